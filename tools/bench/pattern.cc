#include "tools/bench/pattern.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace refit::bench {

namespace {

// splitmix64's finalizer: cheap, and every input bit reaches every output bit.
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// Visits every element of `r` (a region of tensor `t`), one innermost row at a
// time: fn(flat index in the tensor of the row's first element, its element
// offset in the buffer, elements in the row, element stride of the row).
// The innermost dim runs in a tight loop; the outer dims step an odometer.
// splitmix64's output for the counter (element, version), salted by the
// tensor: one finalizer per element, since fill and verification compute
// it for every element of every version.
inline uint64_t pattern_of(uint64_t seed, int64_t element, int64_t version) {
  return mix(seed ^ (static_cast<uint64_t>(element) * 0x9E3779B97F4A7C15ull +
                     static_cast<uint64_t>(version) * 0xD6E8FEB86659FD93ull));
}

template <typename Fn>
void for_each_element(const Tensor& t, const Region& r, Fn&& fn) {
  const Box& b = r.box;
  if (b.empty()) return;
  const Index g = row_major_strides(t.shape);
  const int n = b.ndim;
  if (n == 0) {
    fn(int64_t{0}, r.offset, int64_t{1}, int64_t{1});
    return;
  }
  const int64_t inner = b.size[n - 1];
  const int64_t inner_stride = r.strides[n - 1];
  Index idx{};
  for (;;) {
    int64_t flat = 0, off = r.offset;
    for (int d = 0; d < n; ++d) {
      flat += (b.start[d] + idx[d]) * g[d];
      off += idx[d] * r.strides[d];
    }
    fn(flat, off, inner, inner_stride);
    int d = n - 2;
    while (d >= 0) {
      if (++idx[d] < b.size[d]) break;
      idx[d] = 0;
      --d;
    }
    if (d < 0) break;
  }
}

template <int kBytes>
void fill_row(uint8_t* data, uint64_t seed, int64_t flat, int64_t off, int64_t count, int64_t stride,
              int64_t version) {
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t v = pattern_of(seed, flat + i, version);
    std::memcpy(data + (off + i * stride) * kBytes, &v, kBytes);
  }
}

// The first element of a row that does not hold the pattern, or `count`;
// marks the bytes of the elements before it as covered (when `covered`).
// Sized at compile time, so that the compare and the mark are single moves:
// verification runs over every byte of every version.
template <int kBytes>
int64_t check_row(const uint8_t* data, uint8_t* covered, uint64_t seed, int64_t flat, int64_t off, int64_t count,
                  int64_t stride, int64_t version) {
  constexpr uint64_t kMask = kBytes >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * kBytes)) - 1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t byte = (off + i * stride) * kBytes;
    uint64_t got = 0;
    std::memcpy(&got, data + byte, kBytes);
    if (got != (pattern_of(seed, flat + i, version) & kMask)) return i;
    if (covered != nullptr && stride != 1) std::memset(covered + byte, 1, kBytes);
  }
  if (covered != nullptr && stride == 1) std::memset(covered + off * kBytes, 1, static_cast<size_t>(count) * kBytes);
  return count;
}

std::string hex(const uint8_t* p, int n) {
  std::string s = "0x";
  char b[3];
  for (int i = n - 1; i >= 0; --i) {  // little-endian bytes, most significant first
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

std::string element_index(const Tensor& t, int64_t flat) {
  std::string s = "[";
  const Index g = row_major_strides(t.shape);
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(flat / g[d]);
    flat %= g[d];
  }
  return s + "]";
}

}  // namespace

