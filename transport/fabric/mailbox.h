#pragma once
// Completion flags of the host fabrics (ucx_fabric.h, cma_fabric.h). Every
// rank has kSlots u64 slots that its peers write into: slot (sender rank mod
// kSlots). When a sender's data to a peer is visible there, it writes one
// flag into its slot there:
//   (version << 21) | ((epoch mod 2^20) << 1) | failed
// A failed refresh still writes its flag, with the failed bit, so that the
// peer stops waiting at once instead of at its deadline. The receiving rank
// polls its own memory: no message, no progress of any engine needed.
// Pure C++.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include "planner/status.h"

namespace refit::fabric::mailbox {

inline constexpr size_t kSlots = 4096;
inline constexpr int kEpochBits = 20;

inline uint64_t flag(int64_t version, uint64_t epoch, bool failed) {
  return (static_cast<uint64_t>(version) << (kEpochBits + 1)) | ((epoch & ((1u << kEpochBits) - 1)) << 1) |
         (failed ? 1 : 0);
}
inline size_t slot_of(int32_t rank) { return static_cast<size_t>(rank) % kSlots; }

// Waits until every rank of `from` has flagged (version, epoch) in `slots`
// (kSlots of them, written by other processes), polling every 100 us until
// `deadline` or `*cancel`. Fails at once when a sender flagged this version
// failed or with another epoch; the message names the rank.
Status wait(uint64_t* slots, std::span<const int32_t> from, int64_t version, uint64_t epoch,
            std::chrono::steady_clock::time_point deadline, const std::atomic<bool>* cancel = nullptr);

// Zeroes the slots of `from`, once their flags are consumed.
void clear(uint64_t* slots, std::span<const int32_t> from);
// After a failed attempt: zeroes the slots of `from` except those that hold
// `keep`, the flag of a peer that passed on all its slices for this version
// in this membership. A retry of the same version and membership then finds
// those flags again (the peer may have finished and will not send twice,
// and the bytes it sent are still in place: in one plan every byte of a
// rank's buffer comes from one place), while a failed flag or one of
// another membership does not outlive the attempt that saw it.
void clear_except(uint64_t* slots, std::span<const int32_t> from, uint64_t keep);

}  // namespace refit::fabric::mailbox
