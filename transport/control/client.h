#pragma once
// A coordinator client: connects, answers the challenge, then sends requests
// and waits for their replies, each call with a deadline. Notices (version,
// commit, abort, drained) that arrive while waiting for a reply are kept, in order,
// for wait_notice(); at most 1024 of them.
//
// Thread safety: a Client belongs to one thread at a time; it runs its own
// io_context only inside its calls. Move-only (owned through unique_ptr).

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "planner/status.h"
#include "transport/control/frame_codec.h"

namespace refit::control {

struct ClientOptions {
  std::chrono::milliseconds timeout{10000};  // per call
  DecoderLimits decoder;
};

class Client {
 public:
  // Connects and authenticates with `token`. Fails naming the step: connect,
  // challenge, or auth (the coordinator closes without a word on a wrong token).
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

  // Raw access for tests.
  Status send_raw(const uint8_t* data, size_t size);
  Status send_frame(MsgType type, const Json& body);
  Result<Frame> read_frame(std::chrono::milliseconds timeout);
  // True when the peer closed the connection within `timeout`.
  bool wait_closed(std::chrono::milliseconds timeout);

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit::control
