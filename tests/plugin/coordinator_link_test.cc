// The agents' coordinator link on its own: a member the coordinator declares
// dead while its process lives (its heartbeats come later than the
// coordinator's timeout) shows as dropped(), whichever request hears it
// first, and registering it again clears that.

#include "plugin/coordinator_link.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include "plugin/config.h"
#include "plugin/log.h"
#include "tests/common/frame_relay.h"

namespace refit::plugin {
namespace {

using Clock = std::chrono::steady_clock;

TEST(CoordinatorLink, AMemberDeclaredDeadWhileAliveIsDroppedUntilItRegistersAgain) {
  char dir[] = "/tmp/refit-link-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string token_file = std::string(dir) + "/token";
  const std::string token = "0123456789abcdef0123456789abcdef";
  std::ofstream(token_file) << token;
  ::chmod(token_file.c_str(), 0600);  // a token others may read is refused
  control::CoordinatorConfig cc;
  cc.token = token;
  cc.log = [](const std::string&) {};
  cc.heartbeat_timeout = std::chrono::milliseconds(300);  // shorter than the member's heartbeat
  auto coordinator = control::Coordinator::start(cc);
  ASSERT_TRUE(coordinator.is_ok()) << coordinator.status().message();
  const std::string config_json = R"({"rank": 0, "heartbeat_ms": 1000, "log_level": "error",
      "coordinator": {"address": "127.0.0.1:)" + std::to_string((*coordinator)->port()) +
                                  R"(", "token_file": ")" + token_file + R"("}})";
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const Log log("receiver", 0, config->log_level);
  Result<std::unique_ptr<CoordinatorLink>> link = CoordinatorLink::connect(*config, log);
  ASSERT_TRUE(link.is_ok()) << link.status().message();

