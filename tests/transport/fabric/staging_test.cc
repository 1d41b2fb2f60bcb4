#include "transport/cuda/staging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "transport/cuda/host_copy_ops.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::cuda {
namespace {

std::unique_ptr<HostCopyOps> host_copy_ops(std::chrono::microseconds per_copy = std::chrono::microseconds(0)) {
  Result<std::unique_ptr<HostCopyOps>> ops = HostCopyOps::create(per_copy);
  EXPECT_TRUE(ops.is_ok()) << ops.status().message();
  return ops.is_ok() ? std::move(ops).value() : nullptr;
}

// Runs of random sizes whose device side is scattered into strided places.
struct Layout {
  std::vector<std::vector<uint8_t>> remote;  // per run: its bytes on the network side
  std::vector<uint8_t> device;
  std::vector<StagedRun> runs;
};

Layout make_layout(uint32_t seed, int runs) {
  std::mt19937 rng(seed);
  Layout l;
  l.device.assign(1 << 20, 0);
  uint64_t at = 0;
  for (int r = 0; r < runs; ++r) {
    StagedRun run;
    std::vector<uint8_t> bytes;
    if (r % 2 == 0) {  // contiguous
      const uint64_t n = 1 + rng() % 40000;
      run.places.push_back(DevicePlace{l.device.data() + at, n});
      at += n + 64;
    } else {  // a strided box: rows of width at a pitch
      const uint64_t width = 16 + rng() % 200, rows = 1 + rng() % 100, pitch = width + rng() % 50;
      for (uint64_t y = 0; y < rows; ++y) run.places.push_back(DevicePlace{l.device.data() + at + y * pitch, width});
      at += rows * pitch + 64;
    }
    bytes.resize(run.bytes());
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() | 1);  // never 0, the device's initial bytes
    l.remote.push_back(std::move(bytes));
    l.runs.push_back(std::move(run));
  }
  return l;
}

// Whether pred(device, remote, n) holds for every piece of chunk `c`: n
// bytes at its device places and the same bytes of the run on the network.
template <class Pred>
bool every_piece(const Layout& l, const StagedChunk& c, Pred pred) {
  uint64_t at = 0;  // offset in the run of the current place
  const uint64_t end = c.offset + c.bytes;
  for (const DevicePlace& p : l.runs[c.run].places) {
    const uint64_t lo = std::max(at, c.offset), hi = std::min(at + p.bytes, end);
    if (lo < hi && !pred(p.data + (lo - at), l.remote[c.run].data() + lo, hi - lo)) return false;
    at += p.bytes;
  }
  return true;
}

// Whether the bytes of chunk `c` are at its device places.
bool chunk_in_place(const Layout& l, const StagedChunk& c) {
  return every_piece(l, c, [](const uint8_t* d, const uint8_t* r, uint64_t n) { return std::memcmp(d, r, n) == 0; });
}

// Whether the device places of chunk `c` still hold their initial zeros.
bool chunk_untouched(const Layout& l, const StagedChunk& c) {
  return every_piece(l, c, [](const uint8_t* d, const uint8_t*, uint64_t n) {
    return std::all_of(d, d + n, [](uint8_t b) { return b == 0; });
  });
}

// Whether every byte of run r is at its device places.
bool run_in_place(const Layout& l, size_t r) {
  uint64_t at = 0;
  for (const DevicePlace& p : l.runs[r].places) {
    if (std::memcmp(p.data, l.remote[r].data() + at, p.bytes) != 0) return false;
    at += p.bytes;
  }
  return true;
}

// A network that behaves like the UCX GET engine behind the ring's gate:
// its threads take the chunks in index order, each waits until the ring
// gives its chunk a slot, and lands it after a delay that differs from
// chunk to chunk (so that chunks land out of order) by copying the run's
// bytes into that slot. The last thread out of chunks calls network_over(),
// as the engine does when its batch returns.
class GatedNetwork {
 public:
  struct Options {
    int threads = 3;
    std::chrono::microseconds delay{50};
    int64_t fail_at = -1;    // this chunk lands with an error; the others still land
    int64_t land_from = -1;  // chunks from this one on are taken and never land
    // This chunk, once it has its slot, lands only after every other chunk
    // has landed (a slow source): the others must not wait for its slot.
    int64_t slow = -1;
    // Checks, as each chunk gets a slot, that the chunk that had the slot
    // before is at its device places: then each slot holds one chunk at a
    // time. Only while no chunk failed: after a failure the gate opens for
    // every chunk on purpose.
    bool check_slots = false;
  };

