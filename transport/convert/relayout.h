#pragma once
// Relayout (docs/refresh.md, "Column-major receivers"): a box that landed
// row-major and packed in a staging area, copied element by element into a
// buffer's own strides (a column-major tensor: strides [1, rows]). The dtype
// does not change; only where each element goes.

#include <cstdint>
#include <span>

#include "planner/status.h"

namespace refit::convert {

// Copies the box `sizes` (elements of `elem_bytes`: 1, 2, 4 or 8), packed
// row-major at `src`, to `dst` + (i0 * strides[0] + i1 * strides[1] + ...)
// * elem_bytes for element (i0, i1, ...). The last two dims go tile by tile
// (16 x 16 elements) so that both sides stay in cache whichever is the one
// with stride 1. REQUIRES: sizes and strides of the same length, from 1 to
// 8 dims; every size >= 1; strides >= 0; `src` and `dst` do not overlap.
// Refused (nothing written): another element size, a length mismatch, a
// size below 1 or a negative stride.
Status relayout_box(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                    std::span<const int64_t> strides);

}  // namespace refit::convert
