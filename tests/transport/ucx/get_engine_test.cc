// The GET engine across real processes: 1 puller and 1 or 3 peers (2 and 4
// processes), over tcp on loopback and over shared memory. Random GET runs
// land bit-exact, and so does one chunk of several MiB; random PUT runs land
// bit-exact in the peers' memory after flush (the peers send their buffers
// back to be checked); a batch may mix both; a peer killed mid-batch gives
// an error well within the deadline; a stopped peer runs into the deadline
// and the engine cancels, for GETs and for a flush. After every batch no UCX
// request is outstanding.

#include "transport/ucx/get_engine.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "tests/transport/ucx/peer_process.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Peer;
using testing::pattern_byte;

struct Param {
  const char* transport;  // "tcp" or "shm"
  int peers;
  bool progress_thread;
  // kNone: the shared-memory fast path (UCX's own RMA, no AmRmaServer);
  // kPeer: on shm too, refit's active messages over the tcp lane.
  PeerErrorHandling mode = PeerErrorHandling::kPeer;
  bool ucx_memory = false;  // peers' buffers from MemoryRegion::allocate
};

// gtest would print the struct's padding bytes (valgrind flags that).
void PrintTo(const Param& p, std::ostream* os) {
  *os << p.transport << " peers=" << p.peers << (p.progress_thread ? " thread" : "")
      << (p.mode == PeerErrorHandling::kNone ? " no-peer-errors" : "")
      << (p.ucx_memory ? " ucx-memory" : "");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(info.param.transport) + "_" + std::to_string(info.param.peers + 1) +
         "proc" + (info.param.progress_thread ? "_thread" : "") +
         (info.param.mode == PeerErrorHandling::kNone ? "_nopeererr" : "") +
         (info.param.ucx_memory ? "_ucxmem" : "");
}

class GetEngineMultiProcess : public ::testing::TestWithParam<Param> {
 protected:
  static constexpr uint64_t kPeerBytes = 8ull << 20;

  void SetUp() override {
    const Param& p = GetParam();
    peers_.resize(p.peers);
    for (int i = 0; i < p.peers; ++i) {
      if (!testing::start_peer(&peers_[i], p.transport, 100 + i, kPeerBytes, p.ucx_memory)) {
        GTEST_SKIP() << "cannot start peer: " << peers_[i].error;
      }
    }
    for (auto& peer : peers_) {
      if (!testing::handshake(&peer)) {
        GTEST_SKIP() << "transport " << p.transport << " unavailable in peer: " << peer.error;
      }
    }
    ContextConfig cfg;
    cfg.name = "puller";
    cfg.transports = {p.transport};
    if (std::string(p.transport) == "tcp") cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    if (!ctx) GTEST_SKIP() << "transport " << p.transport << ": " << ctx.status().message();
    ctx_.emplace(std::move(*ctx));
    auto worker = Worker::create(
        *ctx_, p.progress_thread ? ThreadMode::kSerialized : ThreadMode::kSingle);
    ASSERT_TRUE(worker.is_ok()) << worker.status().message();
    worker_.emplace(std::move(*worker));
    for (size_t i = 0; i < peers_.size(); ++i) {
      auto ep = Endpoint::create(*worker_, peers_[i].address, "peer" + std::to_string(i), p.mode);
      ASSERT_TRUE(ep.is_ok()) << ep.status().message();
      eps_.push_back(std::make_unique<Endpoint>(std::move(*ep)));
      Status s = eps_.back()->import_rkey(1, peers_[i].rkey);
      ASSERT_TRUE(s.is_ok()) << s.message();
      // Cached: the same bytes again are a no-op.
      ASSERT_TRUE(eps_.back()->import_rkey(1, peers_[i].rkey).is_ok());
    }
    local_.assign(peers_.size() * kPeerBytes + (1 << 20), 0);
    auto region = MemoryRegion::map(*ctx_, local_.data(), local_.size(), "local");
    ASSERT_TRUE(region.is_ok()) << region.status().message();
    EXPECT_EQ(region->type(), MemoryType::kHost);
    region_.emplace(std::move(*region));
    GetEngineOptions opts;
    opts.limits.chunk_bytes = 256 << 10;
    opts.limits.max_bytes_per_endpoint = 2 << 20;
    opts.limits.max_bytes_in_flight = 4 << 20;
    opts.limits.max_ops_per_endpoint = 16;
    opts.limits.max_ops_in_flight = 32;
    opts.progress_thread = p.progress_thread;
    auto engine = GetEngine::create(*worker_, opts);
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    engine_ = std::move(*engine);
    engine_->add_local_region(*region_);
  }

  void TearDown() override {
    engine_.reset();  // stops the progress thread before endpoints go
    eps_.clear();
    region_.reset();
    worker_.reset();
    ctx_.reset();
    for (auto& p : peers_) testing::stop_peer(&p);
  }

