#pragma once
// The CUDA block quantizer: the same numbers as convert.h's CPU kernel
// (both are built from element.h), on device buffers. Compiled by nvcc
// into an object of refit_convert_cuda when CUDA, NCCL and nvcc are found
// (REFIT_HAVE_CONVERT_KERNEL), so that everything else links as plain C++.

#include <cstdint>

namespace refit::convert::cuda {

// One launch's arguments, every pointer device memory. The box is `rows` x
// `cols` elements of `src` (BF16 when `src_is_bf16`, else F32) with row
// stride `src_stride`; E4M3 bytes land in `dst` (row stride `dst_stride`),
// one F32 scale per block in `scales` (row stride `scale_stride`).
// `amax_scratch` holds one uint32 per block and `bad_block` one uint64 that
// the caller set to UINT64_MAX: after the launches `*bad_block` is the
// smallest linear index (block row * blocks per row + block column) of a
// block holding NaN or an infinity, and then nothing was written to `dst`
// or `scales`.
struct DeviceQuantize {
  const void* src = nullptr;
  bool src_is_bf16 = true;
  int64_t src_stride = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  uint8_t* dst = nullptr;
  int64_t dst_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride = 0;
  int64_t block_rows = 128;
  int64_t block_cols = 128;
  uint32_t* amax_scratch = nullptr;
  unsigned long long* bad_block = nullptr;
};

// Enqueues the two kernels (amax and check, then quantize) on `stream` (a
// cudaStream_t). Returns the launches' cudaError_t as an int.
int launch_quantize_e4m3(const DeviceQuantize& q, void* stream);

}  // namespace refit::convert::cuda
