#pragma once
// An agent's connection to the coordinator: starts an embedded coordinator
// when the config says so, connects and authenticates, and keeps the
// agent's members alive with a heartbeat thread.
//
// Threads: the Client belongs to one thread at a time, so every use of it
// goes through mutex_; a call holds it for one request (or one short wait
// for a notice), never across a whole refresh, so heartbeats go on while an
// agent moves data. The heartbeat thread sends one heartbeat per member
// every config.heartbeat and logs (does not stop on) a failed one. A reply
// that the member is not registered means the coordinator declared it dead
// (its heartbeats came too late, e.g. on a starved machine): the link then
// says dropped(), stops heartbeating, and the agent registers again at its
// next join.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/log.h"
#include "transport/control/client.h"
#include "transport/control/coordinator.h"
#include "transport/control/messages.h"

namespace refit::plugin {

class CoordinatorLink {
 public:
  static Result<std::unique_ptr<CoordinatorLink>> connect(const AgentConfig& config, const Log& log);
  ~CoordinatorLink();
  CoordinatorLink(const CoordinatorLink&) = delete;
  CoordinatorLink& operator=(const CoordinatorLink&) = delete;

  // One request and its reply; the error names the request.
  Result<control::Json> request(control::MsgType type, const control::Json& body);
  // The next notice of `type` that arrives before `deadline`; notices of
  // other types that arrive meanwhile are dropped. nullopt on timeout.
  Result<std::optional<control::Json>> wait_notice(control::MsgType type,
                                                   std::chrono::steady_clock::time_point deadline);
  // The same for any of `types`; the frame says which came.
  Result<std::optional<control::Frame>> wait_notice_of(std::initializer_list<control::MsgType> types,
                                                       std::chrono::steady_clock::time_point deadline);

  // Starts heartbeating `member` (once registered; clears dropped());
  // stop_heartbeat() ends it.
  void start_heartbeat(control::MemberRef member);
  void stop_heartbeat();
  // The coordinator no longer holds the member: it was declared dead.
  bool dropped() const { return dropped_.load(std::memory_order_acquire); }

  // The embedded coordinator's port (0 when not embedded).
  uint16_t embedded_port() const;

 private:
  CoordinatorLink(const AgentConfig& config, const Log& log) : config_(config), log_(log) {}
  void heartbeat_loop();

  AgentConfig config_;
  const Log& log_;
  std::unique_ptr<control::Coordinator> embedded_;
  std::mutex mutex_;  // guards client_ and member_
  std::unique_ptr<control::Client> client_;
  std::optional<control::MemberRef> member_;
  std::mutex hb_mutex_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;  // guarded by hb_mutex_
  std::atomic<bool> dropped_{false};
  std::thread heartbeat_;
};

}  // namespace refit::plugin