  std::vector<Peer> peers_;
  std::optional<Context> ctx_;
  std::optional<Worker> worker_;
  std::vector<std::unique_ptr<Endpoint>> eps_;
  std::vector<uint8_t> local_;
  std::optional<MemoryRegion> region_;
  std::unique_ptr<GetEngine> engine_;
};

TEST_P(GetEngineMultiProcess, RandomRunsLandBitExact) {
  std::mt19937_64 rng(7 + GetParam().peers);
  for (int round = 0; round < 3; ++round) {
    std::fill(local_.begin(), local_.end(), 0);
    std::vector<GetRun> runs;
    std::vector<std::pair<uint32_t, uint64_t>> src;  // peer, remote offset
    uint64_t local_off = 0;
    while (true) {
      uint32_t k = static_cast<uint32_t>(rng() % peers_.size());
      // Mostly small and odd-sized, sometimes several chunks long.
      uint64_t bytes = rng() % 4 == 0 ? 1 + rng() % (1536 << 10) : 1 + rng() % 5000;
      uint64_t roff = rng() % (kPeerBytes - bytes);
      local_off += rng() % 64;  // random local alignment
      if (local_off + bytes > local_.size()) break;
      runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + roff, local_.data() + local_off,
                            bytes});
      src.push_back({k, roff});
      local_off += bytes;
    }
    std::vector<int> done(runs.size(), 0);
    auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20),
                                     [&](uint32_t run, const Status& s) {
                                       EXPECT_TRUE(s.is_ok()) << s.message();
                                       ++done[run];
                                     });
    ASSERT_TRUE(report.status.is_ok()) << report.status.message();
    EXPECT_EQ(engine_->outstanding_requests(), 0u);
    uint64_t total = 0;
    for (size_t i = 0; i < runs.size(); ++i) {
      EXPECT_EQ(done[i], 1) << "run " << i << " reported " << done[i] << " times";
      total += runs[i].bytes;
      const uint8_t* got = static_cast<const uint8_t*>(runs[i].local_address);
      for (uint64_t j = 0; j < runs[i].bytes; ++j) {
        if (got[j] != pattern_byte(100 + src[i].first, src[i].second + j)) {
          FAIL() << "run " << i << " byte " << j << " differs";
        }
      }
    }
    EXPECT_EQ(report.bytes_done, total);
    // Nothing outside the runs was written: the gaps between them stay zero.
    std::vector<bool> in_run(local_.size(), false);
    for (const auto& r : runs) {
      auto off = static_cast<uint8_t*>(r.local_address) - local_.data();
      std::fill(in_run.begin() + off, in_run.begin() + off + r.bytes, true);
    }
    for (size_t i = 0; i < local_.size(); ++i) {
      if (!in_run[i] && local_[i] != 0) FAIL() << "byte " << i << " outside every run written";
    }
  }
  EXPECT_LE(engine_->slot_count(), 32u) << "request slots exceed the op window";
}

// One chunk of several MiB: over tcp its bytes come back as many replies of
// am_rma::kReplyPieceBytes and a short last one, each landing at its offset.
TEST_P(GetEngineMultiProcess, OneLargeChunkLandsBitExact) {
  engine_.reset();  // one engine per worker: it owns the reply handlers
  GetEngineOptions opts;
  opts.limits.chunk_bytes = kPeerBytes;
  opts.limits.max_bytes_per_endpoint = kPeerBytes;
  opts.limits.max_bytes_in_flight = kPeerBytes;
  opts.limits.max_ops_per_endpoint = 1;
  opts.limits.max_ops_in_flight = 1;
  opts.progress_thread = GetParam().progress_thread;
  auto engine = GetEngine::create(*worker_, opts);
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  engine_ = std::move(*engine);
  engine_->add_local_region(*region_);
  const uint64_t roff = 777;
  const uint64_t bytes = kPeerBytes - roff - 12345;
  const uint64_t loff = 3;
  GetRun run{eps_[0].get(), 1, peers_[0].base + roff, local_.data() + loff, bytes};
  auto report = engine_->run_batch({&run, 1}, Clock::now() + std::chrono::seconds(20));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(report.bytes_done, bytes);
  EXPECT_EQ(report.gets_issued, 1u);
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  for (uint64_t j = 0; j < local_.size(); ++j) {
    const bool inside = j >= loff && j < loff + bytes;
    const uint8_t want = inside ? pattern_byte(100, roff + j - loff) : 0;
    if (local_[j] != want) FAIL() << "byte " << j << (inside ? " differs" : " written");
  }
}

