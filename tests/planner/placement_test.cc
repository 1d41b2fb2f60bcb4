#include "planner/placement.h"

#include <gtest/gtest.h>

namespace refit {
namespace {

Placement P(const char* s) { return *parse_placement(s); }

std::vector<std::pair<int64_t, int64_t>> rows(const std::vector<Box>& boxes, int dim = 0) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const Box& b : boxes) out.push_back({b.start[dim], b.end(dim)});
  return out;
}

TEST(Placement, ParsesTheThreeKindsAndRefusesPartial) {
  EXPECT_EQ(P("R").kind, Placement::Kind::kReplicate);
  EXPECT_EQ(P("S(2)").dim, 2);
  Placement ss = P("SS(0,4)");
  EXPECT_EQ(ss.kind, Placement::Kind::kStridedShard);
  EXPECT_EQ(ss.split_factor, 4);
  auto partial = parse_placement("Partial");
  ASSERT_FALSE(partial.is_ok());
  EXPECT_NE(partial.status().message().find("reduce"), std::string::npos);
  EXPECT_FALSE(parse_placement("S(x)").is_ok());
  EXPECT_FALSE(parse_placement("S(-1)").is_ok());
  EXPECT_FALSE(parse_placement("SS(0)").is_ok());
  EXPECT_FALSE(parse_placement("Shard(0)").is_ok());
}

TEST(Placement, ShardFollowsTorchChunkWithEmptyTrailingShards) {
  // torch.chunk(5 rows, 4): chunk 2 -> [0,2) [2,4) [4,5) and an empty fourth.
  auto b = dtensor_boxes({5, 3}, {{4}, {0, 1, 2, 3}, {P("S(0)")}});
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(rows(*b), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 4}, {4, 5}, {5, 5}}));
  EXPECT_TRUE((*b)[3].empty());
}

TEST(Placement, TwoMeshDimsOnOneTensorDimNestLeftToRight) {
  // 10 rows over mesh [2, 3]: first halves of 5, then chunks of 2 of each half.
  auto b = dtensor_boxes({10}, {{2, 3}, {0, 1, 2, 3, 4, 5}, {P("S(0)"), P("S(0)")}});
  ASSERT_TRUE(b.is_ok());
  EXPECT_EQ(rows(*b), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 4}, {4, 5}, {5, 7}, {7, 9}, {9, 10}}));
}

TEST(Placement, StridedShardCutsAfterTheShardItPairsWith) {
  // FSDP2 over TP: mesh [dp=2, tp=2], placements [SS(0,2), S(0)] on 8 rows.
  // TP cuts first (rows 0-3 / 4-7), FSDP cuts each TP piece.
  auto b = dtensor_boxes({8, 2}, {{2, 2}, {0, 1, 2, 3}, {P("SS(0,2)"), P("S(0)")}});
  ASSERT_TRUE(b.is_ok());
  // mesh (dp, tp) row-major: (0,0) (0,1) (1,0) (1,1)
  EXPECT_EQ(rows(*b), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {4, 6}, {2, 4}, {6, 8}}));
}

TEST(Placement, StridedShardNeedsMatchingSplitFactorAndAPartner) {
  auto bad = dtensor_boxes({8}, {{2, 2}, {0, 1, 2, 3}, {P("SS(0,3)"), P("S(0)")}});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("split_factor"), std::string::npos);
  auto alone = dtensor_boxes({8}, {{2, 2}, {0, 1, 2, 3}, {P("SS(0,2)"), P("R")}});
  ASSERT_FALSE(alone.is_ok());
  EXPECT_NE(alone.status().message().find("no later S(0)"), std::string::npos);
}

TEST(Placement, RejectsShardDimOutOfRangeAndMeshMismatch) {
  auto b = dtensor_boxes({4, 4}, {{2}, {0, 1}, {P("S(2)")}});
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("dim 2"), std::string::npos);
  EXPECT_FALSE(dtensor_boxes({4}, {{2}, {0, 1, 2}, {P("S(0)")}}).is_ok());
  EXPECT_FALSE(dtensor_boxes({4}, {{2, 2}, {0, 1, 2, 3}, {P("S(0)")}}).is_ok());
}

TEST(Placement, AddDtensorSharesRegionsAmongReplicasAndSkipsEmptyShards) {
  Layout L;
  L.sources.resize(8);
  uint32_t t = L.add_tensor("w", DType::kBF16, {3, 4});
  // mesh [dp=2, tp=4], [R, S(0)]: 3 rows over 4 -> chunks of 1, the last empty.
  ASSERT_TRUE(add_dtensor(L, t, Side::kSource, {{2, 4}, {0, 1, 2, 3, 4, 5, 6, 7}, {P("R"), P("S(0)")}}, "w").is_ok());
  const auto& regions = L.tensors[t].sources;
  ASSERT_EQ(regions.size(), 3u);
  EXPECT_EQ(L.source_sets.get(regions[0].ranks), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(L.buffers[regions[2].buffer].bytes, 8);
  EXPECT_TRUE(validate(L).is_ok());
}

TEST(Placement, AddDtensorRejectsRepeatedAndOutOfRangeRanks) {
  Layout L;
  L.receivers.resize(2);
  uint32_t t = L.add_tensor("w", DType::kBF16, {4});
  auto rep = add_dtensor(L, t, Side::kReceiver, {{2}, {1, 1}, {P("S(0)")}}, "w");
  ASSERT_FALSE(rep.is_ok());
  EXPECT_NE(rep.message().find("twice"), std::string::npos);
  auto out = add_dtensor(L, t, Side::kReceiver, {{2}, {0, 2}, {P("S(0)")}}, "w");
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.message().find("receiver rank 2"), std::string::npos);
}

}  // namespace
}  // namespace refit
