#include "transport/cuda/pointer_probe.h"

#include <dlfcn.h>

#include <mutex>

namespace refit::cuda {
namespace {

// The few driver API names needed, as cuda.h defines them.
using CuResult = int;
constexpr CuResult kCudaSuccess = 0;
constexpr int kAttributeMemoryType = 2;     // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttributeIsManaged = 8;      // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;   // CU_MEMORYTYPE_DEVICE
using InitFn = CuResult (*)(unsigned);
using PointerGetAttributeFn = CuResult (*)(void*, int, uintptr_t);
using CtxGetCurrentFn = CuResult (*)(void**);

struct Driver {
  PointerGetAttributeFn get = nullptr;  // null: no usable driver
  CtxGetCurrentFn current = nullptr;
};

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
    auto get = reinterpret_cast<PointerGetAttributeFn>(dlsym(lib, "cuPointerGetAttribute"));
    if (init == nullptr || get == nullptr || init(0) != kCudaSuccess) return;  // the library stays open
    d.get = get;
    d.current = reinterpret_cast<CtxGetCurrentFn>(dlsym(lib, "cuCtxGetCurrent"));
  });
  return d;
}

}  // namespace

PointerKind probe_pointer(const void* p) {
  PointerKind kind;
  const Driver& d = driver();
  if (d.get == nullptr || p == nullptr) return kind;
  const auto address = reinterpret_cast<uintptr_t>(p);
  unsigned type = 0, managed = 0;
  if (d.get(&type, kAttributeMemoryType, address) != kCudaSuccess) return kind;  // not the driver's: host
  if (d.get(&managed, kAttributeIsManaged, address) != kCudaSuccess) managed = 0;
  kind.device = type == kMemoryTypeDevice || managed != 0;
  int ordinal = -1;
  if (kind.device && d.get(&ordinal, kAttributeDeviceOrdinal, address) == kCudaSuccess) kind.ordinal = ordinal;
  return kind;
}

bool thread_has_context() {
  const Driver& d = driver();
  void* ctx = nullptr;
  return d.current != nullptr && d.current(&ctx) == kCudaSuccess && ctx != nullptr;
}

}  // namespace refit::cuda
