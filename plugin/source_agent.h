#pragma once
// The source agent, inside a trainer process (include/refit/refit.h,
// refit_source_*): registers the trainer's shards with UCX and with the
// coordinator, serves the receivers' GETs from them, and publishes versions.
//
// Threads: the caller's thread (one at a time, as the C ABI says) runs every
// public method. A progress thread owns the UCX worker while the agent is
// joined: receivers' GETs over tcp need the target's worker to progress (UCX
// emulates RMA with active messages there); it sleeps on the worker's event
// fd between events. In snapshot mode the agent serves copies of the shards
// taken at publish, so the trainer may write again at once; a publish then
// first waits (up to the coordinator timeout) until no receiver still reads
// the previous copy. Memory is registered, and the AM server's handlers
// installed, only while that thread is stopped.

#include <atomic>
#include <deque>
#include <cstdint>
#include <cstdlib>
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
#include "plugin/log.h"
#include "transport/common/threads.h"
#include "transport/control/messages.h"
#include "transport/ucx/am_rma.h"
#include "transport/ucx/context.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::plugin {

class SourceAgent {
 public:
  static Result<std::unique_ptr<SourceAgent>> create(std::string_view config_json);
  ~SourceAgent();
  SourceAgent(const SourceAgent&) = delete;
  SourceAgent& operator=(const SourceAgent&) = delete;

  Status add_tensor(std::string_view description, void* data, uint64_t bytes);
  Status join();
  Status publish(int64_t version);
  Status wait_drained(int64_t version, std::chrono::milliseconds timeout);

 private:
  struct Buf {
    std::string name;
    std::string dtype;
    uint8_t* data = nullptr;  // the trainer's shard
    uint64_t bytes = 0;
    // Snapshot mode: the copy receivers read, taken at publish.
    std::shared_ptr<uint8_t> snapshot;  // plugin/host_memory.h
    // A GPU shard (a build with CUDA): served from a pinned host mirror that
    // publish fills, where UCX cannot read device memory, in snapshot mode
    // and with "verify" (hashes run on the host); else straight from `data`.
    bool device = false;
    uint8_t* mirror = nullptr;
    std::shared_ptr<void> mirror_owner;
    uint8_t* served() const { return mirror ? mirror : snapshot ? snapshot.get() : data; }
    bool copied_at_publish() const { return mirror || snapshot; }
    std::vector<control::Segment> segments;
    std::optional<ucx::MemoryRegion> region;
  };
  SourceAgent(AgentConfig config);
  // Starts the progress thread unless it runs; a refused thread is the
  // error. stop_progress() ends it; progress_error() says whether it failed
  // (its body threw) since it was started.
  Status start_progress();
  void stop_progress();
  Status progress_error();
  // A GPU shard's pinned host mirror, where it needs one (Buf::mirror).
  Status gpu_mirror(Buf* b);
  // "quantize": "source" (plugin/source_convert.h): converts, at publish,
  // the segments the receivers hold in another dtype into converted_, and
  // marks the agent changed when its copies differ from those registered.
  Status convert_at_publish(int64_t version);
  // Verification: the hashes of the boxes this rank serves (plugin/verify.h),
  // as publish_version carries them.
  Result<control::Json> hash_served();

  AgentConfig config_;
  Log log_;
  std::optional<ucx::Context> context_;
  std::optional<ucx::Worker> worker_;
  std::vector<uint8_t> worker_address_;
  // Serves GETs over tcp from the registered buffers (ucx/am_rma.h says why).
  std::unique_ptr<ucx::AmRmaServer> rma_server_;
  std::unique_ptr<CoordinatorLink> link_;
  std::vector<control::TensorDecl> tensors_;
  // How many of tensors_ the coordinator holds (join): with no more, a
  // join that registers other buffers replaces them in place.
  size_t registered_tensors_ = 0;
  std::string registered_;  // the registration the coordinator holds, as sent
  std::deque<Buf> buffers_;  // stable addresses: the AM server holds the regions
  // The copies "quantize": "source" made at the last publish, served as one
  // more buffer (kConvertedBuffer) while they have segments.
  struct Converted {
    std::shared_ptr<uint8_t> memory;  // plugin/host_memory.h
    uint64_t bytes = 0;
    std::string key;  // ConvertLayout::key of what it holds
    std::vector<control::Segment> segments;
    std::optional<ucx::MemoryRegion> region;
  };
  std::optional<Converted> converted_;
  bool joined_ = false;
  bool changed_ = false;  // tensors added since the last registration
  int64_t published_ = 0;
  std::atomic<bool> stop_{false};
  ThreadFactory threads_;  // every thread of the agent, the link's included
  std::mutex progress_mu_;
  Status progress_error_;  // the progress thread's failure; guarded by progress_mu_
  std::thread progress_;
};

}  // namespace refit::plugin
