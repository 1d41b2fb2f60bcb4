// Chunking and windowing with no UCX: split_run covers each run exactly once,
// and the scheduler never exceeds any window while issuing every chunk once;
// a gate holds runs back.

#include "transport/ucx/chunking.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <map>
#include <random>
#include <optional>
#include <set>
#include <span>

namespace refit::ucx {
namespace {

TEST(Chunking, SplitCoversRunExactlyOnceInOrder) {
  std::mt19937_64 rng(1);
  for (int iter = 0; iter < 2000; ++iter) {
    uint64_t bytes = 1 + rng() % 100000;
    uint64_t chunk = 1 + rng() % 9000;
    auto chunks = split_run(7, ChunkRun{3, bytes}, chunk);
    uint64_t next = 0;
    for (const Chunk& c : chunks) {
      EXPECT_EQ(c.run, 7u);
      EXPECT_EQ(c.endpoint, 3u);
      EXPECT_EQ(c.offset, next);
      EXPECT_GT(c.bytes, 0u);
      EXPECT_LE(c.bytes, chunk);
      next += c.bytes;
    }
    EXPECT_EQ(next, bytes);
    EXPECT_EQ(chunks.size(), (bytes + chunk - 1) / chunk);
  }
}

TEST(Chunking, ValidateNamesTheSetting) {
  WindowLimits l;
  l.max_ops_per_endpoint = 0;
  Status s = validate(l);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("max_ops_per_endpoint"), std::string::npos) << s.message();

  l = WindowLimits{};
  l.chunk_bytes = l.max_bytes_per_endpoint + 1;
  s = validate(l);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("chunk_bytes"), std::string::npos) << s.message();
  EXPECT_TRUE(validate(WindowLimits{}).is_ok());
}

TEST(ChunkScheduler, RejectsZeroLengthRunAndNamesIt) {
  std::vector<ChunkRun> runs = {{0, 10}, {0, 0}};
  auto s = ChunkScheduler::create(WindowLimits{}, runs, 1);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("run 1"), std::string::npos) << s.status().message();
}

TEST(ChunkScheduler, RejectsEndpointOutOfRange) {
  std::vector<ChunkRun> runs = {{2, 10}};
  auto s = ChunkScheduler::create(WindowLimits{}, runs, 2);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("run 0"), std::string::npos);
}

TEST(ChunkScheduler, RejectsAFirstEndpointOutOfRange) {
  std::vector<ChunkRun> runs = {{0, 10}, {1, 10}};
  auto s = ChunkScheduler::create(WindowLimits{}, runs, 2, 2);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("first endpoint 2 out of range (2 endpoints)"), std::string::npos)
      << s.status().message();
  EXPECT_TRUE(ChunkScheduler::create(WindowLimits{}, {}, 0, 5).is_ok()) << "no endpoints: nothing to start at";
}

// Endpoints alike (the same bytes each): the first round of issues goes
// from `first` on in index order, wrapping round, and the turns after it
// keep that order.
TEST(ChunkScheduler, StartsAtTheFirstEndpointAndGoesRoundFromThere) {
  constexpr uint32_t kEps = 5;
  WindowLimits l;
  l.chunk_bytes = 100;
  l.max_bytes_in_flight = l.max_bytes_per_endpoint = 1 << 20;
  std::vector<ChunkRun> runs;
  for (uint32_t e = 0; e < kEps; ++e) runs.push_back(ChunkRun{e, 300});
  for (uint32_t first = 0; first < kEps; ++first) {
    auto s = ChunkScheduler::create(l, runs, kEps, first);
    ASSERT_TRUE(s.is_ok()) << s.status().message();
    for (uint32_t k = 0; k < 3 * kEps; ++k) {
      const std::optional<Chunk> c = s->next();
      ASSERT_TRUE(c.has_value());
      EXPECT_EQ(c->endpoint, (first + k) % kEps) << "first " << first << ", issue " << k;
      EXPECT_EQ(c->offset, k / kEps * 100);
    }
    EXPECT_FALSE(s->next().has_value());
  }
}

