// Hand-checked plans of small layouts; plan_property_test covers random ones.
#include "planner/plan.h"

#include <gtest/gtest.h>

#include "planner/placement.h"

namespace refit {
namespace {

Placement P(const char* s) { return *parse_placement(s); }

// docs/formats.md's layout example: w [10, 6] BF16, S(0) over 2 sources, S(1) over 2
// receivers of one domain.
Layout cross_dim(int receiver_domains) {
  Layout L;
  L.sources = {{0}, {0}};
  L.receivers = {{0, 0}, {receiver_domains > 1 ? 1 : 0, 0}};
  uint32_t w = L.add_tensor("w", DType::kBF16, {10, 6});
  EXPECT_TRUE(add_dtensor(L, w, Side::kSource, {{2}, {0, 1}, {P("S(0)")}}, "w").is_ok());
  EXPECT_TRUE(add_dtensor(L, w, Side::kReceiver, {{2}, {0, 1}, {P("S(1)")}}, "w").is_ok());
  EXPECT_TRUE(validate(L).is_ok());
  return L;
}

// copy_order builds both orders an element at a time and keeps one:
// dims of one index first, then the memory order both regions share.
TEST(CopyOrder, SizeOneDimsFirstThenTheSharedMemoryOrder) {
  Box box{3, {0, 0, 0}, {2, 1, 3}};
  Region col{.box = box, .strides = {1, 2, 2}};  // column-major
  const CopyOrder o = copy_order(box, col, col);
  EXPECT_EQ((std::array<int, 3>{o.dims[0], o.dims[1], o.dims[2]}), (std::array<int, 3>{1, 2, 0}));
  EXPECT_EQ(o.run, 6);  // dims 0 and 2 are contiguous in both: one run
  EXPECT_EQ(o.outer, 1);
}

TEST(CopyOrder, RowMajorWhereTheRegionsOrdersDiffer) {
  Box box{3, {0, 0, 0}, {1, 2, 3}};
  Region col{.box = box, .strides = {6, 1, 2}};  // dims 1 and 2 column-major
  Region row{.box = box, .strides = {6, 3, 1}};
  // `col` alone would walk dim 2 outermost; `row` disagrees: row-major.
  const CopyOrder o = copy_order(box, col, row);
  EXPECT_EQ((std::array<int, 3>{o.dims[0], o.dims[1], o.dims[2]}), (std::array<int, 3>{0, 1, 2}));
  EXPECT_EQ(o.run, 1);  // dim 2 has stride 2 in `col`: nothing merges
  EXPECT_EQ(o.outer, 3);
}

// FunctionRef calls the callable it was made from, not a copy, and passes
// its result back.
TEST(FunctionRef, CallsTheCallableItRefersTo) {
  struct Add {
    int calls = 0;
    int operator()(int a, int b) {
      ++calls;
      return a + b;
    }
  };
  auto apply = [](FunctionRef<int(int, int)> f) { return f(2, 3) * 10 + f(1, 1); };
  Add add;
  EXPECT_EQ(apply(add), 52);
  EXPECT_EQ(add.calls, 2);  // a copy would have counted its own calls
  std::function<int(int, int)> held = std::ref(add);
  EXPECT_EQ(apply(held), 52);
  EXPECT_EQ(add.calls, 4);
}

TEST(Plan, CrossDimReshardPullsEachQuarterOnce) {
  Layout L = cross_dim(1);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const PlanSummary& s = plan->summary();
  EXPECT_EQ(s.total_bytes, 120);
  EXPECT_EQ(s.network_bytes, 120);
  EXPECT_EQ(s.minimum_network_bytes, 120);
  EXPECT_EQ(s.local_bytes, 0);
  EXPECT_EQ(s.units, 2);
  EXPECT_EQ(s.pulls, 4);  // each receiver's half comes from both sources
}

TEST(Plan, ReplicatedReceiversInOneDomainShareOnePull) {
  Layout L;
  L.sources = {{0}};
  L.receivers = {{0, 0}, {0, 1}, {0, 2}};
  uint32_t w = L.add_tensor("w", DType::kF32, {4, 4});
  ASSERT_TRUE(add_dtensor(L, w, Side::kSource, {{1}, {0}, {P("R")}}, "w").is_ok());
  ASSERT_TRUE(add_dtensor(L, w, Side::kReceiver, {{3}, {0, 1, 2}, {P("R")}}, "w").is_ok());
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->summary().network_bytes, 64);
  EXPECT_EQ(plan->summary().local_bytes, 128);
  auto nodedup = make_plan(L, {Strategy::kNoDedup});
  ASSERT_TRUE(nodedup.is_ok());
  EXPECT_EQ(nodedup->summary().network_bytes, 192);
  EXPECT_EQ(nodedup->summary().minimum_network_bytes, 64);
  auto bcast = make_plan(L, {Strategy::kBroadcast});
  ASSERT_TRUE(bcast.is_ok());
  EXPECT_EQ(bcast->summary().network_bytes, 192);
}

TEST(Plan, BroadcastPullsWholeTensorsAndCountsTheGather) {
  Layout L = cross_dim(2);
  auto plan = make_plan(L, {Strategy::kBroadcast});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->summary().network_bytes, 240);  // two receivers, whole tensor each
  EXPECT_EQ(plan->summary().gather_bytes, 60);    // the gatherer fetches the other half
  EXPECT_EQ(plan->summary().units, 0);
}

