#pragma once
// refit-bench --hardware: what the refresh simulator (tools/sim, docs/simulator.md)
// predicts for each strategy the bench runs, on a hardware model of this
// machine (scripts/calibrate measures one), beside what the bench measures.
//
// Pure computation, no I/O but the hardware file's read.
#include <string>

#include <nlohmann/json.hpp>

#include "planner/gather.h"
#include "planner/hardware.h"
#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/status.h"

namespace refit::bench {

struct Prediction {
  double seconds = 0;
  std::string model;  // "event" (simulated) or "fluid" (broadcast)
  // With the hardware's host_cores: the CPU time of the transfers and that
  // over the cores; `host_bound` when that bound is the prediction.
  double host_cpu_seconds = 0;
  double host_bound_seconds = 0;
  bool host_bound = false;
};

// The hardware model in `path`: the documented defaults with the file's
// keys applied (planner/hardware.h), checked. Errors name the file and key.
Result<HardwareModel> read_hardware_file(const std::string& path);

// The gathers the bench's receivers group (planner/gather.h), as the agents
// read their config: the defaults; "gather_below_bytes": 0 unless `gather`
// (--no-gather); then `receiver_config`'s keys (--receiver-config, set last,
// so they win): "gather_below_bytes" (0 turns grouping off), "gather_bytes"
// (unset, at most its "window_bytes") and "gather_entries". A key that is
// not an integer is left out here; the agents refuse it.
GatherOptions receiver_gathers(const nlohmann::json& receiver_config, bool gather);

// Plans `layout` for `strategy` and simulates it on `hw`, the receivers
// grouping small runs into gathers as `gather` says. Errors name a
// `gather` the agents would refuse.
Result<Prediction> predict(const Layout& layout, Strategy strategy, const HardwareModel& hw,
                           const GatherOptions& gather);

}  // namespace refit::bench
