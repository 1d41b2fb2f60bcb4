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

uint32_t first_endpoint(uint64_t rank, uint32_t endpoints) {
  // 2^64 / the golden ratio: rank times it, modulo 2^64, is the fractional
  // part of rank / the golden ratio to 2^-64; its top 32 bits times the
  // endpoints, over 2^32, is below the endpoints.
  const uint64_t frac = rank * 0x9E3779B97F4A7C15ULL;
  return static_cast<uint32_t>(((frac >> 32) * endpoints) >> 32);
}

Result<ChunkScheduler> ChunkScheduler::create(const WindowLimits& limits,
                                              std::span<const ChunkRun> runs,
                                              uint32_t num_endpoints, uint32_t first) {
  REFIT_RETURN_IF_ERROR(validate(limits));
  if (num_endpoints > 0 && first >= num_endpoints) {
    return Status::invalid("first endpoint " + std::to_string(first) + " out of range (" +
                           std::to_string(num_endpoints) + " endpoints)");
  }
  ChunkScheduler s;
  s.limits_ = limits;
  s.outstanding_.resize(runs.size());
  s.eps_.resize(num_endpoints);
  // Each endpoint's runs in an array of their number (a receiver of the
  // simulator has thousands of runs an endpoint: no array grows by copies).
  {
    std::vector<uint32_t> per(num_endpoints, 0);
    for (const ChunkRun& r : runs)
      if (r.endpoint < num_endpoints) ++per[r.endpoint];
    for (uint32_t e = 0; e < num_endpoints; ++e) s.eps_[e].runs.reserve(per[e]);
  }
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
    const uint64_t cut = s.cut_of(EndpointRun{r.bytes, i, r.gather});
    const uint64_t chunks = (r.bytes + cut - 1) / cut;
    if (chunks > UINT32_MAX) {
      return Status::invalid("run " + std::to_string(i) + ": " + std::to_string(r.bytes) + " bytes make " +
                             std::to_string(chunks) + " chunks of " + std::to_string(cut) +
                             " bytes, more than a run may have (2^32 - 1); raise chunk_bytes");
    }
    s.outstanding_[i] = static_cast<uint32_t>(chunks);
    s.pending_chunks_ += chunks;
    EndpointState& ep = s.eps_[r.endpoint];
    ep.runs.push_back(EndpointRun{r.bytes, i, r.gather});
    ep.total_bytes += r.bytes;
    ep.pending_bytes += r.bytes;
  }
  while (s.leaves_ < num_endpoints) s.leaves_ *= 2;
  s.tree_.assign(kTrees * 2 * static_cast<size_t>(s.leaves_), Node{});
  s.issues_ = num_endpoints;
  for (uint32_t e = 0; e < num_endpoints; ++e) {
    EndpointState& ep = s.eps_[e];
    ep.head = s.cut(ep, e);
    ep.last_issued = e >= first ? e - first : e + (num_endpoints - first);
    const Node leaf = s.leaf_of(e);
    if (leaf.win == kNone) continue;
    ep.tree = s.tree_of(leaf);
    s.node(ep.tree, s.leaves_ + e) = leaf;
  }
  for (uint8_t k = 0; k < kTrees; ++k)
    for (uint32_t i = s.leaves_ - 1; i >= 1; --i) s.combine(k, i);
  return s;
}

Chunk ChunkScheduler::cut(EndpointState& ep, uint32_t e) {
  if (ep.next_run == ep.runs.size()) return Chunk{0, e, 0, 0};
  if (ep.next_offset == 0) {
    const EndpointRun& r = ep.runs[ep.next_run];
    ep.cur_run = r.run;
    ep.cur_bytes = r.bytes;
    ep.cur_cut = cut_of(r);
  }
  const Chunk c{ep.cur_run, e, ep.next_offset, std::min(ep.cur_cut, ep.cur_bytes - ep.next_offset)};
  ep.next_offset += c.bytes;
  if (ep.next_offset == ep.cur_bytes) {
    ++ep.next_run;
    ep.next_offset = 0;
  }
  return c;
}

void ChunkScheduler::advance(EndpointState& ep, uint32_t e) {
  ep.pending_bytes -= ep.head.bytes;
  if (ep.waiting.empty()) {
    ep.head = cut(ep, e);
    return;
  }
  ep.head = ep.waiting.back();
  ep.waiting.pop_back();
}

