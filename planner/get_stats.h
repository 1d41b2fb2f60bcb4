#pragma once
// How many GETs a plan makes each receiver post, and how large they are.
// Bytes tell how long the wire is busy; the count tells what the GETs cost
// on top of that (an RDMA READ costs about the same to post and complete
// whatever its size), so the planner reports both.
//
// A GET is what a receiver agent issues: each network run of the plan
// (for_each_run), split into pieces of at most `max_get_bytes` (the agent's
// `chunk_bytes`). With `gather` (planner/gather.h), the runs grouped into a
// gather count as one GET of their total bytes, which is what the agent
// posts: one request of up to "gather_bytes".

#include <cstdint>
#include <map>
#include <vector>

#include "planner/gather.h"
#include "planner/plan.h"

namespace refit {

struct GetStats {
  int64_t gets = 0;                   // over all receivers
  std::vector<int64_t> per_receiver;  // GETs each receiver rank posts
  int64_t gets_per_receiver_max = 0;
  int32_t busiest_receiver = -1;      // the rank that posts the most (lowest on ties), -1 without GETs
  // Of each receiver's GETs: its gathers, and its plain GETs of runs below
  // `gather`'s below_bytes ("gather_below_bytes") that travel alone, each
  // run as many GETs as its chunks of at most `max_get_bytes`; the rest are
  // the chunks of runs of at least below_bytes. With `gather` disabled,
  // every run below below_bytes travels alone and counts here; without
  // `gather` (null) there is no threshold and both are zero.
  std::vector<int64_t> per_receiver_gathers;
  std::vector<int64_t> per_receiver_small_alone;
  int64_t get_bytes_median = 0;       // the lower median over all GETs, 0 without GETs
  int64_t get_bytes_min = 0;
  int64_t get_bytes_max = 0;
  std::map<int64_t, int64_t> sizes;   // GET bytes -> how many GETs of that size
  int64_t gathers = 0;                // gathers among the GETs (with `gather`)
  int64_t gathered_runs = 0;          // network runs that travel in them
  int64_t unpacked = 0;               // small runs too large for "gather_bytes" (gather.h)
  // What a source's pullers may ask it to hold for gathers: it copies each
  // gather it serves into reply messages, freed as their sends complete
  // (transport/ucx/am_rma.h), and each puller has at most its window in
  // flight. For the source where it is largest: the sum over its pullers
  // of min(window, the gather bytes that puller pulls from it). The source
  // holds at most its "gather_reply_bytes" of it (more waits). 0 without a
  // window or gathers.
  int64_t gather_reply_bytes_wanted = 0;
  int32_t gather_reply_wanted_source = -1;  // that source's rank, -1 without gathers
};

// REQUIRES max_get_bytes > 0 and a plan with units (not kBroadcast, which
// has only its summary: its GetStats are empty).
// `gather` null or disabled: every network run is its own GET.
// `progress` (may be null) counts the network runs read (PlanProgress::kRuns).
// `window_bytes` > 0: the receivers' "window_bytes", for
// gather_reply_bytes_wanted.
// The runs are counted in their groups (for_each_network_run_group), at a
// cost per group and per gather, not per run; `expanded` counts them one by
// one instead, for tests that check the two agree.
GetStats get_stats(const Plan& plan, int64_t max_get_bytes, const GatherOptions* gather = nullptr,
                   PlanProgress* progress = nullptr, int64_t window_bytes = 0, bool expanded = false);

// GETs of the same power-of-two size class, for a short table: the key is
// the class's upper bound (512 holds 257..512 bytes), the value the count.
std::map<int64_t, int64_t> size_classes(const GetStats& stats);

}  // namespace refit
