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
// Membership while refreshes run (refit and no-dedup): receivers that
// leave and rejoin between versions (churn), an instance whose receivers join
// late, and a rank killed in a refresh (kill), optionally replaced by a
// standby process forked with the others. Every long-lived process's
// resident memory is sampled after the first version it took part in and
// after the last (RunResult::resident).
//
// The calling process must have no threads yet when run_refreshes starts
// (it forks first, then starts the coordinators), and is single-threaded
// again when it returns. Nothing is left running: on any failure every
// child is killed, and the result says what failed.

#include <array>
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
  // The receivers' "local.fabric" ("cma", "ucx"); empty: the library's
  // default.
  std::string local_fabric;
  // The receivers group small runs into gathers (docs/refresh.md,
  // "Gathers"); false: "gather_below_bytes": 0, every run its own GET.
  bool gather = true;
  // Keys set in every receiver's and every source's config over refit-bench's
  // own (JSON objects; empty: none), for a before/after of the transfer
  // knobs ("chunk_bytes", "gather_bytes", "gather_reply_bytes", ...).
  nlohmann::json receiver_config = nlohmann::json::object();
  nlohmann::json source_config = nlohmann::json::object();
  // The coordinator's PlanOptions::relayout_below_bytes (docs/refresh.md,
  // "Column-major receivers"); 0: never.
  int64_t relayout_below_bytes = 0;
  // Some tensor converts on the way (docs/conversion.md): the receivers
  // declare the layout's F8_E4M3 block ("weight_block_size").
  bool converts = false;
  std::array<int64_t, 2> weight_block_size{128, 128};
  // Deadline of each step (every child's answer to one command).
  std::chrono::milliseconds step_timeout{60000};
  // Passed to refit_receiver_refresh and refit_source_wait_drained.
  std::chrono::milliseconds refresh_timeout{30000};
  // The agents' "coordinator.timeout_ms" (each coordinator call's deadline);
  // zero: step_timeout.
  std::chrono::milliseconds coordinator_timeout{0};
  std::chrono::milliseconds coordinator_call_timeout() const {
    return coordinator_timeout.count() > 0 ? coordinator_timeout : step_timeout;
  }
  // A refresh (or drain) step waits for the library's own bound
  // (include/refit/refit.h): refresh_timeout, then at most two coordinator
  // calls that are not bounded by it (staged: the report, then the
  // withdrawal; or a registration), then the lease's release, plus a second
  // for the answer to come back; at least step_timeout. A rank that has not
  // answered by then broke that bound, and the run fails naming it.
  std::chrono::milliseconds refresh_step_timeout() const;
  std::string log_level = "warn";
  // Receivers in "mode": "staged", each refresh followed by a commit
  // (refit and no-dedup; broadcast ignores it).
  bool staged = false;
  // Serving readers in the receiver processes (agent.h), checking every
  // sample_every-th element of each segment per read.
  bool serve_check = false;
  int64_t sample_every = 4096;
  // The ranks' buffers on transparent huge pages (AgentSpec::huge_pages).
  bool huge_pages = true;
  // A rank killed (SIGKILL) during the last version's refresh, once
  // `fraction` of the version before's refresh wall time (an estimate of the
  // last one's) has passed since the refresh command went out. Needs
  // versions >= 2; with 3 or more the estimate is of a warm refresh (the
  // first one also plans and connects). refit and no-dedup; broadcast
  // ignores it.
  //
  // With rejoin, the kill lands in the refresh of the version before the
  // last (needs versions >= 3), and a standby process, forked at the start
  // with the others, takes the killed rank before the last version: a
  // receiver joins with the rank; a source joins, fills and publishes the
  // next version. The last version must then refresh and verify on every
  // receiver. The killed version may fail (it is then not counted as
  // completed, and its error is kept in RunResult::kill_error); the run
  // succeeds when everything after it verifies and, staged, the ranks that
  // lost that refresh still held the version before it.
  //
  // A killed rank stays registered until the coordinator declares it dead
  // (heartbeat_timeout); the replacement joins again until then.
  struct Kill {
    bool receiver = false;  // else a source
    int32_t rank = 0;
    double fraction = 0.5;
    bool rejoin = false;
  };
  std::optional<Kill> kill;
  // Churn: before every version after the first, this many receivers leave
  // (refit_receiver_destroy) and rejoin with the same rank and buffers,
  // taken in turn over the ranks (refit and no-dedup; broadcast ignores it).
  int churn = 0;
  // Late join: when > first_version, the ranks of the last instance join
  // only at this version (their processes exist from the start, idle); the
  // versions before it refresh the other instances only, and from it on
  // every receiver must verify. Needs two instances or more.
  int64_t late_join_version = 0;
  // The embedded coordinator's heartbeat timeout (a silent member is
  // declared dead after it), and the agents' "heartbeat_ms" a quarter of it;
  // zero keeps both defaults (10 s and 1 s).
  std::chrono::milliseconds heartbeat_timeout{0};
  // Many hosts on this machine (hosts.h): the network namespace each
  // process runs in and the device its agent's "network.devices" names;
  // the coordinators run in coordinator_netns and listen on
  // coordinator_host. Ranks are the scenario's (no-dedup and broadcast keep
  // every rank where the scenario puts it; the broadcast's gatherer runs
  // where gatherer_netns says). Empty: everything on this host, on
  // network_devices.
  struct HostPlaces {
    std::vector<std::string> source_netns, source_device;      // by source rank
    std::vector<std::string> receiver_netns, receiver_device;  // by receiver rank
    std::string gatherer_netns, gatherer_device;
    std::string coordinator_netns, coordinator_host;
    // Every host's interface byte counters ({"<host>": {"rx_bytes",
    // "tx_bytes"}}), read just before each refresh command and once every
    // receiver answered; VersionResult::link_bytes holds the difference.
    std::function<Result<nlohmann::json>()> counters;
  };
  std::optional<HostPlaces> hosts;
  // A host's link taken down (set_link(false)) during the refresh of the
  // version before the last (needs versions >= 3), once `fraction` of the
  // version before's refresh wall time has passed since the refresh
  // command went out, for `seconds` (0: until every receiver answered),
  // then up again (set_link(true)). Every receiver must answer within
  // refresh_step_timeout(). The receivers on that host may fail that
  // version (staged: still holding the version before, every byte); when
  // the host holds no source, every other receiver must complete it (with
  // sources there, whether the others can depends on a replica elsewhere,
  // and RunResult::partition_failed says). The last version must then
  // verify on every receiver (refit and no-dedup; broadcast ignores it).
  struct Partition {
    std::string host;  // its name, for the result
    double fraction = 0.5;
    double seconds = 0;
    std::function<Status(bool up)> set_link;
    std::vector<int32_t> receivers;  // the receiver ranks on that host
    bool holds_sources = false;      // some source rank runs on that host
  };
  std::optional<Partition> partition;
  // The coordinator's Prometheus metrics (transport/control/fleet_metrics.h)
  // served on this "HOST:PORT" while the run lasts (port 0: any free one;
  // the port goes to on_metrics); empty: none. refit and no-dedup only,
  // one strategy at a time. After the last version the coordinator stays
  // up until one more scrape was answered, at most metrics_final_scrape,
  // so that a scraper sees the whole run.
  std::string metrics_address;
  std::chrono::milliseconds metrics_final_scrape{30000};
  std::function<void(uint16_t port)> on_metrics;
  // Every receiver agent writes its trace ("trace", plugin/trace.h) to a
  // file of its own in this folder (receiver-RANK-N.json); empty: none.
  std::string trace_dir;
  // Called after each step: what was done, steps done, steps in all.
  std::function<void(const std::string& step, int done, int total)> progress;
};

