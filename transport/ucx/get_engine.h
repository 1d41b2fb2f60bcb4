#pragma once
// The GET engine: takes runs (endpoint, remote address, rkey, local address,
// bytes, direction), splits them into chunks, keeps a bounded window of bytes
// and ops in flight per endpoint and in total (chunking.h), issues
// ucp_get_nbx (Op::kGet) or ucp_put_nbx (Op::kPut), completes by callback and
// reports each run as it lands so the caller can chain the next step on it.
// A batch may mix GETs and PUTs. Every batch has a deadline; on error or
// deadline it cancels what is in flight and returns with no request
// outstanding.
//
// PUT completion is local: a PUT run is reported done once its source bytes
// may be reused, not once they are in the peer's memory. flush() on the
// endpoints is what makes every completed PUT visible at the peer.
//
// Endpoints without an RMA lane (Endpoint::rma_in_software(): tcp in UCX
// 1.13) do not use ucp_get_nbx/ucp_put_nbx: UCX's emulation of those aborts
// the target process when a puller dies (am_rma.h says how). The engine
// sends refit active messages instead, which the peer's AmRmaServer serves
// (a refit peer without one refuses them at once, and the run's error says
// so). Chunking, windows, deadlines, callbacks and errors are the same; a
// GET's bytes come back in pieces that land at their offsets, so a large
// chunk costs no reassembly (am_rma.h); a PUT sent this way is already
// visible at the peer when it is reported.
//
// Gathers: a GET run may instead list many small ranges of one peer
// (GetRun::gather), which travel as gather requests (am_rma.h) on any
// endpoint: the peer's AmRmaServer copies them, in order, into its replies,
// and the engine scatters each reply piece to the ranges' local places. A
// gather's bytes are one stream, chunked and windowed like any run's. A
// peer whose gather reply memory is full answers UCS_ERR_BUSY: the engine
// takes that chunk back and asks again after kGatherRetryDelay, holding the
// endpoint's later chunks until then (they keep their order). A gather
// larger than the peer's bound (UCS_ERR_EXCEEDS_LIMIT) fails its run with
// a message that names both sizes.
//
// Speed on shared memory: with PeerErrorHandling::kNone and a peer region
// from MemoryRegion::allocate, a GET is a memcpy from the peer's mapped
// segment, at ucx_perftest's bandwidth (refit-ucx-bench --transport shm);
// keep local buffers 64-byte aligned, a misaligned destination costs that
// memcpy about a tenth.
//
// Cancelling: UCX 1.13 cannot cancel an RMA request, so the engine cancels by
// closing the endpoints that still have GETs or PUTs in flight with
// UCP_EP_CLOSE_FLAG_FORCE; UCX then completes those requests with an error.
// Such an endpoint is failed afterwards and the caller reconnects.
//
// Threads and ownership:
//  - mutex_ guards the worker and all batch state (scheduler_, slots_,
//    run_status_, ...). UCX callbacks (completions, and the handler of the
//    active-message path's replies) run inside ucp_worker_progress, which
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

#include <atomic>
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
#include "transport/common/threads.h"
#include "transport/ucx/am_rma.h"
#include "transport/ucx/by_copy.h"
#include "transport/ucx/chunking.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {

// Direction of a run. kGet: remote -> local (the local bytes are written).
// kPut: local -> remote (the local bytes are read; the peer's are written).
enum class Op : uint8_t { kGet, kPut };

// One range of a gather: like a GET run's fields, on the gather's endpoint.
struct GatherPart {
  uint64_t rkey_id = 0;
  uint64_t remote_address = 0;
  void* local_address = nullptr;
  uint64_t bytes = 0;  // > 0
};