// first_endpoint (chunking.h): below the endpoints, 0 for rank 0, and the
// starts of consecutive ranks are far apart and spread evenly: every 64
// endpoints in a row (wrapping round) are the start of about as many
// ranks as the ranks per endpoint say, at cluster sizes.
TEST(ChunkScheduler, FirstEndpointsOfConsecutiveRanksSpreadEvenly) {
  EXPECT_EQ(first_endpoint(0, 1900), 0u);
  EXPECT_EQ(first_endpoint(12345, 0), 0u);
  EXPECT_EQ(first_endpoint(12345, 1), 0u);
  for (auto [n, ranks] : {std::pair<uint32_t, uint32_t>{1900, 2048}, {965, 1024}, {128, 128}, {2048, 2048}}) {
    std::vector<int> starts(n, 0);
    for (uint32_t r = 0; r < ranks; ++r) {
      const uint32_t e = first_endpoint(r, n);
      ASSERT_LT(e, n);
      ++starts[e];
      if (r > 0) {
        const uint32_t prev = first_endpoint(r - 1, n);
        const uint32_t apart = std::min((e + n - prev) % n, (prev + n - e) % n);
        EXPECT_GE(apart, n / 3) << "ranks " << r - 1 << " and " << r << " of " << n << " endpoints";
      }
    }
    const double want = 64.0 * ranks / n;
    for (uint32_t i = 0; i < n; ++i) {
      int in = 0;
      for (uint32_t k = 0; k < 64; ++k) in += starts[(i + k) % n];
      EXPECT_NEAR(in, want, 4.0) << "endpoints " << i << " to " << i + 63 << " of " << n;
    }
  }
}

TEST(ChunkScheduler, EmptyBatchIsDone) {
  auto s = ChunkScheduler::create(WindowLimits{}, {}, 0);
  ASSERT_TRUE(s.is_ok());
  EXPECT_TRUE(s->done());
  EXPECT_FALSE(s->next().has_value());
}

// Random runs, random completion order: every chunk issued once, windows
// never exceeded, each run finishes exactly when its last chunk completes.
TEST(ChunkScheduler, RandomWorkloadRespectsEveryWindow) {
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 300; ++iter) {
    WindowLimits l;
    l.chunk_bytes = 1 + rng() % 5000;
    l.max_bytes_per_endpoint = l.chunk_bytes * (1 + rng() % 4) + rng() % 100;
    l.max_bytes_in_flight = l.chunk_bytes * (1 + rng() % 8) + rng() % 100;
    l.max_ops_per_endpoint = 1 + rng() % 5;
    l.max_ops_in_flight = 1 + rng() % 12;
    uint32_t eps = 1 + rng() % 5;
    std::vector<ChunkRun> runs(rng() % 40);
    for (auto& r : runs) r = ChunkRun{static_cast<uint32_t>(rng() % eps), 1 + rng() % 30000};
    auto sched = ChunkScheduler::create(l, runs, eps);
    ASSERT_TRUE(sched.is_ok()) << sched.status().message();

    std::vector<Chunk> in_flight;
    std::map<uint32_t, uint64_t> covered;  // run -> bytes completed
    std::set<std::pair<uint32_t, uint64_t>> seen;
    std::vector<int> finished(runs.size(), 0);
    while (!sched->done()) {
      while (auto c = sched->next()) {
        ASSERT_TRUE(seen.insert({c->run, c->offset}).second) << "chunk issued twice";
        in_flight.push_back(*c);
        ASSERT_LE(sched->bytes_in_flight(), l.max_bytes_in_flight);
        ASSERT_LE(sched->ops_in_flight(), l.max_ops_in_flight);
        ASSERT_LE(sched->bytes_in_flight(c->endpoint), l.max_bytes_per_endpoint);
        ASSERT_LE(sched->ops_in_flight(c->endpoint), l.max_ops_per_endpoint);
      }
      ASSERT_FALSE(in_flight.empty()) << "scheduler stalled with nothing in flight";
      size_t k = rng() % in_flight.size();
      Chunk c = in_flight[k];
      in_flight.erase(in_flight.begin() + k);
      covered[c.run] += c.bytes;
      bool done = sched->complete(c);
      EXPECT_EQ(done, covered[c.run] == runs[c.run].bytes);
      if (done) ++finished[c.run];
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      EXPECT_EQ(finished[i], 1) << "run " << i;
      EXPECT_EQ(covered[i], runs[i].bytes);
    }
    EXPECT_EQ(sched->bytes_in_flight(), 0u);
    EXPECT_EQ(sched->ops_in_flight(), 0u);
  }
}

