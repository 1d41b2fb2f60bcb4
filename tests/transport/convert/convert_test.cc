// The conversion kernels (transport/convert) on hand-checked cases: exact
// E4M3, BF16 and F16 encodings of known values, round-to-nearest-even ties,
// saturation, block scales, partial edge blocks, and the refusals (NaN or
// infinity in a block: nothing written). Runs without Python; the bit-for-
// bit comparison with PyTorch over 10^6 random blocks is
// torch_reference_test.py (scripts/convert-torch-check).

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "transport/convert/convert.h"
#include "transport/convert/element.h"

namespace refit::convert {
namespace {

float bits_f(uint32_t u) { return f32_from_bits(u); }
uint16_t bf16(float f) { return static_cast<uint16_t>(f32_bits(f) >> 16); }  // exact for BF16 values

TEST(E4M3, KnownEncodings) {
  EXPECT_EQ(e4m3_from_f32(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_f32(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_f32(1.0f), 0x38);     // 0 0111 000
  EXPECT_EQ(e4m3_from_f32(-1.0f), 0xB8);
  EXPECT_EQ(e4m3_from_f32(1.5f), 0x3C);     // 0 0111 100
  EXPECT_EQ(e4m3_from_f32(240.0f), 0x77);   // 1.875 * 2^7
  EXPECT_EQ(e4m3_from_f32(256.0f), 0x78);   // 2^8
  EXPECT_EQ(e4m3_from_f32(448.0f), 0x7E);   // the largest finite
  EXPECT_EQ(e4m3_from_f32(-448.0f), 0xFE);
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -6)), 0x08);  // the smallest normal
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -9)), 0x01);  // the smallest subnormal
  EXPECT_EQ(e4m3_from_f32(std::ldexp(7.0f, -9)), 0x07);  // the largest subnormal
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -30)), 0x00);
  EXPECT_EQ(e4m3_from_f32(-std::ldexp(1.0f, -30)), 0x80);
}