  control::RegisterReceiver m;
  m.rank = 0;
  m.worker_address = {1, 2, 3};
  auto register_member = [&] {
    Result<control::Json> r = (*link)->request(control::MsgType::kRegisterReceiver, control::to_json(m));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    (*link)->start_heartbeat(control::MemberRef{control::Role::kReceiver, 0});
  };
  register_member();
  EXPECT_FALSE((*link)->dropped());
  // Declared dead after 300 ms without a heartbeat; the first heartbeat, at
  // 1 s, hears that it is not registered.
  const Clock::time_point until = Clock::now() + std::chrono::seconds(5);
  while (!(*link)->dropped() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE((*link)->dropped());
  // The coordinator holds nothing of it: registering again is accepted, and
  // the link no longer says dropped.
  register_member();
  EXPECT_FALSE((*link)->dropped());
  // Without its heartbeat (as when a partition held the heartbeat's own
  // request), another request is the first to hear that the member was
  // declared dead: its reason says so, and the link says dropped() too.
  (*link)->stop_heartbeat();
  Status heard;
  const Clock::time_point again = Clock::now() + std::chrono::seconds(5);
  while (heard.reason() != Reason::kNotRegistered && Clock::now() < again) {
    heard = (*link)->request(control::MsgType::kLease, control::Json{{"rank", 0}, {"version", 1}}).status();
    if (heard.reason() != Reason::kNotRegistered) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(heard.reason(), Reason::kNotRegistered) << heard.message();
  EXPECT_EQ(heard.code(), Code::kNotFound) << heard.message();
  EXPECT_TRUE((*link)->dropped());
  link->reset();
  std::remove(token_file.c_str());
  rmdir(dir);
}

// A coordinator in this process and the link to it through a FrameRelay
// (tests/common/frame_relay.h), over loopback TCP.
class LinkThroughRelay : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/refit-link-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    token_file_ = dir_ + "/token";
    std::ofstream(token_file_) << kToken;
    ::chmod(token_file_.c_str(), 0600);
  }
  void TearDown() override {
    link_.reset();
    relay_.reset();
    if (coordinator_) coordinator_->stop();
    if (HasFailure()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& l : logs_) std::fprintf(stderr, "coordinator: %s\n", l.c_str());
    }
    std::remove(token_file_.c_str());
    rmdir(dir_.c_str());
  }
  void start(control::CoordinatorConfig cc, testing::FrameRelay::Hook hook, int timeout_ms,
             const ThreadFactory& threads = {}) {
    cc.token = kToken;
    cc.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      logs_.push_back(line);
    };
    auto co = control::Coordinator::start(cc);
    ASSERT_TRUE(co.is_ok()) << co.status().message();
    coordinator_ = std::move(co).value();
    relay_ = std::make_unique<testing::FrameRelay>(coordinator_->port(), std::move(hook));
    ASSERT_NE(relay_->port(), 0);
    const std::string config_json = R"({"rank": 0, "heartbeat_ms": 100, "log_level": "error",
        "coordinator": {"address": "127.0.0.1:)" + std::to_string(relay_->port()) +
                                    R"(", "token_file": ")" + token_file_ + R"(", "timeout_ms": )" +
                                    std::to_string(timeout_ms) + "}}";
    Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
    ASSERT_TRUE(config.is_ok()) << config.status().message();
    log_ = std::make_unique<Log>("receiver", 0, config->log_level);
    auto link = CoordinatorLink::connect(*config, *log_, threads);
    ASSERT_TRUE(link.is_ok()) << link.status().message();
    link_ = std::move(link).value();
  }
  Result<control::Json> register_receiver() {
    control::RegisterReceiver m;
    m.rank = 0;
    m.worker_address = {1, 2, 3};
    return link_->request(control::MsgType::kRegisterReceiver, control::to_json(m));
  }
  std::string wait_log(const std::string& part, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    const auto until = Clock::now() + timeout;
    do {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& l : logs_) {
          if (l.find(part) != std::string::npos) return l;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } while (Clock::now() < until);
    return "";
  }
  size_t receivers() {
    auto st = coordinator_->stats();
    return st.is_ok() ? st->receivers : 999;
  }

  static constexpr const char* kToken = "0123456789abcdef0123456789abcdef";
  std::string dir_, token_file_;
  std::unique_ptr<control::Coordinator> coordinator_;
  std::unique_ptr<testing::FrameRelay> relay_;
  std::unique_ptr<Log> log_;
  std::unique_ptr<CoordinatorLink> link_;
  std::mutex mu_;
  std::vector<std::string> logs_;
};

using Direction = testing::FrameRelay::Direction;
using Frames = std::vector<std::vector<uint8_t>>;

