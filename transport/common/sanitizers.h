#pragma once
// What refit tells the sanitizers about memory that lies outside C++'s
// memory model.
//
// A fabric's mailbox (transport/fabric/mailbox.h) is read and written by
// its peers one-sidedly: RDMA GETs and PUTs, which UCX's shared-memory
// transports carry out with a memcpy in the peer's progress thread. The
// owner's threads access its words with atomics; the peers' accesses are
// the NIC's, ordered by the mailbox's own protocol (flags, fences, the
// accepting word), not by anything a race detector can see. In a test
// whose ranks share one process, ThreadSanitizer sees both sides and
// reports a race between an atomic store and UCX's memcpy (docs/testing.md,
// "Sanitizers").

#include <cstddef>

#if defined(__SANITIZE_THREAD__)
#define REFIT_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define REFIT_THREAD_SANITIZER 1
#endif
#endif

#if defined(REFIT_THREAD_SANITIZER)
// ThreadSanitizer's runtime (dynamic annotations).
extern "C" void AnnotateBenignRaceSized(const char* file, int line, const volatile void* address, size_t size,
                                        const char* description);
#endif

namespace refit {

#if defined(REFIT_THREAD_SANITIZER)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif

// Tells ThreadSanitizer that [address, +bytes) is accessed one-sidedly by
// peers (see above), so that it reports no race on it; does nothing in
// other builds. ThreadSanitizer keeps the mark after the memory is freed,
// so memory marked this way must never be freed while the process may
// reuse it for anything else: under ThreadSanitizer its owner keeps it
// (kThreadSanitizer).
inline void expect_one_sided_access([[maybe_unused]] const void* address, [[maybe_unused]] size_t bytes,
                                    [[maybe_unused]] const char* what) {
#if defined(REFIT_THREAD_SANITIZER)
  AnnotateBenignRaceSized(__FILE__, __LINE__, address, bytes, what);
#endif
}

}  // namespace refit
