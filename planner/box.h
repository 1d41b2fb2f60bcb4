#pragma once
// N-dimensional boxes (up to kMaxDims) in a tensor's global index space, and
// the small algebra the planner needs: intersection, containment, volume,
// and row-major splitting into chunks.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace refit {

inline constexpr int kMaxDims = 8;

using Index = std::array<int64_t, kMaxDims>;

// A half-open box: dims [start[d], start[d] + size[d]) for d < ndim.
// Entries at d >= ndim are zero, so two boxes compare equal as values.
struct Box {
  int ndim = 0;
  Index start{};
  Index size{};

  static Box whole(const std::vector<int64_t>& shape);
  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  int64_t end(int d) const { return start[d] + size[d]; }
  bool operator==(const Box& o) const {
    return ndim == o.ndim && start == o.start && size == o.size;
  }
  bool operator!=(const Box& o) const { return !(*this == o); }
  // Row-major order of start, then size: a deterministic total order.
  bool operator<(const Box& o) const;
  std::string to_string() const;  // "[0:4, 2:6]"
};

// The intersection; empty (numel 0) when the boxes do not meet.
Box intersect(const Box& a, const Box& b);
bool contains(const Box& outer, const Box& inner);
bool overlaps(const Box& a, const Box& b);

// Splits `box` into row-major sub-boxes of at most `max_elems` elements each
// (at least one element each), in row-major order. A chunk spans whole
// trailing dims where it can, so that it maps to as few contiguous runs as
// possible.
std::vector<Box> split_row_major(const Box& box, int64_t max_elems);

}  // namespace refit
