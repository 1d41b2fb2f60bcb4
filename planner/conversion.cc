#include "planner/conversion.h"

#include <algorithm>

namespace refit {
namespace {

bool is_float(DType t) { return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32; }

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

std::string block_text(const std::array<int64_t, 2>& b) {
  return std::to_string(b[0]) + "x" + std::to_string(b[1]);
}

// Blocks of `block` over the last two dims that `box` meets, times its
// leading dims' elements.
int64_t blocks_of(const Box& box, const std::array<int64_t, 2>& block) {
  int64_t n = 1;
  for (int d = 0; d < box.ndim; ++d) {
    const int k = d - (box.ndim - 2);
    if (k < 0) {
      n *= box.size[d];
    } else {
      const int64_t b = block[k];
      n *= (box.end(d) - 1) / b - box.start[d] / b + 1;
    }
  }
  return n;
}

// Whether `box` holds whole blocks only: in the last two dims it starts on a
// block boundary and ends on one or at the tensor's edge.
bool whole_blocks(const Box& box, const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block, int* bad_dim) {
  for (int k = 0; k < 2; ++k) {
    const int d = box.ndim - 2 + k;
    const int64_t b = block[k];
    if (box.start[d] % b != 0 || (box.end(d) % b != 0 && box.end(d) != shape[d])) {
      if (bad_dim) *bad_dim = d;
      return false;
    }
  }
  return true;
}

// The block box (in the scale tensor's index space) of a box of whole blocks.
Box scale_box(const Box& box, const std::array<int64_t, 2>& block) {
  Box s = box;
  for (int k = 0; k < 2; ++k) {
    const int d = box.ndim - 2 + k;
    const int64_t b = block[k];
    s.start[d] = box.start[d] / b;
    s.size[d] = (box.end(d) + b - 1) / b - s.start[d];
  }
  return s;
}

Status check_quantized(Layout& L, uint32_t ti) {
  const Tensor& t = L.tensors[ti];
  const std::array<int64_t, 2>& block = L.weight_block_size;
  const std::string what = "tensor " + quoted(t.name) + " (" + std::string(dtype_name(t.dtype)) + " on the sources, " +
                           std::string(dtype_name(t.dtype_on(Side::kReceiver))) + " on the receivers)";
  if (t.shape.size() < 2)
    return Status::invalid(what + ": F8_E4M3 block scales need at least 2 dims, the tensor has " +
                           std::to_string(t.shape.size()));
  if (block[0] <= 0 || block[1] <= 0)
    return Status::invalid(what + ": weight_block_size " + block_text(block) + " is not positive");
  const std::string sname = scale_tensor_name(t.name);
  const int64_t si = L.find_tensor(sname);
  if (si < 0 || L.tensors[si].receivers.empty())
    return Status::invalid(what + ": its scale tensor " + quoted(sname) + " is missing on the receivers; " +
                           "an F8_E4M3 weight lands with its block scales or not at all");
  Tensor& s = L.tensors[si];
  const std::vector<int64_t> want = scale_shape(t.shape, block);
  if (s.dtype_on(Side::kReceiver) != DType::kF32 || s.shape != want) {
    std::string ws, gs;
    for (int64_t x : want) ws += (ws.empty() ? "" : ", ") + std::to_string(x);
    for (int64_t x : s.shape) gs += (gs.empty() ? "" : ", ") + std::to_string(x);
    return Status::invalid(what + ": its scale tensor " + quoted(sname) + " is " +
                           std::string(dtype_name(s.dtype_on(Side::kReceiver))) + " [" + gs + "], expected F32 [" + ws +
                           "] for blocks of " + block_text(block));
  }
  // A scale tensor's source segments are the scales a source computed with
  // its quantized copies ("quantize": "source"): converted sources too.
  if (!s.sources.empty() && !t.converted_sources.empty()) {
    for (Region r : s.sources) {
      r.buffer += s.source_base;
      s.converted_sources.push_back(r);
    }
    s.sources.clear();
    s.converted_dtype = DType::kF32;
  }
  if (!s.sources.empty())
    return Status::invalid(what + ": its scale tensor " + quoted(sname) +
                           " has sources, but the sources hold the weight unquantized; refit computes the scales");
  s.derived_from = ti;

  for (const Region& r : t.receivers) {
    const int32_t rank = L.receiver_sets.get(r.ranks).front();
    int d = 0;
    if (!whole_blocks(r.box, t.shape, block, &d)) {
      const int k = d - (r.box.ndim - 2);
      const int64_t b = block[k];
      const int64_t cut = r.box.start[d] % b != 0 ? r.box.start[d] : r.box.end(d);
      const int64_t bi = cut / b;
      return Status::invalid("receiver region of " + what + " on receiver rank " + std::to_string(rank) + ": box " +
                             r.box.to_string() + " cuts block " + std::to_string(bi) + " of dim " + std::to_string(d) +
                             " (elements " + std::to_string(bi * b) + " to " +
                             std::to_string(std::min(bi * b + b, t.shape[d])) + ", blocks of " + block_text(block) +
                             "): a receiver must hold whole blocks, as vLLM requires of an FP8 shard");
    }
    // Every rank of the region holds the scales of its blocks.
    const Box sb = scale_box(r.box, block);
    std::vector<int32_t> covered;
    for (const Region& sr : s.receivers) {
      if (!contains(sr.box, sb)) continue;
      const auto& rs = L.receiver_sets.get(sr.ranks);
      covered.insert(covered.end(), rs.begin(), rs.end());
    }
    std::sort(covered.begin(), covered.end());
    for (int32_t x : L.receiver_sets.get(r.ranks)) {
      if (!std::binary_search(covered.begin(), covered.end(), x))
        return Status::invalid("receiver rank " + std::to_string(x) + " holds " + r.box.to_string() + " of " + what +
                               " but not its scales " + sb.to_string() + " of " + quoted(sname));
    }
  }
  return Status::ok();
}

// Whether every rank of `ranks` (source side) holds a region of `list`
// whose box is `box`.
bool every_rank_holds(const Layout& L, const RegionList& list, RankSetId ranks, const Box& box) {
  for (int32_t x : L.source_sets.get(ranks)) {
    bool found = false;
    for (const Region& r : list) {
      if (!(r.box == box)) continue;
      const std::vector<int32_t>& rs = L.source_sets.get(r.ranks);
      found = found || std::binary_search(rs.begin(), rs.end(), x);
    }
    if (!found) return false;
  }
  return true;
}

// The sources' converted copies of tensor `ti` ("quantize": "source",
// docs/conversion.md) that a plan may read: of the receivers' dtype; for
// F8_E4M3, whole blocks of the layout's block whose ranks also hold exactly
// those blocks' scales. A copy made for another block or dtype (the
// receivers changed since the source made it) is dropped: the tensor then
// travels unconverted and the receiver converts it. A copy outside its
// buffer or tensor is refused, naming the tensor.
Status keep_converted(Layout& L, uint32_t ti) {
  Tensor& t = L.tensors[ti];
  if (t.converted_sources.empty()) return Status::ok();
  const DType to = t.dtype_on(Side::kReceiver);
  const bool quantized = to == DType::kF8E4M3 && t.dtype != to;
  Tensor* scales = nullptr;
  if (quantized) {
    const int64_t si = L.find_tensor(scale_tensor_name(t.name));
    if (si >= 0 && L.tensors[si].derived_from == ti) scales = &L.tensors[si];
  }
  auto checked = [&L](const Tensor& of, DType dtype, const Region& r) {
    Tensor view;  // the region's elements are `dtype`, its buffer index absolute
    view.name = of.name + " (a source's converted copy)";
    view.dtype = dtype;
    view.shape = of.shape;
    return check_region(L, view, r, Side::kSource);
  };
  RegionList kept_scales;
  if (scales) {
    for (const Region& r : scales->converted_sources)
      if (checked(*scales, DType::kF32, r).is_ok()) kept_scales.push_back(r);
  }
  RegionList kept;
  if (t.converted_dtype == to && t.dtype != to) {
    for (const Region& r : t.converted_sources) {
      REFIT_RETURN_IF_ERROR(checked(t, to, r));
      if (quantized && (!scales || !whole_blocks(r.box, t.shape, L.weight_block_size, nullptr) ||
                        !every_rank_holds(L, kept_scales, r.ranks, scale_box(r.box, L.weight_block_size))))
        continue;
      kept.push_back(r);
    }
  }
  t.converted_sources = kept.empty() ? RegionList() : kept;
  if (scales) scales->converted_sources = kept.empty() ? RegionList() : kept_scales;
  return Status::ok();
}

}  // namespace

Result<ConversionKind> conversion_for(const std::string& tensor, DType from, DType to) {
  if (from == to) return ConversionKind::kNone;
  const std::string what = "tensor " + quoted(tensor) + ": " + std::string(dtype_name(from)) + " on the sources, " +
                           std::string(dtype_name(to)) + " on the receivers";
  if ((from == DType::kF32 && (to == DType::kBF16 || to == DType::kF16)) || (from == DType::kBF16 && to == DType::kF16))
    return ConversionKind::kCast;
  if ((from == DType::kBF16 || from == DType::kF32) && to == DType::kF8E4M3) return ConversionKind::kQuantizeE4M3;
  if (from == DType::kF8E4M3 || from == DType::kF8E5M2)
    return Status::unsupported(what + ": refit does not dequantize FP8 (it would need the block scales); "
                               "send the weight in the receivers' dtype, or BF16/F32 to quantize on the way");
  if (!is_float(from) || !is_float(to))
    return Status::unsupported(what + ": refit converts floating-point dtypes only (F32 to BF16 or F16, BF16 to "
                               "F16, BF16 or F32 to F8_E4M3); an integer or BOOL tensor must match on both sides");
  return Status::unsupported(what + ": not a conversion refit does (F32 to BF16 or F16, BF16 to F16, "
                             "BF16 or F32 to F8_E4M3 with block scales)");
}

std::string scale_tensor_name(const std::string& weight) { return weight + "_scale_inv"; }

std::vector<int64_t> scale_shape(const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block) {
  std::vector<int64_t> s = shape;
  if (s.size() < 2 || block[0] <= 0 || block[1] <= 0) return s;
  s[s.size() - 2] = (s[s.size() - 2] + block[0] - 1) / block[0];
  s[s.size() - 1] = (s[s.size() - 1] + block[1] - 1) / block[1];
  return s;
}

IndexBox scale_box_of(const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                      const std::array<int64_t, 2>& block) {
  IndexBox b{start, size};
  const size_t n = start.size();
  if (n < 2 || size.size() != n || block[0] <= 0 || block[1] <= 0) return b;
  for (size_t k = 0; k < 2; ++k) {
    const size_t d = n - 2 + k;
    b.start[d] = start[d] / block[k];
    b.size[d] = (start[d] + size[d] + block[k] - 1) / block[k] - b.start[d];
  }
  return b;
}

BlockSplit split_whole_blocks(const Box& box, const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block) {
  BlockSplit out;
  out.whole = box;
  out.whole.size.fill(0);  // no whole block until found
  const int n = box.ndim;
  if (n < 2) {
    out.rest.push_back(box);
    return out;
  }
  Box w = box;
  for (int k = 0; k < 2; ++k) {
    const int d = n - 2 + k;
    const int64_t lo = (box.start[d] + block[k] - 1) / block[k] * block[k];
    const int64_t hi = box.end(d) == shape[d] ? box.end(d) : box.end(d) / block[k] * block[k];
    if (hi <= lo) {
      out.rest.push_back(box);
      return out;
    }
    w.start[d] = lo;
    w.size[d] = hi - lo;
  }
  out.whole = w;
  const int r = n - 2, c = n - 1;
  auto slab = [&](int d, int64_t lo, int64_t hi, const Box& from) {
    if (hi <= lo) return;
    Box b = from;
    b.start[d] = lo;
    b.size[d] = hi - lo;
    out.rest.push_back(b);
  };
  slab(r, box.start[r], w.start[r], box);  // rows above
  slab(r, w.end(r), box.end(r), box);      // rows below
  Box mid = box;
  mid.start[r] = w.start[r];
  mid.size[r] = w.size[r];
  slab(c, box.start[c], w.start[c], mid);  // columns left, beside `whole`
  slab(c, w.end(c), box.end(c), mid);      // columns right
  return out;
}

bool has_conversions(const Layout& L) {
  for (const Tensor& t : L.tensors)
    if (t.dtype_on(Side::kReceiver) != t.dtype) return true;
  return false;
}

Status resolve_conversions(Layout& L) {
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    if (t.derived_from >= 0) continue;
    auto kind = conversion_for(t.name, t.dtype, t.dtype_on(Side::kReceiver));
    if (!kind) return kind.status();
    if (*kind == ConversionKind::kQuantizeE4M3) REFIT_RETURN_IF_ERROR(check_quantized(L, ti));
    REFIT_RETURN_IF_ERROR(keep_converted(L, ti));
  }
  return validate(L);
}