struct VersionResult {
  int64_t version = 0;
  // Monotonic clock (ns): when this version's work began (the sources'
  // fill) and when its verification ended.
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  // From the refresh command to the last receiver done; broadcast: from the
  // gatherer's refresh command to the last receiver's copy done.
  double seconds = 0;
  double unpack_seconds = 0;  // broadcast: the slowest receiver's copy
  // The slowest receiver's report "seconds.total" (broadcast: stage 2's).
  double refresh_seconds = 0;
  // The slowest receiver's pause: direct, its report's "pause_seconds" (the
  // refresh); staged, the commit's "pause_seconds"; broadcast, its copy out.
  double pause_seconds = 0;
  // The sources' publish of the version, all at once: from the command to
  // the last source's return (with "quantize": "source", their conversions).
  double publish_seconds = 0;
  // CPU time of the run's processes (every rank and refit-bench with its
  // coordinator) over the same span as `seconds` (processes_cpu_seconds):
  // what the strategy's refresh cost in CPU, whatever else the machine ran.
  double cpu_seconds = 0;
  // The machine's busy CPU time over that span, all cores and every process
  // (machine_busy_seconds): cores x seconds when the machine was saturated.
  double machine_cpu_seconds = 0;
  int64_t network_bytes = 0;  // the receivers' reports summed (broadcast: the gatherer's too)
  int64_t local_bytes = 0;
  bool verified = false;
  // hosts: every host's interface bytes over the refresh
  // ({"<host>": {"rx_bytes", "tx_bytes"}}); null otherwise.
  nlohmann::json link_bytes;
  // per receiver rank (broadcast: stage 2); staged: the reports after commit
  std::vector<nlohmann::json> reports;
  // churn: the receivers that left and rejoined before this version, and
  // the slowest one's leave and join (0 when none did).
  std::vector<int32_t> rejoined;
  double rejoin_seconds = 0;
};

