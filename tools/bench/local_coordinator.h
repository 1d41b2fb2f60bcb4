#pragma once
// A coordinator embedded in the calling process (transport/control's
// Coordinator on 127.0.0.1 or a given address, any free port) with a fresh random token in a
// private temporary file, for the bench and the tests. Its log lines are kept
// (the last few) instead of printed, so that a failure can show them.
//
// Starting it starts threads: fork every child before, not after.
// Thread safety: logs() may be called from any thread.

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "planner/status.h"
#include "transport/control/coordinator.h"
#include "transport/control/fleet_metrics.h"

namespace refit::bench {

class LocalCoordinator {
 public:
  // heartbeat_timeout: how long a member may be silent before the
  // coordinator declares it dead; zero keeps the coordinator's default.
  // host: the address it listens on (the calling thread's network
  // namespace; see hosts.h's NetnsScope).
  // metrics: "HOST:PORT" to serve the coordinator's metrics on
  // (transport/control/fleet_metrics.h), port 0 for any free one; empty: none.
  // relayout_below_bytes: its plans' PlanOptions::relayout_below_bytes
  // (docs/refresh.md, "Column-major receivers"); 0: never.
  static Result<std::unique_ptr<LocalCoordinator>> start(
      std::chrono::milliseconds heartbeat_timeout = std::chrono::milliseconds(0), const std::string& host = "127.0.0.1",
      const std::string& metrics = "", int64_t relayout_below_bytes = 0);
  ~LocalCoordinator();  // stops it and removes the token file
  LocalCoordinator(const LocalCoordinator&) = delete;
  LocalCoordinator& operator=(const LocalCoordinator&) = delete;

  // "HOST:PORT"
  const std::string& address() const { return address_; }
  const std::string& token_file() const { return token_file_; }
  // The metrics endpoint's port (0: none) and the scrapes it answered.
  uint16_t metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }
  uint64_t scrapes() const { return metrics_server_ ? metrics_server_->counts().served : 0; }
  // The last log lines, one per line; "" when there were none.
  std::string logs() const;
  void stop();

 private:
  LocalCoordinator() = default;
  std::unique_ptr<control::Coordinator> coordinator_;
  std::unique_ptr<control::MetricsServer> metrics_server_;  // stopped before coordinator_
  std::string address_, token_file_;
  mutable std::mutex mu_;
  std::deque<std::pair<std::string, int>> logs_;  // each line and how many times in a row; guarded by mu_
};

// Writes a fresh random token (64 hex digits) to a new private file under
// $TMPDIR (or /tmp) and returns its path.
Result<std::string> write_token_file();

}  // namespace refit::bench
