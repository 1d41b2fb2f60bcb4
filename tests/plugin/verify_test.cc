// hash_box (plugin/verify.h): the hash of a box depends on its contents
// only, not on where or how the box lies in a buffer.
#include "plugin/verify.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <vector>

namespace refit::plugin {
namespace {

using control::Segment;

// A [6, 10] I32 tensor with element (r, c) = 100 r + c.
int32_t value(int64_t r, int64_t c) { return static_cast<int32_t>(100 * r + c); }

TEST(HashBox, SameContentsSameHashWhateverTheLayout) {
  // Rows [1, 5) of the tensor, contiguous.
  std::vector<int32_t> rows(4 * 10);
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 10; ++c) rows[r * 10 + c] = value(1 + r, c);
  const Segment contiguous{"t", {1, 0}, {4, 10}, 0, {10, 1}};
  // The whole tensor, transposed (column-major), after 3 elements of padding.
  std::vector<int32_t> transposed(3 + 10 * 6, -1);
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t c = 0; c < 10; ++c) transposed[3 + c * 6 + r] = value(r, c);
  const Segment column_major{"t", {0, 0}, {6, 10}, 3, {1, 6}};
  const auto* a = reinterpret_cast<const uint8_t*>(rows.data());
  const auto* b = reinterpret_cast<const uint8_t*>(transposed.data());

  // The box rows [2, 4), columns [3, 8): five elements per row.
  const std::vector<int64_t> start{2, 3}, size{2, 5};
  Result<uint64_t> ha = hash_box(a, rows.size() * 4, contiguous, 4, start, size);
  Result<uint64_t> hb = hash_box(b, transposed.size() * 4, column_major, 4, start, size);
  ASSERT_TRUE(ha.is_ok() && hb.is_ok()) << ha.status().message() << hb.status().message();
  EXPECT_EQ(*ha, *hb);
  // The value is XXH3-64 of the box's elements in row-major order.
  std::vector<int32_t> box;
  for (int64_t r = 2; r < 4; ++r)
    for (int64_t c = 3; c < 8; ++c) box.push_back(value(r, c));
  EXPECT_EQ(*ha, XXH3_64bits(box.data(), box.size() * 4));
  // Whole rows merge into one run; the hash is the same.
  Result<uint64_t> whole = hash_box(a, rows.size() * 4, contiguous, 4, {1, 0}, {4, 10});
  EXPECT_EQ(*whole, XXH3_64bits(rows.data(), rows.size() * 4));

  // One element changed: another hash.
  transposed[3 + 4 * 6 + 3] += 1;  // (3, 4)
  EXPECT_NE(*hash_box(b, transposed.size() * 4, column_major, 4, start, size), *ha);
}

TEST(HashBox, RefusesABoxOutsideTheSegmentOrASegmentOutsideTheBuffer) {
  std::vector<int32_t> rows(4 * 10);
  const Segment seg{"t", {1, 0}, {4, 10}, 0, {10, 1}};
  const auto* p = reinterpret_cast<const uint8_t*>(rows.data());
  Result<uint64_t> outside = hash_box(p, rows.size() * 4, seg, 4, {0, 0}, {2, 10});
  EXPECT_EQ(outside.status().message(),
            "tensor \"t\" box start [0,0] size [2,10] is not inside the segment at start [1,0] size [4,10]");
  Result<uint64_t> short_buffer = hash_box(p, rows.size() * 4 - 1, seg, 4, {1, 0}, {1, 10});
  EXPECT_EQ(short_buffer.status().message(),
            "tensor \"t\" box start [1,0] size [1,10]: the segment's elements reach past the buffer's 159 bytes");
  Result<uint64_t> dims = hash_box(p, rows.size() * 4, seg, 4, {1}, {1});
  EXPECT_FALSE(dims.is_ok());
}

}  // namespace
}  // namespace refit::plugin
