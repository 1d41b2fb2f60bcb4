#pragma once
// The value pattern the bench and the end-to-end tests move: element e (flat
// row-major index in the global tensor) of tensor T at version v holds the
// low dtype_bytes(dtype) bytes of a hash of (T's name, e, v). Any dtype works,
// since only bytes are compared; every version changes every element (up to
// hash collisions of one-byte dtypes, which verification tolerates only where
// the bytes really are equal).
//
// Sources are filled through their segments; receivers are checked through
// theirs, and the bytes outside every segment must still hold kGuardByte
// (the C ABI promises never to write them).

#include <cstdint>
#include <string_view>
#include <vector>

#include "planner/layout.h"
#include "planner/status.h"
#include "tools/bench/rank_buffers.h"

namespace refit::bench {

// What a receiver buffer holds before anything was written to it.
inline constexpr uint8_t kGuardByte = 0xE7;

// 64-bit FNV-1a of a tensor name: the per-tensor seed of the pattern.
uint64_t name_seed(std::string_view name);

// The pattern's value of one element, as 8 bytes (little-endian); an element
// of n bytes holds the first n of them.
uint64_t pattern_value(uint64_t seed, int64_t element, int64_t version);

// Writes version `version` of the pattern into every segment of `buffer` at
// `data` (buffer.bytes long).
void fill(const Layout& layout, const RankBuffer& buffer, uint8_t* data, int64_t version);

// Checks every segment byte against version `version`, and (when
// `check_guard`) every byte outside the segments against kGuardByte. The
// first mismatch is an error naming the buffer, the byte offset, the tensor,
// the element (flat and per dim), the version and both values.
Status verify(const Layout& layout, const RankBuffer& buffer, const uint8_t* data, int64_t version,
              bool check_guard = true);

// One element of a buffer that a serving reader checks (--serve-check): where
// it lies and how to compute what it should hold.
struct SampledElement {
  int64_t byte = 0;    // offset in the buffer
  uint64_t seed = 0;   // name_seed of its tensor
  int64_t flat = 0;    // flat row-major index in the tensor
  int32_t bytes = 0;   // dtype_bytes
};

// Every `every`-th element of each segment of `buffer` in its element order,
// plus the segment's first and last, so that a reader checks a buffer at a
// cost of about 1/every of its elements. `every` >= 1.
std::vector<SampledElement> sample_elements(const Layout& layout, const RankBuffer& buffer, int64_t every);

// Which of versions[0..n) (n <= 64) element `e` of `data` matches: bit k set
// when it holds the pattern of versions[k]. 0: the element holds none of them.
// Only the versions whose bit is set in `among` are computed (and can be set).
uint64_t matching_versions(const SampledElement& e, const uint8_t* data, const int64_t* versions, int n,
                           uint64_t among = ~uint64_t{0});

}  // namespace refit::bench
