// Versions that never tear, through the C ABI, in forked processes over real
// UCX on loopback (include/refit/refit.h, "Versions, leases and commits";
// docs/refresh.md): a drained version is never read again, a lease lives as
// long as its refresh, commit is final for every rank of an instance, an
// instance with a rank missing never commits, a registration that cannot be
// planned is refused at join without harming the others, and a slow plan
// gets nobody declared dead.
//
// The processes are forked before the coordinator's threads start (a fork
// while another thread holds a lock leaves the child a lock nobody will
// release); the coordinator runs in the test process, with its timeouts set
// low. Each child reads commands, one line each, from its parent and answers
// with one line; every wait of the parent is bounded.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"
#include "transport/control/coordinator.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// One tensor "w", I32 [kRows, kCols]; source rank 0 holds all of it.
constexpr int64_t kRows = 64, kCols = 256;
const char* const kToken = "0123456789abcdef0123456789abcdef";
constexpr unsigned kTestSeconds = 110;  // SIGALRM past this; the children die with the test (PDEATHSIG)

int32_t value(int64_t version, int64_t i) { return static_cast<int32_t>(version * 100000 + i); }

// One line each way over a pair of pipes.
struct Line {
  int in = -1, out = -1;
  void send(const std::string& s) const {
    const std::string l = s + "\n";
    (void)!write(out, l.data(), l.size());
  }
  // "" on EOF or when nothing came within `timeout`.
  std::string recv(milliseconds timeout = milliseconds(30000)) const {
    std::string l;
    const auto deadline = Clock::now() + timeout;
    while (true) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return "";
      pollfd p{in, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char c;
      if (read(in, &c, 1) != 1) return "";
      if (c == '\n') return l;
      l.push_back(c);
    }
  }
};

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The agents' config; `extra` is merged in.
std::string config(int rank, uint16_t port, const std::string& token_file, nlohmann::json extra = {}) {
  nlohmann::json c = {{"rank", rank},
                      {"coordinator", {{"address", "127.0.0.1:" + std::to_string(port)}, {"token_file", token_file}}},
                      {"heartbeat_ms", 200}};
  if (extra.is_object()) c.update(extra);
  return c.dump();
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "child %d: %s: %s\n", getpid(), what, refit_last_error());
  _exit(1);
}

// What a child runs: its line to the parent, the coordinator's port, the
// token file.
using Body = std::function<void(const Line&, uint16_t, const std::string&)>;

class Trust : public ::testing::Test {
 protected:
  void SetUp() override {
    ::alarm(kTestSeconds);
    signal(SIGPIPE, SIG_IGN);
    char dir[] = "/tmp/refit-trust-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << kToken;
    chmod(token_file_.c_str(), 0600);  // a token file others may read is refused
  }
  void TearDown() override {
    for (Kid& k : kids_) {
      k.line.send("exit");
      close(k.line.out);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (Kid& k : kids_) {
      int status = 0;
      while (waitpid(k.pid, &status, WNOHANG) == 0 && Clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(10));
      }
      if (waitpid(k.pid, &status, WNOHANG) == 0) {
        kill(k.pid, SIGKILL);
        waitpid(k.pid, &status, 0);
      }
      close(k.line.in);
    }
    coordinator_.reset();
    std::remove(token_file_.c_str());
    rmdir(dir_.c_str());
    ::alarm(0);
  }

