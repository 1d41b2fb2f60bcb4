#include <algorithm>
#include <map>
#include <optional>
#include <string>

#include "planner/box.h"
#include "planner/conversion.h"
#include "planner/plan.h"

namespace refit {

CopyOrder copy_order(const Box& box, const Region& from, const Region& to) {
  CopyOrder o;
  const int n = box.ndim;
  // Both orders are built an element at a time, the shared one in o.dims
  // itself: copying an array whole right after writing it an element at a
  // time stalls (the stores cannot be forwarded to the wider load), and
  // did twice a call, a fifth of the simulator's walk of a DeepSeek-V3 plan.
  //
  // Dims of one index first: they move no offset, so they may not stand
  // between two dims that merge. The others in the memory order the two
  // regions share, else row-major: the order only groups the same bytes
  // into runs, any order copies them exactly. outer_first is a total order
  // (ties by dim), so any sort gives the same order: o.dims is an
  // insertion sort of the others as they come (no heap, no copy).
  auto outer_first = [&](int a, int b) {
    if (from.strides[a] != from.strides[b]) return from.strides[a] > from.strides[b];
    if (to.strides[a] != to.strides[b]) return to.strides[a] > to.strides[b];
    return a < b;
  };
  std::array<int, kMaxDims> row_major{};
  std::array<int, kMaxDims>& sorted = o.dims;
  int k = 0;
  for (int d = 0; d < n; ++d) {
    if (box.size[d] != 1) continue;
    row_major[k] = sorted[k] = d;
    ++k;
  }
  const int first = k;
  for (int d = 0; d < n; ++d) {
    if (box.size[d] == 1) continue;
    row_major[k] = d;
    int j = k++;
    for (; j > first && outer_first(d, sorted[j - 1]); --j) sorted[j] = sorted[j - 1];
    sorted[j] = d;
  }
  bool shared = true;
  for (int i = first; i < n && shared; ++i) {
    const int d = sorted[i];
    shared = from.strides[d] > 0 && to.strides[d] > 0 &&
             (i == first || to.strides[sorted[i - 1]] >= to.strides[d]);
  }
  if (!shared) {
    for (int i = first; i < n; ++i) o.dims[i] = row_major[i];
  }
  // Merge the innermost dims that are contiguous in both buffers into one run.
  o.outer = n;
  if (n > 0 && from.strides[o.dims[n - 1]] == 1 && to.strides[o.dims[n - 1]] == 1) {
    o.run = box.size[o.dims[n - 1]];
    o.outer = n - 1;
    while (o.outer > 0 && from.strides[o.dims[o.outer - 1]] == o.run && to.strides[o.dims[o.outer - 1]] == o.run) {
      o.run *= box.size[o.dims[o.outer - 1]];
      --o.outer;
    }
  }
  return o;
}

void for_each_copy_group(const Box& box, const Region& from, const Region& to, int elem_bytes,
                         FunctionRef<void(const CopyGroup&)> fn) {
  if (box.empty()) return;
  const int n = box.ndim;
  const CopyOrder o = copy_order(box, from, to);
  int64_t fbase = from.offset, tbase = to.offset;
  for (int d = 0; d < n; ++d) {
    fbase += (box.start[d] - from.box.start[d]) * from.strides[d];
    tbase += (box.start[d] - to.box.start[d]) * to.strides[d];
  }
  // The innermost iterated dim is one group: equal runs at fixed strides. It
  // was not merged into the run, so its runs do not continue each other.
  const int gi = o.outer - 1;
  const int g = gi >= 0 ? o.dims[gi] : -1;
  CopyGroup c;
  c.bytes = o.run * elem_bytes;
  c.count = g >= 0 ? box.size[g] : 1;
  c.from_stride = g >= 0 ? from.strides[g] * elem_bytes : 0;
  c.to_stride = g >= 0 ? to.strides[g] * elem_bytes : 0;
  Index idx{};  // by position in o.dims
  for (;;) {
    int64_t fo = fbase, to_off = tbase;
    for (int i = 0; i < gi; ++i) {
      fo += idx[i] * from.strides[o.dims[i]];
      to_off += idx[i] * to.strides[o.dims[i]];
    }
    c.from_offset = fo * elem_bytes;
    c.to_offset = to_off * elem_bytes;
    fn(c);
    int i = gi - 1;
    while (i >= 0) {
      if (++idx[i] < box.size[o.dims[i]]) break;
      idx[i] = 0;
      --i;
    }
    if (i < 0) break;
  }
}

void for_each_copy(const Box& box, const Region& from, const Region& to, int elem_bytes,
                   FunctionRef<void(int64_t, int64_t, int64_t)> fn) {
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


bool whole_blocks_of(const Box& box, const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block) {
  for (int k = 0; k < 2; ++k) {
    const int d = box.ndim - 2 + k;
    if (box.start[d] % block[k] != 0 || (box.end(d) % block[k] != 0 && box.end(d) != shape[d])) return false;
  }
  return true;
}

// A piece a source converted ("quantize": "source", docs/conversion.md):
// the rank that serves it, its copy in the receivers' dtype and, for
// F8_E4M3, the copy of its blocks' scales.
struct ConvertedPick {
  int32_t rank = 0;
  const Region* data = nullptr;
  const Region* scales = nullptr;
};

bool source_holds(const Layout& L, const Region& r, int32_t rank) {
  const std::vector<int32_t>& s = L.source_sets.get(r.ranks);
  return std::binary_search(s.begin(), s.end(), rank);
}

// The converted copy that holds `box` of `t`, on rank `prefer` (the plan's
// pick for the piece) where it has one, else on the lowest rank that does;
// for F8_E4M3 only a box of whole blocks whose scales the rank holds too.
std::optional<ConvertedPick> converted_holder(const Layout& L, const Tensor& t, const Tensor* scale, const Box& box,
                                              int32_t prefer) {
  if (t.converted_sources.empty()) return std::nullopt;
  if (scale && !whole_blocks_of(box, t.shape, L.weight_block_size)) return std::nullopt;
  const Box blocks = scale ? block_box(box, L.weight_block_size) : Box{};
  auto pick_on = [&](const Region& r, int32_t rank) -> std::optional<ConvertedPick> {
    if (!scale) return ConvertedPick{rank, &r, nullptr};
    for (const Region& sr : scale->converted_sources)
      if (contains(sr.box, blocks) && source_holds(L, sr, rank)) return ConvertedPick{rank, &r, &sr};
    return std::nullopt;
  };
  std::optional<ConvertedPick> best;
  for (const Region& r : t.converted_sources) {
    if (!contains(r.box, box)) continue;
    if (source_holds(L, r, prefer))
      if (auto p = pick_on(r, prefer)) return p;
    for (int32_t rank : L.source_sets.get(r.ranks)) {
      if (best && best->rank <= rank) break;
      if (auto p = pick_on(r, rank)) best = p;
    }
  }
  return best;
}

// `box` grown to the blocks it meets (a cast's block is one element).
Box grown(const Box& box, const std::array<int64_t, 2>& block, const std::vector<int64_t>& shape) {
  Box g = box;
  for (int k = 0; k < 2 && box.ndim >= 2; ++k) {
    const int d = box.ndim - 2 + k;
    g.start[d] = box.start[d] / block[k] * block[k];
    g.size[d] = std::min(shape[d], (box.end(d) + block[k] - 1) / block[k] * block[k]) - g.start[d];
  }
  return g;
}

Box bounding(const Box& a, const Box& b) {
  Box u = a;
  for (int d = 0; d < a.ndim; ++d) {
    u.start[d] = std::min(a.start[d], b.start[d]);
    u.size[d] = std::max(a.end(d), b.end(d)) - u.start[d];
  }
  return u;
}

// A part of a converted unit: a piece, or a piece's whole blocks or the
// rest of it where a source converted its whole blocks. `q` set: pulled
// from that source's converted copy; else from `src` and converted by the
// puller.
struct Part {
  Box box;
  SourcePick src;
  std::optional<ConvertedPick> q;
};

// The unit's parts: each piece whose whole blocks a source converted, cut
// into those blocks (from the copy) and the rest; every other piece whole.
std::vector<Part> unit_parts(const Plan& plan, const Unit& u, const Tensor* scale) {
  const Layout& L = plan.layout();
  const Tensor& t = L.tensors[u.tensor];
  const PullSet& ps = plan.pull_set(u);
  std::vector<Part> parts;
  for (size_t i = 0; i < ps.pieces.size(); ++i) {
    const SourcePick src = plan.source(u, i);
    const Box& box = ps.pieces[i].box;
    if (!scale) {
      parts.push_back({box, src, converted_holder(L, t, nullptr, box, src.rank)});
      continue;
    }
    const BlockSplit split = split_whole_blocks(box, t.shape, L.weight_block_size);
    std::optional<ConvertedPick> q;
    if (!split.whole.empty()) q = converted_holder(L, t, scale, split.whole, src.rank);
    if (!q) {
      parts.push_back({box, src, std::nullopt});
      continue;
    }
    parts.push_back({split.whole, src, q});
    for (const Box& b : split.rest) parts.push_back({b, src, std::nullopt});
  }
  return parts;
}

// The boxes the puller of a unit converts itself: the blocks of each part
// no source converted, merged into one box while two meet (a block two
// parts share is converted once). A converted part that a merged box
// reaches is pulled unconverted and joins it (its `q` cleared). Each part
// left to convert lies in exactly one of the boxes returned; with no part
// converted by a source, the box is the unit's.
std::vector<Box> convert_boxes(const Box& unit, std::vector<Part>& parts, const std::array<int64_t, 2>& block,
                               const std::vector<int64_t>& shape) {
  if (std::none_of(parts.begin(), parts.end(), [](const Part& p) { return p.q.has_value(); })) return {unit};
  std::vector<Box> boxes;
  for (const Part& p : parts)
    if (!p.q) boxes.push_back(grown(p.box, block, shape));
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t a = 0; a < boxes.size() && !changed; ++a) {
      for (size_t b = a + 1; b < boxes.size() && !changed; ++b) {
        if (!overlaps(boxes[a], boxes[b])) continue;
        boxes[a] = bounding(boxes[a], boxes[b]);
        boxes.erase(boxes.begin() + static_cast<std::ptrdiff_t>(b));
        changed = true;
      }
      for (size_t i = 0; i < parts.size() && !changed; ++i) {
        if (!parts[i].q || !overlaps(boxes[a], parts[i].box)) continue;
        parts[i].q.reset();
        boxes[a] = bounding(boxes[a], grown(parts[i].box, block, shape));
        changed = true;
      }
    }
  }
  return boxes;
}

