// End-to-end refreshes: one process per source and receiver rank, librefit
// through its C ABI only, a coordinator in the test process, UCX tcp on the
// loopback as the network and shared memory as the local fabric. Each layout
// is refreshed to three versions; after each, every receiver byte is checked
// against the pattern (and bytes outside the segments against the guard),
// and the bytes the receivers report pulling over the network must equal the
// plan's minimum: each domain receives each byte it needs exactly once.

#include <unistd.h>

#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "planner/layout.h"
#include "planner/layout_json.h"
#include "planner/manifest.h"
#include "planner/plan.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "tests/e2e/gathers.h"
#include "tools/bench/refresh_run.h"

namespace {

using refit::Layout;
using refit::Strategy;
using refit::bench::RunOptions;
using refit::bench::RunResult;

// A test that runs longer than this is killed by SIGALRM; its rank
// processes die with it (PR_SET_PDEATHSIG).
constexpr unsigned kTestSeconds = 55;

class Refresh : public ::testing::Test {
 protected:
  void SetUp() override { ::alarm(kTestSeconds); }
  void TearDown() override { ::alarm(0); }

  static Layout parse(const std::string& text) {
    auto layout = refit::parse_layout_json(text, "test layout");
    EXPECT_TRUE(layout.is_ok()) << layout.status().message();
    return layout.is_ok() ? std::move(*layout) : Layout();
  }

  static RunOptions options() {
    RunOptions o;
    o.versions = 3;
    o.step_timeout = std::chrono::seconds(20);
    o.refresh_timeout = std::chrono::seconds(15);
    return o;
  }

  // TP2 sources to two TP2 replicas in one domain: every byte is needed twice.
  static Layout two_replicas_in_one_domain() {
    return parse(R"json({"format": "refit-layout/1",
      "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
      "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                    {"rank": 2, "domain": 0, "instance": 1}, {"rank": 3, "domain": 0, "instance": 1}],
      "tensors": [
        {"name": "w", "dtype": "BF16", "shape": [64, 32],
         "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
         "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(1)"]}}]})json");
  }

  // Refreshes `layout` three times and checks every byte and the network
  // bytes; `check_report` (optional) sees each receiver's report;
  // `gathered`: small runs must have travelled in gathers every time.
  static void refresh_and_check(const Layout& layout, const RunOptions& o = options(),
                                const std::function<void(const nlohmann::json&)>& check_report = {},
                                bool gathered = false) {
    ASSERT_FALSE(layout.tensors.empty());
    auto plan = refit::make_plan(layout);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    const int64_t minimum = plan->summary().minimum_network_bytes;
    ASSERT_GT(minimum, 0);

    RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
    ASSERT_TRUE(r.status.is_ok()) << r.status.message();
    ASSERT_EQ(r.versions.size(), static_cast<size_t>(o.versions));
    for (const auto& v : r.versions) {
      EXPECT_TRUE(v.verified) << "version " << v.version;
      EXPECT_EQ(v.network_bytes, minimum) << "version " << v.version << ": the receivers pulled "
                                          << v.network_bytes << " bytes over the network, the minimum is " << minimum;
      for (const auto& report : v.reports) {
        EXPECT_EQ(report.value("version", int64_t{-1}), v.version) << report.dump();
        EXPECT_TRUE(report.value("ok", false)) << report.dump();
        if (check_report) check_report(report);
      }
      if (gathered) {
        EXPECT_GT(refit::e2e::gathered_runs(v), 0) << "version " << v.version << ": no gather";
      }
    }
  }
};

// TP2 column- and row-parallel shards to TP4 in one domain; the norm is
// replicated on both sides, so the domain pulls it once and fans it out.
TEST_F(Refresh, TensorParallel2To4) {
  refresh_and_check(parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                  {"rank": 2, "domain": 0, "instance": 0}, {"rank": 3, "domain": 0, "instance": 0}],
    "tensors": [
      {"name": "w", "dtype": "BF16", "shape": [64, 48],
       "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(0)"]}},
      {"name": "o", "dtype": "F32", "shape": [48, 64],
       "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(1)"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(1)"]}},
      {"name": "norm", "dtype": "F16", "shape": [48],
       "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["R"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["R"]}}]})json"));
}