// Issue: after one timeout, every later reply was read by the wrong request.
// The relay holds the coordinator's replies back past the link's deadline;
// the reply that comes late is dropped, and the next request reads its own.
TEST_F(LinkThroughRelay, AReplyThatComesAfterItsRequestTimedOutIsNotReadByTheNext) {
  std::atomic<bool> hold{false};
  std::atomic<int> to_client{0};  // replies the relay passed on
  start({}, [&](Direction d, size_t, std::vector<uint8_t> frame) {
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (d == Direction::kToClient && hold.load() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (d == Direction::kToClient) ++to_client;
    return Frames{std::move(frame)};
  }, /*timeout_ms=*/400);
  ASSERT_TRUE(register_receiver().is_ok());
  hold = true;
  const int replies_before = to_client.load();
  auto late = link_->request(control::MsgType::kSubscribe, control::Json::object());
  ASSERT_FALSE(late.is_ok());
  EXPECT_EQ(late.status().code(), Code::kTimeout) << late.status().message();
  hold = false;  // the subscribe reply ({ok, version}) now arrives, late
  const auto let_go_by = Clock::now() + std::chrono::seconds(5);
  while (to_client.load() == replies_before && Clock::now() < let_go_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_GT(to_client.load(), replies_before) << "the relay never passed the late reply on";
  auto beat = link_->request(control::MsgType::kHeartbeat, control::Json{{"role", "receiver"}, {"rank", 0}});
  ASSERT_TRUE(beat.is_ok()) << beat.status().message();
  EXPECT_FALSE(beat->contains("version")) << "the heartbeat read the late subscribe reply: " << beat->dump();
  EXPECT_EQ(link_->connections(), 1u) << "a timeout does not cost the connection";
}

// The network drops the connection: the next call makes it again within its
// deadline, registers the member again, and is served.
TEST_F(LinkThroughRelay, ABrokenConnectionIsMadeAgainAndTheMemberRegisteredWithinTheDeadline) {
  control::CoordinatorConfig cc;
  // 20 heartbeats long, so that a loaded machine does not expire the
  // member on its new connection.
  cc.heartbeat_timeout = std::chrono::milliseconds(2000);
  std::atomic<size_t> to_coordinator{0};  // frames passed to the coordinator
  start(cc, [&](Direction d, size_t, std::vector<uint8_t> frame) {
    if (d == Direction::kToCoordinator) ++to_coordinator;
    return Frames{std::move(frame)};
  }, /*timeout_ms=*/5000);
  ASSERT_TRUE(register_receiver().is_ok());
  const size_t registered = to_coordinator.load();
  link_->start_heartbeat(control::MemberRef{control::Role::kReceiver, 0});
  // The cut comes after a heartbeat went through on the first connection.
  const auto beat_by = Clock::now() + std::chrono::seconds(5);
  while (to_coordinator.load() == registered && Clock::now() < beat_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GT(to_coordinator.load(), registered) << "no heartbeat reached the coordinator";
  relay_->cut_all();
  const auto t0 = Clock::now();
  auto r = link_->request(control::MsgType::kSubscribe, control::Json::object());
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  // The coordinator saw the old connection close: the same registration
  // takes the member over at once, not after the old member's heartbeat
  // timeout (2 s from its last heartbeat).
  EXPECT_LT(took.count(), 1500);
  EXPECT_EQ(link_->connections(), 2u);
  EXPECT_EQ(relay_->connections(), 2u);
  EXPECT_EQ(receivers(), 1u) << "registered again on the new connection";
  // Heartbeats go on over the new connection: the member stays, at every
  // look, for longer than the coordinator's heartbeat timeout.
  for (const auto until = Clock::now() + std::chrono::milliseconds(3000); Clock::now() < until;) {
    ASSERT_EQ(receivers(), 1u) << "the member expired on its new connection";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(link_->dropped());
  std::printf("reconnected and registered again in %lld ms\n", static_cast<long long>(took.count()));
  link_->stop_heartbeat();
}

// The coordinator's replies reach the link 2.5 s late (the relay holds
// them, as a plan part of megabytes sent first holds up the replies queued
// behind it), 2.5 times the heartbeat timeout, while the coordinator reads
// what the link sends at once. The link does not wait for a heartbeat's
// reply to send the next: the member lives throughout.
TEST_F(LinkThroughRelay, HeartbeatsGoOnWhileTheirRepliesAreHeldUp) {
  control::CoordinatorConfig cc;
  cc.heartbeat_timeout = std::chrono::milliseconds(1000);  // 10 heartbeats long
  std::atomic<bool> hold{false};
  std::atomic<size_t> to_coordinator{0};  // frames passed to the coordinator
  start(cc, [&](Direction d, size_t, std::vector<uint8_t> frame) {
    if (d == Direction::kToCoordinator) ++to_coordinator;
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (d == Direction::kToClient && hold.load() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return Frames{std::move(frame)};
  }, /*timeout_ms=*/5000);
  ASSERT_TRUE(register_receiver().is_ok());
  link_->start_heartbeat(control::MemberRef{control::Role::kReceiver, 0});
  const size_t registered = to_coordinator.load();
  const auto beat_by = Clock::now() + std::chrono::seconds(5);
  while (to_coordinator.load() == registered && Clock::now() < beat_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GT(to_coordinator.load(), registered) << "no heartbeat reached the coordinator";
  hold = true;
  const size_t held_from = to_coordinator.load();
  for (const auto until = Clock::now() + std::chrono::milliseconds(2500); Clock::now() < until;) {
    ASSERT_EQ(receivers(), 1u) << "the member was declared dead while its heartbeats' replies were held up";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GE(to_coordinator.load() - held_from, 10u) << "heartbeats stopped while their replies were held up";
  hold = false;
  // The held replies arrive; heartbeats and their replies go on as before.
  for (const auto until = Clock::now() + std::chrono::milliseconds(1500); Clock::now() < until;) {
    ASSERT_EQ(receivers(), 1u);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(link_->dropped());
  EXPECT_EQ(link_->connections(), 1u);
  EXPECT_EQ(wait_log("declared dead", std::chrono::milliseconds(0)), "");
  link_->stop_heartbeat();
}

// The connection breaks and the system refuses the new connection's reader
// thread: the call that reconnects fails, saying so, and so does the next;
// the process lives on.
TEST_F(LinkThroughRelay, AReaderThatCannotStartOnReconnectFailsTheCallsNotTheProcess) {
  start({}, [](Direction, size_t, std::vector<uint8_t> frame) { return Frames{std::move(frame)}; },
        /*timeout_ms=*/3000, ThreadFactory::refusing_after(1));  // the first connection's reader only
  ASSERT_TRUE(register_receiver().is_ok());
  relay_->cut_all();
  for (int i = 0; i < 2; ++i) {
    auto r = link_->request(control::MsgType::kSubscribe, control::Json::object());
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().reason(), Reason::kNoThread) << r.status().message();
    EXPECT_NE(r.status().message().find("cannot start the coordinator link reader thread"), std::string::npos)
        << r.status().message();
  }
  EXPECT_EQ(link_->connections(), 1u);
}

// One bit of the registration flipped on the path after authentication: the
// coordinator closes the connection with a log line and registers nothing.
TEST_F(LinkThroughRelay, AFlippedBitClosesTheConnectionAndNothingIsApplied) {
  std::atomic<bool> flip{true};
  start({}, [&](Direction d, size_t index, std::vector<uint8_t> frame) {
    // Frame 1 to the coordinator: the first after the handshake (register_receiver).
    if (d == Direction::kToCoordinator && index == 1 && flip.exchange(false)) frame[frame.size() - 33] ^= 0x01;
    return Frames{std::move(frame)};
  }, /*timeout_ms=*/3000);
  auto r = register_receiver();
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("fails its seal"), std::string::npos) << r.status().message();
  EXPECT_NE(wait_log("frame: register_receiver (frame 0 after authentication) fails its seal"), "");
  EXPECT_EQ(receivers(), 0u) << "nothing of the altered frame is applied";
  // The path is clean again: the link connects anew and is served.
  ASSERT_TRUE(register_receiver().is_ok());
  EXPECT_EQ(receivers(), 1u);
  EXPECT_EQ(link_->connections(), 2u);
}

// A frame sent twice on the path (a replay of a heartbeat): the copy fails
// its seal; the connection is closed and logged.
TEST_F(LinkThroughRelay, AReplayedFrameIsRefused) {
  start({}, [&](Direction d, size_t index, std::vector<uint8_t> frame) {
    if (d == Direction::kToCoordinator && index == 2) return Frames{frame, frame};
    return Frames{std::move(frame)};
  }, /*timeout_ms=*/3000);
  ASSERT_TRUE(register_receiver().is_ok());
  (void)link_->request(control::MsgType::kHeartbeat, control::Json{{"role", "receiver"}, {"rank", 0}});
  EXPECT_NE(wait_log("heartbeat (frame 2 after authentication) fails its seal"), "");
  uint64_t refused = 0;
  for (const auto until = Clock::now() + std::chrono::seconds(5); refused == 0 && Clock::now() < until;) {
    auto st = coordinator_->stats();
    ASSERT_TRUE(st.is_ok());
    refused = st->refused;
    if (refused == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(refused, 1u);
}

// `token` in dir/token, readable by its owner only (a token others may
// read is refused); its path.
std::string write_token(const std::string& dir, const std::string& token) {
  const std::string file = dir + "/token";
  std::ofstream(file) << token;
  ::chmod(file.c_str(), 0600);
  return file;
}

// The network between the link and the coordinator drops everything for
// 7 s (nft in a network namespace of its own), longer than the member's
// heartbeat timeout, then comes back. TCP alone would send the bytes
// queued meanwhile only at its next backed-off retransmission, about 12.6 s
// after the first was lost, so a call right after the network is back
// would wait 5 s and more. The link sees that its connection stopped moving
// bytes, makes a new one, registers the member again (the coordinator
// declared it dead meanwhile) and serves the call within its 3 s.
//
// The scenario runs in a child process, alone in its namespace; it reports
// on a pipe, read with a deadline.
std::string run_partition(const std::string& dir) {
  if (::unshare(CLONE_NEWNET) != 0) return std::string("skip: unshare(CLONE_NEWNET): ") + std::strerror(errno);
  if (std::system("ip link set lo up >/dev/null 2>&1") != 0) return "skip: cannot bring up lo (iproute2)";
  if (std::system("nft list tables >/dev/null 2>&1") != 0) return "skip: no nft";
  const std::string token = "0123456789abcdef0123456789abcdef";
  const std::string token_file = write_token(dir, token);
  control::CoordinatorConfig cc;
  cc.token = token;
  cc.log = [](const std::string&) {};
  cc.heartbeat_timeout = std::chrono::milliseconds(1000);
  auto coordinator = control::Coordinator::start(cc);
  if (!coordinator.is_ok()) return "fail: " + coordinator.status().message();
  const std::string port = std::to_string((*coordinator)->port());
  const std::string config_json = R"({"rank": 0, "heartbeat_ms": 200, "log_level": "error",
      "coordinator": {"address": "127.0.0.1:)" + port + R"(", "token_file": ")" + token_file +
                                  R"(", "timeout_ms": 3000}})";
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  if (!config.is_ok()) return "fail: " + config.status().message();
  const Log log("receiver", 0, config->log_level);
  auto link = CoordinatorLink::connect(*config, log);
  if (!link.is_ok()) return "fail: " + link.status().message();
  control::RegisterReceiver m;
  m.rank = 0;
  m.worker_address = {1, 2, 3};
  if (auto r = (*link)->request(control::MsgType::kRegisterReceiver, control::to_json(m)); !r.is_ok()) {
    return "fail: register: " + r.status().message();
  }
  (*link)->start_heartbeat(control::MemberRef{control::Role::kReceiver, 0});
  if (auto r = (*link)->request(control::MsgType::kSubscribe, control::Json::object()); !r.is_ok()) {
    return "fail: subscribe: " + r.status().message();
  }
  const std::string cut = "nft add table inet cut && nft add chain inet cut in '{ type filter hook input priority 0; }' "
                          "&& nft add rule inet cut in tcp dport " + port + " drop && nft add rule inet cut in tcp sport " +
                          port + " drop";
  if (std::system(cut.c_str()) != 0) return "skip: nft cannot add a rule";
  // The partition's length: what the test is about, not a wait for anyone.
  std::this_thread::sleep_for(std::chrono::seconds(7));
  const size_t during = (*coordinator)->stats().is_ok() ? (*coordinator)->stats()->receivers : 99;
  if (std::system("nft delete table inet cut") != 0) return "fail: nft cannot remove the rule";
  const auto t0 = Clock::now();
  auto r = (*link)->request(control::MsgType::kFetchPlan, control::Json{{"rank", 0}});
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  const size_t after = (*coordinator)->stats().is_ok() ? (*coordinator)->stats()->receivers : 99;
  (*link)->stop_heartbeat();
  std::string out = "took " + std::to_string(took) + " ms, connections " + std::to_string((*link)->connections()) +
                    ", receivers during " + std::to_string(during) + " after " + std::to_string(after);
  // fetch_plan's answer for a lone receiver may be a refusal (nothing to
  // plan); any reply from the coordinator is the link working. A timeout
  // or a broken connection is not.
  if (!r.is_ok() && (r.status().code() == Code::kTimeout || r.status().code() == Code::kIoError)) {
    return "fail: " + out + ": " + r.status().message();
  }
  if (during != 0) return "fail: " + out + ": the member was not declared dead during the partition";
  if (after != 1) return "fail: " + out + ": the member is not registered again";
  if ((*link)->connections() < 2) return "fail: " + out + ": no new connection";
  return "ok: " + out;
}

// The child's one line, read with a deadline of `seconds`.
std::string in_a_child(const std::function<std::string(const std::string&)>& body, int seconds) {
  char dir[] = "/tmp/refit-link-XXXXXX";
  if (mkdtemp(dir) == nullptr) return "fail: mkdtemp";
  int fds[2];
  if (::pipe(fds) != 0) return "fail: pipe";
  const pid_t pid = ::fork();
  if (pid < 0) return "fail: fork";
  if (pid == 0) {
    ::close(fds[0]);
    const std::string line = body(dir) + "\n";
    (void)!::write(fds[1], line.data(), line.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string line;
  const auto until = Clock::now() + std::chrono::seconds(seconds);
  for (char buf[512]; line.find('\n') == std::string::npos;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    pollfd p{fds[0], POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    line.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (line.find('\n') == std::string::npos) ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::remove((std::string(dir) + "/token").c_str());
  ::rmdir(dir);
  if (line.empty()) return "fail: no word from the child in " + std::to_string(seconds) + " s";
  return line;
}

// The scenario `body` as root in a child (in_a_child): its "ok: " passes,
// its "skip: " skips.
#define EXPECT_OK_FROM_CHILD(body, seconds)                                                          \
  do {                                                                                                \
    if (::geteuid() != 0) GTEST_SKIP() << "needs root: a network namespace of its own, and nft";      \
    const std::string line = in_a_child(body, seconds);                                               \
    std::printf("%s", line.c_str());                                                                  \
    if (line.rfind("skip: ", 0) == 0) GTEST_SKIP() << line.substr(6);                                 \
    EXPECT_EQ(line.rfind("ok: ", 0), 0u) << line;                                                     \
  } while (0)

TEST(LinkAcrossAPartition, ACallAfterThePartitionHealsReconnectsAndRegistersAgainWithinItsDeadline) {
  EXPECT_OK_FROM_CHILD(run_partition, 40);
}

// Right after a link comes back, the kernel may still answer a connect()
// with "No route to host" for a moment (the neighbour entry of the peer is
// still marked failed). That is not an answer from the coordinator: the
// link tries again until its deadline. Here the route answers so (an nft
// rule that rejects the SYN with ICMP host-unreachable, toward a veth
// address in a network namespace of its own) for the first 600 ms of the
// link's 3 s to connect; it connects once the rule is gone. Before, it
// failed at once with the kernel's error.
std::string run_no_route(const std::string& dir) {
  if (::unshare(CLONE_NEWNET) != 0) return std::string("skip: unshare(CLONE_NEWNET): ") + std::strerror(errno);
  if (std::system("ip link set lo up >/dev/null 2>&1 && ip link add va type veth peer name vb && "
                  "ip addr add 10.99.0.1/24 dev va && ip link set va up && ip link set vb up") != 0) {
    return "skip: cannot make a veth pair (iproute2)";
  }
  if (std::system("nft list tables >/dev/null 2>&1") != 0) return "skip: no nft";
  const std::string token = "0123456789abcdef0123456789abcdef";
  const std::string token_file = write_token(dir, token);
  control::CoordinatorConfig cc;
  cc.host = "10.99.0.1";
  cc.token = token;
  cc.log = [](const std::string&) {};
  auto coordinator = control::Coordinator::start(cc);
  if (!coordinator.is_ok()) return "fail: " + coordinator.status().message();
  const std::string port = std::to_string((*coordinator)->port());
  const std::string reject = "nft add table inet cut && nft add chain inet cut out '{ type filter hook output "
                             "priority 0; }' && nft add rule inet cut out ip daddr 10.99.0.1 tcp dport " + port +
                             " reject with icmp type host-unreachable";
  if (std::system(reject.c_str()) != 0) return "skip: nft cannot add a reject rule";
  const std::string config_json = R"({"rank": 0, "heartbeat_ms": 200, "log_level": "error",
      "coordinator": {"address": "10.99.0.1:)" + port + R"(", "token_file": ")" + token_file +
                                  R"(", "timeout_ms": 3000}})";
  Result<AgentConfig> config = parse_agent_config(config_json, /*receiver=*/true);
  if (!config.is_ok()) return "fail: " + config.status().message();
  const Log log("receiver", 0, config->log_level);
  std::atomic<bool> removed{false};
  const auto t0 = Clock::now();
  std::thread heal([&removed] {
    // The no-route window's length: what the test is about, not a wait for
    // anyone (the link's connect is measured against it).
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    removed = std::system("nft delete table inet cut") == 0;
  });
  // The link connects at once, within the coordinator timeout (3 s).
  auto link = CoordinatorLink::connect(*config, log);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  heal.join();
  if (!removed) return "fail: nft cannot remove the rule";
  const std::string out = "connected after " + std::to_string(took) + " ms";
  if (!link.is_ok()) return "fail: " + out + ": " + link.status().message();
  if (took < 500) return "fail: " + out + ": while the route still refused it";
  control::RegisterReceiver m;
  m.rank = 0;
  m.worker_address = {1, 2, 3};
  if (auto r = (*link)->request(control::MsgType::kRegisterReceiver, control::to_json(m)); !r.is_ok()) {
    return "fail: " + out + ": register: " + r.status().message();
  }
  return "ok: " + out;
}

TEST(LinkAcrossAPartition, NoRouteToTheCoordinatorIsTriedAgainUntilTheDeadline) {
  EXPECT_OK_FROM_CHILD(run_no_route, 20);
}

// The embedded coordinator's relayout knobs (docs/refresh.md, "Column-major
// receivers"): read with "embedded", refused without it or out of range.
TEST(AgentConfigRelayout, EmbeddedCoordinatorTakesTheKnobs) {
  auto config = [](const std::string& coordinator) {
    return parse_agent_config(R"({"rank": 0, "coordinator": {"address": "127.0.0.1:0", "token_file": "t", )" +
                                  coordinator + "}}",
                              /*receiver=*/true);
  };
  Result<AgentConfig> c = config(R"("embedded": true, "relayout_below_bytes": 4096)");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->coordinator.relayout_below_bytes, 4096);
  EXPECT_EQ(c->coordinator.relayout_staging_bytes, int64_t{1} << 30);
  c = config(R"("embedded": true)");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->coordinator.relayout_below_bytes, 0);
  c = parse_agent_config(R"({"rank": 0, "coordinator": {"address": "127.0.0.1:5000", "token_file": "t",
                             "relayout_below_bytes": 4096}})",
                         /*receiver=*/true);
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("coordinator.embedded"), std::string::npos) << c.status().message();
  c = config(R"("embedded": true, "relayout_below_bytes": -1)");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("relayout_below_bytes"), std::string::npos) << c.status().message();
}

}  // namespace
}  // namespace refit::plugin