TEST(E4M3, TiesRoundToEven) {
  EXPECT_EQ(e4m3_from_f32(1.0625f), 0x38);   // between 1.0 (m 0) and 1.125 (m 1): even is 1.0
  EXPECT_EQ(e4m3_from_f32(1.1875f), 0x3A);   // between 1.125 (m 1) and 1.25 (m 2): even is 1.25
  EXPECT_EQ(e4m3_from_f32(std::nextafter(1.0625f, 2.0f)), 0x39);  // just past the tie rounds up
  EXPECT_EQ(e4m3_from_f32(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: to 0
  EXPECT_EQ(e4m3_from_f32(std::ldexp(3.0f, -10)), 0x02);  // 1.5 steps: to 2 steps
  EXPECT_EQ(e4m3_from_f32(std::ldexp(5.0f, -10)), 0x02);  // 2.5 steps: to 2 steps
  EXPECT_EQ(e4m3_from_f32(std::ldexp(15.0f, -10)), 0x08); // 7.5 steps: to the smallest normal
  EXPECT_EQ(e4m3_from_f32(464.0f), 0x7E);    // between 448 and 480 (not finite): to 448
}

TEST(E4M3, SaturatesPastTheRange) {
  EXPECT_EQ(e4m3_from_f32(470.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(464.5f), 0x7E);    // rounds to 480, which E4M3 has not: 448
  EXPECT_EQ(e4m3_from_f32(480.0f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-1e30f), 0xFE);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(e4m3_from_f32(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(e4m3_from_f32(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(e4m3_from_f32(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
}

TEST(E4M3, EveryFiniteCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(e4m3_from_f32(f32_from_e4m3(static_cast<uint8_t>(b))), b) << b;
  }
  EXPECT_EQ(f32_from_e4m3(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(f32_from_e4m3(0x7F)));
}

// Against a brute-force reference: the nearest of the 127 finite
// non-negative codes' values, ties to the even code (so everything past 448
// is 448).
TEST(E4M3, MatchesNearestValueOverRandomFloats) {
  std::vector<double> value(127);
  for (int b = 0; b < 127; ++b) value[b] = f32_from_e4m3(static_cast<uint8_t>(b));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-14, 10);
  for (int n = 0; n < 200000; ++n) {
    const float x = std::ldexp(mant(rng), ex(rng));
    int best = 0;
    for (int b = 1; b < 127; ++b) {
      const double d = std::abs(value[b] - x), db = std::abs(value[best] - x);
      if (d < db || (d == db && (b & 1) == 0)) best = b;
    }
    ASSERT_EQ(e4m3_from_f32(x), best) << x;
    ASSERT_EQ(e4m3_from_f32(-x), best | 0x80) << -x;
  }
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_from_f32(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_f32(bits_f(0x3F808000)), 0x3F80);  // tie, even below
  EXPECT_EQ(bf16_from_f32(bits_f(0x3F818000)), 0x3F82);  // tie, even above
  EXPECT_EQ(bf16_from_f32(bits_f(0x3F808001)), 0x3F81);  // past the tie
  EXPECT_EQ(bf16_from_f32(-0.0f), 0x8000);
  EXPECT_EQ(bf16_from_f32(bits_f(0x00000001)), 0x0000);   // the smallest subnormal: to 0
  EXPECT_EQ(bf16_from_f32(bits_f(0x00018000)), 0x0002);   // subnormal tie, even above
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::max()), 0x7F80);  // overflow to infinity
  EXPECT_EQ(bf16_from_f32(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_from_f32(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  EXPECT_EQ(bf16_from_f32(bits_f(0xFF800001)), 0x7FC0);  // a signalling NaN, negative
}

TEST(F16, RoundsToNearestEven) {
  EXPECT_EQ(f16_from_f32(1.0f), 0x3C00);
  EXPECT_EQ(f16_from_f32(-2.0f), 0xC000);
  EXPECT_EQ(f16_from_f32(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie, even below
  EXPECT_EQ(f16_from_f32(1.0f + std::ldexp(3.0f, -11)), 0x3C02);  // tie, even above
  EXPECT_EQ(f16_from_f32(65504.0f), 0x7BFF);
  EXPECT_EQ(f16_from_f32(65519.0f), 0x7BFF);
  EXPECT_EQ(f16_from_f32(65520.0f), 0x7C00);  // tie past the largest: infinity
  EXPECT_EQ(f16_from_f32(1e10f), 0x7C00);
  EXPECT_EQ(f16_from_f32(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  EXPECT_EQ(f16_from_f32(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(f16_from_f32(std::ldexp(1.0f, -25)), 0x0000);  // tie: to 0
  EXPECT_EQ(f16_from_f32(std::ldexp(3.0f, -25)), 0x0002);  // tie: to 2 steps
  EXPECT_EQ(f16_from_f32(-0.0f), 0x8000);
  EXPECT_EQ(f16_from_f32(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(f16_from_f32(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
}

TEST(Cast, WholeBuffers) {
  const std::vector<float> f = {1.0f, -2.0f, 65520.0f, std::ldexp(1.0f, -25)};
  std::vector<uint16_t> out(f.size());
  ASSERT_TRUE(cast(DType::kF32, DType::kF16, f.data(), out.data(), 4, "w").is_ok());
  EXPECT_EQ(out, (std::vector<uint16_t>{0x3C00, 0xC000, 0x7C00, 0x0000}));
  ASSERT_TRUE(cast(DType::kF32, DType::kBF16, f.data(), out.data(), 4, "w").is_ok());
  EXPECT_EQ(out[0], 0x3F80);
  EXPECT_EQ(out[1], 0xC000);
  const std::vector<uint16_t> b = {0x3F80, 0x4780 /* 65536 */, 0x3F81 /* 1.0078125 */};
  ASSERT_TRUE(cast(DType::kBF16, DType::kF16, b.data(), out.data(), 3, "w").is_ok());
  EXPECT_EQ(out[0], 0x3C00);
  EXPECT_EQ(out[1], 0x7C00);
  EXPECT_EQ(out[2], 0x3C08);  // exact: 1 + 2^-7
}

TEST(Cast, RefusesWhatItDoesNotConvert) {
  uint16_t x = 0, y = 0;
  for (auto [from, to] : {std::pair{DType::kF16, DType::kBF16}, std::pair{DType::kF8E4M3, DType::kBF16},
                          std::pair{DType::kI32, DType::kF32}, std::pair{DType::kBF16, DType::kF8E4M3}}) {
    const Status s = cast(from, to, &x, &y, 1, "model.layers.0.w");
    EXPECT_EQ(s.code(), Code::kUnsupported);
    EXPECT_NE(s.message().find("model.layers.0.w"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(std::string(dtype_name(from))), std::string::npos) << s.message();
  }
}

TEST(BlockScale, IsAmaxOver448) {
  EXPECT_EQ(e4m3_block_scale(448.0f), 1.0f);
  EXPECT_EQ(e4m3_block_scale(7.0f), 1.0f / 64.0f);
  // An all-zero block: amax clamped to 1e-4 (vLLM's per_block_cast_to_fp8).
  EXPECT_EQ(e4m3_block_scale(0.0f), 1e-4f / 448.0f);
  EXPECT_EQ(e4m3_block_scale(5e-5f), 1e-4f / 448.0f);
}

struct Quantized {
  std::vector<uint8_t> values;
  std::vector<float> scales;
};

Quantized quantize_bf16(const std::vector<uint16_t>& src, int64_t rows, int64_t cols, BlockSize block) {
  Quantized q;
  const int64_t br = (rows + block.rows - 1) / block.rows, bc = (cols + block.cols - 1) / block.cols;
  q.values.assign(rows * cols, 0xAB);
  q.scales.assign(br * bc, -1.0f);
  QuantizeArgs a;
  a.src = src.data();
  a.src_stride = cols;
  a.rows = rows;
  a.cols = cols;
  a.dst = q.values.data();
  a.dst_stride = cols;
  a.scales = q.scales.data();
  a.scale_stride = bc;
  a.block = block;
  a.tensor = "w";
  const Status s = quantize_e4m3_blocks(a);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return q;
}

TEST(Quantize, OneBlockByHand) {
  // amax 7: scale 7/448 = 1/64 exactly, values times 64.
  const std::vector<float> x = {7.0f, -3.5f, 1.0f / 64, 0.0f, -0.0f, 0.0625f, 6.0f, std::ldexp(1.0f, -15)};
  std::vector<uint16_t> src;
  for (float f : x) src.push_back(bf16(f));
  const Quantized q = quantize_bf16(src, 2, 4, {2, 4});
  ASSERT_EQ(q.scales.size(), 1u);
  EXPECT_EQ(q.scales[0], 1.0f / 64);
  // 448, -224, 1, 0, -0, 4, 384, 2^-9 (the smallest subnormal)
  EXPECT_EQ(q.values, (std::vector<uint8_t>{0x7E, 0xF6, 0x38, 0x00, 0x80, 0x48, 0x7C, 0x01}));
}

TEST(Quantize, AllZeroBlockGetsTheClampedScale) {
  std::vector<uint16_t> src(16, 0);
  src[3] = 0x8000;  // -0.0
  const Quantized q = quantize_bf16(src, 4, 4, {4, 4});
  EXPECT_EQ(q.scales[0], 1e-4f / 448.0f);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(q.values[i], i == 3 ? 0x80 : 0x00) << i;
}

TEST(Quantize, EdgeBlocksArePartialAndStridesRespected) {
  // 5 x 7 with 2 x 3 blocks: 3 x 3 blocks, the last row and column partial.
  const int64_t rows = 5, cols = 7;
  std::vector<uint16_t> src(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) src[i * cols + j] = bf16(static_cast<float>(i * 10 + j));
  const Quantized q = quantize_bf16(src, rows, cols, {2, 3});
  ASSERT_EQ(q.scales.size(), 9u);
  // Block (2, 2) is the single element (4, 6) = 46: scale 46/448, value 448.
  EXPECT_EQ(q.scales[8], 46.0f / 448.0f);
  EXPECT_EQ(q.values[4 * cols + 6], 0x7E);
  // Block (0, 0) holds 0, 1, 2, 10, 11, 12: amax 12.
  EXPECT_EQ(q.scales[0], 12.0f / 448.0f);
  for (uint8_t v : q.values) EXPECT_NE(v, 0xAB);  // every element written
}

class QuantizeRefusal : public ::testing::Test {
 protected:
  // 4 x 4 blocks of 2 x 2 over an 8 x 8 box.
  std::vector<uint16_t> src = std::vector<uint16_t>(64, 0x3F80);
  std::vector<uint8_t> dst = std::vector<uint8_t>(64, 0xAB);
  std::vector<float> scales = std::vector<float>(16, -1.0f);
  QuantizeArgs args() {
    QuantizeArgs a;
    a.src = src.data();
    a.src_stride = 8;
    a.rows = 8;
    a.cols = 8;
    a.dst = dst.data();
    a.dst_stride = 8;
    a.scales = scales.data();
    a.scale_stride = 4;
    a.block = {2, 2};
    a.tensor = "model.layers.3.mlp.down_proj.weight";
    a.block_row0 = 10;
    a.block_col0 = 20;
    return a;
  }
  void expect_nothing_written() {
    for (uint8_t v : dst) ASSERT_EQ(v, 0xAB);
    for (float s : scales) ASSERT_EQ(s, -1.0f);
  }
};

TEST_F(QuantizeRefusal, NaNNamesTensorAndBlock) {
  src[5 * 8 + 3] = 0x7FC0;  // row 5, column 3: block (2, 1) of the box
  const Status s = quantize_e4m3_blocks(args());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("model.layers.3.mlp.down_proj.weight"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("block (12, 21)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("NaN"), std::string::npos) << s.message();
  expect_nothing_written();
}

TEST_F(QuantizeRefusal, InfinityInTheLastBlock) {
  src[63] = 0xFF80;  // -inf
  const Status s = quantize_e4m3_blocks(args());
  EXPECT_NE(s.message().find("block (13, 23)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("infinity"), std::string::npos) << s.message();
  expect_nothing_written();
}

TEST_F(QuantizeRefusal, BadArguments) {
  QuantizeArgs a = args();
  a.src_dtype = DType::kF16;
  EXPECT_EQ(quantize_e4m3_blocks(a).code(), Code::kUnsupported);
  a = args();
  a.block = {0, 128};
  EXPECT_EQ(quantize_e4m3_blocks(a).code(), Code::kInvalidArgument);
  a = args();
  a.scale_stride = 3;
  EXPECT_EQ(quantize_e4m3_blocks(a).code(), Code::kInvalidArgument);
  a = args();
  a.src_stride = 4;
  EXPECT_EQ(quantize_e4m3_blocks(a).code(), Code::kInvalidArgument);
  a = args();
  a.scales = nullptr;
  EXPECT_EQ(quantize_e4m3_blocks(a).code(), Code::kInvalidArgument);
  expect_nothing_written();
}

TEST(Quantize, F32SourceMatchesBF16WhereTheValuesAreEqual) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> b(64 * 64);
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] = bf16_from_f32(nd(rng));
    f[i] = f32_from_bf16(b[i]);
  }
  const Quantized qb = quantize_bf16(b, 64, 64, {16, 32});
  Quantized qf;
  qf.values.assign(b.size(), 0);
  qf.scales.assign(8, 0);
  QuantizeArgs a;
  a.src_dtype = DType::kF32;
  a.src = f.data();
  a.src_stride = 64;
  a.rows = 64;
  a.cols = 64;
  a.dst = qf.values.data();
  a.dst_stride = 64;
  a.scales = qf.scales.data();
  a.scale_stride = 2;
  a.block = {16, 32};
  ASSERT_TRUE(quantize_e4m3_blocks(a).is_ok());
  EXPECT_EQ(qb.values, qf.values);
  EXPECT_EQ(qb.scales, qf.scales);
}

}  // namespace
}  // namespace refit::convert
