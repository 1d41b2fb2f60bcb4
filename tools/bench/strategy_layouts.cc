#include "tools/bench/strategy_layouts.h"

#include <algorithm>
#include <vector>

namespace refit::bench {

namespace {

std::vector<int32_t> needers(const Layout& layout, const Tensor& t) {
  std::vector<int32_t> out;
  for (const Region& r : t.receivers)
    for (int32_t x : layout.receiver_sets.get(r.ranks)) out.push_back(x);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Region whole_region(const Tensor& t, RankSetId ranks, uint32_t buffer) {
  Region r;
  r.box = Box::whole(t.shape);
  r.ranks = ranks;
  r.buffer = buffer;
  r.offset = 0;
  r.strides = row_major_strides(t.shape);
  return r;
}

}  // namespace

std::string scratch_buffer_name(const std::string& tensor) { return "scratch:" + tensor; }

Layout no_dedup_layout(const Layout& layout) {
  Layout out = layout;
  for (size_t r = 0; r < out.receivers.size(); ++r) out.receivers[r].domain = static_cast<int32_t>(r);
  return out;
}

Layout gather_layout(const Layout& layout) {
  // Sources, their buffers and regions stay as they are (buffer indices
  // included); the receivers' are replaced, so their old buffers stay in the
  // list unreferenced.
  Layout out = layout;
  out.receivers = {ReceiverRank{0, 0}};
  out.receiver_sets = RankSets();
  const RankSetId gatherer = out.receiver_sets.intern({0});
  for (Tensor& t : out.tensors) {
    const bool needed = !t.receivers.empty();
    t.receivers.clear();
    t.receiver_base = 0;
    if (!needed) continue;
    const uint32_t b = out.add_buffer({Side::kReceiver, t.name, t.dtype, t.bytes(), gatherer});
    t.receivers.push_back(whole_region(t, gatherer, b));
  }
  return out;
}

Layout spread_layout(const Layout& layout) {
  Layout out;
  out.sources = {SourceRank{0}};
  const RankSetId gatherer = out.source_sets.intern({0});
  out.receivers = layout.receivers;
  for (size_t r = 0; r < out.receivers.size(); ++r) out.receivers[r].domain = static_cast<int32_t>(r);
  for (const Tensor& in : layout.tensors) {
    const uint32_t ti = out.add_tensor(in.name, in.dtype, in.shape);
    Tensor& t = out.tensors[ti];
    const std::vector<int32_t> who = needers(layout, in);
    if (who.empty()) continue;
    const uint32_t sb = out.add_buffer({Side::kSource, t.name, t.dtype, t.bytes(), gatherer});
    t.sources.push_back(whole_region(t, gatherer, sb));
    const RankSetId rs = out.receiver_sets.intern(who);
    const uint32_t rb = out.add_buffer({Side::kReceiver, scratch_buffer_name(t.name), t.dtype, t.bytes(), rs});
    t.receivers.push_back(whole_region(t, rs, rb));
  }
  return out;
}

}  // namespace refit::bench
