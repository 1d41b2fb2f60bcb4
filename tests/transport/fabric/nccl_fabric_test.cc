// The NCCL fabric's logic (rounds, per-peer order, failure, deadline, the
// communicator cache) over the host communicator (host_comm.h).

#include "transport/fabric/nccl_fabric.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "fanout_case.h"
#include "host_comm.h"

namespace refit::fabric {
namespace {

using testing::FanoutCase;
using testing::RankFabric;

// Packing on with the smallest areas: a test not about the area's size
// need not zero-fill 2 x 64 MiB per rank.
PackLimits small_packs() {
  PackLimits l;
  l.pack_bytes = kMinPackBytes;
  return l;
}

// Rewrites what its rank announces in a round (round_words.h) before the
// words leave: `round` counts the rank's count exchanges from 0, `words`
// are its host words [0, W n), the block for NCCL rank p at W p.
using Tamper = std::function<void(int round, uint64_t* words, size_t n)>;

// A host communicator whose rank lies in its announcements: every call goes
// to the real one, put_words after `tamper` rewrote the host words.
class TamperComm final : public cuda::DomainComm {
 public:
  TamperComm(std::unique_ptr<cuda::DomainComm> comm, Tamper tamper) : c_(std::move(comm)), tamper_(std::move(tamper)) {}
  int32_t rank() const override { return c_->rank(); }
  int32_t size() const override { return c_->size(); }
  void set_deadline(Clock::time_point d) override { c_->set_deadline(d); }
  uint64_t* words() override { return c_->words(); }
  uint64_t* host_words() override { return c_->host_words(); }
  size_t word_count() const override { return c_->word_count(); }
  Status put_words(size_t n) override {
    tamper_(round_++, c_->host_words(), n);
    return c_->put_words(n);
  }
  Status get_words(size_t from, size_t n) override { return c_->get_words(from, n); }
  Status order_after_upstream() override { return c_->order_after_upstream(); }
  Status issue(std::span<const cuda::P2p> group) override { return c_->issue(group); }
  Result<bool> idle() override { return c_->idle(); }
  void abort() override { c_->abort(); }
  Result<PackAreas> pack_areas(uint64_t bytes, size_t max_pieces) override {
    return c_->pack_areas(bytes, max_pieces);
  }
  Status scatter(std::span<const cuda::ScatterPiece> pieces) override { return c_->scatter(pieces); }

 private:
  std::unique_ptr<cuda::DomainComm> c_;
  Tamper tamper_;
  int round_ = 0;
};

class TamperFactory final : public cuda::CommFactory {
 public:
  TamperFactory(bool can_scatter, Tamper tamper) : f_(can_scatter), tamper_(std::move(tamper)) {}
  bool can_scatter() const override { return f_.can_scatter(); }
  Result<std::vector<uint8_t>> unique_id() override { return f_.unique_id(); }
  Result<std::unique_ptr<cuda::DomainComm>> connect(const std::vector<uint8_t>& id, int32_t size, int32_t rank,
                                                    Clock::time_point deadline) override {
    Result<std::unique_ptr<cuda::DomainComm>> c = f_.connect(id, size, rank, deadline);
    if (!c.is_ok()) return c;
    return std::unique_ptr<cuda::DomainComm>(std::make_unique<TamperComm>(std::move(c).value(), tamper_));
  }

 private:
  cuda::testing::HostCommFactory f_;
  Tamper tamper_;
};

struct Domain {
  FanoutCase c;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<RankFabric> fabrics;
  std::vector<NcclFabric*> nccl;

  PackLimits pack;
  bool can_scatter = true;
  uint32_t max_sends = kDefaultMaxSendsPerRound;  // of the ranks add() makes
  Tamper tamper;  // where set, the ranks add() makes lie with it

  Domain(int32_t ranks, uint32_t seed, uint64_t half = 24 << 10, uint64_t chunk = 4096,
         PackLimits limits = small_packs(), bool scatter = true)
      : c(testing::make_case(ranks, half, chunk, seed)), buffers(c.start), pack(limits), can_scatter(scatter) {
    for (int32_t r = 0; r < ranks; ++r) add(r);
  }
  void add(int32_t r) {
    NcclFabricConfig config;
    config.rank = r;
    config.pack = pack;
    config.max_sends_per_round = max_sends;
    std::unique_ptr<cuda::CommFactory> factory;
    if (tamper) {
      factory = std::make_unique<TamperFactory>(can_scatter, tamper);
    } else {
      factory = std::make_unique<cuda::testing::HostCommFactory>(can_scatter);
    }
    Result<std::unique_ptr<NcclFabric>> f = NcclFabric::create(config, std::move(factory));
    EXPECT_TRUE(f.is_ok()) << f.status().message();
    RankFabric rf;
    rf.contact = (*f)->contact();
    if (static_cast<size_t>(r) < nccl.size()) {
      nccl[r] = f->get();
      rf.fabric = std::move(f).value();
      fabrics[r] = std::move(rf);
    } else {
      nccl.push_back(f->get());
      rf.fabric = std::move(f).value();
      fabrics.push_back(std::move(rf));
    }
  }
  std::vector<Schedule> schedules(int64_t version) {
    buffers = c.start;
    for (size_t r = 0; r < fabrics.size(); ++r) {
      // What the coordinator would carry after a re-registration.
      if (nccl[r]->contact_changed()) fabrics[r].contact = nccl[r]->contact();
    }
    std::vector<Schedule> s;
    for (int32_t r = 0; r < c.ranks; ++r) s.push_back(testing::schedule_of(c, r, buffers, fabrics, version));
    return s;
  }
};

TEST(NcclFabric, KeepsTheCommunicatorWhileTheDomainIsUnchanged) {
  Domain d(3, 21);
  const std::vector<uint8_t> root_contact = d.fabrics[0].contact;
  const std::vector<uint8_t> other_contact = d.fabrics[1].contact;
  for (int64_t v = 1; v <= 3; ++v) {
    std::vector<Schedule> s = d.schedules(v);
    std::vector<Status> st = testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(20), 5);
    for (int32_t r = 0; r < 3; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << st[r].message();
      EXPECT_EQ(d.buffers[r], d.c.expected[r]);
      EXPECT_EQ(d.nccl[r]->communicators_built(), 1u) << "rank " << r << " version " << v;
    }
  }
  // The root's id served its one communicator: its contact changed (and was
  // re-registered by schedules()), the others' did not, and neither change
  // made the domain rebuild.
  EXPECT_NE(d.fabrics[0].contact, root_contact);
  EXPECT_EQ(d.fabrics[1].contact, other_contact);
  // A member that restarts (a new instance) changes the domain: everyone builds anew.
  d.add(2);
  std::vector<Schedule> s = d.schedules(4);
  std::vector<Status> st = testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(20), 6);
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].message();
    EXPECT_EQ(d.buffers[r], d.c.expected[r]);
  }
  EXPECT_EQ(d.nccl[0]->communicators_built(), 2u);
  EXPECT_EQ(d.nccl[1]->communicators_built(), 2u);
  EXPECT_EQ(d.nccl[2]->communicators_built(), 1u);
}

