#include "transport/cuda/nccl_status.h"

namespace refit::cuda {

Status from_nccl(ncclResult_t result, const std::string& what) {
  if (result == ncclSuccess || result == ncclInProgress) return Status::ok();
  const std::string msg = what + " failed: " + ncclGetErrorString(result);
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return Status::invalid(msg);
    case ncclUnhandledCudaError:
    case ncclSystemError:
      return Status::io_error(msg + "; the CUDA driver or the system refused: see NCCL_DEBUG=WARN");
    case ncclRemoteError:
      return Status::io_error(msg + "; a peer of the domain failed or left");
    default:
      return Status::io_error(msg);
  }
}

}  // namespace refit::cuda
