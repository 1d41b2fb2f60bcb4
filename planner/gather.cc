#include "planner/gather.h"

#include <algorithm>
#include <string>

namespace refit {

Status validate(const GatherOptions& o) {
  if (o.below_bytes < 0) {
    return Status::invalid("\"gather_below_bytes\" must not be negative, got " + std::to_string(o.below_bytes));
  }
  if (o.max_bytes <= 0) {
    return Status::invalid("\"gather_bytes\" must be a positive integer, got " + std::to_string(o.max_bytes));
  }
  if (o.max_entries < 2 || o.max_entries > kGatherEntriesMax) {
    return Status::invalid("\"gather_entries\" must lie in [2, " + std::to_string(kGatherEntriesMax) + "], got " +
                           std::to_string(o.max_entries));
  }
  return Status::ok();
}

GatherCounter::GatherCounter(GatherOptions options, std::function<void(const GatherClose&)> on_close)
    : options_(options), on_close_(std::move(on_close)) {}

void GatherCounter::emit(int32_t receiver, int32_t source, int64_t runs, int64_t bytes, uint64_t tag, int64_t times) {
  if (runs > 1) {
    gathers_ += static_cast<uint64_t>(times);
    gathered_runs_ += static_cast<uint64_t>(runs * times);
  }
  on_close_(GatherClose{receiver, source, bytes, runs, tag, false, times});
}

void GatherCounter::close(const std::pair<int32_t, int32_t>& key, Open& g) {
  if (g.runs > 0) emit(key.first, key.second, g.runs, g.bytes, g.tag, 1);
  g = Open{};
}

void GatherCounter::add(const GatherInput& run, int64_t count, uint64_t tag) {
  if (count <= 0) return;
  const int64_t b = run.bytes;
  if (!options_.enabled || b >= options_.below_bytes || b > options_.max_bytes) {
    if (options_.enabled && b < options_.below_bytes) unpacked_ += static_cast<uint64_t>(count);
    on_close_(GatherClose{run.receiver, run.source, b, 1, tag, true, count});
    return;
  }
  const std::pair<int32_t, int32_t> key{run.receiver, run.source};
  Open& g = open_[(static_cast<uint64_t>(static_cast<uint32_t>(run.receiver)) << 32) | static_cast<uint32_t>(run.source)];
  // A run joins the open gather unless it would take it past max_bytes or
  // max_entries; then the gather closes and the run opens the next one.
  if (g.runs > 0 && (g.bytes + b > options_.max_bytes || g.runs >= options_.max_entries)) close(key, g);
  const int64_t fit = std::min({count, options_.max_entries - g.runs, (options_.max_bytes - g.bytes) / b});
  g.runs += fit;
  g.bytes += fit * b;
  g.tag = tag;
  int64_t left = count - fit;
  if (left == 0) return;
  close(key, g);
  // Full gathers of `per` runs each, then the last, which stays open.
  const int64_t per = std::min(options_.max_entries, options_.max_bytes / b);  // >= 1: b <= max_bytes
  const int64_t full = (left - 1) / per;
  if (full > 0) emit(key.first, key.second, per, per * b, tag, full);
  left -= full * per;
  g.runs = left;
  g.bytes = left * b;
  g.tag = tag;
}

void GatherCounter::finish() {
  // In (receiver, source) order: deterministic.
  std::vector<std::pair<std::pair<int32_t, int32_t>, Open*>> open;
  open.reserve(open_.size());
  for (auto& [key, g] : open_)
    open.push_back({{static_cast<int32_t>(key >> 32), static_cast<int32_t>(static_cast<uint32_t>(key))}, &g});
  std::sort(open.begin(), open.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [key, g] : open) close(key, *g);
  open_.clear();
}

GatherGrouper::GatherGrouper(GatherOptions options, std::function<void(std::span<const uint64_t>)> on_gather,
                             std::function<void(uint64_t)> on_single)
    : on_gather_(std::move(on_gather)),
      on_single_(std::move(on_single)),
      counter_(options, [this](const GatherClose& c) { closed(c); }) {}

void GatherGrouper::closed(const GatherClose& c) {
  closing_ = GatherInput{c.receiver, c.source, c.bytes};
  if (c.passed) {
    passed_ = true;
    on_single_(next_);
    return;
  }
  std::vector<uint64_t>& runs = open_[{c.receiver, c.source}];
  if (runs.size() == 1) {
    on_single_(runs.front());
  } else {
    on_gather_(runs);
  }
  runs.clear();
}

void GatherGrouper::add(const GatherInput& run) {
  passed_ = false;
  counter_.add(run, 1, 0);
  if (!passed_) open_[{run.receiver, run.source}].push_back(next_);
  ++next_;
}

void GatherGrouper::finish() {
  counter_.finish();
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