uint64_t ChunkScheduler::share_of(const EndpointState& ep) {
  const uint64_t issued = ep.total_bytes - ep.pending_bytes;
  // Nothing pending (or nothing at all): not in the tree, never compared.
  if (issued >= ep.total_bytes) return UINT64_MAX;
  return static_cast<uint64_t>((static_cast<unsigned __int128>(issued) << 64) / ep.total_bytes);
}

void ChunkScheduler::combine(uint8_t k, uint32_t i) {
  const Node& a = node(k, 2 * i);
  const Node& b = node(k, 2 * i + 1);
  // An empty node's key comes after every endpoint's.
  const Node& w = before(b, a) ? b : a;
  node(k, i) = Node{w.share, w.tie, std::min(a.min_head, b.min_head), w.win, w.win_head};
}

ChunkScheduler::Node ChunkScheduler::leaf_of(uint32_t e) const {
  const EndpointState& ep = eps_[e];
  if (!in_tree(ep)) return Node{};
  const uint64_t h = ep.head.bytes;
  return Node{ep.share, ep.last_issued, h, e, static_cast<uint32_t>(std::min<uint64_t>(h, kWideHead))};
}

void ChunkScheduler::set_leaf(uint8_t k, uint32_t e, const Node& leaf) {
  uint32_t i = leaves_ + e;
  if (node(k, i) == leaf) return;
  node(k, i) = leaf;
  // A node is its children's: once one is unchanged, so is everything above.
  for (i /= 2; i >= 1; i /= 2) {
    const Node was = node(k, i);
    combine(k, i);
    if (node(k, i) == was) return;
  }
}

void ChunkScheduler::update(uint32_t e, bool share_changed) {
  EndpointState& ep = eps_[e];
  if (share_changed) ep.share = share_of(ep);
  const Node leaf = leaf_of(e);
  const uint8_t k = leaf.win == kNone ? kNoTree : tree_of(leaf);
  if (ep.tree != k && ep.tree != kNoTree) set_leaf(ep.tree, e, Node{});
  ep.tree = k;
  if (k != kNoTree) set_leaf(k, e, leaf);
}

void ChunkScheduler::search(uint8_t k, uint64_t free, const Node*& best) const {
  uint32_t stack[64];
  size_t n = 0;
  stack[n++] = 1;
  while (n > 0) {
    const uint32_t i = stack[--n];
    const Node& x = node(k, i);
    if (x.win == kNone || x.min_head > free) continue;
    if (best != nullptr && !before(x, *best)) continue;  // nothing here comes first
    const uint64_t head = x.win_head != kWideHead ? x.win_head : node(k, leaves_ + x.win).min_head;
    if (head <= free) {
      best = &x;  // the subtree's first fits: nothing else in it comes before
      continue;
    }
    if (i >= leaves_) continue;
    stack[n++] = 2 * i + 1;
    stack[n++] = 2 * i;
  }
}

uint32_t ChunkScheduler::first_fitting(uint64_t free) const {
  // Whole chunks first: where one fits, its tree's first usually does, and
  // prunes most of the other tree at its root.
  const Node* best = nullptr;
  search(kWhole, free, best);
  search(kPart, free, best);
  return best != nullptr ? best->win : kNone;
}

namespace {
// Starts loading the cache lines of [p, p + bytes).
void prefetch_lines(const void* p, size_t bytes) {
  const auto* c = static_cast<const char*>(p);
  const auto first = reinterpret_cast<uintptr_t>(c) & ~uintptr_t{63};
  for (uintptr_t a = first; a < reinterpret_cast<uintptr_t>(c) + bytes; a += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(a));
}
}  // namespace

void ChunkScheduler::prefetch_complete(const Chunk& chunk) const {
  if (tree_.empty()) return;  // not made by create()
  if (chunk.endpoint < eps_.size()) prefetch_lines(&eps_[chunk.endpoint], sizeof(EndpointState));
  if (chunk.run < outstanding_.size()) __builtin_prefetch(&outstanding_[chunk.run]);
  __builtin_prefetch(&node(kWhole, 1));
  __builtin_prefetch(&node(kPart, 1));
}

