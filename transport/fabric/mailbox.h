#pragma once
// Completion flags of the host fabrics (ucx_fabric.h, cma_fabric.h). Every
// rank has kSlots u64 slots that its peers write into: slot (sender rank mod
// kSlots). When a sender's data to a peer is visible there, it writes one
// flag into its slot there:
//   (version << 21) | (epoch_bits(epoch) << 1) | failed
// A failed refresh still writes its flag, with the failed bit, so that the
// peer stops waiting at once instead of at its deadline. The receiving rank
// polls its own memory: no message, no progress of any engine needed.
//
// The fence. A sender whose attempt outlives the receiver's (the receiver
// retried under a new membership epoch, went solo, or failed at its deadline)
// could go on writing the bytes of version v into the receiver's buffers
// after the receiver went on to version v+1: a half-updated model that
// reports OK. Two rules close that:
//  - after the slots, each rank's mailbox has one more word, kAcceptingWord:
//    flag(version, epoch, false) while the rank accepts the writes of that
//    attempt, flag(version, epoch, true) once the attempt is over, 0 before
//    the first. A sender reads it before each batch of writes to a peer
//    (accepting()): it writes when the word names its own attempt, waits
//    while it names an earlier one, and stops when the attempt is over there
//    or the peer went on to a later one;
//  - a sender's flag, ok or failed, is written after its last data write of
//    the attempt. A receiver whose attempt ended without a sender's flag
//    remembers that sender (Fence::close); before it accepts writes for
//    another version it waits until each remembered sender's flag for that
//    attempt arrived, its own accepting word moved on, or its process is
//    gone (Fence::wait).
// A sender that read the accepting word just before the receiver moved on is
// therefore waited for; one that reads it later sees another attempt and
// stops. A late write of the same version is left alone: its bytes are the
// ones already there.
//
// Pure C++.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "planner/plan_epoch.h"
#include "planner/status.h"

namespace refit::fabric::mailbox {

inline constexpr size_t kSlots = 4096;
inline constexpr int kEpochBits = 20;
// The accepting word's index, and the size of a mailbox in words.
inline constexpr size_t kAcceptingWord = kSlots;
inline constexpr size_t kWords = kSlots + 1;

// The plan epoch's bits in a flag: the counter's low 19 bits, and the solo
// flag as bit 19, so that a solo attempt and the domain's attempt of one
// membership are told apart.
inline uint64_t epoch_bits(PlanEpoch epoch) {
  return (epoch.counter & ((uint64_t{1} << (kEpochBits - 1)) - 1)) |
         (uint64_t{epoch.solo ? 1u : 0u} << (kEpochBits - 1));
}
inline uint64_t flag(int64_t version, PlanEpoch epoch, bool failed) {
  return (static_cast<uint64_t>(version) << (kEpochBits + 1)) | (epoch_bits(epoch) << 1) | (failed ? 1 : 0);
}
inline size_t slot_of(int32_t rank) { return static_cast<size_t>(rank) % kSlots; }
inline int64_t version_of(uint64_t flag) { return static_cast<int64_t>(flag >> (kEpochBits + 1)); }

// What a sender of attempt (version, epoch) does, given a peer's accepting
// word: write, wait for the peer to begin the attempt, or stop.
enum class Accepting { kWrite, kWait, kStop };
inline Accepting accepting(uint64_t word, int64_t version, PlanEpoch epoch) {
  const uint64_t open = flag(version, epoch, false);
  if (word == open) return Accepting::kWrite;
  if (word == (open | 1) || (word >> 1) > (open >> 1)) return Accepting::kStop;
  return Accepting::kWait;
}
// Whether a slot's value shows that the sender ended its attempt (version,
// epoch), ok or failed, or a later version (its attempts run one at a time).
inline bool ended(uint64_t value, int64_t version, PlanEpoch epoch) {
  if (value == 0) return false;
  if (version_of(value) > version) return true;
  return (value | 1) == flag(version, epoch, true);
}

// Waits until every rank of `from` has flagged (version, epoch) in `slots`
// (kSlots of them, written by other processes), polling every 100 us until
// `deadline` or `*cancel`. Fails at once when a sender flagged this version
// failed or with another epoch; the message names the rank.
Status wait(uint64_t* slots, std::span<const int32_t> from, int64_t version, PlanEpoch epoch,
            std::chrono::steady_clock::time_point deadline, const std::atomic<bool>* cancel = nullptr);

// A sender of attempt (version, epoch) before a batch of writes to receiver
// `rank`: reads the peer's accepting word with `read` until it says to write
// (ok) or to stop (an error naming the rank), every 100 us until `deadline`
// or `*cancel`.
Status await_accepting(const std::function<Status(uint64_t* word)>& read, int32_t rank, int64_t version,
                       PlanEpoch epoch, std::chrono::steady_clock::time_point deadline,
                       const std::atomic<bool>* cancel);

// The senders that may still be writing into this rank (see the fence above).
class Fence {
 public:
  struct Sender {
    int32_t rank = 0;
    // Whether the sender's attempt whose accepting word would be `open`
    // (flag(version, epoch, false)) is over by other signs than its flag:
    // its process is gone, or its own accepting word no longer is `open`
    // (a sender writes only inside an attempt it began, and moves its word
    // on only once its writes of the attempt returned). Polled by wait().
    std::function<bool(uint64_t open)> over;
  };
  // Ends this rank's attempt (version, epoch) with these senders. Their
  // slots are cleared once consumed: all of them after an attempt that
  // succeeded (`ok`); after one that failed, all but those that hold the ok
  // flag of this attempt, so that a retry of the same version and
  // membership finds what a peer finished (it will not send again, and its
  // bytes are in place: in one plan each byte of a rank's buffer comes from
  // one place), while a failed flag or one of another attempt does not
  // outlive the attempt that saw it. Each sender whose flag for the attempt
  // was not there is remembered. The value a sender's flag was seen as is
  // the value cleared, one compare and swap each, so a flag that lands
  // meanwhile stays for wait() to find. A sender seen to end the attempt is
  // forgotten (with any earlier attempt of it: its attempts run one at a
  // time).
  void close(uint64_t* slots, std::span<const Sender> senders, int64_t version, PlanEpoch epoch, bool ok);
  // Before this rank accepts writes for `version`: waits until every
  // remembered sender of another version has ended that attempt (its flag,
  // or Sender::over), polling every 100 us until `deadline` or `*cancel`. A
  // timeout names the sender, the version and what to do.
  Status wait(uint64_t* slots, int64_t version, std::chrono::steady_clock::time_point deadline,
              const std::atomic<bool>* cancel = nullptr);
  // Senders remembered now (for tests and logs).
  size_t open() const { return open_.size(); }

 private:
  struct Open {
    Sender sender;
    int64_t version = 0;
    PlanEpoch epoch;
  };
  std::vector<Open> open_;
};

// Process identity for the fence's `gone`: the start time of `pid` (field 22
// of /proc/PID/stat, clock ticks after boot), which with the pid names one
// process for the life of the machine.
Result<uint64_t> start_time_of(int pid);
// Whether the process (pid, start_time) has exited (or the pid was reused).
bool process_gone(int pid, uint64_t start_time);

}  // namespace refit::fabric::mailbox
