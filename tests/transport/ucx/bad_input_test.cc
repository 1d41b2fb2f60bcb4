// Bad input to the UCX transport: each is an error Status that names the run
// or the setting; no crash, no abort, no hang. One process that GETs from its
// own memory over tcp on lo, so no peer is needed.

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/wire_blob.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;

bool contains(const Status& s, const std::string& needle) {
  return s.message().find(needle) != std::string::npos;
}

TEST(Context, UnknownTransportNameIsAnErrorNamingIt) {
  ContextConfig cfg;
  cfg.name = "network";
  cfg.transports = {"tcp", "infiniband-please"};
  auto ctx = Context::create(cfg);
  ASSERT_FALSE(ctx.is_ok());
  EXPECT_EQ(ctx.status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(contains(ctx.status(), "infiniband-please")) << ctx.status().message();
  EXPECT_TRUE(contains(ctx.status(), "network")) << ctx.status().message();
}

TEST(Context, ShmExpandsToCmaWithTcpControlLane) {
  auto tls = ucx_tls_string({"shm"}, "local");
  ASSERT_TRUE(tls.is_ok());
  EXPECT_EQ(*tls, "posix,sysv,cma,tcp,self");
  EXPECT_EQ(*ucx_tls_string({}, "x"), "all");
}

TEST(Context, UnknownDeviceIsAnErrorNamingIt) {
  ContextConfig cfg;
  cfg.name = "network";
  cfg.transports = {"tcp"};
  cfg.devices = {"lo", "no-such-nic0"};
  auto ctx = Context::create(cfg);
  // UCX 1.13 only warns and would start without the device.
  ASSERT_FALSE(ctx.is_ok());
  EXPECT_TRUE(contains(ctx.status(), "\"no-such-nic0\"")) << ctx.status().message();
  EXPECT_TRUE(contains(ctx.status(), "network")) << ctx.status().message();
  // And it says what there is.
  EXPECT_TRUE(contains(ctx.status(), "lo")) << ctx.status().message();
  cfg.devices = {"lo"};
  EXPECT_TRUE(Context::create(cfg).is_ok());
}

class LoopbackFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    ContextConfig cfg;
    cfg.name = "loopback";
    // Not "self": in UCX 1.13 it has no peer-failure support, which refit's
    // endpoints require; tcp on lo stands in.
    cfg.transports = {"tcp"};
    cfg.devices = {"lo"};
    auto ctx = Context::create(cfg);
    if (!ctx) GTEST_SKIP() << "UCX tcp transport unavailable: " << ctx.status().message();
    ctx_.emplace(std::move(*ctx));
    auto worker = Worker::create(*ctx_);
    ASSERT_TRUE(worker.is_ok()) << worker.status().message();
    worker_.emplace(std::move(*worker));
    auto addr = worker_->address();
    ASSERT_TRUE(addr.is_ok());
    address_ = *addr;
    auto ep = Endpoint::create(*worker_, address_, "self");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ep_.emplace(std::move(*ep));
    src_.resize(1 << 20);
    dst_.resize(1 << 20);
    for (size_t i = 0; i < src_.size(); ++i) src_[i] = static_cast<uint8_t>(i * 7 + 3);
    auto s = MemoryRegion::map(*ctx_, src_.data(), src_.size(), "src");
    auto d = MemoryRegion::map(*ctx_, dst_.data(), dst_.size(), "dst");
    ASSERT_TRUE(s.is_ok() && d.is_ok());
    src_region_.emplace(std::move(*s));
    dst_region_.emplace(std::move(*d));
    ASSERT_TRUE(ep_->import_rkey(1, src_region_->packed_rkey()).is_ok());
    auto engine = GetEngine::create(*worker_, GetEngineOptions{});
    ASSERT_TRUE(engine.is_ok());
    engine_ = std::move(*engine);
    engine_->add_local_region(*dst_region_);
    // This process is its own peer over tcp, so it serves the GETs too
    // (am_rma.h).
    auto server = AmRmaServer::create(*worker_);
    ASSERT_TRUE(server.is_ok()) << server.status().message();
    server_ = std::move(*server);
    server_->export_region(*src_region_);
  }
  void TearDown() override {
    server_.reset();
    engine_.reset();
    ep_.reset();
    src_region_.reset();
    dst_region_.reset();
    worker_.reset();
    ctx_.reset();
  }
  GetRun good_run(uint64_t off, uint64_t bytes) {
    return GetRun{&*ep_, 1, reinterpret_cast<uint64_t>(src_.data()) + off, dst_.data() + off,
                  bytes};
  }
  // A batch with one good run and `bad` as run 1: refused before any GET.
  void expect_refused(const GetRun& bad, const std::string& needle) {
    std::vector<GetRun> runs = {good_run(0, 100), bad};
    auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
    ASSERT_FALSE(report.status.is_ok());
    EXPECT_TRUE(contains(report.status, "run 1")) << report.status.message();
    EXPECT_TRUE(contains(report.status, needle)) << report.status.message();
    EXPECT_EQ(report.gets_issued, 0u);
    EXPECT_EQ(engine_->outstanding_requests(), 0u);
  }

  std::optional<Context> ctx_;
  std::optional<Worker> worker_;
  std::vector<uint8_t> address_;
  std::optional<Endpoint> ep_;
  std::vector<uint8_t> src_, dst_;
  std::optional<MemoryRegion> src_region_, dst_region_;
  std::unique_ptr<GetEngine> engine_;
  std::unique_ptr<AmRmaServer> server_;
};

