#pragma once
// The GET engine: takes runs (endpoint, remote address, rkey, local address,
// bytes), splits them into chunks, keeps a bounded window of bytes and ops in
// flight per endpoint and in total (chunking.h), issues ucp_get_nbx, completes
// by callback and reports each run as it lands so the caller can chain the
// next step on it. Every batch has a deadline; on error or deadline it
// cancels what is in flight and returns with no request outstanding.
//
// Cancelling: UCX 1.13 cannot cancel an RMA request, so the engine cancels by
// closing the endpoints that still have GETs in flight with
// UCP_EP_CLOSE_FLAG_FORCE; UCX then completes those requests with an error.
// Such an endpoint is failed afterwards and the caller reconnects.
//
// Threads and ownership:
//  - mutex_ guards the worker and all batch state (scheduler_, slots_,
//    run_status_, ...). UCX callbacks run inside ucp_worker_progress, which
//    is only ever called with mutex_ held, so they run under it too.
//  - Without a progress thread, run_batch() drives progress on the calling
//    thread; the worker may be ThreadMode::kSingle.
//  - With a progress thread (options.progress_thread), the worker must be
//    ThreadMode::kSerialized; the thread owns progress and sleeps on the
//    worker's event fd (ucp_worker_arm + poll) between events; run_batch()
//    issues and waits on a condition variable until done or the deadline.
//    While the engine exists, nobody else may touch the worker (do not
//    destroy endpoints on it until the engine is gone).
//  - The run callback runs with mutex_ held, on whichever thread progresses:
//    it must not call into the engine.
// Invariant: outstanding_ == number of slots in use == UCX requests issued
// and not yet completed; after run_batch() returns it is zero unless the
// report says otherwise (an internal error).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/chunking.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {

struct GetRun {
  Endpoint* endpoint = nullptr;  // borrowed; outlives the batch
  uint64_t rkey_id = 0;          // imported on `endpoint` (Endpoint::import_rkey)
  uint64_t remote_address = 0;   // inside that key's region
  void* local_address = nullptr; // inside a region added with add_local_region
  uint64_t bytes = 0;            // > 0
};

struct BatchReport {
  Status status;                 // ok iff every run landed
  std::vector<Status> runs;      // one per run, in input order
  uint64_t bytes_done = 0;       // bytes of chunks that completed ok
  std::chrono::nanoseconds elapsed{0};
  uint64_t gets_issued = 0;
};

struct GetEngineOptions {
  WindowLimits limits;
  bool progress_thread = false;
  // After a deadline or error, how long to wait for UCX to complete the
  // requests of force-closed endpoints.
  std::chrono::milliseconds cancel_grace{2000};
};

class GetEngine {
 public:
  using RunCallback = std::function<void(uint32_t run, const Status& status)>;

  // `worker` is borrowed and must outlive the engine.
  static Result<std::unique_ptr<GetEngine>> create(Worker& worker, GetEngineOptions options);
  ~GetEngine();
  GetEngine(const GetEngine&) = delete;
  GetEngine& operator=(const GetEngine&) = delete;

  // Local GET targets must lie inside a region added here (borrowed; it
  // must outlive the engine or be removed first).
  void add_local_region(const MemoryRegion& region);
  void remove_local_region(const MemoryRegion& region);

  // Runs one batch to completion, error or `deadline`. Validates every run
  // before issuing any (errors name the run). `on_run_done` is called once
  // per run as it finishes (ok or not).
  BatchReport run_batch(std::span<const GetRun> runs,
                        std::chrono::steady_clock::time_point deadline,
                        RunCallback on_run_done = {});

  // One round of worker progress, for a caller that drives progress between
  // batches (e.g. to notice peer failures). Without a progress thread only.
  unsigned progress();

  // UCX requests issued and not yet completed (zero between batches).
  uint64_t outstanding_requests() const;
  // Request slots ever allocated (bounded by the window's op limit).
  size_t slot_count() const;

 private:
  struct Slot {
    GetEngine* engine = nullptr;
    Chunk chunk;
    uint64_t generation = 0;
    bool in_use = false;
  };

  GetEngine(Worker& worker, GetEngineOptions options);
  static void on_get_done(void* request, ucs_status_t status, void* user_data);
  void complete_locked(Slot* slot, ucs_status_t status);
  void finish_run_locked(uint32_t run);
  void fail_run_locked(uint32_t run, const Status& status);
  void pump_locked();
  void issue_locked(const Chunk& chunk);
  void cancel_locked(const std::string& reason);
  Slot* take_slot_locked();
  Status validate_locked(std::span<const GetRun> runs, std::vector<ChunkRun>* chunk_runs);
  void progress_loop();
  bool batch_done_locked() const { return !scheduler_ || scheduler_->done(); }

  Worker& worker_;
  const GetEngineOptions options_;

  mutable std::mutex mutex_;
  std::condition_variable batch_cv_;  // signalled when the batch may be done

  // Guarded by mutex_.
  std::vector<const MemoryRegion*> local_regions_;
  std::deque<Slot> slots_;  // stable addresses: UCX holds Slot* as user data
  std::vector<Slot*> free_slots_;
  uint64_t outstanding_ = 0;
  uint64_t generation_ = 0;
  // Batch state, valid while a batch runs.
  std::optional<ChunkScheduler> scheduler_;
  std::span<const GetRun> runs_;
  std::vector<Endpoint*> batch_eps_;
  std::vector<bool> ep_dropped_;
  std::vector<Status> run_status_;
  std::vector<bool> run_reported_;
  std::vector<uint32_t> run_ep_;
  std::vector<ucp_mem_h> run_memh_;  // local registration of each run
  RunCallback on_run_done_;
  uint64_t bytes_done_ = 0;
  uint64_t gets_issued_ = 0;

  // Progress thread; stop_ guarded by mutex_.
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace refit::ucx
