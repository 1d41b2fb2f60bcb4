// Gathers (am_rma.h, get_engine.h): many small ranges of one peer in one
// request, scattered into place by the engine; and the server's checks of
// the entry list, which is peer input. One process that gathers from its
// own memory over tcp on lo, so no peer is needed.

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <atomic>
#include <algorithm>

#include "transport/ucx/am_rma.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;

bool contains(const Status& s, const std::string& needle) { return s.message().find(needle) != std::string::npos; }

class GatherFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    ContextConfig cfg;
    cfg.name = "loopback";
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
    auto ep = Endpoint::create(*worker_, *addr, "self");
    ASSERT_TRUE(ep.is_ok()) << ep.status().message();
    ep_.emplace(std::move(*ep));
    src_.resize(1 << 20);
    dst_.assign(1 << 20, 0);
    for (size_t i = 0; i < src_.size(); ++i) src_[i] = static_cast<uint8_t>(i * 7 + 3 + (i >> 8));
    auto s = MemoryRegion::map(*ctx_, src_.data(), src_.size(), "src");
    auto d = MemoryRegion::map(*ctx_, dst_.data(), dst_.size(), "dst");
    ASSERT_TRUE(s.is_ok() && d.is_ok());
    src_region_.emplace(std::move(*s));
    dst_region_.emplace(std::move(*d));
    ASSERT_TRUE(ep_->import_rkey(1, src_region_->packed_rkey()).is_ok());
    auto server = AmRmaServer::create(*worker_, AmRmaServer::Puts::kRefused);
    ASSERT_TRUE(server.is_ok()) << server.status().message();
    server_ = std::move(*server);
    server_->export_region(*src_region_);
  }
  void TearDown() override {
    engine_.reset();
    ep2_.reset();
    worker2_.reset();
    server_.reset();
    ep_.reset();
    src_region_.reset();
    dst_region_.reset();
    worker_.reset();
    ctx_.reset();
  }
  // A server whose gather reply memory is `bound` bytes, in place of the
  // default one.
  void make_server(uint64_t bound) {
    server_.reset();
    auto server = AmRmaServer::create(*worker_, AmRmaServer::Puts::kRefused, bound);
    ASSERT_TRUE(server.is_ok()) << server.status().message();
    server_ = std::move(*server);
    server_->export_region(*src_region_);
  }
  void make_engine(uint64_t chunk_bytes, uint64_t gather_chunk_bytes = 0) {
    GetEngineOptions o;
    o.limits.chunk_bytes = chunk_bytes;
    o.limits.gather_chunk_bytes = gather_chunk_bytes;
    o.limits.max_bytes_per_endpoint = std::max<uint64_t>(o.limits.max_bytes_per_endpoint, chunk_bytes);
    o.limits.max_bytes_in_flight = std::max<uint64_t>(o.limits.max_bytes_in_flight, chunk_bytes);
    auto engine = GetEngine::create(*worker_, o);
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    engine_ = std::move(*engine);
    engine_->add_local_region(*dst_region_);
  }
  uint64_t src_at(uint64_t off) const { return reinterpret_cast<uint64_t>(src_.data()) + off; }

  // A second worker with an endpoint to the server's: a puller that sends
  // raw gather requests (gather_from_second) and reads nothing until the
  // test progresses its worker (its replies are then dropped: it has no
  // handler of its own).
  void make_second_puller(const char* name) {
    auto w2 = Worker::create(*ctx_);
    ASSERT_TRUE(w2.is_ok()) << w2.status().message();
    worker2_.emplace(std::move(*w2));
    auto addr = worker_->address();
    ASSERT_TRUE(addr.is_ok());
    auto e2 = Endpoint::create(*worker2_, *addr, name);
    ASSERT_TRUE(e2.is_ok()) << e2.status().message();
    ep2_.emplace(std::move(*e2));
  }
  // The request's header and `entries` must outlive the returned request
  // (UCX 1.13 does not copy an active message's header).
  ucs_status_ptr_t gather_from_second(const std::vector<am_rma::GatherEntry>& entries, uint64_t token) {
    am_rma::GatherHeader& h = second_header_;
    h = am_rma::GatherHeader{};
    h.count = static_cast<uint32_t>(entries.size());
    h.token = token;
    h.total = 0;
    for (const am_rma::GatherEntry& e : entries) h.total += e.length;
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    return ucp_am_send_nbx(ep2_->get(), am_rma::kGatherRequest, &h, sizeof(h), entries.data(),
                           entries.size() * sizeof(am_rma::GatherEntry), &param);
  }

  // A column slice: `rows` rows of `row_bytes` at a source stride, landing
  // packed at the destination in reverse row order (so the scatter, not
  // the order of the stream, decides where bytes go).
  std::vector<GatherPart> column_slice(int rows, uint64_t row_bytes, uint64_t stride) {
    std::vector<GatherPart> parts;
    for (int r = 0; r < rows; ++r) {
      parts.push_back(GatherPart{1, src_at(r * stride + 40), dst_.data() + (rows - 1 - r) * row_bytes, row_bytes});
    }
    return parts;
  }
  void expect_landed(const std::vector<GatherPart>& parts) {
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto* want = reinterpret_cast<const uint8_t*>(parts[k].remote_address);
      ASSERT_EQ(std::memcmp(parts[k].local_address, want, parts[k].bytes), 0) << "range " << k;
    }
  }

  std::optional<Context> ctx_;
  std::optional<Worker> worker_;
  std::optional<Endpoint> ep_;
  std::optional<Worker> worker2_;
  std::optional<Endpoint> ep2_;
  am_rma::GatherHeader second_header_;
  std::vector<uint8_t> src_, dst_;
  std::optional<MemoryRegion> src_region_, dst_region_;
  std::unique_ptr<GetEngine> engine_;
  std::unique_ptr<AmRmaServer> server_;
};

