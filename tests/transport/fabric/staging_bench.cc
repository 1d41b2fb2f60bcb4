// refit-staging-bench: how fast the staging pipeline moves bytes into device
// memory, beside the plain cudaMemcpy from pinned memory (the limit of the
// copy stage). The "network" is host threads copying from pageable host
// memory into the pinned slots, the way a GET lands in them.
//   refit_staging_bench [MiB] [slot KiB] [slots]   (default 1024 4096 4)
// Prints one JSON line.

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <mutex>
#include <thread>

#include "transport/cuda/cuda_copy_ops.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/staging.h"

using namespace refit;
using Clock = std::chrono::steady_clock;

namespace {

// A few threads standing in for the NIC.
class Network {
 public:
  explicit Network(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Network() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

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
  Result<std::unique_ptr<cuda::StagingPipeline>> p = cuda::StagingPipeline::create(
      **ops, std::span<uint8_t>(ring->data(), ring->bytes()), cuda::StagingOptions{slot, slots});
  if (!p.is_ok()) return fail(p.status());
  Network net(static_cast<int>(slots));
  auto stage = [&](const cuda::StagedChunk& c, uint8_t* s, std::function<void(Status)> done) {
    const uint8_t* from = source.data() + c.run * per + c.offset;
    net.post([from, s, c, done] {
      std::memcpy(s, from, c.bytes);
      done(Status::ok());
    });
    return Status::ok();
  };
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    Status st = (*p)->run(cuda::Direction::kToDevice, runs, stage, [](uint32_t) {}, Clock::now() + std::chrono::seconds(120));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!st.is_ok()) return fail(st);
    best = std::max(best, bytes / s / 1e9);
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
  const cuda::StagingStats& s = (*p)->stats();
  std::printf(
      "{\"bytes\": %llu, \"slot_bytes\": %llu, \"slots\": %u, \"staged_GBps\": %.2f, \"pinned_h2d_GBps\": %.2f, "
      "\"chunks\": %llu, \"max_in_network\": %u, \"max_in_copy\": %u, \"overlapped\": %llu, \"verified\": %s}\n",
      static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(slot), slots, best, h2d,
      static_cast<unsigned long long>(s.chunks), s.max_in_network, s.max_in_copy,
      static_cast<unsigned long long>(s.overlapped), ok ? "true" : "false");
  return ok ? 0 : 1;
}
