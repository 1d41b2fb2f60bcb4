// refit-staging-bench: how fast the landing ring moves bytes into device
// memory, beside the plain cudaMemcpy from pinned memory (the limit of the
// copy stage). The "network" is host threads that take the chunks in order,
// wait at the ring's gate like the GET engine, and copy each chunk from
// pageable host memory into its pinned slot, the way a GET lands in it.
//   refit_staging_bench [MiB] [slot KiB] [slots]   (default 1024 4096 4)
// Prints one JSON line.

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "ring_network.h"
#include "transport/cuda/cuda_copy_ops.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/staging.h"

using namespace refit;
using Clock = std::chrono::steady_clock;

namespace {

int fail(const Status& s) {
  std::cerr << "refit-staging-bench: " << s.message() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  const uint64_t slot = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 4096) << 10;
  const uint32_t slots = argc > 3 ? static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10)) : 4;
  Status probe = cuda::probe_device();
  if (!probe.is_ok()) return fail(probe);
  Result<cuda::DeviceBuffer> dev = cuda::DeviceBuffer::allocate(0, bytes);
  if (!dev.is_ok()) return fail(dev.status());
  Result<cuda::PinnedBuffer> ring = cuda::PinnedBuffer::allocate(slot * slots);
  if (!ring.is_ok()) return fail(ring.status());
  Result<std::unique_ptr<cuda::CudaCopyOps>> ops = cuda::CudaCopyOps::create(0);
  if (!ops.is_ok()) return fail(ops.status());
  std::vector<uint8_t> source(bytes);
  for (uint64_t i = 0; i < bytes; i += 8) {
    const uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(source.data() + i, &v, std::min<uint64_t>(8, bytes - i));
  }
  // 16 runs of equal size, contiguous on the device.
  std::vector<cuda::StagedRun> runs;
  const uint64_t per = bytes / 16;
  for (uint64_t r = 0; r < 16; ++r) {
    runs.push_back(cuda::StagedRun{{cuda::DevicePlace{dev->data() + r * per, r == 15 ? bytes - 15 * per : per}}});
  }
  const std::span<uint8_t> host(ring->data(), ring->bytes());
  const cuda::StagingOptions options{slot, slots};
  // A ring serves one batch: a fresh one per repetition.
  cuda::StagingStats stats;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    Result<std::unique_ptr<cuda::LandingRing>> landing = cuda::LandingRing::create(**ops, host, options, runs);
    if (!landing.is_ok()) return fail(landing.status());
    const auto t0 = Clock::now();
    Status st;
    {
      cuda::RingNetwork net(
          **landing, [&](const cuda::StagedChunk& c) { return source.data() + c.run * per + c.offset; },
          static_cast<int>(std::min<uint32_t>(slots, 8)), std::chrono::seconds(60));
      st = (*landing)->run([](uint32_t) {}, {}, /*release_on_issue=*/false, Clock::now() + std::chrono::seconds(120));
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!st.is_ok()) return fail(st);
    best = std::max(best, bytes / s / 1e9);
    stats = (*landing)->stats();
  }
  // Check a sample.
  std::vector<uint8_t> back(std::min<uint64_t>(bytes, 64 << 20));
  Status st = cuda::copy_now(back.data(), dev->data() + bytes - back.size(), back.size());
  if (!st.is_ok()) return fail(st);
  const bool ok = std::memcmp(back.data(), source.data() + bytes - back.size(), back.size()) == 0;
  // The copy stage's limit: one cudaMemcpy from pinned memory.
  Result<cuda::PinnedBuffer> pinned = cuda::PinnedBuffer::allocate(bytes);
  double h2d = 0;
  if (pinned.is_ok()) {
    std::memcpy(pinned->data(), source.data(), bytes);
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = Clock::now();
      if (!cuda::copy_now(dev->data(), pinned->data(), bytes).is_ok()) break;
      h2d = std::max(h2d, bytes / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
    }
  }
  const cuda::StagingStats& s = stats;
  std::printf(
      "{\"bytes\": %llu, \"slot_bytes\": %llu, \"slots\": %u, \"staged_GBps\": %.2f, \"pinned_h2d_GBps\": %.2f, "
      "\"chunks\": %llu, \"max_in_copy\": %u, \"overlapped\": %llu, \"held\": %llu, \"verified\": %s}\n",
      static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(slot), slots, best, h2d,
      static_cast<unsigned long long>(s.chunks), s.max_in_copy, static_cast<unsigned long long>(s.overlapped),
      static_cast<unsigned long long>(s.held), ok ? "true" : "false");
  return ok ? 0 : 1;
}
