#pragma once
// The CUDA relayout (docs/refresh.md, "Column-major receivers"): a box
// packed row-major in device memory copied element by element into a
// device buffer's strides, as relayout.h's relayout_box does on the host.
// Compiled by nvcc into an object of refit_convert_cuda when CUDA, NCCL and
// nvcc are found (REFIT_HAVE_CONVERT_KERNEL), so that everything else links
// as plain C++.

#include <cstdint>

namespace refit::convert::cuda {

// One launch's arguments, both pointers device memory. Element e of the
// box (row-major over `size`, `ndim` dims from 1 to 8) is read at
// src + e * elem_bytes and written at dst + (sum over d of i_d *
// stride[d]) * elem_bytes. `elem_bytes` is 1, 2, 4 or 8 and both pointers
// are aligned to it.
struct DeviceRelayout {
  const void* src = nullptr;
  void* dst = nullptr;
  int elem_bytes = 2;
  int ndim = 0;
  int64_t size[8] = {};
  int64_t stride[8] = {};
};

// Enqueues the kernel on `stream` (a cudaStream_t). Returns the launch's
// cudaError_t as an int.
int launch_relayout(const DeviceRelayout& r, void* stream);

}  // namespace refit::convert::cuda