// Every byte lands, over as many refreshes as asked; returns the sends
// (not to itself) of all ranks in one refresh. `at_once`: each rank passes
// all its sends in one call, so that what a round finds ready (none or
// all) does not depend on timing.
size_t run_ok(Domain& d, int64_t versions, bool at_once = false) {
  size_t sends = 0;
  for (int64_t v = 1; v <= versions; ++v) {
    std::vector<Schedule> s = d.schedules(v);
    std::vector<Status> st =
        testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(20), 30 + v, {}, {}, at_once);
    sends = 0;
    for (int32_t r = 0; r < d.c.ranks; ++r) {
      EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].message();
      EXPECT_EQ(d.buffers[r], d.c.expected[r]) << "rank " << r << " version " << v;
      for (const Send& x : s[r].sends) sends += x.peer != kSelf;
    }
  }
  return sends;
}

TEST(NcclFabric, PacksTheSmallSendsOfARoundToOnePeer) {
  // 64 KiB areas, 4 ranks: a peer's share is 21 KiB, sends are up to 4 KiB.
  Domain d(4, 31);
  const size_t sends = run_ok(d, 2, /*at_once=*/true);
  uint64_t packs = 0, packed = 0;
  for (NcclFabric* f : d.nccl) {
    EXPECT_TRUE(f->packing());
    packs += f->packs_sent();
    packed += f->packed_sends();
  }
  // Every send of this case is far below the threshold and the share: all
  // went packed. All sends were ready in one round, so a peer's pack holds
  // several of them: fewer packs than sends.
  EXPECT_EQ(packed, 2 * sends);
  EXPECT_GT(packs, 0u);
  EXPECT_LT(packs, packed);
}

TEST(NcclFabric, ASmallPackAreaSplitsRoundsAndLargeSendsGoUnpacked) {
  // 5 ranks, 64 KiB areas: a peer's pack is at most 16 KiB a round; sends
  // are chunks of up to 12 KiB, and those of at least 10000 bytes go unpacked.
  PackLimits limits;
  limits.pack_bytes = kMinPackBytes;
  limits.pack_threshold = 10000;
  Domain d(5, 32, 1 << 20, 12 << 10, limits);
  // All sends ready in one round: a peer's sends pass its 16 KiB share there.
  const size_t sends = run_ok(d, 2, /*at_once=*/true);
  uint64_t packs = 0, packed = 0, full = 0;
  for (NcclFabric* f : d.nccl) {
    packs += f->packs_sent();
    packed += f->packed_sends();
    full += f->packs_full();
  }
  EXPECT_GT(full, 0u) << "no round stopped at a full pack";
  EXPECT_GT(packed, 0u);
  EXPECT_LT(packed, 2 * sends) << "some sends are above the threshold or the share";
  EXPECT_GT(packs, 0u);
}

TEST(NcclFabric, WithoutPackingOrAScatterEverySendGoesAsItIs) {
  PackLimits off;
  off.pack_bytes = 0;
  Domain a(3, 33, 24 << 10, 4096, off);
  run_ok(a, 1);
  Domain b(3, 33, 24 << 10, 4096, small_packs(), /*scatter=*/false);
  run_ok(b, 1);
  for (Domain* d : {&a, &b}) {
    for (NcclFabric* f : d->nccl) {
      EXPECT_FALSE(f->packing());
      EXPECT_EQ(f->packs_sent(), 0u);
    }
  }
}

TEST(NcclFabric, RanksThatPackDifferentlyAreRefusedNamingTheKey) {
  Domain d(3, 34);
  d.pack.pack_bytes = 1 << 20;  // rank 1 restarts with another pack area
  d.add(1);
  std::vector<Schedule> s = d.schedules(1);
  const Status st = d.nccl[0]->begin(s[0], Clock::now() + std::chrono::seconds(5));
  d.nccl[0]->end();
  ASSERT_EQ(st.code(), Code::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("\"pack_bytes\""), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("receiver rank 1"), std::string::npos) << st.message();

  NcclFabricConfig bad;
  bad.pack.pack_bytes = 1000;
  Result<std::unique_ptr<NcclFabric>> f = NcclFabric::create(bad, std::make_unique<cuda::testing::HostCommFactory>());
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("\"pack_bytes\""), std::string::npos) << f.status().message();
}

// begin() of rank 0 on the domain's contacts: what check_packing says.
Status begin_status(Domain& d) {
  std::vector<Schedule> s = d.schedules(1);
  const Status st = d.nccl[0]->begin(s[0], Clock::now() + std::chrono::seconds(5));
  d.nccl[0]->end();
  return st;
}

