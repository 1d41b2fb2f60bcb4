#include <algorithm>
#include <map>
#include <string>

#include "planner/box.h"
#include "planner/plan.h"

namespace refit {

void for_each_copy_group(const Box& box, const Region& from, const Region& to, int elem_bytes,
                         const std::function<void(const CopyGroup&)>& fn) {
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
  // The last iterated dim is one group: equal runs at fixed strides. It was
  // not merged into the run, so its runs do not continue each other.
  const int g = outer - 1;
  CopyGroup c;
  c.bytes = run * elem_bytes;
  c.count = g >= 0 ? box.size[g] : 1;
  c.from_stride = g >= 0 ? from.strides[g] * elem_bytes : 0;
  c.to_stride = g >= 0 ? to.strides[g] * elem_bytes : 0;
  Index idx{};
  for (;;) {
    int64_t fo = fbase, to_off = tbase;
    for (int d = 0; d < g; ++d) {
      fo += idx[d] * from.strides[d];
      to_off += idx[d] * to.strides[d];
    }
    c.from_offset = fo * elem_bytes;
    c.to_offset = to_off * elem_bytes;
    fn(c);
    int d = g - 1;
    while (d >= 0) {
      if (++idx[d] < box.size[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

void for_each_copy(const Box& box, const Region& from, const Region& to, int elem_bytes,
                   const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  for_each_copy_group(box, from, to, elem_bytes, [&](const CopyGroup& c) {
    for (int64_t k = 0; k < c.count; ++k) fn(c.from_offset + k * c.from_stride, c.to_offset + k * c.to_stride, c.bytes);
  });
}

namespace {

bool holds(const Layout& L, const Region& r, int32_t rank) {
  for (int32_t x : L.receiver_sets.get(r.ranks))
    if (x == rank) return true;
  return false;
}

// The region of tensor `ti` that receiver `rank` holds `box` in, or null.
const Region* region_holding(const Layout& L, uint32_t ti, int32_t rank, const Box& box) {
  for (const Region& r : L.tensors[ti].receivers)
    if (contains(r.box, box) && holds(L, r, rank)) return &r;
  return nullptr;
}

int64_t element_of(const Region& r, const Box& box) {
  int64_t off = r.offset;
  for (int d = 0; d < box.ndim; ++d) off += (box.start[d] - r.box.start[d]) * r.strides[d];
  return off;
}

// The box of the scale tensor whose blocks cover `box` (block aligned).
Box block_box(const Box& box, const std::array<int64_t, 2>& block) {
  Box b = box;
  for (int k = 0; k < 2; ++k) {
    const int d = box.ndim - 2 + k;
    b.start[d] = box.start[d] / block[k];
    b.size[d] = (box.start[d] + box.size[d] + block[k] - 1) / block[k] - b.start[d];
  }
  return b;
}

std::string box_text(const Box& b) {
  std::string s = "start [";
  for (int d = 0; d < b.ndim; ++d) s += (d ? ", " : "") + std::to_string(b.start[d]);
  s += "] size [";
  for (int d = 0; d < b.ndim; ++d) s += (d ? ", " : "") + std::to_string(b.size[d]);
  return s + "]";
}

// Adjacent runs that continue each other merge into one (for_each_run),
// over groups: a group's runs never continue each other (for_each_copy_group
// merged such dims into the run), so only the last run of the pending group
// and the first of the next can merge.
class Merger {
 public:
  explicit Merger(const std::function<void(const RunGroup&)>& fn) : fn_(fn) {}
  void push(const RunGroup& g) {
    if (have_ && continues(pending_.at(pending_.count - 1), g.run)) {
      if (pending_.count > 1) {
        RunGroup head = pending_;
        --head.count;
        fn_(head);
        pending_ = RunGroup{pending_.at(pending_.count - 1)};
      }
      pending_.run.bytes += g.run.bytes;
      if (g.count == 1) return;
      fn_(pending_);
      pending_ = g;
      pending_.run = g.at(1);
      --pending_.count;
      return;
    }
    flush();
    pending_ = g;
    have_ = true;
  }
  void push(const Run& r, const CopyGroup& c) {
    RunGroup g{r, c.count, c.from_stride, c.to_stride};
    g.run.from.offset = c.from_offset;
    g.run.to.offset = c.to_offset;
    g.run.bytes = c.bytes;
    push(g);
  }
  void flush() {
    if (have_) fn_(pending_);
    have_ = false;
  }
  bool have() const { return have_; }

 private:
  static bool continues(const Run& a, const Run& b) {
    return a.local == b.local && a.from.side == b.from.side && a.from.rank == b.from.rank &&
           a.from.buffer == b.from.buffer && a.to.rank == b.to.rank && a.to.buffer == b.to.buffer &&
           a.from.offset + a.bytes == b.from.offset && a.to.offset + a.bytes == b.to.offset;
  }
  const std::function<void(const RunGroup&)>& fn_;
  RunGroup pending_;
  bool have_ = false;
};

// network_only: the network runs alone, as the full walk gives them (its
// local runs are not made; where one would follow, the network run before it
// is passed on unmerged, as the local run would have made it).
Status run_all(const Plan& plan, const std::function<void(const RunGroup&)>& fn,
               const std::function<void(const ConvertStep&)>* on_convert, bool network_only = false) {
  const Layout& L = plan.layout();
  Merger m(fn);
  std::map<int32_t, int64_t> staged;  // per puller: its staging area's end
  for (const Unit& u : plan.units()) {
    const Tensor& t = L.tensors[u.tensor];
    const int eb = dtype_bytes(t.dtype);
    const int64_t chunk_elems = std::max<int64_t>(1, plan.options().chunk_bytes / eb);
    const Consumer& p = plan.puller(u);
    const Region& dst = t.receivers[p.region];
    const uint32_t dst_buf = t.buffer_of(Side::kReceiver, dst);
    const PullSet& ps = plan.pull_set(u);
    if (on_convert && t.dtype_on(Side::kReceiver) != t.dtype) {
      // Land in the staging area, convert, then fan out the converted bytes.
      const Box& box = ps.box;
      const int n = box.ndim;
      if (n < 1) return Status::invalid("tensor \"" + t.name + "\": a scalar cannot be converted on the way");
      ConvertStep step;
      step.rank = p.rank;
      step.tensor = u.tensor;
      step.box = box;
      int64_t& end = staged[p.rank];
      step.stage_offset = end;
      end += (box.numel() * eb + 63) / 64 * 64;
      step.buffer = dst_buf;
      step.offset = element_of(dst, box);
      step.strides = dst.strides;
      Region stage;
      stage.box = box;
      stage.offset = step.stage_offset / eb;
      int64_t stride = 1;
      for (int d = n - 1; d >= 0; --d) {
        stage.strides[d] = stride;
        stride *= box.size[d];
      }
      const Tensor* scale = nullptr;
      Box blocks;
      if (t.dtype_on(Side::kReceiver) == DType::kF8E4M3) {
        const int64_t si = L.find_tensor(t.name + "_scale_inv");
        if (si < 0 || n < 2) {
          return Status::invalid("tensor \"" + t.name + "\" is quantized to F8_E4M3 but the receivers hold no \"" +
                                 t.name + "_scale_inv\"");
        }
        for (int k = 0; k < 2; ++k) {
          const int d = n - 2 + k;
          const int64_t b = L.weight_block_size[k];
          if (box.start[d] % b != 0 || ((box.start[d] + box.size[d]) % b != 0 && box.start[d] + box.size[d] != t.shape[d])) {
            return Status::invalid("tensor \"" + t.name + "\": the unit " + box_text(box) + " cuts a block of " +
                                   std::to_string(L.weight_block_size[0]) + "x" + std::to_string(L.weight_block_size[1]) +
                                   " in dim " + std::to_string(d));
          }
        }
        scale = &L.tensors[si];
        step.scale_tensor = si;
        blocks = block_box(box, L.weight_block_size);
        const Region* sr = region_holding(L, static_cast<uint32_t>(si), p.rank, blocks);
        if (!sr) {
          return Status::invalid("receiver rank " + std::to_string(p.rank) + " holds blocks " + box_text(blocks) +
                                 " of tensor \"" + t.name + "\" but not their scales in \"" + scale->name + "\"");
        }
        step.scale_buffer = scale->buffer_of(Side::kReceiver, *sr);
        step.scale_offset = element_of(*sr, blocks);
        step.scale_strides = sr->strides;
      }
      for (size_t i = 0; i < ps.pieces.size(); ++i) {
        const SourcePick src = plan.source(u, i);
        const Region& sr = t.sources[src.region];
        const uint32_t src_buf = t.buffer_of(Side::kSource, sr);
        for (const Box& c : split_row_major(ps.pieces[i].box, chunk_elems)) {
          for_each_copy_group(c, sr, stage, eb, [&](const CopyGroup& g) {
            m.push(Run{false, {Side::kSource, src.rank, src_buf, 0}, {Side::kReceiver, p.rank, kStagingBuffer, 0}, 0}, g);
          });
        }
      }
      m.flush();
      (*on_convert)(step);
      const int reb = dtype_bytes(t.dtype_on(Side::kReceiver));
      for (const Consumer& k : plan.consumers(u)) {
        if (k.rank == p.rank && k.region == p.region) continue;
        const Region& kr = t.receivers[k.region];
        for_each_copy_group(box, dst, kr, reb, [&](const CopyGroup& g) {
          m.push(Run{true, {Side::kReceiver, p.rank, dst_buf, 0}, {Side::kReceiver, k.rank, t.buffer_of(Side::kReceiver, kr), 0}, 0},
                 g);
        });
        if (!scale) continue;
        const Region* from = region_holding(L, static_cast<uint32_t>(step.scale_tensor), p.rank, blocks);
        const Region* to = region_holding(L, static_cast<uint32_t>(step.scale_tensor), k.rank, blocks);
        if (!to) {
          return Status::invalid("receiver rank " + std::to_string(k.rank) + " holds blocks " + box_text(blocks) +
                                 " of tensor \"" + t.name + "\" but not their scales in \"" + scale->name + "\"");
        }
        if (k.rank == p.rank && to == from) continue;
        for_each_copy_group(blocks, *from, *to, 4, [&](const CopyGroup& g) {
          m.push(Run{true, {Side::kReceiver, p.rank, scale->buffer_of(Side::kReceiver, *from), 0},
                     {Side::kReceiver, k.rank, scale->buffer_of(Side::kReceiver, *to), 0}, 0},
                 g);
        });
      }
      continue;
    }
    for (size_t i = 0; i < ps.pieces.size(); ++i) {
      const SourcePick src = plan.source(u, i);
      const Region& sr = t.sources[src.region];
      const uint32_t src_buf = t.buffer_of(Side::kSource, sr);
      for (const Box& c : split_row_major(ps.pieces[i].box, chunk_elems)) {
        for_each_copy_group(c, sr, dst, eb, [&](const CopyGroup& g) {
          m.push(Run{false, {Side::kSource, src.rank, src_buf, 0}, {Side::kReceiver, p.rank, dst_buf, 0}, 0}, g);
        });
        if (network_only) {
          if (plan.consumers(u).size() > 1) m.flush();
          continue;
        }
        for (const Consumer& k : plan.consumers(u)) {
          if (k.rank == p.rank && k.region == p.region) continue;
          const Region& kr = t.receivers[k.region];
          for_each_copy_group(c, dst, kr, eb, [&](const CopyGroup& g) {
            m.push(Run{true, {Side::kReceiver, p.rank, dst_buf, 0}, {Side::kReceiver, k.rank, t.buffer_of(Side::kReceiver, kr), 0}, 0},
                   g);
          });
        }
      }
    }
  }
  m.flush();
  return Status::ok();
}

// Each run of a group, in order.
std::function<void(const RunGroup&)> expand(const std::function<void(const Run&)>& fn) {
  return [&fn](const RunGroup& g) {
    for (int64_t k = 0; k < g.count; ++k) fn(g.at(k));
  };
}

}  // namespace

Run RunGroup::at(int64_t k) const {
  Run r = run;
  r.from.offset += k * from_stride;
  r.to.offset += k * to_stride;
  return r;
}

void for_each_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn) {
  (void)run_all(plan, fn, nullptr);
}

void for_each_network_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn) {
  (void)run_all(plan, fn, nullptr, /*network_only=*/true);
}

void for_each_run(const Plan& plan, const std::function<void(const Run&)>& fn) {
  (void)run_all(plan, expand(fn), nullptr);
}

void for_each_network_run(const Plan& plan, const std::function<void(const Run&)>& fn) {
  (void)run_all(plan, expand(fn), nullptr, /*network_only=*/true);
}

Status for_each_run(const Plan& plan, const std::function<void(const Run&)>& fn,
                    const std::function<void(const ConvertStep&)>& on_convert) {
  return run_all(plan, expand(fn), &on_convert);
}

}  // namespace refit
