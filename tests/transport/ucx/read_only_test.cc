// A source accepts no writes (docs/security.md, "Data plane"). The peer
// process serves its buffer as SourceAgent serves a shard (peer_main.cc,
// "source": a serve-only context, memory mapped remote-read-only, an
// AmRmaServer that refuses PUTs); the SourceAgent itself also needs a
// coordinator, which the data plane does not, so the peer stands in for it
// with the same three settings. This process is the stranger: it holds the
// peer's worker address and rkey, as anyone who reads a plan does, and
// tries to write with refit's active messages and with UCX's own PUT.
// A peer served the ordinary way (read-write) is the control: the same
// PUTs land there, which is what a source allowed before.

#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <optional>

#include "tests/transport/ucx/peer_process.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/remote_key.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;
using testing::Peer;
using testing::pattern_byte;

constexpr uint64_t kPeerBytes = 1 << 20;
constexpr uint32_t kSeed = 41;

TEST(ReadOnlyMemory, SourceMappingFlags) {
  ContextConfig cfg;
  cfg.name = "flags";
  cfg.transports = {"tcp"};
  cfg.devices = {"lo"};
  cfg.serves_only = true;
  auto ctx = Context::create(cfg);
  if (!ctx) GTEST_SKIP() << "no tcp on lo: " << ctx.status().message();
  std::vector<uint8_t> shard(4096, 7);
  auto ro = MemoryRegion::map(*ctx, shard.data(), shard.size(), "shard", Access::kRemoteRead);
  ASSERT_TRUE(ro.is_ok()) << ro.status().message();
  EXPECT_EQ(ro->access(), Access::kRemoteRead);
  EXPECT_EQ(protection_names(ro->protection()), "LOCAL_READ|LOCAL_WRITE|REMOTE_READ");
  EXPECT_EQ(ro->protection(), unsigned{UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE |
                                       UCP_MEM_MAP_PROT_REMOTE_READ});
  std::cout << "source shard mapped with " << protection_names(ro->protection()) << "\n";
  std::vector<uint8_t> landing(4096);
  auto rw = MemoryRegion::map(*ctx, landing.data(), landing.size(), "landing");
  ASSERT_TRUE(rw.is_ok()) << rw.status().message();
  EXPECT_EQ(protection_names(rw->protection()), "LOCAL_READ|LOCAL_WRITE|REMOTE_READ|REMOTE_WRITE");
}

class StrangerPut : public ::testing::TestWithParam<bool> {
 protected:
  bool as_source() const { return GetParam(); }

  void SetUp() override {
    if (!testing::start_peer(&peer_, "tcp", kSeed, kPeerBytes, false, as_source())) {
      GTEST_SKIP() << "cannot start peer: " << peer_.error;
    }
    if (!testing::handshake(&peer_)) GTEST_SKIP() << "tcp unavailable in peer: " << peer_.error;
    ContextConfig cfg;
    cfg.name = "stranger";
    cfg.transports = {"tcp"};
    cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    ASSERT_TRUE(ctx.is_ok()) << ctx.status().message();
    ctx_.emplace(std::move(*ctx));
    auto worker = Worker::create(*ctx_);
    ASSERT_TRUE(worker.is_ok()) << worker.status().message();
    worker_.emplace(std::move(*worker));
    auto ep = Endpoint::create(*worker_, peer_.address, "source");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ep_.emplace(std::move(*ep));
    ASSERT_TRUE(ep_->import_rkey(1, peer_.rkey).is_ok());
    local_.assign(2 * kPeerBytes, 0xAB);
    auto region = MemoryRegion::map(*ctx_, local_.data(), local_.size(), "stranger");
    ASSERT_TRUE(region.is_ok()) << region.status().message();
    region_.emplace(std::move(*region));
  }

  void TearDown() override {
    ep_.reset();
    region_.reset();
    worker_.reset();
    ctx_.reset();
    testing::stop_peer(&peer_);
  }

  // How many bytes of the peer's buffer no longer hold its pattern.
  uint64_t bytes_changed() {
    std::vector<uint8_t> got;
    EXPECT_TRUE(testing::dump_peer(&peer_, &got)) << "peer did not dump";
    uint64_t changed = 0;
    for (uint64_t i = 0; i < got.size(); ++i) changed += got[i] != pattern_byte(kSeed, i);
    return got.empty() ? kPeerBytes : changed;
  }

