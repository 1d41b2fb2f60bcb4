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

// Network completions, shared with the callbacks: a callback of an earlier
// run() (after a deadline) finds another generation and does nothing.
struct StagingPipeline::Shared {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  std::deque<std::pair<uint32_t, Status>> finished;  // (slot, status)
};

StagingPipeline::StagingPipeline(CopyOps& ops, std::span<uint8_t> host, StagingOptions options)
    : ops_(ops), host_(host), options_(options), shared_(std::make_shared<Shared>()) {}

StagingPipeline::~StagingPipeline() {
  std::lock_guard<std::mutex> lock(shared_->mu);
  ++shared_->generation;
}

Result<std::unique_ptr<StagingPipeline>> StagingPipeline::create(CopyOps& ops, std::span<uint8_t> host,
                                                                 const StagingOptions& options) {
  REFIT_RETURN_IF_ERROR(validate(options));
  if (host.size() / options.slots < options.slot_bytes) {
    return Status::invalid("staging: " + std::to_string(options.slots) + " slots of " +
                           std::to_string(options.slot_bytes) + " bytes need more than the " +
                           std::to_string(host.size()) + " bytes of staging memory given");
  }
  return std::unique_ptr<StagingPipeline>(new StagingPipeline(ops, host, options));
}

Status StagingPipeline::issue_copy(Direction direction, const StagedRun& run, const StagedChunk& chunk,
                                   uint8_t* slot) {
  std::vector<Piece> pieces;
  uint64_t at = 0;  // offset in the run of the current place
  const uint64_t end = chunk.offset + chunk.bytes;
  for (const DevicePlace& p : run.places) {
    const uint64_t lo = std::max(at, chunk.offset);
    const uint64_t hi = std::min(at + p.bytes, end);
    if (lo < hi) {
      uint8_t* device = p.data + (lo - at);
      uint8_t* host = slot + (lo - chunk.offset);
      pieces.push_back(direction == Direction::kToDevice ? Piece{device, host, hi - lo} : Piece{host, device, hi - lo});
    }
    at += p.bytes;
    if (at >= end) break;
  }
  const std::vector<Copy> copies = plan_copies(pieces);
  stats_.copies += copies.size();
  return ops_.copy_all(copies);
}

