#include "planner/get_stats.h"

namespace refit {

GetStats get_stats(const Plan& plan, int64_t max_get_bytes) {
  GetStats s;
  s.per_receiver.assign(plan.layout().receivers.size(), 0);
  if (max_get_bytes <= 0) return s;
  for_each_run(plan, [&](const Run& r) {
    if (r.local) return;
    const int64_t whole = r.bytes / max_get_bytes;
    const int64_t rest = r.bytes % max_get_bytes;
    const int64_t n = whole + (rest > 0 ? 1 : 0);
    s.per_receiver[r.to.rank] += n;
    s.gets += n;
    if (whole > 0) s.sizes[max_get_bytes] += whole;
    if (rest > 0) s.sizes[rest] += 1;
  });
  for (size_t i = 0; i < s.per_receiver.size(); ++i) {
    if (s.per_receiver[i] > s.gets_per_receiver_max) {
      s.gets_per_receiver_max = s.per_receiver[i];
      s.busiest_receiver = static_cast<int32_t>(i);
    }
  }
  if (s.gets > 0) {
    s.get_bytes_min = s.sizes.begin()->first;
    s.get_bytes_max = s.sizes.rbegin()->first;
    const int64_t want = (s.gets - 1) / 2;  // index of the lower median
    int64_t seen = 0;
    for (const auto& [bytes, count] : s.sizes) {
      if (seen + count > want) {
        s.get_bytes_median = bytes;
        break;
      }
      seen += count;
    }
  }
  return s;
}

std::map<int64_t, int64_t> size_classes(const GetStats& stats) {
  std::map<int64_t, int64_t> out;
  for (const auto& [bytes, count] : stats.sizes) {
    int64_t bound = 1;
    while (bound < bytes) bound <<= 1;
    out[bound] += count;
  }
  return out;
}

}  // namespace refit
