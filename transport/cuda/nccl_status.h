#pragma once
// ncclResult_t to Status: the one place where NCCL errors are converted
// (docs/architecture.md, "Errors"). Compiled only when NCCL is found.

#include <nccl.h>

#include <string>

#include "planner/status.h"

namespace refit::cuda {

// `what` names the call and its input: "ncclCommInitRankConfig(rank 1 of 4)".
// ncclInProgress is not an error; callers poll it (nccl_comm.cc).
Status from_nccl(ncclResult_t result, const std::string& what);

}  // namespace refit::cuda
