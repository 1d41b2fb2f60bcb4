// The mailbox's fence (mailbox.h) through both host fabrics: a sender whose
// attempt outlived its receiver's must not write into the receiver's next
// version. Two ranks in one process (the cma fabric writes to its own pid,
// the UCX one over shared memory): rank 0 sends one 4 KiB slice to rank 1.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "transport/fabric/cma_fabric.h"
#include "transport/fabric/mailbox.h"
#include "transport/fabric/ucx_fabric.h"

namespace refit::fabric {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBytes = 4096;

TEST(Mailbox, AcceptingWordTellsASenderToWriteWaitOrStop) {
  const uint64_t open = mailbox::flag(3, PlanEpoch{7}, false);
  EXPECT_EQ(mailbox::accepting(open, 3, PlanEpoch{7}), mailbox::Accepting::kWrite);
  EXPECT_EQ(mailbox::accepting(0, 3, PlanEpoch{7}), mailbox::Accepting::kWait);                             // not begun
  EXPECT_EQ(mailbox::accepting(mailbox::flag(2, PlanEpoch{7}, true), 3, PlanEpoch{7}), mailbox::Accepting::kWait);     // earlier version
  EXPECT_EQ(mailbox::accepting(mailbox::flag(3, PlanEpoch{6}, false), 3, PlanEpoch{7}), mailbox::Accepting::kWait);    // earlier epoch
  EXPECT_EQ(mailbox::accepting(open | 1, 3, PlanEpoch{7}), mailbox::Accepting::kStop);                       // over there
  EXPECT_EQ(mailbox::accepting(mailbox::flag(4, PlanEpoch{1}, false), 3, PlanEpoch{7}), mailbox::Accepting::kStop);    // went on
  EXPECT_EQ(mailbox::accepting(mailbox::flag(3, PlanEpoch{7, true}, false), 3, PlanEpoch{7}),           // went solo
            mailbox::Accepting::kStop);
}

TEST(Mailbox, CloseClearsTheSlotsAndRemembersSendersWithoutTheirFlag) {
  std::vector<uint64_t> slots(mailbox::kWords, 0);
  const std::vector<mailbox::Fence::Sender> senders = {{1, nullptr}, {2, nullptr}, {3, nullptr}};
  slots[1] = mailbox::flag(5, PlanEpoch{2}, false);  // finished
  slots[2] = mailbox::flag(5, PlanEpoch{2}, true);   // failed: ended too
  slots[3] = mailbox::flag(4, PlanEpoch{2}, false);  // a stale flag: rank 3 may still write version 5
  mailbox::Fence fence;
  fence.close(slots.data(), senders, 5, PlanEpoch{2}, /*ok=*/false);
  EXPECT_EQ(fence.open(), 1u);
  EXPECT_EQ(slots[1], mailbox::flag(5, PlanEpoch{2}, false)) << "a retry of the attempt keeps what a peer finished";
  EXPECT_EQ(slots[2], 0u);
  EXPECT_EQ(slots[3], 0u);

  // The same version again waits for nobody: late bytes would be the same.
  EXPECT_TRUE(fence.wait(slots.data(), 5, std::chrono::steady_clock::now()).is_ok());
  // Another version waits for rank 3's flag, and names it when it times out.
  Status st = fence.wait(slots.data(), 6, std::chrono::steady_clock::now() + 20ms);
  ASSERT_EQ(st.code(), Code::kTimeout);
  EXPECT_NE(st.message().find("receiver rank 3 may still be writing version 5"), std::string::npos) << st.message();
  slots[3] = mailbox::flag(5, PlanEpoch{2}, true);
  EXPECT_TRUE(fence.wait(slots.data(), 6, std::chrono::steady_clock::now() + 1s).is_ok());
  EXPECT_EQ(fence.open(), 0u);
  EXPECT_EQ(slots[3], 0u) << "the flag that ended the wait is consumed";

  // A sender whose attempt is over by other signs (Sender::over) ends the wait too.
  std::atomic<bool> over{false};
  const std::vector<mailbox::Fence::Sender> one = {{9, [&](uint64_t open) {
                                                      EXPECT_EQ(open, mailbox::flag(6, PlanEpoch{2}, false));
                                                      return over.load();
                                                    }}};
  fence.close(slots.data(), one, 6, PlanEpoch{2}, /*ok=*/false);
  EXPECT_EQ(fence.wait(slots.data(), 7, std::chrono::steady_clock::now() + 20ms).code(), Code::kTimeout);
  over = true;
  EXPECT_TRUE(fence.wait(slots.data(), 7, std::chrono::steady_clock::now() + 1s).is_ok());

  // After an attempt that succeeded every slot is cleared.
  slots[1] = mailbox::flag(7, PlanEpoch{2}, false);
  fence.close(slots.data(), std::vector<mailbox::Fence::Sender>{{1, nullptr}}, 7, PlanEpoch{2}, /*ok=*/true);
  EXPECT_EQ(slots[1], 0u);
  EXPECT_EQ(fence.open(), 0u);
}

struct Rank {
  std::unique_ptr<LocalFabric> fabric;
  std::vector<uint8_t> buffer = std::vector<uint8_t>(kBytes, 0);
  std::vector<uint8_t> key;
};

class Fence : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    for (int32_t r = 0; r < 2; ++r) {
      Rank& k = ranks_[r];
      if (GetParam() == "cma") {
        Result<std::unique_ptr<CmaFabric>> f = CmaFabric::create(CmaFabricConfig{r});
        if (!f.is_ok()) GTEST_SKIP() << "no cross-memory attach here: " << f.status().message();
        k.fabric = std::move(f).value();
      } else {
        UcxFabricConfig config;
        config.rank = r;
        Result<std::unique_ptr<UcxFabric>> f = UcxFabric::create(config);
        if (!f.is_ok()) GTEST_SKIP() << "no UCX shared memory here: " << f.status().message();
        k.fabric = std::move(f).value();
      }
      Result<std::vector<uint8_t>> key = k.fabric->register_buffer("t", k.buffer.data(), k.buffer.size());
      ASSERT_TRUE(key.is_ok()) << key.status().message();
      k.key = *key;
    }
  }

  // Rank 0 sends its whole buffer to rank 1's; `solo`: rank 1's part of a
  // solo plan (no peers).
  // `solo_epoch`: the epoch of the coordinator's solo plan.
  Schedule schedule(int32_t rank, int64_t version, uint64_t epoch, bool solo = false, bool solo_epoch = false) {
    Schedule s;
    s.version = version;
    s.epoch = PlanEpoch{epoch, solo_epoch};
    if (solo) return s;
    const int32_t other = 1 - rank;
    Peer p;
    p.rank = other;
    p.contact = ranks_[other].fabric->contact();
    p.buffers.push_back(RemoteBuffer{reinterpret_cast<uint64_t>(ranks_[other].buffer.data()), ranks_[other].key});
    s.peers.push_back(p);
    if (rank == 0) {
      Send x;
      x.peer = 0;
      x.src = ranks_[0].buffer.data();
      x.bytes = kBytes;
      s.sends.push_back(x);
    } else {
      s.recvs.push_back(Recv{0, ranks_[1].buffer.data(), kBytes});
    }
    return s;
  }

  LocalFabric& f(int32_t r) { return *ranks_[r].fabric; }
  void fill(int32_t r, uint8_t v) { std::fill(ranks_[r].buffer.begin(), ranks_[r].buffer.end(), v); }
  // Whether rank r's buffer holds v in every byte (host fabrics: visible
  // once the sender's finish() returned).
  bool holds(int32_t r, uint8_t v) {
    return std::all_of(ranks_[r].buffer.begin(), ranks_[r].buffer.end(), [v](uint8_t b) { return b == v; });
  }

  Rank ranks_[2];
  const uint32_t send0_ = 0;
};

