#include "plugin/verify.h"

#include <xxhash.h>

#include <memory>
#include <string>

namespace refit::plugin {

namespace {

std::string dims(const std::vector<int64_t>& v) { return control::Json(v).dump(); }

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

Result<uint64_t> hash_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                          int elem_bytes, const std::vector<int64_t>& start, const std::vector<int64_t>& size) {
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
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) return Status::internal("hash_box: XXH3 state");
  std::vector<int64_t> idx(k, 0);  // over the outer dims of the box
  int64_t base = seg.offset;
  for (size_t d = 0; d < n; ++d) base += (start[d] - seg.start[d]) * seg.strides[d];
  const size_t run_bytes = static_cast<size_t>(run) * static_cast<size_t>(elem_bytes);
  while (true) {
    int64_t off = base;
    for (size_t d = 0; d < k; ++d) off += idx[d] * seg.strides[d];
    (void)XXH3_64bits_update(state.get(), buffer + off * elem_bytes, run_bytes);
    size_t d = k;
    while (d > 0 && ++idx[d - 1] == size[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return static_cast<uint64_t>(XXH3_64bits_digest(state.get()));
}

}  // namespace refit::plugin
