// relayout_box against an element-by-element copy: random boxes, strides in
// any memory order (packed or padded), every element size.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "transport/convert/relayout.h"

namespace {

using refit::convert::relayout_box;

// Strides of a tensor of `shape` in a random memory order (dims shuffled,
// outermost first), each dim padded by up to `pad` elements; `*elems` gets
// the elements the layout spans.
std::vector<int64_t> random_strides(const std::vector<int64_t>& shape, std::mt19937_64& g, int64_t pad,
                                    int64_t* elems) {
  const int n = static_cast<int>(shape.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), g);
  std::vector<int64_t> strides(n);
  int64_t acc = 1;
  for (int k = n - 1; k >= 0; --k) {
    strides[order[k]] = acc;
    acc = acc * shape[order[k]] + std::uniform_int_distribution<int64_t>(0, pad)(g);
  }
  *elems = acc;
  return strides;
}

TEST(Relayout, MatchesAnElementCopyInAnyMemoryOrder) {
  std::mt19937_64 g(0x7e1a'0000);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  int cases = 0;
  for (int i = 0; i < 400; ++i) {
    const int n = static_cast<int>(uni(1, 4));
    const int eb = std::array<int, 4>{1, 2, 4, 8}[uni(0, 3)];
    std::vector<int64_t> sizes(n);
    for (int64_t& s : sizes) s = uni(1, n <= 2 ? 150 : 12);
    int64_t acc = 0;
    const std::vector<int64_t> strides = random_strides(sizes, g, 2, &acc);  // sometimes padded
    int64_t numel = 1, extent = 1;
    for (int d = 0; d < n; ++d) {
      numel *= sizes[d];
      extent += (sizes[d] - 1) * strides[d];
    }
    std::vector<uint8_t> src(numel * eb), dst(extent * eb, 0xee), want(extent * eb, 0xee);
    for (size_t k = 0; k < src.size(); ++k) src[k] = static_cast<uint8_t>(g());
    std::vector<int64_t> idx(n, 0);
    for (int64_t e = 0; e < numel; ++e) {  // row-major over the box
      int64_t off = 0;
      for (int d = 0; d < n; ++d) off += idx[d] * strides[d];
      std::memcpy(&want[off * eb], &src[e * eb], eb);
      for (int d = n - 1; d >= 0; --d) {
        if (++idx[d] < sizes[d]) break;
        idx[d] = 0;
      }
    }
    ASSERT_TRUE(relayout_box(src.data(), dst.data(), eb, sizes, strides).is_ok());
    ASSERT_EQ(dst, want) << "case " << i << ": " << n << " dims, " << eb << "-byte elements";
    ++cases;
  }
  EXPECT_EQ(cases, 400);
}

// A box of a larger tensor (strides of the tensor's shape, in a random
// memory order), sizes around the 16 x 16 tile's edges, 1 to 8 dims (size-1
// dims among them), every element size: the box lands where an element copy
// puts it, and no byte outside it changes, before or after it in the buffer.
TEST(Relayout, ASubBoxAtTheTileEdgesWritesItsElementsAndNothingElse) {
  std::mt19937_64 g(0x7e1a'0003);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  const std::array<int64_t, 7> edges{1, 2, 15, 16, 17, 32, 33};
  constexpr int64_t kGuard = 64;  // bytes before and after the tensor
  for (int i = 0; i < 600; ++i) {
    const int n = static_cast<int>(uni(1, 8));
    const int eb = std::array<int, 4>{1, 2, 4, 8}[uni(0, 3)];
    std::vector<int64_t> sizes(n), shape(n), start(n);
    int64_t numel = 1;
    for (int d = 0; d < n; ++d) {
      // The last two dims around the tile's edges; the leading ones small.
      sizes[d] = d + 2 >= n ? edges[uni(0, 6)] : uni(1, 3);
      shape[d] = sizes[d] + uni(0, 3);
      start[d] = uni(0, shape[d] - sizes[d]);
      numel *= sizes[d];
    }
    if (numel > 20000) continue;
    int64_t acc = 0;
    const std::vector<int64_t> strides = random_strides(shape, g, 0, &acc);  // the tensor's memory order, packed
    int64_t first = 0;  // the box's first element in the tensor
    for (int d = 0; d < n; ++d) first += start[d] * strides[d];
    const size_t bytes = static_cast<size_t>(kGuard + acc * eb + kGuard);
    std::vector<uint8_t> src(numel * eb), dst(bytes, 0xee), want(bytes, 0xee);
    for (uint8_t& b : src) b = static_cast<uint8_t>(g());
    std::vector<int64_t> idx(n, 0);
    for (int64_t e = 0; e < numel; ++e) {
      int64_t off = first;
      for (int d = 0; d < n; ++d) off += idx[d] * strides[d];
      std::memcpy(&want[kGuard + off * eb], &src[e * eb], eb);
      for (int d = n - 1; d >= 0; --d) {
        if (++idx[d] < sizes[d]) break;
        idx[d] = 0;
      }
    }
    ASSERT_TRUE(relayout_box(src.data(), dst.data() + kGuard + first * eb, eb, sizes, strides).is_ok());
    ASSERT_EQ(dst, want) << "case " << i << ": " << n << " dims, " << eb << "-byte elements";
  }
}

TEST(Relayout, ColumnMajorMatrix) {
  // 3 x 2 row-major [[1, 2], [3, 4], [5, 6]] into strides [1, 3]: columns.
  const std::vector<uint16_t> src{1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> dst(6, 0);
  const std::vector<int64_t> sizes{3, 2}, strides{1, 3};
  ASSERT_TRUE(relayout_box(reinterpret_cast<const uint8_t*>(src.data()), reinterpret_cast<uint8_t*>(dst.data()), 2,
                           sizes, strides)
                  .is_ok());
  EXPECT_EQ(dst, (std::vector<uint16_t>{1, 3, 5, 2, 4, 6}));
}

TEST(Relayout, RefusesWhatItCannotCopy) {
  uint8_t a[8] = {}, b[8] = {};
  const std::vector<int64_t> two{2, 2}, one{2};
  EXPECT_NE(relayout_box(a, b, 3, two, two).message().find("3 bytes"), std::string::npos);
  EXPECT_NE(relayout_box(a, b, 2, two, one).message().find("one stride per dim"), std::string::npos);
  EXPECT_FALSE(relayout_box(a, b, 2, {}, {}).is_ok());
  const std::vector<int64_t> empty{0, 2}, negative{1, -1};
  EXPECT_NE(relayout_box(a, b, 2, empty, two).message().find("size 0"), std::string::npos);
  EXPECT_NE(relayout_box(a, b, 2, two, negative).message().find("stride -1"), std::string::npos);
}

}  // namespace