  Peer peer_;
  std::optional<Context> ctx_;
  std::optional<Worker> worker_;
  std::optional<Endpoint> ep_;
  std::vector<uint8_t> local_;
  std::optional<MemoryRegion> region_;
};

// refit's own PUT (the GetEngine's active messages, what a receiver's
// fan-out uses): refused by a source, served by the control.
TEST_P(StrangerPut, RefitPutIsRefusedBySourceAndGetStillServed) {
  auto engine = GetEngine::create(*worker_, GetEngineOptions{});
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  (*engine)->add_local_region(*region_);
  GetRun put{&*ep_, 1, peer_.base + 4096, local_.data(), 64 << 10, Op::kPut};
  BatchReport r = (*engine)->run_batch({&put, 1}, Clock::now() + std::chrono::seconds(20));
  if (as_source()) {
    ASSERT_FALSE(r.status.is_ok());
    EXPECT_NE(r.runs[0].message().find("ejected"), std::string::npos) << r.runs[0].message();
    std::cout << "stranger's PUT into the source: " << r.runs[0].message() << "\n";
  } else {
    ASSERT_TRUE(r.status.is_ok()) << r.status.message();
  }
  // GETs are still served, bit-exact.
  GetRun get{&*ep_, 1, peer_.base, local_.data() + kPeerBytes, kPeerBytes, Op::kGet};
  r = (*engine)->run_batch({&get, 1}, Clock::now() + std::chrono::seconds(20));
  ASSERT_TRUE(r.status.is_ok()) << r.status.message();
  if (as_source()) {
    for (uint64_t i = 0; i < kPeerBytes; ++i) {
      ASSERT_EQ(local_[kPeerBytes + i], pattern_byte(kSeed, i)) << "byte " << i;
    }
  }
  engine->reset();
  EXPECT_EQ(bytes_changed() == 0, as_source());
}

// UCX's own PUT with the peer's rkey (its software emulation over tcp,
// which writes the named address with no check): a source's context does
// not serve it, so nothing lands; on the control it lands.
TEST_P(StrangerPut, UcxPutWithTheRkeyLandsOnlyOnTheControl) {
  const RemoteKey* key = ep_->rkey(1);
  ASSERT_NE(key, nullptr);
  struct Done {
    bool done = false;
    ucs_status_t status = UCS_OK;
  } done;
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = [](void*, ucs_status_t st, void* user) {
    auto* d = static_cast<Done*>(user);
    d->done = true;
    d->status = st;
  };
  param.user_data = &done;
  ucs_status_ptr_t req = ucp_put_nbx(ep_->get(), local_.data(), 64 << 10, peer_.base + 4096,
                                     key->get(), &param);
  if (req == nullptr) done.done = true;
  if (UCS_PTR_IS_ERR(req)) done = {true, UCS_PTR_STATUS(req)};
  // Then a flush, which completes once the peer acknowledged the PUT.
  ucp_request_param_t fparam = {};
  ucs_status_ptr_t flush = ucp_ep_flush_nbx(ep_->get(), &fparam);
  const auto until = Clock::now() + std::chrono::seconds(3);
  bool flushed = flush == nullptr;
  while (Clock::now() < until && !(done.done && flushed)) {
    worker_->progress();
    if (!flushed && !UCS_PTR_IS_ERR(flush) && ucp_request_check_status(flush) != UCS_INPROGRESS) {
      flushed = true;
    }
    if (UCS_PTR_IS_ERR(flush)) flushed = true;
  }
  std::cout << "UCX PUT " << (done.done ? ucs_status_string(done.status) : "not completed")
            << ", flush " << (flushed ? "completed" : "not completed in 3 s") << "\n";
  const uint64_t changed = bytes_changed();
  if (as_source()) {
    EXPECT_EQ(changed, 0u) << "a stranger's UCX PUT wrote into the source's region";
  } else {
    EXPECT_GT(changed, 0u) << "the control should take the PUT";
  }
  ep_->force_close("test done", Clock::now() + std::chrono::seconds(2));
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS) worker_->progress();
    ucp_request_free(req);
  }
  if (flush != nullptr && !UCS_PTR_IS_ERR(flush)) {
    while (ucp_request_check_status(flush) == UCS_INPROGRESS) worker_->progress();
    ucp_request_free(flush);
  }
}

INSTANTIATE_TEST_SUITE_P(Peers, StrangerPut, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Source" : "ReadWriteControl"; });

}  // namespace
}  // namespace refit::ucx
