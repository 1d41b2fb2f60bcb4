#include "planner/placement.h"

#include <algorithm>
#include <charconv>
#include <map>

namespace refit {
namespace {

bool parse_int(std::string_view s, int* out) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

// One ordered step of sharding: mesh dim `mesh_dim` cuts tensor dim `dim`.
struct Step {
  int mesh_dim;
  int dim;
};

}  // namespace

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kStridedShard: return "SS(" + std::to_string(dim) + "," + std::to_string(split_factor) + ")";
  }
  return "?";
}

Result<Placement> parse_placement(std::string_view text) {
  Placement p;
  const std::string quoted = "placement \"" + std::string(text) + "\"";
  if (text == "R") return p;
  if (text == "P" || text.substr(0, 7) == "Partial")
    return Status::invalid(quoted + ": Partial tensors cannot be published; reduce them first");
  auto inside = [&](std::string_view prefix) -> std::optional<std::string_view> {
    if (text.size() < prefix.size() + 2 || text.substr(0, prefix.size()) != prefix || text[prefix.size()] != '(' ||
        text.back() != ')')
      return std::nullopt;
    return text.substr(prefix.size() + 1, text.size() - prefix.size() - 2);
  };
  if (auto arg = inside("SS")) {
    size_t comma = arg->find(',');
    if (comma == std::string_view::npos || !parse_int(arg->substr(0, comma), &p.dim) ||
        !parse_int(arg->substr(comma + 1), &p.split_factor))
      return Status::invalid(quoted + ": expected SS(dim,split_factor)");
    if (p.dim < 0 || p.split_factor < 1)
      return Status::invalid(quoted + ": dim must be >= 0 and split_factor >= 1");
    p.kind = Placement::Kind::kStridedShard;
    return p;
  }
  if (auto arg = inside("S")) {
    if (!parse_int(*arg, &p.dim) || p.dim < 0) return Status::invalid(quoted + ": expected S(dim) with dim >= 0");
    p.kind = Placement::Kind::kShard;
    return p;
  }
  return Status::invalid(quoted + ": expected \"R\", \"S(d)\" or \"SS(d,k)\"");
}

Result<std::vector<Box>> dtensor_boxes(const std::vector<int64_t>& shape, const DTensorSpec& spec) {
  const int nd = static_cast<int>(shape.size());
  const int nm = static_cast<int>(spec.mesh.size());
  if (nm == 0) return Status::invalid("mesh is empty");
  if (static_cast<int>(spec.placements.size()) != nm)
    return Status::invalid("placements has " + std::to_string(spec.placements.size()) + " entries for a mesh of " +
                           std::to_string(nm) + " dims");
  int64_t mesh_size = 1;
  for (int64_t m : spec.mesh) {
    if (m < 1) return Status::invalid("mesh dims must be >= 1");
    mesh_size *= m;
    if (mesh_size > (int64_t{1} << 24)) return Status::invalid("mesh is too large");
  }
  if (static_cast<int64_t>(spec.ranks.size()) != mesh_size)
    return Status::invalid("ranks lists " + std::to_string(spec.ranks.size()) + " ranks for a mesh of " +
                           std::to_string(mesh_size));

  // The sharding order of _explicit_order_placements: a strided shard waits
  // for the next plain shard of its dim and then follows it, innermost
  // (latest mesh dim) first.
  std::vector<Step> order;
  std::map<int, std::vector<int>> deferred;  // tensor dim -> strided mesh dims
  std::vector<bool> strided_ended(nd, false);
  for (int m = 0; m < nm; ++m) {
    const Placement& p = spec.placements[m];
    if (p.kind == Placement::Kind::kReplicate) continue;
    if (p.dim >= nd)
      return Status::invalid("placement " + p.to_string() + " on mesh dim " + std::to_string(m) +
                             " shards dim " + std::to_string(p.dim) + " of a " + std::to_string(nd) + "-dim tensor");
    if (p.kind == Placement::Kind::kStridedShard) {
      deferred[p.dim].push_back(m);
      continue;
    }
    if (strided_ended[p.dim])
      return Status::invalid("placement " + p.to_string() + " on mesh dim " + std::to_string(m) +
                             " follows the end of a strided shard of the same dim");
    order.push_back({m, p.dim});
    auto it = deferred.find(p.dim);
    if (it != deferred.end()) {
      strided_ended[p.dim] = true;
      int64_t aggregate = spec.mesh[m];
      std::vector<int>& ms = it->second;
      while (!ms.empty()) {
        int sm = ms.back();
        ms.pop_back();
        const Placement& sp = spec.placements[sm];
        if (sp.split_factor != aggregate)
          return Status::invalid("placement " + sp.to_string() + " on mesh dim " + std::to_string(sm) +
                                 ": split_factor must equal the product of the later mesh sizes sharding dim " +
                                 std::to_string(sp.dim) + " (" + std::to_string(aggregate) + ")");
        aggregate *= spec.mesh[sm];
        order.push_back({sm, p.dim});
      }
      deferred.erase(it);
    }
  }
  if (!deferred.empty()) {
    int sm = deferred.begin()->second.front();
    return Status::invalid("placement " + spec.placements[sm].to_string() + " on mesh dim " + std::to_string(sm) +
                           " has no later S(" + std::to_string(deferred.begin()->first) + ") to pair with");
  }

  std::vector<Box> boxes(mesh_size);
  std::vector<int64_t> coord(nm, 0);
  for (int64_t i = 0; i < mesh_size; ++i) {
    Box b = Box::whole(shape);
    for (const Step& s : order) {
      const int64_t k = spec.mesh[s.mesh_dim];
      const int64_t n = b.size[s.dim];
      const int64_t chunk = (n + k - 1) / k;
      const int64_t lo = std::min(coord[s.mesh_dim] * chunk, n);
      const int64_t hi = std::min(lo + chunk, n);
      b.start[s.dim] += lo;
      b.size[s.dim] = hi - lo;
    }
    boxes[i] = b;
    for (int m = nm - 1; m >= 0; --m) {
      if (++coord[m] < spec.mesh[m]) break;
      coord[m] = 0;
    }
  }
  return boxes;
}