// Rows on the trainers, columns on the servers (S(0) -> S(1)): every
// receiver needs a strided piece of every source. Two instances of TP2 in
// two domains of two ranks.
TEST_F(Refresh, CrossDimShardsInTwoDomains) {
  refresh_and_check(parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}, {"rank": 2, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                  {"rank": 2, "domain": 1, "instance": 1}, {"rank": 3, "domain": 1, "instance": 1}],
    "tensors": [
      {"name": "w", "dtype": "BF16", "shape": [30, 20],
       "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(0)"]},
       "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(1)"]}},
      {"name": "x", "dtype": "F32", "shape": [6, 9, 4],
       "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(1)"]},
       "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(2)"]}}]})json"),
                    options(), {}, /*gathered=*/true);
}

// Two data-parallel replicas of TP2 on the trainers (every piece has two
// holders) to two instances of TP3 in two domains of three ranks.
TEST_F(Refresh, ReplicatedSourcesToSixReceivers) {
  refresh_and_check(parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}, {"rank": 2, "domain": 1}, {"rank": 3, "domain": 1}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                  {"rank": 2, "domain": 0, "instance": 0}, {"rank": 3, "domain": 1, "instance": 1},
                  {"rank": 4, "domain": 1, "instance": 1}, {"rank": 5, "domain": 1, "instance": 1}],
    "tensors": [
      {"name": "w", "dtype": "F32", "shape": [48, 32],
       "source":   {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(0)"]},
       "receiver": {"mesh": [2, 3], "ranks": [0, 1, 2, 3, 4, 5], "placements": ["R", "S(0)"]}},
      {"name": "bias", "dtype": "BF16", "shape": [10],
       "source":   {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["R"]},
       "receiver": {"mesh": [6], "ranks": [0, 1, 2, 3, 4, 5], "placements": ["R"]}}]})json"));
}

// vLLM's qkv_proj: each TP4 receiver holds cat(q_t, k_(t/2), v_(t/2)) in
// one buffer, the two KV heads replicated over the four ranks, and 64
// trailing bytes that no segment covers. The TP2 trainers hold a fused
// buffer too: cat(q_t, k_t, v_t), one data pointer for three tensors.
// head_dim 4, 8 query heads, 2 KV heads, hidden 16.
TEST_F(Refresh, FusedQkvWithReplicatedKvHeads) {
  std::ostringstream j;
  j << R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                  {"rank": 2, "domain": 0, "instance": 0}, {"rank": 3, "domain": 0, "instance": 0}],
    "tensors": [{"name": "q", "dtype": "BF16", "shape": [32, 16]},
                {"name": "k", "dtype": "BF16", "shape": [8, 16]},
                {"name": "v", "dtype": "BF16", "shape": [8, 16]}],
    "buffers": [)json";
  bool first = true;
  auto seg = [](const char* t, int row0, int rows, int offset_rows) {
    std::ostringstream s;
    s << R"({"tensor": ")" << t << R"(", "start": [)" << row0 << R"(, 0], "size": [)" << rows
      << R"(, 16], "offset": )" << offset_rows * 16 << R"(, "strides": [16, 1]})";
    return s.str();
  };
  for (int t = 0; t < 2; ++t) {  // trainers: q rows 16t.., k rows 4t.., v rows 4t..
    j << (first ? "" : ",") << R"({"side": "source", "rank": )" << t
      << R"(, "name": "qkv", "dtype": "BF16", "bytes": )" << 24 * 16 * 2 << R"(, "segments": [)"
      << seg("q", 16 * t, 16, 0) << "," << seg("k", 4 * t, 4, 16) << "," << seg("v", 4 * t, 4, 20) << "]}";
    first = false;
  }
  for (int t = 0; t < 4; ++t) {  // servers: q rows 8t.., kv head t/2
    j << R"(,{"side": "receiver", "rank": )" << t << R"(, "name": "qkv_proj", "dtype": "BF16", "bytes": )"
      << 16 * 16 * 2 + 64 << R"(, "segments": [)" << seg("q", 8 * t, 8, 0) << "," << seg("k", 4 * (t / 2), 4, 8)
      << "," << seg("v", 4 * (t / 2), 4, 12) << "]}";
  }
  j << "]}";
  refresh_and_check(parse(j.str()));
}