TEST(NcclFabric, TheThresholdMustAgreeOnlyWherePackingIsOn) {
  PackLimits off;
  off.pack_bytes = 0;
  off.pack_threshold = 4096;
  Domain a(3, 35, 24 << 10, 4096, off);
  a.pack.pack_threshold = 8192;  // unused where nothing packs
  a.add(1);
  run_ok(a, 1);

  PackLimits on;
  on.pack_bytes = kMinPackBytes;
  on.pack_threshold = 4096;
  Domain b(3, 36, 24 << 10, 4096, on);
  b.pack.pack_threshold = 8192;
  b.add(1);
  Status st = begin_status(b);
  ASSERT_EQ(st.code(), Code::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("receiver rank 1 packs with \"pack_bytes\" 65536 and \"pack_threshold\" 8192"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("receiver rank 0 packs with \"pack_bytes\" 65536 and \"pack_threshold\" 4096"),
            std::string::npos)
      << st.message();

  Domain c(3, 37, 24 << 10, 4096, on);
  c.pack = off;
  c.add(1);
  st = begin_status(c);
  ASSERT_EQ(st.code(), Code::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("receiver rank 1 does not pack"), std::string::npos) << st.message();
  EXPECT_EQ(st.message().find("with off"), std::string::npos) << st.message();
}

TEST(NcclFabric, AFailedRankTellsItsPeersAtOnce) {
  Domain d(3, 4);
  std::vector<Schedule> s = d.schedules(1);
  const auto t0 = Clock::now();
  std::vector<Status> st =
      testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(30), 9, {}, /*fail=*/{0});
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10)) << "the peers waited for their deadline";
  EXPECT_FALSE(st[0].is_ok());
  for (int32_t r : {1, 2}) {
    bool gets_from_0 = false;
    for (const Recv& x : s[r].recvs) gets_from_0 |= s[r].peers[x.peer].rank == 0;
    if (!gets_from_0) {
      EXPECT_TRUE(st[r].is_ok()) << st[r].message();
      continue;
    }
    EXPECT_EQ(st[r].code(), Code::kIoError) << st[r].message();
    EXPECT_NE(st[r].message().find("rank 0"), std::string::npos) << st[r].message();
  }
  // The next refresh, with nobody failing, works on the same communicator.
  s = d.schedules(2);
  st = testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(30), 10);
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << st[r].message();
    EXPECT_EQ(d.buffers[r], d.c.expected[r]);
  }
}

TEST(NcclFabric, AMissingRankIsATimeoutNotAHangAndTheDomainRebuilds) {
  Domain d(3, 8);
  std::vector<Schedule> s = d.schedules(1);
  const auto t0 = Clock::now();
  std::vector<Status> st =
      testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::milliseconds(300), 3, /*skip=*/{2});
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  for (int32_t r : {0, 1}) {
    EXPECT_EQ(st[r].code(), Code::kTimeout) << st[r].message();
    EXPECT_TRUE(d.nccl[r]->contact_changed()) << "an aborted rank must publish a new contact";
  }
  // Once the contacts are re-registered, the whole domain builds a new communicator.
  s = d.schedules(2);
  st = testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::seconds(20), 4);
  for (int32_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].message();
    EXPECT_EQ(d.buffers[r], d.c.expected[r]);
  }
}

