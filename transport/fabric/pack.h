#pragma once
// Packing the NCCL fabric's fan-out (docs/refresh.md, "Packed fan-out").
//
// Each round of the NCCL fabric (nccl_fabric.h) passes on, per peer, the
// sends to that peer that became ready since the last round. Most of them are small (one
// contiguous run each), and one ncclSend per run costs more in launches
// than in bytes. With packing, the small sends of one round to one peer are
// gathered into one contiguous pack in device memory, cross as one
// ncclSend, land in the peer's pack area as one ncclRecv, and are scattered
// into their places there; large sends go as they are.
//
// plan_pack() decides which sends of a round go packed, where in the pack,
// and how many of them the round takes. It is a pure function of the sizes
// (in send order) and the limits, so both ends compute the same layout: the
// sender from its ready sends, the receiver from the receives the round's
// counts announce. Each rank holds two pack areas of `pack_bytes` (sending,
// receiving), shared by its peers: a peer's pack in one round is at most
// pack_share() bytes, so the packs of all peers of a round fit.
//
// No CUDA, no NCCL: the refresh simulator (tools/sim) models the same packs.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "planner/status.h"

namespace refit::fabric {

// Defaults of the nccl fabric's config keys "local": {"pack_bytes",
// "pack_threshold"} (plugin/config.h; docs/refresh.md, "Packed fan-out").
// 64 MiB per area: on a 64-GPU NVLink domain each peer's pack is up to 1 MiB
// a round, the size of one GET chunk; 2 x 64 MiB of device memory per rank.
inline constexpr uint64_t kDefaultPackBytes = 64ull << 20;
// A send of at least this many bytes goes as it is: it already moves at
// NVLink bandwidth, and copying it twice would cost more than its launch.
inline constexpr uint64_t kDefaultPackThreshold = 1ull << 20;
// The round's cap on sends per peer (NcclFabricConfig::max_sends_per_round).
inline constexpr uint32_t kDefaultMaxSendsPerRound = 256;
// Pieces start at multiples of this in a pack: the scatter kernel moves 16
// bytes at a time where source and destination share their alignment.
inline constexpr uint64_t kPackAlign = 16;
// The smallest pack area that is not 0 (off).
inline constexpr uint64_t kMinPackBytes = 64ull << 10;

struct PackLimits {
  uint64_t pack_bytes = kDefaultPackBytes;          // per area; 0: packing off
  uint64_t pack_threshold = kDefaultPackThreshold;  // sends of at least this go unpacked
};

// Refuses limits that cannot work, naming the key: a pack area below
// kMinPackBytes (other than 0), a threshold of 0.
Status validate(const PackLimits& limits);

// The most bytes one peer's pack takes in one round when the domain has
// `domain_size` ranks: pack_bytes / (domain_size - 1), rounded down to
// kPackAlign. 0 when packing is off or the rank has no peer.
uint64_t pack_share(const PackLimits& limits, size_t domain_size);

inline constexpr uint64_t kUnpacked = UINT64_MAX;

struct PackLayout {
  size_t taken = 0;             // how many of the sizes go this round (a prefix)
  std::vector<uint64_t> offset;  // per taken send: its offset in the pack, or kUnpacked
  uint64_t bytes = 0;           // the pack's bytes (0: nothing packed)
  size_t packed = 0;            // sends in the pack
};

// The layout of one round's sends to one peer, `sizes` in send order. A send
// goes packed when it is smaller than `threshold` and no larger than
// `share`; it takes the next offset rounded up to kPackAlign. The round
// stops before the first packed send that would pass `share`: it and the
// sends after it go in the next round (the pack "splits" across rounds).
// Unpacked sends never stop a round. So a non-empty `sizes` always takes at
// least one send. share == 0: nothing is packed, every send is taken.
PackLayout plan_pack(std::span<const uint64_t> sizes, uint64_t share, uint64_t threshold);

}  // namespace refit::fabric