// The receiver's rank picks the endpoint its first GET goes to
// (GetEngineOptions::rank, first_endpoint in chunking.h): with one run per
// peer, the gate is asked first of the run of that endpoint, then of the
// others in order from it, for every rank of a few.
TEST_P(GetEngineMultiProcess, TheRankPicksTheEndpointOfTheFirstGet) {
  const auto n = static_cast<uint32_t>(peers_.size());
  if (n < 2) GTEST_SKIP() << "one peer: every rank starts there";
  for (uint64_t rank : {0, 1, 2, 3, 7}) {
    engine_.reset();  // one engine per worker: it owns the reply handlers
    GetEngineOptions opts;
    opts.rank = rank;
    opts.progress_thread = GetParam().progress_thread;
    auto engine = GetEngine::create(*worker_, opts);
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    engine_ = std::move(*engine);
    engine_->add_local_region(*region_);
    std::vector<GetRun> runs;
    for (uint32_t k = 0; k < n; ++k)
      runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base, local_.data() + k * 4096, 4096});
    std::vector<uint32_t> asked;  // the gate runs on the engine's progressing thread, one call at a time
    auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20), {},
                                     [&](uint32_t run, void**) {
                                       asked.push_back(run);
                                       return true;
                                     });
    ASSERT_TRUE(report.status.is_ok()) << report.status.message();
    const uint32_t first = first_endpoint(rank, n);
    ASSERT_EQ(asked.size(), n);
    for (uint32_t k = 0; k < n; ++k) EXPECT_EQ(asked[k], (first + k) % n) << "rank " << rank << ", GET " << k;
    for (uint32_t k = 0; k < n; ++k)
      for (uint64_t j = 0; j < 4096; ++j)
        if (local_[k * 4096 + j] != pattern_byte(100 + k, j)) FAIL() << "peer " << k << " byte " << j << " differs";
  }
}

// A landing ring: every run is registered at slot 0 of a two-slot ring; the
// gate holds a run until a slot is free and moves it there; a copier thread
// moves each landed run to its final place and frees its slot. Every byte
// must arrive at its place: a run that landed in a slot still holding
// another would have overwritten it.
TEST_P(GetEngineMultiProcess, GatedRunsWaitForAFreeSlotAndLandThere) {
  constexpr uint64_t kSlot = 300 << 10;  // two chunks of the window
  std::vector<uint8_t> dst(3 << 20, 0);
  std::vector<GetRun> runs;
  std::vector<std::pair<uint32_t, uint64_t>> src;  // peer, remote offset
  std::vector<uint64_t> dst_off;
  std::mt19937_64 rng(11);
  for (uint64_t at = 0; at < dst.size();) {
    const uint64_t bytes = std::min<uint64_t>(dst.size() - at, 1 + rng() % kSlot);
    const uint32_t k = static_cast<uint32_t>(runs.size() % peers_.size());
    const uint64_t roff = rng() % (kPeerBytes - bytes);
    runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + roff, local_.data(), bytes});
    src.push_back({k, roff});
    dst_off.push_back(at);
    at += bytes;
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint32_t> landed;          // guarded by mu
  std::vector<uint8_t*> free_slots = {local_.data(), local_.data() + kSlot};  // guarded by mu
  std::vector<uint8_t*> slot_of(runs.size(), nullptr);  // guarded by mu
  int held = 0;                          // guarded by mu
  bool over = false;                     // guarded by mu
  std::thread copier([&] {
    while (true) {
      std::vector<uint32_t> take;
      {
        std::unique_lock<std::mutex> lock(mu);
        // Slots are freed only once the gate has refused a run: a GET that
        // completes inline could otherwise be copied out before the engine
        // asks for the third slot, and the wait would never be exercised.
        cv.wait(lock, [&] { return (!landed.empty() && held > 0) || over; });
        if (landed.empty() || held == 0) return;
        take.swap(landed);
      }
      for (uint32_t run : take) {
        uint8_t* slot = nullptr;
        {
          std::lock_guard<std::mutex> lock(mu);
          slot = slot_of[run];
        }
        std::memcpy(dst.data() + dst_off[run], slot, runs[run].bytes);
        std::lock_guard<std::mutex> lock(mu);
        free_slots.push_back(slot);
      }
      engine_->wake();
    }
  });
  auto gate = [&](uint32_t run, void** local) {
    std::lock_guard<std::mutex> lock(mu);
    if (free_slots.empty()) {
      ++held;
      cv.notify_one();
      return false;
    }
    slot_of[run] = free_slots.back();
    free_slots.pop_back();
    *local = slot_of[run];
    return true;
  };
  auto report = engine_->run_batch(
      runs, Clock::now() + std::chrono::seconds(20),
      [&](uint32_t run, const Status& s) {
        EXPECT_TRUE(s.is_ok()) << s.message();
        std::lock_guard<std::mutex> lock(mu);
        landed.push_back(run);
        cv.notify_one();
      },
      gate);
  {
    std::lock_guard<std::mutex> lock(mu);
    over = true;
  }
  cv.notify_one();
  copier.join();
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_GT(held, 0) << "two slots never ran out";
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  for (size_t i = 0; i < runs.size(); ++i) {
    for (uint64_t j = 0; j < runs[i].bytes; ++j) {
      if (dst[dst_off[i] + j] != pattern_byte(100 + src[i].first, src[i].second + j)) {
        FAIL() << "run " << i << " byte " << j << " differs";
      }
    }
  }
}

