// What a round of the NCCL fabric announces (round_words.h): the positions
// written are the positions read, and words no honest peer writes are
// refused, saying what is wrong, with nothing marked received.

#include "transport/fabric/round_words.h"

#include <gtest/gtest.h>

#include <random>

namespace refit::fabric {
namespace {

std::vector<uint64_t> announce(const std::vector<uint32_t>& positions) {
  std::vector<uint64_t> w(kRoundWordsPerPeer, 7);
  write_announcement(w.data(), 1000, 42, positions);
  return w;
}

TEST(RoundWords, PositionsCrossAsRangesInTheirOrder) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t size = 1 + rng() % 600;
    std::vector<uint32_t> all(size);
    for (uint32_t i = 0; i < size; ++i) all[i] = i;
    // Runs of consecutive positions, shuffled as landings shuffle them.
    std::vector<std::vector<uint32_t>> runs;
    for (size_t at = 0; at < size;) {
      const size_t n = std::min<size_t>(size - at, 1 + rng() % 9);
      runs.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(at), all.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
    }
    std::shuffle(runs.begin(), runs.end(), rng);
    std::vector<uint32_t> order;
    for (const auto& r : runs) order.insert(order.end(), r.begin(), r.end());
    std::vector<uint8_t> got(size, 0);
    size_t done = 0;
    while (done < size) {
      std::span<const uint32_t> rest(order.data() + done, std::min<size_t>(size - done, 1 + rng() % 300));
      const size_t fit = ranges_prefix(rest);
      ASSERT_GE(fit, 1u);
      const std::vector<uint32_t> taken(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(fit));
      const std::vector<uint64_t> w = announce(taken);
      ASSERT_LE(w[3], kMaxRanges);
      std::vector<uint32_t> read;
      ASSERT_TRUE(read_positions(w.data(), size, got, &read).is_ok());
      ASSERT_EQ(read, taken);
      done += fit;
    }
    EXPECT_EQ(std::count(got.begin(), got.end(), 1), static_cast<std::ptrdiff_t>(size));
  }
}

TEST(RoundWords, AtMostKMaxRangesFitARound) {
  std::vector<uint32_t> apart;
  for (uint32_t i = 0; i < 100; ++i) apart.push_back(2 * i);
  EXPECT_EQ(ranges_prefix(apart), kMaxRanges);
  std::vector<uint32_t> one_run;
  for (uint32_t i = 0; i < 1000; ++i) one_run.push_back(500 + i);
  EXPECT_EQ(ranges_prefix(one_run), 1000u);
  EXPECT_EQ(ranges_prefix({}), 0u);
}

// Each bad announcement: refused, the message saying why, `got` unchanged.
void expect_refused(std::vector<uint64_t> w, size_t size, const std::vector<uint8_t>& got_before,
                    const std::string& says) {
  std::vector<uint8_t> got = got_before;
  std::vector<uint32_t> read;
  const Status st = read_positions(w.data(), size, got, &read);
  ASSERT_FALSE(st.is_ok()) << says;
  EXPECT_NE(st.message().find(says), std::string::npos) << st.message();
  EXPECT_EQ(got, got_before) << says;
  EXPECT_TRUE(read.empty());
}

TEST(RoundWords, WordsNoHonestPeerWritesAreRefused) {
  const std::vector<uint8_t> none(10, 0);
  std::vector<uint64_t> w = announce({2, 3, 4});
  w[3] = kMaxRanges + 1;
  expect_refused(w, 10, none, "ranges of slices announced");
  w = announce({2, 3, 4});
  w[5] = 0;  // an empty range
  expect_refused(w, 10, none, "is empty or outside");
  w = announce({8, 9});
  w[5] = 3;  // past the end
  w[0] = 3;
  expect_refused(w, 10, none, "is empty or outside");
  w = announce({1});
  w[4] = UINT64_MAX;  // start + length wraps around
  w[5] = 2;
  w[0] = 2;
  expect_refused(w, 10, none, "is empty or outside");
  w = announce({1, 2});
  w[0] = 11;  // more than the plan has
  expect_refused(w, 10, none, "this rank's plan has 10");
  w = announce({1, 2});
  w[0] = 3;  // ranges name fewer
  expect_refused(w, 10, none, "its ranges name 2");
  w = announce({1, 2, 3});
  w[0] = 2;  // ranges name more
  expect_refused(w, 10, none, "name more slices");
  // A position named twice in one round, or received in an earlier one.
  w = announce({4, 5, 6, 5});
  expect_refused(w, 10, none, "announced again");
  std::vector<uint8_t> some = none;
  some[6] = 1;
  expect_refused(announce({5, 6}), 10, some, "slice 6 announced again");
}

}  // namespace
}  // namespace refit::fabric
