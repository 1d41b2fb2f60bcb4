// The control plane against a hostile or unlucky peer, with every process
// real: the agents through the C ABI in forked processes over UCX on
// loopback, the coordinator embedded in one of them or run as the
// refit-coordinator executable. (docs/security.md, "Control plane".)
#include <fcntl.h>
#include <poll.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"
#include "transport/control/client.h"
#include "transport/control/messages.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
constexpr const char* kToken = "0123456789abcdef0123456789abcdef";
constexpr int64_t kElems = 4096;  // F32 "w"

float w_value(int64_t i, int v) { return static_cast<float>(i * 3 + v * 1000); }

bool read_byte(int fd, char* c) { return read(fd, c, 1) == 1; }
void write_byte(int fd, char c) { (void)!write(fd, &c, 1); }

[[noreturn]] void fail(int up, const char* what) {
  std::fprintf(stderr, "child %d: %s: %s\n", getpid(), what, refit_last_error());
  write_byte(up, 'f');
  _exit(1);
}

// A free loopback port (bound, read and released).
uint16_t free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

struct TempDir {
  std::string path;
  TempDir() {
    char dir[] = "/tmp/refit-trust-XXXXXX";
    path = mkdtemp(dir) ? dir : "";
  }
  ~TempDir() {
    if (!path.empty()) (void)!system(("rm -rf " + path).c_str());
  }
};

std::string write_token(const std::string& dir) {
  const std::string file = dir + "/token";
  std::ofstream(file) << kToken << "\n";
  chmod(file.c_str(), 0600);
  return file;
}

std::string agent_config(int rank, uint16_t port, const std::string& token_file, bool receiver, bool embedded) {
  nlohmann::json c = {{"rank", rank},
                      {"coordinator",
                       {{"address", "127.0.0.1:" + std::to_string(port)}, {"token_file", token_file},
                        {"timeout_ms", 20000}}},
                      {"heartbeat_ms", 200}};
  if (embedded) c["coordinator"]["embedded"] = true;
  if (receiver) c["instance"] = 0;
  return c.dump();
}

const char* kWDesc = R"J({"name": "w", "dtype": "F32", "shape": [4096],
    "dtensor": {"mesh": [1], "ranks": [0], "placements": ["R"]}})J";

// Joins, says 'r'; then per 'g' publishes the next version and says 'p';
// exits at 'x' or EOF.
void source_child(uint16_t port, const std::string& token, bool embedded, int up, int down) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_source_t* s = nullptr;
  if (refit_source_create(agent_config(0, port, token, false, embedded).c_str(), &s) != REFIT_OK) fail(up, "create");
  std::vector<float> w(kElems);
  if (refit_source_add_tensor(s, kWDesc, w.data(), w.size() * 4) != REFIT_OK) fail(up, "add");
  if (refit_source_join(s) != REFIT_OK) fail(up, "join");
  write_byte(up, 'r');
  char c;
  for (int v = 1; read_byte(down, &c) && c == 'g'; ++v) {
    for (int64_t i = 0; i < kElems; ++i) w[i] = w_value(i, v);
    if (refit_source_publish(s, v) != REFIT_OK) fail(up, "publish");
    write_byte(up, 'p');
  }
  refit_source_destroy(s);
  _exit(0);
}

// Joins, says 'r'; at 'g' refreshes to version 1, checks every element and
// says 'd'; exits at 'x' or EOF.
void receiver_child(uint16_t port, const std::string& token, int up, int down) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  refit_receiver_t* r = nullptr;
  if (refit_receiver_create(agent_config(0, port, token, true, false).c_str(), &r) != REFIT_OK) fail(up, "create");
  std::vector<float> w(kElems);
  if (refit_receiver_add_buffer(r, kWDesc, w.data(), w.size() * 4) != REFIT_OK) fail(up, "add");
  if (refit_receiver_join(r) != REFIT_OK) fail(up, "join");
  write_byte(up, 'r');
  char c;
  if (read_byte(down, &c) && c == 'g') {
    if (refit_receiver_refresh(r, 1, 20000) != REFIT_OK) fail(up, "refresh");
    for (int64_t i = 0; i < kElems; ++i) {
      if (w[i] != w_value(i, 1)) fail(up, "a wrong element after the refresh");
    }
    write_byte(up, 'd');
    read_byte(down, &c);
  }
  refit_receiver_destroy(r);
  _exit(0);
}

struct Child {
  pid_t pid = -1;
  int up = -1, down = -1;  // the parent's ends
};

