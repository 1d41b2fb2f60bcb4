#pragma once
// The plan: for every receiving domain and tensor, what crosses the network
// once, from which source, into which rank, and who gets it from there over
// the local fabric (docs/planner.md, "Units, pieces, chunks").
//
// Vocabulary:
// - A cell is a box of a tensor cut along every boundary of the receiver
//   regions of one domain (coordinate compression per dim).
// - A unit is a maximal box of cells with the same consumers in the domain.
//   One consumer, the puller, pulls the unit over the network straight into
//   its final buffer; every other consumer receives it from the puller.
// - A piece is the part of a unit that one set of source regions (the
//   holders) covers: the unit cut along the source boundaries. The puller gets
//   each piece from one chosen holder rank. Cutting units by consumers first
//   and by sources second keeps the plan small when a trainer shards finely
//   (FSDP over 256 ranks cuts every tensor 256 ways, but each receiving
//   domain still has one unit per tensor it needs); pieces are shared between
//   units through interned PullSets.
// - A chunk is a row-major sub-box of a piece of at most chunk_bytes, the
//   grain of pipelining: chunk k is fanned out while chunk k+1 is in flight.
//
// Pullers and holders are chosen to balance bytes per NIC: bytes a holder
// must serve because it is the only one are counted first; then the remaining
// choices are made greedily, largest first, least loaded NIC wins, ties to the
// lowest rank. The same input gives the same plan, byte for byte.
//
// Thread safety: a finished Plan is read-only and may be read from any thread.
// It refers to the Layout it was made from, which must outlive it.

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <vector>

#include "planner/function_ref.h"
#include "planner/layout.h"
#include "planner/status.h"

namespace refit {

enum class Strategy {
  kRefit,      // one pull per domain, local fan-out inside it
  kNoDedup,    // every receiver rank pulls all it needs itself (vLLM sharded_rdt, NeMo RL nixl)
  kBroadcast,  // whole tensors gathered at one source, every receiver pulls whole tensors
};
const char* strategy_name(Strategy s);

// Where a running make_plan() is, for a progress display (refit-plan):
// written by the planning thread, readable from any other.
struct PlanProgress {
  // kRuns counts without a total (total stays 0).
  enum Step : int { kTensors = 0, kPlacing = 1, kRuns = 2 };
  std::atomic<int> step{kTensors};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> total{0};
  void set(Step s, int64_t d, int64_t t) {
    step.store(s, std::memory_order_relaxed);
    total.store(t, std::memory_order_relaxed);
    done.store(d, std::memory_order_relaxed);
  }
};

struct PlanOptions {
  Strategy strategy = Strategy::kRefit;
  int64_t chunk_bytes = int64_t{4} << 20;
  // Relayout (docs/refresh.md, "Column-major receivers"): a unit of a tensor
  // whose receivers hold the sources' dtype, whose pull would move runs of
  // fewer than this many bytes on average (a column-major receiver of a
  // row-major source: one element per run), is pulled row-major into the
  // puller's staging area in runs of up to chunk_bytes and copied from there
  // into the puller's layout (a ConvertStep of one dtype). 0, the default:
  // never. Only the walks that carry conversion steps (for_each_run and
  // for_each_run_group with on_convert) and the network runs do it.
  int64_t relayout_below_bytes = 0;
  // The most staging bytes one puller's relayouts may take (a conversion
  // staging area holds them after its conversions); a unit that would pass
  // it is pulled into its layout directly.
  int64_t relayout_staging_bytes = int64_t{1} << 30;
  // Threads that plan the units, each a range of consecutive tensors
  // (docs/planner.md, "Planning on threads"). 0, the default: one per core
  // the process may use (usable_cores(), planner/cores.h: its CPU affinity
  // and cgroup quota), at most one per 1024 tensors; negative is refused.
  // Has no effect on the plan.
  int threads = 0;
  // Not owned; null reports nothing. Has no effect on the plan.
  PlanProgress* progress = nullptr;
};

struct Consumer {
  int32_t rank = 0;     // receiver rank
  uint32_t region = 0;  // index into the tensor's receivers
};

struct Piece {
  Box box;
  uint32_t holders_begin = 0;  // into PullSet::holders: source region indices
  uint32_t holders_count = 0;
};

// A unit box cut by the source regions of its tensor. Shared by all units
// with the same box over the same source regions.
struct PullSet {
  Box box;  // the unit box that was cut
  std::vector<Piece> pieces;
  std::vector<uint32_t> holders;
  bool forced = false;  // every piece has exactly one holder rank
};

// The unit's box is its PullSet's (Plan::box): a unit is 28 bytes, and a
// DeepSeek-V3 plan has 1.4 million of them.
struct Unit {
  uint32_t tensor = 0;
  int32_t domain = 0;  // receiving domain (a rank, under kNoDedup)
  uint32_t consumers_begin = 0;  // into Plan::consumers()
  uint32_t consumers_count = 0;
  uint32_t puller = 0;           // index among this unit's consumers
  uint32_t pull_set = 0;         // index into Plan::pull_sets()
  uint32_t sources_begin = 0;    // into Plan::chosen_sources(): one per piece; unused when forced
};

// A source picked for one piece: the rank and the region it reads.
struct SourcePick {
  int32_t rank = 0;
  uint32_t region = 0;
};

struct PlanSummary {
  int64_t tensors = 0;
  int64_t total_bytes = 0;             // sum of all tensors' bytes
  int64_t network_bytes = 0;           // bytes GET over the network, all domains
  int64_t minimum_network_bytes = 0;   // sum over domains of distinct bytes its ranks need
  int64_t local_bytes = 0;             // bytes over the local fabric
  int64_t gather_bytes = 0;            // kBroadcast: bytes the gathering sources fetch
  int64_t units = 0;
  int64_t pulls = 0;                   // pieces over all units: one GET source each
  int64_t chunks = 0;
  int64_t max_source_nic_bytes = 0;
  int64_t max_receiver_nic_bytes = 0;
  double plan_seconds = 0;
  int threads = 0;  // threads that planned the units (PlanOptions::threads; 1 for kBroadcast)
};

class Plan {
 public:
  const Layout& layout() const { return *layout_; }
  const PlanOptions& options() const { return options_; }
  const PlanSummary& summary() const { return summary_; }
  const std::vector<Unit>& units() const { return units_; }
  const std::vector<PullSet>& pull_sets() const { return pull_sets_; }
  std::span<const Consumer> consumers(const Unit& u) const {
    return {consumers_.data() + u.consumers_begin, u.consumers_count};
  }
  const Consumer& puller(const Unit& u) const { return consumers_[u.consumers_begin + u.puller]; }
  const PullSet& pull_set(const Unit& u) const { return pull_sets_[u.pull_set]; }
  const Box& box(const Unit& u) const { return pull_sets_[u.pull_set].box; }
  int64_t bytes(const Unit& u) const {
    return box(u).numel() * dtype_bytes(layout_->tensors[u.tensor].dtype);
  }
  std::span<const uint32_t> holders(const PullSet& s, const Piece& p) const {
    return {s.holders.data() + p.holders_begin, p.holders_count};
  }
  // The source chosen for piece `i` of unit `u`.
  SourcePick source(const Unit& u, size_t i) const;
  // Bytes each rank sends (source) or pulls (receiver) over its NIC.
  const std::vector<int64_t>& source_nic_bytes() const { return source_nic_; }
  const std::vector<int64_t>& receiver_nic_bytes() const { return receiver_nic_; }

