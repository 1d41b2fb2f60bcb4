#pragma once
// The one place where UCX's ucs_status_t becomes refit's Status. Every UCX
// call in transport/ucx reports its failure through from_ucs().

#include <ucs/type/status.h>

#include <string>

#include "planner/status.h"

namespace refit::ucx {

// Returns Status::ok() for UCS_OK (and UCS_INPROGRESS, which is not a
// failure); otherwise an error whose message is `what: <UCX text> (UCX status
// N)`. `what` says which call failed on which input.
Status from_ucs(ucs_status_t status, const std::string& what);

}  // namespace refit::ucx
