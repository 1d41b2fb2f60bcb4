#pragma once
// Runs live refreshes of a Layout with one process per rank, the way the
// bench and the end-to-end tests need: a coordinator embedded in this
// process, the sources fill the pattern of version v and publish it, then
// every receiver refreshes to v at once, and every receiver byte is checked.
//
// Strategies (planner/plan.h's names):
// - kRefit: the layout as it is (its domains, so refit dedups inside them);
// - kNoDedup: every receiver rank in a domain of its own;
// - kBroadcast: gather then broadcast whole tensors, executed with the same
//   library in two stages with two coordinators (strategy_layouts.h): a
//   gatherer process refreshes every whole tensor from the trainers, publishes
//   it as the one source of stage 2, every receiver rank refreshes the whole
//   tensors it touches into scratch buffers and copies its slices out
//   (memcpy, timed as part of the refresh).
//
// The calling process must have no threads yet when run_refreshes starts
// (it forks first, then starts the coordinators), and is single-threaded
// again when it returns. Nothing is left running: on any failure every
// child is killed, and the result says what failed.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/status.h"

namespace refit::bench {

struct RunOptions {
  int versions = 3;
  int64_t first_version = 1;
  std::vector<std::string> network_transports{"tcp"};
  std::vector<std::string> network_devices{"lo"};
  std::vector<std::string> local_transports{"shm"};
  // Deadline of each step (every child's answer to one command).
  std::chrono::milliseconds step_timeout{60000};
  // Passed to refit_receiver_refresh and refit_source_wait_drained.
  std::chrono::milliseconds refresh_timeout{30000};
  std::string log_level = "warn";
  // Called after each step: what was done, steps done, steps in all.
  std::function<void(const std::string& step, int done, int total)> progress;
};

struct VersionResult {
  int64_t version = 0;
  // From the refresh command to the last receiver done; broadcast: from the
  // gatherer's refresh command to the last receiver's copy done.
  double seconds = 0;
  double unpack_seconds = 0;  // broadcast: the slowest receiver's copy
  int64_t network_bytes = 0;  // the receivers' reports summed (broadcast: the gatherer's too)
  int64_t local_bytes = 0;
  bool verified = false;
  std::vector<nlohmann::json> reports;  // per receiver rank (broadcast: stage 2)
};

struct RunResult {
  Strategy strategy = Strategy::kRefit;
  Status status;  // the first failure; the versions before it are kept
  std::vector<VersionResult> versions;
  bool verified() const;  // status ok and every version verified
  double median_seconds() const;
};

RunResult run_refreshes(const Layout& layout, Strategy strategy, const RunOptions& options);

// The config document of an agent, as refit.h documents it.
struct AgentPlace {
  bool receiver = false;
  int32_t rank = 0;
  int32_t domain = 0;
  int32_t instance = 0;
};
std::string agent_config(const AgentPlace& place, const std::string& coordinator_address,
                         const std::string& token_file, const RunOptions& options);

}  // namespace refit::bench
