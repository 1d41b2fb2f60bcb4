// Receivers and sources that come and go while refreshes run (refresh_run.h):
// receivers that leave and rejoin between versions (churn), a receiver or a
// source killed in a refresh and replaced by a standby process, a source
// killed where a replica holds its data, and an instance that joins late.
// Every version that completes is verified byte for byte on every receiver
// that took part, and the serving readers must never see two versions.
//
// The coordinator declares a killed rank dead after heartbeat_timeout; the
// tests shorten it to 3 s (the agents then beat every 750 ms) so that a
// replacement joins, or a plan routes around the dead rank, well within the
// refresh deadline.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "planner/layout.h"
#include "planner/manifest.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "tests/e2e/gathers.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/refresh_run.h"

extern char** environ;

namespace {

// A sanitizer's allocator: AddressSanitizer's and ThreadSanitizer's have no
// mallinfo2 (the heap in use reads 0), and AddressSanitizer's holds freed
// memory in its quarantine.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif

namespace fs = std::filesystem;
using refit::Layout;
using refit::Strategy;
using refit::bench::RunOptions;
using refit::bench::RunResult;

// A test that runs longer than this is killed by SIGALRM; its rank
// processes die with it (PR_SET_PDEATHSIG).
constexpr unsigned kTestSeconds = 55;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class Membership : public ::testing::Test {
 protected:
  void SetUp() override { ::alarm(kTestSeconds); }
  void TearDown() override { ::alarm(0); }

  // A scenario with the small-dense model of examples/models.
  static Layout scenario(const std::string& path) {
    auto s = refit::parse_scenario(read_text(path), path);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    if (!s.is_ok()) return Layout();
    const std::string model = std::string(REFIT_SOURCE_ROOT) + "/examples/models/small-dense.json";
    auto m = refit::parse_manifest_json(read_text(model), model);
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    if (!m.is_ok()) return Layout();
    const std::string config = std::string(REFIT_SOURCE_ROOT) + "/examples/models/small-dense.config.json";
    auto c = refit::parse_model_config(read_text(config), config);
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    if (!c.is_ok()) return Layout();
    m->config = *c;
    auto layout = refit::layout_from_scenario(*s, *m);
    EXPECT_TRUE(layout.is_ok()) << layout.status().message();
    return layout.is_ok() ? std::move(*layout) : Layout();
  }
  // Megatron TP2 trainers to two vLLM TP2 replicas in one 4-rank domain:
  // each shard is held by one source rank only.
  static Layout tp2_to_tp2x2() {
    return scenario(std::string(REFIT_SOURCE_ROOT) + "/examples/scenarios/tp2-to-tp2x2.json");
  }
  // The same receivers; the TP2 trainers replicated twice (DP2), so that
  // every shard has a second source rank.
  static Layout dp2_tp2_to_tp2x2() { return scenario(REFIT_TEST_SCENARIOS "/dp2-tp2-to-tp2x2.json"); }

  static RunOptions options(int versions) {
    RunOptions o;
    o.versions = versions;
    o.staged = true;
    o.serve_check = true;
    o.step_timeout = std::chrono::seconds(20);
    o.refresh_timeout = std::chrono::seconds(12);
    o.heartbeat_timeout = std::chrono::seconds(3);
    return o;
  }

  // Every report of a completed version names it, succeeded and committed.
  static void expect_reports_of(const refit::bench::VersionResult& v, size_t receivers) {
    EXPECT_TRUE(v.verified) << "version " << v.version;
    EXPECT_EQ(v.reports.size(), receivers) << "version " << v.version;
    for (const auto& report : v.reports) {
      EXPECT_EQ(report.value("version", int64_t{-1}), v.version) << report.dump();
      EXPECT_TRUE(report.value("ok", false)) << report.dump();
      EXPECT_TRUE(report.value("committed", false)) << report.dump();
    }
  }

  static const refit::bench::ResidentSample* resident_of(const RunResult& r, const std::string& process) {
    for (const auto& s : r.resident)
      if (s.process == process) return &s;
    return nullptr;
  }
};

// Two of the four receivers leave (refit_receiver_destroy) and rejoin
// before every version after the first. Each version verifies on all four,
// the readers never see two versions, and no process's resident memory
// grows by as much as one receiver's buffers, nor what it has allocated and
// not freed by a quarter of that: a receiver that kept its staging copies
// (or anything of that size) after leaving would, once per rejoin.
//
// A source keeps the pieces its gather replies were copied into for reuse,
// up to its "gather_reply_bytes" (transport/ucx/am_rma.h), and how many it
// holds at once follows the timing of the pullers: with the default 256 MiB
// a source's heap grew by 12 MiB between two samples under UCX 1.22 without
// any leak. Here the sources keep at most 4 MiB and the receivers' gathers
// are at most 1 MiB, so that the reuse stays well under the bound.
TEST_F(Membership, ChurnedReceiversVerifyEveryVersionAndMemoryStaysFlat) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(8);
  o.churn = 2;
  o.source_config = {{"gather_reply_bytes", int64_t{4} << 20}};
  o.receiver_config = {{"gather_bytes", int64_t{1} << 20}};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message();
  ASSERT_EQ(r.versions.size(), 8u);
  EXPECT_TRUE(r.verified());
  std::vector<int> rejoins_of(4, 0);
  for (const auto& v : r.versions) {
    expect_reports_of(v, 4);
    EXPECT_EQ(v.rejoined.size(), v.version == 1 ? 0u : 2u) << "version " << v.version;
    for (int32_t rank : v.rejoined) ++rejoins_of.at(static_cast<size_t>(rank));
    if (v.version > 1) {
      EXPECT_GT(v.rejoin_seconds, 0) << "version " << v.version;
    }
  }
  EXPECT_EQ(r.rejoins, 14);
  for (int n : rejoins_of) EXPECT_GE(n, 3) << "the churn takes the ranks in turn";
  EXPECT_GT(r.serve_reads, 0);
  EXPECT_EQ(r.mixed_version_reads, 0) << "of " << r.serve_reads << " reads";

