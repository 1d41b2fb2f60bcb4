// The copies a source converts with "quantize": "source"
// (plugin/source_convert.h, docs/conversion.md "At the source"): which
// boxes, where they lie, the memory bound, and their segments.

#include "plugin/source_convert.h"

#include <gtest/gtest.h>

namespace refit::plugin {
namespace {

control::Segment seg(const std::string& tensor, std::vector<int64_t> start, std::vector<int64_t> size) {
  std::vector<int64_t> strides(size.size(), 1);
  for (size_t d = size.size() - 1; d > 0; --d) strides[d - 1] = strides[d] * size[d];
  return control::Segment{tensor, std::move(start), std::move(size), 0, std::move(strides), ""};
}

const std::map<std::string, std::vector<int64_t>> kShapes = {{"w", {300, 256}}, {"x", {64, 32}}, {"n", {256}}};

TEST(PlanConverted, QuantizesTheWholeBlocksOfEachSegment) {
  // Rows [10, 300) of "w": whole blocks are rows [128, 300) (the tensor's
  // edge ends a partial block), all 256 columns.
  std::vector<ServedBuffer> bufs = {{"BF16", {seg("w", {10, 0}, {290, 256})}, true}};
  const ConvertLayout l = plan_converted(bufs, kShapes, {{"w", DType::kF8E4M3, {128, 128}}}, 1 << 20);
  ASSERT_EQ(l.jobs.size(), 1u);
  EXPECT_EQ(l.jobs[0].start, (std::vector<int64_t>{128, 0}));
  EXPECT_EQ(l.jobs[0].size, (std::vector<int64_t>{172, 256}));
  EXPECT_EQ(l.jobs[0].data_offset, 0u);
  EXPECT_EQ(l.jobs[0].scale_offset, 172u * 256);          // 64-byte aligned
  EXPECT_EQ(l.bytes, 172u * 256 + 64);                    // 2 x 2 scales, padded to 64
  const std::vector<control::Segment> segs = converted_segments(l);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].tensor, "w");
  EXPECT_EQ(segs[0].dtype, "F8_E4M3");
  EXPECT_EQ(segs[0].strides, (std::vector<int64_t>{256, 1}));
  EXPECT_EQ(segs[1].tensor, "w_scale_inv");
  EXPECT_EQ(segs[1].dtype, "F32");
  EXPECT_EQ(segs[1].start, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(segs[1].size, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(segs[1].offset, static_cast<int64_t>(172 * 256 / 4));
}

TEST(PlanConverted, NoWholeBlockNoCopyAndCastsCopyAll) {
  std::vector<ServedBuffer> bufs = {{"BF16", {seg("w", {10, 0}, {100, 256})}, true},
                                    {"F32", {seg("x", {0, 0}, {64, 32})}, true}};
  const ConvertLayout l = plan_converted(
      bufs, kShapes, {{"w", DType::kF8E4M3, {128, 128}}, {"x", DType::kBF16, {128, 128}}}, 1 << 20);
  ASSERT_EQ(l.jobs.size(), 1u);  // rows [10, 110) of "w" hold no whole block
  EXPECT_EQ(l.jobs[0].segment.tensor, "x");
  EXPECT_EQ(l.jobs[0].size, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(converted_segments(l).size(), 1u);  // a cast has no scales
}

TEST(PlanConverted, TheBoundLeavesTheRestUnconverted) {
  std::vector<ServedBuffer> bufs = {{"BF16", {seg("w", {0, 0}, {128, 256}), seg("w", {128, 0}, {172, 256})}, true},
                                    {"F32", {seg("x", {0, 0}, {64, 32})}, true}};
  const std::vector<ConvertRequest> q = {{"w", DType::kF8E4M3, {128, 128}}, {"x", DType::kBF16, {128, 128}}};
  // Room for the first copy of "w" (32768 + 64) and "x" (4096), not both of "w".
  const ConvertLayout l = plan_converted(bufs, kShapes, q, 32768 + 64 + 4096);
  ASSERT_EQ(l.jobs.size(), 2u);
  EXPECT_EQ(l.jobs[0].start, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(l.jobs[1].segment.tensor, "x");
  EXPECT_EQ(l.left_out, (std::vector<std::string>{"w"}));
  EXPECT_TRUE(plan_converted(bufs, kShapes, q, 0).jobs.empty());
}

TEST(PlanConverted, SkipsWhatItCannotConvertOrRead) {
  std::vector<ServedBuffer> bufs = {{"BF16", {seg("w", {0, 0}, {128, 256})}, false},   // a GPU shard
                                    {"BF16", {seg("n", {0}, {256})}, true}};
  // A 1-dim tensor has no blocks, and F8 to BF16 is no conversion refit does.
  EXPECT_TRUE(plan_converted(bufs, kShapes, {{"w", DType::kF8E4M3, {128, 128}}, {"n", DType::kF8E4M3, {128, 128}}}, 1 << 20)
                  .jobs.empty());
  std::vector<ServedBuffer> fp8 = {{"F8_E4M3", {seg("w", {0, 0}, {128, 256})}, true}};
  EXPECT_TRUE(plan_converted(fp8, kShapes, {{"w", DType::kBF16, {128, 128}}}, 1 << 20).jobs.empty());
}

}  // namespace
}  // namespace refit::plugin
