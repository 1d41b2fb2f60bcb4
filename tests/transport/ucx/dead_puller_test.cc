// A target (a process whose memory others GET from) must survive its
// pullers: a puller that is stopped or killed while it has many GETs and
// PUTs in flight over tcp must not take the target down, and the target must
// keep serving the next puller. Three processes: the target (ucx_test_peer),
// the victim puller (ucx_test_puller) and this one, which pulls after the
// victim is gone and checks every byte.
//
// With UCX's own GET emulation over tcp the "target paused" cases aborted
// the target ("ucp_request.inl:346 Fatal: unexpected error: Endpoint
// timeout" from ucp_get_req_handler); am_rma.h explains why and the fix.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include "tests/transport/ucx/peer_process.h"
#include "transport/ucx/get_engine.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Peer;
using testing::pattern_byte;

constexpr uint64_t kTargetBytes = 8ull << 20;

// The target is alive iff waitpid does not reap it; on death says why.
::testing::AssertionResult alive(Peer& p) {
  int status = 0;
  pid_t r = ::waitpid(p.pid, &status, WNOHANG);
  if (r == 0) return ::testing::AssertionSuccess();
  p.pid = -1;
  if (r < 0) return ::testing::AssertionFailure() << "waitpid failed";
  if (WIFSIGNALED(status)) {
    return ::testing::AssertionFailure() << "target died of signal " << WTERMSIG(status);
  }
  return ::testing::AssertionFailure() << "target exited with " << WEXITSTATUS(status);
}

// Pulls the target's whole buffer from this process and checks it.
void pull_and_check(const Peer& target, uint32_t seed) {
  ContextConfig cfg;
  cfg.name = "checker";
  cfg.transports = {"tcp"};
  cfg.devices = {"lo"};
  auto ctx = Context::create(cfg);
  ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
  auto worker = Worker::create(*ctx);
  ASSERT_TRUE(worker.is_ok()) << worker.status().message();
  auto ep = Endpoint::create(*worker, target.address, "target");
  ASSERT_TRUE(ep.is_ok()) << ep.status().message();
  ASSERT_TRUE(ep->import_rkey(1, target.rkey).is_ok());
  std::vector<uint8_t> local(target.bytes, 0);
  auto region = MemoryRegion::map(*ctx, local.data(), local.size());
  ASSERT_TRUE(region.is_ok());
  auto engine = GetEngine::create(*worker, GetEngineOptions{});
  ASSERT_TRUE(engine.is_ok());
  (*engine)->add_local_region(*region);
  GetRun all{&*ep, 1, target.base, local.data(), target.bytes};
  auto report = (*engine)->run_batch({&all, 1}, Clock::now() + std::chrono::seconds(20));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  for (uint64_t i = 0; i < local.size(); ++i) {
    if (local[i] != pattern_byte(seed, i)) FAIL() << "byte " << i << " differs";
  }
}

struct Case {
  const char* name;
  bool stop_first;     // SIGSTOP, let the target run into it, then SIGKILL
  int stopped_ms;
  bool pause_target;   // the target is stopped while the puller dies, so
                       // that it finds GET requests of a dead puller queued
};

// gtest would print the struct's padding bytes (valgrind flags that).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class DeadPuller : public ::testing::TestWithParam<Case> {};

TEST_P(DeadPuller, TargetSurvivesAndServesTheNextPuller) {
  const Case& c = GetParam();
  Peer target;
  if (!testing::start_peer(&target, "tcp", 41, kTargetBytes) || !testing::handshake(&target)) {
    testing::stop_peer(&target);
    GTEST_SKIP() << "tcp unavailable: " << target.error;
  }
  for (int round = 0; round < 3; ++round) {
    Peer victim;
    ASSERT_TRUE(testing::start_puller(&victim, "tcp", 41, target)) << victim.error;
    uint8_t b = 0;
    ASSERT_TRUE(testing::read_all(victim.fd, &b, 1, Clock::now() + std::chrono::seconds(20)));
    if (b != 'P') {
      std::vector<uint8_t> e;
      testing::recv_blob(victim.fd, &e, Clock::now() + std::chrono::seconds(1));
      FAIL() << "victim puller failed: " << std::string(e.begin(), e.end());
    }
    // It is now pulling with up to 256 GETs in flight.
    if (c.stop_first) {
      ::kill(victim.pid, SIGSTOP);
      ::usleep(c.stopped_ms * 1000);
      ASSERT_TRUE(alive(target)) << "while the puller was stopped";
    }
    if (c.pause_target) {
      ::kill(target.pid, SIGSTOP);
      ::usleep(50 * 1000);  // lets GET requests pile up in the target's socket
    }
    ::kill(victim.pid, SIGKILL);
    ::waitpid(victim.pid, nullptr, 0);
    ::close(victim.fd);
    if (c.pause_target) ::kill(target.pid, SIGCONT);
    // Give the target time to notice the dead connection and fail its
    // replies.
    ::usleep(300 * 1000);
    ASSERT_TRUE(alive(target)) << "after the puller was killed (round " << round << ")";
    pull_and_check(target, 41);
    ASSERT_TRUE(alive(target));
  }
  testing::stop_peer(&target);
}

INSTANTIATE_TEST_SUITE_P(
    Tcp, DeadPuller,
    ::testing::Values(Case{"killed", false, 0, false},
                      Case{"stopped_then_killed", true, 1500, false},
                      Case{"killed_while_target_paused", false, 0, true},
                      Case{"stopped_then_killed_while_target_paused", true, 1500, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace refit::ucx