// The scheduler's policy (chunking.h) written plainly: per endpoint a list
// of pending chunks, and next() looks at every endpoint each time.
class ReferenceScheduler {
 public:
  ReferenceScheduler(const WindowLimits& l, std::span<const ChunkRun> runs, uint32_t eps, uint32_t first = 0)
      : l_(l), eps_(eps), first_(first) {
    for (uint32_t i = 0; i < runs.size(); ++i) {
      const uint64_t cut = runs[i].gather && l.gather_chunk_bytes > 0 ? l.gather_chunk_bytes : l.chunk_bytes;
      for (const Chunk& c : split_run(i, runs[i], cut)) eps_[c.endpoint].pending.push_back(c);
      eps_[runs[i].endpoint].total += runs[i].bytes;
      eps_[runs[i].endpoint].left += runs[i].bytes;
    }
  }
  std::optional<Chunk> next(const ChunkScheduler::Gate& gate) {
    std::optional<uint32_t> best;
    for (uint32_t e = 0; e < eps_.size(); ++e) {
      const Ep& ep = eps_[e];
      if (ep.pending.empty() || ep.held) continue;
      const Chunk& c = ep.pending.front();
      if (ops_ >= l_.max_ops_in_flight || ep.ops >= l_.max_ops_per_endpoint ||
          bytes_ + c.bytes > l_.max_bytes_in_flight || ep.bytes + c.bytes > l_.max_bytes_per_endpoint)
        continue;
      if (!best || behind(e, *best)) {
        if (gate && c.offset == 0 && !gate_open(gate, c.run)) continue;
        best = e;
      }
    }
    if (!best) return std::nullopt;
    Ep& ep = eps_[*best];
    const Chunk c = ep.pending.front();
    ep.pending.erase(ep.pending.begin());
    ep.left -= c.bytes;
    ep.last = ++issued_;
    ep.bytes += c.bytes;
    ++ep.ops;
    bytes_ += c.bytes;
    ++ops_;
    return c;
  }
  void complete(const Chunk& c) {
    eps_[c.endpoint].bytes -= c.bytes;
    --eps_[c.endpoint].ops;
    bytes_ -= c.bytes;
    --ops_;
  }
  void requeue(const Chunk& c) {
    complete(c);
    eps_[c.endpoint].pending.insert(eps_[c.endpoint].pending.begin(), c);
    eps_[c.endpoint].left += c.bytes;
  }
  void hold(uint32_t e, bool held) { eps_[e].held = held; }
  void drop(uint32_t e) {
    eps_[e].pending.clear();
    eps_[e].left = 0;
  }
  size_t pending() const {
    size_t n = 0;
    for (const Ep& ep : eps_) n += ep.pending.size();
    return n;
  }

 private:
  struct Ep {
    std::vector<Chunk> pending;
    uint64_t total = 0, left = 0, last = 0, bytes = 0, ops = 0;
    bool held = false;
  };
  // Whether `a` is further behind than `b`: a smaller share issued (as a
  // fraction of 2^64 rounded down), then issued less recently (never
  // first), then the one that comes first counting from `first`, wrapping
  // round.
  bool behind(uint32_t a, uint32_t b) const {
    const Ep& x = eps_[a];
    const Ep& y = eps_[b];
    auto share = [](const Ep& e) {
      return static_cast<uint64_t>((static_cast<unsigned __int128>(e.total - e.left) << 64) / e.total);
    };
    if (share(x) != share(y)) return share(x) < share(y);
    if (x.last != y.last) return x.last < y.last;
    const auto n = static_cast<uint32_t>(eps_.size());
    return (a + n - first_) % n < (b + n - first_) % n;
  }
  // The gate is asked of the candidate only; asking it of endpoints that
  // lose would still be allowed, but the test's gate has no side effects.
  static bool gate_open(const ChunkScheduler::Gate& gate, uint32_t run) { return gate(run); }

