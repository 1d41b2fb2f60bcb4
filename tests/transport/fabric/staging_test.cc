#include "transport/cuda/staging.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "transport/cuda/host_copy_ops.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::cuda {
namespace {


// A network that serves each chunk on a thread of its own after a delay:
// kToDevice copies the chunk's bytes from `remote` into the slot, kFromDevice
// copies the slot out to `remote`. Chunks finish out of order.
class HostNetwork {
 public:
  HostNetwork(std::vector<std::vector<uint8_t>>& remote, std::chrono::microseconds delay, Direction direction)
      : remote_(remote), delay_(delay), direction_(direction) {}
  ~HostNetwork() {
    for (std::thread& t : threads_) t.join();
  }
  StagingPipeline::Network stage() {
    return [this](const StagedChunk& c, uint8_t* slot, std::function<void(Status)> done) -> Status {
      if (fail_after_ >= 0 && issued_++ >= fail_after_) {
        threads_.emplace_back([done] { done(Status::io_error("host network: the peer went away")); });
        return Status::ok();
      }
      if (never_) return Status::ok();  // accepted, never finishes (a hung peer)
      const auto delay = delay_ * (1 + (c.offset / 4096) % 3);
      threads_.emplace_back([this, c, slot, done, delay] {
        std::this_thread::sleep_for(delay);
        uint8_t* r = remote_[c.run].data() + c.offset;
        if (direction_ == Direction::kToDevice) {
          std::memcpy(slot, r, c.bytes);
        } else {
          std::memcpy(r, slot, c.bytes);
        }
        done(Status::ok());
      });
      return Status::ok();
    };
  }
  int fail_after_ = -1;
  bool never_ = false;

 private:
  std::vector<std::vector<uint8_t>>& remote_;
  std::chrono::microseconds delay_;
  Direction direction_;
  int issued_ = 0;
  std::vector<std::thread> threads_;
};

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
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng() | 1);
    l.remote.push_back(std::move(bytes));
    l.runs.push_back(std::move(run));
  }
  return l;
}

TEST(StagingPipeline, LandsEveryRunThroughTheSlotsAndOverlapsCopiesWithTheNetwork) {
  Layout l = make_layout(3, 12);
  HostCopyOps ops(std::chrono::microseconds(100));
  std::vector<uint8_t> host(4 * 4096);
  StagingOptions options;
  options.slot_bytes = 4096;
  options.slots = 4;
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, options);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  HostNetwork net(l.remote, std::chrono::microseconds(200), Direction::kToDevice);
  std::vector<int> done(l.runs.size(), 0);
  Status st = (*p)->run(Direction::kToDevice, l.runs, net.stage(), [&](uint32_t r) { ++done[r]; },
                        Clock::now() + std::chrono::seconds(30));
  ASSERT_TRUE(st.is_ok()) << st.message();
  for (size_t r = 0; r < l.runs.size(); ++r) {
    EXPECT_EQ(done[r], 1) << "run " << r;
    uint64_t at = 0;
    for (const DevicePlace& pl : l.runs[r].places) {
      ASSERT_EQ(std::memcmp(pl.data, l.remote[r].data() + at, pl.bytes), 0) << "run " << r;
      at += pl.bytes;
    }
  }
  const StagingStats& s = (*p)->stats();
  EXPECT_GT(s.overlapped, 0u) << "no copy ran while the network had a chunk in flight";
  EXPECT_LE(s.max_in_network + 0u, options.slots);
  EXPECT_GE(s.max_in_network, 2u);
  // Strided runs were coalesced: fewer copies than places.
  uint64_t places = 0;
  for (const StagedRun& r : l.runs) places += r.places.size();
  EXPECT_LT(s.copies, places);
}

TEST(StagingPipeline, FromTheDeviceCopiesFirstThenSends) {
  Layout l = make_layout(5, 8);
  std::mt19937 rng(1);
  for (uint8_t& b : l.device) b = static_cast<uint8_t>(rng());
  HostCopyOps ops;
  std::vector<uint8_t> host(3 * 8192);
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, StagingOptions{8192, 3});
  ASSERT_TRUE(p.is_ok());
  HostNetwork net(l.remote, std::chrono::microseconds(50), Direction::kFromDevice);
  Status st = (*p)->run(Direction::kFromDevice, l.runs, net.stage(), [](uint32_t) {},
                        Clock::now() + std::chrono::seconds(30));
  ASSERT_TRUE(st.is_ok()) << st.message();
  for (size_t r = 0; r < l.runs.size(); ++r) {
    uint64_t at = 0;
    for (const DevicePlace& pl : l.runs[r].places) {
      ASSERT_EQ(std::memcmp(pl.data, l.remote[r].data() + at, pl.bytes), 0) << "run " << r;
      at += pl.bytes;
    }
  }
}

TEST(StagingPipeline, ANetworkErrorEndsTheRunWithThatError) {
  Layout l = make_layout(9, 6);
  HostCopyOps ops;
  std::vector<uint8_t> host(4 * 4096);
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, StagingOptions{4096, 4});
  ASSERT_TRUE(p.is_ok());
  HostNetwork net(l.remote, std::chrono::microseconds(10), Direction::kToDevice);
  net.fail_after_ = 5;
  Status st = (*p)->run(Direction::kToDevice, l.runs, net.stage(), [](uint32_t) {},
                        Clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(st.code(), Code::kIoError);
  EXPECT_NE(st.message().find("peer went away"), std::string::npos) << st.message();
}

TEST(StagingPipeline, AHungNetworkIsATimeoutAtTheDeadline) {
  Layout l = make_layout(11, 3);
  HostCopyOps ops;
  std::vector<uint8_t> host(2 * 4096);
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, StagingOptions{4096, 2});
  ASSERT_TRUE(p.is_ok());
  HostNetwork net(l.remote, std::chrono::microseconds(10), Direction::kToDevice);
  net.never_ = true;
  const auto t0 = Clock::now();
  Status st = (*p)->run(Direction::kToDevice, l.runs, net.stage(), [](uint32_t) {},
                        Clock::now() + std::chrono::milliseconds(200));
  EXPECT_EQ(st.code(), Code::kTimeout) << st.message();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
}

TEST(StagingPipeline, ACopyErrorEndsTheRun) {
  Layout l = make_layout(13, 4);
  HostCopyOps ops;
  ops.fail_next_copy();
  std::vector<uint8_t> host(2 * 4096);
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, StagingOptions{4096, 2});
  ASSERT_TRUE(p.is_ok());
  HostNetwork net(l.remote, std::chrono::microseconds(10), Direction::kToDevice);
  Status st = (*p)->run(Direction::kToDevice, l.runs, net.stage(), [](uint32_t) {},
                        Clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(st.code(), Code::kIoError) << st.message();
}

TEST(StagingPipeline, BadOptionsAreRefusedWithTheirName) {
  HostCopyOps ops;
  std::vector<uint8_t> host(4096);
  Result<std::unique_ptr<StagingPipeline>> p = StagingPipeline::create(ops, host, StagingOptions{0, 4});
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("slot_bytes"), std::string::npos);
  p = StagingPipeline::create(ops, host, StagingOptions{4096, 1});
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("slots"), std::string::npos);
  p = StagingPipeline::create(ops, host, StagingOptions{4096, 4});
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("staging memory"), std::string::npos);
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
}  // namespace
}  // namespace refit::cuda
