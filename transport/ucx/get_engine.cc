#include "transport/ucx/get_engine.h"

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <random>

#include "transport/ucx/by_copy.h"
#include "transport/ucx/ucx_status.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

const char* op_name(Op op) { return op == Op::kPut ? "PUT" : "GET"; }

std::string run_name(uint32_t i, const GetRun& r) {
  if (!r.gather.empty()) {
    return "run " + std::to_string(i) + " (gather of " + std::to_string(r.gather.size()) + " ranges, " +
           std::to_string(r.bytes) + " bytes" +
           (r.endpoint ? ", on endpoint \"" + r.endpoint->name() + "\"" : std::string()) + ")";
  }
  return "run " + std::to_string(i) + " (" + op_name(r.op) + " of " + std::to_string(r.bytes) +
         (r.op == Op::kPut ? " bytes to " : " bytes from ") + hex(r.remote_address) +
         (r.endpoint ? " on endpoint \"" + r.endpoint->name() + "\"" : std::string()) + ")";
}

}  // namespace

Result<std::unique_ptr<GetEngine>> GetEngine::create(Worker& worker, GetEngineOptions options) {
  REFIT_RETURN_IF_ERROR(validate(options.limits));
  if (worker.get() == nullptr) return Status::invalid("ucx get engine: worker is empty");
  if (options.limits.max_ops_in_flight > 0xFFFF) {  // a slot's index is 16 bits of an AM token
    return Status::invalid("ucx get engine: \"max_ops_in_flight\" must be at most 65535, got " +
                           std::to_string(options.limits.max_ops_in_flight));
  }
  if (options.progress_thread && worker.mode() != ThreadMode::kSerialized) {
    return Status::invalid("ucx get engine: a progress thread needs a worker created with "
                           "ThreadMode::kSerialized");
  }
  std::unique_ptr<GetEngine> engine(new GetEngine(worker, options));
  REFIT_RETURN_IF_ERROR(engine->set_reply_handlers(true));
  if (options.progress_thread) {
    auto fd = worker.event_fd();
    if (!fd) return fd.status().with_context("ucx get engine: progress thread");
    GetEngine* e = engine.get();
    Result<std::thread> t = options.threads.start(
        "ucx get engine progress", [e] { e->progress_loop(); }, [e](const Status& why) { e->progress_failed(why); });
    if (!t.is_ok()) return t.status().with_context("ucx get engine");
    engine->thread_ = std::move(t).value();
  }
  return engine;
}

namespace {

// Engine instances of this process, from a random start so that two runs of
// a process do not repeat each other's tokens either.
uint16_t next_instance() {
  static std::atomic<uint16_t> next{static_cast<uint16_t>(std::random_device{}())};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

GetEngine::GetEngine(Worker& worker, GetEngineOptions options)
    : worker_(worker), options_(options), instance_(next_instance()) {}

GetEngine::~GetEngine() {
  retire();
  std::lock_guard<std::mutex> lock(mutex_);
  (void)set_reply_handlers(false);
}

Status GetEngine::set_reply_handlers(bool on) {
  for (unsigned id : {am_rma::kGetReply, am_rma::kPutReply}) {
    if (!on) {
      REFIT_RETURN_IF_ERROR(am_rma::install_fallback_handler(worker_.get(), id));
      continue;
    }
    ucp_am_handler_param_t p = {};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = &GetEngine::on_am_reply;
    p.arg = this;
    REFIT_RETURN_IF_ERROR(from_ucs(ucp_worker_set_am_recv_handler(worker_.get(), &p),
                                   "ucx get engine: registering the handler for AM id " +
                                       std::to_string(id)));
  }
  return Status::ok();
}

void GetEngine::add_local_region(const MemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  local_regions_.push_back(&region);
}

void GetEngine::remove_local_region(const MemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  local_regions_.erase(std::remove(local_regions_.begin(), local_regions_.end(), &region),
                       local_regions_.end());
}

void GetEngine::retire() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  (void)worker_.signal();
  thread_.join();
}

uint64_t GetEngine::outstanding_requests() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return outstanding_;
}

size_t GetEngine::slot_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

unsigned GetEngine::progress() {
  if (thread_.joinable()) return 0;
  std::lock_guard<std::mutex> lock(mutex_);
  return worker_.progress();
}

