#pragma once
// The local fabric over UCX (host memory; shared memory between the
// processes of one host in every test): each send is a PUT into the peer's
// registered buffer, run on a GET engine of its own worker. Completion is a
// mailbox flag (mailbox.h): the mailbox lives in registered memory, its
// address and rkey travel in the rank's contact with the worker address;
// when every send to a peer is done, finish() flushes the endpoint (the PUTs
// are then visible there) and PUTs the flag into the peer's slot, then waits
// for the flags of the peers that send here. The mailbox's fence
// (mailbox.h) keeps a sender of an attempt that outlived this rank's from
// writing into a later version: each batch of PUTs to a peer first GETs its
// accepting word, and begin() waits for the senders of an earlier version
// that may still be writing (until their flag, their endpoint fails, or, on
// this host, their process is gone).
//
// Shared memory in UCX 1.13 has no peer-failure support (ucx/endpoint.h):
// with the "shm" transports the endpoints use UCP_ERR_HANDLING_MODE_NONE and
// the deadline guards against a dead peer.
//
// Threads: as LocalFabric says. Endpoints are made and rkeys imported in
// begin(), before the engine (and its progress thread) exists; end()
// destroys the engine. Between refreshes an idle thread of the fabric
// progresses the worker, so that peers' requests are served at any time
// (without an RMA lane UCX 1.13 emulates a PUT or GET with active messages
// that the target's progress answers): a peer's flag lands, and its read of
// this rank's accepting word is answered, while this rank is not refreshing.

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "transport/common/threads.h"
#include "transport/fabric/local_fabric.h"
#include "transport/fabric/mailbox.h"
#include "transport/ucx/am_rma.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::fabric {

struct UcxFabricConfig {
  int32_t rank = 0;
  std::vector<std::string> transports{"shm"};
  ucx::WindowLimits limits;
  // Starts the idle progress thread and each refresh's engine's (tests hand
  // one that refuses; transport/common/threads.h).
  ThreadFactory threads;
};

class UcxFabric final : public LocalFabric {
 public:
  static Result<std::unique_ptr<UcxFabric>> create(const UcxFabricConfig& config);
  ~UcxFabric() override;

  const char* name() const override { return "ucx"; }
  Result<std::vector<uint8_t>> register_buffer(const std::string& name, void* data, uint64_t bytes) override;
  std::vector<uint8_t> contact() const override;
  Status begin(const Schedule& schedule, Clock::time_point deadline) override;
  Status send(std::span<const uint32_t> ready) override;
  Status finish(bool failed) override;
  void end() override;

 private:
  struct PeerState {
    std::vector<uint8_t> address;
    std::optional<ucx::Endpoint> ep;
    std::map<std::vector<uint8_t>, uint64_t> rkey_ids;  // packed rkey -> id on ep
    uint64_t mailbox_id = 0;         // the rkey id of its mailbox on ep, and
    uint64_t accepting_word = 0;     // the address of its accepting word there
  };
  struct Contact {
    std::vector<uint8_t> address;
    uint64_t mailbox = 0;
    std::vector<uint8_t> mailbox_rkey;
    int pid = 0;                  // the peer's process, and
    uint64_t start_time = 0;      // its start time (mailbox::start_time_of)
    std::string boot_id;          // of its host: pid and start time count only on this host
  };
  explicit UcxFabric(UcxFabricConfig config) : config_(std::move(config)) {}
  static Result<Contact> parse_contact(const std::vector<uint8_t>& bytes, int32_t rank);
  Result<uint64_t> import(PeerState& p, const std::vector<uint8_t>& rkey);
  // As CmaFabric's: once peer `peer` accepts this attempt's writes.
  Status await_accepting(uint32_t peer);
  // As CmaFabric's: clears the slots, remembers the senders that may still
  // write, closes the accepting word. Once per attempt, from finish() or
  // else end().
  void close_attempt(bool ok);
  // Fence::Sender::over for a sender of an earlier attempt: its process on
  // this host is gone, its endpoint failed, or its accepting word (a GET
  // on the endpoint kept in peers_) is no longer `open`. Only inside
  // begin(), where the engine exists.
  bool sender_over(int32_t rank, uint64_t open, bool here, int pid, uint64_t start_time);

  UcxFabricConfig config_;
  ucx::PeerErrorHandling mode_ = ucx::PeerErrorHandling::kPeer;
  std::optional<ucx::Context> context_;
  std::optional<ucx::Worker> worker_;
  std::vector<uint8_t> address_;
  std::deque<ucx::MemoryRegion> regions_;  // stable: the AM server holds them
  // Serves peers' PUTs when the fabric has no RMA lane (ucx/am_rma.h).
  std::unique_ptr<ucx::AmRmaServer> rma_server_;
  std::unique_ptr<uint64_t[]> mailbox_;  // mailbox::kWords
  std::optional<ucx::MemoryRegion> mailbox_region_;
  mailbox::Fence fence_;
  int pid_ = 0;
  uint64_t start_time_ = 0;
  std::string boot_id_;
  std::unique_ptr<uint64_t[]> flags_;
  std::optional<ucx::MemoryRegion> flags_region_;
  std::map<int32_t, PeerState> peers_;  // by rank, kept across refreshes

  // The idle progress (see Threads above): progresses the worker while no
  // engine exists; register_buffer(), begin() and end() hold idle_mutex_
  // while they touch the worker or make and destroy the engine.
  void idle_loop();
  std::mutex idle_mutex_;
  bool idle_stop_ = false;  // guarded by idle_mutex_
  Status idle_error_;       // the idle thread failed: begin() fails with it; guarded by idle_mutex_
  std::thread idle_thread_;
  uint64_t next_rkey_id_ = 1;

  // One refresh (begin .. end).
  const Schedule* schedule_ = nullptr;
  Clock::time_point deadline_;
  std::unique_ptr<ucx::GetEngine> engine_;
  // Engines that ended with requests outstanding (GetEngine::retire): kept
  // alive for as long as the worker, since UCX may complete those requests
  // until it destroys the endpoints, at the latest in the worker's
  // destruction; then left undestroyed, as their destructors would touch
  // the worker. One per refresh that a dead peer left that way.
  std::vector<std::unique_ptr<ucx::GetEngine>> retired_;
  std::vector<ucx::Endpoint*> eps_;               // per schedule peer
  std::vector<std::vector<uint64_t>> buffer_ids_;  // per schedule peer, per buffer: rkey id
  std::vector<uint64_t> mailboxes_;               // per schedule peer: its slot for this rank
  std::vector<uint64_t> mailbox_ids_;
  std::vector<uint64_t> accepting_words_;          // per schedule peer: the address of its accepting word
  std::vector<Contact> contacts_;                  // per schedule peer
  std::vector<uint32_t> out_peers_;               // peers this rank sends to
  std::vector<int32_t> in_ranks_;                 // ranks that send to this rank
  std::vector<uint32_t> in_peers_;                // their schedule peers
  bool open_ = false;                             // the accepting word names this attempt
};

}  // namespace refit::fabric
