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
// Modes (RunOptions::staged): direct receivers refresh into the served
// buffers; staged ones refresh into staging copies, and once every receiver's
// refresh returned OK, every receiver commits (refit_receiver_commit). The
// broadcast baseline always runs direct: its served buffers are the final
// ones, written only by its copy out, which is its pause.
//
// With serve_check every receiver process runs a serving reader (agent.h)
// and the run counts the reads that saw two versions (or none) at once. In
// direct mode every receiver then pauses (takes the server's lock) before
// the refresh command goes out, because a peer's push lands in this rank's
// buffers as soon as the peer's refresh starts.
//
// The calling process must have no threads yet when run_refreshes starts
// (it forks first, then starts the coordinators), and is single-threaded
// again when it returns. Nothing is left running: on any failure every
// child is killed, and the result says what failed.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
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
  // Receivers in "mode": "staged", each refresh followed by a commit
  // (refit and no-dedup; broadcast ignores it).
  bool staged = false;
  // Serving readers in the receiver processes (agent.h), checking every
  // sample_every-th element of each segment per read.
  bool serve_check = false;
  int64_t sample_every = 4096;
  // A rank killed (SIGKILL) during the last version's refresh, once
  // `fraction` of the version before's refresh wall time (an estimate of the
  // last one's) has passed since the refresh command went out. Needs
  // versions >= 2; with 3 or more the estimate is of a warm refresh (the
  // first one also plans and connects). refit and no-dedup; broadcast
  // ignores it.
  struct Kill {
    bool receiver = false;  // else a source
    int32_t rank = 0;
    double fraction = 0.5;
  };
  std::optional<Kill> kill;
  // Called after each step: what was done, steps done, steps in all.
  std::function<void(const std::string& step, int done, int total)> progress;
};

struct VersionResult {
  int64_t version = 0;
  // From the refresh command to the last receiver done; broadcast: from the
  // gatherer's refresh command to the last receiver's copy done.
  double seconds = 0;
  double unpack_seconds = 0;  // broadcast: the slowest receiver's copy
  // The slowest receiver's report "seconds.total" (broadcast: stage 2's).
  double refresh_seconds = 0;
  // The slowest receiver's pause: direct, its report's "pause_seconds" (the
  // refresh); staged, the commit's "pause_seconds"; broadcast, its copy out.
  double pause_seconds = 0;
  int64_t network_bytes = 0;  // the receivers' reports summed (broadcast: the gatherer's too)
  int64_t local_bytes = 0;
  bool verified = false;
  // per receiver rank (broadcast: stage 2); staged: the reports after commit
  std::vector<nlohmann::json> reports;
};

struct RunResult {
  Strategy strategy = Strategy::kRefit;
  bool staged = false;  // the mode the receivers ran in
  Status status;  // the first failure; the versions before it are kept
  // The refreshes that completed (and committed, staged), in order.
  std::vector<VersionResult> versions;
  // serve_check: reads by the serving readers and mixed ones, summed over the
  // receivers, as of the last version that completed.
  int64_t serve_reads = 0;
  int64_t mixed_version_reads = 0;
  // kill: who was killed and when; and, staged, whether the survivors that
  // lost the refresh (the killed receiver's instance; every receiver when a
  // source was killed) still hold the previous version, every byte checked.
  std::string killed;
  std::optional<bool> live_weights_intact;
  bool verified() const;  // status ok and every version verified
  double median_seconds() const;
  double median_refresh_seconds() const;
  double median_pause_seconds() const;
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
