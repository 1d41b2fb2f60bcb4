#include "transport/cuda/staging.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

namespace refit::cuda {

Landing choose_landing(bool device_memory, bool ucx_reports_cuda) {
  // Host memory is always reachable; device memory only where UCX itself
  // says it can move CUDA memory (a CUDA-aware UCX reports kCuda for it).
  return device_memory && !ucx_reports_cuda ? Landing::kStaged : Landing::kDirect;
}

const char* landing_name(Landing landing) { return landing == Landing::kDirect ? "direct" : "staged"; }

uint64_t StagedRun::bytes() const {
  uint64_t n = 0;
  for (const DevicePlace& p : places) n += p.bytes;
  return n;
}

Status validate(const StagingOptions& options) {
  if (options.slot_bytes == 0) {
    return Status::invalid("staging: \"slot_bytes\" must be a positive number of bytes, got 0");
  }
  if (options.slots < 2) {
    return Status::invalid("staging: \"slots\" must be at least 2 so that copies overlap the network, got " +
                           std::to_string(options.slots));
  }
  return Status::ok();
}

LandingRing::LandingRing(CopyOps& ops, std::span<uint8_t> host, StagingOptions options, std::vector<StagedRun> runs)
    : ops_(ops), host_(host), options_(options), runs_(std::move(runs)) {
  for (uint32_t r = 0; r < runs_.size(); ++r) {
    const uint64_t total = runs_[r].bytes();
    for (uint64_t off = 0; off < total; off += options_.slot_bytes) {
      chunks_.push_back(StagedChunk{r, off, std::min(options_.slot_bytes, total - off)});
    }
  }
  for (uint32_t i = options_.slots; i > 0; --i) free_slots_.push_back(i - 1);
  slot_.reset(new std::atomic<uint32_t>[chunks_.size()]);
  waited_.reset(new std::atomic<bool>[chunks_.size()]);
  for (size_t k = 0; k < chunks_.size(); ++k) {
    slot_[k].store(0);
    waited_[k].store(false);
  }
}

StagingStats LandingRing::stats() const {
  StagingStats s = stats_;
  s.held = held_.load();
  return s;
}

Result<std::unique_ptr<LandingRing>> LandingRing::create(CopyOps& ops, std::span<uint8_t> host,
                                                         const StagingOptions& options, std::vector<StagedRun> runs) {
  REFIT_RETURN_IF_ERROR(validate(options));
  if (host.size() / options.slots < options.slot_bytes) {
    return Status::invalid("staging: " + std::to_string(options.slots) + " slots of " +
                           std::to_string(options.slot_bytes) + " bytes need more than the " +
                           std::to_string(host.size()) + " bytes of staging memory given");
  }
  return std::unique_ptr<LandingRing>(new LandingRing(ops, host, options, std::move(runs)));
}

uint8_t* LandingRing::slot_of(uint32_t chunk) const {
  return host_.data() + static_cast<uint64_t>(slot_[chunk].load(std::memory_order_acquire)) * options_.slot_bytes;
}

bool LandingRing::acquire(uint32_t chunk, void** slot) {
  if (gate_open_.load(std::memory_order_acquire)) {
    slot_[chunk].store(0, std::memory_order_release);
    *slot = host_.data();
    return true;
  }
  std::lock_guard<std::mutex> lock(slots_mu_);
  if (free_slots_.empty()) {
    if (!waited_[chunk].exchange(true, std::memory_order_relaxed)) held_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  const uint32_t i = free_slots_.back();
  free_slots_.pop_back();
  slot_[chunk].store(i, std::memory_order_release);
  *slot = host_.data() + static_cast<uint64_t>(i) * options_.slot_bytes;
  return true;
}

void LandingRing::landed(uint32_t chunk, const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  landed_.emplace_back(chunk, status);
  cv_.notify_one();
}

void LandingRing::network_over() {
  std::lock_guard<std::mutex> lock(mu_);
  over_ = true;
  cv_.notify_one();
}

Status LandingRing::issue_copy(const StagedChunk& chunk, uint8_t* slot) {
  std::vector<Piece> pieces;
  uint64_t at = 0;  // offset in the run of the current place
  const uint64_t end = chunk.offset + chunk.bytes;
  for (const DevicePlace& p : runs_[chunk.run].places) {
    const uint64_t lo = std::max(at, chunk.offset);
    const uint64_t hi = std::min(at + p.bytes, end);
    if (lo < hi) pieces.push_back(Piece{p.data + (lo - at), slot + (lo - chunk.offset), hi - lo});
    at += p.bytes;
    if (at >= end) break;
  }
  const std::vector<Copy> copies = plan_copies(pieces);
  stats_.copies += copies.size();
  return ops_.copy_all(copies);
}

Status LandingRing::run(const RunDone& run_done, const std::function<void()>& slots_freed, bool release_on_issue,
                        Clock::time_point bound) {
  stats_ = StagingStats{};
  stats_.chunks = chunks_.size();
  // Per run: chunks not yet issued to the copy stage, and not yet copied.
  std::vector<uint32_t> to_issue(runs_.size(), 0), to_copy(runs_.size(), 0);
  for (const StagedChunk& c : chunks_) {
    ++to_issue[c.run];
    ++to_copy[c.run];
  }
  for (uint32_t r = 0; r < runs_.size(); ++r) {
    if (to_copy[r] == 0) run_done(r);  // an empty run
  }
  struct InCopy {
    uint64_t ticket;
    std::vector<uint32_t> chunks;
  };
  std::deque<InCopy> in_copy;  // tickets increase: the stream completes them in order
  uint32_t chunks_in_copy = 0;
  Status status;
  bool over = false;
  bool told_failed = false;
  while (true) {
    std::deque<std::pair<uint32_t, Status>> take;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (landed_.empty()) {
        if (!in_copy.empty()) {
          cv_.wait_for(lock, std::chrono::microseconds(20));  // and poll the copies
        } else if (!over_) {
          cv_.wait(lock, [&] { return !landed_.empty() || over_; });
        }
      }
      take.swap(landed_);
      over = over_;
    }
    // Landed chunks: one batch of copies, then one ticket for all of them.
    InCopy batch;
    for (auto& [k, st] : take) {
      if (!st.is_ok()) {
        if (status.is_ok()) status = st.with_context("staging: network");
        continue;
      }
      if (!status.is_ok()) continue;  // failed: what still lands is not copied
      status = issue_copy(chunks_[k], slot_of(k));
      batch.chunks.push_back(k);  // also when that failed: some of its copies may be on the stream
      if (!status.is_ok()) {
        status = status.with_context("staging: copy");
        break;
      }
      if (!over) ++stats_.overlapped;
    }
    if (!batch.chunks.empty()) {
      Result<uint64_t> ticket = ops_.record();
      if (!ticket.is_ok() && status.is_ok()) status = ticket.status().with_context("staging: copy");
      // Without a ticket the copies already issued are still waited for
      // below: record() fails only on a broken stream, whose done() fails too.
      batch.ticket = ticket.is_ok() ? *ticket : 0;
      chunks_in_copy += static_cast<uint32_t>(batch.chunks.size());
      stats_.max_in_copy = std::max(stats_.max_in_copy, chunks_in_copy);
      if (release_on_issue && status.is_ok()) {  // (a failed batch releases nothing)
        for (uint32_t k : batch.chunks) {
          if (--to_issue[chunks_[k].run] == 0) run_done(chunks_[k].run);
        }
      }
      in_copy.push_back(std::move(batch));
    }
    // Copies that completed free their slots.
    bool freed = false;
    while (!in_copy.empty()) {
      Result<bool> d = in_copy.front().ticket == 0 ? Result<bool>(Status::io_error("no ticket"))
                                                   : ops_.done(in_copy.front().ticket);
      if (!d.is_ok()) {
        // The copy engine failed: nothing it holds completes any more.
        gate_open_.store(true, std::memory_order_release);
        if (slots_freed) slots_freed();
        return status.is_ok() ? d.status().with_context("staging: copy") : status;
      }
      if (!*d) break;
      {
        std::lock_guard<std::mutex> lock(slots_mu_);
        for (uint32_t k : in_copy.front().chunks) free_slots_.push_back(slot_[k].load(std::memory_order_acquire));
      }
      for (uint32_t k : in_copy.front().chunks) {
        if (!release_on_issue && status.is_ok() && --to_copy[chunks_[k].run] == 0) run_done(chunks_[k].run);
      }
      chunks_in_copy -= static_cast<uint32_t>(in_copy.front().chunks.size());
      in_copy.pop_front();
      freed = true;
    }
    if (!status.is_ok() && in_copy.empty() && !told_failed) {
      // Failed, and no copy reads a slot any more: the gate opens for every
      // chunk, so that the network drains at once (what lands is dropped).
      // Not before: with release_on_issue a consumer may already read the
      // device places of a copy still in flight, whose slot must hold.
      told_failed = true;
      gate_open_.store(true, std::memory_order_release);
      freed = true;
    }
    if (freed && slots_freed) slots_freed();
    if (over && in_copy.empty()) break;
    if (Clock::now() >= bound && !in_copy.empty()) {
      // A broken device (the bound is past the network's deadline, so its
      // batch is over): the gate stays shut over slots copies may still read.
      return Status::timeout("staging: the copies from the landing ring did not finish");
    }
  }
  if (status.is_ok()) {
    uint32_t missing = 0;
    for (uint32_t r = 0; r < runs_.size(); ++r) missing += release_on_issue ? to_issue[r] : to_copy[r];
    if (missing > 0) {
      status = Status::internal("staging: " + std::to_string(missing) + " chunk(s) never landed");
    }
  }
  return status;
}

}  // namespace refit::cuda
