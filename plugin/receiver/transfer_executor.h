#pragma once
// The transfer executor: runs one attempt of a compiled plan part
// (plan_compiler.h). It owns the GET engine, the landing ring and the
// threads of the attempt, and joins every thread it started before it
// returns or is destroyed; the threads share nothing but the executor's
// members, each guarded as said below.
//
//   the caller's thread  the GETs (GetEngine::run_batch; the engine has a
//                        progress thread of its own);
//   fan-out              converts each unit of a tensor converted on the
//                        way once the GETs that stage it have landed
//                        (docs/conversion.md), passes each send to the
//                        local fabric as soon as the GETs and conversions
//                        it reads are done, then finishes the fabric (the
//                        peers are told, failed or not);
//   lander               (GETs through the landing ring) copies each
//                        landing slot on to its places in device memory
//                        and releases a GET's sends once all of it is there;
//   watcher              asks whether to stop waiting for the peers: the
//                        instance aborted the version, or the membership
//                        changed (TransferWatch); then the GETs to sources
//                        the new plan left out are cancelled.
//
// A GET into a landing slot already carries a list of places its bytes are
// copied on to (cuda::StagedRun): a GET of a contiguous pack area whose
// bytes scatter to many places is one GET with a longer list.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "planner/status.h"
#include "plugin/receiver/plan_compiler.h"
#include "plugin/receiver/state.h"
#include "transport/common/threads.h"
#include "plugin/trace.h"
#include "transport/cuda/device_ops.h"
#include "transport/cuda/staging.h"
#include "transport/fabric/local_fabric.h"
#include "transport/ucx/gather_ops.h"
#include "transport/ucx/get_engine.h"

namespace refit::convert {
class GpuWork;  // convert_cuda.h, in builds with the CUDA kernels
}  // namespace refit::convert

namespace refit::plugin::receiver {

using Clock = std::chrono::steady_clock;

// What the watcher asks while the attempt runs. A non-ok Status ends the
// wait for the peers at once (the GETs go on: the other ranks of the
// domain may still need what this rank passes on); its reason says why.
struct TransferWatch {
  // Waits until `until` at most for a word that ends the attempt (staged:
  // the instance's abort). Null: nothing to listen for.
  std::function<Status(Clock::time_point until)> listen;
  // Called every kMembershipCheck: whether the membership changed since
  // the last call that said so (the first: since the part's). Null: never.
  // When it did, `*gone` lists the sources of this part that the newest
  // plan does not read from: the coordinator declared them dead, they
  // left, or this rank no longer needs them. Those whose GETs have seen no
  // progress for TransferExecutor::kQuietSource are cancelled (a
  // partitioned source over tcp would hold them until the deadline); the
  // others run on.
  std::function<Status(std::vector<int32_t>* gone)> check;
};

// What the attempt runs on; borrowed, all outlive the executor.
struct TransferSetup {
  int32_t rank = 0;  // this receiver's: where its GETs start among its sources (GetEngineOptions::rank)
  fabric::LocalFabric* fabric = nullptr;
  ucx::Worker* worker = nullptr;
  std::map<int32_t, ucx::Endpoint*> endpoints;     // every source the part names, its rkeys imported
  std::vector<const ucx::MemoryRegion*> regions;   // where GETs land
  uint64_t transfer_chunk_bytes = 1 << 20;         // the largest plain GET the engine issues
  uint64_t window_bytes = 64 << 20;                // GET bytes in flight, in all and per endpoint
  // GETs through the landing ring: its memory (slots of landing_slot_bytes,
  // at most transfer_chunk_bytes), the copies on, and whether the local fabric's
  // sends wait for those copies themselves (NCCL orders them on a stream).
  cuda::CopyOps* copy_ops = nullptr;
  std::span<uint8_t> landing_ring;
  uint64_t landing_slot_bytes = 4 << 20;
  bool fabric_waits_for_copies = false;
  // Small runs of one source that land in host memory travel together, one
  // request each (docs/refresh.md, "Gathers").
  GatherOptions gather;
  // Where the attempt's spans go (get_batch, fan_out, landing) and the
  // counter of GET bytes in flight; null: nowhere.
  Trace* trace = nullptr;
  Progress* progress = nullptr;  // told the GET bytes as they land; null: none
  // What conversions into GPU memory reuse across units and refreshes (a
  // stream of refit's own and a device scratch, convert_cuda.h), used by
  // the fan-out thread only; null: the attempt makes its own.
  std::shared_ptr<convert::GpuWork> gpu_work;
};

struct TransferReport {
  double network_s = 0;
  double local_s = 0;
  uint64_t network_bytes = 0;
  uint64_t gets = 0;
  uint64_t sends = 0;
  bool landing = false;
  uint64_t landing_slots = 0, landing_chunks = 0, landing_copies = 0, landing_held = 0;
  // Gathers (docs/refresh.md, "Gathers"): requests, the runs they carried,
  // and small runs that travelled alone because they exceed "gather_bytes".
  uint64_t gathers = 0, gathered_runs = 0, gather_unpacked = 0;
  // Gather requests a source answered "busy" (its reply memory was full,
  // docs/refresh.md "Gathers"), asked again.
  uint64_t gather_busy = 0;
  // Conversions on the way (docs/conversion.md): units converted and the
  // seconds the fan-out spent in the kernels.
  uint64_t converts = 0;
  double convert_s = 0;
};

class TransferExecutor {
 public:
  // How often the watcher calls TransferWatch::check, and the slice of
  // each TransferWatch::listen call (the watcher stops within one).
  static constexpr std::chrono::milliseconds kMembershipCheck{250};
  static constexpr std::chrono::milliseconds kListenSlice{5};
  // A source the new plan leaves out whose GETs have seen no progress for
  // this long is taken for gone (TransferWatch::check); a second is many
  // chunks' time on any link the plan would use.
  static constexpr std::chrono::milliseconds kQuietSource{1000};

