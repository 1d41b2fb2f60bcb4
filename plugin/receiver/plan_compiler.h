#pragma once
// The plan compiler: one receiver's typed plan part
// (transport/control/messages.h, PlanPart) in; out, what the transfer
// executor runs: the network GETs into this rank's buffers, the sends to
// the other ranks of its domain, each depending on the GETs that bring the
// bytes it reads, and what the peers send to this rank. It checks the part
// against the buffers this rank registered: a run that names a buffer this
// rank lacks, or a range outside one, or a send of bytes this rank never
// pulls, is refused with a message naming the run.
//
// Pure: no UCX, no threads, no I/O (tests/plugin/plan_compiler_test.cc).
//
// Words: a "plan piece" is the planner's unit of a tensor (docs/planner.md);
// a run moves part of one. A GET here is one network run; the engine cuts
// it into transfer chunks ("chunk_bytes") and, for a buffer whose GETs go
// through the landing ring, into landing slots (transport/cuda/staging.h).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "planner/dtype.h"
#include "planner/plan_epoch.h"
#include "planner/status.h"
#include "transport/control/messages.h"
#include "transport/convert/convert.h"
#include "transport/fabric/local_fabric.h"

namespace refit::plugin::receiver {

// A buffer of this rank as the compiler sees it.
struct LocalBuffer {
  std::string name;
  uint8_t* data = nullptr;  // where refreshes write (the live buffer or its staging copy)
  uint64_t bytes = 0;
  // Its GETs land in a landing slot and are copied on from there (GPU
  // memory that the network cannot write).
  bool through_slot = false;
  bool device = false;  // GPU memory
};

// Where a part's GETs of tensors converted on the way land: `bytes` of host
// memory the network can write, kept by the caller while the part lives.
using StagingArea = std::function<Result<uint8_t*>(uint64_t bytes)>;

// The id a source's packed rkey is imported under on its endpoint: the same
// (rank, buffer, rkey) always gets the same id.
using RkeyIds = std::function<uint64_t(int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey)>;

// Byte ranges [offset, offset + bytes) of one buffer, sorted and merged.
using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

struct CompiledPart {
  // A unit of a tensor converted on the way (docs/conversion.md, "At the
  // receiver"): its box, staged row-major in `from`, becomes `to` at `dst`
  // (element strides `strides`, the last one 1) and, to F8_E4M3, one F32
  // scale per block at `scales` (`scale_strides`, the last one 1).
  struct Convert {
    std::string tensor;
    DType from = DType::kBF16;
    DType to = DType::kF8E4M3;
    convert::BlockSize block;
    const uint8_t* staged = nullptr;
    std::vector<int64_t> start, size;
    uint8_t* dst = nullptr;
    std::vector<int64_t> strides;
    float* scales = nullptr;  // null: a cast
    std::vector<int64_t> scale_strides;
    bool device = false;  // `dst` and `scales` are GPU memory: the CUDA kernel
    // One dtype (from == to): a relayout (docs/refresh.md, "Column-major
    // receivers"), the staged box copied into `strides` as it is.
    bool relayout = false;
  };
  struct Get {
    int32_t source = 0;
    uint64_t rkey_id = 0;
    uint64_t remote = 0;       // the source's address of the first byte
    uint64_t bytes = 0;
    uint8_t* local = nullptr;  // where it lands; null when through a landing slot
    uint8_t* device = nullptr; // through a landing slot: where the slot's bytes are copied on to
    // `local` is GPU memory the network writes directly (over RDMA): never
    // gathered, since a gather's replies are scattered by the CPU.
    bool local_on_gpu = false;
  };
  PlanEpoch epoch;
  bool through_slots = false;  // some GETs land in the landing ring first
  std::vector<Get> gets;
  std::map<int32_t, std::vector<std::pair<uint64_t, std::vector<uint8_t>>>> source_keys;  // rank -> (id, packed)
  std::map<int32_t, std::vector<uint8_t>> source_addresses;                               // rank -> worker address
  fabric::Schedule schedule;                      // its version is set per refresh
  std::vector<uint32_t> send_deps;                // per send: the GETs and conversions it waits for
  // Per GET, then per conversion (index gets.size() + k): the sends that
  // read its bytes.
  std::vector<std::vector<uint32_t>> dependents;
  std::vector<Convert> converts;
  std::vector<uint32_t> convert_deps;                     // per conversion: the GETs it waits for
  std::vector<std::vector<uint32_t>> get_converts;        // per GET: the conversions that read its bytes
  uint64_t staging_bytes = 0;
  uint64_t network_bytes = 0;
  uint64_t local_bytes = 0;
  int64_t minimum_network_bytes = -1;
  bool solo = false;
  // Per buffer (in the order given): the byte ranges a refresh writes;
  // staged mode commits exactly these.
  std::vector<Ranges> written;
};

// Compiles the part of receiver `rank`. `part` must not be `unchanged`.
Result<std::shared_ptr<const CompiledPart>> compile_plan(const control::PlanPart& part, int32_t rank,
                                                         std::span<const LocalBuffer> buffers,
                                                         const RkeyIds& rkey_ids,
                                                         const StagingArea& staging = nullptr);

// Sorts and merges byte ranges (touching ones merge too).
Ranges merge_ranges(Ranges ranges);

}  // namespace refit::plugin::receiver
