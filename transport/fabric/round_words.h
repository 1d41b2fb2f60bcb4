#pragma once
// What one round of the NCCL fabric announces to a peer (nccl_fabric.h):
// the sends it passes on this round, named by their positions in the
// pair's plan-order list, in the order they cross. Sends go in the order
// they became ready, not plan order, so one slice still on its way does not
// hold back the ones that landed after it; the receiver finds its receives
// by the positions.
//
// Per peer and way, kRoundWordsPerPeer u64 words:
//   [0] count   the sends (kFailedMarker: the sender failed)
//   [1] bytes   their sum
//   [2] digest  a hash of their sizes in crossing order (nccl_fabric.cc)
//   [3] ranges  how many (start, length) pairs follow, at most kMaxRanges
//   [4 + 2i], [5 + 2i]  range i: positions start .. start + length - 1
//
// The words come from a peer: read_positions() checks every one of them.
// Pure C++, no CUDA; shared by the fabric and its tests.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "planner/status.h"
#include "transport/cuda/device_ops.h"

namespace refit::fabric {

inline constexpr size_t kRoundWordsPerPeer = cuda::kCountWordsPerPeer;
inline constexpr size_t kMaxRanges = (kRoundWordsPerPeer - 4) / 2;  // 62

// How many of `positions` (in crossing order), from the first, fit in
// kMaxRanges ranges of consecutive positions.
size_t ranges_prefix(std::span<const uint32_t> positions);

// Writes the announcement of `positions` (all of them must fit:
// ranges_prefix) into w[0, kRoundWordsPerPeer).
void write_announcement(uint64_t* w, uint64_t bytes, uint64_t digest, std::span<const uint32_t> positions);

// Reads a peer's announcement w[0, kRoundWordsPerPeer) (not a failure
// marker) against this rank's list of `size` receives from it, `got` marking
// those already received: `positions` gets the positions in crossing order,
// and `got` marks them. Refuses (invalid_argument, saying what is wrong) a
// range count above kMaxRanges, an empty range, a position outside the
// list, one received before or named twice, and a count that is not the
// ranges' sum; `got` is unchanged then.
Status read_positions(const uint64_t* w, size_t size, std::vector<uint8_t>& got, std::vector<uint32_t>* positions);

}  // namespace refit::fabric
