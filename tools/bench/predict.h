#pragma once
// refit-bench --hardware: what the refresh simulator (tools/sim, docs/simulator.md)
// predicts for each strategy the bench runs, on a hardware model of this
// machine (scripts/calibrate measures one), beside what the bench measures.
//
// Pure computation, no I/O but the hardware file's read.
#include <string>

#include "planner/hardware.h"
#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/status.h"

namespace refit::bench {

struct Prediction {
  double seconds = 0;
  std::string model;  // "event" (simulated) or "fluid" (broadcast)
};

// The hardware model in `path`: the documented defaults with the file's
// keys applied (planner/hardware.h), checked. Errors name the file and key.
Result<HardwareModel> read_hardware_file(const std::string& path);

// Plans `layout` for `strategy` and simulates it on `hw`, the receivers
// grouping gathers unless `gather` is false.
Result<Prediction> predict(const Layout& layout, Strategy strategy, const HardwareModel& hw, bool gather);

}  // namespace refit::bench
