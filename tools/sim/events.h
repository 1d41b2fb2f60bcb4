#pragma once
// The network's events in the refresh simulator (simulator.cc), and the
// queue that keeps them by window. Here so that the queue is tested on its
// own (tests/tools/simulator_test.cc).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "transport/ucx/chunking.h"

namespace refit::sim {

struct Event {
  double t;
  // Posted: when the receiver decided to post it, and its count of posts
  // before it. A source serves posts of one time in the order they were
  // decided, then in turns (tie_turn), then by receiver, then by this count.
  double decided;
  uint64_t seq;
  int32_t receiver;
  int32_t source;  // of the chunk's job (so crossing reads no job)
  bool landed;     // false: posted, about to cross
  uint32_t turn;   // posted: tie_turn
  ucx::Chunk chunk;
};

// The network's events of some receivers, by window: window k is the time
// [k w, (k + 1) w) for the window length w (Sim::simulate_network in
// simulator.cc). The windows ahead are a ring of buckets, each the events
// of one window; events past the ring wait in a heap until the ring comes
// to them. A window is taken whole, its events in the order they were
// pushed, but for those that came from the heap: they come first, by
// time, receiver, kind and count. Either way, a receiver's events of one
// kind (posted, landed) come in the order they were pushed, which is time
// order (it posts one after another, and its NIC takes in one chunk after
// another; push() checks it); the simulation orders a window's events
// further only where the order across receivers shows. (A heap of each
// receiver's earliest events read, at every pop, an event that had left
// the caches since its push.)
class WindowQueue {
 public:
  // Windows of `length` seconds (> 0), starting at window 0.
  void reset(double length, int32_t receivers) {
    length_ = length;
    ring_.assign(kRing, {});
    far_.clear();
    current_ = 0;
    in_ring_ = 0;
    last_.assign(2 * static_cast<size_t>(receivers), 0.0);
  }
  // The window of time t (>= 0); kNoWindow past 2^62 windows.
  uint64_t window_of(double t) const {
    const double k = std::floor(t / length_);
    return k < 0x1p62 ? static_cast<uint64_t>(k) : kNoWindow;
  }
  // False when `e` falls before the current window, past the last window,
  // or before the last event of its receiver's kind (posted or landed).
  bool push(const Event& e) {
    const uint64_t k = window_of(e.t);
    double& last = last_[static_cast<size_t>(e.receiver) * 2 + (e.landed ? 1 : 0)];
    if (k < current_ || k == kNoWindow || e.t < last) return false;
    last = e.t;
    if (k - current_ < kRing) {
      ring_[k % kRing].push_back(e);
      ++in_ring_;
    } else {
      far_.push_back(e);
      std::push_heap(far_.begin(), far_.end(), later);
    }
    return true;
  }
  // The first window from the current one that holds an event; kNoWindow
  // when none does.
  uint64_t next_window() const {
    if (in_ring_ > 0)
      for (uint64_t k = current_;; ++k)
        if (!ring_[k % kRing].empty()) return k;
    return far_.empty() ? kNoWindow : window_of(far_.front().t);
  }
  // Makes window k (no earlier than the current one, and no window
  // between them holds an event) the current one, and moves its events
  // into `out` (in the order of the class comment).
  void take(uint64_t k, std::vector<Event>& out) {
    current_ = k;
    while (!far_.empty() && window_of(far_.front().t) - k < kRing) {
      std::pop_heap(far_.begin(), far_.end(), later);
      ring_[window_of(far_.back().t) % kRing].push_back(far_.back());
      far_.pop_back();
      ++in_ring_;
    }
    std::vector<Event>& bucket = ring_[k % kRing];
    out.clear();
    out.swap(bucket);  // the bucket keeps out's memory for a later window
    in_ring_ -= out.size();
    // Unless that is far more than this window took: a few crowded windows
    // (every receiver posting at the start) would otherwise leave their
    // memory going round the ring, every bucket's grown to the largest.
    if (bucket.capacity() > 2 * out.size() + 64) std::vector<Event>().swap(bucket);
  }
  static constexpr uint64_t kNoWindow = UINT64_MAX;

 private:
  static constexpr uint64_t kRing = 4096;  // windows ahead in buckets
  // The heap's order: the earliest on top, ties by receiver, kind and the
  // receiver's count of posts. So a receiver's events of one kind come out
  // in the order they were pushed (its count grows with its pushes), and
  // enter their bucket before any pushed there directly: one is pushed
  // there only once the window is within the ring, and take() has moved
  // the heap's events of that window into the ring by then.
  static bool later(const Event& a, const Event& b) {
    if (a.t != b.t) return a.t > b.t;
    if (a.receiver != b.receiver) return a.receiver > b.receiver;
    if (a.landed != b.landed) return a.landed > b.landed;
    return a.seq > b.seq;
  }
  double length_ = 1;
  std::vector<std::vector<Event>> ring_;  // window k's events in ring_[k % kRing]
  std::vector<Event> far_;                // events kRing windows ahead or more: a heap
  uint64_t current_ = 0;
  size_t in_ring_ = 0;
  std::vector<double> last_;  // per receiver and kind: the time of its last event pushed
};

}  // namespace refit::sim