  ASSERT_EQ(r.resident.size(), 7u) << "the bench, 2 sources and 4 receivers";
  EXPECT_EQ(r.resident.front().process, "refit-bench");
  const int64_t receiver_kib = refit::bench::receiver_payload_bytes(layout) / 4 / 1024;
  for (const auto& s : r.resident) {
    EXPECT_EQ(s.first_version, 1) << s.process;
    EXPECT_EQ(s.last_version, 8) << s.process;
    EXPECT_GT(s.first_kib, 0) << s.process;
    // A sanitizer's allocator (kSanitizerAllocator): growth says nothing
    // there, and AddressSanitizer's leak check at exit takes the place of
    // these bounds.
    if (kSanitizerAllocator) continue;
    EXPECT_LT(s.last_kib - s.first_kib, receiver_kib) << s.process << " grew from " << s.first_kib << " to "
                                                      << s.last_kib << " KiB";
    EXPECT_GT(s.first_heap_kib, 0) << s.process;
    EXPECT_LT(s.last_heap_kib - s.first_heap_kib, receiver_kib / 4)
        << s.process << "'s heap in use grew from " << s.first_heap_kib << " to " << s.last_heap_kib << " KiB";
  }
  EXPECT_EQ(r.resident_first_kib(), [&] {
    int64_t sum = 0;
    for (const auto& s : r.resident) sum += s.first_kib;
    return sum;
  }());
}

// A receiver killed in the refresh of version 3: a standby process takes its
// rank, and version 4 refreshes and verifies on all four receivers. Whatever
// version 3 did, the receivers that lost it still serve version 2.
TEST_F(Membership, KilledReceiverIsReplacedAndTheNextVersionVerifiesEverywhere) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(4);
  o.kill = RunOptions::Kill{true, 1, 0.2, /*rejoin=*/true};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message() << "\nkilled version: " << r.kill_error;
  EXPECT_EQ(r.killed_version, 3);
  EXPECT_NE(r.killed.find("receiver 1"), std::string::npos) << r.killed;
  EXPECT_NE(r.rejoined.find("took receiver 1"), std::string::npos) << r.rejoined;
  EXPECT_GT(r.rejoin_seconds, 0);
  EXPECT_LT(r.kill_refresh_seconds, 12 + 1) << "the killed version's refresh outlived its deadline";
  if (r.live_weights_intact) {
    EXPECT_TRUE(*r.live_weights_intact) << r.kill_error;
  }
  ASSERT_GE(r.versions.size(), 3u);
  EXPECT_EQ(r.versions[0].version, 1);
  EXPECT_EQ(r.versions[1].version, 2);
  expect_reports_of(r.versions.back(), 4);
  EXPECT_EQ(r.versions.back().version, 4);
  EXPECT_EQ(r.mixed_version_reads, 0);
  const auto* replacement = resident_of(r, "receiver 1 (replacement)");
  ASSERT_NE(replacement, nullptr);
  EXPECT_EQ(replacement->first_version, 4);
}