// A peer without an AmRmaServer (or one that does not export the range)
// refuses tcp GETs at once, with a message that says what is missing,
// rather than leaving them to the deadline or crashing (UCX 1.13 crashes on
// an AM with UCP_AM_SEND_FLAG_REPLY that has no handler).
TEST_F(LoopbackFixture, PeerWithoutAmRmaServerRefusesClearly) {
  server_->unexport_region(*src_region_);
  GetRun run = good_run(0, 4096);
  auto start = Clock::now();
  auto report = engine_->run_batch({&run, 1}, start + std::chrono::seconds(5));
  EXPECT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "AmRmaServer")) << report.status.message();
  EXPECT_EQ(server_->refused(), 1u);
  server_.reset();  // the worker's fallback handler refuses now
  report = engine_->run_batch({&run, 1}, Clock::now() + std::chrono::seconds(5));
  EXPECT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "refused")) << report.status.message();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
}

// A region of atomic words (a fabric's mailbox): whole aligned words are
// served, read and written word by word; a request that would split a word,
// or a gather, is refused by the server (am_rma.h, AmRmaServer::Words).
TEST_F(LoopbackFixture, ARegionOfAtomicWordsServesWholeWordsOnly) {
  server_->unexport_region(*src_region_);
  server_->export_region(*src_region_, AmRmaServer::Words::kAtomicWords);
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(5); };
  // Whole words, more than one reply piece: served.
  GetRun whole = good_run(8, 200000);
  BatchReport report = engine_->run_batch({&whole, 1}, deadline());
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(std::memcmp(dst_.data() + 8, src_.data() + 8, 200000), 0);
  // A PUT of whole words lands in the region.
  std::memset(dst_.data() + 4096, 0xA5, 64);
  GetRun put{&*ep_, 1, reinterpret_cast<uint64_t>(src_.data()) + 4096, dst_.data() + 4096, 64, Op::kPut};
  report = engine_->run_batch({&put, 1}, deadline());
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(std::memcmp(src_.data() + 4096, dst_.data() + 4096, 64), 0);
  const uint64_t refused = server_->refused();
  // A GET that starts inside a word, one that ends inside one, and a PUT
  // that would split one: each refused, and the region unchanged.
  std::vector<uint8_t> before = src_;
  for (GetRun bad : {good_run(3, 16), good_run(0, 12),
                     GetRun{&*ep_, 1, reinterpret_cast<uint64_t>(src_.data()) + 12, dst_.data(), 8, Op::kPut}}) {
    report = engine_->run_batch({&bad, 1}, deadline());
    EXPECT_FALSE(report.status.is_ok());
    EXPECT_TRUE(contains(report.status, "refused")) << report.status.message();
  }
  EXPECT_EQ(server_->refused(), refused + 3);
  EXPECT_EQ(src_, before);
  // A gather: never served from a region of atomic words.
  const std::vector<GatherPart> parts = {{1, reinterpret_cast<uint64_t>(src_.data()), dst_.data(), 64},
                                         {1, reinterpret_cast<uint64_t>(src_.data()) + 128, dst_.data() + 64, 64}};
  GetRun gather{&*ep_, 0, 0, nullptr, 128, Op::kGet, parts};
  report = engine_->run_batch({&gather, 1}, deadline());
  EXPECT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "refused")) << report.status.message();
  EXPECT_EQ(server_->refused(), refused + 4);
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
}

