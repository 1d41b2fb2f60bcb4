#pragma once
// Pinned host staging for device buffers that the network cannot reach.
//
// Where UCX reports CUDA memory for a device buffer (ucp_mem_query), GETs
// land in it directly. Where it does not (Debian's UCX 1.13 is built without
// CUDA), every byte passes through a landing ring: a few pinned host slots,
// registered with the network, that GETs land in chunk by chunk; each chunk
// is copied on to its device places as soon as it has landed, and its slot
// takes another chunk once that copy is done. With n slots, up to n chunks
// are in the network or in a copy at once, so the copies of one chunk
// overlap the GETs of the next ones, and the pinned memory is n slots,
// whatever the size of the buffers.
//
// The ring does not drive the network: it is the GET engine's gate
// (ucx::GetEngine::Gate). When the engine is about to issue a chunk, the
// ring gives it a free slot to land in, or holds it while every slot is
// busy; it hears from the engine which chunk landed. Any chunk takes any
// free slot, so a slow source holds only the slots of its own chunks in
// flight, not the others'. A chunk's device side may be many places (a
// strided box): its pieces become 2-D/3-D copies (copy_plan.h).
//
// The logic is plain C++ over CopyOps (device_ops.h): CUDA in production, a
// host implementation in the CPU tests and under REFIT_LANDING_MIRROR.
//
// Sources do not stage this way: a one-sided GET reads the source's memory
// with no help from the source, so a GPU shard is served from a pinned copy
// of the whole shard, filled at publish (plugin/source_agent.h).
//
// Threads: acquire(), landed() and network_over() from any thread (the
// engine calls the first two with its mutex held; they never wait for the
// copy stage); run() on one thread of its own.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "planner/status.h"
#include "transport/cuda/device_ops.h"

namespace refit::cuda {

// Where a GET into a buffer lands, given what the buffer is and what UCX
// reports for it.
enum class Landing { kDirect, kStaged };
Landing choose_landing(bool device_memory, bool ucx_reports_cuda);
const char* landing_name(Landing landing);

// The device side of one run (one network GET of the plan): its bytes, in
// order, are the concatenation of these places.
struct DevicePlace {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
};
struct StagedRun {
  std::vector<DevicePlace> places;
  uint64_t bytes() const;
};

// One chunk: bytes [offset, offset + bytes) of run `run`. The chunks of a
// run are in order, and the runs in order.
struct StagedChunk {
  uint32_t run = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct StagingOptions {
  uint64_t slot_bytes = 1 << 20;  // one chunk
  uint32_t slots = 64;
};
Status validate(const StagingOptions& options);

struct StagingStats {
  uint64_t chunks = 0;
  uint64_t copies = 0;         // after coalescing (copy_plan.h)
  uint32_t max_in_copy = 0;    // chunks in the copy stage at once
  uint64_t overlapped = 0;     // copies issued while the network still ran
  uint64_t held = 0;           // chunks that waited for a slot (acquire said no at least once)
};

class LandingRing {
 public:
  // Called on run()'s thread: every byte of run `run` is on its way to or
  // in device memory (see run()).
  using RunDone = std::function<void(uint32_t run)>;

  // Splits `runs` into chunks of at most options.slot_bytes.
  // `host` holds options.slots slots of options.slot_bytes (pinned for CUDA,
  // registered with the network by the caller); it, `ops` and the device
  // places outlive the ring.
  static Result<std::unique_ptr<LandingRing>> create(CopyOps& ops, std::span<uint8_t> host,
                                                     const StagingOptions& options, std::vector<StagedRun> runs);
  LandingRing(const LandingRing&) = delete;
  LandingRing& operator=(const LandingRing&) = delete;

  const std::vector<StagedChunk>& chunks() const { return chunks_; }
  // The slots' memory, all of them (what the network registers; a chunk's
  // GET may name it before acquire() moves it to its slot).
  uint8_t* base() const { return host_.data(); }

  // The engine's gate: may chunk k start landing now? True when a slot is
  // free, which it takes: *slot is where the chunk lands. False while every
  // slot is busy. After a failure, once no copy reads a slot any more,
  // always true, with the first slot (the network drains at once; what
  // lands then is not copied).
  bool acquire(uint32_t chunk, void** slot);
  // Where chunk k lands: the slot acquire() gave it.
  uint8_t* slot_of(uint32_t chunk) const;
  // The network finished chunk k (ok: its bytes are in its slot).
  void landed(uint32_t chunk, const Status& status);
  // No landed() follows (the engine's batch returned).
  void network_over();

  // The copy stage (once per ring: a ring serves one batch of the engine),
  // until the network is over and every chunk that landed
  // has been copied, or the first error. Calls run_done(r) once every chunk
  // of run r has been copied (with release_on_issue: once the copies are
  // issued, for a consumer that orders itself after the copy stream, like
  // the NCCL fabric), and slots_freed() after slots became free (the
  // caller wakes the engine). Copies are local and always finish: it waits
  // for those in flight before it returns, in every case, up to `bound`
  // (which only catches a broken device).
  Status run(const RunDone& run_done, const std::function<void()>& slots_freed, bool release_on_issue,
             Clock::time_point bound);

  uint32_t slots() const { return options_.slots; }
  StagingStats stats() const;

 private:
  LandingRing(CopyOps& ops, std::span<uint8_t> host, StagingOptions options, std::vector<StagedRun> runs);
  Status issue_copy(const StagedChunk& chunk, uint8_t* slot);

  CopyOps& ops_;
  std::span<uint8_t> host_;
  const StagingOptions options_;
  const std::vector<StagedRun> runs_;
  std::vector<StagedChunk> chunks_;
  std::atomic<bool> gate_open_{false};  // after a failure, once no copy reads a slot
  std::mutex slots_mu_;
  std::vector<uint32_t> free_slots_;               // guarded by slots_mu_
  std::unique_ptr<std::atomic<uint32_t>[]> slot_;  // per chunk: the slot it took
  std::unique_ptr<std::atomic<bool>[]> waited_;    // per chunk: counted in held_
  std::atomic<uint64_t> held_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint32_t, Status>> landed_;  // guarded by mu_
  bool over_ = false;                               // guarded by mu_
  StagingStats stats_;
};

}  // namespace refit::cuda
