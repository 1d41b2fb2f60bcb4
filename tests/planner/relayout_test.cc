// Relayout (docs/refresh.md, "Column-major receivers"): a receiver that
// holds a tensor in another memory order than its sources. The walk with
// conversion steps is executed on real buffers (the network runs into
// the buffers or the puller's staging area, each step a strided copy of
// its staged box, the local runs after it) and every receiver byte is
// compared with the layout; the network runs are counted with relayouts
// off and on.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "planner/dtype.h"
#include "planner/layout.h"
#include "planner/layout_json.h"
#include "planner/plan.h"
#include "tests/planner/element_walk.h"

namespace refit {
namespace {

using reference::element_offset;
using reference::for_each_element;
using reference::linear_index;

constexpr uint8_t kUnwritten = 0xee;

// A byte of element `e` (row-major index in the tensor) of tensor `t`.
uint8_t tag(uint32_t t, int64_t e, int k) { return static_cast<uint8_t>((t * 131 + e * 7 + k * 3 + 1) % 251); }


struct Result {
  std::string mismatch;  // empty: every receiver byte as the layout says
  int64_t net_runs = 0;
  int64_t steps = 0;
};

// Executes the plan's runs and steps in order on buffers filled as the
// layout says, and compares every receiver byte.
Result execute(const Layout& L, const PlanOptions& o) {
  Result out;
  auto plan = make_plan(L, o);
  if (!plan.is_ok()) {
    out.mismatch = plan.status().message();
    return out;
  }
  std::map<std::tuple<Side, int32_t, uint32_t>, std::vector<uint8_t>> mem;
  for (uint32_t b = 0; b < L.buffers.size(); ++b)
    for (int32_t r : L.sets(L.buffers[b].side).get(L.buffers[b].ranks))
      mem[{L.buffers[b].side, r, b}].assign(static_cast<size_t>(L.buffers[b].bytes), kUnwritten);
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    const int eb = dtype_bytes(t.dtype);
    for (const Region& sr : t.sources)
      for (int32_t r : L.source_sets.get(sr.ranks))
        for_each_element(sr.box, [&](const Index& idx) {
          std::vector<uint8_t>& m = mem[{Side::kSource, r, t.buffer_of(Side::kSource, sr)}];
          for (int k = 0; k < eb; ++k) m[element_offset(sr, idx) * eb + k] = tag(ti, linear_index(t.shape, idx), k);
        });
  }
  std::map<int32_t, std::vector<uint8_t>> staging;
  // Per puller, the staged boxes of its steps: the receiver runs every GET
  // of a part at once and each step when its own GETs are in, so two boxes
  // that share a staging byte would overwrite each other there; executed in
  // order, as here, they would not show it.
  std::map<int32_t, std::vector<std::pair<int64_t, int64_t>>> staged_boxes;
  auto bytes_of = [&](Side side, int32_t rank, uint32_t buffer) -> std::vector<uint8_t>& {
    if (buffer == kStagingBuffer) return staging[rank];
    return mem[{side, rank, buffer}];
  };
  bool bounds = true;
  Status st = for_each_run(
      *plan,
      [&](const Run& run) {
        out.net_runs += run.local ? 0 : 1;
        std::vector<uint8_t>& from = bytes_of(run.from.side, run.from.rank, run.from.buffer);
        std::vector<uint8_t>& to = bytes_of(Side::kReceiver, run.to.rank, run.to.buffer);
        if (run.to.buffer == kStagingBuffer && to.size() < static_cast<size_t>(run.to.offset + run.bytes))
          to.resize(static_cast<size_t>(run.to.offset + run.bytes), kUnwritten);
        if (run.from.offset < 0 || run.to.offset < 0 || run.from.offset + run.bytes > static_cast<int64_t>(from.size()) ||
            run.to.offset + run.bytes > static_cast<int64_t>(to.size())) {
          bounds = false;
          return;
        }
        std::memcpy(to.data() + run.to.offset, from.data() + run.from.offset, static_cast<size_t>(run.bytes));
      },
      [&](const ConvertStep& c) {
        ++out.steps;
        const Tensor& t = L.tensors[c.tensor];
        const int eb = dtype_bytes(t.dtype);
        staged_boxes[c.rank].emplace_back(c.stage_offset, c.stage_offset + c.box.numel() * eb);
        std::vector<uint8_t>& from = staging[c.rank];
        std::vector<uint8_t>& to = mem[{Side::kReceiver, c.rank, c.buffer}];
        int64_t k = 0;
        for_each_element(c.box, [&](const Index& idx) {
          int64_t e = c.offset;
          for (int d = 0; d < c.box.ndim; ++d) e += (idx[d] - c.box.start[d]) * c.strides[d];
          const int64_t src = c.stage_offset + k++ * eb;
          if (src + eb > static_cast<int64_t>(from.size()) || (e + 1) * eb > static_cast<int64_t>(to.size())) {
            bounds = false;
            return;
          }
          std::memcpy(to.data() + e * eb, from.data() + src, static_cast<size_t>(eb));
        });
      });
  if (!st.is_ok()) {
    out.mismatch = st.message();
    return out;
  }
  if (!bounds) {
    out.mismatch = "a run or a step out of bounds";
    return out;
  }
  for (auto& [rank, boxes] : staged_boxes) {
    std::sort(boxes.begin(), boxes.end());
    for (size_t k = 1; k < boxes.size(); ++k)
      if (boxes[k].first < boxes[k - 1].second) {
        out.mismatch = "receiver rank " + std::to_string(rank) + ": two steps share staging byte " +
                       std::to_string(boxes[k].first);
        return out;
      }
  }
  std::map<std::tuple<Side, int32_t, uint32_t>, std::vector<uint8_t>> want;
  for (auto& [key, m] : mem)
    if (std::get<0>(key) == Side::kReceiver) want[key].assign(m.size(), kUnwritten);
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    const int eb = dtype_bytes(t.dtype);
    for (const Region& rr : t.receivers)
      for (int32_t r : L.receiver_sets.get(rr.ranks))
        for_each_element(rr.box, [&](const Index& idx) {
          std::vector<uint8_t>& m = want[{Side::kReceiver, r, t.buffer_of(Side::kReceiver, rr)}];
          for (int k = 0; k < eb; ++k) m[element_offset(rr, idx) * eb + k] = tag(ti, linear_index(t.shape, idx), k);
        });
  }
  for (auto& [key, m] : want) {
    const std::vector<uint8_t>& got = mem[key];
    for (size_t k = 0; k < m.size(); ++k)
      if (got[k] != m[k]) {
        out.mismatch = "receiver rank " + std::to_string(std::get<1>(key)) + " buffer \"" +
                       L.buffers[std::get<2>(key)].name + "\" byte " + std::to_string(k);
        return out;
      }
  }
  return out;
}

