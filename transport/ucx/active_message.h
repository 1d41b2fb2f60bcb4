#pragma once
// Request/response over UCX active messages, on the workers refit already
// uses for the GET engine: a process serves an AM id with a handler that
// takes request bytes and returns response bytes (or an error), and a caller
// sends a request to an endpoint and waits for the response until a
// deadline. For small control messages: bytes are copied both ways.
//
// Wire: the request goes out on the served id with UCP_AM_SEND_FLAG_REPLY
// and a header {magic, token}; the response comes back on kResponseId with
// {magic, token, status} and the response bytes (or, when the handler
// failed, its error message). Both are sent eager: UCX 1.13's rendezvous
// over tcp falls back to its RMA emulation, which aborts a process whose
// peer died (am_rma.h).
//
// Ids: requests use ids kFirstRequestId .. kFirstRequestId + kRequestIds - 1.
// Every refit Worker answers those it does not serve with an error response
// ("no handler for AM id N"), because UCX 1.13 crashes the receiving process
// on an AM sent with UCP_AM_SEND_FLAG_REPLY to an id without a handler.
//
// Threads: handlers run inside ucp_worker_progress, on whichever thread
// progresses the worker; they must not call request(). request() sends and
// drives the worker's progress on the calling thread, so nobody else may
// progress the worker at the same time (it suits a caller-driven GetEngine
// used from the same thread, not one with a progress thread). The object
// must outlive neither its Worker nor, while a request() runs, its Endpoint.

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {

class ActiveMessages {
 public:
  // Small ids: UCX keeps AM handlers in an array indexed by id. am_rma.h
  // uses 0x3f0..0x3f3.
  static constexpr unsigned kFirstRequestId = 0x300;
  static constexpr unsigned kRequestIds = 64;
  static constexpr unsigned kResponseId = 0x3E0;
  // Request and response bytes above this are refused (control messages).
  static constexpr size_t kMaxBytes = 16u << 20;

  // Returns the response bytes, or an error that the caller receives as the
  // request's Status (its message travels back).
  using Handler = std::function<Result<std::vector<uint8_t>>(std::span<const uint8_t> request)>;

  // Registers the response handler on `worker` (borrowed, must outlive
  // this). One per worker.
  static Result<std::unique_ptr<ActiveMessages>> create(Worker& worker);
  ~ActiveMessages();
  ActiveMessages(const ActiveMessages&) = delete;
  ActiveMessages& operator=(const ActiveMessages&) = delete;

  // Serves `id` (in the request range) with `handler`, replacing any
  // earlier one. The handler is dropped (the id answers "no handler" again)
  // by stop_serving or when this object goes.
  Status serve(unsigned id, Handler handler);
  Status stop_serving(unsigned id);

  // Sends `bytes` to the handler of `id` at the peer of `endpoint` and waits
  // for its response until `deadline`. Errors name the endpoint and the id:
  // deadline passed, peer dead (endpoint failed), peer refused (no handler
  // for id, handler error with its message), or sizes over kMaxBytes. A
  // response that arrives after the deadline is dropped.
  Result<std::vector<uint8_t>> request(Endpoint& endpoint, unsigned id,
                                       std::span<const uint8_t> bytes,
                                       std::chrono::steady_clock::time_point deadline);

 private:
  explicit ActiveMessages(Worker& worker) : worker_(worker) {}
  struct Served {
    ActiveMessages* self;
    unsigned id;
    Handler handler;
  };
  struct Pending {
    bool done = false;
    int32_t status = 0;
    std::vector<uint8_t> bytes;
  };
  static ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_response(void* arg, const void* header, size_t header_length,
                                  void* data, size_t length, const ucp_am_recv_param_t* param);

  Worker& worker_;
  // Touched by the handlers inside progress and by request()/serve() on
  // the thread that drives the worker: one thread at a time (see above).
  std::unordered_map<unsigned, std::unique_ptr<Served>> served_;
  std::unordered_map<uint64_t, Pending> pending_;
  uint64_t next_token_ = 0;
};

namespace active_message {
// Registers the "no handler" answer for every request id (Worker::create
// does this), or for one id.
Status install_fallback_handlers(ucp_worker_h worker);
Status install_fallback_handler(ucp_worker_h worker, unsigned id);
}  // namespace active_message

}  // namespace refit::ucx