// halt() from the first run callback: nothing more is issued, the runs not yet
// finished fail with the reason, and the batch returns once what was in
// flight completed, with no request outstanding.
TEST_P(GetEngineMultiProcess, HaltEndsTheBatchOnceWhatIsInFlightCompletes) {
  std::vector<GetRun> runs;
  for (uint32_t i = 0; i < 400; ++i) {
    const uint32_t k = i % peers_.size();
    runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + (i * 8192) % (kPeerBytes - 8192),
                          local_.data() + i * 8192, 8192});
  }
  std::vector<int> reported(runs.size(), 0);
  std::vector<Status> got(runs.size());
  bool asked = false;  // halt() at the first run that finishes
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20),
                                   [&](uint32_t run, const Status& s) {
                                     ++reported[run];
                                     got[run] = s;
                                     if (!asked) engine_->halt(Status::io_error("the test halts the batch"));
                                     asked = true;
                                   });
  EXPECT_EQ(report.status.code(), Code::kIoError) << report.status.message();
  EXPECT_NE(report.status.message().find("the test halts the batch"), std::string::npos) << report.status.message();
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  size_t halted = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(reported[i], 1) << "run " << i;
    if (!got[i].is_ok()) {
      ++halted;
      EXPECT_NE(got[i].message().find("halted"), std::string::npos) << got[i].message();
    }
  }
  // Once halted, only what was in flight (at most the window's 32 ops) may
  // still complete.
  EXPECT_GE(halted, runs.size() - 1 - 32) << "the batch ran on after halt()";
  EXPECT_LT(report.bytes_done, runs.size() * 8192u);
  // The next batch is not halted.
  GetRun one{eps_[0].get(), 1, peers_[0].base, local_.data(), 4096};
  auto next = engine_->run_batch({&one, 1}, Clock::now() + std::chrono::seconds(20));
  EXPECT_TRUE(next.status.is_ok()) << next.status.message();
}