// What convert_unit's steps share about one unit.
struct UnitCtx {
  const Plan& plan;
  const Layout& L;
  const Unit& u;
  const Tensor& t;
  const Consumer& p;    // the puller
  const Region& dst;    // its region of the tensor
  const Tensor* scale;  // F8_E4M3: the scale tensor, else null
  int64_t scale_index;  // its index, or -1
  const Region* puller_scales;  // F8_E4M3: the puller's region of the unit's scales
  Merger& out;
};

// The unit's pieces a source converted: pulled as they are into the
// puller's region, then their blocks' scales into its scale region.
void pull_converted(const UnitCtx& c, const std::vector<Part>& parts) {
  const int reb = dtype_bytes(c.t.dtype_on(Side::kReceiver));
  const int64_t chunk_elems = std::max<int64_t>(1, c.plan.options().chunk_bytes / reb);
  const uint32_t dst_buf = c.t.buffer_of(Side::kReceiver, c.dst);
  for (const Part& part : parts) {
    if (!part.q) continue;
    const ConvertedPick& q = *part.q;
    for (const Box& chunk : split_row_major(part.box, chunk_elems)) {
      for_each_copy_group(chunk, *q.data, c.dst, reb, [&](const CopyGroup& g) {
        c.out.push(Run{false, {Side::kSource, q.rank, q.data->buffer, 0}, {Side::kReceiver, c.p.rank, dst_buf, 0}, 0}, g);
      });
    }
    if (!q.scales) continue;
    const uint32_t sbuf = c.scale->buffer_of(Side::kReceiver, *c.puller_scales);
    for_each_copy_group(block_box(part.box, c.L.weight_block_size), *q.scales, *c.puller_scales, 4,
                        [&](const CopyGroup& g) {
                          c.out.push(Run{false, {Side::kSource, q.rank, q.scales->buffer, 0},
                                         {Side::kReceiver, c.p.rank, sbuf, 0}, 0}, g);
                        });
  }
}

