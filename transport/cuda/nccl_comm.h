#pragma once
// CommFactory and DomainComm over NCCL (device_ops.h says the contract).
// Communicators are non-blocking (ncclConfig_t::blocking = 0): building
// one and launching a group that still connects to a peer return at once
// and are polled, so that every wait has the refresh's deadline and a peer
// that never comes ends in ncclCommAbort, not in a hang. Compiled only
// when CUDA and NCCL are found.

#include <memory>

#include "transport/cuda/device_ops.h"

namespace refit::cuda {

// Communicators on `device`. `upstream`, a cudaStream_t or null, is the
// stream the network's landing copies run on (CudaCopyOps::stream()): each
// group that sends waits for what was issued on it before.
Result<std::unique_ptr<CommFactory>> nccl_comm_factory(int device, void* upstream);

// The NCCL version this build runs with, "2.28.3".
std::string nccl_version();

}  // namespace refit::cuda
