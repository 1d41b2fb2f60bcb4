#pragma once
// Host memory the agents allocate for themselves (staging copies, landing
// mirrors, snapshots): mapped anonymous pages, returned to the system when
// freed. With malloc, glibc's adaptive mmap threshold keeps such blocks in
// its heap after the first free, so a receiver that leaves and rejoins would
// grow its resident memory by up to a staging copy each time.

#include <sys/mman.h>

#include <cstdint>
#include <memory>

namespace refit::plugin {

// `bytes` of zeroed, page-aligned memory; null when the system refuses.
inline std::shared_ptr<uint8_t> map_host_memory(uint64_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [bytes](uint8_t* q) { munmap(q, bytes); });
}

}  // namespace refit::plugin