// Rank 0 passes eight slices to rank 1; the first in plan order is still
// "on its way" (not passed) while the other seven are. They cross at once:
// rounds go in the order sends became ready, not in plan order. (Before,
// a round took the ready prefix, and rank 1 received nothing until the
// first slice was passed.)
TEST(NcclFabric, ASliceStillOnItsWayDoesNotHoldBackTheOnesThatLanded) {
  Domain d(2, 5);
  FanoutCase& c = d.c;
  c.plan.clear();
  c.start.assign(2, std::vector<uint8_t>(2 * c.half, 0));
  c.expected = c.start;
  for (uint64_t k = 0; k < 8; ++k) {
    for (uint64_t i = 0; i < 1024; ++i) {
      const auto v = static_cast<uint8_t>(1 + (k * 31 + i) % 251);
      c.start[0][k * 1024 + i] = v;
      c.expected[0][k * 1024 + i] = v;
      c.expected[1][k * 1024 + i] = v;
    }
    c.plan.push_back(testing::Transfer{0, 1, k * 1024, 1024});
  }
  std::vector<Schedule> s = d.schedules(1);
  ASSERT_EQ(s[0].sends.size(), 8u);
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(20);
  for (int32_t r = 0; r < 2; ++r) ASSERT_TRUE(d.fabrics[r].fabric->begin(s[r], deadline).is_ok());
  Status received;
  std::thread rank1([&] { received = d.fabrics[1].fabric->finish(false); });
  const std::vector<uint32_t> landed = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(d.fabrics[0].fabric->send(landed).is_ok());
  const Clock::time_point give_up = Clock::now() + std::chrono::seconds(10);
  while (d.nccl[1]->slices_received() < 7 && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(d.nccl[1]->slices_received(), 7u) << "the seven landed slices waited for the first";
  const std::vector<uint32_t> first = {0};
  ASSERT_TRUE(d.fabrics[0].fabric->send(first).is_ok());
  const Status sent = d.fabrics[0].fabric->finish(false);
  rank1.join();
  for (int32_t r = 0; r < 2; ++r) d.fabrics[r].fabric->end();
  ASSERT_TRUE(sent.is_ok()) << sent.message();
  ASSERT_TRUE(received.is_ok()) << received.message();
  EXPECT_EQ(d.nccl[1]->slices_received(), 8u);
  EXPECT_EQ(d.buffers[1], c.expected[1]);
}

// Rank 0 passes seven of its eight slices to rank 1, in ready order, and
// never the first: at the deadline (1 s) both time out, each naming the other
// (rank 1 is owed a slice by rank 0, rank 0 owes one to rank 1), and the
// seven that crossed have landed.
TEST(NcclFabric, ASliceNeverPassedIsATimeoutNamingThePairAtBothEnds) {
  Domain d(2, 5);
  FanoutCase& c = d.c;
  c.plan.clear();
  c.start.assign(2, std::vector<uint8_t>(2 * c.half, 0));
  c.expected = c.start;
  for (uint64_t k = 0; k < 8; ++k) {
    for (uint64_t i = 0; i < 1024; ++i) c.start[0][k * 1024 + i] = static_cast<uint8_t>(1 + (k * 31 + i) % 251);
    c.plan.push_back(testing::Transfer{0, 1, k * 1024, 1024});
  }
  std::vector<Schedule> s = d.schedules(1);
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
  for (int32_t r = 0; r < 2; ++r) ASSERT_TRUE(d.fabrics[r].fabric->begin(s[r], deadline).is_ok());
  Status received;
  std::thread rank1([&] { received = d.fabrics[1].fabric->finish(false); });
  const std::vector<uint32_t> landed = {7, 3, 5, 1, 2, 6, 4};
  ASSERT_TRUE(d.fabrics[0].fabric->send(landed).is_ok());
  std::this_thread::sleep_until(deadline + std::chrono::milliseconds(100));
  const Status sent = d.fabrics[0].fabric->finish(true);
  rank1.join();
  EXPECT_LT(Clock::now() - deadline, std::chrono::seconds(3));
  for (int32_t r = 0; r < 2; ++r) d.fabrics[r].fabric->end();
  EXPECT_EQ(sent.code(), Code::kTimeout) << sent.message();
  EXPECT_NE(sent.message().find("receiver rank(s) 1 "), std::string::npos) << sent.message();
  EXPECT_EQ(received.code(), Code::kTimeout) << received.message();
  EXPECT_NE(received.message().find("receiver rank(s) 0 "), std::string::npos) << received.message();
  EXPECT_EQ(d.nccl[1]->slices_received(), 7u);
  for (uint64_t i = 1024; i < 8 * 1024; ++i) ASSERT_EQ(d.buffers[1][i], c.start[0][i]) << "byte " << i;
  for (uint64_t i = 0; i < 1024; ++i) ASSERT_EQ(d.buffers[1][i], 0) << "byte " << i;
}

TEST(NcclFabric, RanksThatRunDifferentPlansFailInsteadOfWritingWrongBytes) {
  uint32_t seed = 12;
  auto crosses = [](const FanoutCase& c) {
    for (const testing::Transfer& t : c.plan) {
      if (t.from != t.to) return true;
    }
    return false;
  };
  while (!crosses(testing::make_case(2, 24 << 10, 4096, seed))) ++seed;
  Domain d(2, seed);
  std::vector<Schedule> s = d.schedules(1);
  // Rank 1 expects one byte less of the first slice from rank 0.
  Schedule* receiver = nullptr;
  for (Schedule& x : s) {
    if (!x.recvs.empty() && !receiver) receiver = &x;
  }
  ASSERT_NE(receiver, nullptr);
  receiver->recvs[0].bytes -= 1;
  std::vector<Status> st = testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::milliseconds(500), 1);
  bool plan_error = false;
  for (const Status& x : st) {
    EXPECT_FALSE(x.is_ok());
    plan_error |= x.message().find("different plans") != std::string::npos;
  }
  EXPECT_TRUE(plan_error);
}

// Two receives of one round whose sizes differ from the sender's by one
// byte each way: the count and the byte sum agree, the sizes do not. Packed,
// the pieces would be scattered one byte off without an error anywhere.
TEST(NcclFabric, ARoundWhoseSizesDifferWithAnEqualSumIsRefusedNamingThePeer) {
  uint32_t seed = 40;
  auto two_from_0 = [](const FanoutCase& c) {
    int to_1 = 0;
    for (const testing::Transfer& t : c.plan) to_1 += t.from == 0 && t.to == 1 && t.bytes >= 2;
    return to_1 >= 2;
  };
  while (!two_from_0(testing::make_case(2, 24 << 10, 4096, seed))) ++seed;
  PackLimits off;
  off.pack_bytes = 0;
  PackLimits small;
  small.pack_bytes = kMinPackBytes;
  for (const PackLimits& limits : {small, off}) {
    Domain d(2, seed, 24 << 10, 4096, limits);
    std::vector<Schedule> s = d.schedules(1);
    std::vector<Recv>& recvs = s[1].recvs;  // all from rank 0, in its send order
    ASSERT_GE(recvs.size(), 2u);
    ASSERT_GE(recvs[0].bytes, 2u);
    recvs[0].bytes -= 1;
    recvs[1].bytes += 1;
    // All sends passed in one call: the two go in the same round.
    std::vector<Status> st =
        testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::milliseconds(500), 1, {}, {}, true);
    ASSERT_FALSE(st[1].is_ok()) << "pack_bytes " << limits.pack_bytes;
    EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].message();
    EXPECT_NE(st[1].message().find("receiver rank 0 announced"), std::string::npos) << st[1].message();
    EXPECT_NE(st[1].message().find("sizes (digest) differ"), std::string::npos) << st[1].message();
    EXPECT_FALSE(st[0].is_ok()) << "the sender's round cannot complete";
  }
}