Status GetEngine::validate_locked(std::span<const GetRun> runs,
                                  std::vector<ChunkRun>* chunk_runs) {
  for (uint32_t i = 0; i < runs.size(); ++i) {
    const GetRun& r = runs[i];
    if (r.endpoint == nullptr || r.endpoint->get() == nullptr) {
      if (r.endpoint && r.endpoint->failed()) {
        return r.endpoint->failure().with_context(run_name(i, r));
      }
      return Status::invalid(run_name(i, r) + ": no endpoint");
    }
    if (r.op != Op::kGet && r.op != Op::kPut) {
      return Status::invalid(run_name(i, r) + ": unknown op " +
                             std::to_string(static_cast<unsigned>(r.op)));
    }
    if (r.bytes == 0) {
      return Status::invalid(run_name(i, r) + ": zero bytes; drop empty runs before submitting");
    }
    if (r.endpoint->failed()) return r.endpoint->failure().with_context(run_name(i, r));
    if (!r.gather.empty()) {
      REFIT_RETURN_IF_ERROR(validate_gather_locked(i, r));
      auto it = std::find(batch_eps_.begin(), batch_eps_.end(), r.endpoint);
      uint32_t e = static_cast<uint32_t>(it - batch_eps_.begin());
      if (it == batch_eps_.end()) batch_eps_.push_back(r.endpoint);
      run_ep_.push_back(e);
      run_memh_.push_back(nullptr);
      run_region_.push_back(nullptr);
      run_local_.push_back(nullptr);
      chunk_runs->push_back(ChunkRun{e, r.bytes, /*gather=*/true});
      continue;
    }
    run_gather_.push_back(0);
    const RemoteKey* key = r.endpoint->rkey(r.rkey_id);
    if (key == nullptr) {
      return Status::not_found(run_name(i, r) + ": rkey id " + std::to_string(r.rkey_id) +
                               " was never imported on this endpoint; import the peer's "
                               "packed rkey with Endpoint::import_rkey first");
    }
    if (!key->contains(r.remote_address, r.bytes)) {
      return Status::invalid(run_name(i, r) + ": remote range [" + hex(r.remote_address) + ", " +
                             hex(r.remote_address + r.bytes) + ") is outside the region of rkey " +
                             std::to_string(r.rkey_id) + " [" + hex(key->base()) + ", " +
                             hex(key->base() + key->length()) + ")");
    }
    auto local = std::find_if(local_regions_.begin(), local_regions_.end(),
                              [&](const MemoryRegion* m) {
                                return m->contains(r.local_address, r.bytes);
                              });
    if (local == local_regions_.end()) {
      return Status::invalid(run_name(i, r) + ": local range at " +
                             hex(reinterpret_cast<uint64_t>(r.local_address)) +
                             " is not inside a registered region; register the buffer with "
                             "MemoryRegion::map and GetEngine::add_local_region");
    }
    if (r.endpoint->rma_in_software() && !cpu_can_copy((*local)->type())) {
      return Status::unsupported(run_name(i, r) + ": its local range is " + memory_type_name((*local)->type()) +
                                 " memory, and the endpoint has no RMA lane (tcp), so its " + op_name(r.op) +
                                 "s are copied by the CPU: give both ends a transport that reaches GPU "
                                 "memory (rc, dc), or land the bytes in host memory");
    }
    auto it = std::find(batch_eps_.begin(), batch_eps_.end(), r.endpoint);
    uint32_t e = static_cast<uint32_t>(it - batch_eps_.begin());
    if (it == batch_eps_.end()) batch_eps_.push_back(r.endpoint);
    run_ep_.push_back(e);
    run_memh_.push_back((*local)->get());
    run_region_.push_back(*local);
    run_local_.push_back(static_cast<uint8_t*>(r.local_address));
    chunk_runs->push_back(ChunkRun{e, r.bytes});
  }
  return Status::ok();
}

Status GetEngine::validate_gather_locked(uint32_t i, const GetRun& r) {
  if (r.op != Op::kGet) return Status::invalid(run_name(i, r) + ": a gather must be a GET");
  if (r.gather.size() > am_rma::kMaxGatherEntries) {
    return Status::invalid(run_name(i, r) + ": more than " + std::to_string(am_rma::kMaxGatherEntries) +
                           " ranges, the most a peer serves in one gather");
  }
  const uint64_t cut =
      options_.limits.gather_chunk_bytes > 0 ? options_.limits.gather_chunk_bytes : options_.limits.chunk_bytes;
  if (std::min<uint64_t>(r.bytes, cut) > am_rma::kMaxGatherBytes) {
    return Status::invalid(run_name(i, r) + ": its requests would exceed " + std::to_string(am_rma::kMaxGatherBytes) +
                           " bytes, the most a peer serves in one gather; use a smaller \"gather_bytes\"");
  }
  run_gather_.push_back(static_cast<uint32_t>(gather_offsets_.size()));
  uint64_t sum = 0;
  for (size_t k = 0; k < r.gather.size(); ++k) {
    const GatherPart& p = r.gather[k];
    auto part = [&] { return run_name(i, r) + ", range " + std::to_string(k); };  // only on error
    if (p.bytes == 0 || p.bytes > r.bytes - sum) {
      return Status::invalid(part() + ": " + std::to_string(p.bytes) +
                             " bytes; the ranges must be non-empty and sum to the run's bytes");
    }
    const RemoteKey* key = r.endpoint->rkey(p.rkey_id);
    if (key == nullptr || !key->contains(p.remote_address, p.bytes)) {
      return Status::invalid(part() + ": remote range [" + hex(p.remote_address) + ", +" + std::to_string(p.bytes) +
                             ") is not inside the region of rkey " + std::to_string(p.rkey_id) +
                             (key == nullptr ? " (never imported on this endpoint)" : ""));
    }
    auto local = std::find_if(local_regions_.begin(), local_regions_.end(),
                              [&](const MemoryRegion* m) { return m->contains(p.local_address, p.bytes); });
    if (local == local_regions_.end()) {
      return Status::invalid(part() + ": local range at " + hex(reinterpret_cast<uint64_t>(p.local_address)) +
                             " is not inside a registered region");
    }
    if (!cpu_can_copy((*local)->type())) {
      return Status::unsupported(part() + ": its local range is " + memory_type_name((*local)->type()) +
                                 " memory; a gather's replies are scattered by the CPU, so gathers land in "
                                 "host memory only");
    }
    gather_offsets_.push_back(sum);
    sum += p.bytes;
  }
  if (sum != r.bytes) {
    return Status::invalid(run_name(i, r) + ": its ranges hold " + std::to_string(sum) + " bytes, not " +
                           std::to_string(r.bytes));
  }
  return Status::ok();
}

