#pragma once
// Copy planning for the staging pipeline: the pieces of one staged chunk
// (contiguous host bytes that belong at several device places) become as few
// 1-D, 2-D and 3-D copies as their regularity allows. A strided box of a
// tensor, packed at the source, arrives as many equal rows at a constant
// pitch: one cudaMemcpy2DAsync instead of one call per row, and equal
// row blocks at a constant plane stride one cudaMemcpy3DAsync.
//
// Pure C++: the CUDA implementation (cuda_copy_ops.h) maps a Copy onto the
// runtime's calls, the host fake and the tests run it with copy_on_host().

#include <cstdint>
#include <span>
#include <vector>

namespace refit::cuda {

// depth planes of height rows of width bytes. Rows of a plane are pitch bytes
// apart, planes plane bytes apart, on each side. The shapes the runtime
// accepts: pitch >= width where height > 1; plane a multiple of pitch and
// plane / pitch >= height where depth > 1.
struct Copy {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t width = 0;
  uint64_t height = 1;
  uint64_t depth = 1;
  uint64_t dst_pitch = 0;
  uint64_t src_pitch = 0;
  uint64_t dst_plane = 0;
  uint64_t src_plane = 0;
  uint64_t bytes() const { return width * height * depth; }
};

// One contiguous piece: bytes from src to dst.
struct Piece {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
};

// The runtime's limit on a pitch (cudaMemcpy2D: below 2^31 on every current
// device); a stride above it keeps its pieces as separate copies.
inline constexpr uint64_t kMaxPitch = (uint64_t{1} << 31) - 1;

// Coalesces `pieces`, in order, into copies that together move exactly the
// same bytes: consecutive pieces of one width at constant forward strides
// into one 2-D copy, consecutive 2-D copies of one shape at constant plane
// strides into one 3-D copy. Empty pieces are dropped. The result moves the
// same bytes in the same order as the pieces one by one, provided the
// destinations do not overlap (the staging pipeline's never do).
std::vector<Copy> plan_copies(std::span<const Piece> pieces);

// Runs `copy` with memcpy: the host fake's copy, and the tests' reference.
void copy_on_host(const Copy& copy);

}  // namespace refit::cuda