// A peer whose announcements are anything at all (round_words.h): each
// lie below is told in one round of rank 0 to rank 1, packing on and off.
// Rank 1 must refuse it naming rank 0, both ranks must return by their
// deadline (300 ms), and rank 1 must write nothing but bytes of its own
// receives (each byte of its buffer is as it was or as the plan leaves it).
TEST(NcclFabric, AnyAnnouncementAPeerMakesUpIsRefusedInTime) {
  constexpr size_t W = kRoundWordsPerPeer;
  constexpr uint64_t kSlices = 64;
  using Lie = std::function<void(uint64_t* w, const uint64_t* first, std::mt19937_64& rng)>;
  const uint64_t max = UINT64_MAX;
  std::vector<std::pair<const char*, Lie>> lies = {
      {"count + 1", [](uint64_t* w, const uint64_t*, auto&) { ++w[0]; }},
      {"count past the list", [](uint64_t* w, const uint64_t*, auto&) { w[0] = kSlices + 1; }},
      {"count 0 with ranges", [](uint64_t* w, const uint64_t*, auto&) { w[0] = 0; }},
      {"bytes + 1", [](uint64_t* w, const uint64_t*, auto&) { ++w[1]; }},
      {"digest", [](uint64_t* w, const uint64_t*, auto&) { w[2] ^= 1; }},
      {"one range too many", [](uint64_t* w, const uint64_t*, auto&) { w[3] = kMaxRanges + 1; }},
      {"max ranges", [max](uint64_t* w, const uint64_t*, auto&) { w[3] = max; }},
      {"no ranges", [](uint64_t* w, const uint64_t*, auto&) { w[3] = 0; }},
      {"start at the end", [](uint64_t* w, const uint64_t*, auto&) { w[4] = kSlices; }},
      {"start max", [max](uint64_t* w, const uint64_t*, auto&) { w[4] = max; }},
      {"length max", [max](uint64_t* w, const uint64_t*, auto&) { w[5] = max; }},
      {"start + length wraps", [max](uint64_t* w, const uint64_t*, auto&) { w[4] = 1, w[5] = max; }},
      {"empty range", [](uint64_t* w, const uint64_t*, auto&) { w[5] = 0; }},
      {"one range twice",
       [](uint64_t* w, const uint64_t*, auto&) {
         w[3] = 2, w[6] = w[4], w[7] = w[5], w[0] = 2 * w[5];
       }},
      {"a round told again", [](uint64_t* w, const uint64_t* first, auto&) { std::copy(first, first + W, w); }},
      {"random words",
       [](uint64_t* w, const uint64_t*, std::mt19937_64& rng) {
         for (size_t k = 0; k < W; ++k) w[k] = rng();
       }},
      {"random small words",
       [](uint64_t* w, const uint64_t*, std::mt19937_64& rng) {
         w[0] = rng() % (kSlices + 2);
         w[3] = rng() % (kMaxRanges + 2);
         for (size_t k = 4; k < W; ++k) w[k] = rng() % (kSlices + 2);
       }},
  };
  PackLimits off;
  off.pack_bytes = 0;
  for (const PackLimits& limits : {small_packs(), off}) {
    for (size_t which = 0; which < lies.size(); ++which) {
      SCOPED_TRACE(std::string(lies[which].first) + ", pack_bytes " + std::to_string(limits.pack_bytes));
      Domain d(2, 60, 24 << 10, 4096, limits);
      FanoutCase& c = d.c;
      c.plan.clear();
      c.start.assign(2, std::vector<uint8_t>(2 * c.half, 0));
      c.expected = c.start;
      uint64_t at = 0;
      for (uint64_t k = 0; k < kSlices; ++k) {  // sizes that differ: the digest sees a swap
        const uint64_t n = 64 + 8 * k;
        for (uint64_t i = 0; i < n; ++i) {
          const auto v = static_cast<uint8_t>(1 + (k * 37 + i) % 251);
          c.start[0][at + i] = v;
          c.expected[1][at + i] = v;
        }
        c.expected[0][at] = c.start[0][at];
        c.plan.push_back(testing::Transfer{0, 1, at, n});
        at += n + 16;
      }
      c.expected[0] = c.start[0];
      // Rank 0 lies in its second round that passes something on, and
      // passes at most 8 a round, so that there is one.
      int told = 0;
      std::vector<uint64_t> first(W, 0);
      std::mt19937_64 rng(which);
      d.max_sends = 8;
      d.tamper = [&, which](int, uint64_t* words, size_t n) {
        if (n < 2 * W) return;
        uint64_t* w = words + W;  // to NCCL rank 1
        if (w[0] == 0 || w[0] == NcclFabric::kFailedMarker) return;
        if (++told == 1) {
          std::copy(w, w + W, first.begin());
        } else if (told == 2) {
          lies[which].second(w, first.data(), rng);
        }
      };
      d.add(0);
      d.tamper = nullptr;
      std::vector<Schedule> s = d.schedules(1);
      ASSERT_EQ(s[1].recvs.size(), kSlices);
      const auto t0 = Clock::now();
      std::vector<Status> st =
          testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::milliseconds(300), 7);
      EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3)) << "a rank waited past its deadline";
      ASSERT_EQ(told >= 2, true) << "rank 0 passed everything on in one round";
      EXPECT_FALSE(st[1].is_ok());
      EXPECT_NE(st[1].message().find("receiver rank 0"), std::string::npos) << st[1].message();
      for (size_t i = 0; i < d.buffers[1].size(); ++i) {
        const uint8_t b = d.buffers[1][i];
        ASSERT_TRUE(b == c.start[1][i] || b == c.expected[1][i]) << "byte " << i << " of rank 1";
      }
    }
  }
}

