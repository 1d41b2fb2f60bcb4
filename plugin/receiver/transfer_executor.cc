#include "plugin/receiver/transfer_executor.h"

#include <algorithm>

#include "planner/dtype.h"
#include "transport/convert/convert.h"
#include "transport/convert/relayout.h"
#ifdef REFIT_HAVE_CONVERT_KERNEL
#include "transport/convert/convert_cuda.h"
#endif

namespace refit::plugin::receiver {

namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

TransferExecutor::TransferExecutor(const TransferSetup& setup, const CompiledPart& part, int64_t version,
                                   Clock::time_point deadline, TransferWatch watch, ThreadFactory threads)
    : setup_(setup), part_(part), deadline_(deadline), watch_(std::move(watch)), threads_(std::move(threads)),
      schedule_(part.schedule) {
  schedule_.version = version;
}

TransferExecutor::~TransferExecutor() {
  inputs_over();
  join_all();
}

void TransferExecutor::fail_fast(fabric::LocalFabric& fabric, const fabric::Schedule& schedule,
                                 Clock::time_point deadline) {
  if (fabric.begin(schedule, deadline).is_ok()) (void)fabric.finish(/*failed=*/true);
  fabric.end();
}

Status TransferExecutor::run(TransferReport* report) {
  if (Status st = prepare(); !st.is_ok()) {
    fail_fast(*setup_.fabric, schedule_, deadline_);
    return st;
  }
  fan_status_ = setup_.fabric->begin(schedule_, deadline_);
  fan_end_ = Clock::now();
  const bool begun = fan_status_.is_ok();
  const Status started = begun ? start_threads() : Status::ok();
  start_ = Clock::now();
  if (begun && started.is_ok()) pull();
  net_end_ = Clock::now();
  inputs_over();
  join_all();
  setup_.fabric->end();
  fill(report);
  return outcome(started);
}

// The engine, its runs and the landing ring. The engine's runs: a GET
// straight into its place for each GET of the part, or, for a GET through
// the landing ring, one per landing slot's worth of it (the ring's gate
// holds each until a slot is free, and moves it there).
Status TransferExecutor::prepare() {
  ucx::GetEngineOptions options;
  options.progress_thread = true;
  options.threads = threads_;
  options.rank = static_cast<uint64_t>(setup_.rank);
  options.limits.chunk_bytes = setup_.transfer_chunk_bytes;
  // A gather is one request of up to "gather_bytes" (docs/refresh.md, "Gathers").
  if (setup_.gather.enabled) options.limits.gather_chunk_bytes = static_cast<uint64_t>(setup_.gather.max_bytes);
  options.limits.max_bytes_in_flight = setup_.window_bytes;
  options.limits.max_bytes_per_endpoint = setup_.window_bytes;
  Result<std::unique_ptr<ucx::GetEngine>> engine = ucx::GetEngine::create(*setup_.worker, options);
  if (!engine.is_ok()) return engine.status();
  engine_ = std::move(engine).value();
  for (const ucx::MemoryRegion* r : setup_.regions) engine_->add_local_region(*r);
  if (part_.through_slots) {
    std::vector<cuda::StagedRun> ring_runs;
    for (uint32_t i = 0; i < part_.gets.size(); ++i) {
      if (part_.gets[i].device == nullptr) continue;
      ring_runs.push_back(cuda::StagedRun{{cuda::DevicePlace{part_.gets[i].device, part_.gets[i].bytes}}});
      ring_run_get_.push_back(i);
    }
    const uint64_t slot = std::min(setup_.landing_slot_bytes, setup_.transfer_chunk_bytes);
    Result<std::unique_ptr<cuda::LandingRing>> ring = cuda::LandingRing::create(
        *setup_.copy_ops, setup_.landing_ring,
        cuda::StagingOptions{slot, static_cast<uint32_t>(setup_.landing_ring.size() / slot)}, std::move(ring_runs));
    if (!ring.is_ok()) return ring.status();
    ring_ = std::move(ring).value();
  }
  // Gathers: small runs of one source that land in host memory travel as
  // one request (docs/refresh.md, "Gathers"); runs through a landing slot,
  // or straight into GPU memory, never do.
  std::vector<ucx::NetRunRef> refs;
  refs.reserve(part_.gets.size());
  for (const CompiledPart::Get& g : part_.gets) {
    refs.push_back(ucx::NetRunRef{g.source, ucx::GatherPart{g.rkey_id, g.remote, g.local, g.bytes},
                                  g.device == nullptr && !g.local_on_gpu});
  }
  gathers_ = ucx::make_gather_ops(refs, setup_.gather);
  for (uint32_t i = 0; i < part_.gets.size(); ++i) {
    const CompiledPart::Get& g = part_.gets[i];
    if (g.device != nullptr || gathers_.gathered[i]) continue;
    engine_runs_.push_back(ucx::GetRun{setup_.endpoints.at(g.source), g.rkey_id, g.remote, g.local, g.bytes});
    engine_run_chunk_.push_back(-1);
    engine_run_get_.push_back(i);
    engine_run_gather_.push_back(-1);
  }
  for (uint32_t k = 0; k < gathers_.ops.size(); ++k) {
    const ucx::GatherOps::Op& op = gathers_.ops[k];
    engine_runs_.push_back(ucx::GetRun{setup_.endpoints.at(op.peer), 0, 0, nullptr, op.bytes, ucx::Op::kGet, op.parts});
    engine_run_chunk_.push_back(-1);
    engine_run_get_.push_back(op.runs.front());
    engine_run_gather_.push_back(k);
  }
  if (!ring_) return Status::ok();
  const std::vector<cuda::StagedChunk>& chunks = ring_->chunks();
  for (uint32_t k = 0; k < chunks.size(); ++k) {
    const uint32_t get = ring_run_get_[chunks[k].run];
    const CompiledPart::Get& g = part_.gets[get];
    // Named at the ring's start; the gate moves it to the slot it gets.
    engine_runs_.push_back(ucx::GetRun{setup_.endpoints.at(g.source), g.rkey_id, g.remote + chunks[k].offset,
                                       ring_->base(), chunks[k].bytes});
    engine_run_chunk_.push_back(k);
    engine_run_get_.push_back(get);
    engine_run_gather_.push_back(-1);
  }
  return Status::ok();
}

// The watcher, the fan-out, the lander, in that order. A thread that cannot
// start fails the attempt; the fabric, begun already, is finished failed
// by the fan-out, or here when that is the thread that could not start.
Status TransferExecutor::start_threads() {
  deps_ = part_.send_deps;
  for (uint32_t i = 0; i < deps_.size(); ++i) {
    if (deps_[i] == 0) ready_.push_back(i);
  }
  convert_deps_ = part_.convert_deps;
  for (uint32_t k = 0; k < convert_deps_.size(); ++k) {
    if (convert_deps_[k] == 0) convert_ready_.push_back(k);
  }
  landing_done_ = !ring_;
  watching_ = true;
  Result<std::thread> watcher = threads_.start("transfer watcher", [this] { watch(); },
                                                  [this](const Status& why) { stop_waiting(why); });
  if (!watcher.is_ok()) {
    (void)setup_.fabric->finish(/*failed=*/true);
    return watcher.status();
  }
  watcher_ = std::move(watcher).value();
  Result<std::thread> fan = threads_.start("fan-out", [this] { fan_out(); }, [this](const Status& why) {
    fan_status_ = why;  // the peers are told at once
    (void)setup_.fabric->finish(/*failed=*/true);
    fan_end_ = Clock::now();
  });
  if (!fan.is_ok()) {
    (void)setup_.fabric->finish(/*failed=*/true);
    return fan.status();
  }
  fan_ = std::move(fan).value();
  if (!ring_) return Status::ok();
  Result<std::thread> lander = threads_.start("landing ring copy", [this] { land(); }, [this](const Status& why) {
    engine_->halt(why);
    {
      std::lock_guard<std::mutex> lock(mu_);
      landing_status_ = why;
      landing_done_ = true;
    }
    cv_.notify_one();
  });
  if (!lander.is_ok()) {  // the fan-out then finishes the fabric failed
    std::lock_guard<std::mutex> lock(mu_);
    landing_status_ = lander.status();
    landing_done_ = true;
    return lander.status();
  }
  lander_ = std::move(lander).value();
  return Status::ok();
}

void TransferExecutor::pull() {
  TraceSpan span(setup_.trace, "get_batch");
  if (setup_.progress) {
    uint64_t planned = 0;
    for (const ucx::GetRun& r : engine_runs_) planned += r.bytes;
    setup_.progress->landed.store(0);
    setup_.progress->planned.store(planned);
    setup_.progress->version.store(schedule_.version);
  }
  ucx::GetEngine::Gate gate;
  if (ring_) {
    gate = [this](uint32_t run, void** local) {
      return engine_run_chunk_[run] < 0 || ring_->acquire(static_cast<uint32_t>(engine_run_chunk_[run]), local);
    };
  }
  if (setup_.trace) {  // counts what the gate lets go
    gate = [this, ring_gate = std::move(gate)](uint32_t run, void** local) {
      if (ring_gate && !ring_gate(run, local)) return false;
      in_flight_ += engine_runs_[run].bytes;
      sample_in_flight(false);
      return true;
    };
  }
  batch_ = engine_->run_batch(
      engine_runs_, deadline_,
      [this](uint32_t run, const Status& st) {
        if (setup_.trace) {
          in_flight_ -= std::min(in_flight_, engine_runs_[run].bytes);
          sample_in_flight(in_flight_ == 0);
        }
        // A failed GET fails the attempt: the rest need not be pulled (a
        // new attempt plans anew).
        if (!st.is_ok()) engine_->halt(st);
        if (st.is_ok() && setup_.progress) setup_.progress->landed.fetch_add(engine_runs_[run].bytes);
        if (engine_run_chunk_[run] >= 0) {
          ring_->landed(static_cast<uint32_t>(engine_run_chunk_[run]), st);
          return;
        }
        if (!st.is_ok()) return;
        std::lock_guard<std::mutex> lock(mu_);
        bool any = false;
        if (engine_run_gather_[run] >= 0) {  // a gather releases the sends of all its runs
          for (uint32_t get : gathers_.ops[static_cast<size_t>(engine_run_gather_[run])].runs) {
            any = release_locked(get) || any;
          }
        } else {
          any = release_locked(engine_run_get_[run]);
        }
        if (any) cv_.notify_one();
      },
      std::move(gate));
  span.arg("requests", engine_runs_.size());
  span.arg("bytes", batch_.bytes_done);
  span.arg("ok", batch_.status.is_ok());
}

// At most one sample a millisecond, and always the last (force): a batch
// of thousands of small GETs would otherwise flood the trace.
void TransferExecutor::sample_in_flight(bool force) {
  const Clock::time_point now = Clock::now();
  if (!force && now - in_flight_sampled_ < std::chrono::milliseconds(1)) return;
  in_flight_sampled_ = now;
  setup_.trace->counter("get_bytes_in_flight", now, static_cast<double>(in_flight_));
}

// No more GETs: tells the ring and the fan-out. Idempotent.
void TransferExecutor::inputs_over() {
  if (inputs_over_) return;
  inputs_over_ = true;
  if (ring_) ring_->network_over();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!net_done_) net_ok_ = batch_.status.is_ok();
    net_done_ = true;
  }
  cv_.notify_one();
}