  // Forks one process per body, then starts the coordinator and gives them its port.
  void start(const std::vector<Body>& bodies, refit::control::CoordinatorConfig cc) {
    struct Pipes {
      int up[2], down[2];
    };
    std::vector<Pipes> pipes(bodies.size());
    for (Pipes& p : pipes) ASSERT_TRUE(pipe(p.up) == 0 && pipe(p.down) == 0);
    for (size_t i = 0; i < bodies.size(); ++i) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        for (size_t j = 0; j < pipes.size(); ++j) {
          close(pipes[j].up[0]), close(pipes[j].down[1]);
          if (j != i) close(pipes[j].up[1]), close(pipes[j].down[0]);
        }
        const Line line{pipes[i].down[0], pipes[i].up[1]};
        const std::vector<std::string> port = words(line.recv(milliseconds(60000)));
        if (port.size() != 2) _exit(2);
        bodies[i](line, static_cast<uint16_t>(std::stoi(port[1])), token_file_);
        line.recv(milliseconds(60000));  // "exit"
        _exit(0);
      }
      close(pipes[i].up[1]), close(pipes[i].down[0]);
      kids_.push_back(Kid{pid, Line{pipes[i].up[0], pipes[i].down[1]}});
    }
    cc.token = kToken;
    cc.log = [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(log_mu_);
      log_.push_back(l);
    };
    auto started = refit::control::Coordinator::start(cc);
    ASSERT_TRUE(started.is_ok()) << started.status().message();
    coordinator_ = std::move(started).value();
    for (Kid& k : kids_) k.line.send("port " + std::to_string(coordinator_->port()));
  }

  const Line& kid(size_t i) const { return kids_.at(i).line; }
  pid_t pid(size_t i) const { return kids_.at(i).pid; }
  // Sends `command` and returns the reply's words (none on a timeout).
  std::vector<std::string> ask(size_t i, const std::string& command, milliseconds timeout = milliseconds(30000)) {
    kid(i).send(command);
    return words(kid(i).recv(timeout));
  }
  // Whether the coordinator counts `n` leases within `timeout` (a state
  // query, polled: the coordinator has no event a test can wait on).
  bool wait_leases(size_t n, milliseconds timeout = milliseconds(10000)) {
    const auto until = Clock::now() + timeout;
    do {
      auto st = coordinator_->stats();
      if (st.is_ok() && st->leases >= n) return true;
      std::this_thread::sleep_for(milliseconds(5));
    } while (Clock::now() < until);
    return false;
  }
  std::vector<std::string> log_lines() {
    std::lock_guard<std::mutex> lock(log_mu_);
    return log_;
  }

  struct Kid {
    pid_t pid;
    Line line;
  };
  std::string dir_, token_file_;
  std::vector<Kid> kids_;
  std::unique_ptr<refit::control::Coordinator> coordinator_;
  std::mutex log_mu_;
  std::vector<std::string> log_;
};

// A source of all of "w" that answers:
//   "publish V"  waits until V-1 drained (when V > 1), writes V, publishes V: "ok"
//   "drain V"    wait_drained(V), then writes the pattern of version 999
//                into the shard at once, as a trainer does: "drained STATUS MS"
//   "write V"    writes V's pattern without publishing: "ok"
void source_body(const Line& line, uint16_t port, const std::string& token) {
  refit_source_t* s = nullptr;
  if (refit_source_create(config(0, port, token).c_str(), &s) != REFIT_OK) die("source create");
  std::vector<int32_t> w(kRows * kCols, 0);
  const char* desc = R"J({"name": "w", "dtype": "I32", "shape": [64, 256],
      "segments": [{"start": [0, 0], "size": [64, 256], "offset": 0}]})J";
  if (refit_source_add_tensor(s, desc, w.data(), w.size() * 4) != REFIT_OK) die("add_tensor");
  if (refit_source_join(s) != REFIT_OK) die("source join");
  auto fill = [&](int64_t v) {
    for (int64_t i = 0; i < kRows * kCols; ++i) w[i] = value(v, i);
  };
  while (true) {
    const std::vector<std::string> c = words(line.recv(milliseconds(100000)));
    if (c.empty() || c[0] == "exit") break;
    const int64_t v = c.size() > 1 ? std::stoll(c[1]) : 0;
    if (c[0] == "publish") {
      if (v > 1 && refit_source_wait_drained(s, v - 1, 20000) != REFIT_OK) die("wait_drained before a publish");
      fill(v);
      if (refit_source_publish(s, v) != REFIT_OK) die("publish");
      line.send("ok");
    } else if (c[0] == "drain") {
      const auto t0 = Clock::now();
      const refit_status_t st = refit_source_wait_drained(s, v, 20000);
      if (st == REFIT_OK) fill(999);  // the trainer writes its next step at once
      line.send("drained " + std::string(refit_status_name(st)) + " " +
                std::to_string(std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count()));
    } else if (c[0] == "write") {
      fill(v);
      line.send("ok");
    }
  }
  refit_source_destroy(s);
}

