#include "plugin/coordinator_link.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace refit::plugin {

using control::Frame;
using control::Json;
using control::MsgType;
using std::chrono::duration_cast;
using std::chrono::milliseconds;

namespace {

// A request whose second sending changes nothing the first did not: sent
// again when the connection broke before its reply came.
bool retriable(MsgType t) {
  return t == MsgType::kHeartbeat || t == MsgType::kSubscribe || t == MsgType::kFetchPlan ||
         t == MsgType::kVersionHashes || t == MsgType::kVerifyBoxes || t == MsgType::kWaitDrained;
}

bool is_notice(MsgType t) {
  return t == MsgType::kVersionNotify || t == MsgType::kCommit || t == MsgType::kAbort || t == MsgType::kDrained;
}

// Writes all of `data` to the non-blocking `fd` before `deadline`.
Status write_all(int fd, const uint8_t* data, size_t size, std::chrono::steady_clock::time_point deadline) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::send(fd, data + done, size - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left = duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return Status::timeout("the coordinator did not take the request in time");
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
      continue;
    }
    return Status::io_error(std::string("cannot send to the coordinator: ") + std::strerror(errno));
  }
  return Status::ok();
}

// How long a connection may go without its host acknowledging any byte
// sent, with bytes waiting for it and the kernel retransmitting, before the
// link takes it for dropped by the network (a partition, a host gone).
constexpr milliseconds kStalled{1000};
// A connection attempt's first slice (then kConnectSlice * 2): a SYN sent
// while the network was down is retransmitted with backoff (1 s, 3 s, 7 s,
// ...), so after the network heals a new attempt is quicker than waiting.
constexpr milliseconds kConnectSlice{1000};
// Between connection attempts that found no route to the coordinator.
constexpr milliseconds kUnreachablePause{100};

// Why the connection on `fd` has stopped moving bytes, or "" while it
// moves them. The evidence is the kernel's (TCP_INFO): bytes sent and not
// acknowledged, retransmitted at least twice without an acknowledgement,
// and none for kStalled. A coordinator that is slow to answer (planning,
// starved) is not taken for gone: its host acknowledges what it receives,
// whether or not the coordinator reads it.
std::string stalled(int fd) {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return "";
  if (info.tcpi_unacked == 0 || info.tcpi_retransmits < 2 || info.tcpi_last_ack_recv < kStalled.count()) return "";
  return "the coordinator's host acknowledged nothing for " + std::to_string(info.tcpi_last_ack_recv) +
         " ms, with " + std::to_string(info.tcpi_unacked) + " segments unacknowledged and " +
         std::to_string(static_cast<unsigned>(info.tcpi_retransmits)) +
         " retransmissions (the network dropped the connection)";
}

}  // namespace