struct GetRun {
  Endpoint* endpoint = nullptr;  // borrowed; outlives the batch
  uint64_t rkey_id = 0;          // imported on `endpoint` (Endpoint::import_rkey)
  uint64_t remote_address = 0;   // inside that key's region
  void* local_address = nullptr; // inside a region added with add_local_region
  uint64_t bytes = 0;            // > 0
  Op op = Op::kGet;
  // Non-empty: a gather (op kGet) of these ranges (borrowed; they outlive
  // the batch), in this order; `bytes` is their sum and rkey_id,
  // remote_address and local_address are not used. A gate may not move it.
  std::span<const GatherPart> gather;
};

struct BatchReport {
  Status status;                 // ok iff every run landed
  std::vector<Status> runs;      // one per run, in input order
  uint64_t bytes_done = 0;       // bytes of chunks that completed ok
  std::chrono::nanoseconds elapsed{0};
  uint64_t gets_issued = 0;      // UCX operations issued, GETs and PUTs
  uint64_t busy_retries = 0;     // gathers a busy peer answered, asked again
};

struct GetEngineOptions {
  WindowLimits limits;
  // The rank this engine pulls or pushes for: a batch's first operations
  // go to its endpoint first_endpoint(rank, endpoints) and on in order
  // (chunking.h), so that ranks whose plans name their peers alike do not
  // all ask the same ones first.
  uint64_t rank = 0;
  bool progress_thread = false;
  // Starts the progress thread (tests hand one that refuses; threads.h).
  ThreadFactory threads;
  // After a deadline or error, how long to wait for UCX to complete the
  // requests of force-closed endpoints.
  std::chrono::milliseconds cancel_grace{2000};
};

// How long the engine waits before asking a busy peer again (see the top).
constexpr std::chrono::microseconds kGatherRetryDelay{200};

class GetEngine {
 public:
  using RunCallback = std::function<void(uint32_t run, const Status& status)>;
  // Asked (with mutex_ held, on the progressing thread; it must not call
  // into the engine) before the first chunk of a run is issued: false holds
  // the run back (the rules of ChunkScheduler::Gate apply), true lets it go,
  // and may set *local to where the run lands instead of its local_address
  // (a free slot of a landing ring): inside the same registered region, with
  // room for the run's bytes, else the run fails.
  using Gate = std::function<bool(uint32_t run, void** local)>;

  // `worker` is borrowed and must outlive the engine.
  static Result<std::unique_ptr<GetEngine>> create(Worker& worker, GetEngineOptions options);
  ~GetEngine();
  GetEngine(const GetEngine&) = delete;
  GetEngine& operator=(const GetEngine&) = delete;

  // Local GET targets and PUT sources must lie inside a region added here
  // (borrowed; it must outlive the engine or be removed first).
  void add_local_region(const MemoryRegion& region);
  void remove_local_region(const MemoryRegion& region);

  // Runs one batch to completion, error or `deadline`. Validates every run
  // before issuing any (errors name the run). `on_run_done` is called once
  // per run as it finishes (ok or not).
  // `gate`, if given, holds runs back or moves them (Gate); whoever opens
  // it calls wake() so that the engine asks again.
  BatchReport run_batch(std::span<const GetRun> runs,
                        std::chrono::steady_clock::time_point deadline,
                        RunCallback on_run_done = {}, Gate gate = {});

  // Makes the running batch look at its gate again soon. Any thread, also
  // from no batch (then it does nothing useful); never blocks.
  void wake();

  // Ends the running batch early, for a caller that knows it failed (a run
  // failed, a copy stage behind the network broke, the plan changed): no
  // further chunk is issued, every run not yet finished fails with `why`,
  // and run_batch() returns once what is in flight has completed (not
  // cancelled: its memory is in use until then). Any thread, also from a
  // run callback or a gate; never blocks. The next batch starts afresh.
  void halt(const Status& why);