  WindowLimits l_;
  std::vector<Ep> eps_;
  uint32_t first_ = 0;
  uint64_t issued_ = 0, bytes_ = 0, ops_ = 0;
};

// Random mixes of next (through a gate), complete, requeue, hold and drop:
// the scheduler issues exactly the chunk the plain reference does, every
// time, and its counts agree. Sources of up to 2^61 bytes make shares
// need all 64 bits of their fractions, and chunks of 2^40 bytes and more
// are too wide for a node's copy of its first's head.
TEST(ChunkScheduler, AgreesWithAPlainReferenceUnderRequeueHoldDropAndGate) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 400; ++iter) {
    const bool huge = iter % 4 == 3;
    const uint64_t unit = huge ? uint64_t{1} << 40 : 1;
    WindowLimits l;
    l.chunk_bytes = unit * (1 + rng() % 5000);
    l.gather_chunk_bytes = rng() % 2 ? 0 : l.chunk_bytes * (1 + rng() % 2);
    l.max_bytes_per_endpoint = l.chunk_bytes * (2 + rng() % 4);
    l.max_bytes_in_flight = l.chunk_bytes * (2 + rng() % 8);
    l.max_ops_per_endpoint = 1 + rng() % 5;
    l.max_ops_in_flight = 1 + rng() % 12;
    // One in eight with hundreds of endpoints: the scheduler's tree is then
    // deep, and most endpoints' heads do not fit what is left of the window.
    const bool many = iter % 8 == 5;
    const uint32_t eps = 1 + static_cast<uint32_t>(rng() % (many ? 300 : 6));
    std::vector<ChunkRun> runs(1 + rng() % (many ? 600 : 40));
    for (auto& r : runs) {
      r = ChunkRun{static_cast<uint32_t>(rng() % eps), 1 + rng() % (6 * l.chunk_bytes), rng() % 4 == 0};
    }
    // Half of them start at another endpoint than the first.
    const uint32_t first = rng() % 2 ? static_cast<uint32_t>(rng() % eps) : 0;
    auto sched = ChunkScheduler::create(l, runs, eps, first);
    ASSERT_TRUE(sched.is_ok()) << sched.status().message();
    ReferenceScheduler ref(l, runs, eps, first);
    std::vector<uint8_t> closed(runs.size(), 0);
    ChunkScheduler::Gate gate = [&](uint32_t run) { return closed[run] == 0; };
    std::vector<Chunk> in_flight;
    std::set<std::pair<uint32_t, uint64_t>> out;  // (run, offset) issued and not completed or requeued
    std::vector<uint64_t> landed(runs.size(), 0);
    std::vector<int> finished(runs.size(), 0);
    std::vector<uint8_t> dropped(eps, 0);
    // After `steps` random operations every endpoint is let go and every
    // gate opened, and what is left drains.
    const int steps = 4000;
    for (int step = 0; !sched->done(); ++step) {
      SCOPED_TRACE("iteration " + std::to_string(iter) + " step " + std::to_string(step));
      ASSERT_LT(step, steps + 100000) << "the scheduler stalled";
      if (step == steps) {
        for (uint32_t e = 0; e < eps; ++e) sched->hold(e, false), ref.hold(e, false);
        std::fill(closed.begin(), closed.end(), 0);
      }
      // (Draining, only next and complete: a complete with nothing in
      // flight would fall through to the hold below.)
      const uint64_t op = step < steps ? rng() % 100 : (rng() % 2 || in_flight.empty() ? 0 : 50);
      if (op < 50) {
        // The hints change nothing, and name the endpoints next() issues
        // from: with nothing in flight every head fits, so where the gate
        // lets both firsts go, next() issues one of them, the chunk that
        // head() said.
        if (!in_flight.empty()) sched->prefetch_complete(in_flight[rng() % in_flight.size()]);
        const std::array<uint32_t, 2> firsts = sched->prefetch_next();
        std::vector<Chunk> heads;
        bool open = true;
        if (firsts[0] != UINT32_MAX) ASSERT_NE(firsts[0], firsts[1]) << "one endpoint the first of both trees";
        for (size_t k = 0; k < firsts.size(); ++k) {
          const uint32_t e = firsts[k];
          if (e == UINT32_MAX) continue;
          ASSERT_LT(e, eps);
          const Chunk h = sched->head(e);
          ASSERT_GT(h.bytes, 0u) << "a tree's first has nothing pending";
          // The first tree holds whole chunks, the second the rest.
          if (k == 0) {
            ASSERT_GE(h.bytes, l.chunk_bytes);
          } else {
            ASSERT_LT(h.bytes, l.chunk_bytes);
          }
          open &= h.offset != 0 || closed[h.run] == 0;
          heads.push_back(h);
        }
        const bool idle = in_flight.empty();
        const std::optional<Chunk> got = sched->next(gate);
        const std::optional<Chunk> want = ref.next(gate);
        ASSERT_EQ(got.has_value(), want.has_value());
        // With nothing in flight, what next() issues was in a tree: a
        // tree's first was named.
        if (got && idle) ASSERT_FALSE(heads.empty()) << "prefetch_next named no endpoint";
        if (got && idle && open) {
          bool named = false;
          for (const Chunk& h : heads)
            named |= h.endpoint == got->endpoint && h.run == got->run && h.offset == got->offset && h.bytes == got->bytes;
          EXPECT_TRUE(named) << "next() issued endpoint " << got->endpoint << ", not a first prefetch_next named";
        }
        if (got) {
          ASSERT_EQ(got->run, want->run);
          ASSERT_EQ(got->offset, want->offset);
          ASSERT_EQ(got->bytes, want->bytes);
          ASSERT_EQ(got->endpoint, want->endpoint);
          ASSERT_TRUE(out.insert({got->run, got->offset}).second) << "a chunk issued twice";
          in_flight.push_back(*got);
        } else if (step >= steps) {
          ASSERT_FALSE(in_flight.empty()) << "nothing fits with nothing in flight";
        }
      } else if (op < 80 && !in_flight.empty()) {
        const size_t k = rng() % in_flight.size();
        const Chunk c = in_flight[k];
        in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(k));
        out.erase({c.run, c.offset});
        landed[c.run] += c.bytes;
        const bool done = sched->complete(c);
        ref.complete(c);
        if (!dropped[c.endpoint]) {
          EXPECT_EQ(done, landed[c.run] == runs[c.run].bytes);
        }
        finished[c.run] += done;
      } else if (op < 88 && !in_flight.empty()) {
        const size_t k = rng() % in_flight.size();
        const Chunk c = in_flight[k];
        in_flight.erase(in_flight.begin() + static_cast<std::ptrdiff_t>(k));
        out.erase({c.run, c.offset});
        sched->requeue(c);
        ref.requeue(c);
      } else if (op < 94) {
        const auto e = static_cast<uint32_t>(rng() % eps);
        const bool held = rng() % 2;
        sched->hold(e, held);
        ref.hold(e, held);
      } else if (op < 98) {
        closed[rng() % runs.size()] ^= 1;
      } else if (op < 99) {
        const auto e = static_cast<uint32_t>(rng() % eps);
        for (uint32_t run : sched->drop_endpoint(e)) ++finished[run];
        ref.drop(e);
        dropped[e] = 1;
      }
      ASSERT_EQ(sched->pending_chunks(), ref.pending());
      ASSERT_LE(sched->bytes_in_flight(), l.max_bytes_in_flight);
      ASSERT_LE(sched->ops_in_flight(), l.max_ops_in_flight);
      ASSERT_EQ(sched->ops_in_flight(), in_flight.size());
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      EXPECT_TRUE(sched->run_finished(static_cast<uint32_t>(i)));
      // A run finishes once: its last chunk landed, or its endpoint was
      // dropped with nothing of it in flight. (A run of a dropped endpoint
      // that finished before the drop is not named again.)
      EXPECT_EQ(finished[i], 1) << "run " << i;
      if (!dropped[runs[i].endpoint]) {
        EXPECT_EQ(landed[i], runs[i].bytes) << "run " << i;
      }
    }
  }
}