uint64_t name_seed(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t pattern_value(uint64_t seed, int64_t element, int64_t version) { return pattern_of(seed, element, version); }

void fill(const Layout& layout, const RankBuffer& buffer, uint8_t* data, int64_t version) {
  for (const Placed& p : buffer.placed) {
    const Tensor& t = layout.tensors[p.tensor];
    const uint64_t seed = name_seed(t.name);
    const int es = dtype_bytes(t.dtype);
    for_each_element(t, *p.region, [&](int64_t flat, int64_t off, int64_t count, int64_t stride) {
      switch (es) {
        case 1: fill_row<1>(data, seed, flat, off, count, stride, version); break;
        case 2: fill_row<2>(data, seed, flat, off, count, stride, version); break;
        case 4: fill_row<4>(data, seed, flat, off, count, stride, version); break;
        default: fill_row<8>(data, seed, flat, off, count, stride, version); break;
      }
    });
  }
}

Status verify(const Layout& layout, const RankBuffer& buffer, const uint8_t* data, int64_t version,
              bool check_guard) {
  std::vector<uint8_t> covered;
  if (check_guard) covered.assign(static_cast<size_t>(buffer.bytes), 0);
  Status bad;
  for (const Placed& p : buffer.placed) {
    const Tensor& t = layout.tensors[p.tensor];
    const uint64_t seed = name_seed(t.name);
    const int es = dtype_bytes(t.dtype);
    uint8_t* mark = check_guard ? covered.data() : nullptr;
    for_each_element(t, *p.region, [&](int64_t flat, int64_t off, int64_t count, int64_t stride) {
      if (!bad.is_ok()) return;
      int64_t i = 0;
      switch (es) {
        case 1: i = check_row<1>(data, mark, seed, flat, off, count, stride, version); break;
        case 2: i = check_row<2>(data, mark, seed, flat, off, count, stride, version); break;
        case 4: i = check_row<4>(data, mark, seed, flat, off, count, stride, version); break;
        default: i = check_row<8>(data, mark, seed, flat, off, count, stride, version); break;
      }
      if (i == count) return;
      const int64_t byte = (off + i * stride) * es;
      const uint64_t want = pattern_value(seed, flat + i, version);
      bad = Status::internal("buffer \"" + buffer.name + "\" byte offset " + std::to_string(byte) + ": tensor \"" +
                             t.name + "\" element " + std::to_string(flat + i) + " " + element_index(t, flat + i) +
                             " of version " + std::to_string(version) + " should be " +
                             hex(reinterpret_cast<const uint8_t*>(&want), es) + ", got " + hex(data + byte, es));
    });
    if (!bad.is_ok()) return bad;
  }
  if (check_guard) {
    // Eight bytes at a time first (covered bytes are 0 or 1, so times 0xFF
    // they mask the covered ones out); the byte is looked for only when
    // there is one.
    constexpr uint64_t kGuardWord = 0x0101010101010101ull * kGuardByte;
    uint64_t any = 0;
    const int64_t words = buffer.bytes / 8;
    for (int64_t w = 0; w < words; ++w) {
      uint64_t c = 0, d = 0;
      std::memcpy(&c, covered.data() + 8 * w, 8);
      std::memcpy(&d, data + 8 * w, 8);
      any |= ~(c * 0xFF) & (d ^ kGuardWord);
    }
    for (int64_t i = 8 * words; i < buffer.bytes; ++i) any |= !covered[i] && data[i] != kGuardByte;
    for (int64_t i = 0; any != 0 && i < buffer.bytes; ++i) {
      if (!covered[i] && data[i] != kGuardByte) {
        char got[8];
        std::snprintf(got, sizeof got, "0x%02x", data[i]);
        return Status::internal("buffer \"" + buffer.name + "\" byte offset " + std::to_string(i) +
                                " lies outside every segment but was written: " + got + " instead of the guard byte");
      }
    }
  }
  return Status::ok();
}

std::vector<SampledElement> sample_elements(const Layout& layout, const RankBuffer& buffer, int64_t every) {
  if (every < 1) every = 1;
  std::vector<SampledElement> out;
  for (const Placed& p : buffer.placed) {
    const Tensor& t = layout.tensors[p.tensor];
    const uint64_t seed = name_seed(t.name);
    const int es = dtype_bytes(t.dtype);
    int64_t seen = 0;  // elements of this segment visited so far
    SampledElement last;
    for_each_element(t, *p.region, [&](int64_t flat, int64_t off, int64_t count, int64_t stride) {
      // The first multiple of `every` at or after `seen`, then every `every`.
      for (int64_t i = (every - seen % every) % every; i < count; i += every)
        out.push_back({(off + i * stride) * es, seed, flat + i, es});
      last = {(off + (count - 1) * stride) * es, seed, flat + count - 1, es};
      seen += count;
    });
    if (seen > 0 && (seen - 1) % every != 0) out.push_back(last);
  }
  return out;
}

uint64_t matching_versions(const SampledElement& e, const uint8_t* data, const int64_t* versions, int n,
                           uint64_t among) {
  uint64_t got = 0;
  std::memcpy(&got, data + e.byte, static_cast<size_t>(e.bytes));
  const uint64_t mask = e.bytes >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * e.bytes)) - 1;
  uint64_t bits = 0;
  for (int k = 0; k < n; ++k)
    if ((among >> k & 1) && (pattern_value(e.seed, e.flat, versions[k]) & mask) == got) bits |= uint64_t{1} << k;
  return bits;
}

}  // namespace refit::bench
