#include "transport/ucx/chunking.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace refit::ucx {

Status validate(const WindowLimits& l) {
  auto positive = [](uint64_t v, const char* name) -> Status {
    if (v == 0) {
      return Status::invalid(std::string("ucx window: \"") + name +
                             "\" must be a positive integer, got 0");
    }
    return Status::ok();
  };
  REFIT_RETURN_IF_ERROR(positive(l.chunk_bytes, "chunk_bytes"));
  REFIT_RETURN_IF_ERROR(positive(l.max_bytes_in_flight, "max_bytes_in_flight"));
  REFIT_RETURN_IF_ERROR(positive(l.max_ops_in_flight, "max_ops_in_flight"));
  REFIT_RETURN_IF_ERROR(positive(l.max_bytes_per_endpoint, "max_bytes_per_endpoint"));
  REFIT_RETURN_IF_ERROR(positive(l.max_ops_per_endpoint, "max_ops_per_endpoint"));
  if (l.gather_chunk_bytes > l.max_bytes_per_endpoint || l.gather_chunk_bytes > l.max_bytes_in_flight) {
    return Status::invalid("ucx window: \"gather_chunk_bytes\" (" + std::to_string(l.gather_chunk_bytes) +
                           ") must not exceed \"max_bytes_per_endpoint\" (" +
                           std::to_string(l.max_bytes_per_endpoint) + ") or \"max_bytes_in_flight\" (" +
                           std::to_string(l.max_bytes_in_flight) + "); lower gather_chunk_bytes");
  }
  if (l.chunk_bytes > l.max_bytes_per_endpoint || l.chunk_bytes > l.max_bytes_in_flight) {
    return Status::invalid("ucx window: \"chunk_bytes\" (" + std::to_string(l.chunk_bytes) +
                           ") must not exceed \"max_bytes_per_endpoint\" (" +
                           std::to_string(l.max_bytes_per_endpoint) +
                           ") or \"max_bytes_in_flight\" (" +
                           std::to_string(l.max_bytes_in_flight) + "); lower chunk_bytes");
  }
  return Status::ok();
}

std::vector<Chunk> split_run(uint32_t run, const ChunkRun& r, uint64_t chunk_bytes) {
  std::vector<Chunk> out;
  if (chunk_bytes == 0) return out;
  out.reserve((r.bytes + chunk_bytes - 1) / chunk_bytes);
  for (uint64_t off = 0; off < r.bytes; off += chunk_bytes) {
    uint64_t n = r.bytes - off < chunk_bytes ? r.bytes - off : chunk_bytes;
    out.push_back(Chunk{run, r.endpoint, off, n});
  }
  return out;
}

Result<ChunkScheduler> ChunkScheduler::create(const WindowLimits& limits,
                                              std::span<const ChunkRun> runs,
                                              uint32_t num_endpoints) {
  REFIT_RETURN_IF_ERROR(validate(limits));
  ChunkScheduler s;
  s.limits_ = limits;
  s.runs_.resize(runs.size());
  s.eps_.resize(num_endpoints);
  for (uint32_t i = 0; i < runs.size(); ++i) {
    const ChunkRun& r = runs[i];
    if (r.bytes == 0) {
      return Status::invalid("run " + std::to_string(i) +
                             ": zero bytes; drop empty runs before submitting them");
    }
    if (r.endpoint >= num_endpoints) {
      return Status::invalid("run " + std::to_string(i) + ": endpoint index " +
                             std::to_string(r.endpoint) + " out of range (" +
                             std::to_string(num_endpoints) + " endpoints)");
    }
    const uint64_t cut = r.gather && limits.gather_chunk_bytes > 0 ? limits.gather_chunk_bytes : limits.chunk_bytes;
    auto chunks = split_run(i, r, cut);
    s.runs_[i].pending = static_cast<uint32_t>(chunks.size());
    s.pending_chunks_ += chunks.size();
    auto& q = s.eps_[r.endpoint].queue;
    q.insert(q.end(), chunks.begin(), chunks.end());
  }
  for (uint32_t e = 0; e < num_endpoints; ++e) {
    const EndpointState& ep = s.eps_[e];
    if (ep.queue.empty()) continue;
    s.min_head_ = std::min(s.min_head_, ep.queue.front().bytes);
    s.live_.push_back(e);
  }
  return s;
}

