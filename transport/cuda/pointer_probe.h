#pragma once
// What kind of memory a pointer is, asked of the CUDA driver without making
// a CUDA context: the driver library is opened at run time (dlopen
// libcuda.so.1) and asked with cuPointerGetAttribute after cuInit, neither
// of which creates a context or takes GPU memory. A process without a
// driver, or a driver that cannot start, has no GPU memory: every pointer is
// host memory. Builds everywhere (no CUDA header), so host-only users of a
// CUDA build, and builds without CUDA, pay nothing but the one dlopen.
//
// Thread safety: any thread; the driver is opened once.

#include <cstdint>
#include <string>

namespace refit::cuda {

struct PointerKind {
  bool device = false;  // device or managed memory
  int ordinal = -1;     // its device, when device
};

PointerKind probe_pointer(const void* p);

// Whether the calling thread has a CUDA context current (cuCtxGetCurrent):
// a thread that never used CUDA has none, and the runtime's cudaGetDevice
// answers 0 for it all the same.
bool thread_has_context();

}  // namespace refit::cuda