// Rank 0 passes 200 slices to rank 1, 40 copies to itself and takes 100
// from rank 1, its sends ready in orders and batches that make rounds of
// many ranges (every other slice, then the rest; all in reverse; random
// batches), packing off, on, and with an area that splits the rounds.
// Every byte lands, each receive is announced once, and the cap on ranges
// (kMaxRanges) binds in some round.
TEST(NcclFabric, EveryByteLandsOnceInAnyOrderAndBatching) {
  constexpr size_t W = kRoundWordsPerPeer;
  PackLimits off;
  off.pack_bytes = 0;
  // 64 KiB areas: a round's pack to rank 1 holds about a third of its
  // slices; with a threshold of 800 bytes, half of them go unpacked.
  PackLimits mixed = small_packs();
  mixed.pack_threshold = 800;
  for (const PackLimits& limits : {off, small_packs(), mixed}) {
    for (int order_kind = 0; order_kind < 3; ++order_kind) {
      SCOPED_TRACE("order " + std::to_string(order_kind) + ", pack_bytes " + std::to_string(limits.pack_bytes) +
                   ", pack_threshold " + std::to_string(limits.pack_threshold));
      Domain d(2, 61, 256 << 10, 4096, limits);
      FanoutCase& c = d.c;
      c.plan.clear();
      c.start.assign(2, std::vector<uint8_t>(2 * c.half, 0));
      uint64_t at = 0;
      auto slice = [&](int32_t from, int32_t to, uint64_t n) {
        for (uint64_t i = 0; i < n; ++i) c.start[from][at + i] = static_cast<uint8_t>(1 + (at * 7 + i) % 253);
        c.plan.push_back(testing::Transfer{from, to, at, n});
        at += n + 8;
      };
      for (uint64_t k = 0; k < 200; ++k) {
        slice(0, 1, 500 + 3 * k);
        if (k % 5 == 0) c.plan.push_back(testing::Transfer{0, 0, c.plan.back().offset, c.plan.back().bytes});
        if (k % 2 == 0) slice(1, 0, 100 + k);
      }
      ASSERT_LE(at, c.half);
      c.expected = c.start;
      for (const testing::Transfer& t : c.plan) {
        const uint64_t to = t.to == t.from ? c.half + t.offset : t.offset;
        std::copy_n(c.start[t.from].begin() + static_cast<std::ptrdiff_t>(t.offset), t.bytes,
                    c.expected[t.to].begin() + static_cast<std::ptrdiff_t>(to));
      }
      uint64_t most_ranges = 0;
      d.tamper = [&](int, uint64_t* words, size_t n) {  // only looks
        if (n >= 2 * W && words[W] != NcclFabric::kFailedMarker) most_ranges = std::max(most_ranges, words[W + 3]);
      };
      d.add(0);
      d.tamper = nullptr;
      std::vector<Schedule> s = d.schedules(1);
      const uint64_t received_before = d.nccl[1]->slices_received() + d.nccl[0]->slices_received();
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(20);
      for (int32_t r = 0; r < 2; ++r) ASSERT_TRUE(d.fabrics[r].fabric->begin(s[r], deadline).is_ok());
      Status got1;
      std::thread rank1([&] {
        std::vector<uint32_t> all(s[1].sends.size());
        for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
        got1 = d.fabrics[1].fabric->send(all);
        const Status fin = d.fabrics[1].fabric->finish(!got1.is_ok());
        if (got1.is_ok()) got1 = fin;
      });
      std::vector<uint32_t> order(s[0].sends.size());
      for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
      std::vector<size_t> batches;
      if (order_kind == 0) {
        std::stable_partition(order.begin(), order.end(), [](uint32_t i) { return i % 2 == 0; });
        batches = {order.size() / 2, order.size() - order.size() / 2};
      } else if (order_kind == 1) {
        std::reverse(order.begin(), order.end());
        batches = {order.size()};
      } else {
        std::mt19937 rng(62);
        std::shuffle(order.begin(), order.end(), rng);
        for (size_t left = order.size(); left > 0;) {
          batches.push_back(std::min<size_t>(left, 1 + rng() % 60));
          left -= batches.back();
        }
      }
      Status got0;
      for (size_t i = 0, b = 0; b < batches.size() && got0.is_ok(); i += batches[b++]) {
        got0 = d.fabrics[0].fabric->send(std::span<const uint32_t>(order.data() + i, batches[b]));
      }
      const Status fin0 = d.fabrics[0].fabric->finish(!got0.is_ok());
      rank1.join();
      for (int32_t r = 0; r < 2; ++r) d.fabrics[r].fabric->end();
      ASSERT_TRUE(got0.is_ok()) << got0.message();
      ASSERT_TRUE(fin0.is_ok()) << fin0.message();
      ASSERT_TRUE(got1.is_ok()) << got1.message();
      EXPECT_EQ(d.buffers[0], c.expected[0]);
      EXPECT_EQ(d.buffers[1], c.expected[1]);
      EXPECT_EQ(d.nccl[1]->slices_received() + d.nccl[0]->slices_received() - received_before,
                s[0].recvs.size() + s[1].recvs.size());
      if (order_kind < 2) {
        EXPECT_EQ(most_ranges, kMaxRanges);
      }
    }
  }
}

// The scatter tables are sized once, for max_sends_per_round pieces per
// peer: a peer that packs more in one round is refused with a status, not
// given a bigger table behind work in flight.
TEST(NcclFabric, APeerThatPacksMoreThanTheTablesHoldIsRefused) {
  uint32_t seed = 50;
  auto many_from_0 = [](const FanoutCase& c) {
    int to_1 = 0;
    for (const testing::Transfer& t : c.plan) to_1 += t.from == 0 && t.to == 1;
    return to_1 >= 4;
  };
  while (!many_from_0(testing::make_case(2, 24 << 10, 1024, seed))) ++seed;
  PackLimits small;
  small.pack_bytes = kMinPackBytes;
  Domain d(2, seed, 24 << 10, 1024, small);
  d.max_sends = 2;  // rank 1's tables hold 2 pieces; rank 0 packs up to 256
  d.add(1);
  std::vector<Schedule> s = d.schedules(1);
  std::vector<Status> st =
      testing::run_refresh(d.fabrics, s, Clock::now() + std::chrono::milliseconds(500), 1, {}, {}, true);
  ASSERT_FALSE(st[1].is_ok());
  EXPECT_EQ(st[1].code(), Code::kInvalidArgument) << st[1].message();
  EXPECT_NE(st[1].message().find("receiver rank 0 packed"), std::string::npos) << st[1].message();
  EXPECT_NE(st[1].message().find("max_sends_per_round"), std::string::npos) << st[1].message();
}

