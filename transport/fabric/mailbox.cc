#include "transport/fabric/mailbox.h"

#include <atomic>
#include <thread>
#include <vector>

namespace refit::fabric::mailbox {

Status wait(uint64_t* slots, std::span<const int32_t> from, int64_t version, uint64_t epoch,
            std::chrono::steady_clock::time_point deadline, const std::atomic<bool>* cancel) {
  const uint64_t want = flag(version, epoch, false);
  std::vector<int32_t> waiting(from.begin(), from.end());
  while (!waiting.empty()) {
    for (size_t i = 0; i < waiting.size();) {
      const uint64_t v = std::atomic_ref<uint64_t>(slots[slot_of(waiting[i])]).load(std::memory_order_acquire);
      if (v == want) {
        waiting.erase(waiting.begin() + static_cast<long>(i));
        continue;
      }
      if ((v >> (kEpochBits + 1)) == static_cast<uint64_t>(version)) {
        if (v & 1) {
          return Status::io_error("local fabric: receiver rank " + std::to_string(waiting[i]) +
                                  " of this domain failed to pass on its slices");
        }
        return Status::invalid("local fabric: receiver rank " + std::to_string(waiting[i]) +
                               " executed the plan of another membership; retry the refresh");
      }
      ++i;
    }
    if (waiting.empty()) break;
    if (cancel && cancel->load(std::memory_order_acquire)) {
      return Status::io_error("local fabric: the wait for the peers was cancelled");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string names;
      for (int32_t r : waiting) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return Status::timeout("local fabric: receiver rank(s) " + names +
                             " of this domain did not pass on their slices before the deadline");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return Status::ok();
}

void clear(uint64_t* slots, std::span<const int32_t> from) {
  for (int32_t r : from) std::atomic_ref<uint64_t>(slots[slot_of(r)]).store(0, std::memory_order_release);
}

void clear_except(uint64_t* slots, std::span<const int32_t> from, uint64_t keep) {
  for (int32_t r : from) {
    uint64_t seen = std::atomic_ref<uint64_t>(slots[slot_of(r)]).load(std::memory_order_acquire);
    // Only a flag that is not `keep` is cleared, and only if it is still the
    // one seen: a peer may write its flag meanwhile.
    if (seen != keep) std::atomic_ref<uint64_t>(slots[slot_of(r)]).compare_exchange_strong(seen, 0);
  }
}

}  // namespace refit::fabric::mailbox