// A gate that moves a run outside its registered region fails that run.
TEST_P(GetEngineMultiProcess, AGateThatMovesARunOutsideItsRegionFailsIt) {
  std::vector<uint8_t> elsewhere(4096);
  GetRun run{eps_[0].get(), 1, peers_[0].base, local_.data(), 4096};
  auto report = engine_->run_batch({&run, 1}, Clock::now() + std::chrono::seconds(20), {},
                                   [&](uint32_t, void** local) {
                                     *local = elsewhere.data();
                                     return true;
                                   });
  EXPECT_EQ(report.status.code(), Code::kInternal) << report.status.message();
  EXPECT_NE(report.status.message().find("outside its local region"), std::string::npos) << report.status.message();
  EXPECT_TRUE(std::all_of(elsewhere.begin(), elsewhere.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
}

TEST_P(GetEngineMultiProcess, KilledPeerGivesErrorWithinDeadline) {
  if (GetParam().mode == PeerErrorHandling::kNone) {
    GTEST_SKIP() << "kNone: a dead peer is only noticed by the batch deadline";
  }
  // Many runs from the last peer; it is SIGKILLed when the first run lands.
  Peer& victim = peers_.back();
  Endpoint* ep = eps_.back().get();
  std::vector<GetRun> runs;
  for (uint64_t off = 0; off + (1 << 20) <= local_.size() && runs.size() < 64; off += 1 << 20) {
    runs.push_back(GetRun{ep, 1, victim.base + (off % (kPeerBytes - (1 << 20))),
                          local_.data() + off, 1 << 20});
  }
  // And one healthy run per other peer.
  for (size_t i = 0; i + 1 < peers_.size(); ++i) {
    runs.push_back(GetRun{eps_[i].get(), 1, peers_[i].base, local_.data() + i * 4096, 4096});
  }
  std::atomic<bool> killed{false};
  const auto deadline_span = std::chrono::seconds(20);
  const auto start = Clock::now();
  auto report = engine_->run_batch(runs, start + deadline_span, [&](uint32_t, const Status&) {
    if (!killed.exchange(true)) ::kill(victim.pid, SIGKILL);
  });
  const auto took = Clock::now() - start;
  ASSERT_TRUE(killed.load());
  if (!report.status.is_ok()) {
    // The other peers' runs (the last ones) are unaffected.
    for (size_t i = runs.size() - (peers_.size() - 1); i < runs.size(); ++i) {
      EXPECT_TRUE(report.runs[i].is_ok()) << "run " << i << ": " << report.runs[i].message();
    }
  }
  // For shm, cma GETs run to completion inside ucp_get_nbx, so the batch may
  // finish before the kill takes effect; then the next batch must fail.
  if (report.status.is_ok()) {
    ::waitpid(victim.pid, nullptr, 0);
    victim.pid = -1;
    report = engine_->run_batch(runs, Clock::now() + deadline_span);
  }
  EXPECT_FALSE(report.status.is_ok());
  EXPECT_LT(took, deadline_span + std::chrono::seconds(3));
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  std::cout << "[ info ] killed-peer batch: " << report.status.message() << " after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms\n";
}

// Random PUT runs to disjoint remote ranges (runs may not overlap each other
// at the peer, or the result would depend on their order): after flush each
// peer's buffer equals its pattern with the runs applied, byte for byte.
TEST_P(GetEngineMultiProcess, RandomPutsLandBitExactAfterFlush) {
  std::mt19937_64 rng(11 + GetParam().peers);
  std::vector<std::vector<uint8_t>> expect(peers_.size());
  for (size_t k = 0; k < peers_.size(); ++k) {
    expect[k].resize(kPeerBytes);
    for (uint64_t i = 0; i < kPeerBytes; ++i) expect[k][i] = pattern_byte(100 + k, i);
  }
  for (int round = 0; round < 2; ++round) {
    for (auto& b : local_) b = static_cast<uint8_t>(rng());
    std::vector<GetRun> runs;
    std::vector<uint64_t> next_remote(peers_.size(), 0);
    uint64_t local_off = 0;
    while (true) {
      uint32_t k = static_cast<uint32_t>(rng() % peers_.size());
      uint64_t bytes = rng() % 4 == 0 ? 1 + rng() % (1536 << 10) : 1 + rng() % 5000;
      uint64_t roff = next_remote[k] + rng() % 64;
      local_off += rng() % 64;
      if (local_off + bytes > local_.size() || roff + bytes > kPeerBytes) break;
      next_remote[k] = roff + bytes;
      runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + roff, local_.data() + local_off,
                            bytes, Op::kPut});
      std::copy_n(local_.data() + local_off, bytes, expect[k].begin() + roff);
      local_off += bytes;
    }
    ASSERT_FALSE(runs.empty());
    std::vector<int> done(runs.size(), 0);
    auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20),
                                     [&](uint32_t run, const Status& s) {
                                       EXPECT_TRUE(s.is_ok()) << s.message();
                                       ++done[run];
                                     });
    ASSERT_TRUE(report.status.is_ok()) << report.status.message();
    EXPECT_EQ(engine_->outstanding_requests(), 0u);
    for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(done[i], 1) << "run " << i;
    std::vector<Endpoint*> all;
    for (auto& ep : eps_) all.push_back(ep.get());
    Status f = engine_->flush(all, Clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(f.is_ok()) << f.message();
    for (size_t k = 0; k < peers_.size(); ++k) {
      std::vector<uint8_t> got;
      ASSERT_TRUE(testing::dump_peer(&peers_[k], &got)) << "peer " << k << " did not dump";
      for (uint64_t i = 0; i < kPeerBytes; ++i) {
        if (got[i] != expect[k][i]) FAIL() << "peer " << k << " byte " << i << " differs";
      }
    }
  }
}