TEST(ChunkScheduler, RefusesARunOfMoreChunksThanItCountsNamingIt) {
  WindowLimits l;
  l.chunk_bytes = 1;
  std::vector<ChunkRun> runs = {{0, 10}, {0, uint64_t{1} << 32}};
  auto s = ChunkScheduler::create(l, runs, 1);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("run 1"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("raise chunk_bytes"), std::string::npos) << s.status().message();
}

// Never-issued endpoints go first, by index; then, among equal shares, the
// least recently issued. Endpoint 0's chunk taken back leaves it with
// nothing issued, as 1 and 2, but issued more recently than either.
TEST(ChunkScheduler, NeverIssuedGoFirstByIndexThenLeastRecentlyIssued) {
  WindowLimits l;
  l.chunk_bytes = 10;
  std::vector<ChunkRun> runs = {{0, 100}, {1, 100}, {2, 100}};
  auto sched = ChunkScheduler::create(l, runs, 3);
  ASSERT_TRUE(sched.is_ok());
  sched->requeue(*sched->next());
  std::vector<uint32_t> order;
  for (int i = 0; i < 6; ++i) order.push_back(sched->next()->endpoint);
  EXPECT_EQ(order, (std::vector<uint32_t>{1, 2, 0, 1, 2, 0}));
}

