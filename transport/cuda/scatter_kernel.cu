#include <cuda_runtime.h>

#include "transport/cuda/scatter_kernel.h"

namespace refit::cuda {
namespace {

// Bytes of one piece that one block moves: a piece of up to this goes in one
// block, a larger one (a packed send up to pack_threshold, 1 MiB by
// default) is split across blocks so that more loads are in flight. A
// multiple of 16.
constexpr uint64_t kChunkBytes = 64 << 10;
constexpr uint32_t kThreads = 256;
// Blocks along the pieces (grid-strided beyond).
constexpr uint32_t kMaxPieceBlocks = 4096;
// Blocks along the chunks of a piece (grid-strided beyond): 65535 is
// CUDA's limit on gridDim.y.
constexpr uint64_t kMaxChunkBlocks = 65535;

// The grid is (piece, chunk): block (x, y) moves chunk y of piece x (and
// those a grid stride further). Where destination and source share their
// alignment mod 16, a piece is `head` bytes up to the next 16-byte boundary
// of both, then 16-byte words, then a tail of under 16 bytes; chunk c moves
// the words [c * W, (c + 1) * W) with W = kChunkBytes / 16, and chunk 0
// also the head and the tail. Otherwise chunk c moves the bytes
// [c * kChunkBytes, (c + 1) * kChunkBytes) one at a time.
__global__ void scatter(const ScatterPiece* __restrict__ pieces, uint32_t n) {
  constexpr uint64_t kWords = kChunkBytes / 16;
  for (uint32_t p = blockIdx.x; p < n; p += gridDim.x) {
    const ScatterPiece pc = pieces[p];
    uint8_t* __restrict__ dst = pc.dst;
    const uint8_t* __restrict__ src = pc.src;
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
    const uintptr_t s = reinterpret_cast<uintptr_t>(src);
    if (((d ^ s) & 15) == 0) {
      uint64_t head = (16 - (d & 15)) & 15;
      if (head > pc.bytes) head = pc.bytes;
      const uint64_t wide = (pc.bytes - head) / 16;
      const uint64_t chunks = wide == 0 ? 1 : (wide + kWords - 1) / kWords;
      const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(src + head);
      uint4* __restrict__ d4 = reinterpret_cast<uint4*>(dst + head);
      for (uint64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
        if (c == 0) {
          for (uint64_t k = threadIdx.x; k < head; k += blockDim.x) dst[k] = src[k];
          for (uint64_t k = head + wide * 16 + threadIdx.x; k < pc.bytes; k += blockDim.x) dst[k] = src[k];
        }
        const uint64_t end = (c + 1) * kWords < wide ? (c + 1) * kWords : wide;
        for (uint64_t k = c * kWords + threadIdx.x; k < end; k += blockDim.x) d4[k] = s4[k];
      }
    } else {
      const uint64_t chunks = (pc.bytes + kChunkBytes - 1) / kChunkBytes;
      for (uint64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
        const uint64_t end = (c + 1) * kChunkBytes < pc.bytes ? (c + 1) * kChunkBytes : pc.bytes;
        for (uint64_t k = c * kChunkBytes + threadIdx.x; k < end; k += blockDim.x) dst[k] = src[k];
      }
    }
  }
}

}  // namespace

int launch_scatter(const ScatterPiece* pieces, uint32_t n, uint64_t max_bytes, void* stream) {
  if (n == 0) return cudaSuccess;
  const uint32_t x = n < kMaxPieceBlocks ? n : kMaxPieceBlocks;
  uint64_t chunks = (max_bytes + kChunkBytes - 1) / kChunkBytes;
  if (chunks == 0) chunks = 1;
  if (chunks > kMaxChunkBlocks) chunks = kMaxChunkBlocks;
  const dim3 grid(x, static_cast<uint32_t>(chunks));
  // cudaGetLastError() after a launch reports any earlier error of this
  // thread too (the round thread's cudaEventQuery leaves cudaErrorNotReady):
  // clear it first, so that what it returns is the launch's.
  (void)cudaGetLastError();
  scatter<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(pieces, n);
  return cudaGetLastError();
}

}  // namespace refit::cuda