template <typename Body>
Child fork_child(Body body) {
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    body(up[1], down[0]);
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  return Child{pid, up[0], down[1]};
}

// The byte the child sends next, within `timeout` ('\0' on timeout or EOF).
char await(const Child& c, std::chrono::milliseconds timeout) {
  pollfd p{c.up, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout.count())) != 1) return '\0';
  char b = 0;
  return read_byte(c.up, &b) ? b : '\0';
}

int reap(const Child& c, std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  int status = 0;
  while (Clock::now() < until) {
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) return status;
    std::this_thread::sleep_for(10ms);
  }
  kill(c.pid, SIGKILL);
  waitpid(c.pid, &status, 0);
  return status;
}

// Issue: a registration frame whose tensor name is the bytes "w\xff\xfe",
// then a fetch_plan, aborted the coordinator (nlohmann type_error 316); with
// "embedded": true the coordinator's process is a trainer. Here it is a
// source process through the C ABI; a token holder speaks the protocol to
// its embedded coordinator over TCP.
TEST(Trust, AFrameWithInvalidUtf8ToAnEmbeddedCoordinatorKillsNoProcessAndIsRefused) {
  signal(SIGPIPE, SIG_IGN);
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string token = write_token(dir.path);
  const uint16_t port = free_port();
  Child source = fork_child([&](int up, int down) { source_child(port, token, /*embedded=*/true, up, down); });
  ASSERT_GT(source.pid, 0);
  ASSERT_EQ(await(source, 20s), 'r') << "the source with its embedded coordinator joined";

  using refit::control::Client;
  using refit::control::Json;
  using refit::control::MsgType;
  auto bad = Client::connect("127.0.0.1", port, kToken);
  ASSERT_TRUE(bad.is_ok()) << bad.status().message();
  refit::control::RegisterSource m;
  m.rank = 1;
  m.worker_address = {1, 2, 3};
  m.tensors.push_back({std::string("w\xff\xfe"), "F32", {kElems}});
  m.buffers.push_back({std::string("w\xff\xfe"), "F32", kElems * 4, 0x1000, {1}, {{std::string("w\xff\xfe"), {0}, {kElems}, 0, {1}}}});
  auto r = (*bad)->request(MsgType::kRegisterSource, refit::control::to_json(m));
  ASSERT_FALSE(r.is_ok()) << "the frame is refused";
  EXPECT_NE(r.status().message().find("is not valid UTF-8"), std::string::npos) << r.status().message();
  // A receiver asks for a plan, which is where the coordinator used to abort.
  auto rcv = Client::connect("127.0.0.1", port, kToken);
  ASSERT_TRUE(rcv.is_ok()) << rcv.status().message();
  refit::control::RegisterReceiver rr;
  rr.rank = 0;
  rr.worker_address = {4, 5, 6};
  rr.buffers.push_back({"w", "F32", kElems * 4, 0, {}, {{"w", {0}, {kElems}, 0, {1}}}});
  ASSERT_TRUE((*rcv)->request(MsgType::kRegisterReceiver, refit::control::to_json(rr)).is_ok());
  auto plan = (*rcv)->request(MsgType::kFetchPlan, Json{{"rank", 0}});
  EXPECT_TRUE(plan.is_ok()) << plan.status().message();
  // The source process lives and its coordinator serves it: it publishes.
  int status = 0;
  EXPECT_EQ(waitpid(source.pid, &status, WNOHANG), 0) << "the source process died, status " << status;
  write_byte(source.down, 'g');
  EXPECT_EQ(await(source, 20s), 'p') << "the source publishes after the bad frame";
  write_byte(source.down, 'x');
  status = reap(source, 20s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

// Issue: connections that never authenticate counted toward max_connections
// and shut members out. Here refit-coordinator runs with max_connections 16
// and 32 file descriptors; max_connections + 100 connections that never
// authenticate are held open (and opened again as the coordinator drops
// them), which exhausts its descriptors. A source and a receiver still join
// and the receiver refreshes, every element checked, within 30 s.
TEST(Trust, StrangersAndExhaustedDescriptorsDoNotKeepAMemberFromRefreshing) {
  signal(SIGPIPE, SIG_IGN);
  TempDir dir;
  ASSERT_FALSE(dir.path.empty());
  const std::string token = write_token(dir.path);
  const uint16_t port = free_port();
  const std::string log_file = dir.path + "/coordinator.log";
  constexpr int kMaxConnections = 16;
  constexpr rlim_t kDescriptors = 32;
  // Every child is forked before this process starts a thread.
  Child source = fork_child([&](int up, int down) {
    char c;
    if (!read_byte(down, &c)) _exit(2);
    source_child(port, token, false, up, down);
  });
  Child receiver = fork_child([&](int up, int down) {
    char c;
    if (!read_byte(down, &c)) _exit(2);
    receiver_child(port, token, up, down);
  });
  const pid_t coordinator = fork();
  if (coordinator == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int fd = open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
    rlimit lim{kDescriptors, kDescriptors};
    setrlimit(RLIMIT_NOFILE, &lim);
    const std::string listen = "127.0.0.1:" + std::to_string(port);
    const std::string max = std::to_string(kMaxConnections);
    execl(REFIT_COORDINATOR, REFIT_COORDINATOR, "--listen", listen.c_str(), "--token-file", token.c_str(),
          "--max-connections", max.c_str(), "--auth-timeout-ms", "20000", static_cast<char*>(nullptr));
    _exit(127);
  }
  auto log_text = [&] {
    std::ifstream in(log_file);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  auto cleanup = [&] {
    for (const Child* c : {&source, &receiver}) {
      write_byte(c->down, 'x');
      close(c->down);
    }
    kill(coordinator, SIGTERM);
    int st = 0;
    waitpid(coordinator, &st, 0);
    reap(source, 10s);
    reap(receiver, 10s);
  };
  // Wait for it to listen.
  bool listening = false;
  for (int i = 0; i < 500 && !listening; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    listening = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (!listening) std::this_thread::sleep_for(10ms);
  }
  if (!listening) {
    cleanup();
    FAIL() << "refit-coordinator did not listen: " << log_text();
  }
  // The flood: max_connections + 100 connections that say nothing, each
  // opened again once the coordinator has closed it.
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread flood([&] {
    std::vector<int> fds(kMaxConnections + 100, -1);
    while (!stop) {
      for (int& fd : fds) {
        if (fd >= 0) {
          // Closed by the coordinator: the connection is made again.
          pollfd p{fd, POLLIN, 0};
          char b;
          if (poll(&p, 1, 0) == 1 &&
              ((p.revents & (POLLERR | POLLHUP)) != 0 || recv(fd, &b, 1, MSG_DONTWAIT) <= 0)) {
            close(fd);
            fd = -1;
          }
        }
        if (fd < 0) {
          // Non-blocking: a connect the coordinator cannot take yet waits in its backlog, not here.
          fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          a.sin_port = htons(port);
          if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 || errno == EINPROGRESS) ++opened;
        }
      }
      std::this_thread::sleep_for(5ms);
    }
    for (int fd : fds) {
      if (fd >= 0) close(fd);
    }
  });
  // The flood is on once the coordinator closed one of its connections and
  // the flood opened it again. The members join at that moment, when the
  // coordinator drops unauthenticated connections to free descriptors: a
  // member's own connection can be dropped while it authenticates, and the
  // member connects again within its deadline (docs/security.md).
  const auto flooding_by = Clock::now() + 20s;
  while (opened.load() <= kMaxConnections + 100 && Clock::now() < flooding_by) std::this_thread::sleep_for(5ms);
  if (opened.load() <= kMaxConnections + 100) {
    stop = true;
    flood.join();
    cleanup();
    FAIL() << "the coordinator closed none of " << opened.load() << " idle connections within 20 s";
  }
  // The members join and the receiver refreshes, the flood going on.
  const auto t0 = Clock::now();
  write_byte(source.down, 'j');
  write_byte(receiver.down, 'j');
  const char s_ready = await(source, 30s);
  const char r_ready = await(receiver, 30s);
  char published = '\0', refreshed = '\0';
  if (s_ready == 'r' && r_ready == 'r') {
    write_byte(source.down, 'g');
    published = await(source, 30s);
    if (published == 'p') {
      write_byte(receiver.down, 'g');
      refreshed = await(receiver, 30s);
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  flood.join();
  const int flooded = opened.load();
  cleanup();
  const std::string log = log_text();
  EXPECT_EQ(s_ready, 'r') << log;
  EXPECT_EQ(r_ready, 'r') << log;
  EXPECT_EQ(published, 'p');
  EXPECT_EQ(refreshed, 'd') << log;
  EXPECT_LT(secs, 30.0);
  EXPECT_NE(log.find("to free a file descriptor (the process has none left)"), std::string::npos)
      << "the descriptors ran out: " << log.substr(0, 4000);
  std::printf("joined and refreshed in %.2f s while %d connections that never authenticated were opened\n", secs,
              flooded);
}

}  // namespace