// Box `g` of the unit, which the puller converts: the pieces in it land
// row-major in its staging area, then the conversion step.
Status stage_and_convert(const UnitCtx& c, const Box& g, const std::vector<Part>& parts,
                         std::map<int32_t, int64_t>& staged, const std::function<void(const ConvertStep&)>& on_convert) {
  const int eb = dtype_bytes(c.t.dtype);
  const int64_t chunk_elems = std::max<int64_t>(1, c.plan.options().chunk_bytes / eb);
  const int n = g.ndim;
  ConvertStep step;
  step.rank = c.p.rank;
  step.tensor = c.u.tensor;
  step.box = g;
  int64_t& end = staged[c.p.rank];
  step.stage_offset = end;
  end += (g.numel() * eb + 63) / 64 * 64;
  step.buffer = c.t.buffer_of(Side::kReceiver, c.dst);
  step.offset = element_of(c.dst, g);
  step.strides = c.dst.strides;
  Region stage;
  stage.box = g;
  stage.offset = step.stage_offset / eb;
  int64_t stride = 1;
  for (int d = n - 1; d >= 0; --d) {
    stage.strides[d] = stride;
    stride *= g.size[d];
  }
  if (c.scale) {
    step.scale_tensor = c.scale_index;
    step.scale_buffer = c.scale->buffer_of(Side::kReceiver, *c.puller_scales);
    step.scale_offset = element_of(*c.puller_scales, block_box(g, c.L.weight_block_size));
    step.scale_strides = c.puller_scales->strides;
  }
  for (const Part& part : parts) {
    if (part.q || !contains(g, part.box)) continue;
    const Region& sr = c.t.sources[part.src.region];
    const uint32_t src_buf = c.t.buffer_of(Side::kSource, sr);
    for (const Box& chunk : split_row_major(part.box, chunk_elems)) {
      for_each_copy_group(chunk, sr, stage, eb, [&](const CopyGroup& g) {
        c.out.push(Run{false, {Side::kSource, part.src.rank, src_buf, 0},
                       {Side::kReceiver, c.p.rank, kStagingBuffer, 0}, 0}, g);
      });
    }
  }
  c.out.flush();
  on_convert(step);
  return Status::ok();
}

