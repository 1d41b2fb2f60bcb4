#pragma once
// One kernel launch for many small contiguous pieces, where one
// cudaMemcpyAsync per piece would cost more in calls than in bytes (the
// irregular runs that copy_plan.h cannot coalesce into 2-D/3-D copies).
// Compiled by nvcc when it is found (REFIT_HAVE_SCATTER_KERNEL); without it
// CudaCopyOps copies piece by piece.

#include <cstdint>

namespace refit::cuda {

struct ScatterPiece {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
};

// Copies pieces[0, n) on `stream` (a cudaStream_t). `pieces` and every dst
// and src must be device-accessible (device memory, or pinned host memory
// under unified addressing); the pieces must not overlap. `max_bytes` is at
// least the largest piece's bytes: it sizes the grid, whose blocks split a
// piece into 64 KiB chunks (a smaller bound leaves a larger piece to fewer
// blocks, still whole). Returns the launch's cudaError_t as an int.
int launch_scatter(const ScatterPiece* pieces, uint32_t n, uint64_t max_bytes, void* stream);

}  // namespace refit::cuda