// A chunk taken back lowers its endpoint's share: it goes next, before one
// that has issued more, and then both take turns again.
TEST(ChunkScheduler, ARequeueLowersTheShare) {
  WindowLimits l;
  l.chunk_bytes = 10;
  std::vector<ChunkRun> runs = {{0, 40}, {1, 40}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  std::vector<Chunk> got;
  for (int i = 0; i < 4; ++i) got.push_back(*sched->next());
  ASSERT_EQ(got[3].endpoint, 1u);
  sched->requeue(got[3]);  // endpoint 1 has issued 1/4, endpoint 0 2/4
  std::vector<uint32_t> order;
  for (int i = 0; i < 3; ++i) order.push_back(sched->next()->endpoint);
  EXPECT_EQ(order, (std::vector<uint32_t>{1, 0, 1}));
}

// Shares are compared as fractions of 2^64 rounded down (chunking.h). With
// totals of 3c - 1 and 3c bytes, one chunk of c issued from each, endpoint
// 1 (1/3) is behind endpoint 0 (c / (3c - 1)) by 1 / (3 (3c - 1)): with
// c = 2^62 that is under 2^-64, both round to the same share, and endpoint
// 0, issued less recently, goes; with c = 2^20 endpoint 1 goes.
TEST(ChunkScheduler, SharesCloserThan2ToTheMinus64GoByLastIssue) {
  for (const uint64_t c : {uint64_t{1} << 62, uint64_t{1} << 20}) {
    WindowLimits l;
    l.chunk_bytes = c;
    l.max_bytes_in_flight = c;
    l.max_bytes_per_endpoint = c;
    std::vector<ChunkRun> runs = {{0, 3 * c - 1}, {1, 3 * c}};
    auto sched = ChunkScheduler::create(l, runs, 2);
    ASSERT_TRUE(sched.is_ok());
    std::vector<uint32_t> order;
    for (int i = 0; i < 3; ++i) {
      const Chunk k = *sched->next();
      EXPECT_FALSE(sched->next()) << "the window holds one chunk";
      order.push_back(k.endpoint);
      sched->complete(k);
    }
    const uint32_t third = c == uint64_t{1} << 62 ? 0 : 1;
    EXPECT_EQ(order, (std::vector<uint32_t>{0, 1, third})) << "c = " << c;
  }
}

// A chunk of 4 GiB or more is too wide for a node's copy of its first's
// head: the fit is checked against the exact one.
TEST(ChunkScheduler, ChunksOf4GiBAndMoreFitExactly) {
  WindowLimits l;
  l.chunk_bytes = uint64_t{1} << 33;
  l.max_bytes_in_flight = (uint64_t{1} << 33) + (uint64_t{1} << 32);
  l.max_bytes_per_endpoint = l.max_bytes_in_flight;
  std::vector<ChunkRun> runs = {{0, uint64_t{1} << 34}, {1, (uint64_t{1} << 33) + 100}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  const Chunk first = *sched->next();
  EXPECT_EQ(first.endpoint, 0u);
  EXPECT_FALSE(sched->next()) << "2^32 bytes free, every head 2^33";
  sched->complete(first);
  EXPECT_EQ(sched->next()->endpoint, 1u);
  const Chunk tail = *sched->next();  // 2^32 free again: endpoint 1's 100 bytes fit, 0's 2^33 not
  EXPECT_EQ(tail.endpoint, 1u);
  EXPECT_EQ(tail.bytes, 100u);
}

TEST(ChunkScheduler, EndpointsTakeTurns) {
  WindowLimits l;
  l.chunk_bytes = 10;
  std::vector<ChunkRun> runs = {{0, 100}, {1, 100}, {2, 100}};
  auto sched = ChunkScheduler::create(l, runs, 3);
  ASSERT_TRUE(sched.is_ok());
  std::vector<uint32_t> order;
  for (int i = 0; i < 6; ++i) order.push_back(sched->next()->endpoint);
  EXPECT_EQ(order, (std::vector<uint32_t>{0, 1, 2, 0, 1, 2}));
}

// A receiver that needs three times as much from source 0 as from source 1
// issues three of its chunks for each of source 1's, so both finish
// together; taking equal turns, it would be left pulling from source 0
// alone, half its bytes after source 1 was done.
TEST(ChunkScheduler, EndpointsGoInProportionToWhatIsLeftOfThem) {
  WindowLimits l;
  l.chunk_bytes = 10;
  l.max_ops_in_flight = 1;
  std::vector<ChunkRun> runs = {{0, 300}, {1, 100}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  std::vector<uint32_t> order;
  while (auto c = sched->next()) {
    order.push_back(c->endpoint);
    EXPECT_FALSE(sched->next());  // the window holds one
    sched->complete(*c);
  }
  ASSERT_EQ(order.size(), 40u);
  for (size_t k = 4; k <= 40; k += 4) {
    const auto ones = std::count(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), 1u);
    EXPECT_EQ(ones, static_cast<std::ptrdiff_t>(k / 4)) << "after " << k << " chunks";
  }
  // Source 1's last chunk is among the last four.
  EXPECT_NE(std::find(order.end() - 4, order.end(), 1u), order.end());
}

// A gather run is cut at its own request size; one larger than a window
// could never be issued and is refused, naming the setting.
TEST(ChunkScheduler, GatherRunsAreCutAtTheirOwnSize) {
  WindowLimits l;
  l.chunk_bytes = 10;
  l.gather_chunk_bytes = 100;
  l.max_bytes_per_endpoint = 100;
  l.max_bytes_in_flight = 100;
  std::vector<ChunkRun> runs = {{0, 250, /*gather=*/true}, {0, 25}};
  auto sched = ChunkScheduler::create(l, runs, 1);
  ASSERT_TRUE(sched.is_ok());
  EXPECT_EQ(sched->pending_chunks(), 3u + 3u);
  const Chunk first = *sched->next();
  EXPECT_EQ(first.bytes, 100u);
  l.gather_chunk_bytes = 101;
  const Status s = validate(l);
  EXPECT_NE(s.message().find("\"gather_chunk_bytes\" (101)"), std::string::npos) << s.message();
}

// A chunk taken back (its peer was busy) gives back its window share and
// is its endpoint's next chunk again; a held endpoint issues nothing, the
// others go on.
TEST(ChunkScheduler, ARequeuedChunkComesNextAndAHeldEndpointWaits) {
  WindowLimits l;
  l.chunk_bytes = 10;
  std::vector<ChunkRun> runs = {{0, 20}, {1, 10}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  const Chunk first = *sched->next();
  EXPECT_EQ(first.run, 0u);
  EXPECT_EQ(first.offset, 0u);
  sched->requeue(first);
  EXPECT_EQ(sched->bytes_in_flight(), 0u);
  EXPECT_EQ(sched->ops_in_flight(), 0u);
  EXPECT_EQ(sched->pending_chunks(), 3u);
  EXPECT_FALSE(sched->run_finished(0));
  sched->hold(0, true);
  const Chunk other = *sched->next();
  EXPECT_EQ(other.run, 1u);
  EXPECT_FALSE(sched->next().has_value());  // endpoint 0 is held
  sched->hold(0, false);
  const Chunk again = *sched->next();
  EXPECT_EQ(again.run, 0u);
  EXPECT_EQ(again.offset, 0u);
  const Chunk second = *sched->next();
  EXPECT_EQ(second.offset, 10u);
  EXPECT_FALSE(sched->complete(again));
  EXPECT_TRUE(sched->complete(second));
  EXPECT_TRUE(sched->complete(other));
  EXPECT_TRUE(sched->done());
}

// A gate holds a run back before its first chunk, and with it the rest of
// that endpoint's queue; other endpoints go on.
TEST(ChunkScheduler, GateHoldsARunAndItsEndpointUntilItOpens) {
  WindowLimits l;
  l.chunk_bytes = 10;
  std::vector<ChunkRun> runs = {{0, 20}, {0, 10}, {1, 10}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  std::vector<bool> open = {true, false, true};
  std::vector<uint32_t> asked;
  ChunkScheduler::Gate gate = [&](uint32_t run) {
    asked.push_back(run);
    return static_cast<bool>(open[run]);
  };
  std::vector<uint32_t> got;
  while (auto c = sched->next(gate)) got.push_back(c->run);
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 2, 0}));  // run 1 held, run 0's second chunk not asked again
  EXPECT_EQ(std::count(asked.begin(), asked.end(), 0u), 1);
  EXPECT_FALSE(sched->done());
  open[1] = true;
  auto c = sched->next(gate);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->run, 1u);
  EXPECT_FALSE(sched->next(gate));
}

