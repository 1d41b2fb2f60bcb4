#pragma once
// Host memory the agents allocate for themselves (staging copies, landing
// rings on host memory, snapshots): mapped anonymous pages, returned to the
// system when freed. With malloc, glibc's adaptive mmap threshold keeps such
// blocks in its heap after the first free, so a receiver that leaves and
// rejoins would grow its resident memory by up to a staging copy each time.
//
// Blocks of 2 MiB and more are aligned to 2 MiB and advised as transparent
// huge pages (MADV_HUGEPAGE), where the kernel offers them ("madvise" or
// "always" in /sys/kernel/mm/transparent_hugepage/enabled). The cma fabric
// writes into a peer's staging copy with process_vm_writev, which pins the
// peer's pages one page at a time: into 4 KiB pages it took 2.3 times as
// long as into huge pages, where it costs what a memcpy does
// (docs/refresh.md, "Host memory and huge pages"; refit-cma-bench). A
// kernel without them gives small pages; nothing else changes.

#include <sys/mman.h>

#include <cstdint>
#include <memory>

namespace refit::plugin {

inline constexpr uint64_t kHugePageBytes = uint64_t{2} << 20;

// `bytes` of zeroed, page-aligned memory (2 MiB-aligned, huge pages advised,
// from 2 MiB on); null when the system refuses.
inline std::shared_ptr<uint8_t> map_host_memory(uint64_t bytes) {
  if (bytes < kHugePageBytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [bytes](uint8_t* q) { munmap(q, bytes); });
  }
  // Map one huge page more than needed, then unmap the unaligned head and
  // the tail beyond the rounded size.
  const uint64_t size = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const uint64_t span = size + kHugePageBytes;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (base + kHugePageBytes - 1) & ~(uintptr_t{kHugePageBytes} - 1);
  if (aligned > base) munmap(p, aligned - base);
  const uintptr_t end = aligned + size;
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);  // advice only: small pages where refused
  return std::shared_ptr<uint8_t>(reinterpret_cast<uint8_t*>(aligned), [size](uint8_t* q) { munmap(q, size); });
}

}  // namespace refit::plugin
