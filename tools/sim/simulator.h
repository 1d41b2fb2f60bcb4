#pragma once
// A discrete-event simulation of the refresh that refit would run for a
// plan, on a hardware model (planner/hardware.h). docs/simulator.md says
// what is modelled and what is not; in short:
//
// - Each receiver executes its part as the receiver agent does: its network
//   runs (for_each_run order) queued per source, split into GETs of
//   `get_chunk_bytes`, issued by the agent's own ChunkScheduler (the source
//   it is furthest behind with first, a window of `window_bytes` in
//   flight); each fan-out send
//   becomes ready once the network runs it reads have landed (and, with
//   `gets_land_in_host`, been copied to the GPU).
// - Resources are exclusive and served first come, first served: a
//   receiver posts its GETs one after another at the per-GET cost; a posted
//   GET holds its source's NIC for bytes / bandwidth, in the order GETs were
//   posted (GETs posted at one time in turns, favouring no receiver),
//   and its receiver's NIC takes the bytes in at its own rate;
//   host copies hold the GPU's PCIe link.
// - The fan-out, with `fanout_rounds` (the nccl fabric), in rounds, once
//   the network is simulated (nothing there waits for it): the ranks that
//   pass slices to each other go in lockstep; a round takes, per puller and
//   peer, the sends ready by its start in the order they became ready (at
//   most 256 runs and 62 ranges of consecutive positions, round_words.h)
//   and lasts two `local_op_us` plus its busiest rank's gather, bytes (out
//   or in, with `local_send_us` per operation) and scatter. Without it (the
//   cma and ucx fabrics), each send holds the puller's NVLink out and the
//   peer's NVLink in for `local_op_us` plus its bytes, one after another.
// - With `fanout_pack_bytes` (the nccl fabric's packed fan-out,
//   transport/fabric/pack.h), a round's small sends to a peer go in one
//   pack up to the peer's share of the area (pack.h's rule); without rounds
//   a small send ready before the puller's last pack to that peer has
//   started joins that pack. A packed send pays its bytes over NVLink plus
//   its gather and scatter copies in GPU memory, and no operation of its
//   own.
// - Consecutive network runs of one receiver from one source, with no
//   fan-out send reading them in between, are simulated as one job of up to
//   the plan's chunk bytes, with the GET count of all its runs. That keeps a
//   plan of 150 million small runs within memory; the GETs are all counted.
//   The runs are read in their groups (for_each_run_group), so a plan of
//   billions of runs costs its millions of groups.
// - Small runs are grouped into gathers as the receiver agents group them
//   (planner/gather.h, SimOptions::gather): a gather counts as one GET, at
//   the job that holds its last run.
// - With `host_cores` (refit-bench: every rank on one machine), the
//   prediction is at least the CPU time of all transfers (per byte of plain
//   GETs, of gathered runs and of fan-out sends, per GET, the CPU kernel's
//   conversions) over those cores: the ranks' own resources are only as
//   fast as the shared cores let them be.
// - Tensors the receivers hold in another dtype are walked as the agents
//   run them (for_each_run_group with its conversion step): the puller
//   stages a unit in the sources' dtype, converts it on its fan-out thread
//   once the unit's GETs have landed, and the fan-out carries the
//   receivers' dtype and the block scales. Sources that serve converted
//   copies (docs/conversion.md, "At the source") make them at publish.
//
// - The network is simulated in windows of time shorter than any GET takes
//   from its post to its landing, each window by several threads: one per
//   block of receivers, then one per block of sources (SimOptions::threads;
//   the result does not depend on their number). So are the fan-out's
//   rounds, one set of ranks in lockstep per thread at a time.
//
// Pure computation, no I/O. One simulation per call; calls on different
// plans may run at once.

#include <cstdint>
#include <string>
#include <vector>

#include "planner/gather.h"
#include "planner/hardware.h"
#include "planner/layout_json.h"
#include "planner/plan.h"
#include "planner/status.h"

