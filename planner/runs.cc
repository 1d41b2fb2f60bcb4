#include <algorithm>

#include "planner/box.h"
#include "planner/plan.h"

namespace refit {

void for_each_copy(const Box& box, const Region& from, const Region& to, int elem_bytes,
                   const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (box.empty()) return;
  const int n = box.ndim;
  // Merge trailing dims that are contiguous in both buffers into one run.
  int64_t run = 1;
  int outer = n;  // dims [0, outer) are iterated, [outer, n) form the run
  if (n > 0 && from.strides[n - 1] == 1 && to.strides[n - 1] == 1) {
    run = box.size[n - 1];
    outer = n - 1;
    while (outer > 0 && from.strides[outer - 1] == run && to.strides[outer - 1] == run) {
      run *= box.size[outer - 1];
      --outer;
    }
  }
  int64_t fbase = from.offset, tbase = to.offset;
  for (int d = 0; d < n; ++d) {
    fbase += (box.start[d] - from.box.start[d]) * from.strides[d];
    tbase += (box.start[d] - to.box.start[d]) * to.strides[d];
  }
  Index idx{};
  for (;;) {
    int64_t fo = fbase, to_off = tbase;
    for (int d = 0; d < outer; ++d) {
      fo += idx[d] * from.strides[d];
      to_off += idx[d] * to.strides[d];
    }
    fn(fo * elem_bytes, to_off * elem_bytes, run * elem_bytes);
    int d = outer - 1;
    while (d >= 0) {
      if (++idx[d] < box.size[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

void for_each_run(const Plan& plan, const std::function<void(const Run&)>& fn) {
  const Layout& L = plan.layout();
  bool have = false;
  Run pending;
  auto push = [&](const Run& r) {
    if (have && pending.local == r.local && pending.from.side == r.from.side && pending.from.rank == r.from.rank &&
        pending.from.buffer == r.from.buffer && pending.to.rank == r.to.rank && pending.to.buffer == r.to.buffer &&
        pending.from.offset + pending.bytes == r.from.offset && pending.to.offset + pending.bytes == r.to.offset) {
      pending.bytes += r.bytes;
      return;
    }
    if (have) fn(pending);
    pending = r;
    have = true;
  };
  for (const Unit& u : plan.units()) {
    const Tensor& t = L.tensors[u.tensor];
    const int eb = dtype_bytes(t.dtype);
    const int64_t chunk_elems = std::max<int64_t>(1, plan.options().chunk_bytes / eb);
    const Consumer& p = plan.puller(u);
    const Region& dst = t.receivers[p.region];
    const uint32_t dst_buf = t.buffer_of(Side::kReceiver, dst);
    const PullSet& ps = plan.pull_set(u);
    for (size_t i = 0; i < ps.pieces.size(); ++i) {
      const SourcePick src = plan.source(u, i);
      const Region& sr = t.sources[src.region];
      const uint32_t src_buf = t.buffer_of(Side::kSource, sr);
      for (const Box& c : split_row_major(ps.pieces[i].box, chunk_elems)) {
        for_each_copy(c, sr, dst, eb, [&](int64_t fo, int64_t to, int64_t bytes) {
          push(Run{false, {Side::kSource, src.rank, src_buf, fo}, {Side::kReceiver, p.rank, dst_buf, to}, bytes});
        });
        for (const Consumer& k : plan.consumers(u)) {
          if (k.rank == p.rank && k.region == p.region) continue;
          const Region& kr = t.receivers[k.region];
          for_each_copy(c, dst, kr, eb, [&](int64_t fo, int64_t to, int64_t bytes) {
            push(Run{true, {Side::kReceiver, p.rank, dst_buf, fo},
                     {Side::kReceiver, k.rank, t.buffer_of(Side::kReceiver, kr), to}, bytes});
          });
        }
      }
    }
  }
  if (have) fn(pending);
}

}  // namespace refit
