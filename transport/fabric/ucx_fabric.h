#pragma once
// The local fabric over UCX (host memory; shared memory between the
// processes of one host in every test): each send is a PUT into the peer's
// registered buffer, run on a GET engine of its own worker. Completion is a
// mailbox flag (mailbox.h): the mailbox lives in registered memory, its
// address and rkey travel in the rank's contact with the worker address;
// when every send to a peer is done, finish() flushes the endpoint (the PUTs
// are then visible there) and PUTs the flag into the peer's slot, then waits
// for the flags of the peers that send here.
//
// Shared memory in UCX 1.13 has no peer-failure support (ucx/endpoint.h):
// with the "shm" transports the endpoints use UCP_ERR_HANDLING_MODE_NONE and
// the deadline guards against a dead peer.
//
// Threads: as LocalFabric says. Endpoints are made and rkeys imported in
// begin(), before the engine (and its progress thread) exists; end()
// destroys the engine.

#include <deque>
#include <map>
#include <memory>
#include <optional>

#include "transport/fabric/local_fabric.h"
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
  };
  struct Contact {
    std::vector<uint8_t> address;
    uint64_t mailbox = 0;
    std::vector<uint8_t> mailbox_rkey;
  };
  explicit UcxFabric(UcxFabricConfig config) : config_(std::move(config)) {}
  static Result<Contact> parse_contact(const std::vector<uint8_t>& bytes, int32_t rank);
  Result<uint64_t> import(PeerState& p, const std::vector<uint8_t>& rkey);

  UcxFabricConfig config_;
  ucx::PeerErrorHandling mode_ = ucx::PeerErrorHandling::kPeer;
  std::optional<ucx::Context> context_;
  std::optional<ucx::Worker> worker_;
  std::vector<uint8_t> address_;
  std::deque<ucx::MemoryRegion> regions_;  // stable: the AM server holds them
  // Serves peers' PUTs when the fabric has no RMA lane (ucx/am_rma.h).
  std::unique_ptr<ucx::AmRmaServer> rma_server_;
  std::unique_ptr<uint64_t[]> mailbox_;
  std::optional<ucx::MemoryRegion> mailbox_region_;
  std::unique_ptr<uint64_t[]> flags_;
  std::optional<ucx::MemoryRegion> flags_region_;
  std::map<int32_t, PeerState> peers_;  // by rank, kept across refreshes
  uint64_t next_rkey_id_ = 1;

  // One refresh (begin .. end).
  const Schedule* schedule_ = nullptr;
  Clock::time_point deadline_;
  std::unique_ptr<ucx::GetEngine> engine_;
  std::vector<ucx::Endpoint*> eps_;               // per schedule peer
  std::vector<std::vector<uint64_t>> buffer_ids_;  // per schedule peer, per buffer: rkey id
  std::vector<uint64_t> mailboxes_;               // per schedule peer: its slot for this rank
  std::vector<uint64_t> mailbox_ids_;
  std::vector<uint32_t> out_peers_;               // peers this rank sends to
  std::vector<int32_t> in_ranks_;                 // ranks that send to this rank
};

}  // namespace refit::fabric
