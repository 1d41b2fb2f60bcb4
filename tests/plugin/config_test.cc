// What the agents' config says about the network (plugin/config.h): which
// transports move GPU memory without the CPU.
#include <gtest/gtest.h>

#include "plugin/config.h"

namespace refit::plugin {
namespace {

TEST(TransportConfig, OnlyTheRdmaFamiliesReachGpuMemoryWithoutTheCpu) {
  for (const std::vector<std::string>& t : std::vector<std::vector<std::string>>{
           {"rc"}, {"dc"}, {"ib"}, {"rc_x"}, {"dc_mlx5"}, {"rc_verbs"}, {"tcp", "rc"}, {"cuda_copy", "dc_x"}}) {
    EXPECT_TRUE((TransportConfig{t, {}}.has_rdma())) << t.back();
  }
  // tcp and shared memory copy with the CPU (transport/ucx/am_rma.h), ud
  // has no RDMA read, cuda_copy alone stages through host memory, and "all"
  // may leave an endpoint with tcp only.
  for (const std::vector<std::string>& t : std::vector<std::vector<std::string>>{
           {"tcp"}, {"shm"}, {"ud"}, {"ud_verbs"}, {"all"}, {"tcp", "cuda_copy"}, {"posix", "sysv", "cma"}, {}}) {
    EXPECT_FALSE((TransportConfig{t, {}}.has_rdma())) << (t.empty() ? "none" : t.front());
  }
}

}  // namespace
}  // namespace refit::plugin