uint64_t sum(const std::vector<GatherPart>& parts) {
  uint64_t n = 0;
  for (const GatherPart& p : parts) n += p.bytes;
  return n;
}

TEST_F(GatherFixture, ColumnSliceLandsInOneRequest) {
  make_engine(1 << 20);
  // 300 rows of 700 bytes: more than three reply pieces, cut mid-row.
  const auto parts = column_slice(300, 700, 2048);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(report.gets_issued, 1u);
  EXPECT_EQ(report.bytes_done, sum(parts));
  EXPECT_EQ(server_->served(), 1u);
  expect_landed(parts);
}

// The server's reply pieces outlive their sends (am_rma.h): a puller that
// reads its replies late makes the source hold many pieces at once, and the
// next gathers reuse them instead of allocating again. Before, every piece
// was a new allocation, and once a gather's pieces were freed their memory
// went back to the kernel and came back as fresh pages.
TEST_F(GatherFixture, ReplyPiecesAreReusedFromOneGatherToTheNext) {
  make_second_puller("late puller");
  // 8 entries of the whole 1 MiB source: 8 MiB of replies, more than the
  // sockets absorb while the puller reads nothing.
  std::vector<am_rma::GatherEntry> entries(8, am_rma::GatherEntry{src_at(0), src_.size()});
  uint64_t most_held = 0;
  for (uint64_t round = 1; round <= 3; ++round) {
    ucs_status_ptr_t req = gather_from_second(entries, round);
    ASSERT_FALSE(UCS_PTR_IS_ERR(req));
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (server_->served() < round && Clock::now() < until) {
      worker2_->progress();
      worker_->progress();
    }
    ASSERT_EQ(server_->served(), round);
    if (req != nullptr) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) worker2_->progress();
      ucp_request_free(req);
    }
    // The source holds pieces while the puller has read nothing yet.
    most_held = std::max(most_held, server_->replies_in_flight());
    EXPECT_GT(server_->replies_in_flight(), 1u);
    // Now it reads (its replies are dropped: it has no handler) until every
    // piece is back.
    while (server_->replies_in_flight() > 0 && Clock::now() < until) {
      worker2_->progress();
      worker_->progress();
    }
    ASSERT_EQ(server_->replies_in_flight(), 0u);
    EXPECT_EQ(server_->gather_reply_bytes(), 0u);
    EXPECT_EQ(server_->gather_pieces_kept(), server_->gather_pieces_allocated());
  }
  // Never more pieces than were held at once (plus the one being filled
  // while the others were sent), though the three gathers sent 3 x 131.
  EXPECT_LE(server_->gather_pieces_allocated(), most_held + 1);
}