// Column-major receivers (strides [1, rows]) of row-major TP2 trainers:
// two receivers of one domain each hold all of "w" column-major, and "c"
// is split by columns over them, each half column-major. Planned directly
// (a run per element) and with relayouts (docs/refresh.md, "Column-major
// receivers": the puller stages rows, copies them into its columns, the
// other receiver gets the columns over the local fabric); every byte checked
// by the harness and, "verify" on, by the receivers against the sources'
// hashes.
TEST_F(Refresh, ColumnMajorReceiversDirectAndRelayouted) {
  std::ostringstream j;
  j << R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0}],
    "tensors": [
      {"name": "w", "dtype": "BF16", "shape": [48, 40],
       "source": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}},
      {"name": "c", "dtype": "F32", "shape": [33, 14],
       "source": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}}],
    "buffers": [)json";
  for (int r = 0; r < 2; ++r) {
    j << (r ? "," : "") << R"({"side": "receiver", "rank": )" << r << R"(, "name": "w", "dtype": "BF16", "bytes": )"
      << 48 * 40 * 2 + 32
      << R"(, "segments": [{"tensor": "w", "start": [0, 0], "size": [48, 40], "offset": 0, "strides": [1, 48]}]},)"
      << R"({"side": "receiver", "rank": )" << r << R"(, "name": "c", "dtype": "F32", "bytes": )" << 33 * 7 * 4
      << R"(, "segments": [{"tensor": "c", "start": [0, )" << 7 * r
      << R"(], "size": [33, 7], "offset": 0, "strides": [1, 33]}]})";
  }
  j << "]}";
  const Layout layout = parse(j.str());
  for (int64_t below : {int64_t{0}, int64_t{4096}}) {
    SCOPED_TRACE("relayout_below_bytes " + std::to_string(below));
    RunOptions o = options();
    o.relayout_below_bytes = below;
    o.receiver_config = {{"verify", true}};
    o.source_config = {{"verify", true}};
    int64_t relayouts = 0;
    refresh_and_check(layout, o, [&](const nlohmann::json& rep) {
      relayouts += rep["converts"].value("units", int64_t{0});
      EXPECT_GT(rep["verify"].value("bytes", int64_t{0}), 0) << rep.dump();
      EXPECT_EQ(rep["verify"].value("unverified_bytes", int64_t{-1}), 0) << rep.dump();
    });
    // Each version relayouts "w" once and each half of "c" once.
    EXPECT_EQ(relayouts, below > 0 ? 3 * o.versions : 0);
  }
}

// torch.chunk sizes: 10 rows over 3 trainers (4, 4, 2) to 4 servers
// (3, 3, 3, 1); 7 columns over 3 (3, 3, 1) to 4 (2, 2, 2, 1); and 2 rows over
// 4 servers, where two servers get nothing and so have no buffer.
TEST_F(Refresh, UnevenTorchChunkShards) {
  refresh_and_check(parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}, {"rank": 2, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                  {"rank": 2, "domain": 1, "instance": 0}, {"rank": 3, "domain": 1, "instance": 0}],
    "tensors": [
      {"name": "w", "dtype": "F32", "shape": [10, 6],
       "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(0)"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(0)"]}},
      {"name": "u", "dtype": "BF16", "shape": [5, 7],
       "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(1)"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(1)"]}},
      {"name": "e", "dtype": "I64", "shape": [2, 5],
       "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["R"]},
       "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(0)"]}}]})json"));
}

// A layout made by the recipes from the project's own scenario: Megatron TP2
// trainers to two vLLM TP2 replicas in one 4-GPU domain (small-dense: fused
// qkv_proj and gate_up_proj, vocab-parallel embedding with padding rows).
TEST_F(Refresh, RecipeScenarioTp2ToTwoTp2Replicas) {
  const std::string root = REFIT_SOURCE_ROOT;
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  auto scenario = refit::parse_scenario(read(root + "/examples/scenarios/tp2-to-tp2x2.json"), "tp2-to-tp2x2.json");
  ASSERT_TRUE(scenario.is_ok()) << scenario.status().message();
  auto model = refit::parse_manifest_json(read(root + "/examples/models/small-dense.json"), "small-dense.json");
  ASSERT_TRUE(model.is_ok()) << model.status().message();
  auto config = refit::parse_model_config(read(root + "/examples/models/small-dense.config.json"),
                                          "small-dense.config.json");
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  model->config = *config;
  auto layout = refit::layout_from_scenario(*scenario, *model);
  ASSERT_TRUE(layout.is_ok()) << layout.status().message();
  ASSERT_EQ(layout->sources.size(), 2u);
  ASSERT_EQ(layout->receivers.size(), 4u);
  refresh_and_check(*layout);
}