// GETs and PUTs in one batch: PUTs to the first half of each peer's buffer,
// GETs from the second half (which nothing writes); both land bit-exact.
TEST_P(GetEngineMultiProcess, MixedBatchLandsBitExact) {
  std::mt19937_64 rng(23 + GetParam().peers);
  const uint64_t half = kPeerBytes / 2;
  std::vector<std::vector<uint8_t>> expect(peers_.size());
  for (size_t k = 0; k < peers_.size(); ++k) {
    expect[k].resize(kPeerBytes);
    for (uint64_t i = 0; i < kPeerBytes; ++i) expect[k][i] = pattern_byte(100 + k, i);
  }
  // Sources of the PUTs in the first half of local_, GET targets in the second.
  const uint64_t local_half = local_.size() / 2;
  for (uint64_t i = 0; i < local_half; ++i) local_[i] = static_cast<uint8_t>(rng());
  std::fill(local_.begin() + local_half, local_.end(), 0);
  std::vector<GetRun> runs;
  std::vector<std::pair<uint32_t, uint64_t>> get_src;  // per run; puts unused
  std::vector<uint64_t> next_put(peers_.size(), 0);
  uint64_t put_off = 0, get_off = local_half;
  for (int n = 0; n < 400; ++n) {
    uint32_t k = static_cast<uint32_t>(rng() % peers_.size());
    uint64_t bytes = rng() % 8 == 0 ? 1 + rng() % (600 << 10) : 1 + rng() % 3000;
    if (rng() % 2 == 0) {
      uint64_t roff = next_put[k] + rng() % 32;
      if (roff + bytes > half || put_off + bytes > local_half) continue;
      next_put[k] = roff + bytes;
      runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + roff, local_.data() + put_off,
                            bytes, Op::kPut});
      std::copy_n(local_.data() + put_off, bytes, expect[k].begin() + roff);
      get_src.push_back({0, 0});
      put_off += bytes + rng() % 32;
    } else {
      uint64_t roff = half + rng() % (half - bytes);
      if (get_off + bytes > local_.size()) continue;
      runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base + roff, local_.data() + get_off,
                            bytes, Op::kGet});
      get_src.push_back({k, roff});
      get_off += bytes + rng() % 32;
    }
  }
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  std::vector<Endpoint*> all;
  for (auto& ep : eps_) all.push_back(ep.get());
  Status f = engine_->flush(all, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(f.is_ok()) << f.message();
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].op != Op::kGet) continue;
    const uint8_t* got = static_cast<const uint8_t*>(runs[i].local_address);
    for (uint64_t j = 0; j < runs[i].bytes; ++j) {
      if (got[j] != pattern_byte(100 + get_src[i].first, get_src[i].second + j)) {
        FAIL() << "GET run " << i << " byte " << j << " differs";
      }
    }
  }
  for (size_t k = 0; k < peers_.size(); ++k) {
    std::vector<uint8_t> got;
    ASSERT_TRUE(testing::dump_peer(&peers_[k], &got)) << "peer " << k << " did not dump";
    for (uint64_t i = 0; i < kPeerBytes; ++i) {
      if (got[i] != expect[k][i]) FAIL() << "peer " << k << " byte " << i << " differs";
    }
  }
}

// Flushing an endpoint whose peer is dead is an error that names it; the
// healthy endpoints flush fine.
TEST_P(GetEngineMultiProcess, FlushOfDeadPeerNamesEndpoint) {
  if (GetParam().mode == PeerErrorHandling::kNone) {
    GTEST_SKIP() << "kNone: a dead peer is only noticed by the deadline";
  }
  const size_t v = peers_.size() - 1;
  std::vector<GetRun> runs;
  for (size_t k = 0; k < peers_.size(); ++k) {
    runs.push_back(GetRun{eps_[k].get(), 1, peers_[k].base, local_.data() + k * 8192, 8192,
                          Op::kPut});
  }
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  ::kill(peers_[v].pid, SIGKILL);
  ::waitpid(peers_[v].pid, nullptr, 0);
  peers_[v].pid = -1;
  // UCX notices the dead peer on the next operation or keepalive; a PUT
  // makes it notice on tcp, where the PUT itself may still report ok.
  (void)engine_->run_batch({&runs[v], 1}, Clock::now() + std::chrono::seconds(5));
  std::vector<Endpoint*> all;
  for (auto& ep : eps_) all.push_back(ep.get());
  const auto start = Clock::now();
  Status f = engine_->flush(all, start + std::chrono::seconds(5));
  const auto took = Clock::now() - start;
  if (f.is_ok()) {
    // shm: a cma PUT to a dead process may fail only on its next use.
    GTEST_SKIP() << "transport did not notice the dead peer during flush";
  }
  EXPECT_NE(f.message().find("peer" + std::to_string(v)), std::string::npos) << f.message();
  EXPECT_LT(took, std::chrono::seconds(5) + GetEngineOptions{}.cancel_grace +
                      std::chrono::milliseconds(500));
  EXPECT_TRUE(eps_[v]->failed());
  for (size_t k = 0; k < v; ++k) EXPECT_FALSE(eps_[k]->failed()) << "peer " << k;
  std::cout << "[ info ] flush of dead peer: " << f.message() << "\n";
}

INSTANTIATE_TEST_SUITE_P(Transports, GetEngineMultiProcess,
                         ::testing::Values(Param{"tcp", 1, false}, Param{"tcp", 3, false},
                                           Param{"shm", 1, false}, Param{"shm", 3, false},
                                           Param{"tcp", 1, true}, Param{"shm", 3, true},
                                           Param{"shm", 1, false, PeerErrorHandling::kNone},
                                           Param{"shm", 3, true, PeerErrorHandling::kNone},
                                           Param{"shm", 1, false, PeerErrorHandling::kNone, true},
                                           Param{"shm", 3, true, PeerErrorHandling::kNone, true}),
                         param_name);