  GatedNetwork(LandingRing& ring, const Layout& layout, uint32_t slots, Options options)
      : ring_(ring), layout_(layout), slots_(slots), options_(options),
        patience_(Clock::now() + std::chrono::seconds(4)) {
    for (int i = 0; i < options_.threads; ++i) threads_.emplace_back([this] { serve(); });
  }
  ~GatedNetwork() { join(); }
  void join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  uint64_t started() const { return started_.load(); }
  // Chunks that landed after the failing chunk (fail_at) was reported.
  std::vector<uint32_t> after_failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return after_failure_;
  }
  // Chunks that got a slot while the chunk before them in it was not yet at
  // its device places (check_slots).
  uint64_t early_starts() const { return early_starts_.load(); }
  // Chunks whose gate was still shut when the network's patience (4 s for
  // all chunks together) ran out; each landed as a timeout.
  uint64_t gate_timeouts() const { return gate_timeouts_.load(); }
  // The slow chunk (Options::slow) landed last, after every other one.
  bool slow_was_last() const { return slow_last_.load(); }

 private:
  void serve() {
    const std::vector<StagedChunk>& chunks = ring_.chunks();
    while (true) {
      const uint32_t k = next_.fetch_add(1);
      if (k >= chunks.size()) break;
      if (options_.land_from >= 0 && k >= options_.land_from) continue;
      bool open = true;
      void* slot = nullptr;
      while (!ring_.acquire(k, &slot)) {
        if (Clock::now() >= patience_) {
          open = false;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(5));
      }
      if (!open) {
        ++gate_timeouts_;
        ring_.landed(k, Status::timeout("fake network: chunk " + std::to_string(k) + " never got its slot"));
        continue;
      }
      ++started_;
      if (slot != ring_.slot_of(k)) ++early_starts_;  // the ring must say where it put the chunk
      if (options_.check_slots) {
        std::lock_guard<std::mutex> lock(mu_);
        auto [prev, fresh] = last_in_slot_.emplace(slot, k);
        if (!fresh && !chunk_in_place(layout_, chunks[prev->second])) ++early_starts_;
        prev->second = k;
      }
      std::this_thread::sleep_for(options_.delay * (1 + (k * 7) % 4));
      if (k == options_.slow) {
        while (landed_.load() + 1 < chunks.size() && Clock::now() < patience_) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        slow_last_ = landed_.load() + 1 == chunks.size();
      }
      if (k == options_.fail_at) {
        ring_.landed(k, Status::io_error("fake network: the peer went away"));
        failure_reported_ = true;
        continue;
      }
      const StagedChunk& c = chunks[k];
      {
        // After a failure the ring's gate sends every chunk to its first
        // slot, whose bytes are dropped (staging.h, acquire()). A NIC may
        // land several there at once; two threads memcpy'ing into one
        // buffer would be a data race in C++'s terms, so here they take
        // turns. A chunk that owns the first slot takes the lock alone.
        std::unique_lock<std::mutex> drain(drain_mu_, std::defer_lock);
        if (slot == ring_.base()) drain.lock();
        std::memcpy(slot, layout_.remote[c.run].data() + c.offset, c.bytes);
      }
      if (failure_reported_) {
        std::lock_guard<std::mutex> lock(mu_);
        after_failure_.push_back(k);
      }
      ring_.landed(k, Status::ok());
      ++landed_;
    }
    if (++finished_ == options_.threads) ring_.network_over();
  }

  LandingRing& ring_;
  const Layout& layout_;
  const uint32_t slots_;
  const Options options_;
  const Clock::time_point patience_;
  std::atomic<uint32_t> next_{0};
  std::atomic<int> finished_{0};
  std::atomic<uint64_t> started_{0}, early_starts_{0}, gate_timeouts_{0};
  std::atomic<bool> failure_reported_{false};
  std::atomic<uint64_t> landed_{0};
  std::atomic<bool> slow_last_{false};
  mutable std::mutex mu_;
  std::mutex drain_mu_;                          // writes into the first slot
  std::vector<uint32_t> after_failure_;          // guarded by mu_
  std::map<void*, uint32_t> last_in_slot_;       // guarded by mu_
  std::vector<std::thread> threads_;
};

