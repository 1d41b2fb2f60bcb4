#pragma once
// The receiver's resources: the server's buffers and their registrations
// (network, local fabric), the staging copies staged mode writes into, the
// landing ring GPU buffers land in when the network cannot write device
// memory, and the endpoints to the sources with their imported rkeys. Kept
// across refreshes; released in the reverse order of their making (the
// fabric and the copies before the memory they touch, endpoints before
// their worker, memory before its context).
//
// Threads: the caller's (one at a time, as the C ABI says). The transfer
// executor borrows what transfer_setup() names while an attempt runs; no
// endpoint or memory is made or released meanwhile.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/describe.h"
#include "plugin/log.h"
#include "plugin/receiver/plan_compiler.h"
#include "plugin/receiver/transfer_executor.h"
#include "transport/control/messages.h"
#include "transport/cuda/device_ops.h"
#include "transport/fabric/local_fabric.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::plugin::receiver {

struct Buffer {
  BufferPart part;
  uint8_t* live = nullptr;  // the server's buffer
  uint8_t* data = nullptr;  // where refreshes write: `live`, or the staging copy
  uint64_t bytes = 0;
  std::shared_ptr<uint8_t> staging;  // host staging copy (plugin/host_memory.h)
  // GPU memory: the staging copy is device memory too, and where the
  // network cannot write device memory (UCX without CUDA support), GETs
  // land in the landing ring's slots and are copied on to `data` while the
  // next ones arrive (`through_slot`).
  bool device = false;
  bool through_slot = false;
  std::shared_ptr<void> device_memory;           // owner of the staging copy
  std::optional<ucx::MemoryRegion> net_region;   // none with `through_slot`
  std::vector<uint8_t> local_key;                // the fabric's key for it
};

class Resources {
 public:
  // The network context and worker, the local fabric the config asks for
  // and, with `force_landing_ring` (the test-only "test":
  // {"force_landing_ring": true}), the landing ring for host buffers too.
  // The fabric and the copies start their threads through `threads`.
  static Result<std::unique_ptr<Resources>> create(const AgentConfig& config, const Log& log,
                                                   bool force_landing_ring, const ThreadFactory& threads);
  ~Resources();
  Resources(const Resources&) = delete;
  Resources& operator=(const Resources&) = delete;

  // Registers a buffer whose part is `part` at [data, data + bytes).
  Status add_buffer(BufferPart part, uint8_t* data, uint64_t bytes);
  bool has_buffer(const std::string& name) const;
  const std::vector<Buffer>& buffers() const { return buffers_; }
  // The buffers as the plan compiler sees them.
  std::vector<LocalBuffer> local_buffers() const;
  // This rank's registration with the coordinator.
  control::RegisterReceiver registration(const AgentConfig& config) const;

  // The id `rkey` of `buffer` of source `rank` is imported under.
  uint64_t rkey_id(int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey);
  // Endpoints to every source `part` names, its rkeys imported: what an
  // attempt runs on. Only while no attempt runs.
  Result<TransferSetup> transfer_setup(const CompiledPart& part);

  // Host memory the network writes, of `bytes` at least, where the GETs of
  // tensors converted on the way land (docs/conversion.md); kept and
  // reused while large enough. Only while no attempt runs.
  Result<uint8_t*> conversion_staging(uint64_t bytes);

  fabric::LocalFabric& fabric() { return *fabric_; }
  // Staged mode: copies `ranges` of every buffer from its staging copy into
  // the live buffer.
  Status commit(const std::vector<Ranges>& ranges);

 private:
  struct Peer {
    std::vector<uint8_t> address;  // the worker address the endpoint was made from
    std::optional<ucx::Endpoint> ep;
    std::map<std::string, uint64_t> rkey_ids;  // "buffer\0packed rkey" -> id imported on ep
  };

  Resources(const AgentConfig& config, const Log& log) : config_(config), log_(log) {}
  Status check_memory(const Buffer& b) const;
  Status stage(Buffer* b);
  Status device_staging(Buffer* b);
  Status make_landing_ring(bool pinned);
  Status copy_and_wait(const std::vector<cuda::Copy>& copies);
  Result<ucx::Endpoint*> endpoint(int32_t rank, const std::vector<uint8_t>& address);

  const AgentConfig& config_;
  const Log& log_;
  // In the order of their making; released in reverse.
  std::optional<ucx::Context> net_context_;
  std::optional<ucx::Worker> net_worker_;
  std::shared_ptr<uint8_t> ring_memory_;  // config_.landing_bytes
  std::optional<ucx::MemoryRegion> ring_region_;
  std::shared_ptr<uint8_t> convert_memory_;
  std::optional<ucx::MemoryRegion> convert_region_;  // released before its memory
  uint64_t convert_bytes_ = 0;
  std::vector<Buffer> buffers_;
  std::map<int32_t, Peer> sources_;  // network endpoints, kept across refreshes
  uint64_t next_rkey_id_ = 1;
  // The copies from the landing ring to device memory, on a stream of their
  // own that the NCCL fabric's sends wait for (null without the GPU path).
  std::unique_ptr<cuda::CopyOps> copy_ops_;
  int fabric_gpu_ = -1;  // the NCCL fabric's device
  // What conversions into GPU memory reuse (TransferSetup::gpu_work); made
  // by the first transfer_setup in builds with the CUDA kernels.
  std::shared_ptr<convert::GpuWork> gpu_work_;
  std::unique_ptr<fabric::LocalFabric> fabric_;
};

}  // namespace refit::plugin::receiver