// Resident memory (VmRSS, KiB) of one long-lived process: the bench itself
// (with the coordinator), a source or a receiver rank's process, sampled
// after the first version it took part in and after the last.
struct ResidentSample {
  std::string process;  // "refit-bench", "source 0", "receiver 1", ...
  int64_t pid = 0;
  int64_t first_version = 0;
  int64_t first_kib = 0;
  int64_t last_version = 0;
  int64_t last_kib = 0;
  // Allocated with malloc and not freed (heap_in_use_kib), at the same times.
  int64_t first_heap_kib = 0;
  int64_t last_heap_kib = 0;
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
  int64_t killed_version = 0;  // the version whose refresh the kill hit
  // What the killed version's refresh ended with: the first error among the
  // receivers, or "" when every surviving receiver completed and verified it.
  std::string kill_error;
  // The kill landed after every refresh of the killed version had returned
  // (`killed` then ends with ", after every refresh had returned"): that
  // version completed as if no kill had been asked for, so the run tested
  // nothing about a kill. Its status is OK when everything verified; the
  // caller reports the run as untested (refit-bench exits 77, a test skips).
  bool kill_missed = false;
  // From the killed version's refresh command until every receiver left had
  // answered (completed or failed).
  double kill_refresh_seconds = 0;
  // Staged, a receiver killed: the ranks of its instance whose refresh
  // still returned OK and committed the version without it.
  std::vector<int32_t> committed_without_killed;
  // The receiver ranks (the killed one aside) whose refresh of the killed
  // version returned OK, in rank order.
  std::vector<int32_t> refreshed_without_killed;
  // kill with rejoin: who took the killed rank, and how long from the kill
  // until it had joined (it waits for the coordinator to declare the killed
  // one dead).
  std::string rejoined;
  double rejoin_seconds = 0;
  // churn: receivers that left and rejoined, and the slowest one's leave and
  // join of each version (VersionResult::rejoin_seconds).
  int64_t rejoins = 0;
  // late join: the instance, its receiver ranks, and the version they joined at.
  std::string late_joined;
  // partition: which host's link went down when and for how long, the
  // version it hit, how long that refresh took until every receiver had
  // answered, the receiver ranks whose refresh failed and the first error,
  // and (staged, when some failed) whether those still hold the version
  // before, every byte checked.
  std::string partitioned;
  int64_t partitioned_version = 0;
  double partition_refresh_seconds = 0;
  std::vector<int32_t> partition_failed;
  std::string partition_error;
  std::optional<bool> partition_live_intact;
  // The link went down only after every refresh of that version had
  // returned: the partition tested nothing (as kill_missed).
  bool partition_missed = false;
  // Every long-lived process, in spawn order, the bench itself first.
  std::vector<ResidentSample> resident;
  bool verified() const;  // status ok and every version verified
  double median_seconds() const;
  double median_refresh_seconds() const;
  double median_pause_seconds() const;
  double median_publish_seconds() const;
  double median_cpu_seconds() const;
  double median_machine_cpu_seconds() const;
  double median_rejoin_seconds() const;  // of the versions that had churn
  double max_rejoin_seconds() const;
  int64_t resident_first_kib() const;  // summed over `resident`
  int64_t resident_last_kib() const;
  int64_t heap_first_kib() const;  // summed over `resident`
  int64_t heap_last_kib() const;
  // The largest last_kib - first_kib of one process, and which.
  int64_t resident_max_growth_kib(std::string* process = nullptr) const;
};

RunResult run_refreshes(const Layout& layout, Strategy strategy, const RunOptions& options);

// Runs several strategies at once, each with processes of its own, taking
// turns version by version: strategy 0's set-up and version 1, strategy 1's
// set-up and version 1, .., then every strategy's version 2, and so on; a
// run holds its turn from the sources' fill through the verification (and
// its shutdown after its last version), so that no two runs' work overlaps
// while a change of the machine's load between versions affects every
// strategy alike. options[i] belongs to strategies[i] (its progress
// callback is called on that run's thread). Refit and no-dedup only, without
// kill, churn or late join (their results say so otherwise). Every process
// of every run is forked before the first thread starts, so the calling
// process must have no threads yet, as for run_refreshes; all runs' processes
// are alive together (the memory of every strategy at once).
std::vector<RunResult> run_interleaved(const Layout& layout, const std::vector<Strategy>& strategies,
                                       const std::vector<RunOptions>& options);

// The config document of an agent, as refit.h documents it.
struct AgentPlace {
  bool receiver = false;
  int32_t rank = 0;
  int32_t domain = 0;
  int32_t instance = 0;
  std::string device;  // its host's interface; "" : RunOptions::network_devices
};
std::string agent_config(const AgentPlace& place, const std::string& coordinator_address,
                         const std::string& token_file, const RunOptions& options);

}  // namespace refit::bench
