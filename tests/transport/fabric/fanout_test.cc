// The same fan-out schedule through the local fabrics: the UCX fabric over
// shared memory, the cma fabric (cross-memory attach; all ranks in this one
// process), and the NCCL fabric's logic over the host communicator
// (host_comm.h). The same bytes must land, whatever order the sends become
// ready in.

#include <gtest/gtest.h>

#include "fanout_case.h"
#include "host_comm.h"
#include "transport/fabric/nccl_fabric.h"
#ifdef REFIT_TEST_UCX_FABRIC
#include "transport/fabric/cma_fabric.h"
#include "transport/fabric/ucx_fabric.h"
#endif

namespace refit::fabric {
namespace {

using testing::FanoutCase;
using testing::RankFabric;

Result<RankFabric> make_nccl(int32_t rank, std::vector<uint8_t>& buffer) {
  NcclFabricConfig config;
  config.rank = rank;
  config.max_sends_per_round = 5;  // several rounds per pair
  config.pack.pack_bytes = kMinPackBytes;  // packs, without 2 x 64 MiB per rank
  Result<std::unique_ptr<NcclFabric>> f = NcclFabric::create(config, std::make_unique<cuda::testing::HostCommFactory>());
  if (!f.is_ok()) return f.status();
  RankFabric out;
  Result<std::vector<uint8_t>> key = (*f)->register_buffer("t", buffer.data(), buffer.size());
  if (!key.is_ok()) return key.status();
  out.key = *key;
  out.contact = (*f)->contact();
  out.fabric = std::move(f).value();
  return out;
}

#ifdef REFIT_TEST_UCX_FABRIC
// Registers `buffer` with a host fabric just made.
template <typename F>
Result<RankFabric> host_rank(Result<std::unique_ptr<F>> f, std::vector<uint8_t>& buffer) {
  if (!f.is_ok()) return f.status();
  RankFabric out;
  Result<std::vector<uint8_t>> key = (*f)->register_buffer("t", buffer.data(), buffer.size());
  if (!key.is_ok()) return key.status();
  out.key = *key;
  out.contact = (*f)->contact();
  out.fabric = std::move(f).value();
  return out;
}

Result<RankFabric> make_ucx(int32_t rank, std::vector<uint8_t>& buffer) {
  UcxFabricConfig config;
  config.rank = rank;
  config.limits.chunk_bytes = 4096;
  return host_rank(UcxFabric::create(config), buffer);
}

Result<RankFabric> make_cma(int32_t rank, std::vector<uint8_t>& buffer) {
  CmaFabricConfig config;
  config.rank = rank;
  config.max_iov = 3;  // several system calls per batch
  return host_rank(CmaFabric::create(config), buffer);
}
#endif

#ifdef REFIT_TEST_UCX_FABRIC
// The UCX fabric's idle thread starts in create(), and its GET engine's
// progress thread in begin(): each refused is that call's error.
TEST(UcxFabric, ThreadsThatCannotStartFailTheirCallNotTheProcess) {
  UcxFabricConfig config;
  config.limits.chunk_bytes = 4096;
  config.threads = ThreadFactory::refusing_after(0);
  Result<std::unique_ptr<UcxFabric>> none = UcxFabric::create(config);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().reason(), Reason::kNoThread);
  EXPECT_NE(none.status().message().find("cannot start the local fabric idle progress thread"), std::string::npos)
      << none.status().message();

  config.threads = ThreadFactory::refusing_after(1);
  std::vector<uint8_t> buffer(4096);
  Result<RankFabric> rank = host_rank(UcxFabric::create(config), buffer);
  ASSERT_TRUE(rank.is_ok()) << rank.status().message();
  Schedule s;
  s.version = 1;
  s.domain = {DomainMember{0, rank->contact}};
  Status st = rank->fabric->begin(s, Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(st.reason(), Reason::kNoThread) << st.message();
  EXPECT_NE(st.message().find("cannot start the ucx get engine progress thread"), std::string::npos)
      << st.message();
  rank->fabric->end();
}
#endif

class Fanout : public ::testing::TestWithParam<std::string> {
 protected:
  testing::MakeFabric maker() {
#ifdef REFIT_TEST_UCX_FABRIC
    if (GetParam() == "ucx") return make_ucx;
    if (GetParam() == "cma") return make_cma;
#endif
    return make_nccl;
  }
};

TEST_P(Fanout, SameBytesLandThroughEveryFabric) {
#ifndef REFIT_TEST_UCX_FABRIC
  if (GetParam() != "nccl") GTEST_SKIP() << "this build has no UCX";
#endif
  for (uint32_t seed : {1u, 2u, 3u}) {
    const int32_t ranks = 2 + static_cast<int32_t>(seed % 3);
    const FanoutCase c = testing::make_case(ranks, 48 << 10, 4096, seed);
    std::vector<std::vector<uint8_t>> buffers = c.start;
    std::vector<RankFabric> fabrics;
    for (int32_t r = 0; r < ranks; ++r) {
      Result<RankFabric> f = maker()(r, buffers[r]);
      if (!f.is_ok() && GetParam() != "nccl") GTEST_SKIP() << "no " << GetParam() << " fabric here: " << f.status().message();
      ASSERT_TRUE(f.is_ok()) << f.status().message();
      fabrics.push_back(std::move(f).value());
    }
    // Two refreshes on the same fabrics: the second reuses what the first
    // connected (endpoints, the communicator).
    for (int64_t version = 1; version <= 2; ++version) {
      buffers = c.start;
      std::vector<Schedule> schedules;
      for (int32_t r = 0; r < ranks; ++r) schedules.push_back(testing::schedule_of(c, r, buffers, fabrics, version));
      const std::vector<Status> st =
          testing::run_refresh(fabrics, schedules, Clock::now() + std::chrono::seconds(30), seed * 7 + version);
      for (int32_t r = 0; r < ranks; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << GetParam() << " rank " << r << ": " << st[r].message();
        EXPECT_EQ(buffers[r], c.expected[r]) << GetParam() << " seed " << seed << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fabrics, Fanout, ::testing::Values("ucx", "cma", "nccl"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace refit::fabric