BatchReport GetEngine::run_batch(std::span<const GetRun> runs, Clock::time_point deadline,
                                 RunCallback on_run_done, Gate gate) {
  const auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  ++generation_;
  BatchReport report;
  batch_eps_.clear();
  run_ep_.clear();
  run_memh_.clear();
  run_region_.clear();
  run_local_.clear();
  run_gather_.clear();
  gather_offsets_.clear();
  std::vector<ChunkRun> chunk_runs;
  Status bad = validate_locked(runs, &chunk_runs);
  if (bad.is_ok()) {
    const auto endpoints = static_cast<uint32_t>(batch_eps_.size());
    auto sched = ChunkScheduler::create(options_.limits, chunk_runs, endpoints,
                                        first_endpoint(options_.rank, endpoints));
    if (!sched) bad = sched.status();
    else scheduler_.emplace(std::move(*sched));
  }
  if (!bad.is_ok()) {
    report.status = bad;
    report.runs.assign(runs.size(), Status::invalid("batch refused before any GET: " +
                                                    bad.message()));
    report.elapsed = Clock::now() - start;
    return report;
  }

  runs_ = runs;
  ep_dropped_.assign(batch_eps_.size(), false);
  ep_last_event_.assign(batch_eps_.size(), start);
  ep_retry_at_.assign(batch_eps_.size(), Clock::time_point{});
  eps_held_ = 0;
  busy_retries_ = 0;
  run_status_.assign(runs.size(), Status::ok());
  run_reported_.assign(runs.size(), false);
  on_run_done_ = std::move(on_run_done);
  halted_ = false;
  halt_.store(false, std::memory_order_release);
  gate_ = std::move(gate);
  scheduler_gate_ = nullptr;
  if (gate_) {
    scheduler_gate_ = [this](uint32_t run) {
      void* moved = nullptr;
      if (!gate_(run, &moved)) return false;
      if (moved != nullptr) {
        if (run_region_[run] == nullptr || !run_region_[run]->contains(moved, runs_[run].bytes)) {
          // Issued all the same (the scheduler counts it), into its own
          // place; the run fails when it completes.
          fail_run_locked(run, Status::internal(run_name(run, runs_[run]) +
                                                ": the gate moved it outside its local region"));
          return true;
        }
        run_local_[run] = static_cast<uint8_t*>(moved);
      }
      return true;
    };
  }
  bytes_done_ = 0;
  gets_issued_ = 0;

  // Caller-driven progress spins, as ucx_perftest does: on loopback tcp and
  // shared memory the event fd does not fire for every completion, so
  // sleeping on it costs bandwidth. Only after 10 ms without any progress
  // (a stalled peer) does it sleep on the fd, 1 ms at a time, so that a hung
  // peer does not burn a core until the deadline. The clock is read every
  // 64 rounds; reading it every round cost a quarter of the CPU.
  bool timed_out = false;
  bool no_progress = false;
  uint32_t rounds = 0;
  auto last_event = Clock::now();
  while (true) {
    pump_locked();
    if (scheduler_->done()) break;
    if (thread_.joinable()) {
      if (!progress_error_.is_ok()) {
        no_progress = true;
        break;
      }
      if (Clock::now() >= deadline) {
        timed_out = true;
        break;
      }
      (void)worker_.signal();  // new GETs may need the progress thread
      // 1 ms while a busy peer waits to be asked again, else 50.
      batch_cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(eps_held_ > 0 ? 1 : 50)));
      continue;
    }
    if (worker_.progress() != 0) {
      rounds = 0;
      last_event = Clock::now();
      continue;
    }
    if (++rounds % 64 != 0) continue;
    const auto now = Clock::now();
    if (now >= deadline) {
      timed_out = true;
      break;
    }
    if (now - last_event > std::chrono::milliseconds(10)) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      (void)worker_.wait(std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(1)));
    }
  }

  if (timed_out) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    cancel_locked("batch deadline exceeded after " + std::to_string(ms.count()) +
                  " ms; GETs/PUTs in flight were cancelled by closing the endpoint");
  }
  if (no_progress) {
    cancel_locked(progress_error_.message() + "; GETs/PUTs in flight were cancelled by closing the endpoint");
  }

  report.runs = run_status_;
  report.bytes_done = bytes_done_;
  report.gets_issued = gets_issued_;
  report.busy_retries = busy_retries_;
  for (uint32_t i = 0; i < report.runs.size(); ++i) {
    if (!report.runs[i].is_ok() && report.status.is_ok()) report.status = report.runs[i];
  }
  if (outstanding_ != 0) {
    report.status = Status::internal(
        "ucx get engine: " + std::to_string(outstanding_) +
        " GET/PUT requests still outstanding after cancel; their slots stay owned by the engine");
  }
  scheduler_.reset();
  {
    std::lock_guard<std::mutex> drops(halt_mu_);  // drop_peer() asks about this batch only
    drops_.clear();
    drop_pending_.store(false, std::memory_order_release);
  }
  runs_ = {};
  on_run_done_ = nullptr;
  gate_ = nullptr;
  scheduler_gate_ = nullptr;
  report.elapsed = Clock::now() - start;
  return report;
}

