// The agents' own host memory (plugin/host_memory.h): zeroed, page-aligned,
// 2 MiB-aligned with huge pages advised from 2 MiB on, and returned to the
// system when the last owner lets go.

#include "plugin/host_memory.h"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace {

using refit::plugin::kHugePageBytes;
using refit::plugin::map_host_memory;

// Whether [p, p + bytes) is mapped in this process (/proc/self/maps).
bool mapped(const void* p, uint64_t bytes) {
  std::ifstream maps("/proc/self/maps");
  const auto begin = reinterpret_cast<uintptr_t>(p);
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && lo <= begin && begin < hi) return begin + bytes <= hi;
  }
  return false;
}

TEST(HostMemory, SmallBlocksArePageAlignedAndZeroed) {
  const uint64_t n = 12345;
  auto m = map_host_memory(n);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.get()) % static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE)), 0u);
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(m.get()[i], 0) << i;
  std::memset(m.get(), 0xab, n);
}

TEST(HostMemory, LargeBlocksAreHugePageAlignedZeroedAndUnmappedWhenFreed) {
  const uint64_t n = 3 * kHugePageBytes + 4096;  // not a multiple of 2 MiB
  const uint8_t* where = nullptr;
  {
    auto m = map_host_memory(n);
    ASSERT_NE(m, nullptr);
    where = m.get();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(where) % kHugePageBytes, 0u);
    EXPECT_TRUE(mapped(where, n));
    for (uint64_t i = 0; i < n; i += 4096) ASSERT_EQ(m.get()[i], 0) << i;
    EXPECT_EQ(m.get()[n - 1], 0);
    std::memset(m.get(), 0x5a, n);  // every byte is writable
    auto second_owner = m;
    m.reset();
    EXPECT_TRUE(mapped(where, n));  // still owned
  }
  EXPECT_FALSE(mapped(where, 1));  // the whole rounded block went back
  EXPECT_FALSE(mapped(where + 3 * kHugePageBytes, 1));
}

}  // namespace