void TransferExecutor::join_all() {
  if (lander_.joinable()) lander_.join();
  if (fan_.joinable()) fan_.join();
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watching_ = false;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

bool TransferExecutor::release_locked(uint32_t get) {
  bool any = false;
  for (uint32_t op : part_.dependents[get]) {
    if (--deps_[op] == 0) {
      ready_.push_back(op);
      any = true;
    }
  }
  if (get < part_.get_converts.size()) {
    for (uint32_t k : part_.get_converts[get]) {
      if (--convert_deps_[k] == 0) {
        convert_ready_.push_back(k);
        any = true;
      }
    }
  }
  return any;
}

// One unit of a converted tensor, from its staged box into the buffer: per
// index of the leading dims (stacked experts), one call of the CPU kernel
// over the last two dims (the CUDA kernel into GPU memory, after a copy of
// the staged rows to the device), or a cast per row (into GPU memory, one
// cast and one copy of the last two dims' rows). The kernel refuses a block
// with NaN or infinity before writing it (docs/conversion.md). Calls into
// GPU memory reuse gpu_work_'s stream and scratch.
Status TransferExecutor::convert(uint32_t k) {
  const CompiledPart::Convert& c = part_.converts[k];
#ifdef REFIT_HAVE_CONVERT_KERNEL
  if (c.device && !gpu_work_) gpu_work_ = setup_.gpu_work ? setup_.gpu_work : std::make_shared<convert::GpuWork>();
#endif
  // A relayout: the staged box into the region's strides, on the host, or
  // copied to the GPU and written by the CUDA kernel (the compiler refuses
  // GPU memory in a build without it).
  if (c.relayout) {
#ifdef REFIT_HAVE_CONVERT_KERNEL
    if (c.device)
      return convert::relayout_box_cuda_from_host(c.staged, c.dst, dtype_bytes(c.to), c.size, c.strides, c.tensor,
                                                  *gpu_work_);
#endif
    return convert::relayout_box(c.staged, c.dst, dtype_bytes(c.to), c.size, c.strides);
  }
  const size_t n = c.size.size();
  const int in = dtype_bytes(c.from), out = dtype_bytes(c.to);
  const bool quantize = c.scales != nullptr;
  // The dims each call covers.
  const size_t inner = quantize ? 2 : c.device ? std::min<size_t>(2, n) : 1;
  int64_t inner_elems = 1;
  for (size_t d = n - inner; d < n; ++d) inner_elems *= c.size[d];
  std::vector<int64_t> idx(n - inner, 0);
  const uint8_t* src = c.staged;
  for (;;) {
    int64_t dst_off = 0, scale_off = 0;
    for (size_t d = 0; d < n - inner; ++d) {
      dst_off += idx[d] * c.strides[d];
      if (quantize) scale_off += idx[d] * c.scale_strides[d];
    }
    if (quantize) {
      convert::QuantizeArgs a;
      a.src_dtype = c.from;
      a.src = src;
      a.src_stride = c.size[n - 1];
      a.rows = c.size[n - 2];
      a.cols = c.size[n - 1];
      a.dst = c.dst + dst_off;
      a.dst_stride = c.strides[n - 2];
      a.scales = c.scales + scale_off;
      a.scale_stride = c.scale_strides[n - 2];
      a.block = c.block;
      a.tensor = c.tensor;
      a.block_row0 = c.start[n - 2] / c.block.rows;
      a.block_col0 = c.start[n - 1] / c.block.cols;
#ifdef REFIT_HAVE_CONVERT_KERNEL
      if (c.device) {
        REFIT_RETURN_IF_ERROR(convert::quantize_e4m3_blocks_cuda_from_host(a, *gpu_work_));
      } else {
        REFIT_RETURN_IF_ERROR(convert::quantize_e4m3_blocks(a));
      }
    } else if (c.device) {
      const int64_t rows = inner == 2 ? c.size[n - 2] : 1;
      const int64_t dst_stride = inner == 2 ? c.strides[n - 2] : c.size[n - 1];
      REFIT_RETURN_IF_ERROR(convert::cast_to_device(c.from, c.to, src, c.dst + dst_off * out, rows, c.size[n - 1],
                                                    dst_stride, c.tensor, *gpu_work_));
#else
      REFIT_RETURN_IF_ERROR(convert::quantize_e4m3_blocks(a));
#endif
    } else {
      REFIT_RETURN_IF_ERROR(convert::cast(c.from, c.to, src, c.dst + dst_off * out, c.size[n - 1], c.tensor));
    }
    src += inner_elems * in;
    size_t d = n - inner;
    while (d > 0) {
      if (++idx[d - 1] < c.size[d - 1]) break;
      idx[d - 1] = 0;
      --d;
    }
    if (d == 0) break;
  }
  return Status::ok();
}

void TransferExecutor::fan_out() {
  TraceSpan span(setup_.trace, "fan_out");
  span.arg("sends", schedule_.sends.size());
  size_t done = 0;
  bool finished = false;
  bool net_ok = false;
  Status landing;
  while (fan_status_.is_ok() && !finished) {
    std::vector<uint32_t> take, converts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !ready_.empty() || !convert_ready_.empty() || (net_done_ && landing_done_); });
      take.swap(ready_);
      converts.swap(convert_ready_);
      finished = net_done_ && landing_done_ && converts.empty();
      net_ok = net_ok_;
      landing = landing_status_;
    }
    if (!take.empty()) {
      // One span per batch handed to the fabric: the sends that became
      // ready together (the fabric may finish them after the span ends).
      TraceSpan send_span(setup_.trace, "fan_out_send");
      uint64_t bytes = 0, peer_bytes = 0;
      for (uint32_t k : take) {
        bytes += schedule_.sends[k].bytes;
        if (schedule_.sends[k].peer != fabric::kSelf) peer_bytes += schedule_.sends[k].bytes;
      }
      fan_status_ = setup_.fabric->send(take);
      send_span.arg("sends", take.size());
      send_span.arg("bytes", bytes);
      send_span.arg("peer_bytes", peer_bytes);
      send_span.arg("ok", fan_status_.is_ok());
    }
    done += take.size();
    // Conversions run here, between sends: the bytes they write are what
    // the sends after them carry.
    TraceSpan convert_span(converts.empty() ? nullptr : setup_.trace, "convert");
    convert_span.arg("units", converts.size());
    for (uint32_t k : converts) {
      if (!fan_status_.is_ok()) break;
      const Clock::time_point t0 = Clock::now();
      Status st = convert(k);
      convert_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
      if (!st.is_ok()) {
        convert_status_ = st;
        fan_status_ = st;
        break;
      }
      std::lock_guard<std::mutex> lock(mu_);
      release_locked(static_cast<uint32_t>(part_.gets.size()) + k);
    }
  }
  if (!fan_status_.is_ok()) {  // the fabric failed: the peers are told at once
    (void)setup_.fabric->finish(/*failed=*/true);
    fan_end_ = Clock::now();
    return;
  }
  if (fan_status_.is_ok() && net_ok && landing.is_ok() && done != schedule_.sends.size()) {
    fan_status_ = Status::internal(std::to_string(schedule_.sends.size() - done) + " local runs never became ready");
  }
  const Status finished_status = setup_.fabric->finish(!fan_status_.is_ok() || !net_ok || !landing.is_ok());
  if (fan_status_.is_ok() && net_ok) fan_status_ = finished_status;
  fan_end_ = Clock::now();
}

