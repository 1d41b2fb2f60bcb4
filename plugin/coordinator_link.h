#pragma once
// An agent's connection to the coordinator: starts an embedded coordinator
// when the config says so, connects and authenticates as the agent's role
// (transport/control/auth.h), and keeps the agent's members alive with a
// heartbeat thread.
//
// Threads. A reader thread of the link reads every frame the coordinator
// sends, as it arrives: a reply goes to the request that waits for its id
// (one that timed out is dropped, never read by a later request), a notice
// to the queue that wait_notice() waits on (no polling). Requests from any
// thread, the heartbeat thread's included, go out concurrently, each waiting
// for its own reply; none holds a lock across its wait.
//
// A broken connection (the coordinator closed it, a frame failed its seal,
// the network dropped) is reconnected by the next call, within that call's
// deadline. A call that waits for its reply looks at the connection every
// kStallCheck: one whose host has acknowledged nothing for a second while
// the kernel retransmits (a partition, which TCP alone notices only after
// minutes, and after it heals only at its next backed-off retransmission)
// is taken for broken. A coordinator that is slow to answer is not: its
// host acknowledges the bytes, so no reconnection storm. On reconnecting,
// the link connects and authenticates again (in attempts of a second or
// two, so that a network that comes back is seen at once; "no route to
// host", which the kernel may still answer for a moment after a link came
// back, is tried again every 100 ms until the deadline), registers the
// member again with the registration it last sent, and subscribes again if
// it was subscribed. A request that was waiting when the connection broke is sent
// again on the new connection when it only reads or renews (heartbeat,
// subscribe, fetch_plan, version_hashes, verify_boxes, wait_drained); any
// other fails, saying it may or may not have been applied.
//
// The heartbeat thread sends one heartbeat per member every config.heartbeat
// and logs (does not stop on) a failed one. It waits for a heartbeat's reply
// only until the next is due: a reply may come seconds late, queued behind
// a plan part of megabytes that the coordinator sent first and the reader
// decodes first, while the coordinator has read the heartbeat long before.
// The next heartbeat goes out meanwhile, and the reader checks the late
// reply. A reply that the member is not registered means the coordinator
// declared it dead (its heartbeats came too late, e.g. on a starved
// machine, or a partition cut the host off): the link then says dropped(),
// stops heartbeating, and the agent registers again at its next join. Any
// other request answered so (reason not_registered) says dropped() too: it
// may hear first.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/log.h"
#include "transport/common/threads.h"
#include "transport/control/auth.h"
#include "transport/control/client.h"
#include "transport/control/coordinator.h"
#include "transport/control/fleet_metrics.h"
#include "transport/control/messages.h"

namespace refit::plugin {

class CoordinatorLink {
 public:
  // Every thread of the link (its reader, its heartbeat, an embedded
  // coordinator's) starts through `threads`: a refused one fails the call
  // that needed it (connect, a request that reconnects, start_heartbeat).
  static Result<std::unique_ptr<CoordinatorLink>> connect(const AgentConfig& config, const Log& log,
                                                          const ThreadFactory& threads = {});
  ~CoordinatorLink();
  CoordinatorLink(const CoordinatorLink&) = delete;
  CoordinatorLink& operator=(const CoordinatorLink&) = delete;

  // One request and its reply within config.coordinator.timeout; the error
  // names the request.
  Result<control::Json> request(control::MsgType type, const control::Json& body);
  // The same, given up at `until` too if that comes first (a refresh's
  // deadline covers its coordinator calls).
  Result<control::Json> request(control::MsgType type, const control::Json& body,
                                std::chrono::steady_clock::time_point until);
  // The next notice of `type` that arrives before `deadline`; notices of
  // other types that arrive meanwhile are dropped. nullopt on timeout.
  Result<std::optional<control::Json>> wait_notice(control::MsgType type,
                                                   std::chrono::steady_clock::time_point deadline);
  // The same for any of `types`; the frame says which came.
  Result<std::optional<control::Frame>> wait_notice_of(std::initializer_list<control::MsgType> types,
                                                       std::chrono::steady_clock::time_point deadline);

  // Starts heartbeating `member` (once registered; clears dropped());
  // stop_heartbeat() ends it. A refused thread is the error.
  Status start_heartbeat(control::MemberRef member);
  void stop_heartbeat();
  // The coordinator no longer holds the member: it was declared dead.
  bool dropped() const { return dropped_.load(std::memory_order_acquire); }

