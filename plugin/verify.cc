#include "plugin/verify.h"

#include <xxhash.h>

#include <memory>
#include <string>
#include <vector>

#include "transport/convert/convert.h"

namespace refit::plugin {

namespace {

std::string dims(const std::vector<int64_t>& v) { return control::Json(v).dump(); }

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

namespace {

// Calls fn(pointer, bytes) for the box's elements of `seg` in `buffer`, in
// row-major order of the box, a contiguous run at a time; fails, naming the
// box, when it is not inside the segment or the segment reaches past the
// buffer.
template <typename Fn>
Status for_each_run(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg, int elem_bytes,
                    const std::vector<int64_t>& start, const std::vector<int64_t>& size, Fn&& fn) {
  const size_t n = seg.size.size();
  const std::string what = "tensor \"" + seg.tensor + "\" box start " + dims(start) + " size " + dims(size);
  if (start.size() != n || size.size() != n || seg.start.size() != n || seg.strides.size() != n) {
    return Status::invalid(what + ": its dims do not match the segment's (" + std::to_string(n) + ")");
  }
  // The box inside the segment, and the segment's last element inside the
  // buffer (the first is at seg.offset; strides are non-negative).
  int64_t last = seg.offset;
  for (size_t d = 0; d < n; ++d) {
    if (size[d] <= 0 || start[d] < seg.start[d] || start[d] + size[d] > seg.start[d] + seg.size[d]) {
      return Status::invalid(what + " is not inside the segment at start " + dims(seg.start) + " size " +
                             dims(seg.size));
    }
    last += (seg.size[d] - 1) * seg.strides[d];
  }
  if (elem_bytes <= 0 || static_cast<uint64_t>(last + 1) * static_cast<uint64_t>(elem_bytes) > buffer_bytes) {
    return Status::invalid(what + ": the segment's elements reach past the buffer's " +
                           std::to_string(buffer_bytes) + " bytes");
  }
  // The innermost dims that are contiguous in the buffer form one run.
  size_t k = n;
  int64_t run = 1;
  while (k > 0 && (seg.strides[k - 1] == run || size[k - 1] == 1)) {
    run *= size[k - 1];
    --k;
  }
  std::vector<int64_t> idx(k, 0);  // over the outer dims of the box
  int64_t base = seg.offset;
  for (size_t d = 0; d < n; ++d) base += (start[d] - seg.start[d]) * seg.strides[d];
  const size_t run_bytes = static_cast<size_t>(run) * static_cast<size_t>(elem_bytes);
  while (true) {
    int64_t off = base;
    for (size_t d = 0; d < k; ++d) off += idx[d] * seg.strides[d];
    fn(buffer + off * elem_bytes, run_bytes);
    size_t d = k;
    while (d > 0 && ++idx[d - 1] == size[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return Status::ok();
}

}  // namespace

Result<uint64_t> hash_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                          int elem_bytes, const std::vector<int64_t>& start, const std::vector<int64_t>& size) {
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) return Status::internal("hash_box: XXH3 state");
  REFIT_RETURN_IF_ERROR(for_each_run(buffer, buffer_bytes, seg, elem_bytes, start, size,
                                     [&](const uint8_t* p, size_t n) { (void)XXH3_64bits_update(state.get(), p, n); }));
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

Status convert_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg, DType from, DType to,
                   const std::array<int64_t, 2>& block, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& size, uint8_t* out, float* scales, bool* refused) {
  *refused = false;
  // The box row-major in the sources' dtype, then converted as a receiver
  // converts it (transport/convert).
  std::vector<uint8_t> box;
  REFIT_RETURN_IF_ERROR(for_each_run(buffer, buffer_bytes, seg, dtype_bytes(from), start, size,
                                     [&](const uint8_t* p, size_t n) { box.insert(box.end(), p, p + n); }));
  const int64_t numel = static_cast<int64_t>(box.size()) / dtype_bytes(from);
  if (to != DType::kF8E4M3) {
    Status st = convert::cast(from, to, box.data(), out, numel, seg.tensor);
    *refused = !st.is_ok();
    return st;
  }
  const size_t n = size.size();
  if (n < 2) return Status::invalid("tensor \"" + seg.tensor + "\": F8_E4M3 needs 2 dims or more");
  const int64_t rows = size[n - 2], cols = size[n - 1];
  if (start[n - 2] % block[0] != 0 || start[n - 1] % block[1] != 0) {
    return Status::invalid("tensor \"" + seg.tensor + "\": a box at row " + std::to_string(start[n - 2]) + ", column " +
                           std::to_string(start[n - 1]) + " does not start on a block of " + std::to_string(block[0]) +
                           "x" + std::to_string(block[1]));
  }
  convert::QuantizeArgs a;
  a.src_dtype = from;
  a.src = box.data();
  a.rows = rows;
  a.cols = cols;
  a.dst = out;
  a.scales = scales;
  a.block = {block[0], block[1]};
  a.tensor = seg.tensor;
  a.block_row0 = start[n - 2] / block[0];
  a.block_col0 = start[n - 1] / block[1];
  Status st = convert::quantize_e4m3_matrices(a, numel / (rows * cols));
  *refused = !st.is_ok();
  return st;
}

Result<ConvertedHashes> hash_converted_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                                           DType from, DType to, const std::array<int64_t, 2>& block,
                                           const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                                           const std::vector<IndexBox>& scale_boxes, bool* refused) {
  *refused = false;
  int64_t numel = 1;
  for (int64_t x : size) numel *= x;
  std::vector<uint8_t> out(static_cast<size_t>(numel * dtype_bytes(to)));
  // The scales of the box's blocks, row-major over their box of the scale
  // tensor (the box's leading dims, then block rows, block cols): a buffer
  // that one segment describes, so that a box of it hashes as a receiver's
  // scale buffer does.
  const size_t n = size.size();
  const IndexBox grid = scale_box_of(start, size, block);
  int64_t nscales = 1;
  for (int64_t x : grid.size) nscales *= x;
  std::vector<float> scales(to == DType::kF8E4M3 ? static_cast<size_t>(nscales) : 0);
  REFIT_RETURN_IF_ERROR(convert_box(buffer, buffer_bytes, seg, from, to, block, start, size, out.data(),
                                    scales.data(), refused));
  ConvertedHashes result;
  result.hash = XXH3_64bits(out.data(), out.size());
  if (to != DType::kF8E4M3) return result;
  control::Segment held{scale_tensor_name(seg.tensor), grid.start, grid.size, 0, std::vector<int64_t>(n, 1)};
  for (size_t d = n - 1; d > 0; --d) held.strides[d - 1] = held.strides[d] * grid.size[d];
  for (const IndexBox& b : scale_boxes) {
    Result<uint64_t> h = hash_box(reinterpret_cast<const uint8_t*>(scales.data()), scales.size() * sizeof(float),
                                  held, sizeof(float), b.start, b.size);
    if (!h.is_ok()) return h.status().with_context("the scales of tensor \"" + seg.tensor + "\" box start " +
                                                   dims(start) + " size " + dims(size));
    result.scale_hashes.push_back(*h);
  }
  return result;
}

}  // namespace refit::plugin