// Staged, three TP2 instances in one domain, receiver 1 (instance 0) killed
// in version 3: instance 0 aborts the version, and its surviving rank 0
// stops refreshing it, while ranks of the other instances have finished it
// and others wait for the slices the killed rank was to pass on. Once the
// coordinator has declared it dead, those retry; their new parts must not
// route slices through the stopped or finished ranks (solo parts,
// docs/refresh.md "Retries"), or they would wait until their deadline.
TEST_F(Membership, AnAbortedInstanceDoesNotHoldUpTheOthers) {
  const Layout layout = scenario(REFIT_TEST_SCENARIOS "/tp2-to-tp2x3.json");
  ASSERT_EQ(layout.receivers.size(), 6u);
  RunOptions o = options(4);
  o.kill = RunOptions::Kill{true, 1, 0.3, /*rejoin=*/true};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message() << "\nkilled version: " << r.kill_error;
  ASSERT_EQ(r.killed_version, 3);
  if (r.kill_missed) GTEST_SKIP() << "the kill landed after the refresh: " << r.killed;
  const std::vector<int32_t>& done = r.refreshed_without_killed;
  std::printf("%s; the others' refresh of version 3 took %.3f s; returned OK:", r.killed.c_str(),
              r.kill_refresh_seconds);
  for (int32_t rank : done) std::printf(" receiver %d", rank);
  std::printf("\n");
  for (int32_t rank = 2; rank < 6; ++rank) {
    EXPECT_NE(std::find(done.begin(), done.end(), rank), done.end()) << "receiver " << rank << ": " << r.kill_error;
  }
  EXPECT_LT(r.kill_refresh_seconds, 12 - 2) << "a receiver waited until its deadline: " << r.kill_error;
  EXPECT_EQ(r.versions.back().version, 4);
  expect_reports_of(r.versions.back(), 6);
}

// The same in direct mode, where every server pauses for the whole refresh
// (the killed version's too, which waits for the coordinator to declare the
// dead rank gone): the readers go on afterwards, and every process still
// exits when asked at the end.
TEST_F(Membership, KilledReceiverInADirectRefreshIsReplacedToo) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(4);
  o.staged = false;
  o.kill = RunOptions::Kill{true, 2, 0.2, /*rejoin=*/true};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message() << "\nkilled version: " << r.kill_error;
  EXPECT_FALSE(r.staged);
  EXPECT_NE(r.rejoined.find("took receiver 2"), std::string::npos) << r.rejoined;
  ASSERT_GE(r.versions.size(), 3u);
  const auto& last = r.versions.back();
  EXPECT_EQ(last.version, 4);
  EXPECT_TRUE(last.verified);
  ASSERT_EQ(last.reports.size(), 4u);
  for (const auto& report : last.reports) EXPECT_TRUE(report.value("ok", false)) << report.dump();
  EXPECT_GT(r.serve_reads, 0);
  EXPECT_EQ(r.mixed_version_reads, 0);
}

// Every shard has two source ranks: source 1 killed in the last refresh, the
// receivers retry until the coordinator declares it dead, then the plan
// takes its shards from its replica, and the version completes everywhere.
TEST_F(Membership, KilledSourceWithAReplicaStillCompletesTheVersion) {
  const Layout layout = dp2_tp2_to_tp2x2();
  ASSERT_EQ(layout.sources.size(), 4u);
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(3);
  o.kill = RunOptions::Kill{false, 1, 0.1};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message();
  if (r.kill_missed) GTEST_SKIP() << "the kill landed after the refresh: " << r.killed;
  EXPECT_EQ(r.killed_version, 3);
  EXPECT_TRUE(r.kill_error.empty()) << r.kill_error;
  ASSERT_EQ(r.versions.size(), 3u);
  for (const auto& v : r.versions) expect_reports_of(v, 4);
  int64_t retries = 0;
  for (const auto& report : r.versions.back().reports) retries += report.value("retries", int64_t{0});
  EXPECT_GT(retries, 0) << "the kill landed after the refresh: nothing was routed around the dead source";
  // The small runs that were rerouted to the replica still travelled in
  // gathers.
  EXPECT_GT(refit::e2e::gathered_runs(r.versions.back()), 0) << "no run of the killed version travelled in a gather";
  EXPECT_EQ(r.mixed_version_reads, 0);
}