  // Gives up on the peer of `ep` once it has gone `quiet`, for a caller
  // that learned it may be gone (the coordinator declared it dead and the
  // plan moved on) while UCX still waits on it: a partitioned peer over tcp
  // keeps its endpoint and the requests in flight until the connection
  // times out, long after the batch's deadline. When `ep` has requests in
  // flight in the running batch (or the next one, if none runs) and none
  // has completed, nor been issued, for `quiet`, the progressing thread
  // force-closes it with `why`, and every unfinished run on it fails with
  // `why` at once, as when UCX reports a failed peer. A peer that still
  // answers is left alone (looked at again at every round of progress), and
  // the request is forgotten when the batch ends. Any thread, also from a
  // run callback; never blocks. `ep` is borrowed and must outlive the
  // engine.
  void drop_peer(Endpoint* ep, const Status& why, std::chrono::milliseconds quiet);

  // Makes every PUT completed so far on `endpoints` visible in the peers'
  // memory: ucp_ep_flush_nbx on each, then waits until all complete or
  // `deadline` (driving progress itself, or waiting on the progress thread,
  // as run_batch does). An endpoint that is already failed is not flushed
  // and makes the result an error naming it (its PUTs may not have landed);
  // an endpoint whose flush fails, or is still flushing at the deadline, is
  // force-closed (failed afterwards; the caller reconnects) and named in the
  // error. The other endpoints' flushes still run to completion. Ok means
  // every endpoint flushed. Not concurrently with run_batch().
  Status flush(std::span<Endpoint* const> endpoints,
               std::chrono::steady_clock::time_point deadline);

  // One round of worker progress, for a caller that drives progress between
  // batches (e.g. to notice peer failures). Without a progress thread only.
  unsigned progress();

  // UCX requests issued and not yet completed (zero between batches).
  uint64_t outstanding_requests() const;
  // For an engine left with outstanding requests (a peer that died where
  // UCX cannot tell, as over shared memory) on endpoints that outlive it:
  // stops the progress thread, so that a new engine may own the worker.
  // The engine must then stay alive as long as UCX may complete those
  // requests, that is until their endpoints and the worker are destroyed:
  // the completions point into it.
  void retire();
  // Request slots ever allocated (bounded by the window's op limit).
  size_t slot_count() const;

 private:
  struct Slot {
    GetEngine* engine = nullptr;
    Chunk chunk;
    uint64_t generation = 0;
    bool in_use = false;
    uint32_t index = 0;  // in slots_
    uint32_t seq = 0;    // bumped on every use; with index, the AM token
    // Active-message path (am_rma.h): done when the request's send has
    // completed and the reply has arrived (for a GET: every piece of it).
    bool am = false;
    bool am_sent = false;
    bool am_replied = false;
    uint64_t am_received = 0;  // GET bytes landed so far
    ucs_status_t am_status = UCS_OK;  // from the reply
    uint64_t am_reply_offset = 0;     // a refusal's offset: the peer's gather bound (am_rma.h)
    Endpoint* endpoint = nullptr;
    am_rma::RequestHeader am_header;  // must live until the send completes
    // A gather's request: its header and entries, likewise.
    am_rma::GatherHeader gather_header;
    std::vector<am_rma::GatherEntry> gather_entries;
    CopySource am_payload;  // a PUT's bytes or a gather's entries, for a send by copy
  };

  GetEngine(Worker& worker, GetEngineOptions options);
  static void on_op_done(void* request, ucs_status_t status, void* user_data);
  static ucs_status_t on_am_reply(void* arg, const void* header, size_t header_length,
                                  void* data, size_t length, const ucp_am_recv_param_t* param);
  void issue_am_locked(Slot* slot, const GetRun& r);
  void issue_gather_locked(Slot* slot, const GetRun& r);
  // Copies `length` bytes of run `run`'s gather stream, from `offset` on,
  // to the parts' local places.
  void scatter_locked(uint32_t run, uint64_t offset, const uint8_t* data, uint64_t length);
  void am_progress_locked(Slot* slot);
  // Fails the AM slots of `ep` still waiting for a reply that can no longer
  // come (the endpoint was closed).
  void abandon_am_locked(const Endpoint* ep);
  Status set_reply_handlers(bool on);
  void complete_locked(Slot* slot, ucs_status_t status);
  void finish_run_locked(uint32_t run);
  void fail_run_locked(uint32_t run, const Status& status);
  void pump_locked();
  // Force-closes the endpoints drop_peer() named.
  void drop_peers_locked();
  // Carries out a halt() once; true while the batch is halted.
  bool halt_locked();
  void issue_locked(const Chunk& chunk);
  void cancel_locked(const std::string& reason);
  Slot* take_slot_locked();
  Status validate_locked(std::span<const GetRun> runs, std::vector<ChunkRun>* chunk_runs);
  Status validate_gather_locked(uint32_t i, const GetRun& r);
  void progress_loop();
  // The progress thread's body threw: every batch from now on fails with
  // `why` (the one running included), and flush() progresses on its caller.
  void progress_failed(const Status& why);
  bool batch_done_locked() const { return !scheduler_ || scheduler_->done(); }

