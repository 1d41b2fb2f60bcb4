#pragma once
// The refresh session: what one refresh asks of the coordinator and how it
// decides. One attempt chooses the version (waiting until it is published),
// leases it and keeps the lease renewed, fetches and compiles the plan part
// of the current membership (cached per epoch), has the transfer executor
// run it, verifies what landed and releases the lease. Between attempts
// the session decides on a failure's reason (planner/status.h) whether a
// new attempt can fix it; staged mode ends with the instance's barrier.
// Every coordinator call is bounded by the refresh's deadline.
//
// Threads: the refresh's (the caller's, or the agent's refresh thread);
// the lease keeper and the transfer's threads are started through the
// ThreadFactory and joined before the attempt returns.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/coordinator_link.h"
#include "plugin/log.h"
#include "plugin/receiver/plan_compiler.h"
#include "plugin/receiver/resources.h"
#include "plugin/receiver/state.h"
#include "transport/common/threads.h"
#include "plugin/receiver/transfer_executor.h"
#include "plugin/trace.h"

namespace refit::plugin::receiver {

// What one refresh did, for its report (include/refit/refit.h,
// refit_receiver_report).
struct RefreshReport {
  int64_t version = 0;
  PlanEpoch epoch;
  uint64_t local_bytes = 0;
  int64_t minimum_network_bytes = -1;
  bool solo = false;
  uint64_t retries = 0;
  double plan_s = 0, total_s = 0;
  TransferReport transfer;
  bool verified = false;  // "verify" ran and passed
  uint64_t verified_boxes = 0, verified_bytes = 0, unverified_bytes = 0;
  double verify_s = 0;
  bool touched = false;  // some attempt began writing the buffers
};

// The report as JSON (include/refit/refit.h, refit_receiver_report).
std::string report_json(const RefreshReport& r, const Status& status, const AgentConfig& config);

class RefreshSession {
 public:
  // `enter` is told each state the refresh reaches. `trace` (borrowed; null:
  // none) records the refresh's steps; `progress` (borrowed; null: none)
  // is told the bytes of the transfer as they land.
  RefreshSession(CoordinatorLink& link, const AgentConfig& config, const Log& log, Resources& resources,
                 const ThreadFactory& threads, std::function<void(ReceiverState)> enter, Trace* trace = nullptr,
                 Progress* progress = nullptr);

  // One attempt to refresh to `requested` (-1: the latest). `compiled`
  // holds the part of the last epoch this rank fetched, and is replaced
  // when the membership changed.
  Status attempt(int64_t requested, Clock::time_point deadline, std::shared_ptr<const CompiledPart>* compiled,
                 RefreshReport* report);
  // Whether a new attempt can fix what `st` says failed: a peer that died
  // or left (the coordinator replans without it), or ranks of the domain
  // on different memberships. Not an abort of the instance, a lost lease, a
  // verification mismatch, a missing thread, nor bad input.
  static bool retryable(const Status& st);
  // Staged mode: says how this rank did and waits for the instance's word.
  // Ok: the instance committed `version`.
  Status barrier(const Status& st, int64_t version, Clock::time_point deadline);

 private:
  struct Lease {
    int64_t version = 0;
    std::chrono::milliseconds timeout{60000};
  };
  Result<Lease> lease(int64_t requested, Clock::time_point deadline);
  Status wait_for_version(int64_t want, int64_t requested, const std::string& drained, Clock::time_point deadline,
                          int64_t* latest);
  Status fetch_plan(Clock::time_point deadline, std::shared_ptr<const CompiledPart>* compiled);
  control::MessageLimits part_limits() const;
  Status transfer(const CompiledPart& part, int64_t version, Clock::time_point deadline, RefreshReport* report);
  TransferWatch watch(const CompiledPart& part, int64_t version, Clock::time_point deadline);
  Status verify(int64_t version, Clock::time_point deadline, RefreshReport* report);
  Status withdraw(int64_t version);

  CoordinatorLink& link_;
  const AgentConfig& config_;
  const Log& log_;
  Resources& resources_;
  const ThreadFactory& threads_;
  std::function<void(ReceiverState)> enter_;
  Trace* trace_;
  Progress* progress_;
};

}  // namespace refit::plugin::receiver
