// The agents through the C ABI, in forked processes over real UCX on
// loopback: two sources (a tensor split by rows) and two receivers of one
// domain (one wants the whole tensor, the other its columns split by rank,
// another tensor replicated on both), three versions, every byte checked.
// The larger end-to-end suite is tests/e2e.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
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

float w_value(int64_t r, int64_t c, int64_t v) { return static_cast<float>(r * 7919 + c * 31 + v * 1000003 % 8191); }
int32_t b_value(int64_t c, int64_t v) { return static_cast<int32_t>(c * 17 + v * 101); }

struct Pipe {
  int fd[2];
  Pipe() { EXPECT_EQ(pipe(fd), 0); }
};

// One byte each way: the child says "ready" (joined), the parent says "go".
bool read_byte(int fd, char* c) { return read(fd, c, 1) == 1; }
void write_byte(int fd, char c) { (void)!write(fd, &c, 1); }

std::string config(int rank, int domain, uint16_t port, const std::string& token_file, bool receiver) {
  nlohmann::json c = {{"rank", rank},
                      {"domain", domain},
                      {"coordinator", {{"address", "127.0.0.1:" + std::to_string(port)}, {"token_file", token_file}}},
                      {"heartbeat_ms", 200}};
  if (receiver) c["instance"] = rank;
  return c.dump();
}

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "child: %s: %s\n", what, refit_last_error());
  _exit(1);
}

void source_child(int rank, uint16_t port, const std::string& token, int up, int down) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_source_t* s = nullptr;
  if (refit_source_create(config(rank, 0, port, token, false).c_str(), &s) != REFIT_OK) fail("create");
  const int64_t rows = kRows / 2;
  std::vector<float> w(rows * kCols);
  std::vector<int32_t> b(kCols);
  const std::string wdesc = R"J({"name": "w", "dtype": "F32", "shape": [96, 1000],
      "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}})J";
  const std::string bdesc = R"J({"name": "b", "dtype": "I32", "shape": [1000],
      "dtensor": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}})J";
  if (refit_source_add_tensor(s, wdesc.c_str(), w.data(), w.size() * 4) != REFIT_OK) fail("add w");
  if (refit_source_add_tensor(s, bdesc.c_str(), b.data(), b.size() * 4) != REFIT_OK) fail("add b");
  if (refit_source_join(s) != REFIT_OK) fail("join");
  write_byte(up, 'r');
  char c;
  for (int v = 1; v <= kVersions; ++v) {
    if (!read_byte(down, &c)) _exit(2);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < kCols; ++col) w[r * kCols + col] = w_value(rank * rows + r, col, v);
    for (int64_t col = 0; col < kCols; ++col) b[col] = b_value(col, v);
    if (refit_source_publish(s, v) != REFIT_OK) fail("publish");
    write_byte(up, 'p');
  }
  read_byte(down, &c);  // exit
  refit_source_destroy(s);
  _exit(0);
}

void receiver_child(int rank, uint16_t port, const std::string& token, int up, int down) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_receiver_t* r = nullptr;
  if (refit_receiver_create(config(rank, 0, port, token, true).c_str(), &r) != REFIT_OK) fail("create");
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
  for (int v = 1; v <= kVersions; ++v) {
    if (!read_byte(down, &c)) _exit(2);
    if (refit_receiver_refresh(r, v, 20000) != REFIT_OK) fail("refresh");
    for (int64_t row = 0; row < kRows; ++row)
      for (int64_t col = 0; col < cols; ++col)
        if (w[row * cols + col] != w_value(row, c0 + col, v)) {
          std::fprintf(stderr, "rank %d v%d: w[%ld, %ld] wrong\n", rank, v, (long)row, (long)(c0 + col));
          _exit(3);
        }
    for (int64_t col = 0; col < kCols; ++col)
      if (b[col] != b_value(col, v)) _exit(4);
    std::fprintf(stderr, "rank %d: %s\n", rank, refit_receiver_report(r));
    write_byte(up, 'd');
  }
  read_byte(down, &c);
  refit_receiver_destroy(r);
  _exit(0);
}

TEST(Agents, TwoSourcesToTwoReceiversOfOneDomainThreeVersions) {
  char dir[] = "/tmp/refit-agents-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string token_file = std::string(dir) + "/token";
  std::ofstream(token_file) << "0123456789abcdef0123456789abcdef";
  refit::control::CoordinatorConfig cc;
  cc.token = "0123456789abcdef0123456789abcdef";
  cc.log = [](const std::string&) {};
  auto coordinator = refit::control::Coordinator::start(cc);
  ASSERT_TRUE(coordinator.is_ok()) << coordinator.status().message();
  const uint16_t port = (*coordinator)->port();

  struct Child {
    pid_t pid;
    Pipe up, down;
  };
  std::vector<Child> kids(4);
  for (int i = 0; i < 4; ++i) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (i < 2) source_child(i, port, token_file, kids[i].up.fd[1], kids[i].down.fd[0]);
      receiver_child(i - 2, port, token_file, kids[i].up.fd[1], kids[i].down.fd[0]);
    }
    kids[i].pid = pid;
  }
  auto await = [&](int i) {
    char c;
    return read_byte(kids[i].up.fd[0], &c);
  };
  bool ok = true;
  for (int i = 0; i < 4 && ok; ++i) ok = await(i);
  for (int v = 1; v <= kVersions && ok; ++v) {
    for (int i = 0; i < 2; ++i) write_byte(kids[i].down.fd[1], 'g');
    for (int i = 0; i < 2 && ok; ++i) ok = await(i);
    for (int i = 2; i < 4; ++i) write_byte(kids[i].down.fd[1], 'g');
    for (int i = 2; i < 4 && ok; ++i) ok = await(i);
  }
  for (Child& k : kids) write_byte(k.down.fd[1], 'x');
  for (Child& k : kids) {
    int status = 0;
    if (!ok) kill(k.pid, SIGKILL);
    waitpid(k.pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << k.pid << " status " << status;
  }
  EXPECT_TRUE(ok);
  std::remove(token_file.c_str());
  rmdir(dir);
}

}  // namespace