  Worker& worker_;
  const GetEngineOptions options_;
  // Tells this engine's AM tokens from those of an earlier engine on the
  // same worker: a reply to a request of an engine that is gone (its
  // endpoint force-closed at a deadline) may still arrive, and must not be
  // taken for the reply to a new request in the same slot.
  const uint16_t instance_;

  mutable std::mutex mutex_;
  std::condition_variable batch_cv_;  // signalled when the batch may be done

  // Guarded by mutex_.
  std::vector<const MemoryRegion*> local_regions_;
  std::deque<Slot> slots_;  // stable addresses: UCX holds Slot* as user data
  std::vector<Slot*> free_slots_;
  uint64_t outstanding_ = 0;
  uint64_t generation_ = 0;
  // halt(): requested (any thread), and carried out in this batch (mutex_).
  std::atomic<bool> halt_{false};
  std::mutex halt_mu_;  // guards halt_why_ and drops_; never held with mutex_ waited for
  Status halt_why_;
  // drop_peer(): endpoints to force-close once quiet, and whether any are
  // waiting (both under halt_mu_; the flag read without it).
  struct Drop {
    Endpoint* ep;
    Status why;
    std::chrono::milliseconds quiet;
  };
  std::vector<Drop> drops_;
  std::atomic<bool> drop_pending_{false};
  bool halted_ = false;
  // Batch state, valid while a batch runs.
  std::optional<ChunkScheduler> scheduler_;
  std::span<const GetRun> runs_;
  std::vector<Endpoint*> batch_eps_;
  std::vector<bool> ep_dropped_;
  // Per batch endpoint: when a request on it was last issued or completed
  // (or a piece of a reply came), for drop_peer's `quiet`.
  std::vector<std::chrono::steady_clock::time_point> ep_last_event_;
  // Per batch endpoint held after a busy gather reply: when to ask again
  // (time_point{}: not held); how many are held.
  std::vector<std::chrono::steady_clock::time_point> ep_retry_at_;
  uint32_t eps_held_ = 0;
  uint64_t busy_retries_ = 0;
  std::vector<Status> run_status_;
  std::vector<bool> run_reported_;
  std::vector<uint32_t> run_ep_;
  std::vector<ucp_mem_h> run_memh_;  // local registration of each run
  RunCallback on_run_done_;
  Gate gate_;
  ChunkScheduler::Gate scheduler_gate_;  // gate_, as the scheduler asks it
  std::vector<uint8_t*> run_local_;      // per run: where it lands (the gate may move it)
  std::vector<const MemoryRegion*> run_region_;  // per run: the local region it lies in
  // Per gather run: where its parts' stream offsets start in gather_offsets_
  // (part i of the run begins at gather_offsets_[run_gather_[run] + i]).
  std::vector<uint32_t> run_gather_;
  std::vector<uint64_t> gather_offsets_;
  uint64_t bytes_done_ = 0;
  uint64_t gets_issued_ = 0;

  // Progress thread; stop_ guarded by mutex_.
  bool stop_ = false;
  Status progress_error_;  // not ok once the progress thread failed; guarded by mutex_
  std::thread thread_;
};

}  // namespace refit::ucx
