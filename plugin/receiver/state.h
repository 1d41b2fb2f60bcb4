#pragma once
// The states of a receiver and of its refresh (docs/receiver.md has the
// diagram). ReceiverAgent holds one; every transition is made by the thread
// that runs the refresh, or by the caller's thread between refreshes.
//
//   kIdle          made; buffers may be added
//   kJoined        registered with the coordinator (join, or a refresh's first step)
//   kVersionKnown  the version to refresh to is published
//   kLeased        the coordinator granted the lease on it: the sources keep it
//   kTransferring  the plan part is compiled; GETs and sends run
//   kLanded        every GET landed and every send and receive of the domain is done
//   kVerified      the bytes match the sources' hashes (or "verify" is off)
//   kStaged        staged mode: the instance committed the version; commit() copies it
//   kCommitted     the buffers the server reads hold the version
//   kFailed        the refresh failed (retried from kJoined while the reason allows)
//   kAborted       staged mode: the instance aborted the version
//
// Direct mode goes kVerified -> kCommitted (the live buffers were written);
// staged mode goes kVerified -> kStaged -> (commit) kCommitted. From
// kCommitted, kFailed or kAborted, the next refresh starts at kJoined.

#include <atomic>
#include <cstdint>

namespace refit::plugin::receiver {

// Where a refresh stands (refit_receiver_progress): written by the thread
// that runs the refresh and by the GET engine's completions, read by any
// thread. Each attempt starts it afresh.
struct Progress {
  std::atomic<uint32_t> attempt{0};   // from 1; 0 before the first refresh
  std::atomic<int64_t> version{0};    // the version the attempt's transfer pulls; 0 before it begins
  std::atomic<uint64_t> planned{0};   // network bytes of the attempt's GETs and gathers
  std::atomic<uint64_t> landed{0};    // of those, landed
};

enum class ReceiverState : uint8_t {
  kIdle,
  kJoined,
  kVersionKnown,
  kLeased,
  kTransferring,
  kLanded,
  kVerified,
  kStaged,
  kCommitted,
  kFailed,
  kAborted,
};

inline const char* state_name(ReceiverState s) {
  switch (s) {
    case ReceiverState::kIdle: return "idle";
    case ReceiverState::kJoined: return "joined";
    case ReceiverState::kVersionKnown: return "version known";
    case ReceiverState::kLeased: return "leased";
    case ReceiverState::kTransferring: return "transferring";
    case ReceiverState::kLanded: return "landed";
    case ReceiverState::kVerified: return "verified";
    case ReceiverState::kStaged: return "staged";
    case ReceiverState::kCommitted: return "committed";
    case ReceiverState::kFailed: return "failed";
    case ReceiverState::kAborted: return "aborted";
  }
  return "unknown";
}

}  // namespace refit::plugin::receiver
