#pragma once
// The device operations the GPU path needs, as two small interfaces, so that
// the logic above them (the staging pipeline, staging.h; the NCCL fabric's
// fan-out rounds, fabric/nccl_fabric.h) is plain C++ that the CPU tests run
// against host implementations of the same interfaces:
//
//   CopyOps     asynchronous copies on one stream, and events on it
//               (CUDA: cudaMemcpy{,2D,3D}Async on a stream of its own,
//               cudaEventRecord/cudaEventQuery; cuda_copy_ops.h);
//   DomainComm  one communicator of one domain: groups of point-to-point
//               sends and receives on one stream, completion by polling,
//               abort (NCCL: ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd
//               on a non-blocking communicator, ncclCommAbort; nccl_comm.h).
//   CommFactory makes the unique ids that travel in a rank's contact and the
//               communicators built from them.
//
// Nothing here includes a CUDA or NCCL header: a build without them compiles
// the logic and its tests all the same.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "planner/status.h"
#include "transport/cuda/copy_plan.h"
#include "transport/cuda/scatter_kernel.h"

namespace refit::cuda {

// The count words of a communicator (DomainComm::words): per rank of the
// communicator and way (sent, received), this many u64 words, the layout of
// one round's announcement (transport/fabric/round_words.h). 128 words name
// 62 ranges of positions, 1 KiB per peer and way in a round's count
// exchange: with 64 (30 ranges) the simulator put the fan-out of DeepSeek-V3
// on 128+128 GB200 29 ms behind the network, with 128 25 ms
// (docs/simulator.md, "What it shows today").
inline constexpr size_t kCountWordsPerPeer = 128;

using Clock = std::chrono::steady_clock;

// Asynchronous copies, executed in issue order on one stream. Pointers are
// whatever the implementation's memory is (device or pinned host for CUDA;
// host for the fake). Threads: one thread at a time.
class CopyOps {
 public:
  virtual ~CopyOps() = default;
  // Issues `copy` after everything issued before it.
  virtual Status copy(const Copy& copy) = 0;
  // Issues all of `copies`, in order; an implementation may batch them (CUDA:
  // many small 1-D copies in one kernel launch).
  virtual Status copy_all(std::span<const Copy> copies) {
    for (const Copy& c : copies) REFIT_RETURN_IF_ERROR(copy(c));
    return Status::ok();
  }
  // Marks the point after everything issued so far; done(ticket) says when
  // the stream has passed it. Tickets increase.
  virtual Result<uint64_t> record() = 0;
  virtual Result<bool> done(uint64_t ticket) = 0;
};

// One point-to-point operation of a group; `peer` is the rank in the
// communicator. NCCL matches the n-th send from a to b with the n-th receive
// at b from a, and the sizes must agree.
struct P2p {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int32_t peer = 0;
  void* data = nullptr;
  uint64_t bytes = 0;
};

// One communicator (NCCL: of the ranks of one domain), and the stream its
// groups run on. Threads: one thread at a time (the fabric's round thread).
// Invariant: every group issued runs after the previous one on the stream.
class DomainComm {
 public:
  virtual ~DomainComm() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // Bounds every wait inside the calls below (NCCL: a non-blocking group
  // still connecting to a peer before it is on the stream); past it they
  // return a timeout.
  virtual void set_deadline(Clock::time_point deadline) = 0;
  // A small array of u64 words in the communicator's memory (device memory
  // for NCCL), for the counts a round exchanges, and its host mirror.
  // put_words copies host_words()[0, n) to words() on the stream;
  // get_words copies words()[from, from + n) back into host_words(), also on
  // the stream; the host side may be read once poll() says idle.
  virtual uint64_t* words() = 0;
  virtual uint64_t* host_words() = 0;
  virtual size_t word_count() const = 0;
  virtual Status put_words(size_t n) = 0;
  virtual Status get_words(size_t from, size_t n) = 0;
  // Makes the stream wait for everything issued so far on the upstream
  // stream (the one the network's landing copies run on), so that a send
  // never reads bytes that are still on their way into device memory.
  virtual Status order_after_upstream() = 0;
  // Issues one group after everything issued before it.
  virtual Status issue(std::span<const P2p> group) = 0;
  // true once everything issued has completed; an error once the
  // communicator failed (a peer's abort shows only as no progress).
  virtual Result<bool> idle() = 0;
  // Abandons everything in flight; the communicator is unusable afterwards.
  // Must return even while a peer is gone (ncclCommAbort).
  virtual void abort() = 0;

  // The packed fan-out (transport/fabric/pack.h), where the factory
  // can_scatter(). pack_areas: two areas of `bytes` in the communicator's
  // memory (device memory for NCCL), one to gather sends into, one to
  // receive packs in, and room for up to `max_pieces` pieces in one
  // scatter() call; kept with the communicator, the same while `bytes` and
  // `max_pieces` do not grow. Call it before the first round, while nothing
  // is in flight: it is the only place that allocates. scatter: copies the
  // pieces on the stream after everything issued before it (CUDA: the
  // scatter kernel, which serves as the gather too); the caller's array may
  // be reused once it returns. More than `max_pieces` pieces is an error
  // (a status; nothing is issued), never a reallocation behind work in
  // flight.
  struct PackAreas {
    uint8_t* send = nullptr;
    uint8_t* recv = nullptr;
  };
  virtual Result<PackAreas> pack_areas(uint64_t bytes, size_t max_pieces) {
    (void)bytes;
    (void)max_pieces;
    return Status::unsupported("this communicator has no pack areas");
  }
  virtual Status scatter(std::span<const ScatterPiece> pieces) {
    (void)pieces;
    return Status::unsupported("this communicator cannot scatter");
  }
};

class CommFactory {
 public:
  virtual ~CommFactory() = default;
  // A fresh unique id (NCCL: ncclGetUniqueId, 128 bytes). An id serves one
  // communicator: NCCL's bootstrap root answers once.
  virtual Result<std::vector<uint8_t>> unique_id() = 0;
  // The communicator of `size` ranks that share `id`, as rank `rank`.
  // Returns by the deadline: a rank that never joins is a timeout, and what
  // was started is aborted.
  virtual Result<std::unique_ptr<DomainComm>> connect(const std::vector<uint8_t>& id, int32_t size,
                                                      int32_t rank, Clock::time_point deadline) = 0;
  // Whether its communicators implement pack_areas() and scatter() (NCCL:
  // when the scatter kernel is compiled in, REFIT_HAVE_SCATTER_KERNEL).
  virtual bool can_scatter() const { return false; }
};

}  // namespace refit::cuda