// Copies each landing slot on as it lands. Copies are local and end in
// bounded time, also past the attempt's deadline (a failed refresh must not
// leave copies writing the buffers after it returned); the bound only
// catches a broken device.
void TransferExecutor::land() {
  const Clock::time_point bound = std::max(deadline_, Clock::now() + std::chrono::seconds(60));
  TraceSpan span(setup_.trace, "landing_copies");
  Status st = ring_->run(
      [this](uint32_t ring_run) {
        std::lock_guard<std::mutex> lock(mu_);
        if (release_locked(ring_run_get_[ring_run])) cv_.notify_one();
      },
      [this] { engine_->wake(); }, setup_.fabric_waits_for_copies, bound);
  if (!st.is_ok()) engine_->halt(st);  // the attempt failed: stop pulling
  span.arg("copies", ring_->stats().copies);
  span.arg("ok", st.is_ok());
  span.end();
  {
    std::lock_guard<std::mutex> lock(mu_);
    landing_status_ = std::move(st);
    landing_done_ = true;
  }
  cv_.notify_one();
}

void TransferExecutor::watch() {
  auto next_check = Clock::now() + kMembershipCheck;
  bool changed = false;  // the membership changed: the peers are no longer waited for
  auto watching = [this] {
    std::lock_guard<std::mutex> lock(watch_mu_);
    return watching_;
  };
  while (watching() && Clock::now() < deadline_) {
    if (watch_.listen) {
      Status st = watch_.listen(std::min({deadline_, next_check, Clock::now() + kListenSlice}));
      if (!st.is_ok()) return stop_waiting(st);
    } else {
      std::unique_lock<std::mutex> lock(watch_mu_);
      watch_cv_.wait_until(lock, std::min(deadline_, next_check), [this] { return !watching_; });
    }
    if (Clock::now() < next_check || !watching()) continue;
    next_check = Clock::now() + kMembershipCheck;
    if (!watch_.check) continue;
    // After a change the watcher goes on: the next one may leave out a
    // source that the first still named (two sources declared dead a
    // heartbeat apart).
    std::vector<int32_t> gone;
    if (Status st = watch_.check(&gone); !st.is_ok()) {
      drop_sources(gone, st);
      if (!changed) stop_waiting(st);
      changed = true;
    }
  }
}