// A receiver of rows [row0, row0 + rows) of "w". Its config: `extra`.
// Answers "refresh V TIMEOUT_MS [DELAY_MS]" (V -1: REFIT_LATEST), after
// sleeping DELAY_MS, with "STATUS VERSION BYTES MS": the refresh's status
// (committed first in staged mode when it succeeded), the version the live
// buffer then holds, whether every byte of it is that version's ("ok",
// "torn", or "old" when it holds no version) and how long the refresh took.
// "start V TIMEOUT_MS" starts one (answers "started") and "wait" waits for
// it, answering the same. "join" answers "STATUS" and the last error.
struct ReceiverSpec {
  int rank = 0;
  int64_t row0 = 0, rows = kRows;
  nlohmann::json extra;
  std::string tensor = "w";
  int64_t seg_row0 = -1;  // the segment's first row when not row0 (out of bounds on purpose)
};

Body receiver_body(ReceiverSpec spec) {
  return [spec](const Line& line, uint16_t port, const std::string& token) {
    std::vector<int32_t> w(spec.rows * kCols, 0);
    refit_receiver_t* r = nullptr;
    bool made = false;
    auto make = [&] {
      if (made) return;
      made = true;
      nlohmann::json extra = spec.extra;
      if (!extra.contains("domain")) extra["domain"] = spec.rank;
      if (!extra.contains("instance")) extra["instance"] = spec.rank;
      if (refit_receiver_create(config(spec.rank, port, token, extra).c_str(), &r) != REFIT_OK) die("receiver create");
      const nlohmann::json desc = {
          {"name", "w"},
          {"dtype", "I32"},
          {"segments", {{{"tensor", spec.tensor},
                         {"start", {spec.seg_row0 >= 0 ? spec.seg_row0 : spec.row0, 0}},
                         {"size", {spec.rows, kCols}},
                         {"offset", 0}}}}};
      if (refit_receiver_add_buffer(r, desc.dump().c_str(), w.data(), w.size() * 4) != REFIT_OK) die("add_buffer");
    };
    auto answer = [&](refit_status_t st, Clock::time_point t0) {
      const bool staged = spec.extra.is_object() && spec.extra.value("mode", "") == "staged";
      if (st == REFIT_OK && staged && refit_receiver_commit(r) != REFIT_OK) {
        die("commit after a refresh that succeeded");
      }
      const int64_t held = refit_receiver_version(r);
      std::string bytes = held == 0 ? "old" : "ok";
      for (int64_t i = 0; i < spec.rows * kCols && held != 0; ++i) {
        if (w[i] != value(held, spec.row0 * kCols + i)) bytes = "torn";
      }
      std::string error = st == REFIT_OK ? "" : refit_last_error();
      for (char& c : error) c = c == '\n' ? ' ' : c;
      std::fprintf(stderr, "receiver %d: %s %s %s\n", spec.rank, refit_status_name(st), error.c_str(), refit_receiver_report(r));
      line.send(std::string(refit_status_name(st)) + " " + std::to_string(held) + " " + bytes + " " +
                std::to_string(std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count()) + " " + error);
    };
    Clock::time_point started;
    while (true) {
      const std::vector<std::string> c = words(line.recv(milliseconds(100000)));
      if (c.empty() || c[0] == "exit") break;
      make();
      if (c[0] == "join") {
        const refit_status_t st = refit_receiver_join(r);
        std::string error = refit_last_error();
        line.send(std::string(refit_status_name(st)) + " " + error);
      } else if (c[0] == "refresh") {
        if (c.size() > 3) std::this_thread::sleep_for(milliseconds(std::stoll(c[3])));
        const auto t0 = Clock::now();
        answer(refit_receiver_refresh(r, std::stoll(c[1]), std::stoll(c[2])), t0);
      } else if (c[0] == "start") {
        started = Clock::now();
        if (refit_receiver_refresh_start(r, std::stoll(c[1]), std::stoll(c[2])) != REFIT_OK) die("refresh_start");
        line.send("started");
      } else if (c[0] == "wait") {
        answer(refit_receiver_refresh_wait(r, 60000), started);
      } else if (c[0] == "report") {
        line.send(refit_receiver_report(r));
      } else if (c[0] == "refresh_keep") {
        // Staged: refreshes, takes the report, commits, and answers
        // "STATUS KEPT COMMITTED": whether the report taken before the
        // commit still reads as it did ("kept" or "changed"), and the
        // "committed" of the report taken after.
        const refit_status_t st = refit_receiver_refresh(r, std::stoll(c[1]), std::stoll(c[2]));
        if (st != REFIT_OK) {
          line.send(std::string(refit_status_name(st)) + " - - " + refit_last_error());
          continue;
        }
        const char* before = refit_receiver_report(r);
        const std::string copy = before;
        if (refit_receiver_commit(r) != REFIT_OK) die("commit");
        const bool kept = std::strcmp(before, copy.c_str()) == 0;
        const nlohmann::json after = nlohmann::json::parse(refit_receiver_report(r), nullptr, false);
        line.send(std::string("REFIT_OK ") + (kept ? "kept" : "changed") + " " +
                  (after.is_object() && after.value("committed", false) ? "true" : "false"));
      } else if (c[0] == "try_start") {
        started = Clock::now();
        const refit_status_t st = refit_receiver_refresh_start(r, std::stoll(c[1]), std::stoll(c[2]));
        std::string error = st == REFIT_OK ? "" : refit_last_error();
        line.send(std::string(refit_status_name(st)) + " " + error);
      }
    }
    refit_receiver_destroy(r);
  };
}

