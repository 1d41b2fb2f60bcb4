#include "planner/layout.h"

#include <gtest/gtest.h>

namespace refit {
namespace {

// One receiver rank, a 32-element BF16 buffer, and a tensor [4, 4].
struct Fixture {
  Layout L;
  uint32_t t, buf;
  Fixture() {
    L.receivers = {{0, 0}};
    t = L.add_tensor("w", DType::kBF16, {4, 4});
    buf = L.add_buffer({Side::kReceiver, "fused", DType::kBF16, 64, L.receiver_sets.intern({0})});
  }
  Region seg(Box b, int64_t offset, Index strides) {
    Region r;
    r.box = b;
    r.ranks = L.receiver_sets.intern({0});
    r.buffer = buf;
    r.offset = offset;
    r.strides = strides;
    return r;
  }
  static Box box(int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    Box b;
    b.ndim = 2;
    b.start = {r0, c0};
    b.size = {rows, cols};
    return b;
  }
};

TEST(Layout, ValidAcceptsSegmentsWithGapsAndInterleavedColumns) {
  Fixture f;
  // Left half of rows 0-1 and right half interleaved in the same rows.
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(0, 2, 0, 2), 0, {4, 1}));
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(0, 2, 2, 2), 2, {4, 1}));
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(2, 2, 0, 4), 20, {4, 1}));  // gap 8..19
  EXPECT_TRUE(validate(f.L).is_ok()) << validate(f.L).message();
}

TEST(Layout, RejectsOverlappingSegmentsNamingBoth) {
  Fixture f;
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(0, 2, 0, 4), 0, {4, 1}));
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(2, 2, 0, 4), 4, {4, 1}));
  Status s = validate(f.L);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("overlap"), std::string::npos);
  EXPECT_NE(s.message().find("\"fused\""), std::string::npos);
}

TEST(Layout, RejectsSegmentOutsideBuffer) {
  Fixture f;
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(0, 4, 0, 4), 20, {4, 1}));
  Status s = validate(f.L);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("outside buffer"), std::string::npos) << s.message();
}

TEST(Layout, RejectsBoxOutsideTensor) {
  Fixture f;
  f.L.tensors[f.t].receivers.push_back(f.seg(Fixture::box(3, 2, 0, 4), 0, {4, 1}));
  Status s = validate(f.L);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("outside the shape"), std::string::npos) << s.message();
}

TEST(Layout, RejectsRankOutOfRange) {
  Fixture f;
  f.L.receiver_sets.intern({0, 3});
  Status s = validate(f.L);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("receiver rank 3 is out of range"), std::string::npos) << s.message();
}

TEST(Layout, DisjointRankSetsMayShareOffsets) {
  Fixture f;
  f.L.receivers = {{0, 0}, {0, 0}};
  f.L.buffers[f.buf].ranks = f.L.receiver_sets.intern({0, 1});
  Region a = f.seg(Fixture::box(0, 2, 0, 4), 0, {4, 1});
  a.ranks = f.L.receiver_sets.intern({0});
  Region b = f.seg(Fixture::box(2, 2, 0, 4), 0, {4, 1});
  b.ranks = f.L.receiver_sets.intern({1});
  f.L.tensors[f.t].receivers = {a, b};
  EXPECT_TRUE(validate(f.L).is_ok()) << validate(f.L).message();
}

}  // namespace
}  // namespace refit
