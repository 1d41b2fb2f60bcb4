#include "plugin/source_convert.h"

#include <algorithm>

#include "planner/conversion.h"

namespace refit::plugin {
namespace {

uint64_t aligned(uint64_t n) { return (n + 63) / 64 * 64; }

int64_t numel(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (int64_t x : size) n *= x;
  return n;
}

// The segment's largest sub-box of whole blocks (a block at the tensor's
// edge may be partial); false when it holds none.
bool whole_block_box(const control::Segment& seg, const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block,
                     std::vector<int64_t>* start, std::vector<int64_t>* size) {
  *start = seg.start;
  *size = seg.size;
  const size_t n = seg.start.size();
  if (n < 2 || shape.size() != n) return false;
  for (size_t k = 0; k < 2; ++k) {
    const size_t d = n - 2 + k;
    const int64_t b = block[k];
    const int64_t lo = (seg.start[d] + b - 1) / b * b;
    const int64_t end = seg.start[d] + seg.size[d];
    const int64_t hi = end == shape[d] ? end : end / b * b;
    if (hi <= lo) return false;
    (*start)[d] = lo;
    (*size)[d] = hi - lo;
  }
  return true;
}

std::string dims(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += std::to_string(x) + ",";
  return s;
}

}  // namespace

ConvertLayout plan_converted(const std::vector<ServedBuffer>& buffers, const std::map<std::string, std::vector<int64_t>>& shapes,
                             const std::vector<ConvertRequest>& requests, uint64_t budget_bytes) {
  ConvertLayout out;
  for (const ConvertRequest& q : requests) {
    auto shape = shapes.find(q.tensor);
    if (shape == shapes.end()) continue;
    bool full = false;
    for (size_t bi = 0; bi < buffers.size() && !full; ++bi) {
      const ServedBuffer& b = buffers[bi];
      for (const control::Segment& seg : b.segments) {
        if (seg.tensor != q.tensor || !b.readable) continue;
        const std::optional<DType> from = parse_dtype(seg.dtype.empty() ? b.dtype : seg.dtype);
        if (!from) continue;
        Result<ConversionKind> kind = conversion_for(seg.tensor, *from, q.to);
        if (!kind.is_ok() || *kind == ConversionKind::kNone) continue;
        ConvertJob job{bi, seg, *from, q.to, q.block, seg.start, seg.size, 0, 0};
        uint64_t scales = 0;
        if (*kind == ConversionKind::kQuantizeE4M3) {
          if (!whole_block_box(seg, shape->second, q.block, &job.start, &job.size)) continue;
          scales = static_cast<uint64_t>(numel(scale_box_of(job.start, job.size, q.block).size)) * sizeof(float);
        }
        const uint64_t data = static_cast<uint64_t>(numel(job.size) * dtype_bytes(q.to));
        if (out.bytes + aligned(data) + aligned(scales) > budget_bytes) {
          out.left_out.push_back(q.tensor);
          full = true;
          break;
        }
        job.data_offset = out.bytes;
        out.bytes += aligned(data);
        job.scale_offset = out.bytes;
        out.bytes += aligned(scales);
        out.key += q.tensor + "|" + std::to_string(bi) + "|" + dims(job.start) + "|" + dims(job.size) + "|" +
                   std::string(dtype_name(*from)) + ">" + std::string(dtype_name(q.to)) + "|" + std::to_string(q.block[0]) + "x" +
                   std::to_string(q.block[1]) + "|" + std::to_string(job.data_offset) + ";";
        out.jobs.push_back(std::move(job));
      }
    }
  }
  return out;
}

std::vector<control::Segment> converted_segments(const ConvertLayout& layout) {
  std::vector<control::Segment> segs;
  for (const ConvertJob& j : layout.jobs) {
    const size_t n = j.size.size();
    control::Segment data{j.segment.tensor, j.start, j.size,
                          static_cast<int64_t>(j.data_offset) / dtype_bytes(j.to), std::vector<int64_t>(n, 1),
                          std::string(dtype_name(j.to))};
    for (size_t d = n - 1; d > 0; --d) data.strides[d - 1] = data.strides[d] * j.size[d];
    segs.push_back(std::move(data));
    if (j.to != DType::kF8E4M3) continue;
    const IndexBox grid = scale_box_of(j.start, j.size, j.block);
    control::Segment scales{scale_tensor_name(j.segment.tensor), grid.start, grid.size,
                            static_cast<int64_t>(j.scale_offset / sizeof(float)), std::vector<int64_t>(n, 1), "F32"};
    for (size_t d = n - 1; d > 0; --d) scales.strides[d - 1] = scales.strides[d] * grid.size[d];
    segs.push_back(std::move(scales));
  }
  return segs;
}

}  // namespace refit::plugin
