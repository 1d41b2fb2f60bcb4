#include "tools/bench/pattern.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "transport/convert/convert.h"

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

// A tensor converted on the way (docs/conversion.md) holds finite values at
// its sources: the quantizer refuses NaN and infinity. Clearing the top
// exponent bit (bit 14 of a BF16, bit 30 of an F32) keeps |x| below 2.
uint64_t finite_mask(const Tensor& t) {
  if (t.dtype_on(Side::kReceiver) == t.dtype) return ~uint64_t{0};
  if (t.dtype == DType::kBF16) return ~(uint64_t{1} << 14);
  if (t.dtype == DType::kF32) return ~(uint64_t{1} << 30);
  return ~uint64_t{0};
}

template <int kBytes>
void fill_row(uint8_t* data, uint64_t seed, int64_t flat, int64_t off, int64_t count, int64_t stride,
              int64_t version, uint64_t mask) {
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t v = pattern_of(seed, flat + i, version) & mask;
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


// What a receiver region of a tensor converted on the way (or of a derived
// scale tensor) should hold at `version`: the CPU kernels applied to the
// sources' (finite) pattern, the reference the receivers are checked
// against. Row-major over the region's box, in the receivers' dtype.
Result<std::vector<uint8_t>> converted_box(const Layout& L, uint32_t ti, const Box& box, int64_t version) {
  const Tensor& t = L.tensors[ti];
  const bool scales = t.derived_from >= 0;
  const Tensor& w = scales ? L.tensors[static_cast<size_t>(t.derived_from)] : t;
  const int n = box.ndim;
  const std::array<int64_t, 2> blk = L.weight_block_size;
  Box wb = box;  // the weight's box whose conversion gives `box`
  if (scales) {
    for (int k = 0; k < 2; ++k) {
      const int d = n - 2 + k;
      wb.start[d] = box.start[d] * blk[k];
      wb.size[d] = std::min((box.start[d] + box.size[d]) * blk[k], w.shape[d]) - wb.start[d];
    }
  }
  const int in = dtype_bytes(w.dtype);
  const DType to = w.dtype_on(Side::kReceiver);
  const uint64_t seed = name_seed(w.name), mask = finite_mask(w);
  const Index g = row_major_strides(w.shape);
  // The weight's box, row-major, in the sources' dtype.
  std::vector<uint8_t> src(static_cast<size_t>(wb.numel() * in));
  {
    Index idx{};
    for (int64_t e = 0; e < wb.numel(); ++e) {
      int64_t flat = 0, rem = e;
      for (int d = n - 1; d >= 0; --d) {
        idx[d] = rem % wb.size[d];
        rem /= wb.size[d];
      }
      for (int d = 0; d < n; ++d) flat += (wb.start[d] + idx[d]) * g[d];
      const uint64_t v = pattern_of(seed, flat, version) & mask;
      std::memcpy(src.data() + e * in, &v, static_cast<size_t>(in));
    }
  }
  if (to != DType::kF8E4M3) {
    std::vector<uint8_t> out(static_cast<size_t>(wb.numel() * dtype_bytes(to)));
    REFIT_RETURN_IF_ERROR(convert::cast(w.dtype, to, src.data(), out.data(), wb.numel(), w.name));
    return out;
  }
  const int64_t rows = wb.size[n - 2], cols = wb.size[n - 1];
  const int64_t brows = (rows + blk[0] - 1) / blk[0], bcols = (cols + blk[1] - 1) / blk[1];
  const int64_t lead = wb.numel() / (rows * cols);
  std::vector<uint8_t> values(static_cast<size_t>(wb.numel()));
  std::vector<float> sc(static_cast<size_t>(lead * brows * bcols));
  convert::QuantizeArgs a;
  a.src_dtype = w.dtype;
  a.src = src.data();
  a.rows = rows;
  a.cols = cols;
  a.dst = values.data();
  a.scales = sc.data();
  a.block = {blk[0], blk[1]};
  a.tensor = w.name;
  REFIT_RETURN_IF_ERROR(convert::quantize_e4m3_matrices(a, lead));
  if (!scales) return values;
  std::vector<uint8_t> out(sc.size() * 4);
  std::memcpy(out.data(), sc.data(), out.size());
  return out;
}

bool converted(const Tensor& t) { return t.derived_from >= 0 || t.dtype_on(Side::kReceiver) != t.dtype; }

// Checks a receiver region of a converted or derived tensor against
// converted_box, marking its bytes covered.
Status verify_converted(const Layout& L, const RankBuffer& buffer, const Placed& p, const uint8_t* data,
                        uint8_t* covered, int64_t version) {
  const Tensor& t = L.tensors[p.tensor];
  const Region& r = *p.region;
  Result<std::vector<uint8_t>> want = converted_box(L, p.tensor, r.box, version);
  if (!want.is_ok()) return want.status();
  const int es = dtype_bytes(t.dtype_on(Side::kReceiver));
  const int n = r.box.ndim;
  Index idx{};
  for (int64_t e = 0; e < r.box.numel(); ++e) {
    int64_t rem = e, off = r.offset;
    for (int d = n - 1; d >= 0; --d) {
      idx[d] = rem % r.box.size[d];
      rem /= r.box.size[d];
    }
    for (int d = 0; d < n; ++d) off += idx[d] * r.strides[d];
    const int64_t byte = off * es;
    if (std::memcmp(data + byte, want->data() + e * es, static_cast<size_t>(es)) != 0) {
      int64_t flat = 0;
      const Index g = row_major_strides(t.shape);
      for (int d = 0; d < n; ++d) flat += (r.box.start[d] + idx[d]) * g[d];
      return Status::internal("buffer \"" + buffer.name + "\" byte offset " + std::to_string(byte) + ": tensor \"" +
                              t.name + "\" element " + element_index(t, flat) + " of version " +
                              std::to_string(version) + " should be " + hex(want->data() + e * es, es) +
                              " (the reference conversion), got " + hex(data + byte, es));
    }
    if (covered != nullptr) std::memset(covered + byte, 1, static_cast<size_t>(es));
  }
  return Status::ok();
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
    const uint64_t mask = finite_mask(t);
    for_each_element(t, *p.region, [&](int64_t flat, int64_t off, int64_t count, int64_t stride) {
      switch (es) {
        case 1: fill_row<1>(data, seed, flat, off, count, stride, version, mask); break;
        case 2: fill_row<2>(data, seed, flat, off, count, stride, version, mask); break;
        case 4: fill_row<4>(data, seed, flat, off, count, stride, version, mask); break;
        default: fill_row<8>(data, seed, flat, off, count, stride, version, mask); break;
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
    if (converted(t)) {
      REFIT_RETURN_IF_ERROR(verify_converted(layout, buffer, p, data, mark, version));
      continue;
    }
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
