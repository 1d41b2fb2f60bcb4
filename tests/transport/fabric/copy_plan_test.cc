#include "transport/cuda/copy_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace refit::cuda {
namespace {

// Moves the same bytes as the pieces one by one, checked against memcpy of
// each piece, on random layouts with regular and irregular strides.
TEST(CopyPlan, MovesExactlyTheBytesOfThePieces) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<uint8_t> src(1 << 16), want(1 << 16, 0), got(1 << 16, 0);
    for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
    std::vector<Piece> pieces;
    // Boxes of planes x rows x width with pitches, packed on one side, and
    // some irregular pieces in between; destinations never overlap.
    uint64_t dst_at = 0, src_at = 0;
    while (true) {
      const uint64_t width = 1 + rng() % 64;
      const uint64_t rows = 1 + rng() % 6;
      const uint64_t planes = 1 + rng() % 4;
      const uint64_t pitch = width + rng() % 16;
      const uint64_t plane = pitch * (rows + rng() % 3);
      const bool packed_src = rng() % 2;
      const uint64_t extent = planes * plane + pitch;
      if (dst_at + extent >= got.size() || src_at + extent >= src.size()) break;
      for (uint64_t z = 0; z < planes; ++z) {
        for (uint64_t y = 0; y < rows; ++y) {
          const uint64_t d = dst_at + z * plane + y * pitch;
          const uint64_t s = packed_src ? src_at + (z * rows + y) * width : src_at + z * plane + y * pitch;
          pieces.push_back(Piece{got.data() + d, src.data() + s, width});
          std::memcpy(want.data() + d, src.data() + s, width);
        }
      }
      if (rng() % 4 == 0) pieces.push_back(Piece{got.data() + dst_at, src.data(), 0});  // empty: dropped
      dst_at += extent + rng() % 8;
      src_at += extent + rng() % 8;
    }
    const std::vector<Copy> copies = plan_copies(pieces);
    uint64_t moved = 0;
    for (const Copy& c : copies) {
      // Shapes the CUDA runtime accepts.
      if (c.height > 1) {
        EXPECT_GE(c.dst_pitch, c.width);
        EXPECT_GE(c.src_pitch, c.width);
      }
      if (c.depth > 1) {
        EXPECT_EQ(c.dst_plane % c.dst_pitch, 0u);
        EXPECT_EQ(c.src_plane % c.src_pitch, 0u);
        EXPECT_GE(c.dst_plane / c.dst_pitch, c.height);
        EXPECT_GE(c.src_plane / c.src_pitch, c.height);
      }
      copy_on_host(c);
      moved += c.bytes();
    }
    uint64_t expected = 0;
    for (const Piece& p : pieces) expected += p.bytes;
    EXPECT_EQ(moved, expected);
    ASSERT_EQ(got, want) << "trial " << trial;
    EXPECT_LE(copies.size(), pieces.size());
  }
}

TEST(CopyPlan, RegularRowsBecomeOne2DCopyAndPlanesOne3DCopy) {
  std::vector<uint8_t> src(4096), dst(8192);
  std::vector<Piece> rows;
  for (uint64_t y = 0; y < 8; ++y) rows.push_back(Piece{dst.data() + y * 100, src.data() + y * 32, 32});
  std::vector<Copy> c = plan_copies(rows);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].height, 8u);
  EXPECT_EQ(c[0].dst_pitch, 100u);
  EXPECT_EQ(c[0].src_pitch, 32u);

  std::vector<Piece> box;
  for (uint64_t z = 0; z < 3; ++z) {
    for (uint64_t y = 0; y < 4; ++y) box.push_back(Piece{dst.data() + z * 1000 + y * 100, src.data() + (z * 4 + y) * 32, 32});
  }
  c = plan_copies(box);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].depth, 3u);
  EXPECT_EQ(c[0].height, 4u);
  EXPECT_EQ(c[0].dst_plane, 1000u);
  EXPECT_EQ(c[0].src_plane, 128u);
}

TEST(CopyPlan, BackwardOrOverlappingStridesStaySeparate) {
  std::vector<uint8_t> src(4096), dst(4096);
  // Backwards, and a pitch below the width: the runtime refuses both.
  std::vector<Piece> back = {{dst.data() + 200, src.data(), 32}, {dst.data() + 100, src.data() + 32, 32}};
  EXPECT_EQ(plan_copies(back).size(), 2u);
  std::vector<Piece> narrow = {{dst.data(), src.data(), 32}, {dst.data() + 16, src.data() + 32, 32}};
  EXPECT_EQ(plan_copies(narrow).size(), 2u);
}

}  // namespace
}  // namespace refit::cuda
