#pragma once
// Makes a device current on this thread for one scope and restores the
// caller's device afterwards: refit runs on the application's threads (and
// its own, where no device was ever set) and must neither depend on nor
// change which device they work on. CUDA builds only.
#include <cuda_runtime_api.h>

#include <string>

#include "planner/status.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::cuda {

class DeviceGuard {
 public:
  // A thread without a context (one that never used CUDA: cudaGetDevice
  // says 0 there too) keeps `device` afterwards: restoring "device 0" would
  // make GPU 0's context in a process that works on another GPU.
  explicit DeviceGuard(int device) {
    if (!thread_has_context() || cudaGetDevice(&previous_) != cudaSuccess || previous_ == device) previous_ = -1;
    status_ = device < 0 ? Status::invalid("no GPU to run on (the memory's device is unknown)")
                         : from_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = -1;
  Status status_;
};

}  // namespace refit::cuda