TEST(ChunkScheduler, OneChunkWindowSerializes) {
  WindowLimits l;
  l.chunk_bytes = 10;
  l.max_ops_in_flight = 1;
  std::vector<ChunkRun> runs = {{0, 25}};
  auto sched = ChunkScheduler::create(l, runs, 1);
  ASSERT_TRUE(sched.is_ok());
  auto a = sched->next();
  ASSERT_TRUE(a);
  EXPECT_FALSE(sched->next());
  EXPECT_FALSE(sched->complete(*a));
  auto b = sched->next();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->offset, 10u);
}

TEST(ChunkScheduler, DropEndpointFinishesItsIdleRuns) {
  WindowLimits l;
  l.chunk_bytes = 10;
  l.max_ops_per_endpoint = 1;
  std::vector<ChunkRun> runs = {{0, 30}, {0, 10}, {1, 10}};
  auto sched = ChunkScheduler::create(l, runs, 2);
  ASSERT_TRUE(sched.is_ok());
  auto a = sched->next();  // run 0 chunk 0 on endpoint 0
  auto b = sched->next();  // run 2 on endpoint 1
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->run, 0u);
  auto finished = sched->drop_endpoint(0);
  // run 1 had nothing in flight: finished now; run 0 waits for chunk a.
  EXPECT_EQ(finished, (std::vector<uint32_t>{1}));
  EXPECT_TRUE(sched->complete(*a));
  EXPECT_TRUE(sched->complete(*b));
  EXPECT_TRUE(sched->done());
}

}  // namespace
}  // namespace refit::ucx
