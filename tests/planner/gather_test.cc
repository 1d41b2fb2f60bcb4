// The grouping of small network runs into gathers (planner/gather.h),
// checked against a brute-force reference on random inputs, and for the
// knobs' edge cases.
#include "planner/gather.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

namespace refit {
namespace {

// The rules of gather.h written out plainly: per (receiver, source) in input
// order, small runs fill a group until the next would break a bound.
Grouping reference(const std::vector<GatherInput>& runs, const GatherOptions& o) {
  Grouping out;
  std::map<std::pair<int32_t, int32_t>, std::pair<std::vector<uint64_t>, int64_t>> open;
  auto close = [&](std::vector<uint64_t>& g) {
    if (g.size() == 1) out.singles.push_back(g[0]);
    if (g.size() > 1) out.gathers.push_back(g);
    g.clear();
  };
  for (uint64_t i = 0; i < runs.size(); ++i) {
    const GatherInput& r = runs[i];
    if (!o.enabled || r.bytes >= o.below_bytes) {
      out.singles.push_back(i);
      continue;
    }
    if (r.bytes > o.max_bytes) {
      ++out.unpacked;
      out.singles.push_back(i);
      continue;
    }
    auto& [g, bytes] = open[{r.receiver, r.source}];
    if (!g.empty() && (bytes + r.bytes > o.max_bytes || static_cast<int64_t>(g.size()) >= o.max_entries)) {
      close(g);
      bytes = 0;
    }
    g.push_back(i);
    bytes += r.bytes;
  }
  for (auto& [key, g] : open) close(g.first);
  return out;
}

std::vector<GatherInput> random_runs(std::mt19937_64& rng, size_t n) {
  std::vector<GatherInput> runs(n);
  for (GatherInput& r : runs) {
    r.receiver = static_cast<int32_t>(rng() % 3);
    r.source = static_cast<int32_t>(rng() % 4);
    r.bytes = rng() % 4 == 0 ? int64_t(1 + rng() % (1 << 20)) : int64_t(1 + rng() % 2048);
  }
  return runs;
}

TEST(Gather, MatchesTheReferenceOnRandomRuns) {
  std::mt19937_64 rng(18);
  for (int trial = 0; trial < 200; ++trial) {
    GatherOptions o;
    o.below_bytes = int64_t(1) << (8 + rng() % 14);
    o.max_bytes = int64_t(1) << (6 + rng() % 16);
    o.max_entries = 2 + static_cast<int64_t>(rng() % 40);
    const auto runs = random_runs(rng, 1 + rng() % 400);
    const Grouping got = group_runs(runs, o);
    const Grouping want = reference(runs, o);
    ASSERT_EQ(got.gathers, want.gathers) << "trial " << trial;
    ASSERT_EQ(got.singles, want.singles) << "trial " << trial;
    ASSERT_EQ(got.unpacked, want.unpacked) << "trial " << trial;
  }
}

// Closings one by one, `times` spelled out: (receiver, source, bytes, runs,
// tag, passed).
using Closings = std::vector<std::tuple<int32_t, int32_t, int64_t, int64_t, uint64_t, bool>>;

TEST(Gather, CounterGivesTheSameForGroupsOfEqualRunsAsOneByOne) {
  // The counter run by run is the grouper above, checked against the
  // reference; groups must give what their runs give one by one.
  std::mt19937_64 rng(21);
  for (int trial = 0; trial < 300; ++trial) {
    GatherOptions o;
    o.enabled = trial % 10 != 0;
    o.below_bytes = int64_t(1) << (8 + rng() % 14);
    o.max_bytes = int64_t(1) << (6 + rng() % 16);
    o.max_entries = 2 + static_cast<int64_t>(rng() % 40);
    const auto runs = random_runs(rng, 1 + rng() % 60);
    std::vector<int64_t> counts(runs.size());
    for (int64_t& c : counts) c = rng() % 3 == 0 ? 1 : 1 + static_cast<int64_t>(rng() % 300);
    auto record = [](Closings& out) {
      return [&out](const GatherClose& c) {
        for (int64_t k = 0; k < c.times; ++k) out.emplace_back(c.receiver, c.source, c.bytes, c.runs, c.tag, c.passed);
      };
    };
    Closings grouped, single;
    GatherCounter a(o, record(grouped)), b(o, record(single));
    for (size_t i = 0; i < runs.size(); ++i) {
      a.add(runs[i], counts[i], i);
      for (int64_t k = 0; k < counts[i]; ++k) b.add(runs[i], 1, i);
    }
    a.finish();
    b.finish();
    ASSERT_EQ(grouped, single) << "trial " << trial;
    ASSERT_EQ(a.gathers(), b.gathers()) << "trial " << trial;
    ASSERT_EQ(a.gathered_runs(), b.gathered_runs()) << "trial " << trial;
    ASSERT_EQ(a.unpacked(), b.unpacked()) << "trial " << trial;
  }
}

TEST(Gather, EveryRunTravelsExactlyOnceWithinTheBounds) {
  std::mt19937_64 rng(7);
  GatherOptions o;
  o.below_bytes = 4096;
  o.max_bytes = 16384;
  o.max_entries = 8;
  const auto runs = random_runs(rng, 5000);
  const Grouping g = group_runs(runs, o);
  std::vector<int> seen(runs.size(), 0);
  for (uint64_t i : g.singles) ++seen[i];
  for (const auto& gather : g.gathers) {
    ASSERT_GE(gather.size(), 2u);
    ASSERT_LE(static_cast<int64_t>(gather.size()), o.max_entries);
    int64_t bytes = 0;
    for (uint64_t i : gather) {
      ++seen[i];
      bytes += runs[i].bytes;
      EXPECT_LT(runs[i].bytes, o.below_bytes);
      EXPECT_EQ(runs[i].source, runs[gather[0]].source);
      EXPECT_EQ(runs[i].receiver, runs[gather[0]].receiver);
    }
    EXPECT_LE(bytes, o.max_bytes);
    EXPECT_TRUE(std::is_sorted(gather.begin(), gather.end()));
  }
  for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(seen[i], 1) << "run " << i;
}

TEST(Gather, ColumnSliceRowsBecomeFewGathers) {
  // 40,000 rows of 576 bytes from one source: a column slice, its rows the
  // size of dsv3-bf16-512-h100's average gathered run. The agents' defaults
  // (docs/refresh.md, "Gathers") close a gather at 8192 runs (4.5 MiB
  // here), so five gathers; at 4096 runs a gather it took ten, and that
  // scenario's busiest receiver posted 27,101 GETs.
  std::vector<GatherInput> runs(40000, GatherInput{0, 1, 576});
  GatherOptions o;  // defaults
  const Grouping g = group_runs(runs, o);
  EXPECT_TRUE(g.singles.empty());
  ASSERT_EQ(g.gathers.size(), 5u);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(g.gathers[k].size(), 8192u) << k;
  EXPECT_EQ(g.gathers[4].size(), 40000u - 4 * 8192u);
}

TEST(Gather, RunsBelowAMebibyteFillGathersOf16MiB) {
  // The agents' defaults (docs/refresh.md, "Gathers"): 200 rows of 112 KiB
  // (an FSDP shard's rows of one expert matrix) from one source are two
  // gathers, the first as large as 16 MiB allows; a run of 1 MiB is a
  // plain GET.
  std::vector<GatherInput> runs(200, GatherInput{0, 1, 112 << 10});
  runs.push_back(GatherInput{0, 1, 1 << 20});
  const Grouping g = group_runs(runs, GatherOptions{});
  ASSERT_EQ(g.gathers.size(), 2u);
  EXPECT_EQ(g.gathers[0].size(), 146u);  // 146 x 112 KiB <= 16 MiB < 147 x 112 KiB
  EXPECT_EQ(g.gathers[1].size(), 54u);
  EXPECT_EQ(g.singles, std::vector<uint64_t>{200});
}

TEST(Gather, DisabledOrLargeRunsStaySingle) {
  std::vector<GatherInput> runs = {{0, 0, 100}, {0, 0, 100}, {0, 0, int64_t{1} << 20}};
  GatherOptions off;
  off.enabled = false;
  EXPECT_TRUE(group_runs(runs, off).gathers.empty());
  const Grouping on = group_runs(runs, GatherOptions{});
  ASSERT_EQ(on.gathers.size(), 1u);
  EXPECT_EQ(on.singles, std::vector<uint64_t>{2});
}

TEST(Gather, PieceTooLargeForTheBoundTravelsUnpackedAndIsCounted) {
  GatherOptions o;
  o.below_bytes = 1 << 20;
  o.max_bytes = 1000;
  std::vector<GatherInput> runs = {{0, 0, 600}, {0, 0, 5000}, {0, 0, 300}};
  const Grouping g = group_runs(runs, o);
  EXPECT_EQ(g.unpacked, 1u);
  ASSERT_EQ(g.gathers.size(), 1u);
  EXPECT_EQ(g.gathers[0], (std::vector<uint64_t>{0, 2}));
  EXPECT_EQ(g.singles, std::vector<uint64_t>{1});
}

TEST(Gather, ValidateNamesTheKey) {
  GatherOptions o;
  o.max_bytes = 0;
  EXPECT_NE(validate(o).message().find("gather_bytes"), std::string::npos);
  o = GatherOptions{};
  o.max_entries = 1;
  EXPECT_NE(validate(o).message().find("gather_entries"), std::string::npos);
  EXPECT_TRUE(validate(GatherOptions{}).is_ok());
}

}  // namespace
}  // namespace refit