Status GetEngine::flush(std::span<Endpoint* const> endpoints, Clock::time_point deadline) {
  const auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  // No callback: a flush that is abandoned at the deadline is handed back to
  // UCX with ucp_request_free and completes later without touching engine
  // memory, so the engine may be gone by then.
  struct Pending {
    Endpoint* ep;
    void* req;              // nullptr once finished
    bool reported = false;  // its error is already in `errors`
  };
  std::vector<Pending> pending;
  std::vector<std::string> errors;
  auto fail = [&](Endpoint* ep, const Status& why) {
    errors.push_back(why.message());
    ep->force_close(why.message(), Clock::now() + options_.cancel_grace);
  };
  for (Endpoint* ep : endpoints) {
    if (ep == nullptr) {
      errors.push_back("ucx flush: null endpoint");
      continue;
    }
    if (std::any_of(pending.begin(), pending.end(), [&](const Pending& p) { return p.ep == ep; })) {
      continue;  // listed twice
    }
    if (ep->failed() || ep->get() == nullptr) {
      // Its PUTs may not have landed; it is not flushed, only reported.
      Status why = ep->failure();
      errors.push_back(why.is_ok() ? "ucx endpoint \"" + ep->name() + "\": closed" : why.message());
      continue;
    }
    ucp_request_param_t param = {};
    ucs_status_ptr_t req = ucp_ep_flush_nbx(ep->get(), &param);
    if (UCS_PTR_IS_ERR(req)) {
      fail(ep, from_ucs(UCS_PTR_STATUS(req), "ucx endpoint \"" + ep->name() + "\": flush"));
    } else if (req != nullptr) {
      pending.push_back(Pending{ep, req, false});
    }
  }

  // Same progress discipline as run_batch(): spin on progress without a
  // progress thread, wait on batch_cv_ (signalled after each progress
  // round) with one.
  auto collect = [&] {
    size_t left = 0;
    for (Pending& p : pending) {
      if (p.req == nullptr) continue;
      ucs_status_t st = ucp_request_check_status(p.req);
      if (st == UCS_INPROGRESS) {
        ++left;
        continue;
      }
      ucp_request_free(p.req);
      p.req = nullptr;
      if (st != UCS_OK && !p.reported) {
        p.reported = true;
        fail(p.ep, from_ucs(st, "ucx endpoint \"" + p.ep->name() + "\": flush"));
      }
    }
    return left;
  };
  auto last_event = Clock::now();
  while (collect() > 0) {
    const auto now = Clock::now();
    if (now >= deadline) break;
    if (thread_.joinable() && progress_error_.is_ok()) {
      (void)worker_.signal();
      batch_cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(5)));
    } else if (worker_.progress() != 0) {
      last_event = now;
    } else if (now - last_event > std::chrono::milliseconds(10)) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      (void)worker_.wait(std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(1)));
    }
  }

  if (collect() > 0) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    const std::string reason = "flush deadline exceeded after " + std::to_string(ms.count()) +
                               " ms; the endpoint was closed, so PUTs on it may not have landed";
    for (Pending& p : pending) {
      if (p.req == nullptr) continue;
      errors.push_back("ucx endpoint \"" + p.ep->name() + "\": " + reason);
      p.reported = true;
      p.ep->force_close(reason, Clock::now() + options_.cancel_grace);
    }
    const auto grace = Clock::now() + options_.cancel_grace;
    while (collect() > 0 && Clock::now() < grace) worker_.progress();
    for (Pending& p : pending) {
      if (p.req != nullptr) ucp_request_free(p.req);  // UCX frees it on completion
    }
  }
  if (errors.empty()) return Status::ok();
  std::string msg = "ucx flush of " + std::to_string(endpoints.size()) + " endpoint(s) failed: " +
                    errors.front();
  if (errors.size() > 1) msg += " (and " + std::to_string(errors.size() - 1) + " more)";
  return Status::io_error(msg);
}

void GetEngine::fail_run_locked(uint32_t run, const Status& status) {
  if (run_status_[run].is_ok()) run_status_[run] = status;
}

void GetEngine::finish_run_locked(uint32_t run) {
  if (run_reported_[run]) return;
  run_reported_[run] = true;
  if (on_run_done_) on_run_done_(run, run_status_[run]);
}