TEST_F(LoopbackFixture, GoodBatchLandsAndReportsEachRun) {
  std::vector<GetRun> runs = {good_run(0, 1), good_run(5, 300000), good_run(400001, 600000)};
  std::vector<int> seen(runs.size());
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(10),
                                   [&](uint32_t i, const Status& s) {
                                     EXPECT_TRUE(s.is_ok());
                                     ++seen[i];
                                   });
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(seen, (std::vector<int>{1, 1, 1}));
  for (const auto& r : runs) {
    auto off = static_cast<uint8_t*>(r.local_address) - dst_.data();
    EXPECT_EQ(0, std::memcmp(dst_.data() + off, src_.data() + off, r.bytes));
  }
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  EXPECT_EQ(src_region_->type(), MemoryType::kHost);
}

TEST_F(LoopbackFixture, ZeroLengthRunIsRefused) { expect_refused(good_run(0, 0), "zero bytes"); }

TEST_F(LoopbackFixture, RemoteRangeOutsideRegionIsRefused) {
  expect_refused(good_run(src_.size() - 10, 11), "outside the region of rkey 1");
  GetRun before = good_run(0, 10);
  before.remote_address -= 1;
  expect_refused(before, "outside the region");
}

TEST_F(LoopbackFixture, LocalRangeOutsideRegisteredRegionIsRefused) {
  std::vector<uint8_t> unregistered(100);
  GetRun r = good_run(0, 100);
  r.local_address = unregistered.data();
  expect_refused(r, "not inside a registered region");
}

TEST_F(LoopbackFixture, UnknownRkeyIsRefused) {
  GetRun r = good_run(0, 100);
  r.rkey_id = 42;
  expect_refused(r, "rkey id 42");
}

TEST_F(LoopbackFixture, NullEndpointIsRefused) {
  GetRun r = good_run(0, 100);
  r.endpoint = nullptr;
  expect_refused(r, "no endpoint");
}

TEST_F(LoopbackFixture, GarbageRkeyBytesAreRefused) {
  std::vector<uint8_t> junk(64, 0xAB);
  Status s = ep_->import_rkey(2, junk);
  EXPECT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s, "rkey id 2")) << s.message();
  // A valid key's bytes with a flipped payload byte fail the checksum.
  auto bytes = src_region_->packed_rkey();
  bytes.back() ^= 0x5A;
  s = ep_->import_rkey(3, bytes);
  EXPECT_TRUE(contains(s, "checksum")) << s.message();
  // Re-importing id 1 with other bytes is refused; the same bytes are cached.
  EXPECT_FALSE(ep_->import_rkey(1, bytes).is_ok());
  EXPECT_TRUE(ep_->import_rkey(1, src_region_->packed_rkey()).is_ok());
}

TEST_F(LoopbackFixture, GarbageWorkerAddressBytesAreRefused) {
  std::mt19937 rng(3);
  for (size_t n : {0, 1, 31, 32, 100, 4096}) {
    std::vector<uint8_t> junk(n);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    auto ep = Endpoint::create(*worker_, junk, "trainer-7");
    ASSERT_FALSE(ep.is_ok());
    EXPECT_TRUE(contains(ep.status(), "trainer-7")) << ep.status().message();
  }
  // Truncated and corrupted real addresses.
  auto truncated = address_;
  truncated.resize(truncated.size() - 1);
  EXPECT_FALSE(Endpoint::create(*worker_, truncated, "t").is_ok());
  auto corrupt = address_;
  corrupt.back() ^= 1;
  auto ep = Endpoint::create(*worker_, corrupt, "t");
  ASSERT_FALSE(ep.is_ok());
  EXPECT_TRUE(contains(ep.status(), "checksum"));
  // A remote key is not a worker address.
  EXPECT_FALSE(Endpoint::create(*worker_, src_region_->packed_rkey(), "t").is_ok());
}

TEST_F(LoopbackFixture, BadWindowIsRefusedNamingTheSetting) {
  GetEngineOptions o;
  o.limits.chunk_bytes = 0;
  auto e = GetEngine::create(*worker_, o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_TRUE(contains(e.status(), "chunk_bytes"));
  o = GetEngineOptions{};
  o.progress_thread = true;  // the worker is kSingle
  EXPECT_FALSE(GetEngine::create(*worker_, o).is_ok());
}

TEST(MemoryRegion, ZeroLengthOrNullIsRefused) {
  ContextConfig cfg;
  cfg.transports = {"self"};
  auto ctx = Context::create(cfg);
  if (!ctx) GTEST_SKIP() << ctx.status().message();
  uint8_t b[8];
  auto r = MemoryRegion::map(*ctx, b, 0, "weights");
  ASSERT_FALSE(r.is_ok());
  EXPECT_TRUE(contains(r.status(), "weights"));
  EXPECT_FALSE(MemoryRegion::map(*ctx, nullptr, 8).is_ok());
}

}  // namespace
}  // namespace refit::ucx
