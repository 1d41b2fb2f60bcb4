#include "planner/layout.h"

#include <algorithm>
#include <map>

namespace refit {

const char* side_name(Side s) { return s == Side::kSource ? "source" : "receiver"; }

size_t RankSets::Hash::operator()(const std::vector<int32_t>& v) const {
  uint64_t h = 1469598103934665603ull;
  for (int32_t r : v) {
    h ^= static_cast<uint32_t>(r);
    h *= 1099511628211ull;
  }
  return static_cast<size_t>(h ^ v.size());
}

RankSetId RankSets::intern(const std::vector<int32_t>& ranks) {
  auto it = index_.find(ranks);
  if (it != index_.end()) return it->second;
  RankSetId id = static_cast<RankSetId>(sets_.size());
  sets_.push_back(ranks);
  index_.emplace(ranks, id);
  return id;
}

int64_t Tensor::bytes() const {
  int64_t n = dtype_bytes(dtype);
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t Layout::find_tensor(const std::string& name) const {
  if (tensor_index_.size() != tensors.size()) {
    tensor_index_.clear();
    for (size_t i = 0; i < tensors.size(); ++i) tensor_index_.emplace(tensors[i].name, i);
  }
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? -1 : static_cast<int64_t>(it->second);
}

uint32_t Layout::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  Tensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  tensors.push_back(std::move(t));
  return static_cast<uint32_t>(tensors.size() - 1);
}

Index row_major_strides(const std::vector<int64_t>& shape) {
  Index s{};
  int64_t acc = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= shape[d];
  }
  return s;
}