refit::control::CoordinatorConfig coordinator_config() {
  refit::control::CoordinatorConfig cc;
  cc.heartbeat_timeout = milliseconds(3000);  // agents beat every 200 ms
  return cc;
}

// Version 1 is published and drained; the source writes over its shard at
// once. A receiver that refreshes afterwards must never return OK with
// those bytes: asking for the latest it waits for a newer version (and
// times out, as none comes), asking for 1 it is told 1 was drained; once 2
// is published, the latest is 2, every byte of it.
TEST_F(Trust, ADrainedVersionIsNeverReadAgain) {
  start({source_body, receiver_body({})}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> drained = ask(0, "drain 1");
  ASSERT_GE(drained.size(), 2u);
  ASSERT_EQ(drained[1], "REFIT_OK");

  std::vector<std::string> latest = ask(1, "refresh -1 1500");
  ASSERT_GE(latest.size(), 3u);
  EXPECT_NE(latest[0], "REFIT_OK") << "a refresh read version 1 after it was drained: its bytes are "
                                   << latest[2];
  EXPECT_EQ(latest[0], "REFIT_TIMEOUT");
  EXPECT_EQ(latest[1], "0");

  std::vector<std::string> explicit_v1 = ask(1, "refresh 1 1500");
  ASSERT_GE(explicit_v1.size(), 3u);
  EXPECT_EQ(explicit_v1[0], "REFIT_NOT_FOUND");
  EXPECT_EQ(explicit_v1[1], "0");
  std::string error;
  for (size_t i = 4; i < explicit_v1.size(); ++i) error += explicit_v1[i] + " ";
  EXPECT_NE(error.find("version 1 was drained"), std::string::npos) << error;

  ASSERT_EQ(ask(0, "publish 2"), std::vector<std::string>{"ok"});
  const std::vector<std::string> two = ask(1, "refresh -1 10000");
  ASSERT_GE(two.size(), 3u);
  EXPECT_EQ(two[0], "REFIT_OK");
  EXPECT_EQ(two[1], "2");
  EXPECT_EQ(two[2], "ok");
}

// The lease times out after 400 ms. Receivers 0 and 1 want all of "w" in
// one domain: receiver 0 pulls it from the source and passes it on to
// receiver 1. Receiver 1 starts first and waits 2.5 s under its lease for
// receiver 0, which starts late. The lease is renewed while the refresh
// runs: the source's wait_drained(1), asked meanwhile, waits until both
// refreshes released version 1, and both get it whole.
TEST_F(Trust, ALeaseLivesAsLongAsItsRefresh) {
  refit::control::CoordinatorConfig cc = coordinator_config();
  cc.lease_timeout = milliseconds(400);
  const nlohmann::json domain0 = {{"domain", 0}};
  start({source_body, receiver_body({0, 0, kRows, domain0}), receiver_body({1, 0, kRows, domain0})}, cc);
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  for (size_t i : {1, 2}) {  // one plan for both, made before either refreshes
    const std::vector<std::string> joined = ask(i, "join");
    ASSERT_FALSE(joined.empty());
    ASSERT_EQ(joined[0], "REFIT_OK");
  }
  kid(2).send("refresh 1 20000");
  kid(1).send("refresh 1 20000 2500");
  ASSERT_TRUE(wait_leases(1)) << "receiver 1 never leased version 1";  // and waits for receiver 0
  kid(0).send("drain 1");
  const std::vector<std::string> a = words(kid(1).recv()), b = words(kid(2).recv());
  ASSERT_GE(a.size(), 4u);
  ASSERT_GE(b.size(), 4u);
  EXPECT_EQ(a[0], "REFIT_OK");
  EXPECT_EQ(a[2], "ok") << "the source overwrote version 1 while a refresh still read it";
  EXPECT_EQ(b[0], "REFIT_OK");
  EXPECT_EQ(b[1], "1");
  EXPECT_EQ(b[2], "ok") << "the source overwrote version 1 while a refresh still read it";
  EXPECT_GT(std::stoll(b[3]), 2000) << "the refresh was to outlive its lease timeout";
  const std::vector<std::string> drained = words(kid(0).recv());
  ASSERT_GE(drained.size(), 3u);
  EXPECT_EQ(drained[1], "REFIT_OK");
}

// The lease times out after 400 ms and the plan takes 2.5 s longer
// (test_plan_delay). The receiver is stopped (SIGSTOP) in its refresh until
// its lease expired (the coordinator keeps a lease alive while it plans for
// its holder, and not after); the source drains version 1 and writes over
// it. Resumed, the refresh must fail, never return OK.
TEST_F(Trust, ARefreshWhoseLeaseWasLostFails) {
  refit::control::CoordinatorConfig cc = coordinator_config();
  cc.heartbeat_timeout = milliseconds(8000);
  cc.lease_timeout = milliseconds(400);
  cc.test_plan_delay = milliseconds(2500);
  start({source_body, receiver_body({0})}, cc);
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  ASSERT_EQ(ask(1, "start 1 20000"), std::vector<std::string>{"started"});
  ASSERT_TRUE(wait_leases(1)) << "the receiver never leased version 1";  // its plan being made
  kill(pid(1), SIGSTOP);
  // Past the lease's expiry (the plan, then 400 ms, seen by a sweep every
  // 2 s): the source is told 1 drained and writes over it.
  const std::vector<std::string> drained = ask(0, "drain 1", milliseconds(15000));
  kill(pid(1), SIGCONT);
  ASSERT_GE(drained.size(), 3u);
  EXPECT_EQ(drained[1], "REFIT_OK");
  const std::vector<std::string> r = ask(1, "wait", milliseconds(30000));
  ASSERT_GE(r.size(), 3u);
  EXPECT_NE(r[0], "REFIT_OK") << "a refresh whose lease was lost returned OK; its bytes are " << r[2];
  std::string error;
  for (size_t i = 4; i < r.size(); ++i) error += r[i] + " ";
  EXPECT_NE(error.find("lease"), std::string::npos) << error;
}

// A two-rank staged instance ("instance_ranks": 2), 100 versions. Rank 0's
// deadline is swept across the time a refresh takes (so that it falls
// before, while and after it reports staged), then rank 1 starts later and
// later, so that it stages at the edge of rank 0's deadline. After every
// version, both ranks hold the same version, every byte of it.
TEST_F(Trust, EveryRankOfAnInstanceEndsOnTheSameVersion) {
  const nlohmann::json staged = {{"mode", "staged"}, {"instance", 0}, {"instance_ranks", 2}};
  start({source_body, receiver_body({0, 0, kRows / 2, staged}), receiver_body({1, kRows / 2, kRows / 2, staged})},
        coordinator_config());
  int64_t v = 0;
  int committed_late = 0;  // versions rank 0 committed after its own deadline
  auto round = [&](int64_t timeout0, int64_t delay1, int64_t* took) {
    ++v;
    EXPECT_EQ(ask(0, "publish " + std::to_string(v)), std::vector<std::string>{"ok"});
    kid(1).send("refresh " + std::to_string(v) + " " + std::to_string(timeout0));
    kid(2).send("refresh " + std::to_string(v) + " 8000 " + std::to_string(delay1));
    const std::vector<std::string> a = words(kid(1).recv()), b = words(kid(2).recv());
    if (a.size() < 4 || b.size() < 4) {
      ADD_FAILURE() << "version " << v << ": a rank did not answer";
      return false;
    }
    EXPECT_EQ(a[1], b[1]) << "version " << v << " (rank 0's timeout " << timeout0 << " ms, rank 1 " << delay1
                          << " ms late): rank 0 " << a[0] << " holds " << a[1] << ", rank 1 " << b[0] << " holds "
                          << b[1];
    EXPECT_NE(a[2], "torn");
    EXPECT_NE(b[2], "torn");
    if (took) *took = std::stoll(a[3]);
    if (a[0] == "REFIT_OK" && std::stoll(a[3]) > timeout0) ++committed_late;
    return a[1] == b[1];
  };
  // How long a refresh takes here, with time to spare: the sweeps' scale.
  int64_t took = 0;
  ASSERT_TRUE(round(8000, 0, &took));  // the first waits for both ranks to join
  ASSERT_TRUE(round(8000, 0, &took));
  const int64_t d = std::max<int64_t>(took, 4);
  int equal = 0;
  for (int i = 0; i < 50; ++i) {  // rank 0's deadline from 3% to 150% of a refresh
    const int64_t timeout0 = std::max<int64_t>(1, d * 3 * (i + 1) / 100);
    equal += round(timeout0, 0, nullptr);
  }
  for (int i = 0; i < 50; ++i) {  // rank 1 stages from a refresh before to a refresh after rank 0's deadline
    const int64_t timeout0 = 2 * d;
    const int64_t delay1 = std::max<int64_t>(0, timeout0 - d + (i - 25) * d / 25);
    equal += round(timeout0, delay1, nullptr);
  }
  EXPECT_EQ(equal, 100);
  std::printf("a refresh took %ld ms; %d versions were committed by rank 0 after its deadline\n",
              static_cast<long>(took), committed_late);
  EXPECT_EQ(v, 102);
}

// Instance 0 declares two ranks and only rank 0 joins: it never commits,
// whatever the deadline. Instance 1, complete, refreshes meanwhile.
TEST_F(Trust, AnInstanceWithARankMissingNeverCommits) {
  const nlohmann::json two = {{"mode", "staged"}, {"instance", 0}, {"instance_ranks", 2}};
  const nlohmann::json one = {{"mode", "staged"}, {"instance", 1}, {"instance_ranks", 1}};
  start({source_body, receiver_body({0, 0, kRows / 2, two}), receiver_body({2, 0, kRows, one})}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> lone = ask(1, "refresh -1 2000");
  ASSERT_GE(lone.size(), 3u);
  EXPECT_NE(lone[0], "REFIT_OK");
  EXPECT_EQ(lone[1], "0") << "an instance missing a rank committed";
  std::string error;
  for (size_t i = 4; i < lone.size(); ++i) error += lone[i] + " ";
  EXPECT_NE(error.find("instance 0 has 1 of its 2 ranks"), std::string::npos) << error;
  const std::vector<std::string> other = ask(2, "refresh -1 10000");
  ASSERT_GE(other.size(), 3u);
  EXPECT_EQ(other[0], "REFIT_OK");
  EXPECT_EQ(other[1], "1");
  EXPECT_EQ(other[2], "ok");
}

// A receiver whose buffer names a tensor no source has, and one whose
// segment lies outside the tensor, are refused at join, naming the buffer
// and the problem; the other instance refreshes.
TEST_F(Trust, AnUnplannableReceiverIsRefusedAtJoinAndTheOthersRefresh) {
  ReceiverSpec unknown{1, 0, kRows / 2};
  unknown.tensor = "no_such_tensor";
  ReceiverSpec outside{2, 0, kRows / 2};
  outside.seg_row0 = kRows - 8;  // rows [56, 88) of a tensor of 64
  start({source_body, receiver_body({0}), receiver_body(unknown), receiver_body(outside)}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  auto joined = [&](size_t i) {
    kid(i).send("join");
    return kid(i).recv();
  };
  const std::string a = joined(2), b = joined(3);
  EXPECT_EQ(a.rfind("REFIT_INVALID_ARGUMENT", 0), 0u) << a;
  EXPECT_NE(a.find("buffer \"w\""), std::string::npos) << a;
  EXPECT_NE(a.find("no registered source declares"), std::string::npos) << a;
  EXPECT_EQ(b.rfind("REFIT_INVALID_ARGUMENT", 0), 0u) << b;
  EXPECT_NE(b.find("buffer \"w\""), std::string::npos) << b;
  EXPECT_NE(b.find("is not inside the tensor"), std::string::npos) << b;
  const std::vector<std::string> good = ask(1, "refresh -1 10000");
  ASSERT_GE(good.size(), 3u);
  EXPECT_EQ(good[0], "REFIT_OK");
  EXPECT_EQ(good[1], "1");
  EXPECT_EQ(good[2], "ok");
}

// A source that only answers "join": STATUS and the last error. Rank 0,
// as the live source_body is.
void second_source_body(const Line& line, uint16_t port, const std::string& token) {
  refit_source_t* s = nullptr;
  if (refit_source_create(config(0, port, token).c_str(), &s) != REFIT_OK) die("second source create");
  std::vector<int32_t> w(kRows * kCols, 0);
  const char* desc = R"J({"name": "w", "dtype": "I32", "shape": [64, 256],
      "segments": [{"start": [0, 0], "size": [64, 256], "offset": 0}]})J";
  if (refit_source_add_tensor(s, desc, w.data(), w.size() * 4) != REFIT_OK) die("second source add_tensor");
  while (true) {
    const std::vector<std::string> c = words(line.recv(milliseconds(100000)));
    if (c.empty() || c[0] == "exit") break;
    if (c[0] == "join") {
      const refit_status_t st = refit_source_join(s);
      line.send(std::string(refit_status_name(st)) + " " + refit_last_error());
    }
  }
  refit_source_destroy(s);
}

// Source rank 0 and receiver rank 0 are live. Another process, with the
// same token, connects and tries to join as each of them: both joins are
// refused, naming the rank, and the live members go on refreshing as if
// nothing happened (the version after is whole, from the live source).
TEST_F(Trust, ASecondConnectionCannotTakeALiveRank) {
  start({source_body, receiver_body({0}), receiver_body({0}), second_source_body}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> one = ask(1, "refresh 1 10000");
  ASSERT_GE(one.size(), 3u);
  EXPECT_EQ(one[0], "REFIT_OK");
  EXPECT_EQ(one[2], "ok");

  kid(2).send("join");
  const std::string receiver = kid(2).recv();
  EXPECT_EQ(receiver.rfind("REFIT_INVALID_ARGUMENT", 0), 0u) << receiver;
  EXPECT_NE(receiver.find("receiver rank 0 is already registered"), std::string::npos) << receiver;
  kid(3).send("join");
  const std::string source = kid(3).recv();
  EXPECT_EQ(source.rfind("REFIT_INVALID_ARGUMENT", 0), 0u) << source;
  EXPECT_NE(source.find("source rank 0 is already registered"), std::string::npos) << source;

  ASSERT_EQ(ask(0, "publish 2"), std::vector<std::string>{"ok"});
  const std::vector<std::string> two = ask(1, "refresh 2 10000");
  ASSERT_GE(two.size(), 3u);
  EXPECT_EQ(two[0], "REFIT_OK");
  EXPECT_EQ(two[1], "2");
  EXPECT_EQ(two[2], "ok");
  for (const std::string& l : log_lines()) EXPECT_EQ(l.find("declared dead"), std::string::npos) << l;
}

// A plan that takes 3.2 s with a 2 s heartbeat timeout (the coordinator
// reads nothing of the asking connection meanwhile, its heartbeats
// included): the receiver gets its plan and refreshes, and nobody is
// declared dead.
TEST_F(Trust, APlanSlowerThanTheHeartbeatTimeoutIsServedAndNobodyDies) {
  refit::control::CoordinatorConfig cc = coordinator_config();
  cc.heartbeat_timeout = milliseconds(2000);
  cc.test_plan_delay = milliseconds(3200);
  start({source_body, receiver_body({0})}, cc);
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> r = ask(1, "refresh 1 20000", milliseconds(30000));
  ASSERT_GE(r.size(), 4u);
  EXPECT_EQ(r[0], "REFIT_OK");
  EXPECT_EQ(r[1], "1");
  EXPECT_EQ(r[2], "ok");
  EXPECT_GT(std::stoll(r[3]), 3000) << "the plan was to take longer than the heartbeat timeout";
  bool planned = false;
  for (const std::string& l : log_lines()) {
    EXPECT_EQ(l.find("declared dead"), std::string::npos) << l;
    planned = planned || l.find("planned membership") != std::string::npos;
  }
  EXPECT_TRUE(planned);
}

// ---- The receiver's C ABI contract (include/refit/refit.h) ---------------

class ReceiverAbi : public Trust {};

// The report pointer a staged receiver returns after its refresh stays
// valid, and reads the same, after commit (the header promises it lives
// until the next refresh); the report taken after the commit says so.
TEST_F(ReceiverAbi, TheReportTakenBeforeACommitOutlivesIt) {
  const nlohmann::json staged = {{"mode", "staged"}};
  start({source_body, receiver_body({0, 0, kRows, staged})}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> r = ask(1, "refresh_keep 1 20000");
  ASSERT_GE(r.size(), 3u);
  ASSERT_EQ(r[0], "REFIT_OK");
  EXPECT_EQ(r[1], "kept") << "the report taken before the commit changed under it (freed and reused)";
  EXPECT_EQ(r[2], "true");
}

// The plan takes 3 s (test_plan_delay) and the coordinator's own timeout
// is 10 s: a refresh given 800 ms returns within about its deadline,
// REFIT_TIMEOUT, instead of waiting for the plan.
TEST_F(ReceiverAbi, ARefreshDeadlineCoversItsCoordinatorCalls) {
  refit::control::CoordinatorConfig cc = coordinator_config();
  cc.heartbeat_timeout = milliseconds(8000);
  cc.test_plan_delay = milliseconds(3000);
  start({source_body, receiver_body({0})}, cc);
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> r = ask(1, "refresh 1 800");
  ASSERT_GE(r.size(), 4u);
  EXPECT_EQ(r[0], "REFIT_TIMEOUT");
  EXPECT_LT(std::stoll(r[3]), 1800) << "the refresh waited for the coordinator past its deadline";
}

// The receiver may start four threads: its coordinator link's reader and
// its UCX fabric's idle progress (at create), its heartbeat (at join) and
// the started refresh's own; the next (the lease renewal) is refused as the
// system refuses one at its limit. The refresh fails with a status that
// names the thread, and the process lives on.
TEST_F(ReceiverAbi, AThreadThatCannotStartFailsTheRefreshNotTheProcess) {
  const nlohmann::json refuse = {{"test", {{"refuse_threads_after", 4}}}, {"local", {{"fabric", "ucx"}}}};
  start({source_body, receiver_body({0, 0, kRows, refuse})}, coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  const std::vector<std::string> joined = ask(1, "join");
  ASSERT_FALSE(joined.empty());
  ASSERT_EQ(joined[0], "REFIT_OK");
  const std::vector<std::string> started = ask(1, "try_start 1 5000");
  ASSERT_FALSE(started.empty());
  ASSERT_EQ(started[0], "REFIT_OK");
  const std::vector<std::string> r = ask(1, "wait", milliseconds(20000));
  ASSERT_GE(r.size(), 3u) << "the receiver's process died";
  EXPECT_EQ(r[0], "REFIT_IO_ERROR");
  std::string error;
  for (size_t i = 4; i < r.size(); ++i) error += r[i] + " ";
  EXPECT_NE(error.find("cannot start the lease renewal thread"), std::string::npos) << error;
  // The refresh thread itself refused: refresh_start says so.
  const std::vector<std::string> again = ask(1, "try_start 1 5000");
  ASSERT_FALSE(again.empty()) << "the receiver's process died";
  EXPECT_EQ(again[0], "REFIT_IO_ERROR");
}

// A two-rank staged instance: rank 0's deadline passes before rank 1
// stages, so the instance aborts the version. Rank 1 is told so:
// REFIT_ABORTED, not the REFIT_IO_ERROR of a network failure.
TEST_F(ReceiverAbi, AnAbortOfTheInstanceIsReportedAsAborted) {
  const nlohmann::json staged = {{"mode", "staged"}, {"instance", 0}, {"instance_ranks", 2}};
  start({source_body, receiver_body({0, 0, kRows / 2, staged}), receiver_body({1, kRows / 2, kRows / 2, staged})},
        coordinator_config());
  ASSERT_EQ(ask(0, "publish 1"), std::vector<std::string>{"ok"});
  for (size_t i : {1, 2}) {
    const std::vector<std::string> joined = ask(i, "join");
    ASSERT_FALSE(joined.empty());
    ASSERT_EQ(joined[0], "REFIT_OK");
  }
  kid(1).send("refresh 1 500");
  kid(2).send("refresh 1 10000 2000");
  const std::vector<std::string> a = words(kid(1).recv()), b = words(kid(2).recv());
  ASSERT_GE(a.size(), 2u);
  ASSERT_GE(b.size(), 2u);
  EXPECT_NE(a[0], "REFIT_OK");
  EXPECT_EQ(b[0], "REFIT_ABORTED");
  EXPECT_EQ(a[1], "0");
  EXPECT_EQ(b[1], "0");
}

}  // namespace
