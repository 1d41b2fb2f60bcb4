// The agents through the C ABI, in forked processes over real UCX on
// loopback: two sources (a tensor split by rows) and two receivers of one
// domain (one wants the whole tensor, the other its columns split by rank,
// another tensor replicated on both), three versions, every byte checked.
// The larger end-to-end suite is tests/e2e.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"
#include "transport/control/coordinator.h"

namespace {

constexpr int64_t kRows = 96, kCols = 1000;  // F32 "w"; "b" is I32 [kCols]
constexpr int kVersions = 3;

// Verification (set before the forks): every agent runs with "verify", and
// source 0 writes into its shard of w right after publishing version
// g_tamper (0: never), as a trainer that does not wait for wait_drained would.
bool g_verify = false;
int g_tamper = 0;

// Gathers (docs/refresh.md, "Gathers"): the receivers' "gather_below_bytes"
// and "gather_bytes" (-1: the defaults), and what each refresh's report
// must then say. Rank 1's half of w is a column slice: one 2000-byte run
// per row from sources that hold whole rows.
int64_t g_gather_below = -1, g_gather_bytes = -1;
// The receivers' "max_plan_runs" (-1: unset); set, every refresh must be
// refused for it, naming the key.
int64_t g_max_plan_runs = -1;
enum class Gathers { kAny, kUsed, kOff, kUnpacked };
Gathers g_expect_gathers = Gathers::kAny;

float w_value(int64_t r, int64_t c, int64_t v) { return static_cast<float>(r * 7919 + c * 31 + v * 1000003 % 8191); }
int32_t b_value(int64_t c, int64_t v) { return static_cast<int32_t>(c * 17 + v * 101); }

struct Pipe {
  int fd[2];
  Pipe() { EXPECT_EQ(pipe(fd), 0); }
};

// One byte each way: the child says "ready" (joined), the parent says "go".
bool read_byte(int fd, char* c) { return read(fd, c, 1) == 1; }
void write_byte(int fd, char c) { (void)!write(fd, &c, 1); }

std::string config(int rank, int domain, uint16_t port, const std::string& token_file, bool receiver,
                   bool staged = false) {
  nlohmann::json c = {{"rank", rank},
                      {"domain", domain},
                      {"coordinator", {{"address", "127.0.0.1:" + std::to_string(port)}, {"token_file", token_file}}},
                      {"heartbeat_ms", 200}};
  if (g_verify) c["verify"] = true;
  if (receiver) {
    if (g_gather_below >= 0) c["gather_below_bytes"] = g_gather_below;
    if (g_gather_bytes >= 0) c["gather_bytes"] = g_gather_bytes;
    if (g_max_plan_runs >= 0) c["max_plan_runs"] = g_max_plan_runs;
    c["instance"] = staged ? 0 : rank;  // staged: one instance, which commits all or nothing
    if (staged) c["mode"] = "staged";
    const char* ring = std::getenv("REFIT_LANDING_RING");
    if (ring != nullptr && std::string(ring) == "1") {
      // A landing ring of three small slots, fewer than the window holds:
      // every refresh wraps it many times and GETs wait for their slot.
      c["chunk_bytes"] = 4096;
      c["window_bytes"] = 16384;
      c["landing_bytes"] = 3 * 4096;
      c["test"] = {{"force_landing_ring", true}};  // a test-only key (include/refit/refit.h)
    }
  }
  return c.dump();
}

[[noreturn]] void fail(const char* what, int code = 1) {
  std::fprintf(stderr, "child: %s: %s\n", what, refit_last_error());
  _exit(code);
}

// replicated: both sources hold all of w (a replica survives either's death).
void source_child(int rank, uint16_t port, const std::string& token, int up, int down, bool replicated) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_source_t* s = nullptr;
  if (refit_source_create(config(rank, 0, port, token, false).c_str(), &s) != REFIT_OK) fail("create");
  const int64_t rows = replicated ? kRows : kRows / 2;
  const int64_t row0 = replicated ? 0 : rank * rows;
  std::vector<float> w(rows * kCols);
  std::vector<int32_t> b(kCols);
  const std::string wdesc = std::string(R"J({"name": "w", "dtype": "F32", "shape": [96, 1000],
      "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": [")J") + (replicated ? "R" : "S(0)") + "\"]}}";
  const std::string bdesc = R"J({"name": "b", "dtype": "I32", "shape": [1000],
      "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}})J";
  if (refit_source_add_tensor(s, wdesc.c_str(), w.data(), w.size() * 4) != REFIT_OK) fail("add w");
  if (refit_source_add_tensor(s, bdesc.c_str(), b.data(), b.size() * 4) != REFIT_OK) fail("add b");
  if (refit_source_join(s) != REFIT_OK) fail("join");
  write_byte(up, 'r');
  char c;
  for (int v = 1; v <= kVersions; ++v) {
    if (!read_byte(down, &c)) fail("the parent is gone", 2);
    // As a trainer does: no receiver reads the last version any more before
    // its shards are overwritten.
    if (v > 1 && refit_source_wait_drained(s, v - 1, 30000) != REFIT_OK) fail("wait_drained");
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < kCols; ++col) w[r * kCols + col] = w_value(row0 + r, col, v);
    for (int64_t col = 0; col < kCols; ++col) b[col] = b_value(col, v);
    if (refit_source_publish(s, v) != REFIT_OK) fail("publish");
    if (v == g_tamper && rank == 0) w[5 * kCols + 7] += 1.0f;
    write_byte(up, 'p');
  }
  read_byte(down, &c);  // exit
  refit_source_destroy(s);
  _exit(0);
}

