// Serving while refreshing: a reader thread in every receiver process reads
// the served buffers the whole time, as a server would (agent.h,
// serve_check), and no read may see two versions at once. Staged refreshes
// pause the server only for the commit; direct ones for the whole refresh.
// Also the reader's check itself: a buffer half of one version and half of
// the next is seen as mixed.

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "planner/layout.h"
#include "planner/layout_json.h"
#include "planner/manifest.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "tests/e2e/gathers.h"
#include "tools/bench/pattern.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/refresh_run.h"

namespace {

using refit::Layout;
using refit::Strategy;
using refit::bench::RunOptions;
using refit::bench::RunResult;

// A test that runs longer than this is killed by SIGALRM; its rank
// processes die with it (PR_SET_PDEATHSIG).
constexpr unsigned kTestSeconds = 55;

class ServeCheck : public ::testing::Test {
 protected:
  void SetUp() override { ::alarm(kTestSeconds); }
  void TearDown() override { ::alarm(0); }

  // Megatron TP2 trainers to two vLLM TP2 replicas in one 4-rank domain.
  static Layout tp2_to_tp2x2() {
    const std::string root = REFIT_SOURCE_ROOT;
    auto read = [](const std::string& path) {
      std::ifstream in(path);
      std::stringstream s;
      s << in.rdbuf();
      return s.str();
    };
    auto scenario = refit::parse_scenario(read(root + "/examples/scenarios/tp2-to-tp2x2.json"), "tp2-to-tp2x2.json");
    EXPECT_TRUE(scenario.is_ok()) << scenario.status().message();
    if (!scenario.is_ok()) return Layout();
    auto model = refit::parse_manifest_json(read(root + "/examples/models/small-dense.json"), "small-dense.json");
    EXPECT_TRUE(model.is_ok()) << model.status().message();
    if (!model.is_ok()) return Layout();
    auto config = refit::parse_model_config(read(root + "/examples/models/small-dense.config.json"),
                                            "small-dense.config.json");
    EXPECT_TRUE(config.is_ok()) << config.status().message();
    if (!config.is_ok()) return Layout();
    model->config = *config;
    auto layout = refit::layout_from_scenario(*scenario, *model);
    EXPECT_TRUE(layout.is_ok()) << layout.status().message();
    return layout.is_ok() ? std::move(*layout) : Layout();
  }

  static RunOptions options(int versions, bool staged) {
    RunOptions o;
    o.versions = versions;
    o.staged = staged;
    o.serve_check = true;
    o.step_timeout = std::chrono::seconds(20);
    o.refresh_timeout = std::chrono::seconds(15);
    return o;
  }

  static void expect_served_every_version(const RunResult& r, int versions, bool staged) {
    ASSERT_TRUE(r.status.is_ok()) << r.status.message();
    EXPECT_EQ(r.staged, staged);
    ASSERT_EQ(r.versions.size(), static_cast<size_t>(versions));
    EXPECT_TRUE(r.verified());
    for (const auto& v : r.versions) {
      EXPECT_TRUE(v.verified) << "version " << v.version;
      EXPECT_GT(v.refresh_seconds, 0) << "version " << v.version;
      EXPECT_GT(v.pause_seconds, 0) << "version " << v.version;
      for (const auto& report : v.reports) {
        EXPECT_EQ(report.value("version", int64_t{-1}), v.version) << report.dump();
        EXPECT_TRUE(report.value("ok", false)) << report.dump();
        EXPECT_EQ(report.value("mode", std::string()), staged ? "staged" : "direct") << report.dump();
        if (staged) {
          EXPECT_TRUE(report.value("committed", false)) << report.dump();
        }
      }
      // The model's norms and biases are runs below "gather_below_bytes":
      // they travel in gathers on this path too.
      EXPECT_GT(refit::e2e::gathered_runs(v), 0) << "version " << v.version << ": no run travelled in a gather";
    }
    EXPECT_GT(r.serve_reads, 0) << "the serving readers never read";
    EXPECT_EQ(r.mixed_version_reads, 0) << "of " << r.serve_reads << " reads";
  }
};

TEST_F(ServeCheck, StagedRefreshesNeverShowTheServerTwoVersions) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, options(10, true));
  expect_served_every_version(r, 10, true);
  // The pause is the commit alone, a copy inside the process: shorter than
  // the refresh, which crosses the network and the domain.
  EXPECT_LT(r.median_pause_seconds(), r.median_refresh_seconds());
}

