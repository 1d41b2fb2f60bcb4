#pragma once
// The local fabric: how the ranks of one domain pass on what one of them
// pulled over the network. On GPUs that is NCCL over NVLink; on host memory
// (and in every test on a machine without GPUs) it is UCX over shared memory
// (ucx_fabric.h). The receiver agent drives both through this interface with
// one schedule, so only the data movement differs.
//
// A refresh, as the agent drives a fabric:
//   begin(schedule)  once, before the first network GET is issued: connect
//                    to the peers, post what the fabric must post up front
//                    (NCCL: the receives, in schedule order);
//   send(ready)      from one thread, any number of times, with the sends
//                    whose bytes have landed (each send exactly once);
//                    returns when they are issued and their sources may be
//                    read again by the caller;
//   finish(failed)   once, after every send was passed (or the refresh
//                    failed): makes the sends visible at the peers, tells the
//                    peers this rank is done (or failed, so that they stop
//                    waiting), and waits until every receive of this rank
//                    has landed, within the deadline;
//   end()            releases the refresh's resources; always called.
//
// Threads: begin, send, finish and end are called from one thread at a time
// (the agent's fan-out thread); register_buffer and contact only while no
// refresh runs.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "planner/plan_epoch.h"
#include "planner/status.h"

namespace refit::fabric {

using Clock = std::chrono::steady_clock;

// A buffer of a peer, as the peer registered it with the coordinator.
struct RemoteBuffer {
  uint64_t address = 0;
  std::vector<uint8_t> key;  // the fabric's key for it (a UCX rkey; empty for NCCL)
};

struct Peer {
  int32_t rank = 0;
  std::vector<uint8_t> contact;        // what the peer's contact() returned
  std::vector<RemoteBuffer> buffers;   // those the schedule names
};

inline constexpr uint32_t kSelf = UINT32_MAX;

// One contiguous copy from this rank's memory to a peer's (or, with peer ==
// kSelf, to another place in this rank's memory).
struct Send {
  uint32_t peer = kSelf;      // index into Schedule::peers, or kSelf
  const uint8_t* src = nullptr;
  uint32_t buffer = 0;        // index into peers[peer].buffers (not for kSelf)
  uint64_t offset = 0;        // bytes into that buffer
  uint8_t* self_dst = nullptr;  // kSelf only
  uint64_t bytes = 0;
};

// One contiguous copy into this rank's memory from a peer.
struct Recv {
  uint32_t peer = 0;
  uint8_t* dst = nullptr;
  uint64_t bytes = 0;
};

// A receiver of this rank's domain (this rank included).
struct DomainMember {
  int32_t rank = 0;
  std::vector<uint8_t> contact;
};

struct Schedule {
  int64_t version = 0;
  PlanEpoch epoch;  // the plan's: every rank of the domain must run the same
  // Every receiver of the domain in rank order, this rank included: a fabric
  // that needs the whole domain (one NCCL communicator per membership) builds
  // it from this list; the UCX fabric needs only `peers`.
  std::vector<DomainMember> domain;
  std::vector<Peer> peers;
  std::vector<Send> sends;  // in plan order
  std::vector<Recv> recvs;  // in plan order; per peer, the order the peer sends in
};

class LocalFabric {
 public:
  virtual ~LocalFabric() = default;
  virtual const char* name() const = 0;

  // Makes [data, data + bytes) writable by peers; returns the key peers need
  // (RemoteBuffer::key). The buffer must outlive the fabric.
  virtual Result<std::vector<uint8_t>> register_buffer(const std::string& name, void* data, uint64_t bytes) = 0;
  // What peers need to reach this rank, for the coordinator to carry.
  virtual std::vector<uint8_t> contact() const = 0;
  // Whether contact() changed since it was last called (NCCL: a unique id
  // serves one communicator); the agent then registers the new one before
  // its next refresh.
  virtual bool contact_changed() const { return false; }

  virtual Status begin(const Schedule& schedule, Clock::time_point deadline) = 0;
  virtual Status send(std::span<const uint32_t> ready) = 0;
  virtual Status finish(bool failed) = 0;
  virtual void end() = 0;

  // Makes a finish() that waits for peers return promptly with an error
  // (the instance aborted, the membership changed). Any thread, any time;
  // begin() clears it.
  void cancel() { cancelled_.store(true, std::memory_order_release); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

 protected:
  void clear_cancel() { cancelled_.store(false, std::memory_order_release); }
  std::atomic<bool> cancelled_{false};
};

}  // namespace refit::fabric
