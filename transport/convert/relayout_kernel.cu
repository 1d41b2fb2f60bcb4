#include "transport/convert/relayout_kernel.h"

#include <cuda_runtime.h>

namespace refit::convert::cuda {

namespace {

constexpr int kThreads = 256;

// Grid-stride over the box's elements in row-major order: the reads are
// coalesced, the writes go where the strides put them.
template <typename T>
__global__ void relayout_kernel(DeviceRelayout r, int64_t numel) {
  const T* src = static_cast<const T*>(r.src);
  T* dst = static_cast<T*>(r.dst);
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < numel;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rest = e, off = 0;
    for (int d = r.ndim - 1; d >= 0; --d) {
      off += (rest % r.size[d]) * r.stride[d];
      rest /= r.size[d];
    }
    dst[off] = src[e];
  }
}

}  // namespace

int launch_relayout(const DeviceRelayout& r, void* stream) {
  int64_t numel = 1;
  for (int d = 0; d < r.ndim; ++d) numel *= r.size[d];
  if (numel == 0) return static_cast<int>(cudaSuccess);
  const int64_t want = (numel + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(want < 65535 ? want : 65535);
  auto s = static_cast<cudaStream_t>(stream);
  // cudaGetLastError() after a launch reports any earlier error of this
  // thread too: clear it first, as the other kernels' launches do.
  (void)cudaGetLastError();
  switch (r.elem_bytes) {
    case 1: relayout_kernel<uint8_t><<<grid, kThreads, 0, s>>>(r, numel); break;
    case 2: relayout_kernel<uint16_t><<<grid, kThreads, 0, s>>>(r, numel); break;
    case 4: relayout_kernel<uint32_t><<<grid, kThreads, 0, s>>>(r, numel); break;
    case 8: relayout_kernel<unsigned long long><<<grid, kThreads, 0, s>>>(r, numel); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace refit::convert::cuda