namespace refit::sim {

// A resource of one rank and how much it carried.
struct LinkLoad {
  int32_t rank = -1;
  int64_t bytes = 0;
  double busy_seconds = 0;
};

// [start, end] of a phase in seconds from the refresh's start; both 0 when
// the phase does not happen.
struct Span {
  double start = 0;
  double end = 0;
  double seconds() const { return end - start; }
};

struct Phases {
  Span publish;  // the sources' copy into their host mirror
  Span network;  // first GET posted to last GET landed
  Span h2d;      // landed GET bytes copied to the GPU
  Span fanout;   // the local fabric's sends
  Span convert;  // the pullers' conversions of staged units
};

// One busy interval of one resource, for the trace. Adjacent intervals of
// one resource are merged.
enum class Lane : uint8_t { kPublish, kSourceNic, kPosting, kReceiverNic, kH2d, kNvlinkOut, kNvlinkIn, kConvert };
const char* lane_name(Lane lane);
struct TraceSpan {
  Lane lane;
  int32_t rank;
  double start;
  double end;
  int64_t bytes;
};

struct SimOptions {
  bool trace = false;
  // How the receivers group small network runs into gathers (planner/gather.h):
  // a gather is one GET, of the bytes of all its runs. The agents' defaults.
  GatherOptions gather;
  // Busy intervals of one resource closer than this merge into one trace
  // span: a NIC that is busy back to back is one bar, not a million. 50 us
  // keeps a DeepSeek-V3 trace (two million GET chunks) to a size a viewer
  // opens, and is a 1/4000 of its simulated refresh.
  double trace_merge_seconds = 50e-6;
  // The plan's runs are walked in their groups (RunGroup), at a cost per
  // group; `expanded` walks them one by one instead, for tests that check
  // that both give the same result.
  bool expanded = false;
  // The fan-out's rounds take the peers to which a puller sends the same
  // sequence of sends as one (a shard's replicas in a domain); false takes
  // each peer on its own, for the test that checks both give the same
  // result.
  bool fold_alike_peers = true;
  // Threads that read the plan into jobs (a block of pullers each) and
  // simulate the network (docs/simulator.md, "The network in windows"); 0:
  // one per core the process may use (usable_cores(), planner/cores.h), at
  // most one per 256 receivers. The result is the same
  // whatever the number. A trace, or the fan-out without `fanout_rounds`,
  // simulates the network on one.
  int threads = 0;
};

struct SimResult {
  std::string model;  // "event": simulated; "fluid": NIC bytes over bandwidth only
  double predicted_seconds = 0;
  Phases phases;
  LinkLoad busiest_source_nic;
  LinkLoad busiest_receiver_nic;
  LinkLoad busiest_posting;  // `bytes` counts GETs here
  LinkLoad busiest_nvlink_out;
  LinkLoad busiest_nvlink_in;
  LinkLoad busiest_convert;  // `bytes`: staged bytes (sources' dtype) it converted
  int64_t network_bytes = 0;
  int64_t local_bytes = 0;
  int64_t gets = 0;                 // GETs posted, all receivers (a gather is one)
  int64_t gathers = 0;              // gathers among them
  int64_t gets_per_receiver_max = 0;
  int64_t local_sends = 0;          // fan-out sends (runs to one peer after one network job)
  int64_t local_runs = 0;           // the contiguous runs in them: the fabric's sends (one each)
  int64_t local_ops = 0;            // fan-out operations charged local_op_us: sends, or packs of them
  int64_t local_packed = 0;         // sends that joined a pack another send opened (no op of their own)
  int64_t local_rounds = 0;         // with fanout_rounds: the rounds, summed over the sets of ranks in lockstep
  int64_t local_pairs = 0;          // with fanout_rounds: the (puller, peer) pairs with sends
  int64_t local_pair_sequences = 0; // the sequences of sends the rounds walked: a puller's alike peers share one
  int64_t jobs = 0;                 // network jobs simulated
  int64_t events = 0;               // GET chunks simulated
  int64_t converts = 0;             // conversion steps (ConvertStep) the pullers run
  int64_t convert_bytes = 0;        // what they read, in the sources' dtype
  int64_t source_convert_bytes = 0; // what the sources quantize at publish, in their dtype
  int64_t gathered_bytes = 0;       // network bytes carried in gathers (the rest went as plain GETs)
  // One shared machine (HardwareModel::host_cores > 0): the CPU time of the
  // refresh's transfers, and that over the cores, a bound the prediction
  // does not go below (`host_bound`: it is what binds).
  double host_cpu_seconds = 0;
  double host_bound_seconds = 0;
  bool host_bound = false;
  // Wall seconds of the simulation's stages, on this machine: reading the
  // plan into jobs and sends, the network's windows (with the receivers'
  // schedulers set up), the fan-out's rounds (0 without them), and the rest
  // (totals, busiest links, the host bound).
  struct StageSeconds {
    double jobs = 0;
    double network = 0;
    double rounds = 0;
    double finish = 0;
  } stage_seconds;
  // The threads of those stages (SimOptions::threads): the jobs', the
  // network's (one with a trace or without fan-out rounds) and the rounds'
  // (0 without them).
  struct StageThreads {
    int32_t jobs = 0;
    int32_t network = 0;
    int32_t rounds = 0;
  } stage_threads;
  std::vector<TraceSpan> trace;
};

// Simulates `plan` (kRefit or kNoDedup) on `hw`. Fails on a broadcast plan
// (it has no runs: use estimate_broadcast) or hardware that check_hardware
// refuses.
Result<SimResult> simulate(const Plan& plan, const HardwareModel& hw, const SimOptions& options = {});
// The same, for a caller that needs nothing more of the plan: its memory is
// given back once it is read into jobs, before the network is simulated
// (DeepSeek-V3 at 2048 ranks a side: 2.4 GB of plan, gone before the
// schedulers come). The plan's layout is the caller's and must outlive the
// call. On a broadcast plan or refused hardware, the plan is left as it was.
Result<SimResult> simulate(Plan&& plan, const HardwareModel& hw, const SimOptions& options = {});

// Sorts `keys` as std::sort would, where each key is a ready time's float
// bits (at or above 0) above a place below, and the places ascend as
// given: by the ready time, ties in place order. `spare` is scratch.
void sort_by_ready(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare);

// The broadcast baseline from its plan's per-NIC totals: the gather over all
// source NICs, then the busiest NIC's pulls with their GETs. Not an event
// simulation: the result's model is "fluid".
SimResult estimate_broadcast(const Plan& plan, const HardwareModel& hw);

// The lower bound (docs/simulator.md, "The lower bound"), at the
// model's achievable bandwidths: the largest of
// - per receiving domain, the distinct bytes its ranks need over the sum of
//   its GPUs' NIC bandwidth;
// - the minimum network bytes over the sum of all source NICs' bandwidth;
// - per receiving GPU, the bytes it needs over its NIC plus NVLink
//   bandwidth (what it can take in at all).
// `source_exclusive_seconds` (a source's bytes that no other source holds,
// over its NIC) and `source_group_seconds` (the same for a group of
// sources: the bytes that only its members hold, a pipeline stage's ranks
// or an expert's replicas, over their NICs) are reported beside it and are
// not part of the maximum.
struct LowerBound {
  double seconds = 0;
  std::string binding;  // which term is the largest
  double domain_nic_seconds = 0;
  int32_t domain = -1;
  double source_nics_seconds = 0;
  double gpu_ingress_seconds = 0;
  int32_t gpu = -1;
  double source_exclusive_seconds = 0;
  int32_t exclusive_source = -1;
  double source_group_seconds = 0;
  int32_t source_group_first = -1;  // its lowest source rank
  int32_t source_group_size = 0;
};

// REQUIRES a kRefit plan (its units carry the real domains).
Result<LowerBound> lower_bound(const Plan& refit_plan, const HardwareModel& hw);

// Writes `r`'s trace as Chrome/Perfetto trace-event JSON ("X" events, one
// process per lane, one thread per rank; times in microseconds).
bool write_trace_json(const SimResult& r, const std::string& title, const TextSink& sink);

}  // namespace refit::sim