// The converted unit to its other consumers: the receivers' dtype from the
// puller's region, then the scales of its blocks.
Status fan_out_converted(const UnitCtx& c, const Box& blocks) {
  const Box& box = c.plan.box(c.u);
  const int reb = dtype_bytes(c.t.dtype_on(Side::kReceiver));
  const uint32_t dst_buf = c.t.buffer_of(Side::kReceiver, c.dst);
  for (const Consumer& k : c.plan.consumers(c.u)) {
    if (k.rank == c.p.rank && k.region == c.p.region) continue;
    const Region& kr = c.t.receivers[k.region];
    for_each_copy_group(box, c.dst, kr, reb, [&](const CopyGroup& g) {
      c.out.push(Run{true, {Side::kReceiver, c.p.rank, dst_buf, 0},
                     {Side::kReceiver, k.rank, c.t.buffer_of(Side::kReceiver, kr), 0}, 0}, g);
    });
    if (!c.scale) continue;
    const Region* from = c.puller_scales;
    const Region* to = region_holding(c.L, static_cast<uint32_t>(c.scale_index), k.rank, blocks);
    if (!to) {
      return Status::invalid("receiver rank " + std::to_string(k.rank) + " holds blocks " + box_text(blocks) +
                             " of tensor \"" + c.t.name + "\" but not their scales in \"" + c.scale->name + "\"");
    }
    if (k.rank == c.p.rank && to == from) continue;
    for_each_copy_group(blocks, *from, *to, 4, [&](const CopyGroup& g) {
      c.out.push(Run{true, {Side::kReceiver, c.p.rank, c.scale->buffer_of(Side::kReceiver, *from), 0},
                     {Side::kReceiver, k.rank, c.scale->buffer_of(Side::kReceiver, *to), 0}, 0}, g);
    });
  }
  return Status::ok();
}