// What a receiver does with version v: refresh normally, or fail on purpose
// (staged mode: a timeout of 1 ms) or fail because its peer did.
enum class Step { kRefresh, kFailOnPurpose, kExpectFailure };

// staged: every refresh is checked to leave the live buffers alone until
// commit, and a failed one to leave them on the last committed version.
void receiver_child(int rank, uint16_t port, const std::string& token, int up, int down, bool staged = false,
                    const std::vector<Step>& steps = {}) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_receiver_t* r = nullptr;
  if (refit_receiver_create(config(rank, 0, port, token, true, staged).c_str(), &r) != REFIT_OK) fail("create");
  // Rank 0 wants all of w; rank 1 the columns [500, 1000) through explicit segments.
  const int64_t c0 = rank == 0 ? 0 : 500, cols = rank == 0 ? kCols : 500;
  std::vector<float> w(kRows * cols);
  std::vector<int32_t> b(kCols);
  const std::string wdesc =
      rank == 0 ? std::string(R"J({"name": "w", "dtype": "F32", "shape": [96, 1000],
                     "dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]}})J")
                : std::string(R"J({"name": "w_half", "dtype": "F32", "segments": [{"tensor": "w",
                     "start": [0, 500], "size": [96, 500], "offset": 0}]})J");
  const std::string bdesc = R"J({"name": "b", "dtype": "I32", "segments": [{"tensor": "b", "start": [0], "size": [1000], "offset": 0}]})J";
  if (refit_receiver_add_buffer(r, wdesc.c_str(), w.data(), w.size() * 4) != REFIT_OK) fail("add w");
  if (refit_receiver_add_buffer(r, bdesc.c_str(), b.data(), b.size() * 4) != REFIT_OK) fail("add b");
  if (refit_receiver_join(r) != REFIT_OK) fail("join");
  write_byte(up, 'r');
  char c;
  auto check = [&](int v) {  // v == 0: never written
    for (int64_t row = 0; row < kRows; ++row)
      for (int64_t col = 0; col < cols; ++col)
        if (w[row * cols + col] != (v == 0 ? 0.0f : w_value(row, c0 + col, v))) {
          std::fprintf(stderr, "rank %d v%d: w[%ld, %ld] wrong\n", rank, v, (long)row, (long)(c0 + col));
          _exit(3);
        }
    for (int64_t col = 0; col < kCols; ++col)
      if (b[col] != (v == 0 ? 0 : b_value(col, v))) fail("b wrong", 4);
  };
  int live = 0;  // the version the live buffers hold
  for (int v = 1; v <= kVersions; ++v) {
    if (!read_byte(down, &c)) fail("the parent is gone", 2);
    const Step step = steps.empty() ? Step::kRefresh : steps[v - 1];
    const refit_status_t st = refit_receiver_refresh(r, v, step == Step::kFailOnPurpose ? 1 : 20000);
    if (g_max_plan_runs >= 0) {  // the part is larger than this rank allows
      const std::string error = refit_last_error();
      if (st == REFIT_OK || error.find("\"max_plan_runs\"") == std::string::npos) {
        std::fprintf(stderr, "rank %d v%d: %s\n", rank, v, error.c_str());
        fail("a part over \"max_plan_runs\" was not refused naming it", 14);
      }
      check(0);  // nothing written
      write_byte(up, 'd');
      continue;
    }
    if (step != Step::kRefresh) {
      if (st == REFIT_OK) fail("a refresh that should fail succeeded");
      if (v == g_tamper) {  // this rank, or its instance, found the tampered bytes
        const std::string error = refit_last_error();
        std::fprintf(stderr, "rank %d v%d failed as it should: %s\n", rank, v, error.c_str());
        if (error.find("verify: version " + std::to_string(v) + " of tensor \"w\"") == std::string::npos) {
          fail("the error does not name the version and tensor that failed verification", 10);
        }
        // The rank that found it, or one whose instance aborted for it first.
        if (st != REFIT_VERIFY_FAILED && st != REFIT_ABORTED) {
          fail("a verification mismatch is neither REFIT_VERIFY_FAILED nor REFIT_ABORTED", 13);
        }
      }
      if (!staged) fail("a failure expected in direct mode", 5);
      check(live);  // staged: the live buffers keep the old version
      if (refit_receiver_version(r) != live) fail("the version moved on a failed refresh", 6);
      if (refit_receiver_commit(r) != REFIT_INVALID_ARGUMENT) fail("commit after a failed refresh", 7);
      write_byte(up, 'd');
      continue;
    }
    if (st != REFIT_OK) fail("refresh");
    if (staged) {
      check(live);  // not yet committed: the server still reads the old version
      if (refit_receiver_commit(r) != REFIT_OK) fail("commit");
      live = v;
      if (refit_receiver_version(r) != v) fail("the version after commit", 8);
    }
    check(v);
    const nlohmann::json report = nlohmann::json::parse(refit_receiver_report(r));
    // The whole plan's minimum: all of w (rank 0 needs it) and b, once for
    // the one domain. A retry after the membership changed during the
    // version ran a solo part (each rank pulls all it needs), whose plan
    // has rank 1, if it is alive, pull its 500 columns of w and b too.
    const int64_t minimum = kRows * kCols * 4 + kCols * 4;
    const int64_t got = report.value("minimum_network_bytes", int64_t{-1});
    if (report.value("solo", false) ? got != minimum && got != minimum + kRows * 500 * 4 + kCols * 4
                                    : got != minimum) {
      fail("the report's minimum_network_bytes", 9);
    }
    if (g_verify) {  // every byte of both buffers checked against a source's hash
      const nlohmann::json& verified = report["verify"];
      const int64_t bytes = kRows * cols * 4 + kCols * 4;
      if (verified.value("bytes", int64_t{0}) != bytes || verified.value("unverified_bytes", int64_t{-1}) != 0 ||
          verified.value("boxes", 0) < 2) {
        fail("the report's verify counts", 11);
      }
    }
    const char* ring = std::getenv("REFIT_LANDING_RING");
    if (ring != nullptr && std::string(ring) == "1") {
      // Every GET went through the three slots, many times over, and GETs
      // waited for a slot to be copied out.
      const nlohmann::json& landing = report["landing"];
      if (landing.value("slots", 0) != 3 || landing.value("chunks", 0) <= 3 || landing.value("held", 0) == 0) {
        fail("the report's landing counts", 12);
      }
    }
    const nlohmann::json gathers = report.value("gathers", nlohmann::json::object());
    const bool used = gathers.value("ops", 0) > 0 && gathers.value("runs", 0) > gathers.value("ops", 0);
    const char* ring_env = std::getenv("REFIT_LANDING_RING");
    const bool through_ring = ring_env != nullptr && std::string(ring_env) == "1";
    // Runs through the landing ring are never grouped (docs/refresh.md, "Gathers").
    if ((through_ring && g_expect_gathers != Gathers::kAny && report.contains("gathers")) ||
        (!through_ring && g_expect_gathers == Gathers::kUsed && (!used || gathers.value("unpacked", -1) != 0)) ||
        (g_expect_gathers == Gathers::kOff && report.contains("gathers")) ||
        (!through_ring && g_expect_gathers == Gathers::kUnpacked && gathers.value("unpacked", 0) == 0)) {
      std::fprintf(stderr, "rank %d: %s\n", rank, refit_receiver_report(r));
      fail("the report's gathers", 13);
    }
    std::fprintf(stderr, "rank %d: %s\n", rank, refit_receiver_report(r));
    write_byte(up, 'd');
  }
  read_byte(down, &c);
  refit_receiver_destroy(r);
  _exit(0);
}

