// The fan-out's pack planner (transport/fabric/pack.h).

#include "transport/fabric/pack.h"

#include <gtest/gtest.h>

#include <random>

namespace refit::fabric {
namespace {

// Checks what every layout must hold: a prefix taken, packed pieces in
// order, aligned, inside the share and disjoint, large sends unpacked.
void expect_sound(const std::vector<uint64_t>& sizes, const PackLayout& l, uint64_t share, uint64_t threshold) {
  ASSERT_LE(l.taken, sizes.size());
  ASSERT_EQ(l.offset.size(), l.taken);
  if (!sizes.empty()) {
    EXPECT_GE(l.taken, 1u);
  }
  uint64_t end = 0;
  size_t packed = 0;
  for (size_t i = 0; i < l.taken; ++i) {
    const bool small = share > 0 && sizes[i] < threshold && sizes[i] <= share;
    if (!small) {
      EXPECT_EQ(l.offset[i], kUnpacked) << "send " << i;
      continue;
    }
    ASSERT_NE(l.offset[i], kUnpacked) << "send " << i;
    EXPECT_EQ(l.offset[i] % kPackAlign, 0u);
    EXPECT_GE(l.offset[i], end) << "send " << i << " overlaps the one before";
    end = l.offset[i] + sizes[i];
    ++packed;
  }
  EXPECT_EQ(l.packed, packed);
  EXPECT_EQ(l.bytes, end);
  EXPECT_LE(l.bytes, share);
  if (l.taken < sizes.size()) {
    // The round stopped only because the next packed send did not fit.
    const uint64_t next = sizes[l.taken];
    EXPECT_TRUE(next < threshold && next <= share);
    EXPECT_GT((l.bytes + kPackAlign - 1) / kPackAlign * kPackAlign + next, share);
  }
}

TEST(Pack, PacksSmallSendsAlignedAndLeavesLargeOnesAsTheyAre) {
  const std::vector<uint64_t> sizes = {100, 2 << 20, 7, 4096, 1 << 20};
  const PackLayout l = plan_pack(sizes, 1 << 20, 1 << 20);
  ASSERT_EQ(l.taken, 5u);
  EXPECT_EQ(l.offset[0], 0u);
  EXPECT_EQ(l.offset[1], kUnpacked);
  EXPECT_EQ(l.offset[2], 112u);  // 100 rounded up to 16
  EXPECT_EQ(l.offset[3], 128u);
  EXPECT_EQ(l.offset[4], kUnpacked);  // at the threshold: unpacked
  EXPECT_EQ(l.bytes, 128u + 4096u);
  EXPECT_EQ(l.packed, 3u);
}

TEST(Pack, ASendLargerThanTheShareGoesUnpackedAndTheRoundStopsAtAFullPack) {
  // Share 1000: a 2000-byte send is below the threshold but cannot be packed.
  const std::vector<uint64_t> sizes = {600, 2000, 300, 200, 10};
  const PackLayout l = plan_pack(sizes, 1000, 1 << 20);
  ASSERT_EQ(l.taken, 3u);  // 600 @0, 2000 unpacked, 300 @608; 200 would pass 1000
  EXPECT_EQ(l.offset[1], kUnpacked);
  EXPECT_EQ(l.offset[2], 608u);
  EXPECT_EQ(l.bytes, 908u);
  // The next round starts where this one stopped.
  const std::vector<uint64_t> rest(sizes.begin() + 3, sizes.end());
  const PackLayout next = plan_pack(rest, 1000, 1 << 20);
  EXPECT_EQ(next.taken, 2u);
  EXPECT_EQ(next.packed, 2u);
}

TEST(Pack, OffMeansEverySendAsItIs) {
  const std::vector<uint64_t> sizes = {1, 2, 3};
  const PackLayout l = plan_pack(sizes, 0, 1 << 20);
  EXPECT_EQ(l.taken, 3u);
  EXPECT_EQ(l.packed, 0u);
  EXPECT_EQ(l.bytes, 0u);
  EXPECT_TRUE(plan_pack({}, 4096, 1 << 20).offset.empty());
}

TEST(Pack, BothEndsAgreeOnRandomRounds) {
  std::mt19937_64 rng(18);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t domain = 2 + rng() % 70;
    PackLimits limits;
    limits.pack_bytes = kMinPackBytes << (rng() % 8);
    limits.pack_threshold = 1 + rng() % (2 << 20);
    ASSERT_TRUE(validate(limits).is_ok());
    const uint64_t share = pack_share(limits, domain);
    EXPECT_LE(share * (domain - 1), limits.pack_bytes) << "the peers' packs fit the area";
    // The sender's ready sends of a round (capped as the fabric caps them).
    std::vector<uint64_t> ready(rng() % (kDefaultMaxSendsPerRound + 1));
    for (uint64_t& b : ready) b = 1 + (rng() % 4 == 0 ? rng() % (4 << 20) : rng() % 8192);
    const PackLayout sent = plan_pack(ready, share, limits.pack_threshold);
    expect_sound(ready, sent, share, limits.pack_threshold);
    // The receiver sees the count the sender announced and its own receives'
    // sizes (the same, per peer in send order): it must lay out the same.
    const std::vector<uint64_t> announced(ready.begin(), ready.begin() + static_cast<ptrdiff_t>(sent.taken));
    const PackLayout got = plan_pack(announced, share, limits.pack_threshold);
    EXPECT_EQ(got.taken, sent.taken);
    EXPECT_EQ(got.offset, sent.offset);
    EXPECT_EQ(got.bytes, sent.bytes);
  }
}

TEST(Pack, ShareSplitsTheAreaOverThePeers) {
  PackLimits limits;
  limits.pack_bytes = 64 << 20;
  EXPECT_EQ(pack_share(limits, 1), 0u);  // no peer
  EXPECT_EQ(pack_share(limits, 2), 64u << 20);
  EXPECT_EQ(pack_share(limits, 64), (64u << 20) / 63 / 16 * 16);
  limits.pack_bytes = 0;
  EXPECT_EQ(pack_share(limits, 8), 0u);
}

TEST(Pack, BadLimitsAreRefusedNamingTheKey) {
  PackLimits limits;
  limits.pack_bytes = 1000;
  Status st = validate(limits);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("\"pack_bytes\""), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("1000"), std::string::npos) << st.message();
  limits = PackLimits{};
  limits.pack_threshold = 0;
  st = validate(limits);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("\"pack_threshold\""), std::string::npos) << st.message();
  limits = PackLimits{};
  limits.pack_bytes = 0;  // off
  EXPECT_TRUE(validate(limits).is_ok());
}

}  // namespace
}  // namespace refit::fabric