bool GetEngine::halt_locked() {
  if (!halt_.load(std::memory_order_acquire)) return false;
  if (!halted_) {
    halted_ = true;
    Status why;
    {
      std::lock_guard<std::mutex> lock(halt_mu_);
      why = halt_why_;
    }
    for (uint32_t i = 0; i < runs_.size(); ++i) {
      if (!scheduler_->run_finished(i)) fail_run_locked(i, why.with_context(run_name(i, runs_[i]) + ": halted"));
    }
    for (uint32_t e = 0; e < batch_eps_.size(); ++e) {
      for (uint32_t run : scheduler_->drop_endpoint(e)) finish_run_locked(run);
    }
    if (scheduler_->done()) batch_cv_.notify_all();
  }
  return true;
}

void GetEngine::drop_peer(Endpoint* ep, const Status& why, std::chrono::milliseconds quiet) {
  if (ep == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(halt_mu_);
    drops_.push_back(Drop{ep, why.is_ok() ? Status::io_error("dropped") : why, quiet});
    drop_pending_.store(true, std::memory_order_release);
  }
  wake();
}

void GetEngine::drop_peers_locked() {
  if (!drop_pending_.load(std::memory_order_acquire)) return;
  // Taken out of halt_mu_ first: the close below runs completions, whose run
  // callback may call halt() or drop_peer().
  std::vector<Drop> drops;
  {
    std::lock_guard<std::mutex> lock(halt_mu_);
    drops.swap(drops_);
    drop_pending_.store(false, std::memory_order_release);
  }
  const auto now = Clock::now();
  std::vector<Drop> kept;
  for (Drop& d : drops) {
    auto it = std::find(batch_eps_.begin(), batch_eps_.end(), d.ep);
    if (it == batch_eps_.end()) continue;  // nothing of this batch on it
    const auto e = static_cast<uint32_t>(it - batch_eps_.begin());
    if (ep_dropped_[e] || d.ep->failed()) continue;  // failed already
    if (scheduler_->ops_in_flight(e) == 0 || now - ep_last_event_[e] < d.quiet) {
      kept.push_back(std::move(d));  // it still answers, or has nothing out: looked at again next round
      continue;
    }
    // The reason goes on the endpoint's unfinished runs first, so that the
    // CANCELED completions of the close do not hide why; the failed-endpoint
    // pass of pump_locked() then drops what is not issued.
    for (uint32_t i = 0; i < runs_.size(); ++i) {
      if (run_ep_[i] == e && !scheduler_->run_finished(i)) fail_run_locked(i, d.why.with_context(run_name(i, runs_[i])));
    }
    d.ep->force_close(d.why.message(), now + options_.cancel_grace);
  }
  if (kept.empty()) return;
  std::lock_guard<std::mutex> lock(halt_mu_);
  drops_.insert(drops_.end(), std::make_move_iterator(kept.begin()), std::make_move_iterator(kept.end()));
  drop_pending_.store(true, std::memory_order_release);
}

void GetEngine::pump_locked() {
  if (!scheduler_) return;
  drop_peers_locked();
  // Endpoints that failed: drop what is not issued, fail their runs, and
  // force-close so that UCX completes what is in flight.
  for (uint32_t e = 0; e < batch_eps_.size(); ++e) {
    if (ep_dropped_[e] || !batch_eps_[e]->failed()) continue;
    ep_dropped_[e] = true;
    Status why = batch_eps_[e]->failure();
    for (uint32_t i = 0; i < runs_.size(); ++i) {
      if (run_ep_[i] == e && !scheduler_->run_finished(i)) {
        fail_run_locked(i, why.with_context(run_name(i, runs_[i])));
      }
    }
    for (uint32_t run : scheduler_->drop_endpoint(e)) finish_run_locked(run);
    batch_eps_[e]->force_close("peer failed", Clock::now() + options_.cancel_grace);
    abandon_am_locked(batch_eps_[e]);
  }
  if (halt_locked()) return;
  if (eps_held_ > 0) {  // endpoints whose busy peer may be asked again
    const auto now = Clock::now();
    for (uint32_t e = 0; e < ep_retry_at_.size(); ++e) {
      if (ep_retry_at_[e] == Clock::time_point{} || now < ep_retry_at_[e]) continue;
      ep_retry_at_[e] = Clock::time_point{};
      --eps_held_;
      scheduler_->hold(e, false);
    }
  }
  // A run callback may halt the batch from inside issue_locked (a GET that
  // completes in place): asked after every chunk.
  while (auto c = scheduler_->next(scheduler_gate_)) {
    issue_locked(*c);
    if (halt_locked()) return;
  }
}

void GetEngine::halt(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(halt_mu_);
    if (halt_.load(std::memory_order_acquire)) return;  // the first reason stays
    halt_why_ = why.is_ok() ? Status::io_error("halted") : why;
  }
  halt_.store(true, std::memory_order_release);
  wake();
}

void GetEngine::wake() {
  (void)worker_.signal();  // the progress thread pumps when it wakes
  batch_cv_.notify_all();  // run_batch() pumps when it wakes
}

GetEngine::Slot* GetEngine::take_slot_locked() {
  Slot* s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slots_.emplace_back();
    s = &slots_.back();
    s->index = static_cast<uint32_t>(slots_.size() - 1);
  }
  s->engine = this;
  s->in_use = true;
  s->generation = generation_;
  ++s->seq;
  s->am = false;
  s->endpoint = nullptr;
  return s;
}