 private:
  friend Result<Plan> make_plan(const Layout& layout, const PlanOptions& options);
  const Layout* layout_ = nullptr;
  PlanOptions options_;
  PlanSummary summary_;
  std::vector<Unit> units_;
  std::vector<Consumer> consumers_;
  std::vector<PullSet> pull_sets_;
  std::vector<SourcePick> chosen_;
  std::vector<int64_t> source_nic_, receiver_nic_;
};

// Plans `layout` (which should have passed validate()). Fails, naming the
// tensor, the receiver rank and the box, when a receiver needs bytes that no
// source holds. Under kBroadcast the plan has no units, only its summary: it
// is the baseline that refit is measured against.
Result<Plan> make_plan(const Layout& layout, const PlanOptions& options = {});

// One contiguous byte copy. `from` is a source buffer for a network run and a
// receiver buffer of the same domain for a local run.
struct RunEnd {
  Side side = Side::kSource;
  int32_t rank = 0;
  uint32_t buffer = 0;  // index into Layout::buffers
  int64_t offset = 0;   // bytes
};
struct Run {
  bool local = false;
  RunEnd from;
  RunEnd to;
  int64_t bytes = 0;
};

// `count` runs of `run.bytes` each, the k-th at `run`'s offsets plus k times
// the strides: the rows of a column slice, passed on as one (a DeepSeek-V3
// plan at TP32 has billions of runs and a few million groups). No run of a
// group continues the one before it.
struct RunGroup {
  Run run;  // the first
  int64_t count = 1;
  int64_t from_stride = 0;  // bytes from one run's start to the next one's
  int64_t to_stride = 0;
  Run at(int64_t k) const;  // the k-th run
};

// Calls `fn` for every contiguous run of `plan` in an order that can be
// executed one after another: unit by unit, piece by piece, chunk by chunk,
// each chunk's network runs followed by its local runs to the other
// consumers. Adjacent runs that continue each other are merged.
void for_each_run(const Plan& plan, const std::function<void(const Run&)>& fn);

// The network runs of for_each_run(plan, fn), the same runs in the same
// order, without making the local ones: at cluster scale most runs are local
// (a domain of 8 fans each chunk out 7 times), and counting GETs needs only
// these. A unit the puller relayouts (PlanOptions::relayout_below_bytes) is
// the exception: its runs are the ones into the staging area, as the walk
// with conversion steps gives them.
void for_each_network_run(const Plan& plan, const std::function<void(const Run&)>& fn);

// The same runs, in the same order, in groups (RunGroup): expanding each
// group gives for_each_run's (for_each_network_run's) runs exactly. For
// whatever counts runs and does not need each one's offsets.
void for_each_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn);
void for_each_network_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn);