std::array<uint32_t, 2> ChunkScheduler::prefetch_next() const {
  // Each tree's first: next() issues one of them where its chunk fits,
  // and moves it to the tree its next chunk belongs to (the same leaf's
  // path in either tree).
  std::array<uint32_t, 2> firsts{kNone, kNone};
  if (tree_.empty()) return firsts;  // not made by create()
  for (uint8_t k = 0; k < kTrees; ++k) {
    const uint32_t e = node(k, 1).win;
    firsts[k] = e;
    if (e == kNone) continue;
    prefetch_lines(&eps_[e], sizeof(EndpointState));
    // Two nodes a line: the leaf's line holds its sibling too.
    for (uint32_t i = leaves_ + e; i >= 1; i /= 2) {
      __builtin_prefetch(&node(kWhole, i));
      __builtin_prefetch(&node(kPart, i));
    }
  }
  return firsts;
}

std::optional<Chunk> ChunkScheduler::next(const Gate& gate) {
  // Nothing fits: no endpoint need be tried (a receiver with hundreds of
  // sources asks after every completion). bytes_in_flight_ never exceeds
  // the limit.
  if (pending_chunks_ == 0 || ops_in_flight_ >= limits_.max_ops_in_flight) return std::nullopt;
  const uint64_t free = limits_.max_bytes_in_flight - bytes_in_flight_;
  if (std::min(node(kWhole, 1).min_head, node(kPart, 1).min_head) > free) return std::nullopt;
  // Furthest behind first (chunking.h); the first whose next chunk fits and
  // that the gate lets go (asked before a run's first chunk only). An
  // endpoint the gate holds leaves the tree until this call returns.
  std::vector<uint32_t> gated;
  uint32_t e = kNone;
  while ((e = first_fitting(free)) != kNone) {
    const Chunk& c = eps_[e].head;
    if (!gate || c.offset != 0 || gate(c.run)) break;
    gated.push_back(e);
    if (eps_[e].tree != kNoTree) set_leaf(eps_[e].tree, e, Node{});  // the gate may have held it meanwhile
  }
  for (uint32_t g : gated) update(g, false);
  if (e == kNone) return std::nullopt;
  return issue(e);
}

Chunk ChunkScheduler::issue(uint32_t e) {
  EndpointState& ep = eps_[e];
  const Chunk c = ep.head;
  advance(ep, e);
  ep.last_issued = issues_++;
  ep.bytes_in_flight += c.bytes;
  ++ep.ops_in_flight;
  bytes_in_flight_ += c.bytes;
  ++ops_in_flight_;
  --pending_chunks_;
  update(e, true);
  return c;
}

bool ChunkScheduler::complete(const Chunk& c) {
  EndpointState& ep = eps_[c.endpoint];
  // An endpoint in the tree stays there: its window only grows. (Asked of
  // its state, which is read anyway, rather than of its leaf.)
  const bool stays = in_tree(ep);
  ep.bytes_in_flight -= c.bytes;
  --ep.ops_in_flight;
  bytes_in_flight_ -= c.bytes;
  --ops_in_flight_;
  --outstanding_[c.run];
  if (!stays) update(c.endpoint, false);
  return run_finished(c.run);
}

void ChunkScheduler::requeue(const Chunk& c) {
  (void)complete(c);
  EndpointState& ep = eps_[c.endpoint];
  if (ep.head.bytes > 0) ep.waiting.push_back(ep.head);
  ep.head = c;
  ep.pending_bytes += c.bytes;
  ++outstanding_[c.run];
  ++pending_chunks_;
  update(c.endpoint, true);
}

void ChunkScheduler::hold(uint32_t endpoint, bool held) {
  eps_[endpoint].held = held;
  update(endpoint, false);
}

std::vector<uint32_t> ChunkScheduler::drop_endpoint(uint32_t endpoint) {
  std::vector<uint32_t> finished;
  EndpointState& ep = eps_[endpoint];
  auto drop = [&](uint32_t run, uint64_t chunks) {
    uint32_t& n = outstanding_[run];
    n -= static_cast<uint32_t>(chunks);
    pending_chunks_ -= chunks;
    if (n == 0) finished.push_back(run);
  };
  if (ep.head.bytes > 0) drop(ep.head.run, 1);
  ep.head.bytes = 0;
  for (auto it = ep.waiting.rbegin(); it != ep.waiting.rend(); ++it) drop(it->run, 1);
  ep.waiting.clear();
  for (; ep.next_run < ep.runs.size(); ++ep.next_run) {
    const EndpointRun& r = ep.runs[ep.next_run];
    const uint64_t cut = cut_of(r);
    drop(r.run, (r.bytes - ep.next_offset + cut - 1) / cut);
    ep.next_offset = 0;
  }
  ep.pending_bytes = 0;
  update(endpoint, true);
  return finished;
}

}  // namespace refit::ucx