void GetEngine::issue_locked(const Chunk& c) {
  const GetRun& r = runs_[c.run];
  Slot* slot = take_slot_locked();
  slot->chunk = c;
  ++outstanding_;
  ++gets_issued_;
  ep_last_event_[run_ep_[c.run]] = Clock::now();
  if (!r.gather.empty()) {
    issue_gather_locked(slot, r);
    return;
  }
  if (r.endpoint->rma_in_software()) {
    issue_am_locked(slot, r);
    return;
  }
  ucp_request_param_t param = {};
  // No UCP_OP_ATTR_FIELD_MEMH: measured on UCX 1.13 with cma it pushes GETs
  // off the zero-copy lane (0.5 GB/s instead of 10); UCX finds the
  // registration in its cache instead.
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &GetEngine::on_op_done;
  param.user_data = slot;
  void* local = run_local_[c.run] + c.offset;
  ucp_rkey_h rkey = r.endpoint->rkey(r.rkey_id)->get();
  ucs_status_ptr_t req =
      r.op == Op::kPut
          ? ucp_put_nbx(r.endpoint->get(), local, c.bytes, r.remote_address + c.offset, rkey,
                        &param)
          : ucp_get_nbx(r.endpoint->get(), local, c.bytes, r.remote_address + c.offset, rkey,
                        &param);
  if (req == nullptr) {
    complete_locked(slot, UCS_OK);  // completed in place; no callback follows
  } else if (UCS_PTR_IS_ERR(req)) {
    complete_locked(slot, UCS_PTR_STATUS(req));
  }
  // Otherwise the callback completes it.
}

void GetEngine::on_op_done(void* request, ucs_status_t status, void* user_data) {
  auto* slot = static_cast<Slot*>(user_data);
  ucp_request_free(request);
  if (slot->am) {
    if (status != UCS_OK) {
      slot->engine->complete_locked(slot, status);
    } else {
      slot->am_sent = true;
      slot->engine->am_progress_locked(slot);
    }
    return;
  }
  slot->engine->complete_locked(slot, status);
}

void GetEngine::issue_am_locked(Slot* slot, const GetRun& r) {
  const Chunk& c = slot->chunk;
  slot->am = true;
  slot->am_sent = false;
  slot->am_replied = false;
  slot->am_received = 0;
  slot->am_status = UCS_OK;
  slot->endpoint = r.endpoint;
  slot->am_header = am_rma::RequestHeader{};
  slot->am_header.token = (uint64_t{instance_} << 48) | (uint64_t{slot->index & 0xFFFF} << 32) | slot->seq;
  slot->am_header.address = r.remote_address + c.offset;
  slot->am_header.length = c.bytes;
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // REPLY: the server answers on the endpoint the request came from. EAGER:
  // UCX 1.13's rendezvous would fall back to the RMA emulation avoided here.
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = &GetEngine::on_op_done;
  param.user_data = slot;
  const bool put = r.op == Op::kPut;
  slot->am_payload = CopySource{put ? run_local_[c.run] + c.offset : nullptr, put ? c.bytes : 0};
  const void* buffer = payload_buffer(param, worker_.am_by_copy(), &slot->am_payload);
  ucs_status_ptr_t req = ucp_am_send_nbx(
      r.endpoint->get(), put ? am_rma::kPutRequest : am_rma::kGetRequest, &slot->am_header,
      sizeof(slot->am_header), buffer, slot->am_payload.bytes, &param);
  if (req == nullptr) {
    slot->am_sent = true;  // sent in place; the reply completes the slot
  } else if (UCS_PTR_IS_ERR(req)) {
    complete_locked(slot, UCS_PTR_STATUS(req));
  }
}

void GetEngine::issue_gather_locked(Slot* slot, const GetRun& r) {
  const Chunk& c = slot->chunk;
  slot->am = true;
  slot->am_sent = false;
  slot->am_replied = false;
  slot->am_received = 0;
  slot->am_status = UCS_OK;
  slot->endpoint = r.endpoint;
  // The parts that overlap the chunk's stream range [c.offset, +c.bytes).
  const uint64_t* offsets = gather_offsets_.data() + run_gather_[c.run];
  const size_t n = r.gather.size();
  size_t k = static_cast<size_t>(std::upper_bound(offsets, offsets + n, c.offset) - offsets) - 1;
  slot->gather_entries.clear();
  const uint64_t end = c.offset + c.bytes;
  for (uint64_t at = c.offset; at < end; ++k) {
    const GatherPart& p = r.gather[k];
    const uint64_t skip = at - offsets[k];
    const uint64_t take = std::min(p.bytes - skip, end - at);
    slot->gather_entries.push_back(am_rma::GatherEntry{p.remote_address + skip, take});
    at += take;
  }
  slot->gather_header = am_rma::GatherHeader{};
  slot->gather_header.count = static_cast<uint32_t>(slot->gather_entries.size());
  slot->gather_header.token =
      (uint64_t{instance_} << 48) | (uint64_t{slot->index & 0xFFFF} << 32) | slot->seq;
  slot->gather_header.total = c.bytes;
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;  // as issue_am_locked says why
  param.cb.send = &GetEngine::on_op_done;
  param.user_data = slot;
  slot->am_payload =
      CopySource{slot->gather_entries.data(), slot->gather_entries.size() * sizeof(am_rma::GatherEntry)};
  const void* buffer = payload_buffer(param, worker_.am_by_copy(), &slot->am_payload);
  ucs_status_ptr_t req =
      ucp_am_send_nbx(r.endpoint->get(), am_rma::kGatherRequest, &slot->gather_header,
                      sizeof(slot->gather_header), buffer, slot->am_payload.bytes, &param);
  if (req == nullptr) {
    slot->am_sent = true;
  } else if (UCS_PTR_IS_ERR(req)) {
    complete_locked(slot, UCS_PTR_STATUS(req));
  }
}

