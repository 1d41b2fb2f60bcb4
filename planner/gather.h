#pragma once
// Grouping a receiver's small network runs into gathers (docs/planner.md,
// "Gathers").
//
// A column slice of a tensor its source holds row-major arrives as one
// network run per row: hundreds of thousands of runs of a few hundred bytes,
// each its own GET, whose cost is the per-GET overhead, not the bytes. A
// gather is one request to a source for a list of its byte ranges; the
// source copies them in order into its replies and the puller scatters the
// replies into place (transport/ucx/am_rma.h). The grouping here decides
// which runs travel together: pure, deterministic, and the same for the
// receiver that executes it and for `refit-plan`, which counts it.
//
// Rules: a run of fewer than `below_bytes` bytes joins the open gather of
// its (receiver rank, source rank); a gather closes when the next run would
// take it past `max_bytes` or `max_entries`. Runs keep their input order
// inside a gather. A gather that ends with a single run is no gather: that
// run travels as a plain GET. A run below `below_bytes` but above
// `max_bytes` cannot be packed: it travels as a plain GET and is counted in
// `unpacked`, so that a configuration whose bounds are too small for its
// pieces shows in the report.

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "planner/status.h"

namespace refit {

// The most runs one gather may hold: what a source serves in one request
// (transport/ucx/am_rma.h, kMaxGatherEntries, which is asserted equal).
constexpr int64_t kGatherEntriesMax = 65536;

struct GatherOptions {
  bool enabled = true;
  // The agents' defaults (docs/refresh.md, "Gathers" says why these sizes).
  int64_t below_bytes = int64_t{1} << 20;  // runs smaller than this are grouped
  int64_t max_bytes = int64_t{16} << 20;   // bytes of one gather
  // Runs of one gather: a request carries 16 bytes per run, so 128 KiB at
  // most at this default (1 MiB at kGatherEntriesMax, the most a source
  // serves).
  int64_t max_entries = 8192;
};

// Ok, or invalid naming the key ("gather_below_bytes", "gather_bytes",
// "gather_entries") and its value.
Status validate(const GatherOptions& options);

// One network run as the grouping sees it.
struct GatherInput {
  int32_t receiver = 0;  // the rank that pulls it
  int32_t source = 0;    // the rank that serves it
  int64_t bytes = 0;     // > 0
};

// What the grouping passes on: a gather closed (`runs` >= 2), a gather
// that closed with one run (`runs` == 1), or a run that travels alone
// without joining one (`passed`: at least `below_bytes`, grouping off, or
// unpacked). `times` identical ones in a row.
struct GatherClose {
  int32_t receiver = 0;
  int32_t source = 0;
  int64_t bytes = 0;  // of one: all its runs' together
  int64_t runs = 1;   // of one
  uint64_t tag = 0;   // the tag of the add() that gave its last run
  bool passed = false;
  int64_t times = 1;
};

// The grouping over runs given in groups of equal runs (RunGroup): the same
// rules and the same result as adding them one by one, at a cost per gather
// closed, not per run. Streaming; deterministic.
class GatherCounter {
 public:
  GatherCounter(GatherOptions options, std::function<void(const GatherClose&)> on_close);
  // `count` runs of `run.bytes` each, in order. `tag` is the caller's mark
  // of these runs, passed back with each closing whose last run they hold.
  void add(const GatherInput& run, int64_t count, uint64_t tag);
  // Closes every open gather, in (receiver, source) order. Call once, after
  // the last add().
  void finish();

  uint64_t gathers() const { return gathers_; }
  uint64_t gathered_runs() const { return gathered_runs_; }
  uint64_t unpacked() const { return unpacked_; }

 private:
  struct Open {
    int64_t runs = 0;
    int64_t bytes = 0;
    uint64_t tag = 0;
  };
  void close(const std::pair<int32_t, int32_t>& key, Open& g);
  void emit(int32_t receiver, int32_t source, int64_t runs, int64_t bytes, uint64_t tag, int64_t times);

  GatherOptions options_;
  std::function<void(const GatherClose&)> on_close_;
  // (receiver, source) -> its open gather. Hashed: a plan of thousands of
  // ranks a side has hundreds of thousands of pairs, and every small run
  // looks its pair up; finish() sorts the keys.
  std::unordered_map<uint64_t, Open> open_;
  uint64_t gathers_ = 0;
  uint64_t gathered_runs_ = 0;
  uint64_t unpacked_ = 0;
};

// Runs as they are grouped, one by one: each input is either one of a
// gather's runs or a single (a plain GET). Streaming, so that a plan of a
// hundred million runs is grouped without holding them all.
class GatherGrouper {
 public:
  // `on_gather(runs)` receives each closed gather: the input indices
  // (counted from 0 in the order of add()) of its runs, in order, at least
  // two. `on_single(index)` receives each run that travels alone. Both are
  // called from add() or finish(), in a deterministic order.
  GatherGrouper(GatherOptions options, std::function<void(std::span<const uint64_t>)> on_gather,
                std::function<void(uint64_t)> on_single);
  void add(const GatherInput& run);
  // Closes every open gather. Call once, after the last add().
  void finish();

  // Inside on_gather or on_single: the receiver, source and bytes (all its
  // runs' together) of the gather or run being passed on, so that a caller
  // that counts need not remember each run until its gather closes.
  const GatherInput& closing() const { return closing_; }

  uint64_t gathers() const { return counter_.gathers(); }
  uint64_t gathered_runs() const { return counter_.gathered_runs(); }
  // Runs below `below_bytes` that did not fit `max_bytes` (see the top).
  uint64_t unpacked() const { return counter_.unpacked(); }

 private:
  void closed(const GatherClose& c);

  std::function<void(std::span<const uint64_t>)> on_gather_;
  std::function<void(uint64_t)> on_single_;
  GatherCounter counter_;
  std::map<std::pair<int32_t, int32_t>, std::vector<uint64_t>> open_;  // the counter's open gathers' runs
  uint64_t next_ = 0;
  bool passed_ = false;  // the run being added travelled alone
  GatherInput closing_;
};

// The same for a list held in memory: the gathers, as lists of indices into
// `runs`, in the order they close.
struct Grouping {
  std::vector<std::vector<uint64_t>> gathers;
  std::vector<uint64_t> singles;
  uint64_t unpacked = 0;
};
Grouping group_runs(std::span<const GatherInput> runs, const GatherOptions& options);

}  // namespace refit