TEST_F(ServeCheck, DirectRefreshesPauseTheServerForTheWholeRefresh) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, options(3, false));
  expect_served_every_version(r, 3, false);
  for (const auto& v : r.versions) EXPECT_DOUBLE_EQ(v.pause_seconds, v.refresh_seconds) << "version " << v.version;
}

// A receiver killed early in the last staged refresh: the run fails and says
// so, the versions before it completed, and the killed rank's instance still
// serves the previous version, every byte of it.
TEST_F(ServeCheck, KilledReceiverLeavesItsInstanceOnThePreviousVersion) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(3, true);
  o.refresh_timeout = std::chrono::seconds(10);
  o.kill = RunOptions::Kill{true, 1, 0.2};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  if (r.kill_missed && r.status.is_ok()) GTEST_SKIP() << "the kill landed after the refresh: " << r.killed;
  EXPECT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("receiver 1"), std::string::npos) << r.status.message();
  EXPECT_NE(r.killed.find("receiver 1"), std::string::npos) << r.killed;
  ASSERT_EQ(r.versions.size(), 2u) << r.status.message();
  EXPECT_TRUE(r.versions[1].verified);
  ASSERT_TRUE(r.live_weights_intact.has_value());
  EXPECT_TRUE(*r.live_weights_intact) << r.status.message();
  EXPECT_EQ(r.mixed_version_reads, 0);
}

// The reader's sample covers each segment's first and last element, and a
// buffer torn between two versions matches neither as a whole.
TEST_F(ServeCheck, SampleSeesATornBuffer) {
  auto layout = refit::parse_layout_json(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}],
    "tensors": [
      {"name": "w", "dtype": "BF16", "shape": [100, 90],
       "source":   {"mesh": [1], "ranks": [0], "placements": ["R"]},
       "receiver": {"mesh": [1], "ranks": [0], "placements": ["R"]}}]})json", "test layout");
  ASSERT_TRUE(layout.is_ok()) << layout.status().message();
  auto bufs = refit::bench::rank_buffers(*layout, refit::Side::kReceiver, 0);
  ASSERT_TRUE(bufs.is_ok()) << bufs.status().message();
  ASSERT_EQ(bufs->size(), 1u);
  const refit::bench::RankBuffer& b = (*bufs)[0];
  const auto sample = refit::bench::sample_elements(*layout, b, 1000);
  ASSERT_EQ(sample.size(), 10u);  // 0, 1000, ..., 8000, and the last, 8999
  EXPECT_EQ(sample.front().flat, 0);
  EXPECT_EQ(sample.back().flat, 8999);
  EXPECT_EQ(sample.back().byte, 8999 * 2);

  std::vector<uint8_t> v1(static_cast<size_t>(b.bytes)), v2(v1.size());
  refit::bench::fill(*layout, b, v1.data(), 1);
  refit::bench::fill(*layout, b, v2.data(), 2);
  const int64_t versions[2] = {1, 2};
  auto common = [&](const std::vector<uint8_t>& data) {
    uint64_t bits = 0b11;
    for (const auto& e : sample) bits &= refit::bench::matching_versions(e, data.data(), versions, 2);
    return bits;
  };
  EXPECT_EQ(common(v1), 0b01u);
  EXPECT_EQ(common(v2), 0b10u);
  std::vector<uint8_t> torn = v1;
  std::memcpy(torn.data() + torn.size() / 2, v2.data() + v2.size() / 2, torn.size() - torn.size() / 2);
  EXPECT_EQ(common(torn), 0u);
  std::vector<uint8_t> last_torn = v1;  // only the segment's last element is new
  std::memcpy(last_torn.data() + 8999 * 2, v2.data() + 8999 * 2, 2);
  EXPECT_EQ(common(last_torn), 0u);
  std::vector<uint8_t> none(v1.size(), refit::bench::kGuardByte);
  EXPECT_EQ(common(none), 0u);
}

}  // namespace