TEST_P(Fence, ALateSenderHoldsTheNextVersionUntilItStops) {
  const Schedule a1 = schedule(0, 1, 1), b1 = schedule(1, 1, 1);
  const auto deadline = Clock::now() + 20s;
  ASSERT_TRUE(f(1).begin(b1, deadline).is_ok());
  ASSERT_TRUE(f(0).begin(a1, deadline).is_ok());
  fill(0, 0x11);
  ASSERT_TRUE(f(0).send(std::span<const uint32_t>(&send0_, 1)).is_ok());
  // Rank 1 gives the attempt up without rank 0's flag (cancelled, say):
  // rank 0 may still be writing version 1.
  (void)f(1).finish(/*failed=*/true);
  f(1).end();

  const Schedule b2 = schedule(1, 2, 1);
  std::atomic<bool> began{false};
  Status began_status;
  std::thread t([&] {
    began_status = f(1).begin(b2, Clock::now() + 20s);
    began = true;
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(began.load()) << "version 2 began while rank 0 could still write version 1 into it";

  // A write of rank 0's old attempt now finds the attempt over at rank 1.
  fill(0, 0x66);
  Status late = f(0).send(std::span<const uint32_t>(&send0_, 1));
  EXPECT_FALSE(late.is_ok());
  EXPECT_NE(late.message().find("receiver rank 1 is no longer in this attempt"), std::string::npos) << late.message();
  EXPECT_TRUE(std::none_of(ranks_[1].buffer.begin(), ranks_[1].buffer.end(), [](uint8_t b) { return b == 0x66; }))
      << "the late write landed";
  EXPECT_FALSE(began.load());

  // Rank 0 ends its attempt: version 2 may begin.
  (void)f(0).finish(/*failed=*/true);
  f(0).end();
  t.join();
  ASSERT_TRUE(began_status.is_ok()) << began_status.message();

  // And version 2 runs as usual.
  const Schedule a2 = schedule(0, 2, 1);
  ASSERT_TRUE(f(0).begin(a2, Clock::now() + 20s).is_ok());
  fill(0, 0x22);
  ASSERT_TRUE(f(0).send(std::span<const uint32_t>(&send0_, 1)).is_ok());
  EXPECT_TRUE(f(0).finish(false).is_ok());
  EXPECT_TRUE(f(1).finish(false).is_ok());
  f(0).end();
  f(1).end();
  EXPECT_TRUE(holds(1, 0x22));
}

TEST_P(Fence, ASenderThatNeverBeganIsNotWaitedFor) {
  const Schedule b1 = schedule(1, 1, 1);
  ASSERT_TRUE(f(1).begin(b1, Clock::now() + 20s).is_ok());
  (void)f(1).finish(/*failed=*/true);
  f(1).end();
  const auto start = Clock::now();
  const Schedule b2 = schedule(1, 2, 1, /*solo=*/true);
  Status st = f(1).begin(b2, Clock::now() + 20s);
  EXPECT_TRUE(st.is_ok()) << st.message();
  EXPECT_LT(Clock::now() - start, 5s);
  f(1).end();
  // Nor does rank 0, beginning version 1 late, write into it.
  const Schedule a1 = schedule(0, 1, 1);
  ASSERT_TRUE(f(0).begin(a1, Clock::now() + 20s).is_ok());
  fill(0, 0x33);
  EXPECT_FALSE(f(0).send(std::span<const uint32_t>(&send0_, 1)).is_ok());
  EXPECT_TRUE(holds(1, 0));
  (void)f(0).finish(true);
  f(0).end();
}

TEST_P(Fence, ASenderWaitsForItsPeerToBegin) {
  const Schedule a1 = schedule(0, 1, 1), b1 = schedule(1, 1, 1);
  ASSERT_TRUE(f(0).begin(a1, Clock::now() + 20s).is_ok());
  fill(0, 0x44);
  std::atomic<bool> sent{false};
  Status send_status;
  std::thread t([&] {
    send_status = f(0).send(std::span<const uint32_t>(&send0_, 1));
    sent = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(sent.load()) << "rank 0 wrote before rank 1 began the attempt";
  EXPECT_TRUE(holds(1, 0));
  ASSERT_TRUE(f(1).begin(b1, Clock::now() + 20s).is_ok());
  t.join();
  ASSERT_TRUE(send_status.is_ok()) << send_status.message();
  EXPECT_TRUE(f(0).finish(false).is_ok());
  EXPECT_TRUE(f(1).finish(false).is_ok());
  f(0).end();
  f(1).end();
  EXPECT_TRUE(holds(1, 0x44));
}

TEST_P(Fence, ARetryOfTheSameVersionDoesNotWait) {
  const Schedule a1 = schedule(0, 1, 1), b1 = schedule(1, 1, 1);
  ASSERT_TRUE(f(1).begin(b1, Clock::now() + 20s).is_ok());
  ASSERT_TRUE(f(0).begin(a1, Clock::now() + 20s).is_ok());
  fill(0, 0x55);
  ASSERT_TRUE(f(0).send(std::span<const uint32_t>(&send0_, 1)).is_ok());
  (void)f(1).finish(true);
  f(1).end();
  // Rank 1 retries version 1 solo while rank 0 is still in its attempt.
  const auto start = Clock::now();
  const Schedule b1_solo = schedule(1, 1, 2, /*solo=*/true, /*solo_epoch=*/true);
  EXPECT_TRUE(f(1).begin(b1_solo, Clock::now() + 20s).is_ok());
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(f(1).finish(false).is_ok());
  f(1).end();
  (void)f(0).finish(true);
  f(0).end();
}

INSTANTIATE_TEST_SUITE_P(HostFabrics, Fence, ::testing::Values("cma", "ucx"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace refit::fabric