// kill_source: SIGKILL source 1 once it has published this version, before
// the receivers refresh to it (0: never).
// kill_receiver: SIGKILL receiver 1 (its own instance) before the receivers
// refresh to this version; receiver 0 must go on alone.
void run_agents(bool staged, const std::vector<std::vector<Step>>& steps, bool replicated = false,
                int kill_source = 0, int kill_receiver = 0) {
  signal(SIGPIPE, SIG_IGN);  // a child that died must fail the test, not kill it
  char dir[] = "/tmp/refit-agents-XXXXXX";
  if (mkdtemp(dir) == nullptr) FAIL();
  const std::string token_file = std::string(dir) + "/token";
  std::ofstream(token_file) << "0123456789abcdef0123456789abcdef";
  ::chmod(token_file.c_str(), 0600);  // a token others may read is refused
  struct Child {
    pid_t pid;
    Pipe up, down;
  };
  std::vector<Child> kids(4);
  for (int i = 0; i < 4; ++i) {
    pid_t pid = fork();
    if (pid < 0) FAIL();
    if (pid == 0) {
      // Keep only this child's ends, so that a child that exits gives its
      // parent EOF instead of a read that never returns.
      for (int j = 0; j < 4; ++j) {
        if (j == i) continue;
        close(kids[j].up.fd[0]), close(kids[j].up.fd[1]), close(kids[j].down.fd[0]), close(kids[j].down.fd[1]);
      }
      close(kids[i].up.fd[0]);
      close(kids[i].down.fd[1]);
      uint16_t port = 0;
      if (read(kids[i].down.fd[0], &port, sizeof port) != sizeof port) _exit(2);
      if (i < 2) source_child(i, port, token_file, kids[i].up.fd[1], kids[i].down.fd[0], replicated);
      receiver_child(i - 2, port, token_file, kids[i].up.fd[1], kids[i].down.fd[0], staged, steps[i - 2]);
    }
    kids[i].pid = pid;
  }
  for (Child& k : kids) close(k.up.fd[1]), close(k.down.fd[0]);
  // The coordinator's threads start after the forks: a fork while another
  // thread holds a lock (UCX's memory hooks take one on every mmap) leaves
  // the child a lock nobody will release.
  refit::control::CoordinatorConfig cc;
  cc.token = "0123456789abcdef0123456789abcdef";
  cc.log = [](const std::string&) {};
  cc.heartbeat_timeout = std::chrono::milliseconds(600);  // agents beat every 200 ms
  auto coordinator = refit::control::Coordinator::start(cc);
  if (!coordinator.is_ok()) {
    for (Child& k : kids) kill(k.pid, SIGKILL), waitpid(k.pid, nullptr, 0);
    FAIL() << coordinator.status().message();
  }
  const uint16_t port = (*coordinator)->port();
  for (Child& k : kids) (void)!write(k.down.fd[1], &port, sizeof port);
  auto await = [&](int i) {
    char c;
    return read_byte(kids[i].up.fd[0], &c);
  };
  bool ok = true;
  for (int i = 0; i < 4 && ok; ++i) ok = await(i);
  bool killed = false, receiver_killed = false;
  for (int v = 1; v <= kVersions && ok; ++v) {
    const int sources = killed ? 1 : 2;
    for (int i = 0; i < sources; ++i) write_byte(kids[i].down.fd[1], 'g');
    for (int i = 0; i < sources && ok; ++i) ok = await(i);
    if (v == kill_source) {  // source 1 dies with version v published
      kill(kids[1].pid, SIGKILL);
      killed = true;
    }
    if (v == kill_receiver) {
      kill(kids[3].pid, SIGKILL);
      receiver_killed = true;
    }
    const int receivers_end = receiver_killed ? 3 : 4;
    for (int i = 2; i < receivers_end; ++i) write_byte(kids[i].down.fd[1], 'g');
    for (int i = 2; i < receivers_end && ok; ++i) ok = await(i);
  }
  for (Child& k : kids) write_byte(k.down.fd[1], 'x');
  for (size_t i = 0; i < kids.size(); ++i) {
    int status = 0;
    if (!ok) kill(kids[i].pid, SIGKILL);
    waitpid(kids[i].pid, &status, 0);
    if ((killed && i == 1) || (receiver_killed && i == 3)) continue;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << kids[i].pid << " status " << status;
  }
  EXPECT_TRUE(ok);
  std::remove(token_file.c_str());
  rmdir(dir);
}

