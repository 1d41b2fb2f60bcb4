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
  // 1.13 and 1.22 alike posix/sysv/cma have no peer-failure support, so with
  // kPeer UCX leaves a shared-memory endpoint nothing but a tcp lane (and
  // the engine moves data as refit active messages over it, am_rma.h). With
  // kNone the endpoint gets sysv/posix/cma lanes. In UCX 1.13 GETs from
  // UCX-allocated memory become memcpy from the mapped segment
  // (MemoryRegion::allocate); other memory is served by UCX's GET emulation
  // over posix/sysv active messages (cma only serves rendezvous in UCX 1.13;
  // measured 2-10 GB/s against 40-50). UCX 1.22 reads any memory with cma
  // zero-copy. The batch deadline is then the only guard against a dead
  // peer.
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

  // The lanes UCX chose for this endpoint and its GET protocols per RMA
  // lane (from ucp_ep_print_info, read once at create), e.g.
  // "lane[0]: 3:sysv/memory.0 ... am am_bw#0" and "get[0]: 0..<bcopy>..(inf)".
  // For logs and the bench.
  const std::string& lanes() const { return state_->lanes; }
  // True when UCX has no RMA lane to this peer and would emulate GET/PUT
  // with its internal active messages (tcp in UCX 1.13 and 1.22, and shared
  // memory with kPeer). The GetEngine then moves data with refit's own
  // active messages instead, served by the peer's AmRmaServer (am_rma.h),
  // because UCX 1.13's emulation aborts the target process when the puller
  // dies. Read from ucp_ep_print_info: its "get[N]" lines (UCX 1.13), or
  // under UCX's newer protocols (1.22) a zero-copy RMA lane of a transport
  // that can GET (endpoint.cc says why both).
  bool rma_in_software() const { return state_->rma_in_software; }

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
    std::string lanes;
    bool rma_in_software = false;
    struct Key {
      std::vector<uint8_t> packed;
      RemoteKey key;
    };
    std::unordered_map<uint64_t, Key> rkeys;
  };
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void read_lanes(State* s);
  void close(bool force, std::chrono::steady_clock::time_point deadline);

  explicit Endpoint(std::unique_ptr<State> s) : state_(std::move(s)) {}
  // Heap-held so that the error callback's argument survives moves.
  std::unique_ptr<State> state_;
};

}  // namespace refit::ucx
