#pragma once
// End-to-end verification (docs/refresh.md, "Verification"; "verify" in the agents'
// config): a hash of every box a receiver reads, computed by the source that
// holds it when it publishes and checked by every receiver once its copy has
// landed.
//
// The hash of a box is XXH3-64 over the box's elements in row-major order of
// the tensor's global index space, the element bytes as they lie in memory.
// It does not depend on where the box lies in a buffer: a source and a
// receiver with different layouts hash the same box from their own buffers,
// through their own segments, and get the same value when the contents agree.
//
// Which boxes: every source segment cut by every receiver segment of the same
// tensor (the coordinator lists them: control_state.h, verify_boxes and
// version_hashes), so a receiver checks each part of each of its segments
// against the one source segment it came from.

#include <array>
#include <cstdint>
#include <vector>

#include "planner/dtype.h"
#include "planner/status.h"
#include "transport/control/messages.h"

namespace refit::plugin {

// The hash of the box (start, size) of `seg`'s tensor, read from `buffer` (of
// `buffer_bytes`) through `seg`, whose elements are `elem_bytes` each. Fails,
// naming the box, when the box is not inside the segment or the segment's
// elements lie outside the buffer.
Result<uint64_t> hash_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                          int elem_bytes, const std::vector<int64_t>& start, const std::vector<int64_t>& size);

// The hash of the same box converted to `to` first (docs/conversion.md),
// what a receiver holding the box as `to` hashes: a cast, or F8_E4M3 block
// quantization with `block` (the box must hold whole blocks; its scales are
// not part of the hash). The source's elements are `from`. Fails as
// hash_box does, or with the conversion's refusal (NaN or infinity in a
// block, naming the tensor and the block), and then sets *refused.
Result<uint64_t> hash_converted_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                                    DType from, DType to, const std::array<int64_t, 2>& block,
                                    const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                                    bool* refused);

}  // namespace refit::plugin
