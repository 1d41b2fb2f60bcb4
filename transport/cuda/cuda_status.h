#pragma once
// cudaError_t to Status: the one place where CUDA runtime errors are
// converted (docs/architecture.md, "Errors"). Compiled only when CUDA is found.

#include <cuda_runtime_api.h>

#include <string>

#include "planner/status.h"

namespace refit::cuda {

// `what` names the call and its input: "cudaMemcpyAsync(4194304 bytes to device)".
Status from_cuda(cudaError_t error, const std::string& what);

// Whether this process can use a GPU: a clear Status when it cannot (no
// device, no driver, a driver older than the toolkit), so that callers fall
// back or skip instead of failing later on the first real call.
Status probe_device();

}  // namespace refit::cuda