// A source that cannot allocate a reply buffer answers the gather
// UCS_ERR_NO_MEMORY (am_rma.cc). A hand-written source stands in for it
// here, on the same worker: the run fails naming the gather and what the
// source ran out of, and nothing stays outstanding.
struct OutOfMemorySource {
  am_rma::ReplyHeader reply;  // outlives the reply's send (no header copy in UCX 1.13)
  int requests = 0;
};

ucs_status_t answer_out_of_memory(void* arg, const void* header, size_t header_length, void*, size_t,
                                  const ucp_am_recv_param_t* param) {
  auto* src = static_cast<OutOfMemorySource*>(arg);
  am_rma::GatherHeader h;
  if (header_length != sizeof(h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  ++src->requests;
  src->reply = am_rma::ReplyHeader{};
  src->reply.status = UCS_ERR_NO_MEMORY;
  src->reply.token = h.token;
  ucp_request_param_t rp = {};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t req =
      ucp_am_send_nbx(param->reply_ep, am_rma::kGetReply, &src->reply, sizeof(src->reply), nullptr, 0, &rp);
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) ucp_request_free(req);
  return UCS_OK;
}

TEST_F(GatherFixture, ASourceOutOfMemoryFailsTheGatherNamingIt) {
  make_engine(1 << 20);
  server_.reset();
  OutOfMemorySource src;
  ASSERT_TRUE(set_am_handler(worker_->get(), am_rma::kGatherRequest, &answer_out_of_memory, &src).is_ok());
  const auto parts = column_slice(300, 700, 2048);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
  ASSERT_EQ(report.status.code(), Code::kIoError) << report.status.message();
  EXPECT_NE(report.status.message().find("run 0 (gather of 300 ranges, 210000 bytes, on endpoint \"self\"): the "
                                         "source ran out of memory for the replies of the gather of 210000 bytes"),
            std::string::npos)
      << report.status.message();
  EXPECT_EQ(src.requests, 1);
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
  EXPECT_TRUE(am_rma::install_fallback_handler(worker_->get(), am_rma::kGatherRequest).is_ok());
}

// It keeps no more pieces than its bound on reply memory allows.
TEST(ReplyPieces, KeepsAtMostItsBoundAndFreesTheRest) {
  am_rma::ReplyPieces pieces(3);
  std::vector<am_rma::ReplyPieces::Piece> taken;
  for (int i = 0; i < 5; ++i) {
    taken.push_back(pieces.take());
    ASSERT_NE(taken.back(), nullptr);
  }
  EXPECT_EQ(pieces.allocated(), 5u);
  const uint8_t* first = taken[0].get();
  for (auto& p : taken) pieces.give(std::move(p));
  EXPECT_EQ(pieces.kept(), 3u);
  // Taken again: kept ones first, in last-in first-out order, then new.
  std::vector<am_rma::ReplyPieces::Piece> again;
  for (int i = 0; i < 4; ++i) again.push_back(pieces.take());
  EXPECT_EQ(pieces.kept(), 0u);
  EXPECT_EQ(pieces.allocated(), 6u);
  EXPECT_EQ(again[2].get(), first);
}

// The most ranges a server takes in one request (the agents' default
// "gather_entries" is an eighth of it): a request of 1 MiB of entries, sent
// eager over tcp, served whole.
TEST_F(GatherFixture, AGatherOfTheMostEntriesLandsInOneRequest) {
  make_engine(1 << 20);
  const auto parts = column_slice(am_rma::kMaxGatherEntries, 8, 15);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(report.gets_issued, 1u);
  EXPECT_EQ(server_->served(), 1u);
  EXPECT_EQ(server_->refused(), 0u);
  expect_landed(parts);
}

TEST_F(GatherFixture, GatherLargerThanAChunkIsCutAcrossRanges) {
  make_engine(4096);  // chunks end inside ranges
  std::mt19937_64 rng(18);
  std::vector<GatherPart> parts;
  uint64_t at_src = 0, at_dst = 0;
  for (int k = 0; k < 200; ++k) {
    const uint64_t n = 1 + rng() % 1500;
    parts.push_back(GatherPart{1, src_at(at_src), dst_.data() + at_dst, n});
    at_src += n + rng() % 300;
    at_dst += n + 64;
  }
  // A plain GET in the same batch, after the gather's bytes.
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts},
                              GetRun{&*ep_, 1, src_at(900000), dst_.data() + 900000, 5000}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(report.gets_issued, (sum(parts) + 4095) / 4096 + 2);
  expect_landed(parts);
  EXPECT_EQ(std::memcmp(dst_.data() + 900000, src_.data() + 900000, 5000), 0);
}