namespace {

// Lowest and highest element offset a region maps to.
void extent(const Region& r, int64_t* lo, int64_t* hi) {
  *lo = r.offset;
  *hi = r.offset;
  for (int d = 0; d < r.box.ndim; ++d) {
    int64_t span = (r.box.size[d] - 1) * r.strides[d];
    if (span < 0) *lo += span; else *hi += span;
  }
}

// Every element offset a region maps to, as sorted half-open intervals,
// scaled by `elem_bytes` (1: elements). Only called for pairs whose extents
// meet, which is rare in real layouts.
std::vector<std::pair<int64_t, int64_t>> footprint(const Region& r, int64_t elem_bytes = 1) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const Box& b = r.box;
  const int n = b.ndim;
  // Innermost run: contiguous when the last dim has stride 1.
  int64_t run = (n > 0 && r.strides[n - 1] == 1) ? b.size[n - 1] : 1;
  int outer = (n > 0 && r.strides[n - 1] == 1) ? n - 1 : n;
  Index idx{};
  for (;;) {
    int64_t off = r.offset;
    for (int d = 0; d < outer; ++d) off += idx[d] * r.strides[d];
    out.emplace_back(off * elem_bytes, (off + run) * elem_bytes);
    int d = outer - 1;
    while (d >= 0) {
      if (++idx[d] < b.size[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

void byte_extent(const Region& r, int elem_bytes, int64_t* lo, int64_t* hi) {
  extent(r, lo, hi);
  *lo *= elem_bytes;
  *hi = (*hi + 1) * elem_bytes;
}

bool regions_meet(const Region& a, int a_bytes, const Region& b, int b_bytes) {
  auto fa = footprint(a, a_bytes);
  auto fb = footprint(b, b_bytes);
  size_t i = 0, j = 0;
  while (i < fa.size() && j < fb.size()) {
    if (std::max(fa[i].first, fb[j].first) < std::min(fa[i].second, fb[j].second)) return true;
    if (fa[i].second < fb[j].second) ++i; else ++j;
  }
  return false;
}

namespace {

// True when no two elements of the region's box map to the same offset.
// Proven cheaply when, taking dims by growing |stride|, each stride exceeds
// the span of the dims before it (every dense or sliced layout); otherwise
// the footprint is enumerated.
bool injective(const Region& r) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size)
  for (int d = 0; d < r.box.ndim; ++d)
    if (r.box.size[d] > 1) dims.push_back({r.strides[d] < 0 ? -r.strides[d] : r.strides[d], r.box.size[d]});
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  bool proven = true;
  for (auto [stride, size] : dims) {
    if (stride == 0) return false;
    if (stride <= span) {
      proven = false;
      break;
    }
    span += stride * (size - 1);
  }
  if (proven) return true;
  auto f = footprint(r);
  for (size_t i = 1; i < f.size(); ++i)
    if (f[i].first < f[i - 1].second) return false;
  return true;
}

bool sets_meet(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) return true;
    if (a[i] < b[j]) ++i; else ++j;
  }
  return false;
}

bool is_subset(const std::vector<int32_t>& small, const std::vector<int32_t>& big) {
  return std::includes(big.begin(), big.end(), small.begin(), small.end());
}

}  // namespace

Status check_region(const Layout& L, const Tensor& t, const Region& r, Side side) {
  const std::string where = std::string(side_name(side)) + " region of tensor \"" + t.name + "\"";
  if (r.box.ndim != static_cast<int>(t.shape.size()))
    return Status::invalid(where + ": box " + r.box.to_string() + " has " + std::to_string(r.box.ndim) +
                           " dims, the tensor has " + std::to_string(t.shape.size()));
  for (int d = 0; d < r.box.ndim; ++d) {
    if (r.box.start[d] < 0 || r.box.size[d] <= 0 || r.box.end(d) > t.shape[d])
      return Status::invalid(where + ": box " + r.box.to_string() + " is empty or outside the shape " +
                             Box::whole(t.shape).to_string());
  }
  const uint64_t bi = uint64_t{t.base(side)} + r.buffer;
  if (bi >= L.buffers.size()) return Status::invalid(where + ": unknown buffer index");
  const Buffer& b = L.buffers[bi];
  if (b.side != side)
    return Status::invalid(where + ": buffer \"" + b.name + "\" belongs to the other side");
  const RankSets& sets = L.sets(side);
  if (r.ranks >= sets.size() || b.ranks >= sets.size()) return Status::invalid(where + ": unknown rank set");
  if (!is_subset(sets.get(r.ranks), sets.get(b.ranks)))
    return Status::invalid(where + ": a rank of the region has no buffer \"" + b.name + "\"");
  // A buffer is bytes: the region's elements are its tensor's, whatever
  // else the buffer holds.
  int64_t lo, hi;
  extent(r, &lo, &hi);
  const int64_t elems = b.bytes / dtype_bytes(t.dtype_on(side));
  if (lo < 0 || hi >= elems)
    return Status::invalid(where + ": box " + r.box.to_string() + " at element offset " +
                           std::to_string(r.offset) + " reaches element " + std::to_string(lo < 0 ? lo : hi) +
                           ", outside buffer \"" + b.name + "\" of " + std::to_string(elems) + " elements");
  if (!injective(r))
    return Status::invalid(where + ": box " + r.box.to_string() + " with its strides maps two elements to the same "
                           "place in buffer \"" + b.name + "\"");
  return Status::ok();
}

Status validate(const Layout& L) {
  for (size_t i = 0; i < L.sources.size(); ++i)
    if (L.sources[i].domain < 0) return Status::invalid("source rank " + std::to_string(i) + ": negative domain");
  for (size_t i = 0; i < L.receivers.size(); ++i)
    if (L.receivers[i].domain < 0 || L.receivers[i].instance < 0)
      return Status::invalid("receiver rank " + std::to_string(i) + ": negative domain or instance");
  for (Side side : {Side::kSource, Side::kReceiver}) {
    const RankSets& sets = L.sets(side);
    for (size_t s = 0; s < sets.size(); ++s) {
      for (int32_t r : sets.get(static_cast<RankSetId>(s)))
        if (r < 0 || r >= L.num_ranks(side))
          return Status::invalid(std::string(side_name(side)) + " rank " + std::to_string(r) +
                                 " is out of range: the layout has " + std::to_string(L.num_ranks(side)) +
                                 " " + side_name(side) + " ranks");
    }
  }
  for (const Buffer& b : L.buffers)
    if (b.bytes < 0 || b.bytes % dtype_bytes(b.dtype) != 0)
      return Status::invalid("buffer \"" + b.name + "\": " + std::to_string(b.bytes) +
                             " bytes is not a whole number of " + std::string(dtype_name(b.dtype)) + " elements");

  // Which tensor references each buffer (kMany: more than one).
  constexpr uint32_t kNone = ~uint32_t{0}, kMany = kNone - 1;
  std::vector<uint32_t> user(L.buffers.size(), kNone);
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    for (Side side : {Side::kSource, Side::kReceiver})
      for (const Region& r : L.regions(ti, side)) {
        const uint64_t bi = uint64_t{t.base(side)} + r.buffer;
        if (bi >= user.size()) continue;  // check_region reports it
        user[bi] = (user[bi] == kNone || user[bi] == ti) ? ti : kMany;
      }
  }

