#include "transport/control/coordinator.h"

#include <boost/asio.hpp>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <deque>
#include <atomic>
#include <future>
#include <map>
#include <set>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

#include "transport/control/auth.h"
#include "transport/control/fleet_metrics.h"

namespace refit::control {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using boost::system::error_code;

namespace {
class Session;

// What a connection authenticated as a role may send (auth.h); "any" (the
// token itself) may send everything.
bool role_may_send(AuthRole role, MsgType type) {
  if (role == AuthRole::kAny) return true;
  switch (type) {
    case MsgType::kUnregister:
    case MsgType::kHeartbeat:
    case MsgType::kSubscribe:
      return true;  // unregister and heartbeat: of a member of its own role (checked with the body)
    case MsgType::kRegisterSource:
    case MsgType::kPublishVersion:
    case MsgType::kWaitDrained:
    case MsgType::kVerifyBoxes:
      return role == AuthRole::kSource;
    case MsgType::kRegisterReceiver:
    case MsgType::kFetchPlan:
    case MsgType::kReportStaged:
    case MsgType::kReportFailed:
    case MsgType::kLease:
    case MsgType::kRelease:
    case MsgType::kVersionHashes:
    case MsgType::kRefreshSummary:
      return role == AuthRole::kReceiver;
    default:
      return false;
  }
}

// compute_plan on the planning thread; an exception (memory, a bug) becomes
// a plan that failed with the reason, never the end of the process.
std::shared_ptr<const PlannedParts> compute_plan_guarded(const PlanInput& input) {
  try {
    return compute_plan(input);
  } catch (const std::exception& e) {
    auto out = std::make_shared<PlannedParts>();
    out->epoch = input.epoch;
    out->solo = input.solo;
    out->status = Status::internal(std::string("planning failed inside the coordinator: ") + e.what());
    return out;
  }
}

// One receiver rank's fetch_plan reply, less what changes between replies
// (version, request id, seal): its runs and peers as CBOR, spliced into
// each reply (encode_frame_with). Made off the I/O thread, once per
// (rank, plan epoch).
struct PartReply {
  uint64_t epoch = 0;  // the plan epoch on the wire (solo bit included)
  Status status;       // why it could not be made (a bug in the coordinator)
  std::shared_ptr<const std::vector<uint8_t>> runs, peers;
  size_t run_count = 0;    // its runs, run groups expanded
  size_t entry_count = 0;  // its entries on the wire (docs/refresh.md, "The plan part")
};

// Runs on a reply thread and touches nothing shared: `plan` and
// `directory` are immutable. The part's message JSON is made from the
// plan's compact entries (PlannedParts::part), checked against its message
// (parsed as the receiver parses it), then encoded as it is; it lives only
// while its reply is built. An exception (memory, a bug) becomes a reply
// that failed with the reason.
PartReply build_part_reply(const PlannedParts& plan, const PeerDirectory& directory, int32_t rank, bool solo,
                           uint64_t epoch, const std::atomic<bool>& stopped) {
  PartReply out;
  out.epoch = epoch;
  try {
    const Json part = plan.part(rank);
    Status checked;
    {  // checked as the receiver parses it, the runs counted, not held
      MessageLimits lim;
      lim.max_runs = kMaxPlanRunsCeiling;  // each receiver applies its own "max_plan_runs"
      Result<size_t> runs = check_plan_runs(part, lim);
      checked = runs.status();
      if (runs.is_ok()) out.run_count = *runs;
      out.entry_count = part.size();
    }
    Result<PlanPeers> peers = checked.is_ok() ? parse_plan_peers(peers_from(directory, rank, solo, part)) : checked;
    if (!peers.is_ok()) {
      out.status = Status::internal("the coordinator's plan part does not fit its message: " + peers.status().message());
      return out;
    }
    if (stopped.load()) {
      out.status = Status::unsupported("the coordinator is stopping");
      return out;
    }
    out.runs = std::make_shared<const std::vector<uint8_t>>(Json::to_cbor(part));
    out.peers = std::make_shared<const std::vector<uint8_t>>(Json::to_cbor(to_json(*peers)));
  } catch (const std::exception& e) {
    out.status = Status::internal(std::string("building the plan part's reply failed inside the coordinator: ") +
                                  e.what());
    out.runs = out.peers = nullptr;
  } catch (...) {
    out.status = Status::internal("building the plan part's reply failed inside the coordinator (not a std::exception)");
    out.runs = out.peers = nullptr;
  }
  return out;
}
}  // namespace

// Owned by the Coordinator. Every member is touched only on the I/O thread
// once start() returns, except: port_ (written before, then read-only),
// stopped_ (atomic), thread_ and repliers_ (start/stop callers), planner_,
// whose one thread runs compute_plan on a copy of the layout and posts the
// result back, and replies_io_, on whose threads (repliers_) the plan parts'
// replies are built (build_part_reply) from immutable snapshots and posted
// back. The I/O thread itself only splices ready bytes into a frame, seals
// and writes it.
class Coordinator::Impl {
 public:
  explicit Impl(CoordinatorConfig config)
      : config_(std::move(config)),
        acceptor_(io_),
        sweeper_(io_),
        pulse_(io_),
        state_(config_.state, config_.heartbeat_timeout) {
    state_.set_lease_timeout(config_.lease_timeout);
    state_.set_relayout(config_.relayout_below_bytes, config_.relayout_staging_bytes);
    if (!config_.log) {
      config_.log = [](const std::string& line) { std::fprintf(stderr, "refit-coordinator: %s\n", line.c_str()); };
    }
  }

  Status listen();
  Status run() {
    Result<std::thread> t = config_.threads.start("coordinator I/O", [this] {
      pulse();
      accept();
      sweep();
      // A handler that throws (memory, a bug) is logged and the loop goes
      // on: the coordinator may be embedded in a trainer or a server.
      for (;;) {
        try {
          io_.run();
          return;
        } catch (const std::exception& e) {
          log(std::string("internal error on the I/O thread, going on: ") + e.what());
        } catch (...) {
          log("internal error on the I/O thread (not a std::exception), going on");
        }
      }
    });
    if (!t.is_ok()) return t.status().with_context("coordinator");
    thread_ = std::move(t).value();
    for (int i = 0; i < kRepliers; ++i) {
      Result<std::thread> r = config_.threads.start("coordinator replies", [this] {
        for (;;) {  // build_part_reply catches its own; this is the belt
          try {
            replies_io_.run();
            return;
          } catch (const std::exception& e) {
            log(std::string("internal error on a reply thread, going on: ") + e.what());
          } catch (...) {
            log("internal error on a reply thread (not a std::exception), going on");
          }
        }
      });
      if (!r.is_ok()) {
        stop();
        return r.status().with_context("coordinator");
      }
      repliers_.push_back(std::move(r).value());
    }
    return Status::ok();
  }
  void stop() {
    if (stopped_.exchange(true)) return;
    asio::post(io_, [this] { shutdown(); });
    if (thread_.joinable()) thread_.join();
    planner_.join();  // a plan being made runs to its end; its result is dropped
    // Replies not yet started are dropped; one being built stops at its next
    // step (stopped_) or runs to its end; either way its result is dropped
    // with io_, whose thread has ended.
    replies_work_.reset();
    replies_io_.stop();
    for (std::thread& t : repliers_) t.join();
  }