uint64_t places_of(const Layout& l) {
  uint64_t n = 0;
  for (const StagedRun& r : l.runs) n += r.places.size();
  return n;
}

TEST(LandingRing, LandsEveryRunThroughFewerSlotsThanChunksAndOverlapsCopiesWithTheNetwork) {
  Layout l = make_layout(3, 12);
  // Copies slower than the network: the ring fills.
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops(std::chrono::microseconds(100));
  HostCopyOps& ops = *ops_owner;
  const StagingOptions options{4096, 4};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  const size_t chunks = (*ring)->chunks().size();
  ASSERT_GT(chunks, 4u * options.slots);
  GatedNetwork::Options net_options;
  net_options.check_slots = true;
  GatedNetwork net(**ring, l, options.slots, net_options);
  std::vector<int> done(l.runs.size(), 0);
  std::atomic<int> wakes{0};
  Status st = (*ring)->run([&](uint32_t r) { ++done[r]; }, [&] { ++wakes; }, /*release_on_issue=*/false,
                           Clock::now() + std::chrono::seconds(30));
  net.join();
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(net.started(), chunks);
  EXPECT_EQ(net.gate_timeouts(), 0u);
  for (size_t r = 0; r < l.runs.size(); ++r) {
    EXPECT_EQ(done[r], 1) << "run " << r;
    EXPECT_TRUE(run_in_place(l, r)) << "run " << r;
  }
  EXPECT_EQ(net.early_starts(), 0u) << "a chunk got a slot whose previous chunk was still being copied";
  EXPECT_GT(wakes.load(), 0);
  const StagingStats& s = (*ring)->stats();
  EXPECT_EQ(s.chunks, chunks);
  EXPECT_GT(s.overlapped, 0u) << "no copy ran while the network still had chunks to land";
  EXPECT_GT(s.held, 0u) << "the gate never held a chunk back: the ring was never full";
  EXPECT_LE(s.held, s.chunks) << "held counts chunks, not refusals";
  EXPECT_GE(s.max_in_copy, 1u);
  EXPECT_LE(s.max_in_copy, options.slots);
  // Strided runs were coalesced: fewer copies than places.
  EXPECT_LT(s.copies, places_of(l));
}

TEST(LandingRing, ReleaseOnIssueTellsEachRunOnceAndStillLandsEveryByte) {
  Layout l = make_layout(7, 10);
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops(std::chrono::microseconds(50));
  HostCopyOps& ops = *ops_owner;
  const StagingOptions options{4096, 3};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  GatedNetwork::Options net_options;
  net_options.check_slots = true;
  GatedNetwork net(**ring, l, options.slots, net_options);
  std::vector<int> done(l.runs.size(), 0);
  Status st = (*ring)->run([&](uint32_t r) { ++done[r]; }, {}, /*release_on_issue=*/true,
                           Clock::now() + std::chrono::seconds(30));
  net.join();
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(net.early_starts(), 0u);
  // run() waited for the copies it had issued: every byte is in place now.
  for (size_t r = 0; r < l.runs.size(); ++r) {
    EXPECT_EQ(done[r], 1) << "run " << r;
    EXPECT_TRUE(run_in_place(l, r)) << "run " << r;
  }
}