// A source the new plan left out may be gone (declared dead) or only not
// needed by this rank any more. One that has answered nothing for
// kQuietSource is taken for gone: its GETs fail now rather than at the
// deadline, the failed runs halt the batch, and the next attempt runs the
// new plan (from a replica, where there is one). One that still answers is
// read on (see stop_waiting).
void TransferExecutor::drop_sources(const std::vector<int32_t>& gone, const Status& why) {
  for (int32_t rank : gone) {
    auto it = setup_.endpoints.find(rank);
    if (it == setup_.endpoints.end()) continue;
    engine_->drop_peer(it->second,
                       Status::io_error("source " + std::to_string(rank) + " is not in the new plan and answered "
                                        "nothing for " + std::to_string(kQuietSource.count()) +
                                        " ms, so its GETs in flight were cancelled: " + why.message())
                           .with_reason(Reason::kPeerLost),
                       kQuietSource);
  }
}

// Only the wait for peers ends: the GETs to sources still in the plan go on,
// since the ranks of other instances in the domain may still need the
// slices this rank passes on.
void TransferExecutor::stop_waiting(const Status& why) {
  watch_status_ = why;
  setup_.fabric->cancel();
}

Status TransferExecutor::outcome(const Status& started) const {
  if (!started.is_ok()) return started;
  // An abort of the instance ends the attempt whatever else happened; a
  // change of membership explains a failed wait for the peers.
  if (watch_status_.reason() == Reason::kInstanceAborted) return watch_status_;
  // A refused conversion (NaN or infinity in a block) is the cause of
  // whatever failed after it.
  if (!convert_status_.is_ok()) return convert_status_;
  if (!watch_status_.is_ok() && !fan_status_.is_ok()) {
    return Status::io_error(watch_status_.message() + ": " + fan_status_.message()).with_reason(watch_status_.reason());
  }
  if (!batch_.status.is_ok()) {
    // A GET fails when its source's endpoint fails: the source died or
    // left, and a new attempt plans without it.
    Status st = batch_.status.with_context("network");
    return st.code() == Code::kIoError && st.reason() == Reason::kNone ? st.with_reason(Reason::kPeerLost) : st;
  }
  if (!landing_status_.is_ok()) return landing_status_.with_context("landing copies");
  return fan_status_;
}

void TransferExecutor::fill(TransferReport* report) const {
  report->network_s = seconds_between(start_, net_end_);
  report->local_s = seconds_between(start_, std::max(start_, fan_end_));
  report->gets = part_.gets.size();
  report->gathers = gathers_.ops.size();
  report->gathered_runs = gathers_.gathered_runs;
  report->gather_unpacked = gathers_.unpacked;
  report->gather_busy = batch_.busy_retries;
  report->sends = schedule_.sends.size();
  report->converts = part_.converts.size();
  report->convert_s = convert_s_;
  report->network_bytes = batch_.bytes_done;
  if (!ring_) return;
  report->landing = true;
  const cuda::StagingStats stats = ring_->stats();
  report->landing_slots = ring_->slots();
  report->landing_chunks = stats.chunks;
  report->landing_copies = stats.copies;
  report->landing_held = stats.held;
}

}  // namespace refit::plugin::receiver
