#include "transport/convert/relayout.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace refit::convert {

namespace {

// 16 x 16: a 4096 x 4096 BF16 box into column-major strides took 15 to 20
// ms with it, 35 to 45 ms with 64 x 64 tiles, on a shared 2-core machine
// (docs/refresh.md, "Column-major receivers"): a 64-element tile of that
// box touches 64 pages on each side.
constexpr int64_t kTile = 16;

// The last two dims of one leading index: `rows` x `cols` packed at `src`,
// to dst + (i * row_stride + j * col_stride) elements.
template <int kBytes>
void copy_matrix(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols, int64_t row_stride,
                 int64_t col_stride) {
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const int64_t i1 = std::min(rows, i0 + kTile);
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t j1 = std::min(cols, j0 + kTile);
      // Within a tile, walk the dim whose destination stride is the smaller
      // innermost: the writes then go in order when it is 1.
      if (col_stride <= row_stride) {
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = j0; j < j1; ++j)
            std::memcpy(dst + (i * row_stride + j * col_stride) * kBytes, src + (i * cols + j) * kBytes, kBytes);
      } else {
        for (int64_t j = j0; j < j1; ++j)
          for (int64_t i = i0; i < i1; ++i)
            std::memcpy(dst + (i * row_stride + j * col_stride) * kBytes, src + (i * cols + j) * kBytes, kBytes);
      }
    }
  }
}

}  // namespace

Status relayout_box(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                    std::span<const int64_t> strides) {
  const size_t n = sizes.size();
  if (n == 0 || n > 8 || strides.size() != n)
    return Status::invalid("relayout: the box needs 1 to 8 dims and one stride per dim, got " + std::to_string(n) +
                           " sizes and " + std::to_string(strides.size()) + " strides");
  for (size_t d = 0; d < n; ++d) {
    if (sizes[d] < 1 || strides[d] < 0)
      return Status::invalid("relayout: dim " + std::to_string(d) + " has size " + std::to_string(sizes[d]) +
                             " and stride " + std::to_string(strides[d]) + " (a size of at least 1 and a stride of "
                             "at least 0 expected)");
  }
  void (*matrix)(const uint8_t*, uint8_t*, int64_t, int64_t, int64_t, int64_t) = nullptr;
  switch (elem_bytes) {
    case 1: matrix = copy_matrix<1>; break;
    case 2: matrix = copy_matrix<2>; break;
    case 4: matrix = copy_matrix<4>; break;
    case 8: matrix = copy_matrix<8>; break;
    default:
      return Status::invalid("relayout: elements of " + std::to_string(elem_bytes) + " bytes (1, 2, 4 or 8 expected)");
  }
  // A 1-dim box is one row of a matrix.
  const int64_t rows = n >= 2 ? sizes[n - 2] : 1;
  const int64_t cols = sizes[n - 1];
  const int64_t row_stride = n >= 2 ? strides[n - 2] : 0;
  const int64_t col_stride = strides[n - 1];
  const size_t lead = n >= 2 ? n - 2 : 0;
  int64_t idx[8] = {};
  for (;;) {
    int64_t dst_off = 0;
    for (size_t d = 0; d < lead; ++d) dst_off += idx[d] * strides[d];
    matrix(src, dst + dst_off * elem_bytes, rows, cols, row_stride, col_stride);
    src += rows * cols * elem_bytes;
    size_t d = lead;
    while (d > 0) {
      if (++idx[d - 1] < sizes[d - 1]) break;
      idx[d - 1] = 0;
      --d;
    }
    if (d == 0) break;
  }
  return Status::ok();
}

}  // namespace refit::convert