bool ChunkScheduler::fits(const EndpointState& ep, const Chunk& c) const {
  return ops_in_flight_ < limits_.max_ops_in_flight &&
         ep.ops_in_flight < limits_.max_ops_per_endpoint &&
         bytes_in_flight_ + c.bytes <= limits_.max_bytes_in_flight &&
         ep.bytes_in_flight + c.bytes <= limits_.max_bytes_per_endpoint;
}

void ChunkScheduler::advance(EndpointState& ep) {
  ++ep.head;
  if (ep.head < ep.queue.size()) min_head_ = std::min(min_head_, ep.queue[ep.head].bytes);
}

std::optional<Chunk> ChunkScheduler::next(const Gate& gate) {
  // Not even the smallest next chunk fits the window in total: no endpoint
  // need be tried (a receiver with hundreds of sources asks after every
  // completion). bytes_in_flight_ never exceeds the limit.
  if (pending_chunks_ == 0 || ops_in_flight_ >= limits_.max_ops_in_flight ||
      min_head_ > limits_.max_bytes_in_flight - bytes_in_flight_)
    return std::nullopt;
  const uint32_t n = static_cast<uint32_t>(eps_.size());
  uint64_t smallest = UINT64_MAX;  // of every endpoint's next chunk, held or not
  // The endpoints with chunks pending, from the cursor on, round robin; the
  // others would be passed over.
  const size_t live = live_.size();
  const size_t first = static_cast<size_t>(std::lower_bound(live_.begin(), live_.end(), cursor_) - live_.begin());
  for (size_t tried = 0; tried < live; ++tried) {
    const size_t i = (first + tried) % live;
    const uint32_t e = live_[i];
    EndpointState& ep = eps_[e];
    smallest = std::min(smallest, ep.queue[ep.head].bytes);
    if (ep.held) continue;
    const Chunk c = ep.queue[ep.head];
    if (!fits(ep, c)) continue;
    if (gate && c.offset == 0 && !gate(c.run)) continue;  // asked before its first chunk only
    advance(ep);
    if (ep.head == ep.queue.size()) live_.erase(live_.begin() + static_cast<ptrdiff_t>(i));
    ep.bytes_in_flight += c.bytes;
    ++ep.ops_in_flight;
    bytes_in_flight_ += c.bytes;
    ++ops_in_flight_;
    --pending_chunks_;
    --runs_[c.run].pending;
    ++runs_[c.run].in_flight;
    cursor_ = (e + 1) % n;
    return c;
  }
  min_head_ = smallest;  // every endpoint was tried: exact
  return std::nullopt;
}

bool ChunkScheduler::complete(const Chunk& c) {
  EndpointState& ep = eps_[c.endpoint];
  ep.bytes_in_flight -= c.bytes;
  --ep.ops_in_flight;
  bytes_in_flight_ -= c.bytes;
  --ops_in_flight_;
  --runs_[c.run].in_flight;
  return run_finished(c.run);
}

void ChunkScheduler::requeue(const Chunk& c) {
  (void)complete(c);
  EndpointState& ep = eps_[c.endpoint];
  // The entries before head are spent: the one before it takes the chunk.
  // head > 0, since the chunk was issued from this queue.
  if (ep.head == ep.queue.size()) live_.insert(std::lower_bound(live_.begin(), live_.end(), c.endpoint), c.endpoint);
  ep.queue[--ep.head] = c;
  min_head_ = std::min(min_head_, c.bytes);
  ++runs_[c.run].pending;
  ++pending_chunks_;
}

std::vector<uint32_t> ChunkScheduler::drop_endpoint(uint32_t endpoint) {
  std::vector<uint32_t> finished;
  EndpointState& ep = eps_[endpoint];
  if (ep.head < ep.queue.size()) live_.erase(std::lower_bound(live_.begin(), live_.end(), endpoint));
  for (size_t i = ep.head; i < ep.queue.size(); ++i) {
    RunState& r = runs_[ep.queue[i].run];
    --r.pending;
    --pending_chunks_;
    if (r.pending == 0 && r.in_flight == 0) finished.push_back(ep.queue[i].run);
  }
  ep.head = ep.queue.size();
  return finished;
}

}  // namespace refit::ucx
