// What the agents' config says about the network (plugin/config.h): which
// transports move GPU memory without the CPU.
#include <gtest/gtest.h>

#include "plugin/config.h"

namespace refit::plugin {
namespace {

TEST(TransportConfig, OnlyTheRdmaFamiliesReachGpuMemoryWithoutTheCpu) {
  for (const std::vector<std::string>& t : std::vector<std::vector<std::string>>{
           {"rc"}, {"dc"}, {"ud"}, {"ib"}, {"rc_x"}, {"dc_mlx5"}, {"ud_verbs"}, {"tcp", "rc"}, {"cuda_copy", "dc_x"}}) {
    EXPECT_TRUE((TransportConfig{t, {}}.has_rdma())) << t.back();
  }
  // tcp and shared memory copy with the CPU (transport/ucx/am_rma.h), and
  // cuda_copy alone stages through host memory.
  for (const std::vector<std::string>& t : std::vector<std::vector<std::string>>{
           {"tcp"}, {"shm"}, {"tcp", "cuda_copy"}, {"posix", "sysv", "cma"}, {}}) {
    EXPECT_FALSE((TransportConfig{t, {}}.has_rdma())) << (t.empty() ? "none" : t.front());
  }
}

}  // namespace
}  // namespace refit::plugin
