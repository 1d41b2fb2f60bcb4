#pragma once
// What one rank of one side of a planner Layout holds: its buffers, each with
// the regions (tensor boxes) that live in it, and the JSON descriptions that
// rank passes through the C ABI to say so: one refit_source_add_tensor() per
// tensor per buffer (explicit segments, "buffer" = the buffer's name, so
// tensors of a fused buffer share one data pointer), or one
// refit_receiver_add_buffer() per buffer (explicit segments).
//
// A RankBuffer points into the Layout it was made from, which must outlive it.

#include <cstdint>
#include <string>
#include <vector>

#include "planner/layout.h"
#include "planner/status.h"

namespace refit::bench {

// One region of one tensor inside a buffer of the rank.
struct Placed {
  uint32_t tensor = 0;
  const Region* region = nullptr;
};

struct RankBuffer {
  uint32_t index = 0;  // into Layout::buffers
  std::string name;
  DType dtype = DType::kBF16;
  int64_t bytes = 0;
  std::vector<Placed> placed;  // by tensor, then in region order
  // Bytes the segments cover (the payload a receiver gets).
  int64_t covered_bytes(const Layout& layout) const;
};

// The buffers of `rank` on `side`, in Layout::buffers order; fails, naming
// the rank and buffer, when two buffers of the rank share a name (the C ABI
// addresses a buffer by name).
Result<std::vector<RankBuffer>> rank_buffers(const Layout& layout, Side side, int32_t rank);

// The refit_source_add_tensor() descriptions for `buffer`, one per tensor:
// {"name", "dtype", "shape", "buffer", "segments": [{"start", "size", "offset", "strides"}]}.
std::vector<std::string> source_tensor_jsons(const Layout& layout, const RankBuffer& buffer);

// The refit_receiver_add_buffer() description of `buffer`:
// {"name", "dtype", "segments": [{"tensor", "start", "size", "offset", "strides"}]}.
std::string receiver_buffer_json(const Layout& layout, const RankBuffer& buffer);

// Bytes every receiver rank ends up with, summed over ranks: what a refresh
// delivers, the numerator of a throughput.
int64_t receiver_payload_bytes(const Layout& layout);

}  // namespace refit::bench
