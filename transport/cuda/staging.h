#pragma once
// Pinned host staging for device buffers that the network cannot reach.
//
// Where UCX reports CUDA memory for a device buffer (ucp_mem_query), GETs
// land in it directly. Where it does not (Debian's UCX 1.13 is built without
// CUDA), every byte goes through a ring of pinned host slots, chunk by chunk:
//
//   to the device (receiver):  network GET into a slot -> copy slot to the
//                              device places of those bytes -> slot free;
//   from the device (source):  copy device places into a slot -> network
//                              send from the slot -> slot free.
//
// With n slots, up to n chunks are in flight at once, some in the network
// stage and some in the copy stage, so the copies of chunk k overlap the
// network of chunk k+1. A chunk's device side may be many places (a strided
// box packed at the source): its pieces become 2-D/3-D copies (copy_plan.h).
//
// The logic is plain C++ over CopyOps (device_ops.h): CUDA in production,
// a host implementation in the CPU tests.
//
// Threads: run() on one thread; the network stage's done() callbacks may
// come from any thread, also after run() returned (they then do nothing).

#include <functional>
#include <memory>
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

enum class Direction { kToDevice, kFromDevice };

// The device side of one run: its bytes, in order, are the concatenation of
// these places.
struct DevicePlace {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
};
struct StagedRun {
  std::vector<DevicePlace> places;
  uint64_t bytes() const;
};

// One chunk: bytes [offset, offset + bytes) of run `run`, in a slot.
struct StagedChunk {
  uint32_t run = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct StagingOptions {
  uint64_t slot_bytes = 4 << 20;  // one chunk
  uint32_t slots = 4;
};
Status validate(const StagingOptions& options);

struct StagingStats {
  uint64_t chunks = 0;
  uint64_t copies = 0;           // after coalescing (copy_plan.h)
  uint32_t max_in_network = 0;   // chunks in the network stage at once
  uint32_t max_in_copy = 0;      // chunks in the copy stage at once
  uint64_t overlapped = 0;       // copies issued while a network chunk was in flight
};

class StagingPipeline {
 public:
  // The network part of one chunk. kToDevice: fill `slot` with the chunk's
  // bytes; kFromDevice: send them from `slot`. Returns whether it was
  // issued; when it was, calls done() exactly once, from any thread. The
  // network must finish (or fail) every chunk it accepted by the deadline
  // (the GET engine does).
  using Network = std::function<Status(const StagedChunk&, uint8_t* slot, std::function<void(Status)> done)>;
  // Called on run()'s thread once every byte of a run has passed both stages.
  using RunDone = std::function<void(uint32_t run)>;

  // `host` holds options.slots slots of options.slot_bytes (pinned for CUDA,
  // and registered with the network by the caller); it and `ops` outlive the
  // pipeline.
  static Result<std::unique_ptr<StagingPipeline>> create(CopyOps& ops, std::span<uint8_t> host,
                                                         const StagingOptions& options);
  ~StagingPipeline();
  StagingPipeline(const StagingPipeline&) = delete;
  StagingPipeline& operator=(const StagingPipeline&) = delete;

  // Moves every run through the two stages. Returns when all have passed,
  // or at the first error, or at the deadline; in every case no copy is
  // left running on the slots when it returns.
  Status run(Direction direction, std::span<const StagedRun> runs, const Network& network, const RunDone& run_done,
             Clock::time_point deadline);

  const StagingStats& stats() const { return stats_; }

 private:
  struct Shared;
  StagingPipeline(CopyOps& ops, std::span<uint8_t> host, StagingOptions options);
  Status issue_copy(Direction direction, const StagedRun& run, const StagedChunk& chunk, uint8_t* slot);

  CopyOps& ops_;
  std::span<uint8_t> host_;
  StagingOptions options_;
  std::shared_ptr<Shared> shared_;  // what network callbacks touch
  StagingStats stats_;
};

}  // namespace refit::cuda
