#pragma once
// A UCP worker: the progress engine that endpoints, requests and callbacks
// belong to. Move-only; must not outlive its Context, and must outlive its
// endpoints. Thread ownership: with ThreadMode::kSingle only the thread that
// uses the worker may call any method; with kSerialized callers serialize
// access themselves (the GetEngine does, with its mutex), except signal(),
// which any thread may call.

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/context.h"

namespace refit::ucx {

enum class ThreadMode {
  kSingle,      // one thread touches the worker
  kSerialized,  // several threads, never at once (caller holds a lock)
};

class Worker {
 public:
  static Result<Worker> create(const Context& context, ThreadMode mode = ThreadMode::kSingle);

  Worker(Worker&& other) noexcept;
  Worker& operator=(Worker&& other) noexcept;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  ~Worker();

  ucp_worker_h get() const { return handle_; }
  ThreadMode mode() const { return mode_; }
  // Its context's Context::am_by_copy().
  bool am_by_copy() const { return am_by_copy_; }

  // This worker's address as opaque framed bytes (see wire_blob.h), for the
  // control plane to carry to peers.
  Result<std::vector<uint8_t>> address() const;

  // One round of progress; returns how many events it handled.
  unsigned progress() { return ucp_worker_progress(handle_); }

  // The file descriptor that becomes readable when the worker has events.
  Result<int> event_fd() const;

  // Arms the event fd. Returns true when armed (safe to sleep on the fd),
  // false when events are pending (progress first, then arm again).
  Result<bool> arm();

  // Sleeps until the worker has events or `timeout` passes: progress, arm,
  // poll on the event fd. Returns after at most `timeout`.
  Status wait(std::chrono::milliseconds timeout);

  // Wakes a thread sleeping in wait() or polling the event fd. Thread-safe.
  Status signal();

 private:
  Worker(ucp_worker_h handle, ThreadMode mode) : handle_(handle), mode_(mode) {}
  ucp_worker_h handle_ = nullptr;
  ThreadMode mode_ = ThreadMode::kSingle;
  bool am_by_copy_ = false;
};

// Registers `cb` (with `arg`) for active messages with `id` on `worker`,
// whole messages only; the error names the id. Shared by refit's AM users
// (am_rma.h, active_message.h).
Status set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg);

}  // namespace refit::ucx
