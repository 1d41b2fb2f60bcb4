#pragma once
// PyTorch DTensor placements, expanded into Regions.
//
// Semantics follow torch.distributed.tensor:
// - Shard(d) splits dim d as torch.chunk does: chunk = ceil(n / k), shard i is
//   [min(i*chunk, n), min((i+1)*chunk, n)), so trailing shards may be smaller
//   or empty.
// - Several mesh dims sharding one tensor dim nest left to right: each later
//   mesh dim chunks the piece the earlier ones left.
// - _StridedShard(d, split_factor) ("SS(d,k)") is deferred to just after the
//   next plain Shard(d) of a later mesh dim, as _explicit_order_placements
//   does, and k must equal the product of the mesh sizes of the shards it is
//   reordered behind. This is how FSDP2 over TP lays out a parameter: TP cuts
//   first, FSDP cuts each TP piece. Under that order every rank's shard is
//   one box.
// - Partial is refused: reduce before publishing.

#include <string>
#include <string_view>
#include <vector>

#include "planner/layout.h"
#include "planner/status.h"

namespace refit {

struct Placement {
  enum class Kind { kReplicate, kShard, kStridedShard };
  Kind kind = Kind::kReplicate;
  int dim = 0;
  int split_factor = 1;  // kStridedShard only
  std::string to_string() const;  // "R", "S(1)", "SS(0,2)"
};

// Parses "R", "S(d)", "SS(d,k)". "P", "Partial" and "Partial(...)" are refused
// with a message that says to reduce first.
Result<Placement> parse_placement(std::string_view text);

struct DTensorSpec {
  std::vector<int64_t> mesh;        // mesh shape
  std::vector<int32_t> ranks;       // the side's ranks, row-major over the mesh
  std::vector<Placement> placements;  // one per mesh dim
};

// The box of the global tensor held at each mesh position, row-major over the
// mesh (same order as spec.ranks). Checks the spec against the shape: one
// placement per mesh dim, product(mesh) == ranks.size(), shard dims in range,
// strided shards paired as described above. Boxes may be empty.
Result<std::vector<Box>> dtensor_boxes(const std::vector<int64_t>& shape, const DTensorSpec& spec);

// Expands `spec` for layout.tensors[tensor] on `side`: every rank with a
// non-empty shard gets a buffer named `buffer_name` holding the shard
// row-major; ranks with the same shard share one Buffer and one Region.
// Checks ranks: in range for the side, none repeated.
Status add_dtensor(Layout& layout, uint32_t tensor, Side side, const DTensorSpec& spec,
                   const std::string& buffer_name);

}  // namespace refit