// Row-major TP2 sources; two receivers of one domain each hold "w"
// [rows, cols] whole and column-major, and half of "c" by columns,
// column-major.
Layout column_major_receivers(int64_t rows, int64_t cols) {
  std::string j = R"j({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0}],
    "tensors": [
      {"name": "w", "dtype": "BF16", "shape": [)j" + std::to_string(rows) + ", " + std::to_string(cols) + R"j(],
       "source": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}},
      {"name": "c", "dtype": "F32", "shape": [33, 14],
       "source": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}}],
    "buffers": [)j";
  for (int r = 0; r < 2; ++r) {
    j += std::string(r ? "," : "") + R"j({"side": "receiver", "rank": )j" + std::to_string(r) +
         R"j(, "name": "w", "dtype": "BF16", "bytes": )j" + std::to_string(rows * cols * 2) +
         R"j(, "segments": [{"tensor": "w", "start": [0, 0], "size": [)j" + std::to_string(rows) + ", " +
         std::to_string(cols) + R"j(], "offset": 0, "strides": [1, )j" + std::to_string(rows) + R"j(]}]},)j" +
         R"j({"side": "receiver", "rank": )j" + std::to_string(r) +
         R"j(, "name": "c", "dtype": "F32", "bytes": 1000, "segments": [{"tensor": "c", "start": [0, )j" +
         std::to_string(7 * r) + R"j(], "size": [33, 7], "offset": 3, "strides": [1, 33]}]})j";
  }
  j += "]}";
  auto L = parse_layout_json(j, "test layout");
  EXPECT_TRUE(L.is_ok()) << L.status().message();
  return L.is_ok() ? std::move(*L) : Layout();
}