// With a gather request size of its own (the agents': "gather_bytes"), a
// gather is one request however small the plain GETs' chunk.
TEST_F(GatherFixture, AGatherIsOneRequestOfItsOwnSize) {
  make_engine(4096, 1 << 20);
  const auto parts = column_slice(300, 700, 2048);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts},
                              GetRun{&*ep_, 1, src_at(900000), dst_.data() + 900000, 10000}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_EQ(report.gets_issued, 1u + 3u);  // the gather whole; the plain GET in chunks of 4096
  expect_landed(parts);
  EXPECT_EQ(std::memcmp(dst_.data() + 900000, src_.data() + 900000, 10000), 0);
}

TEST_F(GatherFixture, RangeOutsideTheKeyIsRefusedBeforeAnyRequest) {
  make_engine(1 << 20);
  auto parts = column_slice(4, 100, 1000);
  parts[2].remote_address = src_at(src_.size() - 10);  // runs past the region
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
  ASSERT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "range 2")) << report.status.message();
  EXPECT_EQ(report.gets_issued, 0u);
  parts = column_slice(4, 100, 1000);
  runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts) + 1, Op::kGet, parts}};
  report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
  EXPECT_TRUE(contains(report.status, "not 401")) << report.status.message();
}

TEST_F(GatherFixture, UnexportedRangeFailsTheRunWithTheServersRefusal) {
  make_engine(1 << 20);
  server_->unexport_region(*src_region_);
  const auto parts = column_slice(4, 100, 1000);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
  ASSERT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "refused")) << report.status.message();
  EXPECT_EQ(server_->refused(), 1u);
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
}

// A peer without an AmRmaServer refuses a gather at once (its fallback
// handler), rather than leaving it to the deadline.
TEST_F(GatherFixture, PeerWithoutAServerRefusesAtOnce) {
  make_engine(1 << 20);
  server_.reset();
  const auto parts = column_slice(4, 100, 1000);
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  const auto start = Clock::now();
  auto report = engine_->run_batch(runs, start + std::chrono::seconds(5));
  ASSERT_FALSE(report.status.is_ok());
  EXPECT_TRUE(contains(report.status, "AmRmaServer")) << report.status.message();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(4));
}

// A gather larger than the source's reply memory can never be served: the
// run fails at once, and the message names both sizes and the knobs.
TEST_F(GatherFixture, AGatherLargerThanTheSourcesBoundIsRefusedNamingBoth) {
  make_server(100000);
  make_engine(1 << 20);
  const auto parts = column_slice(300, 700, 2048);  // 210000 bytes
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(5));
  ASSERT_FALSE(report.status.is_ok());
  EXPECT_EQ(report.status.message(),
            "run 0 (gather of 300 ranges, 210000 bytes, on endpoint \"self\"): the peer serves gathers of at most "
            "100000 bytes (its \"gather_reply_bytes\"), this request has 210000; lower \"gather_bytes\", or raise "
            "the source's \"gather_reply_bytes\": " +
                std::string(ucs_status_string(UCS_ERR_EXCEEDS_LIMIT)) + " (UCX status -21)");
  EXPECT_EQ(server_->refused(), 1u);
  EXPECT_EQ(server_->gather_reply_bytes_peak(), 0u);
  EXPECT_EQ(engine_->outstanding_requests(), 0u);
}

