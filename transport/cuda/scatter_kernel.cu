#include <cuda_runtime.h>

#include "transport/cuda/scatter_kernel.h"

namespace refit::cuda {
namespace {

// One block per piece (grid-strided); 16-byte moves where source and
// destination share their alignment, bytes at the edges and otherwise.
__global__ void scatter(const ScatterPiece* pieces, uint32_t n) {
  for (uint32_t p = blockIdx.x; p < n; p += gridDim.x) {
    const ScatterPiece pc = pieces[p];
    const uintptr_t d = reinterpret_cast<uintptr_t>(pc.dst);
    const uintptr_t s = reinterpret_cast<uintptr_t>(pc.src);
    uint64_t head = pc.bytes;
    uint64_t wide = 0;
    if (((d ^ s) & 15) == 0) {
      head = (16 - (d & 15)) & 15;
      if (head > pc.bytes) head = pc.bytes;
      wide = (pc.bytes - head) / 16;
    }
    for (uint64_t k = threadIdx.x; k < head; k += blockDim.x) pc.dst[k] = pc.src[k];
    const uint4* s4 = reinterpret_cast<const uint4*>(pc.src + head);
    uint4* d4 = reinterpret_cast<uint4*>(pc.dst + head);
    for (uint64_t k = threadIdx.x; k < wide; k += blockDim.x) d4[k] = s4[k];
    for (uint64_t k = head + wide * 16 + threadIdx.x; k < pc.bytes; k += blockDim.x) pc.dst[k] = pc.src[k];
  }
}

}  // namespace

int launch_scatter(const ScatterPiece* pieces, uint32_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  const uint32_t blocks = n < 4096 ? n : 4096;
  // cudaGetLastError() after a launch reports any earlier error of this
  // thread too (the round thread's cudaEventQuery leaves cudaErrorNotReady):
  // clear it first, so that what it returns is the launch's.
  (void)cudaGetLastError();
  scatter<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(pieces, n);
  return cudaGetLastError();
}

}  // namespace refit::cuda