TEST(LandingRing, ANetworkErrorEndsTheRunWithThatErrorAndOpensTheGate) {
  Layout l = make_layout(9, 10);
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops(std::chrono::microseconds(200));
  HostCopyOps& ops = *ops_owner;
  const StagingOptions options{4096, 4};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  const std::vector<StagedChunk>& chunks = (*ring)->chunks();
  // Chunk fail_at's slot is never copied out; the failure makes run()
  // return an error and, once its copies are done, open the gate for every
  // chunk. Many chunks lie beyond.
  const uint32_t fail_at = 5;
  GatedNetwork::Options net_options;
  net_options.fail_at = fail_at;
  net_options.delay = std::chrono::microseconds(20);
  ASSERT_GT(chunks.size(), fail_at + 2u * options.slots * net_options.threads);
  GatedNetwork net(**ring, l, options.slots, net_options);
  std::vector<int> done(l.runs.size(), 0);
  const auto t0 = Clock::now();
  Status st = (*ring)->run([&](uint32_t r) { ++done[r]; }, {}, false, Clock::now() + std::chrono::seconds(30));
  const auto took = Clock::now() - t0;
  net.join();
  EXPECT_EQ(st.code(), Code::kIoError) << st.message();
  EXPECT_NE(st.message().find("peer went away"), std::string::npos) << st.message();
  // Every chunk got through the gate, none waited out the network's
  // patience: the failure opened the gate.
  EXPECT_EQ(net.gate_timeouts(), 0u);
  EXPECT_EQ(net.started(), chunks.size());
  EXPECT_LT(took, std::chrono::seconds(2));
  for (uint32_t k = 0; k < chunks.size(); ++k) {
    void* slot = nullptr;
    EXPECT_TRUE((*ring)->acquire(k, &slot)) << "chunk " << k;
  }
  // What landed after the failure was not copied, and its run is not done.
  const std::vector<uint32_t> late = net.after_failure();
  EXPECT_FALSE(late.empty());
  for (uint32_t k : late) {
    EXPECT_TRUE(chunk_untouched(l, chunks[k])) << "chunk " << k;
    EXPECT_EQ(done[chunks[k].run], 0) << "chunk " << k;
  }
}

TEST(LandingRing, ACopyErrorEndsTheRunAndTheNetworkDrains) {
  Layout l = make_layout(13, 4);
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops();
  HostCopyOps& ops = *ops_owner;
  ops.fail_next_copy();
  const StagingOptions options{4096, 2};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  ASSERT_GT((*ring)->chunks().size(), 2u * options.slots);
  GatedNetwork net(**ring, l, options.slots, GatedNetwork::Options{});
  Status st = (*ring)->run([](uint32_t) {}, {}, false, Clock::now() + std::chrono::seconds(30));
  net.join();
  EXPECT_EQ(st.code(), Code::kIoError) << st.message();
  EXPECT_NE(st.message().find("failing as the test asked"), std::string::npos) << st.message();
  EXPECT_EQ(net.gate_timeouts(), 0u);
  EXPECT_EQ(net.started(), (*ring)->chunks().size());
}

TEST(LandingRing, ChunksThatNeverLandedAreAnError) {
  Layout l = make_layout(17, 4);
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops();
  HostCopyOps& ops = *ops_owner;
  const StagingOptions options{4096, 4};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  const int64_t chunks = static_cast<int64_t>((*ring)->chunks().size());
  ASSERT_GT(chunks, 2);
  GatedNetwork::Options net_options;
  net_options.land_from = chunks - 2;
  GatedNetwork net(**ring, l, options.slots, net_options);
  Status st = (*ring)->run([](uint32_t) {}, {}, false, Clock::now() + std::chrono::seconds(30));
  net.join();
  EXPECT_EQ(st.code(), Code::kInternal) << st.message();
  EXPECT_NE(st.message().find("2 chunk(s) never landed"), std::string::npos) << st.message();
}

// Any chunk takes any free slot, in whatever order the network asks; with
// every slot taken, the next chunk waits.
TEST(LandingRing, AnyChunkTakesAnyFreeSlot) {
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops();
  HostCopyOps& ops = *ops_owner;
  std::vector<uint8_t> device(64 << 10), host(2 * 4096);
  std::vector<StagedRun> runs = {StagedRun{{DevicePlace{device.data(), 5 * 4096}}}};
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, StagingOptions{4096, 2}, runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  ASSERT_EQ((*ring)->chunks().size(), 5u);
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  ASSERT_TRUE((*ring)->acquire(3, &a));
  ASSERT_TRUE((*ring)->acquire(1, &b));
  EXPECT_FALSE((*ring)->acquire(0, &c));
  EXPECT_FALSE((*ring)->acquire(0, &c));  // asked again: still one chunk held
  EXPECT_NE(a, b);
  for (void* p : {a, b}) {
    const uint8_t* q = static_cast<uint8_t*>(p);
    EXPECT_TRUE(q == host.data() || q == host.data() + 4096);
  }
  EXPECT_EQ((*ring)->slot_of(3), a);
  EXPECT_EQ((*ring)->slot_of(1), b);
  EXPECT_EQ((*ring)->stats().held, 1u);
}