// A source whose gather reply memory is full answers "busy"; the puller asks
// again and the gather lands, and the source never holds more than its
// bound. A second puller, which does not read its replies yet, holds the
// source's memory: a 32 MiB gather, more than the sockets absorb.
TEST_F(GatherFixture, ABusySourceIsAskedAgainAndNeverHoldsMoreThanItsBound) {
  constexpr uint64_t kBound = uint64_t{32} << 20;
  make_server(kBound);
  make_second_puller("slow puller");
  // 32 entries of the whole 1 MiB source: the bound exactly.
  std::vector<am_rma::GatherEntry> entries(32, am_rma::GatherEntry{src_at(0), src_.size()});
  ucs_status_ptr_t req = gather_from_second(entries, 5);
  ASSERT_FALSE(UCS_PTR_IS_ERR(req));
  // Until the source has taken it; from then on the slow puller reads
  // nothing (its replies are dropped when it does: no handler of its own).
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (server_->served() == 0 && Clock::now() < until) {
    worker2_->progress();
    worker_->progress();
  }
  ASSERT_EQ(server_->served(), 1u);
  if (req != nullptr) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) worker_->progress();
    ucp_request_free(req);
  }
  // This engine's gather: 12 MiB (rows of the source, again and again) into
  // a buffer of its own.
  std::vector<uint8_t> big(uint64_t{12} << 20, 0);
  auto big_region = MemoryRegion::map(*ctx_, big.data(), big.size(), "big");
  ASSERT_TRUE(big_region.is_ok());
  make_engine(uint64_t{16} << 20);
  engine_->add_local_region(*big_region);
  std::vector<GatherPart> parts;
  for (uint64_t at = 0; at < big.size(); at += 4096) {
    parts.push_back(GatherPart{1, src_at((at * 7) % (src_.size() - 4096)), big.data() + at, 4096});
  }
  // The slow puller starts reading once the source has said "busy" (or
  // after 5 s, and then the test fails on the count below).
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    const auto wait_until = Clock::now() + std::chrono::seconds(5);
    while (server_->busy() == 0 && Clock::now() < wait_until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (!stop.load()) worker2_->progress();
  });
  std::vector<GetRun> runs = {GetRun{&*ep_, 0, 0, nullptr, sum(parts), Op::kGet, parts}};
  auto report = engine_->run_batch(runs, Clock::now() + std::chrono::seconds(20));
  // The slow puller's replies drain too, so that nothing is left in flight.
  const auto drained = Clock::now() + std::chrono::seconds(10);
  while (server_->replies_in_flight() > 0 && Clock::now() < drained) worker_->progress();
  stop = true;
  reader.join();
  EXPECT_EQ(server_->replies_in_flight(), 0u);
  EXPECT_EQ(server_->gather_reply_bytes(), 0u);
  ASSERT_TRUE(report.status.is_ok()) << report.status.message();
  EXPECT_GE(server_->busy(), 1u);
  EXPECT_EQ(report.busy_retries, server_->busy());
  EXPECT_LE(server_->gather_reply_bytes_peak(), kBound);
  EXPECT_EQ(server_->served(), 2u);
  expect_landed(parts);
}

// Raw requests, as a hostile or broken peer could send them: every bad list
// is refused whole, with a reply, and nothing is read.
struct RawReply {
  bool got = false;
  ucs_status_t status = UCS_OK;
  uint64_t bytes = 0;
};