Result<Layout> join_sides(Layout&& S, Layout&& R) {
  for (const Tensor& t : S.tensors)
    if (!t.receivers.empty()) return Status::internal("join_sides: the sources' layout has receivers");
  for (const Tensor& t : R.tensors)
    if (!t.sources.empty()) return Status::internal("join_sides: the receivers' layout has sources");
  Layout L;
  L.sources = std::move(S.sources);
  L.receivers = std::move(R.receivers);
  L.source_sets = std::move(S.source_sets);
  L.receiver_sets = std::move(R.receiver_sets);
  L.weight_block_size = R.weight_block_size;
  const uint32_t shift = static_cast<uint32_t>(R.buffers.size());
  L.buffers = std::move(R.buffers);
  for (Buffer& b : S.buffers) L.buffers.push_back(std::move(b));
  std::vector<std::string> unmatched;
  for (Tensor& rt : R.tensors) {
    const int64_t si = S.find_tensor(rt.name);
    const uint32_t ti = L.add_tensor(rt.name, rt.dtype, rt.shape);
    Tensor& t = L.tensors[ti];
    t.receivers = std::move(rt.receivers);
    t.receiver_base = rt.receiver_base;
    if (si < 0) {
      if (!t.receivers.empty()) unmatched.push_back(t.name);
      continue;
    }
    Tensor& st = S.tensors[si];
    if (st.shape != t.shape) {
      std::string a, b;
      for (int64_t x : st.shape) a += (a.empty() ? "" : ", ") + std::to_string(x);
      for (int64_t x : t.shape) b += (b.empty() ? "" : ", ") + std::to_string(x);
      return Status::invalid("tensor " + quoted(t.name) + " is [" + a + "] on the sources and [" + b +
                             "] on the receivers");
    }
    if (st.dtype != t.dtype) t.receiver_dtype = t.dtype;
    t.dtype = st.dtype;
    t.sources = std::move(st.sources);
    t.source_base = st.source_base + shift;
  }
  REFIT_RETURN_IF_ERROR(resolve_conversions(L));
  for (const std::string& name : unmatched) {
    if (L.tensors[L.find_tensor(name)].derived_from < 0)
      return Status::invalid("tensor " + quoted(name) + " is needed by the receivers but is not in the sources' model" +
                             " (nor a block scale of a tensor quantized on the way)");
  }
  return L;
}

