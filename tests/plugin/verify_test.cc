// hash_box (plugin/verify.h): the hash of a box depends on its contents
// only, not on where or how the box lies in a buffer.
#include "plugin/verify.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "transport/convert/convert.h"

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

// hash_converted_box to F8_E4M3: a source holding an F32 tensor [2, 6, 8]
// (two stacked experts) hashes the box rows [2, 6) of both experts, and the
// scales of its blocks of 2 x 4 as two boxes of the scale tensor [2, 3, 2]
// (one per block column, as two receiver segments would cut them). A
// receiver that quantized the whole tensor hashes the same boxes of its own
// FP8 and scale buffers to the same values; a scale that differs is seen.
TEST(HashConvertedBox, HashesTheBlockScalesAsTheReceiverHoldsThem) {
  constexpr int64_t kExperts = 2, kRows = 6, kCols = 8;
  const std::array<int64_t, 2> block{2, 4};
  std::vector<float> w(kExperts * kRows * kCols);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 37) % 101) * (i % 3 == 0 ? 1e-3f : 2.5f) - 40.0f;
  const Segment whole{"w", {0, 0, 0}, {kExperts, kRows, kCols}, 0, {kRows * kCols, kCols, 1}};
  const std::vector<int64_t> start{0, 2, 0}, size{kExperts, 4, kCols};
  const std::vector<IndexBox> scale_boxes{{{0, 1, 0}, {kExperts, 2, 1}}, {{0, 1, 1}, {kExperts, 2, 1}}};
  bool refused = true;
  Result<ConvertedHashes> got = hash_converted_box(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4, whole,
                                                   DType::kF32, DType::kF8E4M3, block, start, size, scale_boxes,
                                                   &refused);
  ASSERT_TRUE(got.is_ok()) << got.status().message();
  EXPECT_FALSE(refused);
  ASSERT_EQ(got->scale_hashes.size(), 2u);

  // The receiver: every expert quantized whole, FP8 [2, 6, 8], scales [2, 3, 2].
  std::vector<uint8_t> fp8(w.size());
  std::vector<float> scales(kExperts * 3 * 2);
  for (int64_t e = 0; e < kExperts; ++e) {
    convert::QuantizeArgs a;
    a.src_dtype = DType::kF32;
    a.src = w.data() + e * kRows * kCols;
    a.src_stride = kCols;
    a.rows = kRows;
    a.cols = kCols;
    a.dst = fp8.data() + e * kRows * kCols;
    a.dst_stride = kCols;
    a.scales = scales.data() + e * 3 * 2;
    a.scale_stride = 2;
    a.block = {block[0], block[1]};
    a.tensor = "w";
    ASSERT_TRUE(convert::quantize_e4m3_blocks(a).is_ok());
  }
  const Segment held_scales{"w_scale_inv", {0, 0, 0}, {kExperts, 3, 2}, 0, {6, 2, 1}};
  const auto* sp = reinterpret_cast<const uint8_t*>(scales.data());
  EXPECT_EQ(got->hash, *hash_box(fp8.data(), fp8.size(), whole, 1, start, size));
  for (size_t i = 0; i < scale_boxes.size(); ++i) {
    EXPECT_EQ(got->scale_hashes[i],
              *hash_box(sp, scales.size() * 4, held_scales, 4, scale_boxes[i].start, scale_boxes[i].size))
        << "scale box " << i;
  }
  // A receiver whose scale of expert 1, block (2, 1) is one ulp off: the
  // second box no longer matches what the source hashed, the first does.
  scales[1 * 6 + 2 * 2 + 1] = std::nextafter(scales[1 * 6 + 2 * 2 + 1], 1.0f);
  EXPECT_EQ(got->scale_hashes[0],
            *hash_box(sp, scales.size() * 4, held_scales, 4, scale_boxes[0].start, scale_boxes[0].size));
  EXPECT_NE(got->scale_hashes[1],
            *hash_box(sp, scales.size() * 4, held_scales, 4, scale_boxes[1].start, scale_boxes[1].size));

  // A scale box outside the box's blocks (block row 0) is refused, naming it.
  Result<ConvertedHashes> outside =
      hash_converted_box(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4, whole, DType::kF32, DType::kF8E4M3,
                         block, start, size, {{{0, 0, 0}, {1, 1, 1}}}, &refused);
  ASSERT_FALSE(outside.is_ok());
  EXPECT_NE(outside.status().message().find("tensor \"w_scale_inv\" box start [0,0,0] size [1,1,1] is not inside"),
            std::string::npos)
      << outside.status().message();
  EXPECT_FALSE(refused);

  // A box that starts inside a block (row 1 of blocks of 2) is refused,
  // naming where it starts.
  Result<ConvertedHashes> split =
      hash_converted_box(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4, whole, DType::kF32, DType::kF8E4M3,
                         block, {0, 1, 0}, {kExperts, 4, kCols}, {}, &refused);
  ASSERT_FALSE(split.is_ok());
  EXPECT_NE(split.status().message().find("tensor \"w\": a box at row 1, column 0 does not start on a block of 2x4"),
            std::string::npos)
      << split.status().message();
  EXPECT_FALSE(refused);
}

}  // namespace
}  // namespace refit::plugin
