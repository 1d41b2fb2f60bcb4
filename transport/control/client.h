#pragma once
// A coordinator client: connects, authenticates both ways (auth.h: it proves
// its role's key and checks the coordinator's proof), then sends requests
// and waits for their replies, each call with a deadline. Every frame after
// the handshake is sealed both ways (frame_codec.h). Each request carries a
// fresh id and only the reply with that id answers it: a reply that arrives
// after its request timed out is dropped, never read as the answer to a
// later request. Notices (version, commit, abort, drained) that arrive while
// waiting for a reply are kept, in order, for wait_notice(); at most 1024 of
// them.
//
// Thread safety: a Client belongs to one thread at a time; it runs its own
// io_context only inside its calls. Move-only (owned through unique_ptr).
// plugin/coordinator_link.h takes its socket over once it has authenticated
// (release()), for a connection that a reader thread of its own serves.

#include <chrono>
#include <functional>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "planner/status.h"
#include "transport/control/auth.h"
#include "transport/control/frame_codec.h"

namespace refit::control {

struct ClientOptions {
  std::chrono::milliseconds timeout{10000};  // per call
  DecoderLimits decoder;
  AuthRole role = AuthRole::kAny;  // the role claimed; a role key must be this role's
  // When set, a connection the coordinator closes before it authenticated
  // (a coordinator short of descriptors drops unauthenticated connections,
  // docs/security.md) is made again, with a pause growing from 20 ms to
  // 500 ms, until `timeout` has passed in all; each cut is told here first.
  // A refused credential is never tried again: the coordinator says so.
  std::function<void(const std::string& why, std::chrono::milliseconds pause)> on_cut;
};

// An authenticated connection's state, handed over by Client::release().
struct AuthenticatedSocket {
  int fd = -1;          // blocking; the new owner closes it
  FrameSealer sealer;   // seals what the client sends
  FrameDecoder decoder; // checks what the coordinator sends (and holds any bytes already read)
  uint32_t next_id = 1;
};

class Client {
 public:
  // Connects and authenticates with `credential` as options.role. Fails
  // naming the step: connect, challenge, auth (the coordinator refuses a
  // wrong credential with an error frame; a close without one is a cut
  // connection, see ClientOptions::on_cut), or the coordinator's proof.
  // No route to the host is a timeout (the network may come back: worth
  // another try), a refused connection an I/O error.
  static Result<std::unique_ptr<Client>> connect(const std::string& host, uint16_t port,
                                                 const Credential& credential, ClientOptions options = {});
  // The same with the token itself.
  static Result<std::unique_ptr<Client>> connect(const std::string& host, uint16_t port,
                                                 const std::string& token, ClientOptions options = {});
  // Connects without authenticating: for tests that speak the protocol wrongly.
  static Result<std::unique_ptr<Client>> connect_raw(const std::string& host, uint16_t port,
                                                     ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends a request and returns the reply body; a refusal ({ok: false}) or
  // an error frame becomes a Status carrying the coordinator's reason.
  Result<Json> request(MsgType type, const Json& body);
  // The next notice: version_notify (after a subscribe), commit, abort or drained.
  Result<Frame> wait_notice(std::chrono::milliseconds timeout);

  // Raw access for tests. send_frame seals once authenticated.
  Status send_raw(const uint8_t* data, size_t size);
  Status send_frame(MsgType type, const Json& body, uint32_t id = 0);
  Result<Frame> read_frame(std::chrono::milliseconds timeout);
  // True when the peer closed the connection within `timeout`.
  bool wait_closed(std::chrono::milliseconds timeout);

  // Hands over the connection (see above); the Client is unusable after.
  AuthenticatedSocket release();

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The reply body of a kReply frame, or the Status it carries: a refusal
// ({ok: false, error, not_found?}) or an error frame's reason. `request`
// names the request in messages.
Result<Json> reply_result(const char* request, Frame frame);

}  // namespace refit::control