  TransferExecutor(const TransferSetup& setup, const CompiledPart& part, int64_t version, Clock::time_point deadline,
                   TransferWatch watch, ThreadFactory threads);
  ~TransferExecutor();  // stops and joins every thread it started
  TransferExecutor(const TransferExecutor&) = delete;
  TransferExecutor& operator=(const TransferExecutor&) = delete;

  // Runs the attempt; once. The fabric has ended when it returns.
  Status run(TransferReport* report);

  // Tells the peers of the domain at once that this rank's attempt failed
  // (a failed flag) instead of leaving them waiting until their deadline.
  static void fail_fast(fabric::LocalFabric& fabric, const fabric::Schedule& schedule, Clock::time_point deadline);

 private:
  Status prepare();
  Status start_threads();
  void pull();
  void inputs_over();
  void join_all();
  Status outcome(const Status& started) const;
  void fill(TransferReport* report) const;
  void fan_out();
  void land();
  void watch();
  void stop_waiting(const Status& why);
  void drop_sources(const std::vector<int32_t>& gone, const Status& why);
  void sample_in_flight(bool force);
  // Releases the sends that read GET `get` once nothing else holds them
  // back. REQUIRES mu_. Returns whether any became ready.
  bool release_locked(uint32_t get);
  // Runs conversion `k` of the part (the fan-out's thread).
  Status convert(uint32_t k);

  const TransferSetup setup_;
  const CompiledPart& part_;
  const Clock::time_point deadline_;
  const TransferWatch watch_;
  const ThreadFactory threads_;
  fabric::Schedule schedule_;  // the part's, with this attempt's version

  // Made by prepare(), before any thread starts; read-only afterwards.
  std::unique_ptr<ucx::GetEngine> engine_;
  std::unique_ptr<cuda::LandingRing> ring_;
  std::vector<ucx::GetRun> engine_runs_;
  std::vector<int64_t> engine_run_chunk_;  // per engine run: its landing ring chunk, or -1
  std::vector<uint32_t> engine_run_get_;   // per engine run: its GET of the part
  std::vector<int64_t> engine_run_gather_; // per engine run: its gather in gathers_.ops, or -1
  ucx::GatherOps gathers_;                 // the part's small runs, grouped per source
  std::vector<uint32_t> ring_run_get_;     // per landing ring run: its GET of the part

  // The fan-out's inputs.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint32_t> ready_;      // mu_: sends ready to go
  std::vector<uint32_t> deps_;       // mu_: per send, the GETs and conversions still to finish
  std::vector<uint32_t> convert_ready_;  // mu_: conversions whose GETs have all landed
  std::vector<uint32_t> convert_deps_;   // mu_: per conversion, the GETs still to land
  Status convert_status_;            // the fan-out's; read after it is joined
  bool net_done_ = false;            // mu_
  bool net_ok_ = false;              // mu_
  bool landing_done_ = true;         // mu_; false while the lander runs
  Status landing_status_;            // the lander's; read by others after landing_done_
  Status fan_status_;                // the fan-out's; read after it is joined
  Clock::time_point fan_end_;        // the fan-out's; read after it is joined
  double convert_s_ = 0;             // the fan-out's; read after it is joined
  std::shared_ptr<convert::GpuWork> gpu_work_;  // the fan-out's: setup_'s, or made at its first GPU conversion
  ucx::BatchReport batch_;           // the caller's thread's
  Clock::time_point start_, net_end_;
  bool inputs_over_ = false;         // the caller's thread's
  // With a trace: GET bytes issued and not landed (the engine's gate and
  // run callback, both under the engine's mutex), and when the counter was
  // last sampled.
  uint64_t in_flight_ = 0;
  Clock::time_point in_flight_sampled_{};

  // The watcher.
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watching_ = false;            // watch_mu_
  Status watch_status_;              // the watcher's; read after it is joined

  std::thread fan_, lander_, watcher_;
};

}  // namespace refit::plugin::receiver