  // I/O thread only, from here on.
  void accept();
  void sweep();
  // The clock heartbeats and leases are counted on, and read and write
  // deadlines too where the peer did its part (Session::peer_ready): steady
  // time less the time the I/O thread was held up (a costly handler, the
  // process not scheduled), as the pulse measured it. While the I/O thread
  // does not run, frames that members sent wait unread in the socket
  // buffers: that time is nobody's silence, and a deadline that counted it
  // would declare members dead and drop connections for the coordinator's
  // own delay.
  Clock::time_point listening_now() {
    const auto now = Clock::now();
    if (now > pulse_due_) {
      stalled_ += now - pulse_due_;
      pulse_due_ = now;
    }
    return now - stalled_;
  }
  // Runs every kPulse; whatever it comes late by is time the I/O thread was held up.
  void pulse();
  void shutdown();
  // Peers choose some of the text in a line (names, reasons): control
  // characters are replaced so that a peer cannot forge log lines.
  void log(std::string line) {
    for (char& c : line) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
    }
    config_.log(line);
  }
  void closed(uint64_t id, bool refused) {
    sessions_.erase(id);
    unauthenticated_.erase(id);
    state_.session_closed(id);
    if (refused) ++refused_;
    restore_reserve_fd();
  }
  // Connection limits (coordinator.h): a new connection beyond
  // max_unauthenticated, or a descriptor needed when the process has none
  // left, is taken from the oldest connection that has not authenticated.
  bool drop_oldest_unauthenticated(const std::string& why);
  void restore_reserve_fd() {
    if (reserve_fd_ < 0 && !shutting_down_) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  size_t authenticated_count() const { return sessions_.size() - unauthenticated_.size(); }
  void authenticated(uint64_t id) { unauthenticated_.erase(id); }
  const Mac& key_of(AuthRole role) const { return role_keys_[static_cast<int>(role)]; }
  void handle_request(const std::shared_ptr<Session>& s, Frame frame);
  void deliver_notices();
  void answer_fetch(Session& s, const FetchPlan& request);
  // True when answer_fetch() can answer `request` at once: a refusal, an
  // "unchanged", or a part whose reply is built (part_replies_).
  bool reply_ready(const FetchPlan& request);
  // Builds `rank`'s reply of its current plan epoch on a reply thread, unless one is being built.
  void build_reply(int32_t rank);
  void on_built(int32_t rank, PartReply built, int64_t ms);
  // Answers the first waiting fetch whose reply is ready, then posts itself
  // for the next; starts the builds and the plan the others need.
  void answer_next();
  void post_answer_next() {
    if (answering_) return;
    answering_ = true;
    asio::post(io_, [this] { answer_next(); });
  }
  void start_planning();
  void on_planned(std::shared_ptr<const PlannedParts> plan, int64_t ms);

  CoordinatorConfig config_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer sweeper_;
  static constexpr std::chrono::milliseconds kPulse{50};
  asio::steady_timer pulse_;
  Clock::time_point pulse_due_ = Clock::time_point::max();  // when the pulse is next due
  Clock::duration stalled_{0};  // held up so far, in all (listening_now())
  ControlState state_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions_;
  // The sessions still authenticating, oldest (lowest id) first; a subset of sessions_.
  std::map<uint64_t, std::weak_ptr<Session>> unauthenticated_;
  // A descriptor held back so that one connection can still be accepted when
  // the process has no descriptor left (EMFILE); -1 while it is in use.
  int reserve_fd_ = -1;
  std::chrono::steady_clock::time_point last_accept_log_{};
  uint64_t accept_failures_ = 0;  // since the last accept log line
  Mac role_keys_[3] = {};  // by AuthRole
  asio::thread_pool planner_{1};  // runs compute_plan; touches no member
  bool planning_ = false;
  bool answering_ = false;  // an answer_next() is posted
  std::vector<std::pair<std::weak_ptr<Session>, FetchPlan>> pending_fetches_;  // paused sessions, their requests
  // Built on reply threads (build_part_reply), one per (rank, plan
  // epoch), so that a fetch costs the I/O thread a splice and a seal, not a
  // parse, a rebuild and an encoding of a part of maybe a million runs.
  // Started through config_.threads (run()); what they run goes through replies_io_.
  static constexpr int kRepliers = 2;
  asio::io_context replies_io_;
  asio::executor_work_guard<asio::io_context::executor_type> replies_work_{replies_io_.get_executor()};
  std::vector<std::thread> repliers_;
  // Per receiver rank: the CBOR of its part's runs and peers, of one plan
  // epoch; replaced by the next epoch's, dropped when a membership change
  // leaves it stale (on_planned). Nothing else of a reply is kept: the
  // parts themselves live in the state's plans (PlannedParts).
  std::map<int32_t, PartReply> part_replies_;
  static constexpr size_t kLoggedReplyBytes = size_t{1} << 20;  // replies this large are logged with their cost
  std::set<std::pair<int32_t, uint64_t>> building_;  // (rank, plan epoch) being built on a reply thread
  std::shared_ptr<const PeerDirectory> directory_;   // of the latest epoch a reply was built in
  uint64_t next_id_ = 1;
  uint64_t refused_ = 0;
  // Bytes the sessions hold: their queued output and their decoders' input.
  // Each session adds and removes its own share; see Session::count_input.
  size_t buffered_ = 0;
  bool shutting_down_ = false;
  uint16_t port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

namespace {

// One connection. Lives as long as an operation on it is pending (handlers
// hold a shared_ptr). All members belong to the I/O thread.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Coordinator::Impl& co, tcp::socket socket, uint64_t id, std::string peer)
      : co_(co),
        socket_(std::move(socket)),
        read_timer_(co.io_),
        write_timer_(co.io_),
        id_(id),
        peer_(std::move(peer)),
        decoder_(DecoderLimits{co.config_.max_frame_bytes_before_auth, co.config_.decoder.body}),
        read_buf_(16384) {}

  const std::string& peer() const { return peer_; }
  uint64_t id() const { return id_; }

  void start() {
    Result<Nonce> nonce = make_nonce();
    if (!nonce.is_ok()) {
      close(nonce.status().message(), true);
      return;
    }
    nonce_ = *nonce;
    send(MsgType::kChallenge, Json{{"nonce", Json::binary(std::vector<uint8_t>(nonce_.begin(), nonce_.end()))}});
    set_read_deadline(co_.config_.auth_timeout, "did not authenticate");
    watch_read_deadline();
    read();
  }

  // `request` names the request a reply answers, for a refusal.
  // A reply or an error carries the id of the request being answered.
  void send(MsgType type, const Json& body, const char* request = nullptr) {
    if (closed_) return;
    const uint32_t id = type == MsgType::kReply || type == MsgType::kError ? request_id_ : 0;
    enqueue(type, encode_frame(type, body, co_.config_.decoder.max_frame_bytes, id), request);
  }

  void reply(const char* request, const Json& body) { send(MsgType::kReply, body, request); }
  // A reply whose body is `body` with `encoded` members spliced in
  // (encode_frame_with). Returns the bytes queued (0: none, the connection
  // closed or a refusal sent instead).
  size_t reply_with(const char* request, const Json& body, const std::vector<EncodedMember>& encoded) {
    if (closed_) return 0;
    return enqueue(MsgType::kReply,
                   encode_frame_with(MsgType::kReply, body, encoded, co_.config_.decoder.max_frame_bytes, request_id_),
                   request);
  }

 private:
  // Seals and queues one encoded frame; an encoding that failed or a frame
  // past the budgets is refused as below. Returns the bytes queued.
  size_t enqueue(MsgType type, Result<std::vector<uint8_t>> bytes, const char* request) {
    const uint32_t id = type == MsgType::kReply || type == MsgType::kError ? request_id_ : 0;
    if (!bytes.is_ok()) {
      // Our own reply is too large: tell the client why instead.
      bytes = encode_frame(MsgType::kReply, Json{{"ok", false}, {"error", bytes.status().message()}},
                           kDefaultMaxFrameBytes, id);
      if (!bytes.is_ok()) return 0;
    }
    // The error frame before a close is exempt: small, one per connection,
    // and what it precedes frees this connection's share.
    if (type != MsgType::kError && !fits(bytes->size())) {
      const std::string past = " bytes would take the coordinator past its budget of " +
                               std::to_string(co_.config_.max_buffered_bytes) +
                               " bytes buffered across all connections (" + std::to_string(co_.buffered_) +
                               " held)";
      const std::string size = std::to_string(bytes->size());
      if (type == MsgType::kReply) {
        const std::string reason =
            std::string(request ? request : "request") + ": the reply of " + size + past + "; try again";
        co_.log("refused a request from " + peer_ + ": " + reason);
        bytes = encode_frame(MsgType::kReply, Json{{"ok", false}, {"error", reason}}, kDefaultMaxFrameBytes, id);
        if (!bytes.is_ok()) return 0;
      }
      if (!fits(bytes->size())) {
        close(std::string(type_name(type)) + " of " + size + past + "; dropped", true);
        return 0;
      }
    }
    // Sealed in the order written: the seal's sequence number is implicit.
    if (Status st = sealer_.seal(*bytes); !st.is_ok()) {
      close(st.message(), true);
      return 0;
    }
    queued_bytes_ += bytes->size();
    co_.buffered_ += bytes->size();
    if (queued_bytes_ > co_.config_.max_queued_bytes) {
      close("does not read its replies: " + std::to_string(queued_bytes_) +
                " bytes queued, over the limit of " + std::to_string(co_.config_.max_queued_bytes),
            true);
      return 0;
    }
    const size_t size = bytes->size();
    queue_.push_back(std::move(bytes).value());
    if (!writing_) write();
    return size;
  }

 public:

  // Sends the reason, then closes once it is written (or at the write deadline).
  void refuse_and_close(const std::string& reason) {
    co_.log("refused " + peer_ + ": " + reason);
    ++co_.refused_;
    send(MsgType::kError, Json{{"reason", reason}});
    closing_ = true;
    if (!writing_) close("", false);
  }

  void close(const std::string& reason, bool refused) {
    if (closed_) return;
    closed_ = true;
    if (!reason.empty()) co_.log((refused ? "refused " : "closed ") + peer_ + ": " + reason);
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    read_timer_.cancel();
    write_timer_.cancel();
    co_.buffered_ -= queued_bytes_ + input_bytes_;
    queued_bytes_ = input_bytes_ = 0;
    // queue_ is kept: an aborted async_write may still hold its front buffer;
    // it goes with the Session once the last handler has run.
    co_.closed(id_, refused);
  }

 private:
  // A read or write deadline that passes while the I/O thread was held up
  // (Impl::listening_now) waits for the rest of it on the listening clock,
  // provided the peer did its part meanwhile: its bytes wait unread
  // (POLLIN) or it took ours (POLLOUT). A peer that did not is dropped at
  // the deadline as ever (a half frame's sender, a reader that reads nothing).
  bool peer_ready(short events) {
    pollfd p{socket_.native_handle(), events, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & events) != 0;
  }

  void set_read_deadline(std::chrono::milliseconds d, const char* what) {
    read_deadline_what_ = what;
    read_timeout_ = d;
    read_deadline_ = co_.listening_now() + d;
    read_timer_.expires_after(d);
  }

  void watch_read_deadline() {
    read_timer_.async_wait([self = shared_from_this()](error_code) {
      if (self->closed_) return;
      if (self->read_timer_.expiry() <= asio::steady_timer::clock_type::now()) {
        const auto left = self->read_deadline_ - self->co_.listening_now();
        if (left > Clock::duration::zero() && self->peer_ready(POLLIN)) {
          self->read_timer_.expires_after(left);
        } else {
          self->close(std::string(self->read_deadline_what_) + " within " +
                          std::to_string(self->read_timeout_.count()) + " ms; dropped",
                      true);
          return;
        }
      }
      self->watch_read_deadline();
    });
  }

  void read() {
    socket_.async_read_some(asio::buffer(read_buf_), [self = shared_from_this()](error_code ec, size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(error_code ec, size_t n) {
    if (closed_) return;
    if (ec) {
      close(ec == asio::error::eof ? std::string("disconnected") : "disconnected: " + ec.message(), false);
      return;
    }
    decoder_.feed(read_buf_.data(), n);
    process();
  }

  // Handles the next buffered frame, if any, and posts itself for the one
  // after: one frame per turn, so that a peer that pipelines many costly
  // requests (plan parts of megabytes) does not hold up the other
  // connections. Once the frames are handled, reads more unless paused or
  // closing. Never more than one of process() and a read is pending.
  void process() {
    Result<std::optional<Frame>> f = decoder_.next();
    if (!f.is_ok()) {
      if (authenticated_) refuse_and_close(f.status().message());
      else close(f.status().message() + " (before authenticating)", true);
      return;
    }
    if (f->has_value()) {
      frame_deadline_set_ = false;
      on_frame(std::move(**f));
      if (!count_input() || closing_ || paused_) return;
      // The peer is not silent while its requests wait their turn.
      if (authenticated_) set_read_deadline(co_.config_.idle_timeout, "sent nothing");
      asio::post(co_.io_, [self = shared_from_this()] {
        if (!self->closed_ && !self->closing_ && !self->paused_) self->process();
      });
      return;
    }
    if (!count_input()) return;
    if (authenticated_) {
      // A started frame must finish within read_timeout of its first byte;
      // between frames the connection may idle for idle_timeout.
      if (!decoder_.mid_frame()) {
        set_read_deadline(co_.config_.idle_timeout, "sent nothing");
      } else if (!frame_deadline_set_) {
        set_read_deadline(co_.config_.read_timeout, "sent part of a frame and did not finish it");
        frame_deadline_set_ = true;
      }
    }
    read();
  }

 public:
  // While the coordinator works on this connection's request off the I/O
  // thread (planning), its later requests wait, so that replies stay in
  // request order; no read deadline runs meanwhile.
  void pause() {
    paused_ = true;
    read_timer_.expires_at(asio::steady_timer::time_point::max());
  }
  void resume() {
    if (closed_ || !paused_) return;
    paused_ = false;
    if (!closing_) process();
  }
  bool closed() const { return closed_; }

 private:
  bool fits(size_t more) const {
    return co_.buffered_ + more <= co_.config_.max_buffered_bytes;
  }

  // Brings this session's share of co_.buffered_ up to date with its
  // decoder. Returns false, having dropped the connection, when the input
  // grew and the total is past the budget.
  bool count_input() {
    if (closed_) return false;
    const size_t now = decoder_.buffered_bytes();
    const bool grew = now > input_bytes_;
    co_.buffered_ = co_.buffered_ - input_bytes_ + now;
    input_bytes_ = now;
    if (grew && co_.buffered_ > co_.config_.max_buffered_bytes) {
      close("sent " + std::to_string(now) + " bytes of unfinished frames, which take the coordinator past " +
                "its budget of " + std::to_string(co_.config_.max_buffered_bytes) +
                " bytes buffered across all connections (" + std::to_string(co_.buffered_) + " held); dropped",
            true);
      return false;
    }
    return true;
  }

  void on_frame(Frame frame) {
    if (!authenticated_) {
      authenticate(frame);
      return;
    }
    request_id_ = frame.id;
    if (const std::string why = forbidden(frame); !why.empty()) {
      co_.log("refused a request from " + peer_ + ": " + why);
      reply(type_name(frame.type), Json{{"ok", false}, {"error", why}});
      return;
    }
    // Whatever a request does, an exception it throws fails that request
    // only, with a log line; the coordinator and the connection go on.
    const MsgType type = frame.type;
    try {
      co_.handle_request(shared_from_this(), std::move(frame));
    } catch (const std::exception& e) {
      const std::string why = std::string(type_name(type)) + ": internal error in the coordinator: " + e.what();
      co_.log("request from " + peer_ + " failed: " + why);
      reply(type_name(type), Json{{"ok", false}, {"error", why}});
    }
  }

  // The auth response: {role, nonce, mac} (auth.h). Anything else closes
  // the connection; a proof that does not check out is refused with an
  // error frame, then closed.
  void authenticate(const Frame& frame) {
    if (frame.type != MsgType::kAuthResponse) {
      close(std::string("sent ") + type_name(frame.type) + " before authenticating", true);
      return;
    }
    Result<AuthResponse> response = parse_auth_response(frame.body);
    if (!response.is_ok()) {
      close("auth: " + response.status().message(), true);
      return;
    }
    const AuthRole role = response->role;
    const Nonce& client = response->nonce;
    const Mac& key = co_.key_of(role);
    Result<Mac> expected = client_proof(key, role, nonce_, client);
    if (!expected.is_ok() || !mac_equal_bytes(*expected, response->mac.data())) {
      // Said, not just closed: a member tells a refusal from a connection
      // dropped while it authenticated, which it makes again. The word
      // tells a stranger nothing a close would not.
      refuse_and_close(std::string("auth: wrong credential for the role \"") + auth_role_name(role) +
                       "\" (its proof over the challenge does not match)");
      return;
    }
    if (co_.authenticated_count() >= co_.config_.max_connections) {
      refuse_and_close("already serving the limit of " + std::to_string(co_.config_.max_connections) +
                       " authenticated connections");
      return;
    }
    Result<Mac> proof = server_proof(key, role, nonce_, client);
    Result<SessionKeys> keys = session_keys(key, role, nonce_, client);
    if (!proof.is_ok() || !keys.is_ok()) {
      close(!proof.is_ok() ? proof.status().message() : keys.status().message(), true);
      return;
    }
    authenticated_ = true;
    role_ = role;
    co_.authenticated(id_);
    decoder_.set_limits(co_.config_.decoder);
    co_.log("authenticated " + peer_ + " as " + auth_role_name(role_));
    send(MsgType::kAuthOk, Json{{"mac", Json::binary(std::vector<uint8_t>(proof->begin(), proof->end()))}});
    // Every frame from here on, both ways, is sealed.
    sealer_ = FrameSealer(keys->server_to_client);
    decoder_.expect_seals(keys->client_to_server);
    set_read_deadline(co_.config_.idle_timeout, "sent nothing");
  }

  // Why this connection's role may not send `frame` ("" when it may).
  std::string forbidden(const Frame& frame) const {
    const std::string who = std::string("a connection authenticated as ") + auth_role_name(role_);
    if (!role_may_send(role_, frame.type)) {
      if (!is_request(frame.type)) return "";  // handle_request refuses it and closes
      return std::string(type_name(frame.type)) + ": " + who + " may not send it";
    }
    if (role_ != AuthRole::kAny && (frame.type == MsgType::kHeartbeat || frame.type == MsgType::kUnregister)) {
      const Json& b = frame.body;
      const Json* r = b.is_object() && b.contains("role") ? &b["role"] : nullptr;
      if (r && r->is_string() && r->get<std::string>() != auth_role_name(role_)) {
        return std::string(type_name(frame.type)) + ": " + who + " may not name a " +
               (r->get<std::string>() == "source" ? "source" : "member of another role");
      }
    }
    return "";
  }
  static bool is_request(MsgType t) {
    return static_cast<uint16_t>(t) >= static_cast<uint16_t>(MsgType::kRegisterSource) &&
           static_cast<uint16_t>(t) < static_cast<uint16_t>(MsgType::kReply);
  }

  void write() {
    writing_ = true;
    write_deadline_ = co_.listening_now() + co_.config_.write_timeout;
    write_timer_.expires_after(co_.config_.write_timeout);
    watch_write_deadline();
    asio::async_write(socket_, asio::buffer(queue_.front()), [self = shared_from_this()](error_code ec, size_t) {
      self->on_write(ec);
    });
  }

  void watch_write_deadline() {
    write_timer_.async_wait([self = shared_from_this()](error_code ec) {
      if (ec || self->closed_ || !self->writing_) return;
      const auto left = self->write_deadline_ - self->co_.listening_now();
      if (left > Clock::duration::zero() && self->peer_ready(POLLOUT)) {
        self->write_timer_.expires_after(left);
        self->watch_write_deadline();
        return;
      }
      self->close("did not take a reply within " + std::to_string(self->co_.config_.write_timeout.count()) +
                      " ms; dropped",
                  true);
    });
  }

  void on_write(error_code ec) {
    writing_ = false;
    write_timer_.cancel();
    if (closed_) return;
    if (ec) {
      close("disconnected while being written to: " + ec.message(), false);
      return;
    }
    queued_bytes_ -= queue_.front().size();
    co_.buffered_ -= queue_.front().size();
    queue_.pop_front();
    if (!queue_.empty()) {
      write();
    } else if (closing_) {
      close("", false);
    }
  }

  Coordinator::Impl& co_;
  tcp::socket socket_;
  asio::steady_timer read_timer_;
  asio::steady_timer write_timer_;
  const uint64_t id_;
  const std::string peer_;
  FrameDecoder decoder_;
  std::vector<uint8_t> read_buf_;
  std::deque<std::vector<uint8_t>> queue_;
  size_t queued_bytes_ = 0;  // of queue_; counted in co_.buffered_
  size_t input_bytes_ = 0;   // of decoder_, as last counted in co_.buffered_
  bool writing_ = false;
  bool closing_ = false;  // close once the queue is written
  bool closed_ = false;
  bool authenticated_ = false;
  bool frame_deadline_set_ = false;  // the current partial frame's deadline is armed
  bool paused_ = false;
  const char* read_deadline_what_ = "";
  std::chrono::milliseconds read_timeout_{0};
  Clock::time_point read_deadline_{};   // on co_'s listening clock
  Clock::time_point write_deadline_{};  // of the write in progress, on co_'s listening clock
  Nonce nonce_{};
  AuthRole role_ = AuthRole::kAny;  // once authenticated_
  FrameSealer sealer_;              // active once authenticated_
  uint32_t request_id_ = 0;         // the id of the request being answered
};

std::string endpoint_name(const tcp::socket& s) {
  error_code ec;
  tcp::endpoint ep = s.remote_endpoint(ec);
  if (ec) return "<unknown peer>";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

Json reply(const Status& s) {
  if (s.is_ok()) return Json{{"ok", true}};
  Json r{{"ok", false}, {"error", s.message()}};
  // A member the coordinator does not hold (declared dead, or never
  // registered): the agent registers again rather than retrying.
  if (s.code() == Code::kNotFound) r["not_found"] = true;
  // Why, for a caller that decides on it (planner/status.h, Reason).
  if (s.reason() != Reason::kNone) r["reason"] = reason_name(s.reason());
  return r;
}

}  // namespace

Status Coordinator::Impl::listen() {
  error_code ec;
  asio::ip::address addr = asio::ip::make_address(config_.host, ec);
  if (ec) return Status::invalid("coordinator: listen address \"" + config_.host + "\" is not an IP address");
  tcp::endpoint ep(addr, config_.port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::io_error("coordinator: cannot listen on " + config_.host + ":" +
                            std::to_string(config_.port) + ": " + ec.message());
  }
  port_ = acceptor_.local_endpoint().port();
  for (AuthRole role : {AuthRole::kAny, AuthRole::kSource, AuthRole::kReceiver}) {
    Result<Mac> key = role_key(config_.token, role);
    if (!key.is_ok()) return key.status();
    role_keys_[static_cast<int>(role)] = *key;
  }
  restore_reserve_fd();
  return Status::ok();
}

bool Coordinator::Impl::drop_oldest_unauthenticated(const std::string& why) {
  while (!unauthenticated_.empty()) {
    auto oldest = unauthenticated_.begin();
    std::shared_ptr<Session> s = oldest->second.lock();
    unauthenticated_.erase(oldest);
    if (s && !s->closed()) {
      s->close("not authenticated yet, dropped " + why, true);
      return true;
    }
  }
  return false;
}

void Coordinator::Impl::accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
    if (shutting_down_) return;
    if (ec) {
      // Out of descriptors (EMFILE, ENFILE): free one, from the oldest
      // connection that has not authenticated or else from the reserve, and
      // accept at once, so that a member can still get in; with neither,
      // back off a little. Anything else: log, back off, go on accepting.
      const bool no_fds = ec == asio::error::no_descriptors || ec.value() == ENFILE;
      if (no_fds && drop_oldest_unauthenticated("to free a file descriptor (the process has none left)")) {
        accept();
        return;
      }
      if (no_fds && reserve_fd_ >= 0) {
        ::close(reserve_fd_);
        reserve_fd_ = -1;
        accept();
        return;
      }
      ++accept_failures_;
      const auto now = std::chrono::steady_clock::now();
      if (now - last_accept_log_ >= std::chrono::seconds(1)) {
        log("accept failed: " + ec.message() + " (" + std::to_string(accept_failures_) +
            " times since the last such line); retrying");
        last_accept_log_ = now;
        accept_failures_ = 0;
      }
      auto t = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(50));
      t->async_wait([this, t](error_code) {
        if (!shutting_down_) accept();
      });
      return;
    }
    std::string peer = endpoint_name(socket);
    // Strangers are bounded on their own: a connection past the limit of
    // unauthenticated ones takes the place of the oldest, which has had the
    // longest to authenticate. Authenticated connections are bounded by
    // max_connections when they authenticate, so strangers never shut a
    // member out.
    if (unauthenticated_.size() >= config_.max_unauthenticated) {
      drop_oldest_unauthenticated("for a newer connection (limit of " +
                                  std::to_string(config_.max_unauthenticated) + " unauthenticated connections)");
    }
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    const uint64_t id = next_id_++;
    auto s = std::make_shared<Session>(*this, std::move(socket), id, std::move(peer));
    sessions_[id] = s;
    unauthenticated_[id] = s;
    s->start();
    restore_reserve_fd();
    accept();
  });
}

void Coordinator::Impl::pulse() {
  listening_now();  // counts what this pulse came late by
  pulse_due_ = Clock::now() + kPulse;
  pulse_.expires_at(pulse_due_);
  pulse_.async_wait([this](error_code ec) {
    if (ec || shutting_down_) return;
    pulse();
  });
}

void Coordinator::Impl::sweep() {
  auto period = config_.heartbeat_timeout / 4;
  if (period < std::chrono::milliseconds(10)) period = std::chrono::milliseconds(10);
  sweeper_.expires_after(period);
  sweeper_.async_wait([this](error_code ec) {
    if (ec || shutting_down_) return;
    // A connection whose fetch_plan waits for the planner is not read
    // meanwhile, its heartbeats included: its members live. Silence is
    // counted on the listening clock: frames that waited unread while the
    // I/O thread was held up are not silence.
    const auto now = listening_now();
    for (const auto& [weak, request] : pending_fetches_) {
      if (auto s = weak.lock(); s && !s->closed()) state_.touch_session(s->id(), now);
    }
    for (const std::string& line : state_.sweep(now)) log(line);
    deliver_notices();
    sweep();
  });
}

void Coordinator::Impl::shutdown() {
  shutting_down_ = true;
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
  reserve_fd_ = -1;
  error_code ec;
  acceptor_.close(ec);
  sweeper_.cancel();
  pulse_.cancel();
  std::vector<std::shared_ptr<Session>> live;
  for (auto& [id, w] : sessions_) {
    if (auto s = w.lock()) live.push_back(std::move(s));
  }
  for (auto& s : live) s->close("", false);
  sessions_.clear();
}

void Coordinator::Impl::handle_request(const std::shared_ptr<Session>& s, Frame frame) {
  const auto now = listening_now();
  const MessageLimits& lim = config_.messages;
  const uint64_t id = s->id();
  Status st;
  switch (frame.type) {
    case MsgType::kRegisterSource: {
      Result<RegisterSource> m = parse_register_source(frame.body, lim);
      st = m.is_ok() ? state_.register_source(id, std::move(m).value(), now) : m.status();
      break;
    }
    case MsgType::kRegisterReceiver: {
      Result<RegisterReceiver> m = parse_register_receiver(frame.body, lim);
      st = m.is_ok() ? state_.register_receiver(id, std::move(m).value(), now) : m.status();
      break;
    }
    case MsgType::kUnregister: {
      Result<MemberRef> m = parse_member_ref(frame.body, "unregister", lim);
      st = m.is_ok() ? state_.unregister(id, *m) : m.status();
      break;
    }
    case MsgType::kHeartbeat: {
      Result<MemberRef> m = parse_member_ref(frame.body, "heartbeat", lim);
      st = m.is_ok() ? state_.heartbeat(id, *m, now) : m.status();
      break;
    }
    case MsgType::kSubscribe: {
      st = state_.subscribe(id);
      if (st.is_ok()) {
        s->reply("subscribe", Json{{"ok", true}, {"version", state_.version()}});
        return;
      }
      break;
    }
    case MsgType::kPublishVersion: {
      Result<PublishVersion> m = parse_publish_version(frame.body, "publish_version", lim);
      const int64_t before = state_.version();
      st = m.is_ok() ? state_.publish(id, m->version, std::move(m->hashes)) : m.status();
      if (st.is_ok()) {
        log("version " + std::to_string(m->version) + " published by " + s->peer() +
            (state_.version() != before ? "; the group version is now " + std::to_string(state_.version())
                                        : "; the group version stays " + std::to_string(before) +
                                              " until every source has published it"));
      }
      break;
    }
    case MsgType::kFetchPlan: {
      Result<FetchPlan> request = parse_fetch_plan(frame.body, lim);
      st = request.is_ok() ? state_.check_fetch(id, request->rank) : request.status();
      if (!st.is_ok()) break;
      if (state_.plan_current(request->rank) && reply_ready(*request)) {
        answer_fetch(*s, *request);
        return;
      }
      if (pending_fetches_.size() >= config_.state.max_receivers) {
        st = Status::unsupported("fetch_plan: the coordinator is busy planning; try again");
        break;
      }
      // It waits for the plan or for its reply to be built, off the I/O thread.
      pending_fetches_.emplace_back(s, *request);
      s->pause();
      if (state_.plan_current(request->rank)) {
        build_reply(request->rank);
      } else {
        start_planning();
      }
      return;
    }
    case MsgType::kLease: {
      Result<LeaseRequest> m = parse_lease(frame.body, lim);
      st = m.is_ok() ? state_.lease(id, m->report, now, m->renew) : m.status();
      if (st.is_ok()) {
        // The holder renews it well within this (docs/refresh.md, "Leases").
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(state_.lease_timeout()).count();
        s->reply("lease", Json{{"ok", true}, {"timeout_ms", ms}});
        deliver_notices();
        return;
      }
      break;
    }
    case MsgType::kRelease: {
      Result<StageReport> m = parse_stage_report(frame.body, false, lim, "release");
      st = m.is_ok() ? state_.release(id, *m) : m.status();
      break;
    }
    case MsgType::kWaitDrained: {
      Result<PublishVersion> m = parse_publish_version(frame.body, "wait_drained");
      if (!m.is_ok()) {
        st = m.status();
        break;
      }
      Result<bool> drained = state_.wait_drained(id, m->version);
      if (!drained.is_ok()) {
        st = drained.status();
        break;
      }
      s->reply("wait_drained", Json{{"ok", true}, {"drained", *drained}});
      return;
    }
    case MsgType::kVerifyBoxes:
    case MsgType::kVersionHashes: {
      Result<VersionHashes> m = frame.type == MsgType::kVerifyBoxes ? Result<VersionHashes>(VersionHashes{})
                                                                      : parse_version_hashes(frame.body, lim);
      Result<Json> answer = !m.is_ok()                            ? Result<Json>(m.status())
                            : frame.type == MsgType::kVerifyBoxes ? state_.verify_boxes(id)
                                                                  : state_.version_hashes(id, *m);
      if (!answer.is_ok()) {
        st = answer.status();
        break;
      }
      Json body = std::move(answer).value();
      body["ok"] = true;
      s->reply(type_name(frame.type), std::move(body));
      return;
    }
    case MsgType::kRefreshSummary: {
      Result<RefreshSummary> m = parse_refresh_summary(frame.body, lim);
      Result<int32_t> instance = m.is_ok() ? state_.receiver_instance(id, m->rank, "refresh_summary")
                                           : Result<int32_t>(m.status());
      st = instance.status();
      if (st.is_ok() && config_.metrics) config_.metrics->record(*m, *instance);
      break;
    }
    case MsgType::kReportStaged:
    case MsgType::kReportFailed: {
      const bool failed = frame.type == MsgType::kReportFailed;
      Result<StageReport> m = parse_stage_report(frame.body, failed, lim);
      st = !m.is_ok() ? m.status() : failed ? state_.report_failed(id, *m) : state_.report_staged(id, *m);
      if (st.is_ok() && failed && state_.committed(m->rank, m->version)) {
        // Too late to withdraw: the instance committed the version, and
        // this rank must commit it too (commit is final).
        s->reply("report_failed", Json{{"ok", true}, {"committed", true}});
        deliver_notices();
        return;
      }
      break;
    }
    default:
      // Server-to-client types, or a second auth response: out of order.
      s->refuse_and_close(std::string("sent ") + type_name(frame.type) +
                          ", which a client may not send after authenticating");
      return;
  }
  if (!st.is_ok()) log("refused a request from " + s->peer() + ": " + st.message());
  s->reply(type_name(frame.type), reply(st));
  deliver_notices();
}

bool Coordinator::Impl::reply_ready(const FetchPlan& request) {
  const uint64_t epoch = state_.plan_epoch(request.rank);
  if (request.have_epoch == epoch) return true;  // unchanged (or refused, answer_fetch decides)
  auto it = part_replies_.find(request.rank);
  if (it != part_replies_.end() && it->second.epoch == epoch) return true;
  // Last, as it checks the whole registration: refused, nothing to build.
  return !state_.cached_part_status(request.rank).is_ok();
}

void Coordinator::Impl::build_reply(int32_t rank) {
  const uint64_t epoch = state_.plan_epoch(rank);
  if (shutting_down_ || !building_.insert({rank, epoch}).second) return;
  if (!directory_ || directory_->epoch != state_.epoch()) directory_ = state_.peer_directory();
  asio::post(replies_io_, [this, rank, epoch, plan = state_.plan_of(rank), directory = directory_,
                            solo = state_.wants_solo(rank), delay = config_.test_build_delay] {
    const auto t0 = Clock::now();
    PartReply built = build_part_reply(*plan, *directory, rank, solo, epoch, stopped_);
    // Tests only: a part of cluster scale, cut short by stop().
    for (const auto until = t0 + delay; !stopped_ && Clock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    try {
      asio::post(io_, [this, rank, built = std::move(built), ms]() mutable { on_built(rank, std::move(built), ms); });
    } catch (const std::exception&) {
      // No memory to post the result: its fetches wait until the membership
      // changes or their members' connections close.
    }
  });
}

void Coordinator::Impl::on_built(int32_t rank, PartReply built, int64_t ms) {
  building_.erase({rank, built.epoch});
  if (shutting_down_) return;
  const std::string what = "the plan part of receiver rank " + std::to_string(rank) + " (membership " +
                           std::to_string(built.epoch & ~ControlState::kSoloEpochBit) +
                           ((built.epoch & ControlState::kSoloEpochBit) ? ", solo" : "") + ")";
  if (!state_.plan_current(rank) || built.epoch != state_.plan_epoch(rank)) {
    // The membership (or the part the rank needs) changed meanwhile: its
    // fetches wait for the new one (answer_next).
    log("dropped " + what + ", built in " + std::to_string(ms) + " ms: it is stale");
  } else {
    if (built.status.is_ok()) {
      log("built the reply of " + what + ": " + std::to_string(built.run_count) + " runs in " +
          std::to_string(built.entry_count) + " entries, " + std::to_string(built.runs->size() + built.peers->size()) +
          " bytes, in " + std::to_string(ms) + " ms");
    }
    part_replies_[rank] = std::move(built);
  }
  post_answer_next();
}

void Coordinator::Impl::answer_fetch(Session& s, const FetchPlan& request) {
  if (config_.test_answer_delay.count() > 0) std::this_thread::sleep_for(config_.test_answer_delay);
  if (Status part = state_.cached_part_status(request.rank); !part.is_ok()) {
    log("refused a request from " + s.peer() + ": " + part.message());
    s.reply("fetch_plan", reply(part));
    return;
  }
  // cached_part_status() succeeded, so the plan is of the current epoch. The
  // reply is a PlanPart (messages.h), the struct the receiver parses it into.
  PlanPart reply_part;
  reply_part.version = state_.version();
  reply_part.epoch = PlanEpoch::from_wire(state_.plan_epoch(request.rank));
  Result<PlanTotals> totals = parse_plan_totals(state_.plan_totals(request.rank));
  Status st = totals.status();
  if (st.is_ok()) reply_part.totals = *totals;
  if (st.is_ok() && request.have_epoch == reply_part.epoch.wire()) {  // the receiver holds this part already
    reply_part.unchanged = true;
    s.reply("fetch_plan", to_json(reply_part));
    return;
  }
  auto cached = part_replies_.find(request.rank);
  if (st.is_ok() && (cached == part_replies_.end() || cached->second.epoch != reply_part.epoch.wire())) {
    st = Status::internal("no reply was built for it");  // answer_next() waits for it: a bug
  }
  if (st.is_ok()) st = cached->second.status;
  if (!st.is_ok()) {  // the coordinator's own plan does not fit the message: a bug
    part_replies_.erase(request.rank);  // the next fetch builds it again
    const Status bug = Status::internal("fetch_plan: the coordinator cannot answer for receiver rank " +
                                        std::to_string(request.rank) + ": " + st.message());
    log("refused a request from " + s.peer() + ": " + bug.message());
    s.reply("fetch_plan", reply(bug));
    return;
  }
  // The built runs and peers, spliced into this reply's frame: the I/O
  // thread copies the bytes once and seals them, nothing more.
  Json body = to_json(reply_part);
  body.erase("runs");
  body.erase("peers");
  const auto t0 = Clock::now();
  const size_t bytes =
      s.reply_with("fetch_plan", body, {{"runs", cached->second.runs.get()}, {"peers", cached->second.peers.get()}});
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  if (bytes >= kLoggedReplyBytes) {
    log("answered fetch_plan of receiver rank " + std::to_string(request.rank) + " with " + std::to_string(bytes) +
        " bytes, sealed and queued in " + std::to_string(us / 1000) + "." + std::to_string(us / 100 % 10) + " ms");
  }
}

// Planning a cluster-scale layout takes seconds: it runs on planner_, one
// plan at a time, while the I/O thread goes on serving everyone else.
void Coordinator::Impl::start_planning() {
  if (planning_ || shutting_down_) return;
  // The plan the first waiting fetch needs (the shared or the solo one).
  bool solo = false;
  for (const auto& [weak, request] : pending_fetches_) {
    if (auto s = weak.lock(); s && !s->closed() && !state_.plan_current(request.rank)) {
      solo = state_.wants_solo(request.rank);
      break;
    }
  }
  planning_ = true;
  asio::post(planner_, [this, input = state_.plan_input(solo), delay = config_.test_plan_delay] {
    const auto t0 = Clock::now();
    std::shared_ptr<const PlannedParts> plan = compute_plan_guarded(input);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);  // tests only: a plan of cluster scale
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    asio::post(io_, [this, plan, ms] { on_planned(plan, ms); });
  });
}

void Coordinator::Impl::on_planned(std::shared_ptr<const PlannedParts> plan, int64_t ms) {
  planning_ = false;
  if (shutting_down_) return;
  const uint64_t epoch = plan->epoch;
  const bool solo = plan->solo;
  const bool ok = plan->status.is_ok();
  std::shared_ptr<const PlannedParts> old = state_.variant_plan(solo);
  const bool installed = state_.install_plan(plan);
  // Freeing the parts of a cluster-scale plan (a tree of millions of JSON
  // values) takes long: the plan replaced, or the stale one, is freed on
  // the planner's thread, or on a reply thread that still reads it.
  if (installed) plan.reset();
  try {
    asio::post(planner_, [dropped = installed ? std::move(old) : std::move(plan)]() mutable { dropped.reset(); });
  } catch (const std::exception&) {
    // No memory to post it: it is freed here.
  }
  if (!installed) {
    start_planning();  // the membership changed meanwhile: plan the new one
    return;
  }
  log("planned membership " + std::to_string(epoch) + (solo ? " (solo)" : "") + " in " + std::to_string(ms) + " ms" +
      (ok ? "" : " (it cannot be planned)"));
  // Replies of older memberships are never sent again.
  for (auto it = part_replies_.begin(); it != part_replies_.end();) {
    if ((it->second.epoch & ~ControlState::kSoloEpochBit) != epoch) {
      it = part_replies_.erase(it);
    } else {
      ++it;
    }
  }
  post_answer_next();
}

// A reply of a cluster-scale plan part is megabytes to copy, seal and
// queue: one per turn, so that the other connections' frames, the
// heartbeats of the members that wait, are read between them.
void Coordinator::Impl::answer_next() {
  answering_ = false;
  if (shutting_down_) return;
  bool need_plan = false;
  for (auto it = pending_fetches_.begin(); it != pending_fetches_.end();) {
    auto s = it->first.lock();
    if (!s || s->closed()) {
      it = pending_fetches_.erase(it);
      continue;
    }
    const FetchPlan request = it->second;
    Status st = state_.check_fetch(s->id(), request.rank);  // it may have left meanwhile
    if (st.is_ok() && !state_.plan_current(request.rank)) {  // it needs the other plan
      need_plan = true;
      ++it;
      continue;
    }
    if (st.is_ok() && !reply_ready(request)) {  // its reply is being built (or is to be)
      build_reply(request.rank);
      ++it;
      continue;
    }
    // Its heartbeats waited behind the plan.
    state_.touch_session(s->id(), listening_now());
    pending_fetches_.erase(it);
    if (st.is_ok()) {
      answer_fetch(*s, request);
    } else {
      s->reply("fetch_plan", reply(st));
    }
    s->resume();
    deliver_notices();
    post_answer_next();
    return;
  }
  // Every fetch whose reply is ready is answered; the others wait for their
  // builds (on_built) or need a new plan.
  if (need_plan) start_planning();
  deliver_notices();
}

void Coordinator::Impl::deliver_notices() {
  for (Notice& n : state_.take_notices()) {
    auto it = sessions_.find(n.session);
    if (it == sessions_.end()) continue;  // its connection is gone; the member will time out
    if (auto s = it->second.lock()) s->send(n.type, n.body);
  }
}

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() { stop(); }

Result<std::unique_ptr<Coordinator>> Coordinator::start(CoordinatorConfig config) {
  if (config.token.size() < kMinTokenBytes) {
    return Status::invalid("coordinator: the token must be at least " + std::to_string(kMinTokenBytes) + " bytes");
  }
  const size_t largest = size_t{config.decoder.max_frame_bytes} + kHeaderBytes;
  for (const auto& [name, value] : {std::pair{"max_buffered_bytes", config.max_buffered_bytes},
                                    std::pair{"max_queued_bytes", config.max_queued_bytes}}) {
    if (value < largest) {
      return Status::invalid(std::string("coordinator: ") + name + " must hold the largest frame, " +
                             std::to_string(largest) + " bytes (max_frame_bytes plus the header), got " +
                             std::to_string(value));
    }
  }
  std::unique_ptr<Impl> impl;
  try {  // the planner's pool starts its thread here
    impl = std::make_unique<Impl>(std::move(config));
  } catch (const std::system_error& e) {
    return Status::io_error(std::string("coordinator: cannot start the planner thread: ") + e.what())
        .with_reason(Reason::kNoThread);
  }
  REFIT_RETURN_IF_ERROR(impl->listen());
  REFIT_RETURN_IF_ERROR(impl->run());
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

uint16_t Coordinator::port() const { return impl_->port_; }
void Coordinator::stop() {
  if (impl_) impl_->stop();
}

Result<CoordinatorStats> Coordinator::stats() const {
  if (impl_->stopped_) return Status::unsupported("coordinator: stopped");
  auto p = std::make_shared<std::promise<CoordinatorStats>>();
  auto f = p->get_future();
  Impl* impl = impl_.get();
  asio::post(impl->io_, [impl, p] {
    CoordinatorStats st;
    st.connections = impl->sessions_.size();
    st.unauthenticated = impl->unauthenticated_.size();
    st.sources = impl->state_.num_sources();
    st.receivers = impl->state_.num_receivers();
    st.version = impl->state_.version();
    st.refused = impl->refused_;
    st.plans = impl->state_.plans_made();
    st.leases = impl->state_.num_leases();
    st.buffered_bytes = impl->buffered_;
    st.instances = impl->state_.instances();
    p->set_value(st);
  });
  if (f.wait_for(std::chrono::seconds(1)) != std::future_status::ready) {
    return Status::internal("coordinator: the I/O thread did not answer within a second");
  }
  return f.get();
}

}  // namespace refit::control
