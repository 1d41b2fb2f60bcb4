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
// against the one source segment it came from. The block scales a receiver
// computes ("<W>_scale_inv", held by no source) are checked against the
// scales the source computes for such a box of W when it holds whole blocks
// (hash_converted_box), cut by the receiver's scale segments.

#include <array>
#include <cstdint>
#include <vector>

#include "planner/conversion.h"
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

// Converts the box (start, size) of `seg`'s tensor, read from `buffer`
// through `seg` in `from`, to `to` as a receiver converts it
// (docs/conversion.md): the box row-major in `to` at `out`, and to F8_E4M3
// (`block`; the box starts on a block boundary) one F32 scale per block at
// `scales`, row-major over scale_box_of(start, size, block). Refuses NaN or
// infinity in a block, naming the tensor and the block, and sets *refused
// (the blocks before it may be written); fails as hash_box does on a box
// outside the segment.
Status convert_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg, DType from, DType to,
                   const std::array<int64_t, 2>& block, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& size, uint8_t* out, float* scales, bool* refused);

// What a receiver holding a box as another dtype hashes: the box's
// converted bytes and, to F8_E4M3, the boxes of the scale tensor it asked
// for, in the order asked.
struct ConvertedHashes {
  uint64_t hash = 0;
  std::vector<uint64_t> scale_hashes;
};

// The hash of the same box converted to `to` first (docs/conversion.md),
// what a receiver holding the box as `to` hashes: a cast, or F8_E4M3 block
// quantization with `block` (the box must hold whole blocks). The source's
// elements are `from`. To F8_E4M3, also the hash of each box of
// `scale_boxes`, boxes of the scale tensor "<tensor>_scale_inv" inside
// scale_box_of(start, size, block) (the scales this box's blocks get),
// hashed as hash_box hashes a box of a receiver's F32 scale buffer. Fails
// as hash_box does, naming a scale box outside the box's scales or a box
// that does not start on a block boundary, or with
// the conversion's refusal (NaN or infinity in a block, naming the tensor
// and the block), and then sets *refused.
Result<ConvertedHashes> hash_converted_box(const uint8_t* buffer, uint64_t buffer_bytes, const control::Segment& seg,
                                           DType from, DType to, const std::array<int64_t, 2>& block,
                                           const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                                           const std::vector<IndexBox>& scale_boxes, bool* refused);

}  // namespace refit::plugin