// Source 1 holds the only copy of its shards: killed in the refresh of
// version 3, that refresh fails on every receiver before its deadline, every
// receiver lives on and still serves version 2, and once a standby process
// has taken source rank 1 and published version 4, version 4 verifies
// everywhere.
TEST_F(Membership, KilledSourceWithoutAReplicaFailsCleanlyAndItsReplacementServesTheNext) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.sources.size(), 2u);
  RunOptions o = options(4);
  o.kill = RunOptions::Kill{false, 1, 0.1, /*rejoin=*/true};
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message() << "\nkilled version: " << r.kill_error;
  EXPECT_EQ(r.killed_version, 3);
  EXPECT_FALSE(r.kill_error.empty()) << "version 3 completed without source 1's shards";
  EXPECT_LT(r.kill_refresh_seconds, 12 + 1) << "the failed refresh outlived its deadline";
  ASSERT_TRUE(r.live_weights_intact.has_value());
  EXPECT_TRUE(*r.live_weights_intact) << r.kill_error;
  EXPECT_NE(r.rejoined.find("took source 1"), std::string::npos) << r.rejoined;
  ASSERT_EQ(r.versions.size(), 3u) << "versions 1, 2 and 4";
  EXPECT_EQ(r.versions[1].version, 2);
  EXPECT_EQ(r.versions[2].version, 4);
  for (const auto& v : r.versions) expect_reports_of(v, 4);
  EXPECT_EQ(r.mixed_version_reads, 0);
}

// Instance 1 (receivers 2 and 3) joins at version 3: versions 1 and 2
// refresh instance 0 only, and from version 3 on all four verify.
TEST_F(Membership, LateInstanceIsServedFromTheVersionItJoins) {
  const Layout layout = tp2_to_tp2x2();
  ASSERT_EQ(layout.receivers.size(), 4u);
  RunOptions o = options(5);
  o.late_join_version = 3;
  RunResult r = refit::bench::run_refreshes(layout, Strategy::kRefit, o);
  ASSERT_TRUE(r.status.is_ok()) << r.status.message();
  ASSERT_EQ(r.versions.size(), 5u);
  for (const auto& v : r.versions) expect_reports_of(v, v.version < 3 ? 2u : 4u);
  EXPECT_NE(r.late_joined.find("instance 1 (receivers 2, 3) joined at version 3"), std::string::npos)
      << r.late_joined;
  EXPECT_EQ(r.mixed_version_reads, 0);
  for (const char* p : {"receiver 2", "receiver 3"}) {
    const auto* s = resident_of(r, p);
    ASSERT_NE(s, nullptr) << p;
    EXPECT_EQ(s->first_version, 3) << p;
  }
  const auto* early = resident_of(r, "receiver 0");
  ASSERT_NE(early, nullptr);
  EXPECT_EQ(early->first_version, 1);
}

// refit-bench itself, as a user runs it: --churn and the resident memory
// reach the table and the JSON that --help documents.
TEST_F(Membership, BenchReportsChurnAndResidentMemory) {
  std::string dir = (fs::temp_directory_path() / "refit-membership-XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string json = dir + "/out.json", log = dir + "/log.txt";
  const std::string root = REFIT_SOURCE_ROOT;
  std::vector<std::string> argv = {REFIT_BENCH, "--scenario", root + "/examples/scenarios/tp2-to-tp2x2.json",
                                   "--models", root + "/examples/models", "--strategies", "refit", "--versions", "4",
                                   "--mode", "staged", "--serve-check", "--churn=2", "--timeout", "20",
                                   "--json", json};
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ), 0) << argv[0];
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(45);
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    ::usleep(10000);
  }
  const std::string out = read_text(log);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("refit: churn: 6 receivers left and rejoined"), std::string::npos) << out;
  EXPECT_NE(out.find("refit: resident memory (VmRSS) of 7 processes"), std::string::npos) << out;
  auto doc = nlohmann::json::parse(read_text(json), nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << read_text(json);
  const auto& row = doc["results"][0];
  EXPECT_EQ(row["completed"], 4);
  EXPECT_EQ(row["mixed_version_reads"], 0);
  EXPECT_EQ(row["churn"], 2);
  EXPECT_EQ(row["rejoins"], 6);
  EXPECT_GT(row["rejoin_seconds_median"].get<double>(), 0);
  ASSERT_EQ(row["rss"].size(), 7u);
  int64_t first = 0, last = 0;
  for (const auto& p : row["rss"]) {
    EXPECT_EQ(p["first_version"], 1) << p.dump();
    EXPECT_EQ(p["last_version"], 4) << p.dump();
    first += p["first_kib"].get<int64_t>();
    last += p["last_kib"].get<int64_t>();
  }
  EXPECT_EQ(row["rss_first_kib"], first);
  EXPECT_EQ(row["rss_last_kib"], last);
  EXPECT_TRUE(row["rss_max_growth_kib"].is_number_integer());
  // A sanitizer's allocator has no mallinfo2: the heap in use reads 0.
  if (!kSanitizerAllocator) {
    EXPECT_GT(row["heap_last_kib"].get<int64_t>(), 0);
  }
  EXPECT_TRUE(row["rss"][0].contains("last_heap_kib")) << row["rss"][0].dump();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
