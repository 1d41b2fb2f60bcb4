#include <cuda_runtime.h>

#include "transport/convert/convert_kernel.h"
#include "transport/convert/element.h"

namespace refit::convert::cuda {
namespace {

constexpr int kThreads = 256;

__device__ uint32_t block_max(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  }
  return v;  // valid in thread 0
}

__device__ uint32_t abs_bits(const DeviceQuantize& q, int64_t i, int64_t j) {
  if (q.src_is_bf16) {
    const uint16_t b = static_cast<const uint16_t*>(q.src)[i * q.src_stride + j];
    return static_cast<uint32_t>(b & 0x7FFFu) << 16;
  }
  return static_cast<const uint32_t*>(q.src)[i * q.src_stride + j] & 0x7FFFFFFFu;
}

// One CUDA block per quantization block: its amax, as bits of |x|, and the
// smallest index of a block holding NaN or an infinity.
__global__ void amax_kernel(DeviceQuantize q, int64_t bcols, int64_t nblocks) {
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int64_t bi = b / bcols, bj = b % bcols;
    const int64_t r0 = bi * q.block_rows, c0 = bj * q.block_cols;
    const int64_t r = min(q.block_rows, q.rows - r0), c = min(q.block_cols, q.cols - c0);
    uint32_t m = 0;
    for (int64_t k = threadIdx.x; k < r * c; k += blockDim.x) m = max(m, abs_bits(q, r0 + k / c, c0 + k % c));
    m = block_max(m);
    if (threadIdx.x == 0) {
      q.amax_scratch[b] = m;
      if (m >= 0x7F800000u) atomicMin(q.bad_block, static_cast<unsigned long long>(b));
    }
    __syncthreads();
  }
}

__global__ void quantize_kernel(DeviceQuantize q, int64_t bcols, int64_t nblocks) {
  // A bad block anywhere: write nothing (the host reports it).
  if (*q.bad_block != ~0ull) return;
  for (int64_t b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int64_t bi = b / bcols, bj = b % bcols;
    const int64_t r0 = bi * q.block_rows, c0 = bj * q.block_cols;
    const int64_t r = min(q.block_rows, q.rows - r0), c = min(q.block_cols, q.cols - c0);
    // IEEE division and reciprocal (nvcc's default -prec-div=true), as the
    // CPU kernel: max(amax, 1e-4) / 448, then 1 / scale.
    const float scale = __fdiv_rn(fmaxf(f32_from_bits(q.amax_scratch[b]), 1e-4f), kE4M3Max);
    const float inv = __fdiv_rn(1.0f, scale);
    for (int64_t k = threadIdx.x; k < r * c; k += blockDim.x) {
      const int64_t i = r0 + k / c, j = c0 + k % c;
      const float x = q.src_is_bf16 ? f32_from_bf16(static_cast<const uint16_t*>(q.src)[i * q.src_stride + j])
                                    : static_cast<const float*>(q.src)[i * q.src_stride + j];
      q.dst[i * q.dst_stride + j] = e4m3_from_f32(__fmul_rn(x, inv));
    }
    if (threadIdx.x == 0) q.scales[bi * q.scale_stride + bj] = scale;
  }
}

}  // namespace

int launch_quantize_e4m3(const DeviceQuantize& q, void* stream) {
  const int64_t brows = (q.rows + q.block_rows - 1) / q.block_rows;
  const int64_t bcols = (q.cols + q.block_cols - 1) / q.block_cols;
  const int64_t nblocks = brows * bcols;
  if (nblocks == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(nblocks < 65536 ? nblocks : 65536);
  auto s = static_cast<cudaStream_t>(stream);
  // cudaGetLastError() after a launch reports any earlier error of this
  // thread too (a cudaEventQuery's cudaErrorNotReady): clear it first, so
  // that what it returns is the launch's.
  (void)cudaGetLastError();
  amax_kernel<<<grid, kThreads, 0, s>>>(q, bcols, nblocks);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  quantize_kernel<<<grid, kThreads, 0, s>>>(q, bcols, nblocks);
  return cudaGetLastError();
}

}  // namespace refit::convert::cuda