// A unit of a tensor converted on the way (docs/conversion.md): the pieces a
// source converted are pulled as they are, the rest staged and converted by
// the puller, then the unit fans out in the receivers' dtype.
Status convert_unit(const Plan& plan, const Unit& u, Merger& out, std::map<int32_t, int64_t>& staged,
                    const std::function<void(const ConvertStep&)>& on_convert) {
  const Layout& L = plan.layout();
  const Tensor& t = L.tensors[u.tensor];
  const Consumer& p = plan.puller(u);
  const Box& box = plan.box(u);
  const int n = box.ndim;
  if (n < 1) return Status::invalid("tensor \"" + t.name + "\": a scalar cannot be converted on the way");
  const bool quantized = t.dtype_on(Side::kReceiver) == DType::kF8E4M3;
  UnitCtx c{plan, L, u, t, p, t.receivers[p.region], nullptr, -1, nullptr, out};
  const Box blocks = quantized && n >= 2 ? block_box(box, L.weight_block_size) : Box{};
  if (quantized) {
    c.scale_index = L.find_tensor(t.name + "_scale_inv");
    if (c.scale_index < 0 || n < 2) {
      return Status::invalid("tensor \"" + t.name + "\" is quantized to F8_E4M3 but the receivers hold no \"" +
                             t.name + "_scale_inv\"");
    }
    for (int k = 0; k < 2; ++k) {
      const int d = n - 2 + k;
      const int64_t b = L.weight_block_size[k];
      if (box.start[d] % b != 0 || (box.end(d) % b != 0 && box.end(d) != t.shape[d])) {
        return Status::invalid("tensor \"" + t.name + "\": the unit " + box_text(box) + " cuts a block of " +
                               std::to_string(L.weight_block_size[0]) + "x" + std::to_string(L.weight_block_size[1]) +
                               " in dim " + std::to_string(d));
      }
    }
    c.scale = &L.tensors[c.scale_index];
    c.puller_scales = region_holding(L, static_cast<uint32_t>(c.scale_index), p.rank, blocks);
    if (!c.puller_scales) {
      return Status::invalid("receiver rank " + std::to_string(p.rank) + " holds blocks " + box_text(blocks) +
                             " of tensor \"" + t.name + "\" but not their scales in \"" + c.scale->name + "\"");
    }
  }
  std::vector<Part> parts = unit_parts(plan, u, c.scale);
  const std::array<int64_t, 2> block = quantized ? L.weight_block_size : std::array<int64_t, 2>{1, 1};
  const std::vector<Box> boxes = convert_boxes(box, parts, block, t.shape);
  pull_converted(c, parts);
  for (const Box& g : boxes) REFIT_RETURN_IF_ERROR(stage_and_convert(c, g, parts, staged, on_convert));
  return fan_out_converted(c, blocks);
}