// A unit of a tensor whose receivers hold another dtype (docs/conversion.md,
// "At the receiver"): its puller lands the unit's box, row-major in the
// sources' dtype, at `stage_offset` of its conversion staging area, then
// converts it into its own region (receivers' dtype) and, for F8_E4M3,
// computes the box's block scales into its region of the scale tensor. The
// fan-out to the unit's other consumers carries the converted bytes and the
// scales. A relayout (PlanOptions::relayout_below_bytes) is the same step in
// one dtype: the staged box is copied into the region's strides.
struct ConvertStep {
  int32_t rank = 0;  // the puller, a receiver rank
  uint32_t tensor = 0;
  Box box;                   // the unit, in the tensor's index space
  int64_t stage_offset = 0;  // bytes into the rank's staging area
  uint32_t buffer = 0;       // Layout::buffers index of the puller's region
  int64_t offset = 0;        // element (receivers' dtype) of box.start in it
  Index strides{};
  int64_t scale_tensor = -1;  // F8_E4M3: the derived scale tensor, else -1
  uint32_t scale_buffer = 0;
  int64_t scale_offset = 0;   // element of the box's first block's scale
  Index scale_strides{};
};

// A network run into a puller's conversion staging area names this buffer.
inline constexpr uint32_t kStagingBuffer = UINT32_MAX;

// for_each_run, with the units of converted tensors, and those relayouted
// (PlanOptions::relayout_below_bytes), done the receiver's way: their network runs land in the puller's staging area (to.buffer is
// kStagingBuffer, to.offset a byte offset there), `on_convert` is called
// once the unit's network runs are out, and the local runs that follow
// carry the receivers' dtype from the puller's region, then the scales of
// the unit's blocks. Each puller's staging offsets start at 0 and are
// 64-byte aligned; *staging_bytes (optional) gets each rank's total.
// Fails, naming the tensor, when a converted unit is not block aligned or a
// consumer lacks the scales of its blocks.
Status for_each_run(const Plan& plan, const std::function<void(const Run&)>& fn,
                    const std::function<void(const ConvertStep&)>& on_convert);
// Receiver ranks [lo, hi): the pullers a walk is limited to.
struct PullerRange {
  int32_t lo = 0;
  int32_t hi = std::numeric_limits<int32_t>::max();
  bool contains(int32_t rank) const { return rank >= lo && rank < hi; }
};

// The same, in groups (RunGroup), as for_each_run_group gives them: for
// whatever counts runs (the simulator, docs/simulator.md). With `pullers`,
// only the units those ranks pull are walked: each puller's groups and
// steps are exactly those of the whole walk, in its order (a unit's runs
// all have its puller as one of their ranks, so a run of one puller never
// continues across another's unit), and walks of disjoint ranges can run
// at once, once the layout's index of names is built (Layout::find_tensor
// called once: a walk looks scale tensors up). The error is the first of
// the units walked.
Status for_each_run_group(const Plan& plan, const std::function<void(const RunGroup&)>& fn,
                          const std::function<void(const ConvertStep&)>& on_convert, PullerRange pullers = {});

// The order in which for_each_copy walks `box` from region `from` to region
// `to`: the dims of one index first, then the others in the memory order both
// regions share (outermost stride first: column-major regions walk the last
// dim outermost), or row-major where their orders differ or a stride is not
// positive. The innermost dims contiguous in both buffers form the run.
struct CopyOrder {
  std::array<int, kMaxDims> dims{};  // the box's dims, outermost first
  int outer = 0;                     // dims[0, outer) are iterated, dims[outer, ndim) are the run
  int64_t run = 1;                   // elements per run
};
CopyOrder copy_order(const Box& box, const Region& from, const Region& to);

// The contiguous runs that copy `box` from region `from` to region `to` (both
// of a tensor with elements of `elem_bytes`), as byte offsets within their
// buffers, in the order of copy_order, merged where contiguous in both.
void for_each_copy(const Box& box, const Region& from, const Region& to, int elem_bytes,
                   FunctionRef<void(int64_t from_offset, int64_t to_offset, int64_t bytes)> fn);

// The same runs in groups: `count` runs of `bytes`, the k-th at the offsets
// plus k times the strides (all in bytes). The group is the innermost dim of
// copy_order that is not merged into the run, so its runs do not continue
// each other.
struct CopyGroup {
  int64_t from_offset = 0;
  int64_t to_offset = 0;
  int64_t bytes = 0;
  int64_t count = 1;
  int64_t from_stride = 0;
  int64_t to_stride = 0;
};
void for_each_copy_group(const Box& box, const Region& from, const Region& to, int elem_bytes,
                         FunctionRef<void(const CopyGroup&)> fn);

}  // namespace refit
