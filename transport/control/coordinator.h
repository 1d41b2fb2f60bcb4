#pragma once
// The coordinator: a Boost.Asio TCP server that authenticates every
// connection (auth.h), reads frames (frame_codec.h), parses requests
// (messages.h) and keeps the membership (control_state.h). Runs on one I/O
// thread of its own: embedded in a source or receiver process, or standalone
// (refit-coordinator).
//
// Per connection: the server sends a challenge and nothing else until the
// answer checks out (auth.h: the client proves it holds its role's key, the
// server proves it holds it too); a wrong answer, a frame before it or a
// late one closes the connection and logs the peer. After that every frame
// both ways is sealed (frame_codec.h): one whose seal fails (altered,
// injected, replayed, or one before it dropped) closes the connection with a
// log line, before anything in it is applied. A connection may send only
// what its role may (a receiver's key cannot register a source); a refusal
// says so. Every request gets one reply, with the request's id, in order; a connection's pipelined requests are handled one per turn of
// the I/O thread, so that one peer's burst of costly requests (plan parts of
// megabytes) does not hold up the others. A frame must complete within
// read_timeout of its first byte, a connection may be silent between frames
// for at most idle_timeout, a write must complete within write_timeout, and a
// connection may have at most max_queued_bytes waiting to be written:
// whoever breaks one is dropped, with a log line naming the peer and the
// reason, while the others go on.
//
// All connections together hold at most max_buffered_bytes of queued output
// and partly read input, so that many peers, each within its own limits,
// cannot together exhaust memory. What would take the total past it is
// refused, with a log line: a connection whose input grows past it is
// dropped; a reply that would is replaced by a refusal saying so (the client
// may try again once others have taken theirs); any other frame that would,
// and a refusal that would not fit either, drop the connection. A new
// connection is refused while its challenge does not fit. The 16 KiB read
// buffer of each connection is not counted (max_connections and
// max_unauthenticated bound it). Bad
// bytes (wrong magic, wrong version, oversize, malformed CBOR) close the
// connection; a bad request (a field out of range, a duplicate registration)
// gets a refusal with the reason and the connection stays open.
//
// Planning (fetch_plan) runs on a second thread of its own, one plan at a
// time, so a cluster-scale plan does not hold up the other connections; the
// connection that asked waits (its later requests are not read) until its
// reply is sent, which keeps replies in request order. Its members count as
// alive meanwhile (their heartbeats wait behind the plan), however long the
// plan takes.
//
// Heartbeats and leases are counted on a clock that stops while the I/O
// thread is held up (a costly reply, the process not scheduled): frames a
// member sent meanwhile wait unread in the socket, and the coordinator's
// own delay is nobody's silence. A 50 ms pulse on the I/O thread measures
// the holdup. A read or write deadline that passes during a holdup is
// extended likewise, when the peer did its part (its bytes wait unread, or
// it took the coordinator's). Replies to the fetches that waited for a plan are built one
// per turn of the I/O thread, so that the others' frames are read between
// them.
//
// Thread safety: start(), stop(), port() and stats() may be called from any
// thread. Everything else (acceptor, sessions, state) belongs to the I/O
// thread; `log` is called on it. The planning thread sees only a copy of the
// layout document.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "planner/status.h"
#include "transport/common/threads.h"
#include "transport/control/control_state.h"
#include "transport/control/frame_codec.h"
#include "transport/control/messages.h"

namespace refit::control {

class FleetMetrics;

struct CoordinatorConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port; port() says which
  std::string token;  // the secret; each role's key derives from it (auth.h)
  DecoderLimits decoder;
  // Before a peer has authenticated, only its small auth response is
  // expected: a bigger frame is refused at its header, so a stranger cannot
  // make the coordinator buffer megabytes.
  uint32_t max_frame_bytes_before_auth = 1024;
  MessageLimits messages;
  StateLimits state;
  std::chrono::milliseconds auth_timeout{3000};
  std::chrono::milliseconds read_timeout{10000};
  std::chrono::milliseconds idle_timeout{60000};
  std::chrono::milliseconds write_timeout{10000};
  std::chrono::milliseconds heartbeat_timeout{10000};
  std::chrono::milliseconds lease_timeout{60000};
  // The plans' relayout knobs (PlanOptions, docs/refresh.md "Column-major
  // receivers"): 0, the default, never relayouts.
  int64_t relayout_below_bytes = 0;
  int64_t relayout_staging_bytes = int64_t{1} << 30;
  // Authenticated connections, checked when one authenticates.
  size_t max_connections = 4096;
  // Connections that have not authenticated yet, bounded on their own: a new
  // one past the limit replaces the oldest. With auth_timeout, this bounds
  // what strangers hold, so that they never shut a member out. When the
  // process runs out of file descriptors (EMFILE), the oldest such
  // connection is closed to accept a new one; a reserve descriptor covers
  // the case where there is none.
  size_t max_unauthenticated = 64;
  size_t max_queued_bytes = size_t{256} << 20;  // per connection
  // All connections together; at least the largest frame, so that one
  // maximal registration or reply always fits (start() checks).
  size_t max_buffered_bytes = size_t{1} << 30;
  // One line per event worth an operator's eye; default: stderr. Called on
  // the I/O thread, and on a reply thread for an internal error there.
  std::function<void(const std::string&)> log;
  // Where receivers' refresh_summary messages are counted (fleet_metrics.h);
  // null: they are acknowledged and dropped.
  std::shared_ptr<FleetMetrics> metrics;
  // Test only (never set by the library or its tools): every plan takes at
  // least this much longer, standing in for a membership of cluster scale,
  // so that tests can show the coordinator serving everyone meanwhile.
  std::chrono::milliseconds test_plan_delay{0};
  // Test only, likewise: answering a fetch_plan holds the I/O thread at
  // least this much longer, standing in for an I/O thread held up (the
  // process not scheduled on a loaded machine).
  std::chrono::milliseconds test_answer_delay{0};
  // Test only, likewise: building a plan part's reply (off the I/O thread)
  // takes at least this much longer, standing in for a part of megabytes.
  std::chrono::milliseconds test_build_delay{0};
  // Starts the I/O thread (transport/common/threads.h): a refused one fails
  // start(). Tests hand a factory that refuses; the agents hand theirs.
  ThreadFactory threads;
};

struct CoordinatorStats {
  size_t connections = 0;
  size_t unauthenticated = 0;  // of connections
  size_t sources = 0;
  size_t receivers = 0;
  int64_t version = 0;  // the group version (control_state.h)
  uint64_t refused = 0;  // connections closed for a protocol or auth failure
  uint64_t plans = 0;    // plans made (one per membership asked for a plan)
  size_t leases = 0;     // receiver ranks holding a lease on a version now
  size_t buffered_bytes = 0;  // queued output and partly read input, all connections
  std::set<int32_t> instances;  // that have a registered receiver
};

class Coordinator {
 public:
  // Binds, listens and starts the I/O thread.
  static Result<std::unique_ptr<Coordinator>> start(CoordinatorConfig config);
  ~Coordinator();  // stops
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  uint16_t port() const;
  // Closes every connection and joins the I/O thread. Idempotent.
  void stop();
  // A snapshot taken on the I/O thread; waits at most a second for it.
  Result<CoordinatorStats> stats() const;

  class Impl;

 private:
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit::control