void GetEngine::scatter_locked(uint32_t run, uint64_t offset, const uint8_t* data, uint64_t length) {
  const GetRun& r = runs_[run];
  const uint64_t* offsets = gather_offsets_.data() + run_gather_[run];
  const size_t n = r.gather.size();
  size_t k = static_cast<size_t>(std::upper_bound(offsets, offsets + n, offset) - offsets) - 1;
  while (length > 0) {
    const GatherPart& p = r.gather[k];
    const uint64_t skip = offset - offsets[k];
    const uint64_t take = std::min(p.bytes - skip, length);
    std::memcpy(static_cast<uint8_t*>(p.local_address) + skip, data, take);
    data += take;
    offset += take;
    length -= take;
    ++k;
  }
}

void GetEngine::am_progress_locked(Slot* slot) {
  if (slot->am_sent && slot->am_replied) complete_locked(slot, slot->am_status);
}

ucs_status_t GetEngine::on_am_reply(void* arg, const void* header, size_t header_length,
                                    void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<GetEngine*>(arg);
  am_rma::ReplyHeader h;
  if (header_length != sizeof(h)) return UCS_OK;  // not ours
  std::memcpy(&h, header, sizeof(h));
  const uint64_t index = (h.token >> 32) & 0xFFFF;
  if (h.magic != am_rma::kMagic || (h.token >> 48) != self->instance_ || index >= self->slots_.size()) {
    return UCS_OK;  // not this engine's (an earlier engine's late reply)
  }
  Slot* slot = &self->slots_[index];
  if (!slot->in_use || !slot->am || slot->am_replied ||
      slot->seq != static_cast<uint32_t>(h.token)) {
    return UCS_OK;  // a late reply for a slot that was abandoned
  }
  ucs_status_t st = static_cast<ucs_status_t>(h.status);
  const bool current = slot->generation == self->generation_ && self->scheduler_.has_value();
  if (st == UCS_OK && current && self->runs_[slot->chunk.run].op == Op::kGet) {
    // One piece of the GET's bytes (am_rma.h); the slot is done when all
    // have landed. A piece that does not fit the chunk fails it.
    const uint64_t want = slot->chunk.bytes;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length == 0 || h.offset > want ||
        length > want - h.offset || length > want - slot->am_received) {
      st = UCS_ERR_MESSAGE_TRUNCATED;
    } else {
      const uint32_t run = slot->chunk.run;
      if (!self->runs_[run].gather.empty()) {
        self->scatter_locked(run, slot->chunk.offset + h.offset, static_cast<const uint8_t*>(data), length);
      } else {
        std::memcpy(self->run_local_[run] + slot->chunk.offset + h.offset, data, length);
      }
      slot->am_received += length;
      self->ep_last_event_[self->run_ep_[run]] = Clock::now();
      if (slot->am_received < want) return UCS_OK;
    }
  }
  slot->am_replied = true;
  slot->am_status = st;
  slot->am_reply_offset = h.offset;
  self->am_progress_locked(slot);
  return UCS_OK;
}

void GetEngine::abandon_am_locked(const Endpoint* ep) {
  for (Slot& s : slots_) {
    if (s.in_use && s.am && s.endpoint == ep && s.am_sent && !s.am_replied) {
      complete_locked(&s, UCS_ERR_CANCELED);
    }
  }
}