// A stopped peer never serves its tcp GETs: the batch must end at its
// deadline with every request cancelled, not hang.
TEST(GetEngineDeadline, StoppedPeerHitsDeadlineAndCancels) {
  Peer peer;
  if (!testing::start_peer(&peer, "tcp", 5, 8 << 20) || !testing::handshake(&peer)) {
    testing::stop_peer(&peer);
    GTEST_SKIP() << "tcp unavailable: " << peer.error;
  }
  {
    ContextConfig cfg;
    cfg.name = "puller";
    cfg.transports = {"tcp"};
    cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
    auto worker = Worker::create(*ctx);
    ASSERT_TRUE(worker.is_ok());
    auto ep = Endpoint::create(*worker, peer.address, "stopped-peer");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ASSERT_TRUE(ep->import_rkey(9, peer.rkey).is_ok());
    std::vector<uint8_t> local(8 << 20);
    auto region = MemoryRegion::map(*ctx, local.data(), local.size());
    ASSERT_TRUE(region.is_ok());
    auto engine = GetEngine::create(*worker, GetEngineOptions{});
    ASSERT_TRUE(engine.is_ok());
    (*engine)->add_local_region(*region);
    // Warm up the connection, then stop the peer.
    GetRun one{&*ep, 9, peer.base, local.data(), 4096};
    auto warm = (*engine)->run_batch({&one, 1}, Clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(warm.status.is_ok()) << warm.status.message();
    ::kill(peer.pid, SIGSTOP);
    std::vector<GetRun> runs;
    for (int i = 0; i < 8; ++i) {
      runs.push_back(GetRun{&*ep, 9, peer.base + i * (1 << 20), local.data() + i * (1 << 20),
                            1 << 20});
    }
    const auto start = Clock::now();
    auto report = (*engine)->run_batch(runs, start + std::chrono::milliseconds(500));
    const auto took = Clock::now() - start;
    // The cancel closed the connection with GETs queued at the stopped
    // peer. Resumed, it finds them and must survive: UCX 1.13's own GET
    // emulation over tcp aborted here (am_rma.h).
    ::kill(peer.pid, SIGCONT);
    EXPECT_FALSE(report.status.is_ok());
    EXPECT_NE(report.status.message().find("deadline"), std::string::npos)
        << report.status.message();
    EXPECT_NE(report.status.message().find("run "), std::string::npos);
    EXPECT_LT(took, std::chrono::milliseconds(500) + GetEngineOptions{}.cancel_grace +
                        std::chrono::milliseconds(500));
    EXPECT_EQ((*engine)->outstanding_requests(), 0u);
    EXPECT_TRUE(ep->failed());
    // The cancelled endpoint refuses further runs with a clear error.
    auto again = (*engine)->run_batch(runs, Clock::now() + std::chrono::seconds(1));
    EXPECT_FALSE(again.status.is_ok());
    EXPECT_NE(again.status.message().find("run 0"), std::string::npos) << again.status.message();
    ::usleep(300 * 1000);  // lets the peer process what was queued
    int status = 0;
    EXPECT_EQ(::waitpid(peer.pid, &status, WNOHANG), 0)
        << "peer died after the cancel: signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  }
  testing::stop_peer(&peer);
}

// drop_peer(): a peer that has answered nothing for `quiet` (stopped: its
// host still takes the bytes, so tcp sees nothing wrong) is given up at
// once, its runs failing with the caller's reason, long before the
// batch's deadline; a peer that answers is left alone.
TEST(GetEngineDropPeer, AQuietPeerIsDroppedAndAnAnsweringOneIsNot) {
  Peer peer;
  if (!testing::start_peer(&peer, "tcp", 7, 8 << 20) || !testing::handshake(&peer)) {
    testing::stop_peer(&peer);
    GTEST_SKIP() << "tcp unavailable: " << peer.error;
  }
  {
    ContextConfig cfg;
    cfg.name = "puller";
    cfg.transports = {"tcp"};
    cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
    auto worker = Worker::create(*ctx, ThreadMode::kSerialized);
    ASSERT_TRUE(worker.is_ok());
    auto ep = Endpoint::create(*worker, peer.address, "quiet-peer");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ASSERT_TRUE(ep->import_rkey(9, peer.rkey).is_ok());
    std::vector<uint8_t> local(8 << 20);
    auto region = MemoryRegion::map(*ctx, local.data(), local.size());
    ASSERT_TRUE(region.is_ok());
    GetEngineOptions options;
    options.progress_thread = true;
    auto engine = GetEngine::create(*worker, options);
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    (*engine)->add_local_region(*region);
    std::vector<GetRun> runs;
    for (int i = 0; i < 8; ++i) {
      runs.push_back(GetRun{&*ep, 9, peer.base + i * (1 << 20), local.data() + i * (1 << 20), 1 << 20});
    }
    const auto quiet = std::chrono::milliseconds(200);
    // Answering: asked to drop it, the engine reads on; every run lands. Its
    // quiet bound is the receiver's (1 s) and more: on a loaded machine the
    // peer process may not be scheduled for 200 ms, which is quiet too.
    (*engine)->drop_peer(&*ep, Status::io_error("the test gives up on the peer"), std::chrono::seconds(2));
    auto served = (*engine)->run_batch(runs, Clock::now() + std::chrono::seconds(20));
    EXPECT_TRUE(served.status.is_ok()) << served.status.message();
    EXPECT_FALSE(ep->failed());
    // Quiet: stopped, its GETs never end on their own; dropped, they fail
    // with the reason given, once the peer has been quiet for `quiet`.
    ::kill(peer.pid, SIGSTOP);
    (*engine)->drop_peer(&*ep, Status::io_error("the test gives up on the peer"), quiet);
    const auto start = Clock::now();
    // As the receiver does: a failed run halts the batch (halt() from a run
    // callback, which the close's completions call).
    GetEngine* e = engine->get();
    auto report = (*engine)->run_batch(runs, start + std::chrono::seconds(20), [e](uint32_t, const Status& st) {
      if (!st.is_ok()) e->halt(st);
    });
    const auto took = Clock::now() - start;
    ::kill(peer.pid, SIGCONT);
    EXPECT_FALSE(report.status.is_ok());
    EXPECT_NE(report.status.message().find("the test gives up on the peer"), std::string::npos)
        << report.status.message();
    for (const Status& r : report.runs) EXPECT_FALSE(r.is_ok());
    EXPECT_LT(took, quiet + options.cancel_grace + std::chrono::milliseconds(1000));
    EXPECT_EQ((*engine)->outstanding_requests(), 0u);
    EXPECT_TRUE(ep->failed());
  }
  testing::stop_peer(&peer);
}

// A stopped peer never acknowledges the PUTs it was sent over tcp: flush
// must end at its deadline with an error naming the endpoint, and force-close
// it.
TEST(GetEngineDeadline, StoppedPeerFlushHitsDeadline) {
  Peer peer;
  if (!testing::start_peer(&peer, "tcp", 6, 8 << 20) || !testing::handshake(&peer)) {
    testing::stop_peer(&peer);
    GTEST_SKIP() << "tcp unavailable: " << peer.error;
  }
  {
    ContextConfig cfg;
    cfg.name = "putter";
    cfg.transports = {"tcp"};
    cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
    auto worker = Worker::create(*ctx);
    ASSERT_TRUE(worker.is_ok());
    auto ep = Endpoint::create(*worker, peer.address, "stopped-peer");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ASSERT_TRUE(ep->import_rkey(9, peer.rkey).is_ok());
    std::vector<uint8_t> local(8 << 20, 0x5a);
    auto region = MemoryRegion::map(*ctx, local.data(), local.size());
    ASSERT_TRUE(region.is_ok());
    auto engine = GetEngine::create(*worker, GetEngineOptions{});
    ASSERT_TRUE(engine.is_ok());
    (*engine)->add_local_region(*region);
    GetRun one{&*ep, 9, peer.base, local.data(), 4096, Op::kPut};
    auto warm = (*engine)->run_batch({&one, 1}, Clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(warm.status.is_ok()) << warm.status.message();
    Endpoint* eps[] = {&*ep};
    ASSERT_TRUE((*engine)->flush(eps, Clock::now() + std::chrono::seconds(10)).is_ok());
    ::kill(peer.pid, SIGSTOP);
    // Small PUTs complete locally (buffered), so the batch itself may be ok.
    std::vector<GetRun> runs;
    for (int i = 0; i < 8; ++i) {
      runs.push_back(GetRun{&*ep, 9, peer.base + i * 4096, local.data() + i * 4096, 4096,
                            Op::kPut});
    }
    (void)(*engine)->run_batch(runs, Clock::now() + std::chrono::milliseconds(500));
    const auto start = Clock::now();
    Status f = (*engine)->flush(eps, start + std::chrono::milliseconds(500));
    const auto took = Clock::now() - start;
    ::kill(peer.pid, SIGKILL);
    EXPECT_FALSE(f.is_ok());
    EXPECT_NE(f.message().find("stopped-peer"), std::string::npos) << f.message();
    EXPECT_LT(took, std::chrono::milliseconds(500) + GetEngineOptions{}.cancel_grace +
                        std::chrono::milliseconds(500));
    EXPECT_EQ((*engine)->outstanding_requests(), 0u);
    EXPECT_TRUE(ep->failed());
  }
  testing::stop_peer(&peer);
}

}  // namespace
}  // namespace refit::ucx
