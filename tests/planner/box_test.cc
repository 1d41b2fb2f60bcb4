#include "planner/box.h"

#include <gtest/gtest.h>

namespace refit {
namespace {

Box make(std::vector<int64_t> start, std::vector<int64_t> size) {
  Box b;
  b.ndim = static_cast<int>(start.size());
  for (int d = 0; d < b.ndim; ++d) {
    b.start[d] = start[d];
    b.size[d] = size[d];
  }
  return b;
}

TEST(Box, IntersectionOfDisjointBoxesIsEmpty) {
  EXPECT_TRUE(intersect(make({0, 0}, {2, 2}), make({2, 0}, {2, 2})).empty());
  EXPECT_FALSE(overlaps(make({0, 0}, {2, 2}), make({2, 0}, {2, 2})));
}

TEST(Box, IntersectionClipsEveryDim) {
  Box r = intersect(make({0, 0, 0}, {4, 5, 6}), make({1, 2, 3}, {10, 1, 10}));
  EXPECT_EQ(r, make({1, 2, 3}, {3, 1, 3}));
  EXPECT_EQ(r.numel(), 9);
}

TEST(Box, ContainsIsInclusiveOfEdges) {
  EXPECT_TRUE(contains(make({0, 0}, {4, 4}), make({0, 0}, {4, 4})));
  EXPECT_TRUE(contains(make({0, 0}, {4, 4}), make({3, 1}, {1, 3})));
  EXPECT_FALSE(contains(make({0, 0}, {4, 4}), make({3, 1}, {2, 3})));
}

TEST(Box, ScalarHasOneElement) {
  Box s = Box::whole({});
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(split_row_major(s, 1).size(), 1u);
}

// Every element exactly once, each chunk within the cap, row-major order.
void check_split(const Box& box, int64_t cap) {
  auto parts = split_row_major(box, cap);
  int64_t total = 0;
  Box prev;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Box& p = parts[i];
    EXPECT_TRUE(contains(box, p));
    EXPECT_LE(p.numel(), std::max<int64_t>(cap, 1));
    EXPECT_GT(p.numel(), 0);
    for (size_t j = 0; j < i; ++j) EXPECT_FALSE(overlaps(parts[j], p)) << p.to_string();
    if (i > 0) {
      EXPECT_TRUE(prev < p);
    }
    prev = p;
    total += p.numel();
  }
  EXPECT_EQ(total, box.numel());
}

TEST(Box, SplitRowMajorCoversEachElementOnceWithinCap) {
  check_split(make({0}, {10}), 3);
  check_split(make({1, 2}, {7, 5}), 11);
  check_split(make({0, 0, 0}, {3, 4, 5}), 4);
  check_split(make({0, 0, 0}, {3, 4, 5}), 20);
  check_split(make({0, 0, 0}, {3, 4, 5}), 1);
  check_split(make({2, 0, 1, 0}, {2, 3, 2, 9}), 7);
}

TEST(Box, SplitRowMajorTakesWholeTrailingDims) {
  auto parts = split_row_major(make({0, 0}, {8, 4}), 8);
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[1], make({2, 0}, {2, 4}));
}

}  // namespace
}  // namespace refit