TEST(HostComm, ScatterRefusesPiecesOutsideItsAreasOrBeyondItsTable) {
  cuda::testing::HostCommFactory factory;
  Result<std::vector<uint8_t>> id = factory.unique_id();
  ASSERT_TRUE(id.is_ok());
  Result<std::unique_ptr<cuda::DomainComm>> comm = factory.connect(*id, 1, 0, Clock::now() + std::chrono::seconds(5));
  ASSERT_TRUE(comm.is_ok()) << comm.status().message();
  Result<cuda::DomainComm::PackAreas> a = (*comm)->pack_areas(4096, 2);
  ASSERT_TRUE(a.is_ok()) << a.status().message();
  std::vector<uint8_t> buffer(4096, 7);
  using Piece = cuda::ScatterPiece;
  auto ok = [&](std::vector<Piece> pieces) { return (*comm)->scatter(pieces).is_ok(); };
  EXPECT_TRUE(ok({Piece{a->send, buffer.data(), 100}, Piece{a->send + 112, buffer.data() + 100, 50}}));
  EXPECT_TRUE(ok({Piece{buffer.data(), a->recv, 4096}}));
  EXPECT_FALSE(ok({Piece{a->send + 4000, buffer.data(), 100}})) << "past the send area";
  EXPECT_FALSE(ok({Piece{buffer.data(), a->recv + 1, 4096}})) << "past the receive area";
  EXPECT_FALSE(ok({Piece{buffer.data(), buffer.data() + 10, 10}})) << "neither a gather nor a scatter";
  EXPECT_FALSE(ok({Piece{a->recv, a->send, 10}})) << "area to area";
  EXPECT_FALSE(ok({Piece{a->send, buffer.data(), 0}})) << "no bytes";
  EXPECT_FALSE(ok({Piece{a->send, buffer.data(), 100}, Piece{a->send + 96, buffer.data(), 100}})) << "overlap";
  EXPECT_FALSE(ok({Piece{a->send, buffer.data(), 1}, Piece{a->send + 16, buffer.data(), 1},
                   Piece{a->send + 32, buffer.data(), 1}}))
      << "more pieces than pack_areas() was sized for";
  Result<bool> idle = (*comm)->idle();
  ASSERT_TRUE(idle.is_ok()) << idle.status().message();
  EXPECT_TRUE(*idle);
}

TEST(NcclFabric, ASingleRankDomainCopiesToItself) {
  FanoutCase c = testing::make_case(1, 16 << 10, 1024, 2);
  std::vector<std::vector<uint8_t>> buffers = c.start;
  Result<std::unique_ptr<NcclFabric>> f =
      NcclFabric::create(NcclFabricConfig{}, std::make_unique<cuda::testing::HostCommFactory>());
  ASSERT_TRUE(f.is_ok());
  // make_case with one rank has no consumers: add mirror copies of everything.
  c.plan.clear();
  for (uint64_t o = 0; o < c.half; o += 1024) c.plan.push_back(testing::Transfer{0, 0, o, 1024});
  for (uint64_t i = 0; i < c.half; ++i) c.expected[0][c.half + i] = c.start[0][i];
  std::vector<RankFabric> fabrics(1);
  fabrics[0].contact = (*f)->contact();
  fabrics[0].fabric = std::move(f).value();
  std::vector<Schedule> s = {testing::schedule_of(c, 0, buffers, fabrics, 1)};
  std::vector<Status> st = testing::run_refresh(fabrics, s, Clock::now() + std::chrono::seconds(10), 1);
  ASSERT_TRUE(st[0].is_ok()) << st[0].message();
  EXPECT_EQ(buffers[0], c.expected[0]);
}

