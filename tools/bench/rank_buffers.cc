#include "tools/bench/rank_buffers.h"

#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

namespace refit::bench {

namespace {

using Json = nlohmann::ordered_json;

bool holds(const Layout& layout, Side side, RankSetId set, int32_t rank) {
  const auto& ranks = layout.sets(side).get(set);
  return std::binary_search(ranks.begin(), ranks.end(), rank);
}

Json segment_json(const Region& r, const std::string* tensor) {
  Json seg = Json::object();
  if (tensor != nullptr) seg["tensor"] = *tensor;
  Json start = Json::array(), size = Json::array(), strides = Json::array();
  for (int d = 0; d < r.box.ndim; ++d) {
    start.push_back(r.box.start[d]);
    size.push_back(r.box.size[d]);
    strides.push_back(r.strides[d]);
  }
  seg["start"] = std::move(start);
  seg["size"] = std::move(size);
  seg["offset"] = r.offset;
  seg["strides"] = std::move(strides);
  return seg;
}

}  // namespace

int64_t RankBuffer::covered_bytes(const Layout& layout) const {
  int64_t n = 0;
  const Side side = layout.buffers[index].side;  // a receiver may hold another dtype (docs/conversion.md)
  for (const Placed& p : placed) n += p.region->box.numel() * dtype_bytes(layout.tensors[p.tensor].dtype_on(side));
  return n;
}

Result<std::vector<RankBuffer>> rank_buffers(const Layout& layout, Side side, int32_t rank) {
  if (rank < 0 || rank >= layout.num_ranks(side))
    return Status::invalid(std::string(side_name(side)) + " rank " + std::to_string(rank) + " is not in the layout (it has " +
                           std::to_string(layout.num_ranks(side)) + ")");
  std::map<uint32_t, RankBuffer> by_index;
  for (uint32_t ti = 0; ti < layout.tensors.size(); ++ti) {
    const Tensor& t = layout.tensors[ti];
    for (const Region& r : layout.regions(ti, side)) {
      if (!holds(layout, side, r.ranks, rank)) continue;
      const uint32_t bi = t.buffer_of(side, r);
      RankBuffer& b = by_index[bi];
      if (b.placed.empty()) {
        const Buffer& buf = layout.buffers[bi];
        b.index = bi;
        b.name = buf.name;
        b.dtype = buf.dtype;
        b.bytes = buf.bytes;
      }
      b.placed.push_back({ti, &r});
    }
  }
  std::vector<RankBuffer> out;
  std::set<std::string> names;
  for (auto& [bi, b] : by_index) {
    if (!names.insert(b.name).second)
      return Status::invalid(std::string(side_name(side)) + " rank " + std::to_string(rank) + " has two buffers named \"" +
                             b.name + "\"; the C ABI names a buffer by its name");
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<std::string> source_tensor_jsons(const Layout& layout, const RankBuffer& buffer) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < buffer.placed.size()) {
    const uint32_t ti = buffer.placed[i].tensor;
    const Tensor& t = layout.tensors[ti];
    Json doc = Json::object();
    doc["name"] = t.name;
    doc["dtype"] = std::string(dtype_name(t.dtype));
    doc["shape"] = t.shape;
    doc["buffer"] = buffer.name;
    Json segs = Json::array();
    for (; i < buffer.placed.size() && buffer.placed[i].tensor == ti; ++i)
      segs.push_back(segment_json(*buffer.placed[i].region, nullptr));
    doc["segments"] = std::move(segs);
    out.push_back(doc.dump());
  }
  return out;
}

std::string receiver_buffer_json(const Layout& layout, const RankBuffer& buffer) {
  Json doc = Json::object();
  doc["name"] = buffer.name;
  doc["dtype"] = std::string(dtype_name(buffer.dtype));
  Json segs = Json::array();
  for (const Placed& p : buffer.placed) segs.push_back(segment_json(*p.region, &layout.tensors[p.tensor].name));
  doc["segments"] = std::move(segs);
  return doc.dump();
}

int64_t receiver_payload_bytes(const Layout& layout) {
  int64_t n = 0;
  for (const Tensor& t : layout.tensors)
    for (const Region& r : t.receivers)
      n += r.box.numel() * dtype_bytes(t.dtype_on(Side::kReceiver)) *
           static_cast<int64_t>(layout.receiver_sets.get(r.ranks).size());
  return n;
}

}  // namespace refit::bench
