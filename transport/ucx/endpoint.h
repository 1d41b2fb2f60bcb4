#pragma once
// A connection to one peer worker, created from the peer's worker address
// (opaque bytes from the control plane), with UCP_ERR_HANDLING_MODE_PEER and
// an error callback that marks it failed. Owns the peer's rkeys unpacked on
// it: each is unpacked once and cached by the id the caller gives it.
//
// Threads: everything, including the error callback (which UCX calls from
// worker progress), runs on whichever thread drives the worker; the caller
// serializes that (ThreadMode in worker.h). failed() may be read from any
// thread. Move-only; must not outlive its Worker.

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/remote_key.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {

enum class PeerErrorHandling {
  // UCP_ERR_HANDLING_MODE_PEER: UCX detects a dead peer, calls the error
  // callback and fails the requests in flight. The default.
  kPeer,
  // UCP_ERR_HANDLING_MODE_NONE. Only for the shared-memory fast path: in UCX
  // 1.13 neither cma nor posix/sysv support peer failure, so with kPeer UCX
  // emulates GETs over a tcp control lane at tcp speed. With kNone the batch
  // deadline is the only guard against a dead peer.
  kNone,
};

class Endpoint {
 public:
  // `peer_address` is what the peer's Worker::address() returned; garbage
  // gives an invalid-argument Status naming `peer_name`, never a crash.
  static Result<Endpoint> create(Worker& worker, std::span<const uint8_t> peer_address,
                                 std::string peer_name,
                                 PeerErrorHandling mode = PeerErrorHandling::kPeer);

  Endpoint(Endpoint&& other) noexcept = default;
  Endpoint& operator=(Endpoint&& other) noexcept;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  // Closes gracefully (flush) when healthy, forcefully when failed; waits at
  // most one second for the close.
  ~Endpoint();

  ucp_ep_h get() const { return state_ ? state_->ep : nullptr; }
  const std::string& name() const { return state_->name; }

  // True once UCX reported an error on this endpoint or it was force-closed.
  bool failed() const { return !state_ || state_->failed.load(std::memory_order_acquire); }
  // Why it failed, naming the peer; ok() while healthy.
  Status failure() const;

  // Unpacks `packed` (a peer's MemoryRegion::packed_rkey()) under `id`.
  // Importing the same bytes under the same id again is a no-op (the cache);
  // different bytes under a known id are an error.
  Status import_rkey(uint64_t id, std::span<const uint8_t> packed);
  // The key imported under `id`, or nullptr.
  const RemoteKey* rkey(uint64_t id) const;

  // Marks the endpoint failed with `reason` and closes it with
  // UCP_EP_CLOSE_FLAG_FORCE: UCX completes every request in flight on it
  // with an error. Progresses the worker until the close completes or
  // `deadline`. Idempotent.
  void force_close(const std::string& reason,
                   std::chrono::steady_clock::time_point deadline);

 private:
  struct State {
    ucp_worker_h worker = nullptr;
    ucp_ep_h ep = nullptr;
    std::string name;
    std::atomic<bool> failed{false};
    ucs_status_t ucx_error = UCS_OK;  // set by the error callback
    std::string reason;               // set by force_close
    struct Key {
      std::vector<uint8_t> packed;
      RemoteKey key;
    };
    std::unordered_map<uint64_t, Key> rkeys;
  };
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void close(bool force, std::chrono::steady_clock::time_point deadline);

  explicit Endpoint(std::unique_ptr<State> s) : state_(std::move(s)) {}
  // Heap-held so that the error callback's argument survives moves.
  std::unique_ptr<State> state_;
};

}  // namespace refit::ucx