  // A region list shared by several tensors is checked with its first
  // tensor. A later one is the same check again when its buffers match the
  // first one's position by position and no other tensor uses them.
  struct FirstUse {
    uint32_t tensor;
    uint32_t buffers;  // 1 + the largest relative buffer index in the list
  };
  std::unordered_map<const void*, FirstUse> first_use[2];
  auto same_again = [&](uint32_t ti, Side side) {
    const Tensor& t = L.tensors[ti];
    const RegionList& rl = L.regions(ti, side);
    if (rl.empty()) return false;
    auto [it, fresh] = first_use[static_cast<int>(side)].emplace(rl.id(), FirstUse{ti, 0});
    if (fresh) {
      for (const Region& r : rl) it->second.buffers = std::max(it->second.buffers, r.buffer + 1);
      return false;
    }
    const Tensor& f = L.tensors[it->second.tensor];
    if (f.shape != t.shape || f.dtype_on(side) != t.dtype_on(side)) return false;
    for (uint32_t k = 0; k < it->second.buffers; ++k) {
      const uint64_t a = uint64_t{f.base(side)} + k, b = uint64_t{t.base(side)} + k;
      if (a >= L.buffers.size() || b >= L.buffers.size()) return false;
      const Buffer &x = L.buffers[a], &y = L.buffers[b];
      if (x.side != y.side || x.dtype != y.dtype || x.bytes != y.bytes || x.ranks != y.ranks) return false;
      if (user[b] != ti) return false;
    }
    return true;
  };

  // Regions by buffer, for the overlap check.
  struct Entry {
    int64_t lo, hi;
    const Region* region;
    const Tensor* tensor;
  };
  std::vector<std::vector<Entry>> by_buffer(L.buffers.size());
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    if (t.shape.size() > static_cast<size_t>(kMaxDims))
      return Status::invalid("tensor \"" + t.name + "\" has " + std::to_string(t.shape.size()) +
                             " dims; at most " + std::to_string(kMaxDims) + " are supported");
    for (int64_t s : t.shape)
      if (s < 0) return Status::invalid("tensor \"" + t.name + "\" has a negative dim");
    if (t.derived_from >= 0 &&
        (t.derived_from >= static_cast<int64_t>(L.tensors.size()) || !t.sources.empty()))
      return Status::invalid("tensor \"" + t.name + "\" is derived (computed by the receivers) but " +
                             (t.sources.empty() ? "names no tensor it is derived from" : "has sources"));
    for (Side side : {Side::kSource, Side::kReceiver}) {
      if (same_again(ti, side)) continue;
      for (const Region& r : L.regions(ti, side)) {
        REFIT_RETURN_IF_ERROR(check_region(L, t, r, side));
        Entry e{0, 0, &r, &t};
        byte_extent(r, dtype_bytes(t.dtype_on(side)), &e.lo, &e.hi);
        by_buffer[t.base(side) + r.buffer].push_back(e);
      }
    }
  }
  std::vector<RankSetId> distinct;
  std::vector<char> seen;
  for (size_t bi = 0; bi < by_buffer.size(); ++bi) {
    auto& v = by_buffer[bi];
    if (v.size() < 2) continue;
    const RankSets& sets = L.sets(L.buffers[bi].side);
    // Regions of pairwise disjoint rank sets cannot meet: when all the rank
    // sets of a buffer are disjoint (a TP or FSDP shard per rank), only
    // regions of the same set are compared. Otherwise every pair whose
    // extents and rank sets meet.
    distinct.clear();
    for (const Entry& e : v) distinct.push_back(e.region->ranks);
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    bool disjoint = true;
    seen.assign(static_cast<size_t>(L.num_ranks(L.buffers[bi].side)), 0);
    for (RankSetId id : distinct)
      for (int32_t r : sets.get(id)) {
        if (seen[r]) disjoint = false;
        seen[r] = 1;
      }
    std::sort(v.begin(), v.end(), [&](const Entry& a, const Entry& b) {
      if (disjoint && a.region->ranks != b.region->ranks) return a.region->ranks < b.region->ranks;
      return a.lo < b.lo;
    });
    // Sweep: compare each region with the earlier ones whose extent reaches it.
    std::vector<const Entry*> active;
    for (const Entry& e : v) {
      active.erase(std::remove_if(active.begin(), active.end(),
                                  [&](const Entry* a) {
                                    return a->hi <= e.lo || (disjoint && a->region->ranks != e.region->ranks);
                                  }),
                   active.end());
      for (const Entry* a : active) {
        if (!disjoint && !sets_meet(sets.get(a->region->ranks), sets.get(e.region->ranks))) continue;
        if (regions_meet(*a->region, dtype_bytes(a->tensor->dtype_on(L.buffers[bi].side)), *e.region,
                         dtype_bytes(e.tensor->dtype_on(L.buffers[bi].side))))
          return Status::invalid("buffer \"" + L.buffers[bi].name + "\": the segment of tensor \"" + a->tensor->name +
                                 "\" " + a->region->box.to_string() + " and the segment of tensor \"" +
                                 e.tensor->name + "\" " + e.region->box.to_string() + " overlap");
      }
      active.push_back(&e);
    }
  }
  return Status::ok();
}

}  // namespace refit
