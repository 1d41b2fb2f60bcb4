#pragma once
// The receiver agent, inside an inference process (include/refit/refit.h,
// refit_receiver_*): registers the server's buffers, and on refresh pulls
// this rank's part of the plan from the sources over the network and passes
// the slices it pulled for its domain on to the other ranks of the domain
// over the local fabric, each as soon as it has landed (docs/receiver.md).
//
// It drives one state machine (plugin/receiver/state.h):
//
//   idle --join--> joined --version published--> version known
//     --lease granted--> leased --plan part compiled--> transferring
//     --every GET and send done--> landed --hashes match ("verify")--> verified
//   verified --direct--> committed
//   verified --staged: report staged; the instance's commit--> staged --commit()--> committed
//   version known .. verified --failure--> failed --retryable reason, time left--> joined (next attempt)
//   staged barrier --the instance's abort--> aborted
//   committed | failed | aborted --refresh--> joined ...
//
// Its parts, each with one job (plugin/receiver/):
//   resources.h          buffers, registrations, staging copies, landing ring, endpoints;
//   plan_compiler.h      the typed plan part in, GETs, sends and their dependencies out (pure);
//   transfer_executor.h  the GET engine, the fan-out and the landing ring of one attempt,
//                        with the threads it owns and always joins;
//   refresh_session.h    the coordinator's side of a refresh: version, lease, plan,
//                        verification, retries on typed reasons, the staged barrier.
//
// Direct mode writes into the server's buffers (the server pauses for the
// whole refresh; a failure leaves them torn). Staged mode writes into
// staging copies the agent allocates and registers instead, while the server
// goes on reading the live buffers; then it reports "staged v" and waits for
// the coordinator's commit (every rank of the instance staged) or abort, and
// commit() copies the bytes the refresh wrote into the live buffers: the
// only pause. A failure anywhere in the instance leaves the live buffers on
// the old version.
//
// Threads: the caller's thread runs every public method (one at a time, as
// the C ABI says) except that refresh_start() moves the refresh itself to a
// thread of the agent; until it has finished, only poll/wait/report/version/
// state and the destructor may be called. `state_` and `version_` are
// atomics that any thread may read; everything else belongs to whichever
// thread runs the refresh, and to the caller's thread between refreshes.
// Every thread the agent starts goes through its ThreadFactory (a thread
// the system refuses is a Status) and is joined before the refresh returns.
// One thread lives longer: summary_thread_, which sends the refresh
// summaries for the coordinator's metrics (summary_mu_ guards its queue),
// joined by the destructor, which gives the summaries still queued at most
// kSummaryDrain (500 ms) together and drops the rest. A refused or failed
// summary thread only costs the metrics their summaries, never a refresh.
// The coordinator link and the transport objects the agent owns start
// their threads through the agent's factory too (the test-only
// "refuse_threads_after" counts them all).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/coordinator_link.h"
#include "plugin/describe.h"
#include "plugin/log.h"
#include "plugin/receiver/plan_compiler.h"
#include "plugin/receiver/refresh_session.h"
#include "plugin/receiver/resources.h"
#include "plugin/receiver/state.h"
#include "transport/common/threads.h"
#include "plugin/trace.h"

namespace refit::plugin {

class ReceiverAgent {
 public:
  static Result<std::unique_ptr<ReceiverAgent>> create(std::string_view config_json);
  ~ReceiverAgent();
  ReceiverAgent(const ReceiverAgent&) = delete;
  ReceiverAgent& operator=(const ReceiverAgent&) = delete;

  Status add_buffer(std::string_view description, void* data, uint64_t bytes);
  Status join();
  Status refresh(int64_t version, std::chrono::milliseconds timeout);
  Status refresh_start(int64_t version, std::chrono::milliseconds timeout);
  // nullopt while the started refresh runs.
  std::optional<Status> refresh_poll();
  std::optional<Status> refresh_wait(std::chrono::milliseconds timeout);
  bool refresh_running() const;
  // Staged mode: copies the staged version into the live buffers (the
  // server pauses around it). Fails when no version is staged.
  Status commit();
  // The last refresh's report. The string stays where it is until the next
  // refresh starts: commit() adds a newer report beside it.
  const std::string& report() const { return reports_.back(); }
  int64_t version() const { return version_.load(); }
  receiver::ReceiverState state() const { return state_.load(); }
  // Where the refresh stands; any thread (receiver::Progress).
  const receiver::Progress& progress() const { return progress_; }

 private:
  explicit ReceiverAgent(AgentConfig config);
  void enter(receiver::ReceiverState s) { state_.store(s); }
  Status refresh_now(int64_t version, std::chrono::milliseconds timeout);
  Status attempts(int64_t version, std::chrono::steady_clock::time_point deadline, receiver::RefreshReport* report);
  void finish(const Status& status, const receiver::RefreshReport& report);
  // Tells the coordinator what a refresh or commit did, for its metrics
  // (transport/control/fleet_metrics.h), without making the caller wait:
  // the summary is queued for summary_thread_, which sends each with one
  // request bounded by kSummaryBound and logs (never returns) a failure.
  void send_summary(const control::RefreshSummary& summary);
  void summary_loop();
  void stop_summaries();  // sends what is queued within kSummaryDrain, then joins summary_thread_

  AgentConfig config_;
  Log log_;
  std::shared_ptr<const RecipeLayout> recipe_;
  ThreadFactory threads_;
  std::unique_ptr<receiver::Resources> resources_;
  std::unique_ptr<CoordinatorLink> link_;
  std::unique_ptr<Trace> trace_;  // "trace"; null: none
  std::shared_ptr<const receiver::CompiledPart> compiled_;  // the part of compiled_->epoch
  bool joined_ = false;
  bool changed_ = false;  // buffers or the fabric's contact changed since the registration
  std::atomic<receiver::ReceiverState> state_{receiver::ReceiverState::kIdle};
  std::atomic<int64_t> version_{0};
  receiver::Progress progress_;
  // Staged mode: the version the instance committed, waiting for commit(),
  // and the byte ranges of each buffer it wrote.
  int64_t staged_version_ = 0;
  std::vector<receiver::Ranges> staged_ranges_;
  // The reports since the last refresh started, newest last (a deque keeps
  // each string where it is).
  std::deque<std::string> reports_{std::string("{}")};

  // The summaries waiting to be sent, oldest first (at most
  // kMaxQueuedSummaries: more are dropped, with a log line); all guarded by
  // summary_mu_. summary_thread_ starts with the first summary.
  std::mutex summary_mu_;
  std::condition_variable summary_cv_;
  std::deque<control::RefreshSummary> summaries_;
  bool summary_stop_ = false;
  std::chrono::steady_clock::time_point summary_drain_until_;  // once summary_stop_
  std::thread summary_thread_;

  // The started refresh (refresh_start).
  mutable std::mutex async_mutex_;
  std::condition_variable async_cv_;
  std::thread async_;
  bool async_done_ = true;  // guarded by async_mutex_
  Status async_status_;     // guarded by async_mutex_
};

}  // namespace refit::plugin