TEST(Plan, PullersBalanceAcrossTheDomain) {
  // Eight equal tensors, each needed whole by the same two receivers.
  Layout L;
  L.sources = {{0}};
  L.receivers = {{0, 0}, {0, 1}};
  for (int i = 0; i < 8; ++i) {
    uint32_t t = L.add_tensor("t" + std::to_string(i), DType::kBF16, {16});
    ASSERT_TRUE(add_dtensor(L, t, Side::kSource, {{1}, {0}, {P("R")}}, "t" + std::to_string(i)).is_ok());
    ASSERT_TRUE(add_dtensor(L, t, Side::kReceiver, {{2}, {0, 1}, {P("R")}}, "t" + std::to_string(i)).is_ok());
  }
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->receiver_nic_bytes()[0], 4 * 32);
  EXPECT_EQ(plan->receiver_nic_bytes()[1], 4 * 32);
}

// Two holders of the whole tensor: source 0 column-major, source 1
// row-major, like the receiver. From source 0 every element would be its
// own run; the plan takes it from source 1 in one run, even where source 1's
// NIC is the busier (it serves another tensor first), and even though ties
// otherwise go to the lowest rank.
TEST(Plan, NeverChoosesAStridedHolderWhenAContiguousOneExists) {
  Layout L;
  L.sources = {{0}, {0}};
  L.receivers = {{0, 0}};
  const uint32_t w = L.add_tensor("w", DType::kF32, {8, 8});
  const uint32_t busy = L.add_tensor("busy", DType::kF32, {64});
  const RankSetId s0 = L.source_sets.intern({0}), s1 = L.source_sets.intern({1});
  const RankSetId r0 = L.receiver_sets.intern({0});
  const uint32_t b0 = L.add_buffer(Buffer{Side::kSource, "w_cm", DType::kF32, 256, s0});
  const uint32_t b1 = L.add_buffer(Buffer{Side::kSource, "w_rm", DType::kF32, 256, s1});
  const uint32_t bb = L.add_buffer(Buffer{Side::kSource, "busy", DType::kF32, 256, s1});
  const uint32_t rb = L.add_buffer(Buffer{Side::kReceiver, "w", DType::kF32, 256, r0});
  const uint32_t rbb = L.add_buffer(Buffer{Side::kReceiver, "busy", DType::kF32, 256, r0});
  L.tensors[w].sources.push_back(Region{Box::whole({8, 8}), s0, b0, 0, Index{1, 8}});
  L.tensors[w].sources.push_back(Region{Box::whole({8, 8}), s1, b1, 0, row_major_strides({8, 8})});
  L.tensors[w].receivers.push_back(Region{Box::whole({8, 8}), r0, rb, 0, row_major_strides({8, 8})});
  L.tensors[busy].sources.push_back(Region{Box::whole({64}), s1, bb, 0, row_major_strides({64})});
  L.tensors[busy].receivers.push_back(Region{Box::whole({64}), r0, rbb, 0, row_major_strides({64})});
  ASSERT_TRUE(validate(L).is_ok()) << validate(L).message();
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  int w_runs = 0;
  for_each_run(*plan, [&](const refit::Run& r) {
    if (r.local || r.to.buffer != rb) return;
    ++w_runs;
    EXPECT_EQ(r.from.rank, 1);
    EXPECT_EQ(r.bytes, 256);
  });
  EXPECT_EQ(w_runs, 1);
}

