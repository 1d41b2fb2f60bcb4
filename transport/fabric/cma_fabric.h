#pragma once
// The local fabric over cross-memory attach (Linux process_vm_writev), for
// host memory between the processes of one host: each send is one system
// call that copies from this process straight into the peer's buffer, with
// no intermediate copy and no progress needed on the peer. This is what
// UCX's cma transport does inside; UCX 1.13 uses it only for rendezvous
// active messages, and its PUT into memory it did not allocate falls back to
// emulation over posix/sysv active messages (ucx/endpoint.h), measured here
// at a tenth of the speed. Completion: mailbox flags (mailbox.h), written
// with the same system call after the data.
//
// Safety, since the peer is addressed by pid:
//  - a contact carries the pid and the process's start time (from
//    /proc/PID/stat); begin() checks both, so a pid reused by another
//    process after the peer died is refused, never written to;
//  - every send is checked against the peer's registered buffer (its key
//    carries the length), so nothing is written outside what the peer
//    registered;
//  - a peer that dies mid-refresh gives ESRCH: an error naming it.
// Permission: the kernel allows process_vm_writev where it would allow
// ptrace: same user, and under Yama's ptrace_scope 1 (Ubuntu's default)
// only an ancestor or a process the target declared (PR_SET_PTRACER).
// begin() declares only this domain's ranks, from the schedule's contacts:
// the one peer itself, or with several the nearest process they all
// descend from (their launcher), since Yama keeps one exception per
// process. Until a peer has declared this rank, its reads of that peer are
// refused and taken as "not open yet". Under scope 0 nothing is declared;
// with scope 2 or 3 create() fails with a message that says to use the UCX
// fabric ("local": {"fabric": "ucx"}). docs/security.md says what a
// deployment needs.
//
// Threads: as LocalFabric says.

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "transport/fabric/local_fabric.h"
#include "transport/fabric/mailbox.h"

namespace refit::fabric {

struct CmaFabricConfig {
  int32_t rank = 0;
  size_t max_iov = 64;  // iovecs per system call
};

// The process that Yama's ptrace_scope 1 must let attach to a rank so that
// all of `peers` (pids) may: the peer itself, or several peers' nearest
// common ancestor (see the top); 0 for no peer; an error naming two peers
// with no common ancestor below init. Exposed for tests.
Result<int> cma_tracer_for(const std::vector<int>& peers);

class CmaFabric final : public LocalFabric {
 public:
  static Result<std::unique_ptr<CmaFabric>> create(const CmaFabricConfig& config);
  ~CmaFabric() override = default;

  const char* name() const override { return "cma"; }
  Result<std::vector<uint8_t>> register_buffer(const std::string& name, void* data, uint64_t bytes) override;
  std::vector<uint8_t> contact() const override;
  Status begin(const Schedule& schedule, Clock::time_point deadline) override;
  Status send(std::span<const uint32_t> ready) override;
  Status finish(bool failed) override;
  void end() override;

 private:
  struct PeerProcess {
    int pid = 0;
    uint64_t start_time = 0;
    uint64_t mailbox = 0;
  };
  explicit CmaFabric(CmaFabricConfig config) : config_(config) {}
  static Result<PeerProcess> parse_contact(const std::vector<uint8_t>& bytes, int32_t rank);
  // Lets the schedule's peers attach to this process (see the top).
  Status admit_peers();
  // Writes `n` local pieces to `n` remote places of peer `peer`.
  Status write(uint32_t peer, const ::iovec* local, const ::iovec* remote, size_t n);
  // Returns once peer `peer` accepts this attempt's writes; an error when it
  // moved on, or at the deadline or a cancel.
  Status await_accepting(uint32_t peer);
  // Ends the attempt on this rank's side (`ok`: every sender's data landed):
  // clears the slots, remembers the senders that may still write
  // (mailbox::Fence::close) and closes the accepting word. Once per attempt,
  // from finish() or else end().
  void close_attempt(bool ok);

  CmaFabricConfig config_;
  int ptrace_scope_ = 0;
  int tracer_ = 0;  // the process declared with PR_SET_PTRACER, 0: none
  int pid_ = 0;
  uint64_t start_time_ = 0;
  std::unique_ptr<uint64_t[]> mailbox_;  // mailbox::kWords
  mailbox::Fence fence_;

  // One refresh (begin .. end).
  const Schedule* schedule_ = nullptr;
  Clock::time_point deadline_;
  std::vector<PeerProcess> procs_;   // per schedule peer
  std::vector<uint32_t> out_peers_;  // peers this rank sends to
  std::vector<int32_t> in_ranks_;    // ranks that send to this rank
  std::vector<uint32_t> in_peers_;   // their schedule peers
  bool open_ = false;                // the accepting word names this attempt
};

}  // namespace refit::fabric
