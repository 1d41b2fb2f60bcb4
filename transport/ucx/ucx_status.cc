#include "transport/ucx/ucx_status.h"

#include <ucs/type/status.h>

namespace refit::ucx {

Status from_ucs(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK || status == UCS_INPROGRESS) return Status::ok();
  std::string msg = what + ": " + ucs_status_string(status) + " (UCX status " +
                    std::to_string(static_cast<int>(status)) + ")";
  switch (status) {
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_OUT_OF_RANGE:
      return Status::invalid(std::move(msg));
    case UCS_ERR_NO_ELEM:
    case UCS_ERR_NO_DEVICE:
      return Status::not_found(std::move(msg));
    case UCS_ERR_UNREACHABLE:  // a peer that is gone: worth a retry once it is replanned around
      return Status::io_error(std::move(msg));
    case UCS_ERR_UNSUPPORTED:
      return Status::unsupported(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_BUSY:
      return Status::io_error(std::move(msg));
    default:
      return Status::io_error(std::move(msg));
  }
}

}  // namespace refit::ucx
