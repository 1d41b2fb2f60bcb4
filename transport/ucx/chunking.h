#pragma once
// Splitting runs into chunks and keeping a bounded window of bytes and of
// operations in flight, per endpoint and in total. Pure C++ with no UCX, so
// that it is tested on its own; the GetEngine drives it.
//
// Not thread-safe: one owner (the GetEngine, under its mutex).

#include <array>
#include <cstdint>
#include <functional>
#include <new>
#include <optional>
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

// Where the receiver of rank `rank` starts among its `endpoints` sources
// (ChunkScheduler::create's `first`): the rank's place in the Weyl sequence
// of the golden ratio (rank times 0.618..., modulo 1), scaled to the
// endpoints; 0 for rank 0 or no endpoints. Receivers number their sources
// in the order their plan names them, and so alike: started at endpoint 0,
// every receiver would ask the same few sources first while the others,
// the last pipeline stage's among them, waited (docs/refresh.md, "One
// refresh", step 2). Consecutive ranks land far apart, and any k
// consecutive ranks spread evenly over the endpoints.
uint32_t first_endpoint(uint64_t rank, uint32_t endpoints);

class ChunkScheduler {
 public:
  // Fails on invalid limits, a zero-length run, an endpoint index out of
  // range or `first` not below num_endpoints (while there are any);
  // messages name the run or the value. Before any endpoint has issued,
  // endpoint `first` goes first and the others follow in index order,
  // wrapping round (first_endpoint above).
  static Result<ChunkScheduler> create(const WindowLimits& limits, std::span<const ChunkRun> runs,
                                       uint32_t num_endpoints, uint32_t first = 0);

  // May a chunk of this run be issued now? (A run that needs local memory
  // still in use, e.g. a free slot of a landing ring.) Runs of one endpoint
  // are issued in order, so an endpoint whose next run is held waits as a
  // whole; a gate must therefore only hold a run for what runs already
  // issued will release, or nothing behind it could ever go.
  using Gate = std::function<bool(uint32_t run)>;

  // The next chunk that fits the window (and that `gate`, if any, lets go),
  // reserving its bytes and op. Of the endpoints whose next chunk fits, the
  // one furthest behind goes: the smallest share of its bytes issued (to
  // 2^-64, see Node below), ties to the one least recently issued (so equal
  // ones take turns), then to the never-issued one that comes first
  // counting from `first` (create). So a receiver pulls from each source
  // in proportion to what it needs from it, and all its sources finish
  // together: with equal turns, a source it needs more from would be left
  // alone at the end, its NIC the only one busy (docs/refresh.md, "One
  // refresh", step 2). A slow peer takes no more than its share either.
  // nullopt when nothing pending fits now (or nothing is pending).
  std::optional<Chunk> next(const Gate& gate = {});

  // Releases the window share of an issued chunk. Returns true when this was
  // the last outstanding piece of its run (nothing pending, nothing in flight).
  bool complete(const Chunk& chunk);

  // Takes an issued chunk back: its window share is released and it is the
  // next chunk of its endpoint again (a peer that was busy and will be
  // asked again).
  void requeue(const Chunk& chunk);

  // While `held`, next() issues nothing of `endpoint`.
  void hold(uint32_t endpoint, bool held);

  // Drops every chunk of `endpoint` not yet issued. Returns the runs that
  // thereby became finished (no chunk of them still in flight).
  std::vector<uint32_t> drop_endpoint(uint32_t endpoint);

  // Hints for a caller that drives many schedulers in turn (the
  // simulator: thousands of receivers, whose state no cache holds from one
  // of a receiver's calls to its next). They read nothing they do not
  // need and change nothing; each starts loading the memory that a later
  // call reads, so that several schedulers' memory loads at once.
  // prefetch_complete: what complete(chunk) reads, and the trees' roots
  // (what next() reads first).
  void prefetch_complete(const Chunk& chunk) const;
  // What next() reads to issue the chunk it most likely issues: the state
  // of the first endpoint of each tree (below) and its leaf's paths to the
  // roots. Returns those endpoints (UINT32_MAX for an empty tree), so that
  // the caller can load its own memory for them. It reads the roots: call
  // it after prefetch_complete has had time to load them.
  std::array<uint32_t, 2> prefetch_next() const;
  // REQUIRES endpoint < the number of endpoints. The next chunk
  // `endpoint` issues (bytes 0: none pending). What the caller reads of it
  // should come after prefetch_next has loaded it.
  const Chunk& head(uint32_t endpoint) const { return eps_[endpoint].head; }

