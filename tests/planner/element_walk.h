#pragma once
// Element-level helpers of the planner's brute-force reference tests,
// independent of the planner's own run walks: every element of a box, an
// element's place in its tensor and in a region's buffer.

#include <cstdint>
#include <vector>

#include "planner/box.h"
#include "planner/layout.h"

namespace refit::reference {

// Calls fn(idx) for every element of `box`, row-major.
template <typename F>
void for_each_element(const Box& box, F&& fn) {
  if (box.empty()) return;
  Index idx = box.start;
  for (;;) {
    fn(idx);
    int d = box.ndim - 1;
    while (d >= 0) {
      if (++idx[d] < box.end(d)) break;
      idx[d] = box.start[d];
      --d;
    }
    if (d < 0) return;
  }
}

// Row-major index of element `idx` in a tensor of `shape`.
inline int64_t linear_index(const std::vector<int64_t>& shape, const Index& idx) {
  int64_t g = 0;
  for (size_t d = 0; d < shape.size(); ++d) g = g * shape[d] + idx[d];
  return g;
}

// Element offset of global element `idx` in region `r`'s buffer.
inline int64_t element_offset(const Region& r, const Index& idx) {
  int64_t o = r.offset;
  for (int d = 0; d < r.box.ndim; ++d) o += (idx[d] - r.box.start[d]) * r.strides[d];
  return o;
}

}  // namespace refit::reference
