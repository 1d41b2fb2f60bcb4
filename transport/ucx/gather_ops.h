#pragma once
// A receiver's network runs as the GetEngine's gather ops: the planner's
// grouping (planner/gather.h) applied to runs that name their peer, rkey
// and places, so that the agent only hands its runs in and posts what comes
// out (docs/refresh.md, "Gathers").

#include <cstdint>
#include <span>
#include <vector>

#include "planner/gather.h"
#include "transport/ucx/get_engine.h"

namespace refit::ucx {

// One network run of a receiver.
struct NetRunRef {
  int32_t peer = 0;       // the source rank it reads
  GatherPart part;        // its key, remote and local range
  bool eligible = true;   // false: never grouped (it lands in device memory through the landing ring)
};

struct GatherOps {
  struct Op {
    int32_t peer = 0;
    uint64_t bytes = 0;
    std::vector<GatherPart> parts;  // in stream order
    std::vector<uint32_t> runs;     // the input runs it carries, same order
  };
  std::vector<Op> ops;
  std::vector<bool> gathered;  // per input run: travels in one of `ops`
  uint64_t gathered_runs = 0;
  uint64_t unpacked = 0;       // small runs too large for the gather bound (planner/gather.h)
};

// Groups `runs` (one receiver's, in plan order) by `options`. Runs not
// grouped stay plain GETs (gathered[i] false). Deterministic.
GatherOps make_gather_ops(std::span<const NetRunRef> runs, const GatherOptions& options);

}  // namespace refit::ucx