TEST(Agents, TwoSourcesToTwoReceiversOfOneDomainThreeVersions) { run_agents(false, {{}, {}}); }

// Source 1 is killed once it has published version 2. Both sources hold all
// of w, so the receivers' refresh to 2 fails on it, is retried, and
// completes from source 0 once the coordinator has declared source 1 dead
// (heartbeat timeout); version 3 comes from source 0 alone.
TEST(Agents, ARefreshRoutesAroundADeadSourceWithAReplica) {
  run_agents(false, {{}, {}}, /*replicated=*/true, /*kill_source=*/2);
}

// Receiver 1 (an instance of its own, in receiver 0's domain) is killed
// before version 2: receiver 0's refresh finds it gone, is retried, and
// completes once the coordinator has declared it dead and replanned the
// domain for receiver 0 alone; so does version 3.
TEST(Agents, AnotherInstanceOfTheDomainDyingDoesNotStopARefresh) {
  run_agents(false, {{}, {}}, /*replicated=*/false, /*kill_source=*/0, /*kill_receiver=*/2);
}

// Staged: the live buffers change only at commit; when one rank of the
// instance fails version 2, neither commits it and both keep version 1;
// version 3 then commits on both.
TEST(Agents, StagedRefreshCommitsAllOrNothing) {
  run_agents(true, {{Step::kRefresh, Step::kExpectFailure, Step::kRefresh},
                    {Step::kRefresh, Step::kFailOnPurpose, Step::kRefresh}});
}

