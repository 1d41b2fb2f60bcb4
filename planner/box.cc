#include "planner/box.h"

#include <algorithm>

namespace refit {

Box Box::whole(const std::vector<int64_t>& shape) {
  Box b;
  b.ndim = static_cast<int>(shape.size());
  for (int d = 0; d < b.ndim; ++d) b.size[d] = shape[d];
  return b;
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= size[d];
  return n;
}

bool Box::operator<(const Box& o) const {
  if (ndim != o.ndim) return ndim < o.ndim;
  if (start != o.start) return start < o.start;
  return size < o.size;
}

std::string Box::to_string() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) s += ", ";
    s += std::to_string(start[d]) + ":" + std::to_string(end(d));
  }
  return s + "]";
}

Box intersect(const Box& a, const Box& b) {
  Box r;
  r.ndim = a.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    int64_t lo = std::max(a.start[d], b.start[d]);
    int64_t hi = std::min(a.end(d), b.end(d));
    r.start[d] = lo;
    r.size[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

bool contains(const Box& outer, const Box& inner) {
  for (int d = 0; d < inner.ndim; ++d) {
    if (inner.start[d] < outer.start[d] || inner.end(d) > outer.end(d)) return false;
  }
  return true;
}

bool overlaps(const Box& a, const Box& b) {
  for (int d = 0; d < a.ndim; ++d) {
    if (std::max(a.start[d], b.start[d]) >= std::min(a.end(d), b.end(d))) return false;
  }
  return a.ndim > 0 || (a.ndim == 0 && b.ndim == 0);
}

std::vector<Box> split_row_major(const Box& box, int64_t max_elems) {
  std::vector<Box> out;
  if (box.empty()) return out;
  max_elems = std::max<int64_t>(max_elems, 1);
  if (box.numel() <= max_elems) {
    out.push_back(box);
    return out;
  }
  // Dims after k are taken whole (their product `inner` fits); dim k is cut
  // in steps of `step` indices; dims before k one index at a time.
  int k = box.ndim - 1;
  int64_t inner = 1;
  while (k >= 0 && inner * box.size[k] <= max_elems) {
    inner *= box.size[k];
    --k;
  }
  const int64_t step = max_elems / inner;  // >= 1: inner <= max_elems
  Index idx = box.start;
  for (;;) {
    for (int64_t s = box.start[k]; s < box.end(k); s += step) {
      Box c = box;
      for (int d = 0; d < k; ++d) {
        c.start[d] = idx[d];
        c.size[d] = 1;
      }
      c.start[k] = s;
      c.size[k] = std::min(step, box.end(k) - s);
      out.push_back(c);
    }
    int d = k - 1;
    while (d >= 0) {
      if (++idx[d] < box.end(d)) break;
      idx[d] = box.start[d];
      --d;
    }
    if (d < 0) break;
  }
  return out;
}

}  // namespace refit
