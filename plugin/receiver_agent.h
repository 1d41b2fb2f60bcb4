#pragma once
// The receiver agent, inside an inference process (include/refit/refit.h,
// refit_receiver_*): registers the server's buffers, and on refresh pulls
// this rank's part of the plan from the sources over the network and passes
// the slices it pulled for its domain on to the other ranks of the domain
// over the local fabric, each as soon as it has landed.
//
// One refresh, as executed here:
//   1. the version: the group's latest (REFIT_LATEST) or the one asked for,
//      waiting for it to be published until the deadline; lease it.
//   2. the plan part of this rank for the current membership (fetch_plan),
//      compiled once per membership epoch: network GETs, sends to the
//      domain's other ranks (each depending on the GETs that brought its
//      bytes), and what the peers send to this rank.
//   3. the GETs run on the network engine; each run that lands releases the
//      sends that read it to the fan-out thread, which passes them to the
//      local fabric (transport/fabric/local_fabric.h) while the next GETs
//      are in flight.
//   4. when every send is done, the fabric makes them visible at the peers
//      and tells them; this rank waits until every peer that sends to it
//      has done the same.
//   5. release the lease; the report.
// Direct mode writes into the server's buffers (the server pauses for the
// whole refresh; a failure leaves them torn). Staged mode writes into
// staging copies the agent allocates and registers instead, while the server
// goes on reading the live buffers; then it reports "staged v" and waits for
// the coordinator's commit (every rank of the instance staged) or abort, and
// commit() copies the bytes the refresh wrote into the live buffers: the
// only pause. A failure anywhere in the instance leaves the live buffers on
// the old version.
//
// How the fabric signals completion is its own business
// (transport/fabric/ucx_fabric.h: mailbox flags).
//
// Threads: the caller's thread runs every public method (one at a time, as
// the C ABI says) except that refresh_start() moves the refresh itself to a
// thread of the agent; until it has finished, only poll/wait/report/version
// and the destructor may be called. Endpoints and memory are created only
// while no engine exists; engines (with their progress threads) live for one
// refresh.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "plugin/config.h"
#include "plugin/coordinator_link.h"
#include "plugin/describe.h"
#include "plugin/log.h"
#include "transport/cuda/device_ops.h"
#include "transport/fabric/local_fabric.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::plugin {

struct CompiledPart;

class ReceiverAgent {
 public:
  static Result<std::unique_ptr<ReceiverAgent>> create(std::string_view config_json);
  ~ReceiverAgent();
  ReceiverAgent(const ReceiverAgent&) = delete;
  ReceiverAgent& operator=(const ReceiverAgent&) = delete;

  Status add_buffer(std::string_view description, void* data, uint64_t bytes);
  Status join();
  Status refresh(int64_t version, std::chrono::milliseconds timeout);
  Status refresh_start(int64_t version, std::chrono::milliseconds timeout);
  // nullopt while the started refresh runs.
  std::optional<Status> refresh_poll();
  std::optional<Status> refresh_wait(std::chrono::milliseconds timeout);
  bool refresh_running() const;
  // Staged mode: copies the staged version into the live buffers (the
  // server pauses around it). Fails when no version is staged.
  Status commit();
  const std::string& report() const { return report_; }
  int64_t version() const { return version_.load(); }

 private:
  struct Buf {
    BufferPart part;
    uint8_t* live = nullptr;  // the server's buffer
    uint8_t* data = nullptr;  // where refreshes write: `live`, or the staging copy
    uint64_t bytes = 0;
    std::shared_ptr<uint8_t> staging;  // host staging copy (plugin/host_memory.h)
    // GPU memory (a build with CUDA): the staging copy is device memory too,
    // and where the network cannot write device memory (UCX without CUDA
    // support), GETs land in the agent's landing ring and are copied on to
    // `data` chunk by chunk while the next ones arrive (`ring`).
    bool device = false;
    bool ring = false;
    std::shared_ptr<void> device_memory;  // owner of the staging copy
    std::optional<ucx::MemoryRegion> net_region;  // none with `ring`
    std::vector<uint8_t> local_key;  // the fabric's key for it
  };
  struct Peer {
    std::vector<uint8_t> address;  // the worker address the endpoint was made from
    std::optional<ucx::Endpoint> ep;
    std::map<std::string, uint64_t> rkey_ids;  // "buffer\0packed rkey" -> id imported on ep
  };
  struct Report;

  explicit ReceiverAgent(AgentConfig config);
  // GPU buffers: a staging copy in device memory; the landing ring (pinned
  // host slots registered with the network), made at the first buffer
  // that needs it.
  Status device_staging(Buf* b);
  Status landing_ring(bool pinned);
  // Runs `copies` on the copy stream and waits until they are done.
  Status copy_and_wait(const std::vector<cuda::Copy>& copies);
  Status refresh_now(int64_t version, std::chrono::milliseconds timeout);
  // Checks what landed against the sources' hashes (plugin/verify.h).
  Status verify(int64_t version, Report* report);
  Status stage_barrier(Status st, int64_t version, std::chrono::steady_clock::time_point deadline);
  Status run_refresh(int64_t version, std::chrono::steady_clock::time_point deadline, Report* report);
  Status execute(const CompiledPart& part, int64_t version, std::chrono::steady_clock::time_point deadline,
                 Report* report);
  Result<std::shared_ptr<CompiledPart>> compile(const control::Json& reply);
  Result<ucx::Endpoint*> endpoint(int32_t rank, const std::vector<uint8_t>& address);
  uint64_t rkey_id(int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey);
  void finish(Status status, const Report& report);

  AgentConfig config_;
  Log log_;
  std::shared_ptr<const RecipeLayout> recipe_;
  std::optional<ucx::Context> net_context_;
  std::optional<ucx::Worker> net_worker_;
  std::unique_ptr<fabric::LocalFabric> fabric_;
  // The copies from the landing ring to device memory, on a stream of their
  // own that the NCCL fabric's sends wait for (null without the GPU path).
  std::unique_ptr<cuda::CopyOps> copy_ops_;
  int fabric_gpu_ = -1;  // the NCCL fabric's device
  std::shared_ptr<uint8_t> ring_memory_;  // config_.landing_bytes
  std::optional<ucx::MemoryRegion> ring_region_;
  std::unique_ptr<CoordinatorLink> link_;
  std::vector<Buf> buffers_;
  std::map<int32_t, Peer> sources_;  // network endpoints, kept across refreshes
  uint64_t next_rkey_id_ = 1;
  std::shared_ptr<CompiledPart> compiled_;  // the part of compiled_->epoch
  bool joined_ = false;
  bool changed_ = false;
  std::atomic<int64_t> version_{0};
  // Staged mode: the version staged and committed by the instance, waiting
  // for commit(), and the byte ranges of each buffer it wrote.
  int64_t staged_version_ = 0;
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> staged_ranges_;  // per buffer: offset, bytes
  bool aborted_ = false;  // the last attempt ended in an abort of the instance
  std::string report_ = "{}";

  // The started refresh (refresh_start).
  mutable std::mutex async_mutex_;
  std::condition_variable async_cv_;
  std::thread async_;
  bool async_done_ = true;  // guarded by async_mutex_
  Status async_status_;     // guarded by async_mutex_
};

}  // namespace refit::plugin