// Verification: every byte each receiver gets is checked against the hash
// its source computed at publish. Source 0 writes into w after publishing
// version 2 (before anyone pulled it), so both ranks of the instance find
// a hash that differs, name the tensor, and keep version 1 live; version 3
// verifies and commits.
TEST(Agents, VerificationCatchesBytesChangedAfterPublish) {
  g_verify = true;
  g_tamper = 2;
  run_agents(true, {{Step::kRefresh, Step::kExpectFailure, Step::kRefresh},
                    {Step::kRefresh, Step::kExpectFailure, Step::kRefresh}});
  g_verify = false;
  g_tamper = 0;
}

TEST(Agents, VerificationPassesOnEveryVersion) {
  g_verify = true;
  run_agents(false, {{}, {}});
  g_verify = false;
}

// The column slices travel as gathers (on by default), every byte checked
// against the sources' hashes; then with gathers off, the same bytes as
// one GET per row; then with "gather_bytes" smaller than a row, so that the
// rows travel unpacked and the report counts them.
TEST(Agents, ColumnSlicesTravelAsGathersAndVerify) {
  g_verify = true;
  g_expect_gathers = Gathers::kUsed;
  run_agents(false, {{}, {}});
  g_expect_gathers = Gathers::kAny;
  g_verify = false;
}

TEST(Agents, GathersOffPullsEveryRowAlone) {
  g_verify = true;
  g_gather_below = 0;
  g_expect_gathers = Gathers::kOff;
  run_agents(false, {{}, {}});
  g_gather_below = -1;
  g_expect_gathers = Gathers::kAny;
  g_verify = false;
}

// A part that expands to more runs than the receiver allows
// ("max_plan_runs") is refused by it, naming the key, before anything is
// written; the coordinator serves it (it checks against the largest limit).
TEST(Agents, APartOverTheReceiversRunLimitIsRefusedNamingIt) {
  g_max_plan_runs = 1;  // every part has w's runs and b's
  run_agents(false, {{}, {}});
  g_max_plan_runs = -1;
}

TEST(Agents, AGatherBoundSmallerThanARowLeavesRowsUnpacked) {
  g_gather_bytes = 1000;
  g_expect_gathers = Gathers::kUnpacked;
  run_agents(false, {{}, {}});
  g_gather_bytes = -1;
  g_expect_gathers = Gathers::kAny;
}

}  // namespace