Status add_dtensor(Layout& layout, uint32_t tensor, Side side, const DTensorSpec& spec,
                   const std::string& buffer_name) {
  const Tensor& t = layout.tensors[tensor];
  auto boxes = dtensor_boxes(t.shape, spec);
  if (!boxes) return boxes.status();
  const int32_t nranks = layout.num_ranks(side);
  std::vector<int32_t> seen;
  for (int32_t r : spec.ranks) {
    if (r < 0 || r >= nranks)
      return Status::invalid(std::string(side_name(side)) + " rank " + std::to_string(r) +
                             " is out of range: the layout has " + std::to_string(nranks) + " " + side_name(side) +
                             " ranks");
    seen.push_back(r);
  }
  std::sort(seen.begin(), seen.end());
  if (auto it = std::adjacent_find(seen.begin(), seen.end()); it != seen.end())
    return Status::invalid(std::string(side_name(side)) + " rank " + std::to_string(*it) +
                           " appears twice in the mesh");
  // Group ranks by box, in order of first appearance for determinism.
  std::vector<std::pair<Box, std::vector<int32_t>>> groups;
  std::map<Box, size_t> group_of;
  for (size_t i = 0; i < boxes->size(); ++i) {
    const Box& b = (*boxes)[i];
    if (b.empty()) continue;
    auto [it, inserted] = group_of.emplace(b, groups.size());
    if (inserted) groups.push_back({b, {}});
    groups[it->second].second.push_back(spec.ranks[i]);
  }
  const DType dtype = t.dtype;
  for (auto& [box, ranks] : groups) {
    std::sort(ranks.begin(), ranks.end());
    RankSetId set = layout.sets(side).intern(ranks);
    std::vector<int64_t> local(box.size.begin(), box.size.begin() + box.ndim);
    Buffer buf{side, buffer_name, dtype, box.numel() * dtype_bytes(dtype), set};
    uint32_t bi = layout.add_buffer(std::move(buf));
    Region r;
    r.box = box;
    r.ranks = set;
    r.buffer = bi;
    r.offset = 0;
    r.strides = row_major_strides(local);
    layout.regions(tensor, side).push_back(r);
  }
  return Status::ok();
}

}  // namespace refit
