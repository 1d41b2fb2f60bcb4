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

#include "planner/layout.h"
#include "planner/status.h"
#include "plugin/tools/bench/rank_buffers.h"

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

}  // namespace refit::bench
