#include "transport/cuda/cuda_status.h"

namespace refit::cuda {
namespace {

// 12080 -> "12.8"
std::string version_name(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

}  // namespace

Status from_cuda(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return Status::ok();
  const std::string msg = what + " failed: " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
  switch (error) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
      return Status::unsupported(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidPitchValue:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidDevice:
      return Status::invalid(msg);
    case cudaErrorMemoryAllocation:
      return Status::io_error(msg + "; free device or pinned memory, or make the staging slots smaller");
    default:
      return Status::io_error(msg);
  }
}

Status probe_device() {
  int runtime = 0;
  int driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaError_t e = cudaDriverGetVersion(&driver);
  if (e == cudaSuccess && driver == 0) {
    return Status::unsupported("no CUDA driver is installed (the CUDA " + version_name(runtime) +
                               " runtime found none): device buffers need a GPU machine");
  }
  if (e == cudaSuccess && driver < runtime) {
    return Status::unsupported("the CUDA driver supports CUDA " + version_name(driver) +
                               ", older than this build's runtime " + version_name(runtime) +
                               ": update the driver or build against an older toolkit");
  }
  int count = 0;
  e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return from_cuda(e, "cudaGetDeviceCount");
  if (count == 0) return Status::unsupported("cudaGetDeviceCount: this machine has no CUDA device");
  return Status::ok();
}

}  // namespace refit::cuda
