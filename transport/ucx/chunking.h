#pragma once
// Splitting runs into chunks and keeping a bounded window of bytes and of
// operations in flight, per endpoint and in total. Pure C++ with no UCX, so
// that it is tested on its own; the GetEngine drives it.
//
// Not thread-safe: one owner (the GetEngine, under its mutex).

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <vector>

#include "planner/status.h"

namespace refit::ucx {

struct WindowLimits {
  uint64_t chunk_bytes = 1 << 20;                // largest single GET
  // Largest single request of a gather run (ChunkRun::gather); 0: chunk_bytes.
  // A gather is one request to its peer, which copies its ranges into its
  // replies, so it may be larger than a plain GET (docs/refresh.md,
  // "Gathers").
  uint64_t gather_chunk_bytes = 0;
  uint64_t max_bytes_in_flight = 16ull << 20;    // all endpoints together
  uint64_t max_ops_in_flight = 256;              // all endpoints together
  uint64_t max_bytes_per_endpoint = 8ull << 20;  // one endpoint
  uint64_t max_ops_per_endpoint = 64;            // one endpoint
};

// Checks that every limit is positive and that one chunk, plain or of a
// gather, fits every byte window (otherwise nothing could ever be issued).
// The message names the setting.
Status validate(const WindowLimits& limits);

// What the scheduler needs to know about a run.
struct ChunkRun {
  uint32_t endpoint = 0;  // dense index < num_endpoints
  uint64_t bytes = 0;     // > 0
  bool gather = false;    // cut at WindowLimits::gather_chunk_bytes
};

struct Chunk {
  uint32_t run = 0;
  uint32_t endpoint = 0;
  uint64_t offset = 0;  // from the start of the run
  uint64_t bytes = 0;
};

// The chunks of one run: consecutive pieces of at most chunk_bytes, covering
// [0, bytes) exactly once, in order.
std::vector<Chunk> split_run(uint32_t run, const ChunkRun& r, uint64_t chunk_bytes);

class ChunkScheduler {
 public:
  // Fails on invalid limits, a zero-length run or an endpoint index out of
  // range; messages name the run.
  static Result<ChunkScheduler> create(const WindowLimits& limits, std::span<const ChunkRun> runs,
                                       uint32_t num_endpoints);

  // May a chunk of this run be issued now? (A run that needs local memory
  // still in use, e.g. a free slot of a landing ring.) Runs of one endpoint
  // are issued in order, so an endpoint whose next run is held waits as a
  // whole; a gate must therefore only hold a run for what runs already
  // issued will release, or nothing behind it could ever go.
  using Gate = std::function<bool(uint32_t run)>;

  // The next chunk that fits the window (and that `gate`, if any, lets go),
  // reserving its bytes and op. Of the endpoints whose next chunk fits, the
  // one furthest behind goes: the smallest share of its bytes issued, ties
  // to the one least recently issued (so equal ones take turns). So a
  // receiver pulls from each source in proportion to what it needs from it,
  // and all its sources finish together: with equal turns, a source it
  // needs more from would be left alone at the end, its NIC the only one
  // busy (docs/refresh.md, "One refresh", step 2). A slow peer takes no
  // more than its share either. nullopt when nothing pending fits now (or
  // nothing is pending).
  std::optional<Chunk> next(const Gate& gate = {});

  // Releases the window share of an issued chunk. Returns true when this was
  // the last outstanding piece of its run (nothing pending, nothing in flight).
  bool complete(const Chunk& chunk);

  // Takes an issued chunk back: its window share is released and it is the
  // next chunk of its endpoint again (a peer that was busy and will be
  // asked again).
  void requeue(const Chunk& chunk);

  // While `held`, next() issues nothing of `endpoint`.
  void hold(uint32_t endpoint, bool held) { eps_[endpoint].held = held; }

  // Drops every chunk of `endpoint` not yet issued. Returns the runs that
  // thereby became finished (no chunk of them still in flight).
  std::vector<uint32_t> drop_endpoint(uint32_t endpoint);

  bool done() const { return pending_chunks_ == 0 && ops_in_flight_ == 0; }
  bool run_finished(uint32_t run) const {
    return runs_[run].pending == 0 && runs_[run].in_flight == 0;
  }
  uint64_t bytes_in_flight() const { return bytes_in_flight_; }
  uint64_t ops_in_flight() const { return ops_in_flight_; }
  uint64_t bytes_in_flight(uint32_t endpoint) const { return eps_[endpoint].bytes_in_flight; }
  uint64_t ops_in_flight(uint32_t endpoint) const { return eps_[endpoint].ops_in_flight; }
  uint64_t pending_chunks() const { return pending_chunks_; }

 private:
  struct RunState {
    uint32_t pending = 0;    // chunks not yet issued
    uint32_t in_flight = 0;  // chunks issued, not completed
  };
  struct EndpointState {
    std::vector<Chunk> queue;  // pending chunks in issue order
    size_t head = 0;           // queue[head..] are pending
    uint64_t bytes_in_flight = 0;
    uint64_t ops_in_flight = 0;
    uint64_t total_bytes = 0;    // of all its chunks
    uint64_t pending_bytes = 0;  // of queue[head..]
    uint64_t last_issued = 0;    // the scheduler's count of issues when it last issued (0: never)
    bool held = false;
  };
  bool fits(const EndpointState& ep, const Chunk& c) const;
  void advance(EndpointState& ep);  // issues the head chunk of `ep`'s queue
  // An endpoint with chunks pending, as live_ orders it: furthest behind
  // first (the smallest share of its bytes issued), then the least recently
  // issued, then the lowest index.
  struct Live {
    uint64_t issued_bytes = 0;
    uint64_t total_bytes = 0;
    uint64_t last_issued = 0;
    uint32_t endpoint = 0;
    bool operator<(const Live& o) const;
  };
  Live live_key(uint32_t endpoint) const;
  // Issues the head chunk of the endpoint `at` names in live_.
  Chunk issue(std::set<Live>::iterator at);
  void add_head(uint64_t bytes) { ++heads_[bytes]; }
  void remove_head(uint64_t bytes);

  WindowLimits limits_;
  std::vector<RunState> runs_;
  std::vector<EndpointState> eps_;
  uint64_t issued_ = 0;  // chunks issued so far
  // The bytes of every endpoint's next pending chunk, with how many have
  // that size (most are chunk_bytes): when even the smallest does not fit
  // the window in total, next() tries no endpoint.
  std::map<uint64_t, uint32_t> heads_;
  // The endpoints with chunks pending. An endpoint issued moves within it
  // as its node (extract and insert), so that issuing allocates nothing.
  std::set<Live> live_;
  uint64_t pending_chunks_ = 0;
  uint64_t bytes_in_flight_ = 0;
  uint64_t ops_in_flight_ = 0;
};

}  // namespace refit::ucx
