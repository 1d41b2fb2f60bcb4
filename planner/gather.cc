#include "planner/gather.h"

#include <string>

namespace refit {

Status validate(const GatherOptions& o) {
  if (o.below_bytes < 0) {
    return Status::invalid("\"gather_below_bytes\" must not be negative, got " + std::to_string(o.below_bytes));
  }
  if (o.max_bytes <= 0) {
    return Status::invalid("\"gather_bytes\" must be a positive integer, got " + std::to_string(o.max_bytes));
  }
  // 65536: the most ranges a source serves in one gather request
  // (transport/ucx/am_rma.h, kMaxGatherEntries).
  if (o.max_entries < 2 || o.max_entries > 65536) {
    return Status::invalid("\"gather_entries\" must lie in [2, 65536], got " + std::to_string(o.max_entries));
  }
  return Status::ok();
}

GatherGrouper::GatherGrouper(GatherOptions options, std::function<void(std::span<const uint64_t>)> on_gather,
                             std::function<void(uint64_t)> on_single)
    : options_(options), on_gather_(std::move(on_gather)), on_single_(std::move(on_single)) {}

void GatherGrouper::close(const std::pair<int32_t, int32_t>& key, Open& g) {
  closing_ = GatherInput{key.first, key.second, g.bytes};
  if (g.runs.size() == 1) {
    on_single_(g.runs.front());
  } else if (g.runs.size() > 1) {
    ++gathers_;
    gathered_runs_ += g.runs.size();
    on_gather_(g.runs);
  }
  g.runs.clear();
  g.bytes = 0;
}

void GatherGrouper::add(const GatherInput& run) {
  const uint64_t index = next_++;
  if (!options_.enabled || run.bytes >= options_.below_bytes) {
    closing_ = run;
    on_single_(index);
    return;
  }
  if (run.bytes > options_.max_bytes) {
    ++unpacked_;
    closing_ = run;
    on_single_(index);
    return;
  }
  const std::pair<int32_t, int32_t> key{run.receiver, run.source};
  Open& g = open_[key];
  if (!g.runs.empty() && (g.bytes + run.bytes > options_.max_bytes ||
                          static_cast<int64_t>(g.runs.size()) >= options_.max_entries)) {
    close(key, g);
  }
  g.runs.push_back(index);
  g.bytes += run.bytes;
}

void GatherGrouper::finish() {
  for (auto& [key, g] : open_) close(key, g);  // in key order: deterministic
  open_.clear();
}

Grouping group_runs(std::span<const GatherInput> runs, const GatherOptions& options) {
  Grouping out;
  GatherGrouper grouper(
      options, [&](std::span<const uint64_t> g) { out.gathers.emplace_back(g.begin(), g.end()); },
      [&](uint64_t i) { out.singles.push_back(i); });
  for (const GatherInput& r : runs) grouper.add(r);
  grouper.finish();
  out.unpacked = grouper.unpacked();
  return out;
}

}  // namespace refit
