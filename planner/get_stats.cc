#include "planner/get_stats.h"

#include <algorithm>

namespace refit {

GetStats get_stats(const Plan& plan, int64_t max_get_bytes, const GatherOptions* gather, PlanProgress* progress,
                   int64_t window_bytes, bool expanded) {
  GetStats s;
  s.per_receiver.assign(plan.layout().receivers.size(), 0);
  s.per_receiver_gathers.assign(s.per_receiver.size(), 0);
  s.per_receiver_small_alone.assign(s.per_receiver.size(), 0);
  if (max_get_bytes <= 0) return s;
  // `times` GETs of `bytes`, each cut into pieces of at most `cut`.
  // Returns how many GETs that is.
  auto count = [&](int32_t receiver, int64_t bytes, int64_t cut, int64_t times = 1) {
    const int64_t whole = bytes / cut;
    const int64_t rest = bytes % cut;
    const int64_t n = (whole + (rest > 0 ? 1 : 0)) * times;
    s.per_receiver[receiver] += n;
    s.gets += n;
    if (whole > 0) s.sizes[cut] += whole * times;
    if (rest > 0) s.sizes[rest] += times;
    return n;
  };
  // Runs below this travel alone only where they do not join a gather:
  // grouping off, a gather that closed with one run, or unpacked.
  const int64_t small_below = gather ? gather->below_bytes : 0;
  GatherOptions off;
  off.enabled = false;
  std::map<std::pair<int32_t, int32_t>, int64_t> gathered;  // (source, receiver) -> gather bytes
  GatherCounter counter(gather ? *gather : off, [&](const GatherClose& c) {
    if (c.runs > 1) {
      // One request: a gather is at most max_bytes.
      s.per_receiver_gathers[c.receiver] += count(c.receiver, c.bytes, gather->max_bytes, c.times);
      if (window_bytes > 0) gathered[{c.source, c.receiver}] += c.bytes * c.times;
    } else {
      const int64_t n = count(c.receiver, c.bytes, max_get_bytes, c.times);
      if (c.bytes < small_below) s.per_receiver_small_alone[c.receiver] += n;
    }
  });
  int64_t runs = 0, groups = 0;
  auto add = [&](const RunGroup& g) {
    if (progress && (groups & 4095) == 0) progress->set(PlanProgress::kRuns, runs, 0);
    ++groups;
    runs += g.count;
    counter.add(GatherInput{g.run.to.rank, g.run.from.rank, g.run.bytes}, g.count, 0);
  };
  for_each_network_run_group(plan, [&](const RunGroup& g) {
    if (!expanded) return add(g);
    for (int64_t k = 0; k < g.count; ++k) add(RunGroup{g.at(k)});
  });
  counter.finish();
  s.gathers = static_cast<int64_t>(counter.gathers());
  s.gathered_runs = static_cast<int64_t>(counter.gathered_runs());
  s.unpacked = static_cast<int64_t>(counter.unpacked());
  int32_t source = -1;
  int64_t bound = 0;
  for (const auto& [pair, bytes] : gathered) {
    if (pair.first != source) {
      source = pair.first;
      bound = 0;
    }
    bound += std::min(bytes, window_bytes);
    if (bound > s.gather_reply_bytes_wanted) {
      s.gather_reply_bytes_wanted = bound;
      s.gather_reply_wanted_source = source;
    }
  }
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