TEST(Relayout, ColumnMajorReceiversGetEveryByteWithFewNetworkRuns) {
  const Layout L = column_major_receivers(64, 48);
  PlanOptions o;
  o.chunk_bytes = 1024;
  const Result direct = execute(L, o);
  ASSERT_EQ(direct.mismatch, "");
  EXPECT_EQ(direct.steps, 0);
  // One network run per element: 64 x 48 of "w", 33 x 14 of "c".
  EXPECT_EQ(direct.net_runs, 64 * 48 + 33 * 14);
  o.relayout_below_bytes = 64;
  const Result relayouted = execute(L, o);
  ASSERT_EQ(relayouted.mismatch, "");
  EXPECT_EQ(relayouted.steps, 3);  // "w" once, each half of "c" once
  // "w": one run per source shard (its chunks continue each other in both
  // buffers and merge); "c": a run of 7 elements per row of each half.
  EXPECT_EQ(relayouted.net_runs, 2 + 33 * 2);
}

TEST(Relayout, TheNetworkRunsCountTheStagedPull) {
  const Layout L = column_major_receivers(64, 48);
  PlanOptions o;
  o.chunk_bytes = 1024;
  o.relayout_below_bytes = 64;
  auto plan = make_plan(L, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  int64_t walk = 0, net = 0;
  ASSERT_TRUE(for_each_run(
                  *plan, [&](const refit::Run& r) { walk += r.local ? 0 : 1; }, [](const ConvertStep&) {})
                  .is_ok());
  for_each_network_run(*plan, [&](const refit::Run&) { ++net; });
  EXPECT_EQ(net, walk);
  // Without conversion steps (refit-runs/1, executable as it is) the walk
  // pulls straight into the layout.
  int64_t plain = 0;
  for_each_run(*plan, [&](const refit::Run& r) { plain += r.local ? 0 : 1; });
  EXPECT_EQ(plain, 64 * 48 + 33 * 14);
}

TEST(Relayout, AboveTheThresholdOrBeyondTheStagingCapUnitsArePulledDirectly) {
  const Layout L = column_major_receivers(64, 48);
  PlanOptions o;
  o.relayout_below_bytes = 2;  // the direct runs are 2 and 4 bytes: none below 2
  Result r = execute(L, o);
  ASSERT_EQ(r.mismatch, "");
  EXPECT_EQ(r.steps, 0);
  o.relayout_below_bytes = 64;
  // Per puller: "w" fills its puller's share, the other receiver's half of
  // "c" fits in its own.
  o.relayout_staging_bytes = 64 * 48 * 2;
  r = execute(L, o);
  ASSERT_EQ(r.mismatch, "");
  EXPECT_EQ(r.steps, 2);
}

// Random layouts: a 2- or 3-dim tensor split over 1 to 3 row-major sources
// (by rows, by columns, or replicated); 1 to 4 receivers in 1 or 2 domains,
// each holding a random box in a random memory order (packed or padded,
// at a random offset). Every plan is executed with relayouts off and on, at
// random thresholds, and every receiver byte compared with the layout.
TEST(Relayout, RandomLayoutsLandEveryByteWithOrWithoutRelayouts) {
  std::mt19937_64 g(0x7e1a'0002);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  int planned = 0, with_steps = 0;
  for (int i = 0; i < 2000; ++i) {
    const int nd = static_cast<int>(uni(2, 3));
    std::vector<int64_t> shape(nd);
    for (int64_t& x : shape) x = uni(nd == 2 ? 2 : 1, nd == 2 ? 24 : 8);
    const int sources = static_cast<int>(uni(1, 3)), receivers = static_cast<int>(uni(1, 4));
    const char* dt = uni(0, 1) ? "BF16" : "F32";
    const int eb = dt[0] == 'B' ? 2 : 4;
    std::string placement = std::array<const char*, 3>{"S(0)", "S(1)", "R"}[uni(0, 2)];
    std::string j = R"j({"format": "refit-layout/1", "sources": [)j";
    for (int s = 0; s < sources; ++s) j += (s ? "," : "") + std::string(R"j({"rank": )j") + std::to_string(s) + R"j(, "domain": 0})j";
    j += R"j(], "receivers": [)j";
    for (int r = 0; r < receivers; ++r)
      j += (r ? "," : "") + std::string(R"j({"rank": )j") + std::to_string(r) + R"j(, "domain": )j" +
           std::to_string(uni(0, 1)) + R"j(, "instance": )j" + std::to_string(r) + "}";
    j += R"j(], "tensors": [{"name": "w", "dtype": ")j" + std::string(dt) + R"j(", "shape": [)j";
    for (int d = 0; d < nd; ++d) j += (d ? ", " : "") + std::to_string(shape[d]);
    j += R"j(], "source": {"mesh": [)j" + std::to_string(sources) + R"j(], "ranks": [)j";
    for (int s = 0; s < sources; ++s) j += (s ? ", " : "") + std::to_string(s);
    j += R"j(], "placements": [")j" + placement + R"j("]}}], "buffers": [)j";
    for (int r = 0; r < receivers; ++r) {
      std::vector<int64_t> start(nd), size(nd);
      for (int d = 0; d < nd; ++d) {
        start[d] = uni(0, shape[d] - 1);
        size[d] = uni(1, shape[d] - start[d]);
      }
      std::vector<int> order(nd);  // outermost first
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), g);
      std::vector<int64_t> strides(nd);
      int64_t acc = 1;
      for (int k = nd - 1; k >= 0; --k) {
        strides[order[k]] = acc;
        acc = acc * size[order[k]] + (uni(0, 3) == 0 ? uni(1, 2) : 0);
      }
      const int64_t offset = uni(0, 5);
      int64_t extent = offset + 1;
      for (int d = 0; d < nd; ++d) extent += (size[d] - 1) * strides[d];
      auto list = [](const std::vector<int64_t>& v) {
        std::string out = "[";
        for (size_t k = 0; k < v.size(); ++k) out += (k ? ", " : "") + std::to_string(v[k]);
        return out + "]";
      };
      j += (r ? "," : "") + std::string(R"j({"side": "receiver", "rank": )j") + std::to_string(r) +
           R"j(, "name": "w", "dtype": ")j" + dt + R"j(", "bytes": )j" + std::to_string((extent + uni(0, 3)) * eb) +
           R"j(, "segments": [{"tensor": "w", "start": )j" + list(start) + R"j(, "size": )j" + list(size) +
           R"j(, "offset": )j" + std::to_string(offset) + R"j(, "strides": )j" + list(strides) + "}]}";
    }
    j += "]}";
    auto L = parse_layout_json(j, "random layout");
    ASSERT_TRUE(L.is_ok()) << "case " << i << ": " << L.status().message() << "\n" << j;
    PlanOptions o;
    o.chunk_bytes = std::array<int64_t, 3>{16, 64, 4096}[uni(0, 2)];
    const Result direct = execute(*L, o);
    ASSERT_EQ(direct.mismatch, "") << "case " << i << " (direct)\n" << j;
    EXPECT_EQ(direct.steps, 0);
    o.relayout_below_bytes = std::array<int64_t, 3>{4, 16, 1 << 20}[uni(0, 2)];
    o.relayout_staging_bytes = uni(0, 1) ? (int64_t{1} << 30) : uni(64, 2048);
    const Result relayouted = execute(*L, o);
    ASSERT_EQ(relayouted.mismatch, "") << "case " << i << " (relayout below " << o.relayout_below_bytes << ")\n" << j;
    EXPECT_LE(relayouted.net_runs, direct.net_runs) << "case " << i << "\n" << j;
    with_steps += relayouted.steps > 0;
    ++planned;
  }
  EXPECT_EQ(planned, 2000);
  EXPECT_GT(with_steps, 400);  // not vacuous: about a third of the layouts relayout something
  std::cout << "[ relayout ] " << planned << " random layouts executed, " << with_steps << " with relayouts\n";
}

TEST(Relayout, ABadKnobIsRefused) {
  const Layout L = column_major_receivers(8, 8);
  PlanOptions o;
  o.relayout_below_bytes = -1;
  auto plan = make_plan(L, o);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("relayout_below_bytes"), std::string::npos);
}

// A receiver layout whose strides map two elements to one place is refused
// by the layout check, naming the tensor, before any plan.
TEST(Relayout, OverlappingReceiverStridesAreRefusedNamingTheTensor) {
  auto L = parse_layout_json(R"j({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}],
    "tensors": [{"name": "w", "dtype": "BF16", "shape": [4, 4],
                 "source": {"mesh": [1], "ranks": [0], "placements": ["R"]}}],
    "buffers": [{"side": "receiver", "rank": 0, "name": "w", "dtype": "BF16", "bytes": 64,
                 "segments": [{"tensor": "w", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [1, 3]}]}]})j",
                             "test layout");
  ASSERT_FALSE(L.is_ok());
  EXPECT_NE(L.status().message().find("tensor \"w\""), std::string::npos) << L.status().message();
  EXPECT_NE(L.status().message().find("same place"), std::string::npos) << L.status().message();
}

}  // namespace
}  // namespace refit
