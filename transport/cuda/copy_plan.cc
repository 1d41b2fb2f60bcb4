#include "transport/cuda/copy_plan.h"

#include <cstring>

namespace refit::cuda {
namespace {

// The forward distance from a to b, or 0 when b is not after a.
uint64_t ahead(const uint8_t* a, const uint8_t* b) { return b > a ? static_cast<uint64_t>(b - a) : 0; }

// Whether `next` continues `c` as one more row.
bool extends_rows(Copy& c, const Piece& next) {
  if (next.bytes != c.width || c.depth != 1) return false;
  if (c.height == 1) {
    const uint64_t dp = ahead(c.dst, next.dst);
    const uint64_t sp = ahead(c.src, next.src);
    if (dp < c.width || sp < c.width || dp > kMaxPitch || sp > kMaxPitch) return false;
    c.dst_pitch = dp;
    c.src_pitch = sp;
    c.height = 2;
    return true;
  }
  if (next.dst != c.dst + c.height * c.dst_pitch || next.src != c.src + c.height * c.src_pitch) return false;
  ++c.height;
  return true;
}

// Whether 2-D copy `next` continues `c` as one more plane.
bool extends_planes(Copy& c, const Copy& next) {
  if (c.height < 2 || next.depth != 1 || next.width != c.width || next.height != c.height ||
      next.dst_pitch != c.dst_pitch || next.src_pitch != c.src_pitch) {
    return false;
  }
  if (c.depth == 1) {
    const uint64_t dp = ahead(c.dst, next.dst);
    const uint64_t sp = ahead(c.src, next.src);
    if (dp % c.dst_pitch != 0 || sp % c.src_pitch != 0 || dp / c.dst_pitch < c.height ||
        sp / c.src_pitch < c.height) {
      return false;
    }
    c.dst_plane = dp;
    c.src_plane = sp;
    c.depth = 2;
    return true;
  }
  if (next.dst != c.dst + c.depth * c.dst_plane || next.src != c.src + c.depth * c.src_plane) return false;
  ++c.depth;
  return true;
}

}  // namespace

std::vector<Copy> plan_copies(std::span<const Piece> pieces) {
  std::vector<Copy> rows;
  for (const Piece& p : pieces) {
    if (p.bytes == 0) continue;
    if (!rows.empty() && extends_rows(rows.back(), p)) continue;
    Copy c;
    c.dst = p.dst;
    c.src = p.src;
    c.width = p.bytes;
    c.dst_pitch = p.bytes;
    c.src_pitch = p.bytes;
    rows.push_back(c);
  }
  std::vector<Copy> out;
  for (const Copy& c : rows) {
    if (!out.empty() && extends_planes(out.back(), c)) continue;
    out.push_back(c);
  }
  return out;
}

void copy_on_host(const Copy& c) {
  for (uint64_t z = 0; z < c.depth; ++z) {
    for (uint64_t y = 0; y < c.height; ++y) {
      std::memcpy(c.dst + z * c.dst_plane + y * c.dst_pitch, c.src + z * c.src_plane + y * c.src_pitch, c.width);
    }
  }
}

}  // namespace refit::cuda