// A slow source: one chunk keeps its slot until every other chunk has
// landed, and the others go on through the remaining slots meanwhile.
TEST(LandingRing, ASlowChunkHoldsOnlyItsOwnSlot) {
  Layout l = make_layout(21, 8);
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops();
  HostCopyOps& ops = *ops_owner;
  const StagingOptions options{4096, 3};
  std::vector<uint8_t> host(options.slots * options.slot_bytes);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, options, l.runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  ASSERT_GT((*ring)->chunks().size(), 4u * options.slots);
  GatedNetwork::Options net_options;
  net_options.slow = 1;
  net_options.check_slots = true;
  net_options.delay = std::chrono::microseconds(10);
  GatedNetwork net(**ring, l, options.slots, net_options);
  std::vector<int> done(l.runs.size(), 0);
  Status st = (*ring)->run([&](uint32_t r) { ++done[r]; }, {}, false, Clock::now() + std::chrono::seconds(30));
  net.join();
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_TRUE(net.slow_was_last()) << "the other chunks waited for the slow chunk's slot";
  EXPECT_EQ(net.gate_timeouts(), 0u);
  EXPECT_EQ(net.early_starts(), 0u);
  for (size_t r = 0; r < l.runs.size(); ++r) {
    EXPECT_EQ(done[r], 1) << "run " << r;
    EXPECT_TRUE(run_in_place(l, r)) << "run " << r;
  }
}

TEST(LandingRing, BadOptionsAreRefusedWithTheirName) {
  std::unique_ptr<HostCopyOps> ops_owner = host_copy_ops();
  HostCopyOps& ops = *ops_owner;
  std::vector<uint8_t> host(4096);
  Layout l = make_layout(19, 2);
  Result<std::unique_ptr<LandingRing>> ring = LandingRing::create(ops, host, StagingOptions{0, 4}, l.runs);
  ASSERT_FALSE(ring.is_ok());
  EXPECT_NE(ring.status().message().find("slot_bytes"), std::string::npos) << ring.status().message();
  ring = LandingRing::create(ops, host, StagingOptions{4096, 1}, l.runs);
  ASSERT_FALSE(ring.is_ok());
  EXPECT_NE(ring.status().message().find("slots"), std::string::npos) << ring.status().message();
  ring = LandingRing::create(ops, host, StagingOptions{4096, 4}, l.runs);
  ASSERT_FALSE(ring.is_ok());
  EXPECT_NE(ring.status().message().find("staging memory"), std::string::npos) << ring.status().message();
}

TEST(Landing, DeviceMemoryUcxCannotReachGoesThroughStaging) {
  EXPECT_EQ(choose_landing(false, false), Landing::kDirect);
  EXPECT_EQ(choose_landing(true, true), Landing::kDirect);
  EXPECT_EQ(choose_landing(true, false), Landing::kStaged);
  EXPECT_STREQ(landing_name(Landing::kStaged), "staged");
}

}  // namespace
}  // namespace refit::cuda

// The driver probe makes no CUDA context and calls host memory host memory,
// with a driver (a GPU machine) or without one (then there is no GPU memory).
namespace refit::cuda {
namespace {
TEST(PointerProbe, HostMemoryIsHostMemory) {
  std::vector<uint8_t> heap(1 << 20);
  int stack = 0;
  EXPECT_FALSE(probe_pointer(heap.data()).device);
  EXPECT_FALSE(probe_pointer(&stack).device);
  EXPECT_FALSE(probe_pointer(nullptr).device);
  EXPECT_EQ(probe_pointer(heap.data()).ordinal, -1);
}
// The copy thread starts in create(): refused, create() says so.
TEST(HostCopyOps, ACopyThreadThatCannotStartFailsCreate) {
  Result<std::unique_ptr<HostCopyOps>> ops =
      HostCopyOps::create(std::chrono::microseconds(0), ThreadFactory::refusing_after(0));
  ASSERT_FALSE(ops.is_ok());
  EXPECT_EQ(ops.status().reason(), Reason::kNoThread);
  EXPECT_NE(ops.status().message().find("cannot start the host copy thread"), std::string::npos)
      << ops.status().message();
}

}  // namespace
}  // namespace refit::cuda