// Whether the puller of unit `u` (of a tensor the receivers hold in the
// sources' dtype) pulls it through its staging area and relayouts it there
// (PlanOptions::relayout_below_bytes): its direct pull would move runs of
// fewer bytes than that on average, a pull into a row-major staging box
// moves longer ones, the puller's region has a dim of stride 1, and the box
// fits in what its relayouts before left of
// relayout_staging_bytes (`used`, per puller; counted here). The runs are
// counted per piece, before chunking.
bool relayouts(const Plan& plan, const Unit& u, std::map<int32_t, int64_t>& used) {
  const PlanOptions& o = plan.options();
  const Box& box = plan.box(u);
  if (o.relayout_below_bytes <= 0 || box.ndim < 1 || box.empty()) return false;
  const Tensor& t = plan.layout().tensors[u.tensor];
  const int eb = dtype_bytes(t.dtype);
  const Consumer& p = plan.puller(u);
  const Region& dst = t.receivers[p.region];
  // The receiver records what a relayout wrote by runs of its stride-1 dim:
  // without one, a range per element.
  bool unit_stride = false;
  for (int d = 0; d < box.ndim; ++d) unit_stride = unit_stride || (box.size[d] > 1 && dst.strides[d] == 1);
  if (!unit_stride) return false;
  Region stage;
  stage.box = box;
  int64_t stride = 1;
  for (int d = box.ndim - 1; d >= 0; --d) {
    stage.strides[d] = stride;
    stride *= box.size[d];
  }
  const PullSet& ps = plan.pull_set(u);
  int64_t direct = 0, staged_runs = 0;
  for (size_t i = 0; i < ps.pieces.size(); ++i) {
    const Box& piece = ps.pieces[i].box;
    const Region& sr = t.sources[plan.source(u, i).region];
    direct += piece.numel() / copy_order(piece, sr, dst).run;
    staged_runs += piece.numel() / copy_order(piece, sr, stage).run;
  }
  const int64_t bytes = box.numel() * eb;
  if (direct == 0 || bytes / direct >= o.relayout_below_bytes || staged_runs >= direct) return false;
  int64_t& mine = used[p.rank];
  const int64_t need = (bytes + 63) / 64 * 64;
  if (need > o.relayout_staging_bytes - mine) return false;
  mine += need;
  return true;
}

// A unit relayouted by its puller: its pieces land row-major in the
// staging area, the step copies the box into the puller's layout, then the
// unit fans out from the puller's region as a converted one does.
// network_only: the staged network runs alone.
Status relayout_unit(const Plan& plan, const Unit& u, Merger& out, std::map<int32_t, int64_t>& staged,
                     const std::function<void(const ConvertStep&)>& on_convert, bool network_only) {
  const Layout& L = plan.layout();
  const Tensor& t = L.tensors[u.tensor];
  const Consumer& p = plan.puller(u);
  UnitCtx c{plan, L, u, t, p, t.receivers[p.region], nullptr, -1, nullptr, out};
  const PullSet& ps = plan.pull_set(u);
  std::vector<Part> parts;
  parts.reserve(ps.pieces.size());
  for (size_t i = 0; i < ps.pieces.size(); ++i) parts.push_back({ps.pieces[i].box, plan.source(u, i), std::nullopt});
  REFIT_RETURN_IF_ERROR(stage_and_convert(c, plan.box(u), parts, staged, on_convert));
  if (network_only) return Status::ok();
  return fan_out_converted(c, Box{});
}