Status StagingPipeline::run(Direction direction, std::span<const StagedRun> runs, const Network& network,
                            const RunDone& run_done, Clock::time_point deadline) {
  stats_ = StagingStats{};
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    generation = ++shared_->generation;
    shared_->finished.clear();
  }
  enum class State { kFree, kNetwork, kCopy };
  struct Slot {
    State state = State::kFree;
    StagedChunk chunk;
    uint64_t ticket = 0;
  };
  std::vector<Slot> slots(options_.slots);
  std::deque<uint32_t> free;
  for (uint32_t i = 0; i < options_.slots; ++i) free.push_back(i);
  std::vector<uint64_t> total(runs.size());
  std::vector<uint64_t> left(runs.size());
  for (uint32_t r = 0; r < runs.size(); ++r) {
    total[r] = left[r] = runs[r].bytes();
    if (left[r] == 0) run_done(r);
  }
  uint32_t next_run = 0;
  uint64_t next_offset = 0;
  auto next_chunk = [&](StagedChunk* c) {
    while (next_run < runs.size() && next_offset >= total[next_run]) {
      ++next_run;
      next_offset = 0;
    }
    if (next_run >= runs.size()) return false;
    c->run = next_run;
    c->offset = next_offset;
    c->bytes = std::min(options_.slot_bytes, total[next_run] - next_offset);
    next_offset += c->bytes;
    return true;
  };
  uint32_t in_network = 0;
  uint32_t in_copy = 0;
  Status status;
  auto slot_memory = [&](uint32_t i) { return host_.data() + static_cast<uint64_t>(i) * options_.slot_bytes; };
  auto chunk_done = [&](uint32_t i) {
    Slot& s = slots[i];
    s.state = State::kFree;
    left[s.chunk.run] -= s.chunk.bytes;
    if (left[s.chunk.run] == 0) run_done(s.chunk.run);
    free.push_back(i);
  };
  auto start_network = [&](uint32_t i) -> Status {
    Slot& s = slots[i];
    s.state = State::kNetwork;
    ++in_network;
    stats_.max_in_network = std::max(stats_.max_in_network, in_network);
    std::shared_ptr<Shared> shared = shared_;
    Status st = network(s.chunk, slot_memory(i), [shared, generation, i](Status done) {
      std::lock_guard<std::mutex> lock(shared->mu);
      if (shared->generation != generation) return;
      shared->finished.emplace_back(i, std::move(done));
      shared->cv.notify_one();
    });
    if (!st.is_ok()) {
      --in_network;
      s.state = State::kFree;
    }
    return st;
  };
  auto start_copy = [&](uint32_t i) -> Status {
    Slot& s = slots[i];
    REFIT_RETURN_IF_ERROR(issue_copy(direction, runs[s.chunk.run], s.chunk, slot_memory(i)));
    Result<uint64_t> ticket = ops_.record();
    if (!ticket.is_ok()) return ticket.status();
    s.ticket = *ticket;
    s.state = State::kCopy;
    ++in_copy;
    stats_.max_in_copy = std::max(stats_.max_in_copy, in_copy);
    if (in_network > 0) ++stats_.overlapped;
    return Status::ok();
  };

  bool exhausted = false;
  while (true) {
    bool progressed = false;
    // Fill the free slots with the next chunks.
    while (status.is_ok() && !exhausted && !free.empty()) {
      StagedChunk c;
      if (!next_chunk(&c)) {
        exhausted = true;
        break;
      }
      const uint32_t i = free.front();
      free.pop_front();
      slots[i].chunk = c;
      ++stats_.chunks;
      status = direction == Direction::kToDevice ? start_network(i) : start_copy(i);
      progressed = true;
    }
    // Network completions.
    std::deque<std::pair<uint32_t, Status>> finished;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      finished.swap(shared_->finished);
    }
    for (auto& [i, st] : finished) {
      --in_network;
      progressed = true;
      if (!st.is_ok() || !status.is_ok()) {
        if (status.is_ok()) status = st.with_context("staging: network");
        slots[i].state = State::kFree;
        continue;
      }
      if (direction == Direction::kToDevice) {
        status = start_copy(i);
      } else {
        chunk_done(i);
      }
    }
    // Copy completions.
    for (uint32_t i = 0; i < slots.size(); ++i) {
      if (slots[i].state != State::kCopy) continue;
      Result<bool> d = ops_.done(slots[i].ticket);
      if (!d.is_ok()) {
        // The copy engine failed: nothing it holds completes any more.
        return d.status().with_context("staging: copy");
      }
      if (!*d) continue;
      --in_copy;
      progressed = true;
      if (direction == Direction::kToDevice) {
        chunk_done(i);
      } else if (status.is_ok()) {
        status = start_network(i);
      } else {
        slots[i].state = State::kFree;
      }
    }
    if (in_network == 0 && in_copy == 0 && (exhausted || !status.is_ok())) break;
    if (Clock::now() >= deadline) {
      if (status.is_ok()) {
        status = Status::timeout("staging: " + std::to_string(in_network) + " chunk(s) in the network and " +
                                 std::to_string(in_copy) + " in copies when the deadline passed");
      }
      if (in_copy == 0) break;  // copies are local and always finish: wait for them below
    }
    if (progressed) continue;
    std::unique_lock<std::mutex> lock(shared_->mu);
    if (in_copy > 0) {
      shared_->cv.wait_for(lock, std::chrono::microseconds(20));
    } else if (Clock::now() < deadline) {
      shared_->cv.wait_until(lock, deadline, [&] { return !shared_->finished.empty(); });
    }
  }
  return status;
}

}  // namespace refit::cuda
