#pragma once
// "quantize": "source" (docs/conversion.md, "At the source"): the copies a
// source converts when it publishes. Of each segment of a tensor that the
// receivers hold in another dtype, the source converts its whole blocks
// (F8_E4M3: the segment's largest sub-box of whole blocks of the receivers'
// block; a cast: all of it) into memory of its own, and registers the copies
// and their block scales as segments of one more buffer, in the receivers'
// dtype. The planner reads a piece from such a copy wherever one holds it
// (planner/plan.h, Tensor::converted_sources); the rest crosses in the
// sources' dtype and is converted by the receiver that pulled it.
//
// Pure: no UCX, no threads (tests/plugin/source_convert_test.cc).

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "planner/dtype.h"
#include "planner/status.h"
#include "transport/control/messages.h"

namespace refit::plugin {

// A tensor the receivers hold as `to` (verify_boxes' "convert" list).
struct ConvertRequest {
  std::string tensor;
  DType to = DType::kF8E4M3;
  std::array<int64_t, 2> block{128, 128};
};

// One copy: box (start, size) of segment `segment` of buffer `buffer`,
// converted from `from` to `to`, row-major at `data_offset` bytes of the
// copies' memory and, to F8_E4M3, its blocks' scales row-major at
// `scale_offset`.
struct ConvertJob {
  size_t buffer = 0;
  control::Segment segment;
  DType from = DType::kBF16;
  DType to = DType::kF8E4M3;
  std::array<int64_t, 2> block{128, 128};
  std::vector<int64_t> start, size;
  uint64_t data_offset = 0;
  uint64_t scale_offset = 0;
};

struct ConvertLayout {
  std::vector<ConvertJob> jobs;
  uint64_t bytes = 0;                 // the copies' memory, scales included
  std::vector<std::string> left_out;  // tensors with a copy past the budget: they travel unconverted
  std::string key;                    // equal keys: the same copies at the same places
};

// A buffer the source serves: its dtype and segments (a segment's own dtype
// overrides the buffer's).
struct ServedBuffer {
  std::string dtype;
  std::vector<control::Segment> segments;
  bool readable = true;  // host memory the source can read (not a GPU shard without a host copy)
};

// The copies of `buffers` that `requests` ask for, in order, within
// `budget_bytes` (a copy that would pass it is left out, and so are the
// later ones of its tensor). `shapes` gives each tensor's shape. A
// conversion refit does not do, or a segment with no whole block, gets no
// copy.
ConvertLayout plan_converted(const std::vector<ServedBuffer>& buffers, const std::map<std::string, std::vector<int64_t>>& shapes,
                             const std::vector<ConvertRequest>& requests, uint64_t budget_bytes);

// The segments of the copies' buffer: each job's copy (dtype `to`) and, to
// F8_E4M3, its scales (tensor "<W>_scale_inv", F32).
std::vector<control::Segment> converted_segments(const ConvertLayout& layout);

}  // namespace refit::plugin