  // The embedded coordinator's port (0 when not embedded).
  uint16_t embedded_port() const;
  // The embedded coordinator's metrics endpoint's port (0: none).
  uint16_t metrics_port() const { return metrics_server_ ? metrics_server_->port() : 0; }
  // Connections made so far (1 after connect(); one more per reconnection).
  uint64_t connections() const { return connections_.load(); }

 private:
  using Clock = std::chrono::steady_clock;
  // How often a call waiting for its reply looks whether its connection
  // has stopped moving bytes (see above).
  static constexpr std::chrono::milliseconds kStallCheck{100};
  // One connection: its socket, read by reader_, written under write_mu_.
  struct Connection {
    int fd = -1;
    int wake[2] = {-1, -1};  // written by close_connection to end reader_
    std::mutex write_mu;
    control::FrameSealer sealer;  // guarded by write_mu
    std::thread reader;
    int users = 0;  // requests writing to it without mu_; guarded by mu_. Not freed while > 0.
  };

  CoordinatorLink(const AgentConfig& config, const Log& log) : config_(config), log_(log) {}
  // Connects and authenticates a new connection before `deadline`, then
  // replays the registration and the subscription. Caller holds mu_ (lock).
  Status reconnect(std::unique_lock<std::mutex>& lock, Clock::time_point deadline);
  // reply_by: a heartbeat's reply not come by then is left to the reader
  // (late_heartbeats_) and *left set; nothing else passes it.
  Result<control::Json> request_until(control::MsgType type, const control::Json& body, Clock::time_point deadline,
                                      Clock::time_point reply_by = Clock::time_point::max(), bool* left = nullptr);
  Status connect_once(Clock::time_point deadline, std::unique_lock<std::mutex>& lock);
  void reader_loop(Connection* c, control::FrameDecoder decoder, uint64_t generation);
  void broken(uint64_t generation, const std::string& why);  // caller holds mu_
  void close_connection();                                   // caller holds mu_
  // Sends one request on the current connection and waits for its reply.
  // Caller holds mu_ (lock); it is released while waiting.
  Result<control::Frame> exchange(std::unique_lock<std::mutex>& lock, control::MsgType type,
                                  const control::Json& body, Clock::time_point deadline, bool* lost,
                                  Clock::time_point reply_by = Clock::time_point::max(), bool* left = nullptr);
  void heartbeat_loop();
  // A heartbeat's reply: a member the coordinator no longer holds is
  // dropped (see above). Caller holds mu_.
  void heartbeat_answered(const Result<control::Json>& reply);

  AgentConfig config_;
  const Log& log_;
  ThreadFactory threads_;
  control::Credential credential_;
  control::AuthRole role_ = control::AuthRole::kAny;
  uint16_t port_ = 0;
  std::unique_ptr<control::Coordinator> embedded_;
  std::unique_ptr<control::MetricsServer> metrics_server_;  // of embedded_; stopped before it

  // Guards everything below, up to hb_mutex_.
  std::mutex mu_;
  std::condition_variable cv_;  // a reply, a notice, or the connection broke
  std::unique_ptr<Connection> conn_;
  std::vector<std::unique_ptr<Connection>> retired_;  // broken connections whose reader is joined at close
  uint64_t generation_ = 0;   // of conn_; bumped per connection
  bool up_ = false;           // conn_ is connected and not known broken
  bool connecting_ = false;   // a thread is in reconnect(); others wait for it
  std::string broken_why_;    // why the last connection broke
  bool closing_ = false;      // the destructor runs
  uint32_t next_id_ = 1;
  // Requests waiting for their replies, by id: the reply once it came.
  std::map<uint32_t, std::optional<control::Frame>> pending_;
  std::deque<control::Frame> notices_;  // at most kMaxNotices
  static constexpr size_t kMaxNotices = 1024;
  // Heartbeats whose replies the reader checks when they come, by id; the
  // oldest forgotten past kMaxLateHeartbeats, all at a new connection.
  std::deque<uint32_t> late_heartbeats_;
  static constexpr size_t kMaxLateHeartbeats = 64;
  // What a new connection sends again (see above).
  std::optional<std::pair<control::MsgType, control::Json>> registration_;
  bool subscribed_ = false;
  std::optional<control::MemberRef> member_;
  std::atomic<uint64_t> connections_{0};

  std::mutex hb_mutex_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;  // guarded by hb_mutex_
  std::atomic<bool> dropped_{false};
  std::thread heartbeat_;
};

}  // namespace refit::plugin