  bool done() const { return pending_chunks_ == 0 && ops_in_flight_ == 0; }
  bool run_finished(uint32_t run) const { return outstanding_[run] == 0; }
  uint64_t bytes_in_flight() const { return bytes_in_flight_; }
  uint64_t ops_in_flight() const { return ops_in_flight_; }
  uint64_t bytes_in_flight(uint32_t endpoint) const { return eps_[endpoint].bytes_in_flight; }
  uint64_t ops_in_flight(uint32_t endpoint) const { return eps_[endpoint].ops_in_flight; }
  uint64_t pending_chunks() const { return pending_chunks_; }

 private:
  // A run as its endpoint cuts it. Its endpoint's runs lie in one array,
  // in order, so cutting the next run reads memory next to the last.
  struct EndpointRun {
    uint64_t bytes = 0;
    uint32_t run = 0;
    bool gather = false;
  };
  // An endpoint's pending chunks are cut from its runs as they are issued
  // (a plan of tens of millions of chunks is not held as a list). In
  // order: `head`, the chunks in `waiting` (back() first), then the rest of
  // runs[next_run] from next_offset and the runs after it.
  struct EndpointState {
    Chunk head;                    // bytes 0: nothing pending
    std::vector<Chunk> waiting;    // taken back (requeue) behind a newer head
    std::vector<EndpointRun> runs;  // its runs, in issue order
    size_t next_run = 0;
    uint64_t next_offset = 0;      // into runs[next_run]
    // runs[next_run], its bytes and chunk size, while next_offset > 0
    // (read when its first chunk is cut).
    uint32_t cur_run = 0;
    uint64_t cur_bytes = 0;
    uint64_t cur_cut = 0;
    uint64_t bytes_in_flight = 0;
    uint64_t ops_in_flight = 0;
    uint64_t total_bytes = 0;    // of all its chunks
    uint64_t pending_bytes = 0;  // of the chunks not yet issued
    // Its place among issues, unique: before its first issue, its distance
    // from `first` in index order, wrapping round (never-issued endpoints go
    // first, from there), then the scheduler's count of issues when it last
    // issued, which starts at the number of endpoints.
    uint64_t last_issued = 0;
    uint64_t share = 0;  // share_of() its bytes issued, set when they change
    bool held = false;
    uint8_t tree = kNoTree;  // the tree whose leaf holds it (tree_of), or none
  };
  // Cuts the next chunk of `ep`'s runs (bytes 0 when they are all cut).
  Chunk cut(EndpointState& ep, uint32_t endpoint);
  uint64_t cut_of(const EndpointRun& r) const {
    return r.gather && limits_.gather_chunk_bytes > 0 ? limits_.gather_chunk_bytes : limits_.chunk_bytes;
  }
  void advance(EndpointState& ep, uint32_t endpoint);  // the next pending chunk becomes the head
  // The share of its bytes `ep` has issued, as a fraction of 2^64 rounded
  // down (issued < total while it has a chunk pending, so it fits).
  static uint64_t share_of(const EndpointState& ep);
  // Which endpoint goes next is found in a tournament tree over the
  // endpoints (heap-ordered: node i has children 2i and 2i+1, endpoint e is
  // leaf leaves_ + e). A leaf holds its endpoint while that has a chunk
  // pending that its own window takes and is not held; each node keeps the
  // first of its leaves in the order of issue and the smallest head chunk
  // among them. The first endpoint whose head fits the window in total is
  // then found by pruning every subtree whose smallest head does not fit
  // or whose first comes after the best found so far. (Walking the order
  // instead passed over every endpoint whose head did not fit: 12 a chunk
  // on average for a Kimi-K2 receiver with 256 sources, simulated.)
  static constexpr uint32_t kNone = UINT32_MAX;
  // A node holds its first's key and head itself, so that walking the tree
  // reads nothing else, and is 32 bytes in storage aligned to 64, so that
  // a node's sibling, which every step up or down reads too, lies in the
  // same cache line. (A 16-byte node beside a key array read another line
  // a level for the key; a 48-byte node that kept the exact key was slower
  // than that: docs/simulator.md.)
  //
  // The key is (share, tie), compared as two integers. `share` is share_of()
  // the endpoint; `tie` is its last_issued, unique, so no two keys are
  // equal. The order is the exact one (shares as fractions, then least
  // recently issued, then never issued counting from `first`) except where
  // two shares differ by less than 2^-64, which rounding down may make
  // equal: those go by `tie`. Two unequal shares differ by at least 1 /
  // (the product of the two endpoints' totals), so that happens only where
  // that product exceeds 2^64 (both totals above 4 GiB, say).
  static constexpr uint32_t kWideHead = UINT32_MAX;
  struct Node {
    uint64_t share = UINT64_MAX;     // UINT64_MAX: no leaf (an endpoint's share is below it)
    uint64_t tie = UINT64_MAX;
    uint64_t min_head = UINT64_MAX;  // the smallest head among its leaves (UINT64_MAX: none)
    uint32_t win = kNone;            // the first of its leaves, or kNone
    // The first's head, or kWideHead when it is that or more (a chunk of
    // 4 GiB - 1 bytes or more: its leaf's min_head is read instead).
    uint32_t win_head = kWideHead;
    bool operator==(const Node&) const = default;
  };
  static_assert(sizeof(Node) == 32, "two nodes a cache line");
  // Whether key a comes before key b.
  static bool before(const Node& a, const Node& b) {
    return a.share != b.share ? a.share < b.share : a.tie < b.tie;
  }
  // Whether `ep`'s leaf holds it (update() keeps the leaves so): it has a
  // chunk pending that its own window takes and is not held.
  bool in_tree(const EndpointState& ep) const {
    return ep.head.bytes > 0 && !ep.held && ep.ops_in_flight < limits_.max_ops_per_endpoint &&
           ep.bytes_in_flight + ep.head.bytes <= limits_.max_bytes_per_endpoint;
  }
  // Endpoint e's leaf as its state stands.
  Node leaf_of(uint32_t e) const;
  // Two trees of the same shape: kWhole holds the endpoints whose head is a
  // whole chunk (chunk_bytes or more), kPart those whose head is less (a
  // run's last chunk, a small run, a gather's chunk). When the window has
  // less than a chunk free, only kPart can have one that fits, and its
  // nodes' firsts are among those alone: a single tree's firsts were mostly
  // whole chunks that did not fit, which pruned nothing (a simulated
  // DeepSeek-V3 receiver with 2048 sources read 97 nodes a chunk).
  static constexpr uint8_t kWhole = 0, kPart = 1, kTrees = 2, kNoTree = 255;
  uint8_t tree_of(const Node& leaf) const { return leaf.min_head >= limits_.chunk_bytes ? kWhole : kPart; }
  Node& node(uint8_t k, uint32_t i) { return tree_[static_cast<size_t>(k) * 2 * leaves_ + i]; }
  const Node& node(uint8_t k, uint32_t i) const { return tree_[static_cast<size_t>(k) * 2 * leaves_ + i]; }
  // Node i of tree k from its children.
  void combine(uint8_t k, uint32_t i);
  // Sets endpoint `e`'s leaf in tree k, and the nodes above it.
  void set_leaf(uint8_t k, uint32_t e, const Node& leaf);
  // Recomputes endpoint `e`'s leaf, in the tree its head now belongs to,
  // and the nodes above it; `share_changed`: its bytes issued changed, so
  // its share is computed anew.
  void update(uint32_t e, bool share_changed);
  // Tree k's first endpoint whose head chunk is at most `free` bytes, if it
  // comes before `best` (null: none yet); into `best`.
  void search(uint8_t k, uint64_t free, const Node*& best) const;
  // The first endpoint in the order of issue whose head chunk is at most
  // `free` bytes (the trees' leaves as they stand), or kNone.
  uint32_t first_fitting(uint64_t free) const;
  Chunk issue(uint32_t endpoint);

  // Allocates the tree's nodes on a cache line (a vector of Node would align
  // them to 8 bytes only).
  template <class T>
  struct LineAligned {
    using value_type = T;
    static constexpr std::align_val_t kAlign{64};
    LineAligned() = default;
    template <class U>
    LineAligned(const LineAligned<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
    void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
    bool operator==(const LineAligned&) const = default;
  };

  WindowLimits limits_;
  // Per run: its chunks not completed, pending or in flight (issuing a
  // chunk reads nothing per run; completing one reads these 4 bytes).
  std::vector<uint32_t> outstanding_;
  std::vector<EndpointState> eps_;
  uint32_t leaves_ = 1;     // a power of two, at least the endpoints
  std::vector<Node, LineAligned<Node>> tree_;  // the kTrees trees, 2 * leaves_ nodes each (node 0 unused)
  uint64_t issues_ = 0;  // chunks issued so far, plus the number of endpoints
  uint64_t pending_chunks_ = 0;
  uint64_t bytes_in_flight_ = 0;
  uint64_t ops_in_flight_ = 0;
};

}  // namespace refit::ucx