// The same fan-out through the UCX fabric (UCX shared memory), the one for
// hosts whose kernel forbids cross-memory attach: two replicas in one
// domain, so every byte is passed on once.
TEST_F(Refresh, TheUcxFabricCarriesTheFanOut) {
  RunOptions o = options();
  o.local_fabric = "ucx";
  refresh_and_check(two_replicas_in_one_domain(), o);
}

// The baselines run and verify too, and move what their names say: no-dedup
// pulls every rank's bytes itself, broadcast moves whole tensors.
TEST_F(Refresh, BaselinesVerifyAndMoveMoreBytes) {
  Layout layout = two_replicas_in_one_domain();
  auto plan = refit::make_plan(layout);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const int64_t minimum = plan->summary().minimum_network_bytes;
  RunOptions o = options();
  o.versions = 2;

  RunResult no_dedup = refit::bench::run_refreshes(layout, Strategy::kNoDedup, o);
  ASSERT_TRUE(no_dedup.status.is_ok()) << no_dedup.status.message();
  EXPECT_TRUE(no_dedup.verified());
  EXPECT_EQ(no_dedup.versions.back().network_bytes, 2 * minimum);  // two replicas, nothing shared
  EXPECT_EQ(no_dedup.versions.back().local_bytes, 0);

  RunResult broadcast = refit::bench::run_refreshes(layout, Strategy::kBroadcast, o);
  ASSERT_TRUE(broadcast.status.is_ok()) << broadcast.status.message();
  EXPECT_TRUE(broadcast.verified());
  // The gatherer pulls the tensor once, then each of 4 ranks pulls it whole.
  EXPECT_EQ(broadcast.versions.back().network_bytes, 5 * 64 * 32 * 2);
}

// Interleaved runs (refit-bench's default for refit and no-dedup): both
// strategies verify and move what they should, and they take turns, one
// whole version each, never overlapping.
TEST_F(Refresh, InterleavedRunsTakeTurnsVersionByVersion) {
  Layout layout = two_replicas_in_one_domain();
  auto plan = refit::make_plan(layout);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const int64_t minimum = plan->summary().minimum_network_bytes;
  std::vector<RunResult> r =
      refit::bench::run_interleaved(layout, {Strategy::kRefit, Strategy::kNoDedup}, {options(), options()});
  ASSERT_EQ(r.size(), 2u);
  for (const RunResult& x : r) {
    ASSERT_TRUE(x.status.is_ok()) << x.status.message();
    ASSERT_EQ(x.versions.size(), 3u);
    EXPECT_TRUE(x.verified());
  }
  EXPECT_EQ(r[0].versions.back().network_bytes, minimum);
  EXPECT_EQ(r[1].versions.back().network_bytes, 2 * minimum);
  // refit v1, no-dedup v1, refit v2, ...: each version's work (fill to
  // verification) ends before the next one's begins.
  for (size_t v = 0; v < 3; ++v) {
    const auto& a = r[0].versions[v];
    const auto& b = r[1].versions[v];
    EXPECT_LT(a.begin_ns, a.end_ns);
    EXPECT_LE(a.end_ns, b.begin_ns) << "version " << v + 1;
    if (v + 1 < 3) {
      EXPECT_LE(b.end_ns, r[0].versions[v + 1].begin_ns) << "version " << v + 1;
    }
  }
}

// A run that cannot be interleaved fails with a message that says why, and
// leaves the turns: the other run still completes.
TEST_F(Refresh, InterleavingRefusesBroadcastAndTheOtherRunGoesOn) {
  Layout layout = parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 1}],
    "tensors": [
      {"name": "w", "dtype": "F32", "shape": [16, 8],
       "source":   {"mesh": [1], "ranks": [0], "placements": ["R"]},
       "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}]})json");
  RunOptions o = options();
  o.versions = 2;
  std::vector<RunResult> r = refit::bench::run_interleaved(layout, {Strategy::kBroadcast, Strategy::kRefit}, {o, o});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_FALSE(r[0].status.is_ok());
  EXPECT_NE(r[0].status.message().find("broadcast"), std::string::npos) << r[0].status.message();
  ASSERT_TRUE(r[1].status.is_ok()) << r[1].status.message();
  EXPECT_EQ(r[1].versions.size(), 2u);
  EXPECT_TRUE(r[1].verified());
}

}  // namespace