Result<std::unique_ptr<CoordinatorLink>> CoordinatorLink::connect(const AgentConfig& config, const Log& log,
                                                                   const ThreadFactory& threads) {
  Result<control::Credential> credential = control::read_credential_file(config.coordinator.token_file);
  if (!credential.is_ok()) return credential.status().with_context("config: \"coordinator.token_file\"");
  std::unique_ptr<CoordinatorLink> link(new CoordinatorLink(config, log));
  link->threads_ = threads;
  link->credential_ = std::move(credential).value();
  link->role_ = config.receiver ? control::AuthRole::kReceiver : control::AuthRole::kSource;
  link->port_ = config.coordinator.port;
  if (config.coordinator.embedded) {
    if (link->credential_.bound) {
      return Status::invalid(
          "config: \"coordinator.embedded\": the embedded coordinator needs the token itself in "
          "\"coordinator.token_file\", not a role key (it derives every role's key from it)");
    }
    control::CoordinatorConfig cc;
    cc.host = config.coordinator.host;
    cc.port = config.coordinator.port;
    cc.token = link->credential_.token;
    cc.threads = threads;
    cc.relayout_below_bytes = config.coordinator.relayout_below_bytes;
    cc.relayout_staging_bytes = config.coordinator.relayout_staging_bytes;
    const Log* lp = &log;
    cc.log = [lp](const std::string& line) { lp->info("coordinator: " + line); };
    control::MetricsServerOptions metrics_options;
    metrics_options.threads = threads;
    auto fleet = std::make_shared<control::FleetMetrics>();
    if (!config.coordinator.metrics_host.empty()) {
      metrics_options.host = config.coordinator.metrics_host;
      metrics_options.port = config.coordinator.metrics_port;
      metrics_options.log = [lp](const std::string& line) { lp->info("coordinator: " + line); };
      if (!config.coordinator.metrics_token_file.empty()) {
        Result<std::string> bearer = control::read_token_file(config.coordinator.metrics_token_file);
        if (!bearer.is_ok()) return bearer.status().with_context("config: \"coordinator.metrics.token_file\"");
        metrics_options.bearer_token = std::move(bearer).value();
      }
      cc.metrics = fleet;
    }
    Result<std::unique_ptr<control::Coordinator>> started = control::Coordinator::start(std::move(cc));
    if (!started.is_ok()) {
      return started.status().with_context("config: \"coordinator.embedded\": cannot start the coordinator on " +
                                           config.coordinator.host + ":" + std::to_string(config.coordinator.port));
    }
    link->embedded_ = std::move(started).value();
    link->port_ = link->embedded_->port();
    if (!config.coordinator.metrics_host.empty()) {
      Result<std::unique_ptr<control::MetricsServer>> server =
          control::serve_metrics(*link->embedded_, fleet, std::move(metrics_options));
      if (!server.is_ok()) {
        link->embedded_->stop();
        return server.status().with_context("config: \"coordinator.metrics.address\"");
      }
      link->metrics_server_ = std::move(server).value();
      log.info("coordinator: metrics on http://" + config.coordinator.metrics_host + ":" +
               std::to_string(link->metrics_server_->port()) + "/metrics");
    }
  }
  std::unique_lock<std::mutex> lock(link->mu_);
  Status st = link->reconnect(lock, Clock::now() + config.coordinator.timeout);
  if (!st.is_ok()) return st.with_context("coordinator " + config.coordinator.host + ":" + std::to_string(link->port_));
  return link;
}

