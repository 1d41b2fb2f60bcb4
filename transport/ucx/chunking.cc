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
    s.eps_[r.endpoint].total_bytes += r.bytes;
    s.eps_[r.endpoint].pending_bytes += r.bytes;
  }
  for (uint32_t e = 0; e < num_endpoints; ++e) {
    const EndpointState& ep = s.eps_[e];
    if (ep.queue.empty()) continue;
    s.add_head(ep.queue.front().bytes);
    s.live_.insert(s.live_key(e));
  }
  return s;
}

bool ChunkScheduler::fits(const EndpointState& ep, const Chunk& c) const {
  return ops_in_flight_ < limits_.max_ops_in_flight &&
         ep.ops_in_flight < limits_.max_ops_per_endpoint &&
         bytes_in_flight_ + c.bytes <= limits_.max_bytes_in_flight &&
         ep.bytes_in_flight + c.bytes <= limits_.max_bytes_per_endpoint;
}

void ChunkScheduler::remove_head(uint64_t bytes) {
  auto it = heads_.find(bytes);
  if (--it->second == 0) heads_.erase(it);
}

void ChunkScheduler::advance(EndpointState& ep) {
  const uint64_t bytes = ep.queue[ep.head].bytes;
  ep.pending_bytes -= bytes;
  ++ep.head;
  const uint64_t next = ep.head < ep.queue.size() ? ep.queue[ep.head].bytes : 0;
  if (next == bytes) return;  // the same size heads this endpoint again
  remove_head(bytes);
  if (next > 0) add_head(next);
}

bool ChunkScheduler::Live::operator<(const Live& o) const {
  const auto mine = static_cast<unsigned __int128>(issued_bytes) * o.total_bytes;
  const auto theirs = static_cast<unsigned __int128>(o.issued_bytes) * total_bytes;
  if (mine != theirs) return mine < theirs;
  if (last_issued != o.last_issued) return last_issued < o.last_issued;
  return endpoint < o.endpoint;
}

ChunkScheduler::Live ChunkScheduler::live_key(uint32_t e) const {
  const EndpointState& ep = eps_[e];
  return Live{ep.total_bytes - ep.pending_bytes, ep.total_bytes, ep.last_issued, e};
}

std::optional<Chunk> ChunkScheduler::next(const Gate& gate) {
  // Not even the smallest next chunk fits the window in total: no endpoint
  // need be tried (a receiver with hundreds of sources asks after every
  // completion). bytes_in_flight_ never exceeds the limit.
  if (pending_chunks_ == 0 || ops_in_flight_ >= limits_.max_ops_in_flight ||
      heads_.begin()->first > limits_.max_bytes_in_flight - bytes_in_flight_)
    return std::nullopt;
  // Furthest behind first (chunking.h); the first whose next chunk fits and
  // that the gate lets go (asked before a run's first chunk only).
  for (auto it = live_.begin(); it != live_.end(); ++it) {
    const EndpointState& ep = eps_[it->endpoint];
    const Chunk& c = ep.queue[ep.head];
    if (ep.held || !fits(ep, c)) continue;
    if (gate && c.offset == 0 && !gate(c.run)) continue;
    return issue(it);
  }
  return std::nullopt;
}

Chunk ChunkScheduler::issue(std::set<Live>::iterator at) {
  const uint32_t e = at->endpoint;
  EndpointState& ep = eps_[e];
  const Chunk c = ep.queue[ep.head];
  auto node = live_.extract(at);
  advance(ep);
  ep.last_issued = ++issued_;
  if (ep.head < ep.queue.size()) {
    node.value() = live_key(e);
    live_.insert(std::move(node));
  }
  ep.bytes_in_flight += c.bytes;
  ++ep.ops_in_flight;
  bytes_in_flight_ += c.bytes;
  ++ops_in_flight_;
  --pending_chunks_;
  --runs_[c.run].pending;
  ++runs_[c.run].in_flight;
  return c;
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
  if (ep.head < ep.queue.size()) {
    live_.erase(live_key(c.endpoint));
    remove_head(ep.queue[ep.head].bytes);
  }
  ep.queue[--ep.head] = c;
  ep.pending_bytes += c.bytes;
  live_.insert(live_key(c.endpoint));
  add_head(c.bytes);
  ++runs_[c.run].pending;
  ++pending_chunks_;
}

std::vector<uint32_t> ChunkScheduler::drop_endpoint(uint32_t endpoint) {
  std::vector<uint32_t> finished;
  EndpointState& ep = eps_[endpoint];
  if (ep.head < ep.queue.size()) {
    live_.erase(live_key(endpoint));
    remove_head(ep.queue[ep.head].bytes);
  }
  for (size_t i = ep.head; i < ep.queue.size(); ++i) {
    RunState& r = runs_[ep.queue[i].run];
    --r.pending;
    --pending_chunks_;
    if (r.pending == 0 && r.in_flight == 0) finished.push_back(ep.queue[i].run);
  }
  ep.head = ep.queue.size();
  ep.pending_bytes = 0;
  return finished;
}

}  // namespace refit::ucx