void GetEngine::complete_locked(Slot* slot, ucs_status_t status) {
  const Chunk c = slot->chunk;
  const bool current = slot->generation == generation_ && scheduler_.has_value();
  const bool am_refused = slot->am && slot->am_replied && slot->am_status != UCS_OK;
  const uint64_t peer_bound = slot->am_reply_offset;  // read before the slot is reused
  slot->in_use = false;
  free_slots_.push_back(slot);
  --outstanding_;
  if (!current) return;  // a late completion of an abandoned batch
  const uint32_t e = run_ep_[c.run];
  ep_last_event_[e] = Clock::now();
  if (am_refused && status == UCS_ERR_BUSY && !runs_[c.run].gather.empty() && run_status_[c.run].is_ok()) {
    // The peer's gather reply memory is full (am_rma.h): ask again later.
    scheduler_->requeue(c);
    if (ep_retry_at_[e] == Clock::time_point{}) {
      ++eps_held_;
      scheduler_->hold(e, true);
    }
    ep_retry_at_[e] = ep_last_event_[e] + kGatherRetryDelay;
    ++busy_retries_;
    return;
  }
  if (status == UCS_OK) {
    bytes_done_ += c.bytes;
  } else {
    const GetRun& r = runs_[c.run];
    if (am_refused && status == UCS_ERR_EXCEEDS_LIMIT) {
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": the peer serves gathers of at most " +
                                                  std::to_string(peer_bound) +
                                                  " bytes (its \"gather_reply_bytes\"), this request has " +
                                                  std::to_string(c.bytes) +
                                                  "; lower \"gather_bytes\", or raise the source's "
                                                  "\"gather_reply_bytes\""));
    } else if (am_refused && status == UCS_ERR_INVALID_PARAM && !r.gather.empty()) {
      // The server refuses a gather's entry list whole when it has too
      // many entries, too many bytes, or does not add up (am_rma.h); this
      // side checks the first two against its own bounds before sending,
      // so a peer that refuses serves less than they say.
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": the source refused the gather request of " +
                                                  std::to_string(c.bytes) + " bytes at offset " +
                                                  std::to_string(c.offset) +
                                                  ": too many ranges or bytes for it in one request (sources of "
                                                  "this version serve " +
                                                  std::to_string(am_rma::kMaxGatherEntries) + " ranges and " +
                                                  std::to_string(am_rma::kMaxGatherBytes) +
                                                  " bytes at most), or a malformed list; lower "
                                                  "\"gather_entries\" or \"gather_bytes\""));
    } else if (am_refused && status == UCS_ERR_NO_DEVICE) {
      // The source copies with the CPU and its range is GPU memory (am_rma.h).
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": the peer cannot serve the " + op_name(r.op) +
                                                  " of " + std::to_string(c.bytes) + " bytes at offset " +
                                                  std::to_string(c.offset) +
                                                  ": its range is GPU memory, which it serves only by CPU copies (the "
                                                  "replies to a gather, and to any GET over an endpoint without an RMA "
                                                  "lane, such as tcp); a source of this version serves GPU shards "
                                                  "from a pinned host mirror, so the peer is of another build"));
    } else if (am_refused && status == UCS_ERR_NO_MEMORY && !r.gather.empty()) {
      // The source could not allocate a reply buffer (am_rma.h).
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": the source ran out of memory for the "
                                                  "replies of the gather of " + std::to_string(c.bytes) +
                                                  " bytes at offset " + std::to_string(c.offset)));
    } else if (am_refused) {
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": the peer refused the " +
                                                  op_name(r.op) + " of " + std::to_string(c.bytes) +
                                                  " bytes at offset " + std::to_string(c.offset) +
                                                  (status == UCS_ERR_REJECTED
                                                       ? " (it accepts no writes there: a source's memory, or "
                                                         "memory mapped remote-read-only)"
                                                       : " (is an AmRmaServer running on its worker, "
                                                         "with this range exported?)")));
    } else {
      fail_run_locked(c.run, from_ucs(status, run_name(c.run, r) + ": " + op_name(r.op) + " of " +
                                                std::to_string(c.bytes) + " bytes at offset " +
                                                std::to_string(c.offset)));
    }
  }
  if (scheduler_->complete(c)) finish_run_locked(c.run);
  if (scheduler_->done()) batch_cv_.notify_all();
}

void GetEngine::cancel_locked(const std::string& reason) {
  // The reason goes on every unfinished run first, so that the CANCELED
  // completions that follow do not hide why.
  for (uint32_t i = 0; i < runs_.size(); ++i) {
    if (!scheduler_->run_finished(i)) {
      fail_run_locked(i, Status::io_error(run_name(i, runs_[i]) + ": " + reason));
    }
  }
  const auto grace = Clock::now() + options_.cancel_grace;
  for (uint32_t e = 0; e < batch_eps_.size(); ++e) {
    (void)scheduler_->drop_endpoint(e);
    if (scheduler_->ops_in_flight(e) > 0) {
      batch_eps_[e]->force_close(reason, grace);
      abandon_am_locked(batch_eps_[e]);
    }
  }
  while (outstanding_ > 0 && Clock::now() < grace) worker_.progress();
  for (uint32_t i = 0; i < runs_.size(); ++i) {
    if (!run_reported_[i] && !run_status_[i].is_ok()) finish_run_locked(i);
  }
}

void GetEngine::progress_failed(const Status& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  progress_error_ = why.with_context("ucx get engine");
  batch_cv_.notify_all();
}

void GetEngine::progress_loop() {
  auto fd = worker_.event_fd();
  while (true) {
    bool armed = false;
    int wait_ms = 50;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
      while (worker_.progress() != 0) {
      }
      pump_locked();
      if (batch_done_locked()) batch_cv_.notify_all();
      auto a = worker_.arm();
      armed = a.is_ok() && *a;
      if (eps_held_ > 0) wait_ms = 1;  // a busy peer is asked again soon
    }
    if (armed && fd) {
      // Sleeps until the worker has events, run_batch() signals new work,
      // or 50 ms pass (so that stop_ is noticed even without a signal).
      pollfd p = {*fd, POLLIN, 0};
      (void)::poll(&p, 1, wait_ms);
    }
  }
}

}  // namespace refit::ucx