CoordinatorLink::~CoordinatorLink() {
  stop_heartbeat();
  std::vector<std::unique_ptr<Connection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    close_connection();
    all = std::move(retired_);
    cv_.notify_all();
  }
  for (auto& c : all) {
    if (c->reader.joinable()) c->reader.join();
    for (int fd : {c->fd, c->wake[0], c->wake[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }
  if (metrics_server_) metrics_server_->stop();
  if (embedded_) embedded_->stop();
}

uint16_t CoordinatorLink::embedded_port() const { return embedded_ ? embedded_->port() : 0; }

void CoordinatorLink::close_connection() {
  up_ = false;
  if (!conn_) return;
  ::shutdown(conn_->fd, SHUT_RDWR);
  const char c = 'x';
  (void)!::write(conn_->wake[1], &c, 1);
  retired_.push_back(std::move(conn_));
}

void CoordinatorLink::broken(uint64_t generation, const std::string& why) {
  if (generation != generation_ || !up_) return;
  up_ = false;
  broken_why_ = why;
  if (!closing_) log_.warn("coordinator connection: " + why + "; it is made again at the next call");
  if (conn_) ::shutdown(conn_->fd, SHUT_RDWR);
  cv_.notify_all();
}

Status CoordinatorLink::connect_once(Clock::time_point deadline, std::unique_lock<std::mutex>& lock) {
  close_connection();
  // Joined and closed outside the lock: a reader may be waiting for it. One
  // that a request still writes to is kept for later.
  std::vector<std::unique_ptr<Connection>> old, kept;
  for (auto& c : retired_) (c->users > 0 ? kept : old).push_back(std::move(c));
  retired_ = std::move(kept);
  lock.unlock();
  for (auto& c : old) {
    if (c->reader.joinable()) c->reader.join();
    for (int fd : {c->fd, c->wake[0], c->wake[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }
  old.clear();
  Result<std::unique_ptr<control::Client>> client = Status::timeout("no time left to connect");
  bool no_route = false;  // the last attempt found no route to the coordinator
  // In slices: an attempt that used all of its slice (its SYN or the
  // handshake went unanswered) is given up for a new one, so that a network
  // that comes back is noticed at once, not at the next SYN retransmission.
  // One that fails sooner (refused, or the coordinator said no) is the
  // answer, except "no route" (a timeout: the link was down, or the
  // neighbour entry still says so for a moment after it came back), tried
  // again after kUnreachablePause.
  for (milliseconds slice = kConnectSlice;; slice = kConnectSlice * 2) {
    const auto left = duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    control::ClientOptions options;
    options.timeout = std::min(left, slice);
    options.role = role_;
    options.on_cut = [this](const std::string& why, milliseconds pause) {
      log_.warn("coordinator connection: " + why + "; made again in " + std::to_string(pause.count()) + " ms");
    };
    const auto t0 = Clock::now();
    client = control::Client::connect(config_.coordinator.host, port_, credential_, options);
    no_route = false;
    if (client.is_ok() || options.timeout == left) break;
    if (Clock::now() - t0 < options.timeout) {
      if (client.status().code() != Code::kTimeout) break;
      no_route = true;
      std::this_thread::sleep_until(std::min(deadline, Clock::now() + kUnreachablePause));
    }
  }
  lock.lock();
  // Still no route at the deadline: an I/O error, as any failed connection.
  if (!client.is_ok() && no_route) return Status::io_error(client.status().message());
  if (!client.is_ok()) return client.status();
  if (closing_) return Status::io_error("the coordinator link is closing");
  control::AuthenticatedSocket sock = (*client)->release();
  auto c = std::make_unique<Connection>();
  c->fd = sock.fd;
  c->sealer = sock.sealer;
  if (::pipe2(c->wake, O_CLOEXEC) != 0) {
    ::close(c->fd);
    return Status::io_error(std::string("coordinator link: pipe: ") + std::strerror(errno));
  }
  ::fcntl(c->fd, F_SETFL, ::fcntl(c->fd, F_GETFL) | O_NONBLOCK);
  ++generation_;
  late_heartbeats_.clear();  // their replies went with the old connection
  const uint64_t gen = generation_;
  Connection* raw = c.get();
  // A reader that cannot start leaves the link unconnected: this call and
  // the requests waiting on it fail, and the next call tries again.
  Result<std::thread> reader = threads_.start(
      "coordinator link reader",
      [this, raw, gen, decoder = std::move(sock.decoder)]() mutable { reader_loop(raw, std::move(decoder), gen); },
      [this, gen](const Status& why) {
        std::lock_guard<std::mutex> guard(mu_);
        broken(gen, why.message());
      });
  if (!reader.is_ok()) {
    for (int fd : {c->fd, c->wake[0], c->wake[1]}) ::close(fd);
    broken_why_ = reader.status().message();
    return reader.status().with_context("coordinator link");
  }
  c->reader = std::move(reader).value();
  conn_ = std::move(c);
  up_ = true;
  ++connections_;
  return Status::ok();
}

Status CoordinatorLink::reconnect(std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
  while (connecting_) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && connecting_) {
      return Status::timeout("the coordinator connection is being made again and was not ready in time");
    }
  }
  if (up_) return Status::ok();
  if (closing_) return Status::io_error("the coordinator link is closing");
  connecting_ = true;
  const bool again = connections_.load() > 0;
  Status st = connect_once(deadline, lock);
  // A new connection is a new session to the coordinator: the member and
  // its subscription are made again on it.
  // The coordinator keeps the old connection's member until its heartbeat
  // timeout, and refuses the rank meanwhile: tried again until the deadline.
  while (st.is_ok() && again && registration_) {
    bool lost = false;
    const auto [type, body] = *registration_;
    Result<Frame> f = exchange(lock, type, body, deadline, &lost);
    Result<Json> r = f.is_ok() ? control::reply_result(control::type_name(type), std::move(f).value())
                               : Result<Json>(f.status());
    if (r.is_ok()) break;
    const bool held = r.status().reason() == Reason::kRankHeld;
    if (!held || !up_ || Clock::now() + milliseconds(100) >= deadline) {
      st = r.status().with_context("registering again on the new connection");
      break;
    }
    lock.unlock();
    std::this_thread::sleep_for(milliseconds(100));
    lock.lock();
  }
  if (st.is_ok() && again && subscribed_) {
    bool lost = false;
    Result<Frame> f = exchange(lock, MsgType::kSubscribe, Json::object(), deadline, &lost);
    Result<Json> r = f.is_ok() ? control::reply_result("subscribe", std::move(f).value()) : Result<Json>(f.status());
    if (!r.is_ok()) st = r.status().with_context("subscribing again on the new connection");
  }
  if (st.is_ok() && again) log_.info("coordinator connection made again; the member is registered again");
  if (!st.is_ok() && up_) broken(generation_, st.message());
  connecting_ = false;
  cv_.notify_all();
  return st;
}

Result<Frame> CoordinatorLink::exchange(std::unique_lock<std::mutex>& lock, MsgType type, const Json& body,
                                        Clock::time_point deadline, bool* lost, Clock::time_point reply_by,
                                        bool* left) {
  *lost = false;
  if (!up_ || !conn_) return Status::io_error("not connected to the coordinator: " + broken_why_);
  uint32_t id = next_id_++;
  if (id == 0) id = next_id_++;
  Result<std::vector<uint8_t>> bytes = control::encode_frame(type, body, control::kDefaultMaxFrameBytes, id);
  if (!bytes.is_ok()) return bytes.status();
  pending_[id];
  Connection* c = conn_.get();
  const uint64_t gen = generation_;
  ++c->users;
  lock.unlock();
  Status sent;
  {
    std::lock_guard<std::mutex> w(c->write_mu);
    sent = c->sealer.seal(*bytes);
    if (sent.is_ok()) sent = write_all(c->fd, bytes->data(), bytes->size(), deadline);
  }
  lock.lock();
  --c->users;
  if (!sent.is_ok()) {
    pending_.erase(id);
    // A frame cut short is never applied; one not sent at all neither.
    broken(gen, sent.message());
    return sent;
  }
  // In slices, to look at the connection between them: one that has
  // stopped moving bytes (stalled()) is broken now, so that the request is
  // sent again on a new connection within its deadline rather than wait for
  // TCP's backed-off retransmission after the network comes back.
  const auto answered = [&] {
    auto it = pending_.find(id);
    return (it != pending_.end() && it->second.has_value()) || generation_ != gen || !up_ || closing_;
  };
  const auto until = std::min(deadline, reply_by);
  while (!cv_.wait_until(lock, std::min(until, Clock::now() + kStallCheck), answered) && Clock::now() < until) {
    if (std::string why = stalled(c->fd); !why.empty()) broken(gen, why);
  }
  auto it = pending_.find(id);
  std::optional<Frame> reply = std::move(it->second);
  pending_.erase(it);
  if (reply) return std::move(*reply);
  if (left && generation_ == gen && up_ && !closing_ && reply_by < deadline) {
    late_heartbeats_.push_back(id);
    if (late_heartbeats_.size() > kMaxLateHeartbeats) late_heartbeats_.pop_front();
    *left = true;
    return Status::timeout(std::string(control::type_name(type)) + ": its reply is left to the reader");
  }
  if (generation_ != gen || !up_) {
    *lost = true;
    return Status::io_error("the coordinator connection broke before the reply came (" + broken_why_ + ")");
  }
  // Its reply, if it comes, is dropped by the reader: no later request reads it.
  return Status::timeout("no reply from the coordinator within " +
                         std::to_string(config_.coordinator.timeout.count()) + " ms");
}

Result<Json> CoordinatorLink::request(MsgType type, const Json& body) {
  return request(type, body, Clock::time_point::max());
}

Result<Json> CoordinatorLink::request(MsgType type, const Json& body, Clock::time_point until) {
  const char* name = control::type_name(type);
  const auto now = Clock::now();
  if (until <= now) return Status::timeout(std::string(name) + ": the deadline passed before it was sent");
  const bool by_until = until - now < config_.coordinator.timeout;
  const auto deadline = by_until ? until : now + config_.coordinator.timeout;
  Result<Json> r = request_until(type, body, deadline);
  if (by_until && r.status().code() == Code::kTimeout && Clock::now() >= until) {
    return Status::timeout(std::string(name) + ": no reply from the coordinator before the deadline");
  }
  return r;
}

Result<Json> CoordinatorLink::request_until(MsgType type, const Json& body, Clock::time_point deadline,
                                            Clock::time_point reply_by, bool* left) {
  const char* name = control::type_name(type);
  std::unique_lock<std::mutex> lock(mu_);
  for (int attempt = 0;; ++attempt) {
    // While a new connection is being made, its member is not registered
    // again yet: a request (a heartbeat, say) waits for that, or it would
    // read "not registered" and take the member for dead.
    if (!up_ || connecting_) {
      Status st = reconnect(lock, deadline);
      if (!st.is_ok()) return st.with_context(name);
    }
    bool lost = false;
    Result<Frame> f = exchange(lock, type, body, deadline, &lost, reply_by, left);
    if (left && *left) return f.status();
    if (f.is_ok()) {
      Result<Json> r = control::reply_result(name, std::move(f).value());
      if (r.is_ok()) {
        if (type == MsgType::kRegisterSource || type == MsgType::kRegisterReceiver) registration_.emplace(type, body);
        if (type == MsgType::kUnregister) registration_.reset();
        if (type == MsgType::kSubscribe) subscribed_ = true;
      }
      if (!r.is_ok()) {
        // Any request, not only a heartbeat, may be the first to hear that
        // the coordinator declared the member dead (a refresh right after a
        // partition healed, while the heartbeat's own request still waits):
        // dropped() then tells the agent to register again at once.
        if (r.status().reason() == Reason::kNotRegistered && member_) {
          member_.reset();
          registration_.reset();
          dropped_.store(true, std::memory_order_release);
          if (type != MsgType::kHeartbeat) {  // the heartbeat's own loop says it
            log_.warn(std::string(name) + ": " + r.status().message() +
                      ": the coordinator declared this member dead; it registers again at its next join");
          }
        }
        return r.status().with_context(name);
      }
      return r;
    }
    const bool again = !up_ && Clock::now() < deadline && attempt < 2 && (!lost || retriable(type));
    if (!again) {
      if (lost && !retriable(type)) {
        return f.status().with_context(std::string(name) + " (it may or may not have been applied)");
      }
      return f.status().with_context(name);
    }
  }
}

void CoordinatorLink::reader_loop(Connection* c, control::FrameDecoder decoder, uint64_t gen) {
  std::vector<uint8_t> buf(65536);
  // Whatever happens on this thread ends the connection with a log line,
  // never the process.
  try {
    for (;;) {
      // Frames the decoder holds already (some may have come with the handshake).
      for (;;) {
        Result<std::optional<Frame>> f = decoder.next();
        if (!f.is_ok()) {
          std::lock_guard<std::mutex> lock(mu_);
          log_.error("coordinator connection closed: " + f.status().message());
          broken(gen, f.status().message());
          return;
        }
        if (!f->has_value()) break;
        Frame frame = std::move(**f);
        std::lock_guard<std::mutex> lock(mu_);
        if (gen != generation_) return;
        if (frame.type == MsgType::kReply || frame.type == MsgType::kError) {
          auto it = pending_.find(frame.id);
          const bool error = frame.type == MsgType::kError;
          std::string reason;
          if (error && frame.body.is_object() && frame.body.contains("reason") && frame.body["reason"].is_string()) {
            reason = frame.body["reason"].get<std::string>();
          }
          auto late = std::find(late_heartbeats_.begin(), late_heartbeats_.end(), frame.id);
          if (it != pending_.end() && !it->second) {
            it->second = std::move(frame);
          } else if (late != late_heartbeats_.end()) {
            late_heartbeats_.erase(late);
            if (!error) heartbeat_answered(control::reply_result("heartbeat", std::move(frame)));
          } else if (!error) {
            log_.debug("coordinator connection: dropped the reply to request " + std::to_string(frame.id) +
                       ", which came after its request gave up");
          }
          if (error) {
            broken(gen, "the coordinator closed the connection: " + reason);
            return;
          }
          cv_.notify_all();
        } else if (is_notice(frame.type)) {
          if (notices_.size() >= kMaxNotices) {
            log_.warn(std::string("coordinator connection: more than ") + std::to_string(kMaxNotices) +
                      " notices unread; dropped the oldest");
            notices_.pop_front();
          }
          notices_.push_back(std::move(frame));
          cv_.notify_all();
        } else {
          broken(gen, std::string("the coordinator sent ") + control::type_name(frame.type) + ", out of order");
          return;
        }
      }
      pollfd p[2] = {{c->fd, POLLIN, 0}, {c->wake[0], POLLIN, 0}};
      const int n = ::poll(p, 2, -1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 || (p[1].revents & POLLIN) != 0) return;
      const ssize_t got = ::recv(c->fd, buf.data(), buf.size(), 0);
      if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (got <= 0) {
        std::lock_guard<std::mutex> lock(mu_);
        broken(gen, got == 0 ? std::string("the coordinator closed the connection")
                             : std::string("cannot read from the coordinator: ") + std::strerror(errno));
        return;
      }
      decoder.feed(buf.data(), static_cast<size_t>(got));
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    log_.error(std::string("coordinator connection: internal error: ") + e.what());
    broken(gen, std::string("internal error: ") + e.what());
  }
}

Result<std::optional<control::Json>> CoordinatorLink::wait_notice(MsgType type, Clock::time_point deadline) {
  Result<std::optional<control::Frame>> f = wait_notice_of({type}, deadline);
  if (!f.is_ok()) return f.status();
  if (!f->has_value()) return std::optional<control::Json>();
  return std::optional<control::Json>(std::move((**f).body));
}

Result<std::optional<control::Frame>> CoordinatorLink::wait_notice_of(std::initializer_list<MsgType> types,
                                                                       Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    while (!notices_.empty()) {
      Frame f = std::move(notices_.front());
      notices_.pop_front();
      for (MsgType t : types) {
        if (f.type == t) return std::optional<control::Frame>(std::move(f));
      }
    }
    if (closing_) return Status::io_error("waiting for a notice: the coordinator link is closing");
    if (!up_) {
      if (Clock::now() >= deadline) return std::optional<control::Frame>();
      Status st = reconnect(lock, deadline);
      if (!st.is_ok()) return st.with_context("waiting for a notice");
      continue;
    }
    const uint64_t gen = generation_;
    if (!cv_.wait_until(lock, deadline, [&] { return !notices_.empty() || !up_ || gen != generation_ || closing_; })) {
      return std::optional<control::Frame>();
    }
  }
}

Status CoordinatorLink::start_heartbeat(control::MemberRef member) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    member_ = member;
    late_heartbeats_.clear();  // replies about the member before this one
    dropped_.store(false, std::memory_order_release);
  }
  if (heartbeat_.joinable()) return Status::ok();
  {
    std::lock_guard<std::mutex> lock(hb_mutex_);
    hb_stop_ = false;
  }
  Result<std::thread> t = threads_.start("heartbeat", [this] { heartbeat_loop(); });
  if (!t.is_ok()) return t.status();
  heartbeat_ = std::move(t).value();
  return Status::ok();
}

void CoordinatorLink::stop_heartbeat() {
  {
    std::lock_guard<std::mutex> lock(hb_mutex_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
}

void CoordinatorLink::heartbeat_answered(const Result<Json>& reply) {
  if (reply.status().code() == Code::kNotFound) {  // declared dead: no use going on
    member_.reset();
    registration_.reset();
    dropped_.store(true, std::memory_order_release);
    log_.warn("heartbeat: " + reply.status().message() +
              ": the coordinator declared this member dead (its heartbeats came later than the coordinator's "
              "timeout); it registers again at its next refresh or publish");
  } else if (!reply.is_ok()) {
    log_.warn("heartbeat: " + reply.status().message());
  }
}

void CoordinatorLink::heartbeat_loop() {
  std::unique_lock<std::mutex> hb(hb_mutex_);
  // One heartbeat every config_.heartbeat from the last one sent, whether or
  // not its reply came.
  Clock::time_point next = Clock::now() + config_.heartbeat;
  while (!hb_cv_.wait_until(hb, next, [this] { return hb_stop_; })) {
    hb.unlock();
    next = Clock::now() + config_.heartbeat;
    // A failure here is logged; the thread goes on (and never ends the process).
    try {
      std::optional<control::MemberRef> member;
      {
        std::lock_guard<std::mutex> lock(mu_);
        member = member_;
      }
      if (member) {
        bool left = false;
        Result<Json> reply = request_until(MsgType::kHeartbeat, control::to_json(*member),
                                           Clock::now() + config_.coordinator.timeout, next, &left);
        if (!left) {
          std::lock_guard<std::mutex> lock(mu_);
          heartbeat_answered(reply);
        }
      }
    } catch (const std::exception& e) {
      log_.error(std::string("heartbeat: internal error: ") + e.what());
    }
    hb.lock();
  }
}

}  // namespace refit::plugin
