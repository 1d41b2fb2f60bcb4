// The GPU path on a GPU: landing GETs in device memory through the pinned
// landing ring, the copy planner's 2-D/3-D copies, and the NCCL fabric over real
// communicators. Suite 'gpu'; every test skips with the reason where the
// machine has no usable GPU. NoGpu.* runs everywhere (suite 'fabric'): the
// bad-input answers on a machine without one.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "fanout_case.h"
#include "ring_network.h"
#include "transport/cuda/cuda_copy_ops.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/nccl_comm.h"
#include "transport/cuda/staging.h"
#include "transport/fabric/nccl_fabric.h"

namespace refit {
namespace {

int device_count() {
  if (!cuda::probe_device().is_ok()) return 0;
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NoGpu, EveryEntryPointAnswersWithAClearStatus) {
  const Status probe = cuda::probe_device();
  if (probe.is_ok()) {
    GTEST_SKIP() << "this machine has a GPU: the gpu suite covers it";
  }
  EXPECT_TRUE(probe.code() == Code::kUnsupported || probe.code() == Code::kIoError) << probe.message();
  EXPECT_FALSE(probe.message().empty());
  std::cout << "probe: " << probe.message() << "\n";
  Result<std::unique_ptr<cuda::CudaCopyOps>> ops = cuda::CudaCopyOps::create(0);
  EXPECT_FALSE(ops.is_ok());
  Result<std::unique_ptr<cuda::CommFactory>> f = cuda::nccl_comm_factory(0, nullptr);
  EXPECT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().message(), probe.message());
  int host = 0;
  Result<bool> dev = cuda::is_device_pointer(&host);
  EXPECT_TRUE(!dev.is_ok() || !*dev);
  // Not every cudaError_t is fatal to the caller: the conversion keeps the name.
  const Status s = cuda::from_cuda(cudaErrorMemoryAllocation, "cudaMalloc(8 bytes)");
  EXPECT_NE(s.message().find("cudaErrorMemoryAllocation"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("cudaMalloc(8 bytes)"), std::string::npos);
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status probe = cuda::probe_device();
    if (!probe.is_ok()) GTEST_SKIP() << "no usable GPU: " << probe.message();
  }
};

// The chunks' bytes on the "network" side: run r's are remote[r].
cuda::RingNetwork::BytesOf from(const std::vector<std::vector<uint8_t>>& remote) {
  return [&remote](const cuda::StagedChunk& c) { return remote[c.run].data() + c.offset; };
}

TEST_F(Gpu, StagingLandsStridedRunsInDeviceMemoryAndReadsThemBack) {
  Result<cuda::DeviceBuffer> dev = cuda::DeviceBuffer::allocate(0, 8 << 20);
  ASSERT_TRUE(dev.is_ok()) << dev.status().message();
  Result<bool> is_dev = cuda::is_device_pointer(dev->data());
  ASSERT_TRUE(is_dev.is_ok() && *is_dev);
  EXPECT_EQ(cuda::choose_landing(*is_dev, /*ucx_reports_cuda=*/false), cuda::Landing::kStaged);
  Result<std::unique_ptr<cuda::CudaCopyOps>> ops = cuda::CudaCopyOps::create(0);
  ASSERT_TRUE(ops.is_ok()) << ops.status().message();
  Result<cuda::PinnedBuffer> slots = cuda::PinnedBuffer::allocate(4 << 20);
  ASSERT_TRUE(slots.is_ok()) << slots.status().message();
  std::mt19937 rng(3);
  std::vector<cuda::StagedRun> runs;
  std::vector<std::vector<uint8_t>> remote;
  uint64_t at = 0;
  for (int r = 0; r < 10; ++r) {
    cuda::StagedRun run;
    const uint64_t width = 64 + rng() % 512, rows = 1 + rng() % 300, pitch = width + rng() % 128;
    for (uint64_t y = 0; y < rows; ++y) run.places.push_back(cuda::DevicePlace{dev->data() + at + y * pitch, width});
    at += rows * pitch + 256;
    std::vector<uint8_t> bytes(run.bytes());
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    remote.push_back(std::move(bytes));
    runs.push_back(std::move(run));
  }
  ASSERT_LT(at, dev->bytes());
  Result<std::unique_ptr<cuda::LandingRing>> ring = cuda::LandingRing::create(
      **ops, std::span<uint8_t>(slots->data(), slots->bytes()), cuda::StagingOptions{1 << 20, 4}, runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  ASSERT_GT((*ring)->chunks().size(), 4u);  // more chunks than slots: slots are reused
  std::vector<int> done(runs.size(), 0);
  {
    cuda::RingNetwork net(**ring, from(remote), 3, std::chrono::seconds(10));
    Status st = (*ring)->run([&](uint32_t r) { ++done[r]; }, {}, /*release_on_issue=*/false,
                             cuda::Clock::now() + std::chrono::seconds(30));
    ASSERT_TRUE(st.is_ok()) << st.message();
  }
  for (size_t r = 0; r < runs.size(); ++r) EXPECT_EQ(done[r], 1) << "run " << r;
  // Read every place back from the device and compare.
  std::vector<std::vector<uint8_t>> back(remote.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    back[r].assign(remote[r].size(), 0);
    uint64_t k = 0;
    for (const cuda::DevicePlace& pl : runs[r].places) {
      ASSERT_TRUE(cuda::copy_now(back[r].data() + k, pl.data, pl.bytes).is_ok());
      k += pl.bytes;
    }
  }
  EXPECT_EQ(back, remote);
  EXPECT_LT((*ring)->stats().copies, 10u * 300u);
}

TEST_F(Gpu, IrregularPiecesGoThroughTheScatterKernel) {
  Result<cuda::DeviceBuffer> dev = cuda::DeviceBuffer::allocate(0, 4 << 20);
  ASSERT_TRUE(dev.is_ok()) << dev.status().message();
  Result<std::unique_ptr<cuda::CudaCopyOps>> ops = cuda::CudaCopyOps::create(0);
  ASSERT_TRUE(ops.is_ok()) << ops.status().message();
  Result<cuda::PinnedBuffer> slots = cuda::PinnedBuffer::allocate(2 << 20);
  ASSERT_TRUE(slots.is_ok());
  // One run of thousands of pieces of odd sizes at odd offsets: nothing to
  // coalesce, so without the kernel it would be one call per piece.
  std::mt19937 rng(8);
  cuda::StagedRun run;
  uint64_t at = 0;
  while (true) {
    const uint64_t width = 1 + rng() % 300;
    at += rng() % 37;
    if (at + width > dev->bytes()) break;
    run.places.push_back(cuda::DevicePlace{dev->data() + at, width});
    at += width;
  }
  std::vector<std::vector<uint8_t>> remote(1, std::vector<uint8_t>(run.bytes()));
  for (uint8_t& b : remote[0]) b = static_cast<uint8_t>(rng());
  std::vector<cuda::StagedRun> runs{run};
  Result<std::unique_ptr<cuda::LandingRing>> ring = cuda::LandingRing::create(
      **ops, std::span<uint8_t>(slots->data(), slots->bytes()), cuda::StagingOptions{256 << 10, 8}, runs);
  ASSERT_TRUE(ring.is_ok()) << ring.status().message();
  {
    cuda::RingNetwork net(**ring, from(remote), 3, std::chrono::seconds(10));
    Status st = (*ring)->run([](uint32_t) {}, {}, /*release_on_issue=*/false,
                             cuda::Clock::now() + std::chrono::seconds(30));
    ASSERT_TRUE(st.is_ok()) << st.message();
  }
  std::vector<uint8_t> got(dev->bytes());
  ASSERT_TRUE(cuda::copy_now(got.data(), dev->data(), got.size()).is_ok());
  uint64_t k = 0;
  for (const cuda::DevicePlace& pl : run.places) {
    ASSERT_EQ(std::memcmp(got.data() + (pl.data - dev->data()), remote[0].data() + k, pl.bytes), 0);
    k += pl.bytes;
  }
#ifdef REFIT_HAVE_SCATTER_KERNEL
  EXPECT_GT((*ops)->kernel_launches(), 0u);
#endif
}

#ifdef REFIT_HAVE_SCATTER_KERNEL
// launch_scatter itself: pieces from 1 byte to 3 MiB (split across blocks
// in 64 KiB chunks), source and destination sharing their alignment mod 16
// or not, launched after a runtime call left an error behind on this
// thread (as the round thread's cudaEventQuery leaves cudaErrorNotReady),
// and once with a max_bytes below the largest piece (fewer blocks, still
// every byte). Bytes between the pieces stay 0.
TEST_F(Gpu, TheScatterKernelMovesEveryByteOfLargeAndUnalignedPieces) {
  const std::vector<uint64_t> sizes = {1, 15, 16, 17, 4096, 65535, 65536, 65537, 1 << 20, (1 << 20) + 13, 3 << 20};
  const uint64_t bytes = 16 << 20;
  Result<cuda::DeviceBuffer> src = cuda::DeviceBuffer::allocate(0, bytes);
  Result<cuda::DeviceBuffer> dst = cuda::DeviceBuffer::allocate(0, bytes);
  ASSERT_TRUE(src.is_ok() && dst.is_ok());
  std::vector<uint8_t> host(bytes);
  std::mt19937 rng(11);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng() | 1);
  ASSERT_TRUE(cuda::copy_now(src->data(), host.data(), bytes).is_ok());
  void* t = nullptr;
  ASSERT_EQ(cudaHostAlloc(&t, sizes.size() * sizeof(cuda::ScatterPiece), cudaHostAllocPortable | cudaHostAllocMapped),
            cudaSuccess);
  auto* table = static_cast<cuda::ScatterPiece*>(t);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (uint64_t max_bytes : {uint64_t{3} << 20, uint64_t{1}}) {
    ASSERT_EQ(cudaMemset(dst->data(), 0, bytes), cudaSuccess);
    std::vector<uint8_t> want(bytes, 0);
    uint64_t s_at = 0, d_at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      s_at = (s_at + 15) / 16 * 16 + i % 16;                    // src offset i mod 16
      d_at = (d_at + 15) / 16 * 16 + (i % 2 ? i % 16 : 3);      // same alignment for odd i
      table[i] = cuda::ScatterPiece{dst->data() + d_at, src->data() + s_at, sizes[i]};
      std::memcpy(want.data() + d_at, host.data() + s_at, sizes[i]);
      s_at += sizes[i] + 5;
      d_at += sizes[i] + 7;
      ASSERT_LE(s_at, bytes);
      ASSERT_LE(d_at, bytes);
    }
    EXPECT_NE(cudaSetDevice(-1), cudaSuccess);  // leaves cudaErrorInvalidDevice as the last error
    EXPECT_EQ(cuda::launch_scatter(table, static_cast<uint32_t>(sizes.size()), max_bytes, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint8_t> got(bytes);
    ASSERT_TRUE(cuda::copy_now(got.data(), dst->data(), bytes).is_ok());
    EXPECT_TRUE(got == want) << "max_bytes " << max_bytes;
  }
  cudaStreamDestroy(stream);
  cudaFreeHost(t);
}
#endif

// The fan-out case on device buffers through real NCCL communicators, one
// rank per device (ranks > devices would put two ranks on one GPU, which
// NCCL refuses). `skip` ranks never begin.
void fan_out_on_devices(int ranks, uint32_t seed, std::chrono::milliseconds deadline,
                        const std::vector<int32_t>& skip, std::vector<Status>* out) {
  using fabric::testing::FanoutCase;
  using fabric::testing::RankFabric;
  FanoutCase c = fabric::testing::make_case(ranks, 4 << 20, 1 << 20, seed);
  if (ranks == 1) {
    c.plan.clear();
    for (uint64_t o = 0; o < c.half; o += 1 << 20) c.plan.push_back(fabric::testing::Transfer{0, 0, o, 1 << 20});
    for (uint64_t i = 0; i < c.half; ++i) c.expected[0][c.half + i] = c.start[0][i];
  }
  std::vector<cuda::DeviceBuffer> bufs;
  std::vector<uint8_t*> bases;
  std::vector<RankFabric> fabrics;
  const int devices = std::max(device_count(), 1);
  for (int r = 0; r < ranks; ++r) {
    Result<cuda::DeviceBuffer> b = cuda::DeviceBuffer::allocate(r % devices, 2 * c.half);
    ASSERT_TRUE(b.is_ok()) << b.status().message();
    ASSERT_TRUE(cuda::copy_now(b->data(), c.start[r].data(), 2 * c.half).is_ok());
    bases.push_back(b->data());
    bufs.push_back(std::move(b).value());
    Result<std::unique_ptr<cuda::CommFactory>> factory = cuda::nccl_comm_factory(r % devices, nullptr);
    ASSERT_TRUE(factory.is_ok()) << factory.status().message();
    fabric::NcclFabricConfig config;
    config.rank = r;
    Result<std::unique_ptr<fabric::NcclFabric>> f = fabric::NcclFabric::create(config, std::move(factory).value());
    ASSERT_TRUE(f.is_ok()) << f.status().message();
    RankFabric rf;
    rf.contact = (*f)->contact();
    rf.fabric = std::move(f).value();
    fabrics.push_back(std::move(rf));
  }
  std::vector<fabric::Schedule> schedules;
  for (int r = 0; r < ranks; ++r) schedules.push_back(fabric::testing::schedule_of(c, r, bases, fabrics, 1));
  *out = fabric::testing::run_refresh(fabrics, schedules, cuda::Clock::now() + deadline, seed, skip);
  for (int r = 0; r < ranks; ++r) {
    // A rank that never began (its status is left OK) wrote nothing to check.
    if (!(*out)[r].is_ok() || std::find(skip.begin(), skip.end(), r) != skip.end()) continue;
    std::vector<uint8_t> got(2 * c.half);
    ASSERT_TRUE(cuda::copy_now(got.data(), bases[r], got.size()).is_ok());
    EXPECT_EQ(got, c.expected[r]) << "rank " << r;
  }
}

TEST_F(Gpu, NcclFabricCopiesToItselfOnOneDevice) {
  std::vector<Status> st;
  fan_out_on_devices(1, 4, std::chrono::seconds(60), {}, &st);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_TRUE(st[0].is_ok()) << st[0].message();
  std::cout << "NCCL " << cuda::nccl_version() << "\n";
}

TEST_F(Gpu, NcclFabricFansOutAcrossDevices) {
  const int n = std::min(device_count(), 4);
  if (n < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << n;
  std::vector<Status> st;
  fan_out_on_devices(n, 5, std::chrono::seconds(120), {}, &st);
  for (int r = 0; r < n; ++r) EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].message();
}

TEST_F(Gpu, NcclFabricTimesOutOnARankThatNeverJoins) {
  // Two ranks of one domain, rank 1 never begins: rank 0's communicator
  // never completes and is aborted at the deadline.
  std::vector<Status> st;
  const auto t0 = cuda::Clock::now();
  fan_out_on_devices(2, 6, std::chrono::milliseconds(2000), {1}, &st);
  EXPECT_LT(cuda::Clock::now() - t0, std::chrono::seconds(30));
  ASSERT_FALSE(st.empty());
  EXPECT_EQ(st[0].code(), Code::kTimeout) << st[0].message();
}

}  // namespace
}  // namespace refit

// Under meson's 'gpu' suite (REFIT_GPU_SUITE set), a machine without a GPU
// reports the suite as skipped (exit 77), not as passed; the reason is in
// each test's skip message.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  if (rc == 0 && std::getenv("REFIT_GPU_SUITE") != nullptr) {
    const refit::Status probe = refit::cuda::probe_device();
    if (!probe.is_ok()) {
      std::cout << "gpu suite skipped: " << probe.message() << "\n";
      return 77;
    }
  }
  return rc;
}