// The round thread starts at begin(): refused, begin() says so and the
// fabric stays usable and safe to destroy.
TEST(NcclFabric, ARoundThreadThatCannotStartFailsBeginNotTheProcess) {
  FanoutCase c = testing::make_case(1, 16 << 10, 1024, 2);
  std::vector<std::vector<uint8_t>> buffers = c.start;
  NcclFabricConfig config;
  config.threads = ThreadFactory::refusing_after(0);
  Result<std::unique_ptr<NcclFabric>> f = NcclFabric::create(config, std::make_unique<cuda::testing::HostCommFactory>());
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  c.plan.clear();
  for (uint64_t o = 0; o < c.half; o += 1024) c.plan.push_back(testing::Transfer{0, 0, o, 1024});
  std::vector<RankFabric> fabrics(1);
  fabrics[0].contact = (*f)->contact();
  fabrics[0].fabric = std::move(f).value();
  const Schedule s = testing::schedule_of(c, 0, buffers, fabrics, 1);
  Status st = fabrics[0].fabric->begin(s, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(st.reason(), Reason::kNoThread) << st.message();
  EXPECT_NE(st.message().find("cannot start the nccl fabric rounds thread"), std::string::npos) << st.message();
  EXPECT_FALSE(fabrics[0].fabric->finish(false).is_ok());
  fabrics[0].fabric->end();
}

// Bytes that end where a page no one may read begins: a read past them is
// a SIGSEGV, not a silent look at whatever the heap holds there.
class GuardedBytes {
 public:
  GuardedBytes() {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, 2 * page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(m, MAP_FAILED);
    base_ = static_cast<uint8_t*>(m);
    EXPECT_EQ(mprotect(base_ + page_, page_, PROT_NONE), 0);
  }
  ~GuardedBytes() { munmap(base_, 2 * page_); }
  std::span<const uint8_t> hold(std::span<const uint8_t> bytes) {
    uint8_t* at = base_ + page_ - bytes.size();
    if (!bytes.empty()) std::memcpy(at, bytes.data(), bytes.size());
    return {at, bytes.size()};
  }

 private:
  size_t page_ = 0;
  uint8_t* base_ = nullptr;
};

TEST(NcclFabric, ParseContactReadsOnlyTheBytesItIsGivenAndRefusesWrongLengths) {
  Result<std::unique_ptr<NcclFabric>> f =
      NcclFabric::create(NcclFabricConfig{}, std::make_unique<cuda::testing::HostCommFactory>());
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  const std::vector<uint8_t> contact = (*f)->contact();
  Result<NcclFabric::ContactInfo> whole = NcclFabric::parse_contact(contact, 3);
  ASSERT_TRUE(whole.is_ok()) << whole.status().message();
  const size_t id_bytes = whole->id.size();
  ASSERT_GT(id_bytes, 0u);
  const size_t header = contact.size() - id_bytes;
  EXPECT_EQ(whole->pack_bytes, kDefaultPackBytes);
  EXPECT_EQ(whole->pack_threshold, kDefaultPackThreshold);

  GuardedBytes guard;
  // Every prefix: only the whole contact is one.
  for (size_t len = 0; len <= contact.size(); ++len) {
    Result<NcclFabric::ContactInfo> c =
        NcclFabric::parse_contact(guard.hold(std::span<const uint8_t>(contact.data(), len)), 3);
    if (len == contact.size()) {
      ASSERT_TRUE(c.is_ok()) << c.status().message();
      EXPECT_EQ(c->id, whole->id);
      continue;
    }
    ASSERT_FALSE(c.is_ok()) << len << " bytes";
    EXPECT_EQ(c.status().code(), Code::kInvalidArgument) << len << " bytes";
    EXPECT_NE(c.status().message().find("receiver rank 3"), std::string::npos) << c.status().message();
  }
  // One byte more than the id it announces.
  std::vector<uint8_t> longer = contact;
  longer.push_back(0);
  EXPECT_FALSE(NcclFabric::parse_contact(guard.hold(longer), 3).is_ok());
  // An id length field that disagrees with the bytes that follow.
  for (uint64_t n : {uint64_t{0}, uint64_t{id_bytes - 1}, uint64_t{id_bytes + 1}, uint64_t{UINT32_MAX}}) {
    std::vector<uint8_t> b = contact;
    for (int i = 0; i < 4; ++i) b[header - 4 + i] = static_cast<uint8_t>(n >> (8 * i));
    Result<NcclFabric::ContactInfo> c = NcclFabric::parse_contact(guard.hold(b), 3);
    ASSERT_FALSE(c.is_ok()) << "id length " << n;
    EXPECT_NE(c.status().message().find("unique id"), std::string::npos) << c.status().message();
  }
}

TEST(NcclFabric, RefusesAScheduleItCannotRun) {
  Domain d(2, 1);
  std::vector<Schedule> s = d.schedules(1);
  LocalFabric& f = *d.fabrics[0].fabric;
  Schedule bad = s[0];
  bad.domain[1].contact = {'R', 'F', 'C', 'T', 0, 0};  // a UCX fabric's contact
  Status st = f.begin(bad, Clock::now() + std::chrono::seconds(1));
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("receiver rank 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("same \"local\" fabric"), std::string::npos) << st.message();
  f.end();
  bad = s[0];
  std::swap(bad.domain[0], bad.domain[1]);
  st = f.begin(bad, Clock::now() + std::chrono::seconds(1));
  EXPECT_NE(st.message().find("increasing rank order"), std::string::npos) << st.message();
  f.end();
  bad = s[0];
  if (!bad.sends.empty()) {
    bad.sends[0].peer = 7;
    bad.sends[0].self_dst = nullptr;
    st = f.begin(bad, Clock::now() + std::chrono::seconds(1));
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.message();
    f.end();
  }
  EXPECT_FALSE(f.send(std::vector<uint32_t>{0}).is_ok()) << "send() outside begin() must fail, not crash";
  EXPECT_FALSE(f.finish(false).is_ok());
  EXPECT_FALSE(d.nccl[0]->register_buffer("x", nullptr, 0).is_ok());
}

}  // namespace
}  // namespace refit::fabric

namespace refit::fabric {
namespace {

TEST(NcclFabric, CancelEndsTheWaitForPeersAtOnce) {
  // Rank 1 owes rank 0 bytes but never passes them on; both are cancelled
  // long before their deadline (as the agent does when its instance aborts).
  uint32_t seed = 30;
  auto owes = [](const testing::FanoutCase& c) {
    for (const testing::Transfer& t : c.plan) {
      if (t.from == 1 && t.to == 0) return true;
    }
    return false;
  };
  while (!owes(testing::make_case(2, 24 << 10, 4096, seed))) ++seed;
  testing::FanoutCase c = testing::make_case(2, 24 << 10, 4096, seed);
  std::vector<std::vector<uint8_t>> buffers = c.start;
  std::vector<RankFabric> fabrics;
  std::vector<NcclFabric*> nccl;
  for (int32_t r = 0; r < 2; ++r) {
    NcclFabricConfig config;
    config.rank = r;
    config.pack = small_packs();
    Result<std::unique_ptr<NcclFabric>> f =
        NcclFabric::create(config, std::make_unique<cuda::testing::HostCommFactory>());
    ASSERT_TRUE(f.is_ok());
    RankFabric rf;
    rf.contact = (*f)->contact();
    nccl.push_back(f->get());
    rf.fabric = std::move(f).value();
    fabrics.push_back(std::move(rf));
  }
  std::vector<Schedule> s;
  for (int32_t r = 0; r < 2; ++r) s.push_back(testing::schedule_of(c, r, buffers, fabrics, 1));
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  std::vector<Status> st(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Status b = nccl[r]->begin(s[r], deadline);
      if (!b.is_ok()) {
        st[r] = b;
        return;
      }
      if (r == 0) {
        std::vector<uint32_t> all(s[0].sends.size());
        for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
        b = nccl[0]->send(all);
      }
      if (r == 1) {
        // Stalls (its network never lands) until its instance is aborted.
        while (!nccl[1]->cancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      st[r] = nccl[r]->finish(r == 1);
      nccl[r]->end();
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = Clock::now();
  nccl[0]->cancel();
  nccl[1]->cancel();
  for (std::thread& t : threads) t.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  EXPECT_FALSE(st[0].is_ok());
  EXPECT_NE(st[0].message().find("cancelled"), std::string::npos) << st[0].message();
}

}  // namespace
}  // namespace refit::fabric
