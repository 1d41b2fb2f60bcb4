#pragma once
// A host "network" in front of a landing ring, like the GET engine behind
// its gate: threads take the ring's chunks in index order, wait until the
// ring gives each a slot (polling, as the engine's progress thread asks
// again), copy its bytes into that slot and report it landed; the last one
// out of chunks ends the network. A chunk whose slot stays busy past
// `patience` lands as a timeout. For the GPU tests and refit-staging-bench.

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "transport/cuda/staging.h"

namespace refit::cuda {

class RingNetwork {
 public:
  // bytes_of(c): where chunk c's bytes are on the "network" side.
  using BytesOf = std::function<const uint8_t*(const StagedChunk&)>;

  RingNetwork(LandingRing& ring, BytesOf bytes_of, int threads, std::chrono::seconds patience)
      : ring_(ring), bytes_of_(std::move(bytes_of)), threads_(threads), patience_(patience) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { serve(); });
  }
  ~RingNetwork() {
    for (std::thread& t : workers_) t.join();
  }
  RingNetwork(const RingNetwork&) = delete;
  RingNetwork& operator=(const RingNetwork&) = delete;

 private:
  void serve() {
    const std::vector<StagedChunk>& chunks = ring_.chunks();
    while (true) {
      const uint32_t k = next_.fetch_add(1);
      if (k >= chunks.size()) break;
      const Clock::time_point give_up = Clock::now() + patience_;
      bool open = true;
      void* slot = nullptr;
      while (!ring_.acquire(k, &slot)) {
        if (Clock::now() >= give_up) {
          open = false;
          break;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(5));
      }
      if (!open) {
        ring_.landed(k, Status::timeout("ring network: chunk " + std::to_string(k) + " never got its slot"));
        continue;
      }
      std::memcpy(slot, bytes_of_(chunks[k]), chunks[k].bytes);
      ring_.landed(k, Status::ok());
    }
    if (++finished_ == threads_) ring_.network_over();
  }

  LandingRing& ring_;
  const BytesOf bytes_of_;
  const int threads_;
  const std::chrono::seconds patience_;
  std::atomic<uint32_t> next_{0};
  std::atomic<int> finished_{0};
  std::vector<std::thread> workers_;
};

}  // namespace refit::cuda
