// ActiveMessages across real processes, over tcp and shared memory: the
// peer (ucx_test_peer) serves an echo id and a failing id; this process
// sends requests. Responses land byte-exact; a handler's error, an unserved
// id, a stopped peer (deadline) and a killed peer each give an error that
// names the endpoint and the id.

#include "transport/ucx/active_message.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <random>

#include "tests/transport/ucx/peer_process.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Peer;

bool contains(const Status& s, const std::string& needle) {
  return s.message().find(needle) != std::string::npos;
}

class ActiveMessagesMultiProcess : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const std::string transport = GetParam();
    if (!testing::start_peer(&peer_, transport, 3, 4096) || !testing::handshake(&peer_)) {
      GTEST_SKIP() << "transport " << transport << " unavailable: " << peer_.error;
    }
    ContextConfig cfg;
    cfg.name = "requester";
    cfg.transports = {transport};
    if (transport == "tcp") cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
    ctx_.emplace(std::move(*ctx));
    auto worker = Worker::create(*ctx_);
    ASSERT_TRUE(worker.is_ok()) << worker.status().message();
    worker_.emplace(std::move(*worker));
    auto ep = Endpoint::create(*worker_, peer_.address, "am-peer");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ep_.emplace(std::move(*ep));
    auto am = ActiveMessages::create(*worker_);
    ASSERT_TRUE(am.is_ok()) << am.status().message();
    am_ = std::move(*am);
  }
  void TearDown() override {
    am_.reset();
    ep_.reset();
    worker_.reset();
    ctx_.reset();
    testing::stop_peer(&peer_);
  }
  Result<std::vector<uint8_t>> ask(unsigned id, const std::vector<uint8_t>& bytes,
                                   std::chrono::milliseconds within = std::chrono::seconds(10)) {
    return am_->request(*ep_, id, bytes, Clock::now() + within);
  }

  Peer peer_;
  std::optional<Context> ctx_;
  std::optional<Worker> worker_;
  std::optional<Endpoint> ep_;
  std::unique_ptr<ActiveMessages> am_;
};

TEST_P(ActiveMessagesMultiProcess, ResponsesLandByteExact) {
  std::mt19937 rng(5);
  for (size_t n : {size_t{0}, size_t{1}, size_t{100}, size_t{8191}, size_t{100000},
                   size_t{1} << 20}) {
    std::vector<uint8_t> req(n);
    for (auto& b : req) b = static_cast<uint8_t>(rng());
    auto resp = ask(testing::kEchoId, req);
    ASSERT_TRUE(resp.is_ok()) << n << " bytes: " << resp.status().message();
    std::vector<uint8_t> want = {'e', 'c', 'h', 'o', ':'};
    want.insert(want.end(), req.rbegin(), req.rend());
    EXPECT_EQ(*resp, want) << n << " bytes";
  }
  for (int i = 0; i < 200; ++i) {  // many in a row: tokens do not mix up
    std::vector<uint8_t> req = {static_cast<uint8_t>(i), static_cast<uint8_t>(i >> 8)};
    auto resp = ask(testing::kEchoId, req);
    ASSERT_TRUE(resp.is_ok()) << resp.status().message();
    ASSERT_EQ(resp->size(), 7u);
    EXPECT_EQ((*resp)[5], req[1]);
    EXPECT_EQ((*resp)[6], req[0]);
  }
}

TEST_P(ActiveMessagesMultiProcess, HandlerErrorTravelsBack) {
  auto resp = ask(testing::kFailId, std::vector<uint8_t>(42));
  ASSERT_FALSE(resp.is_ok());
  EXPECT_TRUE(contains(resp.status(), "test handler refuses 42 bytes")) << resp.status().message();
  EXPECT_TRUE(contains(resp.status(), "am-peer")) << resp.status().message();
  // The connection stays usable.
  EXPECT_TRUE(ask(testing::kEchoId, {1, 2}).is_ok());
}

TEST_P(ActiveMessagesMultiProcess, UnservedIdIsRefusedNotCrashed) {
  const unsigned id = ActiveMessages::kFirstRequestId + 9;
  auto resp = ask(id, {1, 2, 3});
  ASSERT_FALSE(resp.is_ok());
  EXPECT_TRUE(contains(resp.status(), "no handler for AM id " + std::to_string(id)))
      << resp.status().message();
  EXPECT_TRUE(ask(testing::kEchoId, {1}).is_ok()) << "the peer must still be alive";
  // Ids outside the range are refused locally.
  EXPECT_FALSE(am_->serve(5, [](std::span<const uint8_t>) {
                 return Result<std::vector<uint8_t>>(std::vector<uint8_t>{});
               }).is_ok());
  EXPECT_FALSE(ask(5, {1}).is_ok());
}

TEST_P(ActiveMessagesMultiProcess, StoppedPeerHitsDeadlineThenRecovers) {
  ASSERT_TRUE(ask(testing::kEchoId, {1}).is_ok());
  ::kill(peer_.pid, SIGSTOP);
  const auto start = Clock::now();
  auto resp = ask(testing::kEchoId, {7, 7}, std::chrono::milliseconds(300));
  const auto took = Clock::now() - start;
  ::kill(peer_.pid, SIGCONT);
  ASSERT_FALSE(resp.is_ok());
  EXPECT_TRUE(contains(resp.status(), "deadline")) << resp.status().message();
  EXPECT_TRUE(contains(resp.status(), "am-peer")) << resp.status().message();
  EXPECT_LT(took, std::chrono::milliseconds(1000));
  // The late response to the first request is dropped, not mistaken for
  // this one's.
  auto again = ask(testing::kEchoId, {9});
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(*again, (std::vector<uint8_t>{'e', 'c', 'h', 'o', ':', 9}));
}

TEST_P(ActiveMessagesMultiProcess, KilledPeerIsAnErrorBeforeTheDeadline) {
  ASSERT_TRUE(ask(testing::kEchoId, {1}).is_ok());
  ::kill(peer_.pid, SIGKILL);
  ::waitpid(peer_.pid, nullptr, 0);
  peer_.pid = -1;
  const auto start = Clock::now();
  auto resp = ask(testing::kEchoId, {2}, std::chrono::seconds(20));
  const auto took = Clock::now() - start;
  ASSERT_FALSE(resp.is_ok());
  EXPECT_TRUE(contains(resp.status(), "am-peer")) << resp.status().message();
  EXPECT_LT(took, std::chrono::seconds(10)) << resp.status().message();
  std::cout << "[ info ] killed peer: " << resp.status().message() << " after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms\n";
}

INSTANTIATE_TEST_SUITE_P(Transports, ActiveMessagesMultiProcess, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param);
                         });

}  // namespace
}  // namespace refit::ucx