// network_only: the network runs alone, as the full walk gives them (its
// local runs are not made; where one would follow, the network run before it
// is passed on unmerged, as the local run would have made it).
// pullers: only the units these ranks pull (PullerRange).
Status run_all(const Plan& plan, const std::function<void(const RunGroup&)>& fn,
               const std::function<void(const ConvertStep&)>* on_convert, bool network_only = false,
               PullerRange pullers = {}) {
  const Layout& L = plan.layout();
  Merger m(fn);
  std::map<int32_t, int64_t> staged;  // per puller: its staging area's end
  std::map<int32_t, int64_t> relayout_staged;  // per puller: the part of it its relayouts take
  const std::function<void(const ConvertStep&)> no_step = [](const ConvertStep&) {};
  // A chunk's copy groups into the consumers' regions, by region.
  struct KeptGroups {
    uint32_t region = 0;
    uint32_t begin = 0, end = 0;  // into kept_groups
  };
  constexpr size_t kRegionsKept = 16;
  std::vector<KeptGroups> kept;
  std::vector<CopyGroup> kept_groups;
  for (const Unit& u : plan.units()) {
    if (!pullers.contains(plan.puller(u).rank)) {
      // Its runs would have ended the run before (every one of them has its
      // puller as one of its two ranks): a run never continues across it.
      if (!plan.box(u).empty()) m.flush();
      continue;
    }
    const Tensor& t = L.tensors[u.tensor];
    const bool converted = t.dtype_on(Side::kReceiver) != t.dtype;
    if (on_convert && converted) {
      REFIT_RETURN_IF_ERROR(convert_unit(plan, u, m, staged, *on_convert));
      continue;
    }
    if ((on_convert || network_only) && !converted && relayouts(plan, u, relayout_staged)) {
      REFIT_RETURN_IF_ERROR(relayout_unit(plan, u, m, staged, on_convert ? *on_convert : no_step, network_only));
      continue;
    }
    const int eb = dtype_bytes(t.dtype);
    const int64_t chunk_elems = std::max<int64_t>(1, plan.options().chunk_bytes / eb);
    const Consumer& p = plan.puller(u);
    const Region& dst = t.receivers[p.region];
    const uint32_t dst_buf = t.buffer_of(Side::kReceiver, dst);
    const PullSet& ps = plan.pull_set(u);
    // The consumers' regions are read below, one after another; their
    // loads start together here (on large layouts they are rarely cached).
    if (!network_only)
      for (const Consumer& k : plan.consumers(u)) __builtin_prefetch(&t.receivers[k.region].buffer);

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
        // The copy groups into a region are the same for every consumer
        // that holds it (replicas of a shard share their region): each
        // region's are walked once a chunk, for up to kRegionsKept regions.
        kept.clear();
        kept_groups.clear();
        for (const Consumer& k : plan.consumers(u)) {
          if (k.rank == p.rank && k.region == p.region) continue;
          const Region& kr = t.receivers[k.region];
          const Run local{true, {Side::kReceiver, p.rank, dst_buf, 0}, {Side::kReceiver, k.rank, t.buffer_of(Side::kReceiver, kr), 0}, 0};
          auto same = std::find_if(kept.begin(), kept.end(), [&](const KeptGroups& e) { return e.region == k.region; });
          if (same == kept.end()) {
            if (kept.size() == kRegionsKept) {
              for_each_copy_group(c, dst, kr, eb, [&](const CopyGroup& g) { m.push(local, g); });
              continue;
            }
            const auto begin = static_cast<uint32_t>(kept_groups.size());
            for_each_copy_group(c, dst, kr, eb, [&](const CopyGroup& g) { kept_groups.push_back(g); });
            same = kept.insert(kept.end(), KeptGroups{k.region, begin, static_cast<uint32_t>(kept_groups.size())});
          }
          for (uint32_t i = same->begin; i < same->end; ++i) m.push(local, kept_groups[i]);
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

Status for_each_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn,
                          const std::function<void(const ConvertStep&)>& on_convert, PullerRange pullers) {
  return run_all(plan, fn, &on_convert, /*network_only=*/false, pullers);
}

}  // namespace refit