ConversionBytes count_conversion_bytes(const Plan& plan, ConvertAt at) {
  const Layout& L = plan.layout();
  ConversionBytes c;
  for (const Tensor& t : L.tensors) {
    if (t.derived_from >= 0) ++c.derived_tensors;
    else if (t.dtype_on(Side::kReceiver) != t.dtype) ++c.converted_tensors;
  }
  const std::array<int64_t, 2>& block = L.weight_block_size;
  for (const Unit& u : plan.units()) {
    const Tensor& t = L.tensors[u.tensor];
    const DType to = t.dtype_on(Side::kReceiver);
    const int64_t from_eb = dtype_bytes(t.dtype), to_eb = dtype_bytes(to);
    const bool quantized = to == DType::kF8E4M3 && t.dtype != to;
    const Box& box = plan.box(u);
    const int64_t fan = static_cast<int64_t>(u.consumers_count) - 1;
    const int64_t scales = quantized ? blocks_of(box, block) * int64_t{4} : 0;
    c.local_bytes += (box.numel() * to_eb + scales) * fan;
    c.local_scale_bytes += scales * fan;
    if (at == ConvertAt::kReceiver || t.dtype == to) {
      c.network_bytes += box.numel() * from_eb;
      if (quantized) c.quantized_at_receiver_bytes += box.numel() * from_eb;
      continue;
    }
    // At the source: a cast anywhere; a quantization of the whole blocks of
    // each piece (a piece lies in one holder region, which holds them), the
    // rest of the piece at the receiver.
    for (const Piece& p : plan.pull_set(u).pieces) {
      if (!quantized) {
        c.network_bytes += p.box.numel() * to_eb;
        continue;
      }
      const BlockSplit split = split_whole_blocks(p.box, t.shape, block);
      if (!split.whole.empty()) {
        const int64_t s = blocks_of(split.whole, block) * 4;
        c.network_bytes += split.whole.numel() * to_eb + s;
        c.network_scale_bytes += s;
        c.quantized_at_source_bytes += split.whole.numel() * from_eb;
      }
      const int64_t rest = p.box.numel() - split.whole.numel();
      c.network_bytes += rest * from_eb;
      c.quantized_at_receiver_bytes += rest * from_eb;
    }
  }
  return c;
}

}  // namespace refit