ucs_status_t on_raw_reply(void* arg, const void* header, size_t header_length, void*, size_t length,
                          const ucp_am_recv_param_t*) {
  auto* r = static_cast<RawReply*>(arg);
  am_rma::ReplyHeader h;
  if (header_length != sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  r->bytes += length;
  if (h.status != UCS_OK || length == 0) {
    r->got = true;
    r->status = static_cast<ucs_status_t>(h.status);
  }
  return UCS_OK;
}

class RawGather : public GatherFixture {
 protected:
  RawReply send(uint32_t count, uint64_t total, const std::vector<am_rma::GatherEntry>& entries,
                uint64_t expect_bytes = 0) {
    RawReply reply;
    EXPECT_TRUE(set_am_handler(worker_->get(), am_rma::kGetReply, &on_raw_reply, &reply).is_ok());
    am_rma::GatherHeader h;
    h.count = count;
    h.token = 77;
    h.total = total;
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t req = ucp_am_send_nbx(ep_->get(), am_rma::kGatherRequest, &h, sizeof(h), entries.data(),
                                           entries.size() * sizeof(am_rma::GatherEntry), &param);
    EXPECT_FALSE(UCS_PTR_IS_ERR(req));
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < until && !(reply.got || (expect_bytes > 0 && reply.bytes >= expect_bytes))) {
      worker_->progress();
    }
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < until) worker_->progress();
      ucp_request_free(req);
    }
    EXPECT_TRUE(am_rma::install_fallback_handler(worker_->get(), am_rma::kGetReply).is_ok());
    return reply;
  }
};

TEST_F(RawGather, GoodListIsServed) {
  std::vector<am_rma::GatherEntry> e = {{src_at(0), 100}, {src_at(5000), 200}};
  RawReply r = send(2, 300, e, 300);
  EXPECT_EQ(r.bytes, 300u);
  EXPECT_FALSE(r.got);  // no refusal
  EXPECT_EQ(server_->served(), 1u);
}

TEST_F(RawGather, EntryOutsideEveryRegionIsRefused) {
  std::vector<am_rma::GatherEntry> e = {{src_at(0), 100}, {src_at(src_.size() - 50), 100}};
  RawReply r = send(2, 200, e);
  ASSERT_TRUE(r.got);
  EXPECT_EQ(r.status, UCS_ERR_INVALID_ADDR);
  EXPECT_EQ(r.bytes, 0u);
  e = {{0x1000, 8}};  // not this process's registered memory at all
  r = send(1, 8, e);
  EXPECT_EQ(r.status, UCS_ERR_INVALID_ADDR);
  EXPECT_EQ(server_->refused(), 2u);
  EXPECT_EQ(server_->served(), 0u);
}

TEST_F(RawGather, OverflowingLengthsAreRefused) {
  // Two lengths whose sum wraps to 100 in 64 bits.
  const uint64_t big = std::numeric_limits<uint64_t>::max() - 49;
  std::vector<am_rma::GatherEntry> e = {{src_at(0), big}, {src_at(0), 150}};
  RawReply r = send(2, 100, e);
  ASSERT_TRUE(r.got);
  EXPECT_EQ(r.status, UCS_ERR_INVALID_PARAM);
  EXPECT_EQ(r.bytes, 0u);
}

TEST_F(RawGather, MalformedListsAreRefused) {
  std::vector<am_rma::GatherEntry> e = {{src_at(0), 100}, {src_at(200), 100}};
  EXPECT_EQ(send(3, 200, e).status, UCS_ERR_INVALID_PARAM);        // count says more than is there
  EXPECT_EQ(send(2, 300, e).status, UCS_ERR_INVALID_PARAM);        // total does not match
  EXPECT_EQ(send(0, 0, {}).status, UCS_ERR_INVALID_PARAM);         // empty
  std::vector<am_rma::GatherEntry> zero = {{src_at(0), 0}, {src_at(0), 10}};
  EXPECT_EQ(send(2, 10, zero).status, UCS_ERR_INVALID_PARAM);      // an empty entry
  // Too long: more entries than a server takes.
  std::vector<am_rma::GatherEntry> many(am_rma::kMaxGatherEntries + 1, am_rma::GatherEntry{src_at(0), 1});
  EXPECT_EQ(send(static_cast<uint32_t>(many.size()), many.size(), many).status, UCS_ERR_INVALID_PARAM);
  // Too many bytes, though each entry is in the region.
  std::vector<am_rma::GatherEntry> huge(80, am_rma::GatherEntry{src_at(0), 1 << 20});
  EXPECT_EQ(send(80, uint64_t{80} << 20, huge).status, UCS_ERR_INVALID_PARAM);
  EXPECT_EQ(server_->served(), 0u);
  EXPECT_EQ(server_->refused(), 6u);
}

}  // namespace
}  // namespace refit::ucx