TEST(Plan, MissingSourceNamesTensorRankAndBox) {
  Layout L;
  L.sources = {{0}};
  L.receivers = {{0, 0}};
  uint32_t w = L.add_tensor("w", DType::kBF16, {4});
  Region r;
  r.box = Box::whole({2});
  r.box.ndim = 1;
  r.ranks = L.source_sets.intern({0});
  r.buffer = L.add_buffer({Side::kSource, "w", DType::kBF16, 4, r.ranks});
  r.strides[0] = 1;
  L.tensors[w].sources.push_back(r);
  ASSERT_TRUE(add_dtensor(L, w, Side::kReceiver, {{1}, {0}, {P("R")}}, "w").is_ok());
  ASSERT_TRUE(validate(L).is_ok());
  auto plan = make_plan(L);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("\"w\""), std::string::npos) << plan.status().message();
  EXPECT_NE(plan.status().message().find("receiver rank 0"), std::string::npos);
  EXPECT_NE(plan.status().message().find("[2:4]"), std::string::npos);
}

// Planned on threads, each a range of tensors: the error is the one a single
// thread meets first, the lowest tensor's, not that of the range that
// failed first.
TEST(Plan, OnThreadsTheFirstMissingSourceIsReported) {
  Layout L;
  L.sources = {{0}};
  L.receivers = {{0, 0}};
  for (int i = 0; i < 12; ++i) {
    const std::string name = "w" + std::to_string(i);
    const uint32_t w = L.add_tensor(name, DType::kBF16, {4});
    ASSERT_TRUE(add_dtensor(L, w, Side::kReceiver, {{1}, {0}, {P("R")}}, name).is_ok());
    if (i == 5 || i == 10) {  // the source holds half of it
      Region r;
      r.box = Box::whole({2});
      r.box.ndim = 1;
      r.ranks = L.source_sets.intern({0});
      r.buffer = L.add_buffer({Side::kSource, name, DType::kBF16, 4, r.ranks});
      r.strides[0] = 1;
      L.tensors[w].sources.push_back(r);
    } else {
      ASSERT_TRUE(add_dtensor(L, w, Side::kSource, {{1}, {0}, {P("R")}}, name).is_ok());
    }
  }
  ASSERT_TRUE(validate(L).is_ok());
  PlanOptions negative;
  negative.threads = -1;
  auto refused = make_plan(L, negative);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("threads must not be negative"), std::string::npos)
      << refused.status().message();
  for (int threads : {1, 2, 3, 12}) {
    PlanOptions o;
    o.threads = threads;
    auto plan = make_plan(L, o);
    ASSERT_FALSE(plan.is_ok()) << threads << " threads";
    EXPECT_NE(plan.status().message().find("\"w5\""), std::string::npos)
        << threads << " threads: " << plan.status().message();
  }
}

}  // namespace
}  // namespace refit
