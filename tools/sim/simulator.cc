#include "tools/sim/simulator.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "planner/cores.h"
#include "transport/fabric/pack.h"
#include "transport/fabric/round_words.h"
#include "tools/sim/events.h"
#include "transport/ucx/chunking.h"

namespace refit::sim {
namespace {

// Network runs of one receiver from one source, simulated as one unit of
// the receiver's GET queue (simulator.h).
struct Job {
  int32_t source = 0;
  uint32_t sends_begin = 0;  // into its puller's Sim::sends_
  uint32_t sends_count = 0;
  bool closed = false;       // a fan-out send reads it: nothing more joins it
  bool staged = true;        // all its runs land in the conversion staging area
  // Simulated (kept here, not beside it, since its last chunk to land
  // reads both): all its GETs landed, and when its bytes are usable.
  bool landed = false;
  int64_t bytes = 0;
  int64_t gets = 0;          // GETs of all its runs
  double ready = 0;
};
static_assert(sizeof(Job) == 40, "a Job is 40 bytes: 23 million of them simulate DeepSeek-V3 at 4096 ranks");

// Fan-out runs from one puller to one peer, read from one job: one send,
// whatever its runs (a DeepSeek-V3 plan on 2048 GPUs has 160 million).
struct Send {
  int32_t to = 0;
  uint32_t runs = 1;  // the fabric's sends: one per contiguous run
  int64_t bytes = 0;
};

// One puller's sends, in plan order, in segments of 4096 (64 KiB): the
// sends of a puller lie together (the fan-out's rounds read them puller by
// puller), none is ever copied to a larger array, and each thread of
// build_jobs fills its own pullers' stores.
class SendStore {
 public:
  static constexpr int kBits = 12;
  static constexpr uint32_t kSegment = uint32_t{1} << kBits;
  // A puller's sends are numbered in 32 bits.
  static constexpr uint64_t kMaxSize = std::numeric_limits<uint32_t>::max();

  uint32_t size() const { return size_; }
  Send& operator[](uint32_t i) { return segs_[i >> kBits][i & (kSegment - 1)]; }
  const Send& operator[](uint32_t i) const { return segs_[i >> kBits][i & (kSegment - 1)]; }
  Send& back() { return (*this)[size_ - 1]; }
  // False, storing nothing, once there are kMaxSize sends.
  bool push_back(const Send& s) {
    if (size_ >= kMaxSize) return false;
    if ((size_ >> kBits) == segs_.size()) segs_.push_back(std::make_unique<Send[]>(kSegment));
    (*this)[size_++] = s;
    return true;
  }
  static Status too_many() {
    return Status::invalid("the plan's fan-out has more than " + std::to_string(kMaxSize) +
                           " sends (runs from one network job to one peer) in all or from one puller: more "
                           "than the simulator numbers");
  }

 private:
  std::vector<std::unique_ptr<Send[]>> segs_;
  uint32_t size_ = 0;
};

// The fan-out op a puller's sends to one peer last opened (packed fan-out):
// a send ready by `start` joins it, while it has room.
struct Pack {
  double start = -1;
  uint64_t bytes = 0;
  uint32_t count = 0;
};

// A conversion step (ConvertStep) of one puller. It waits until every job
// of its puller up to `wait_job` has landed: the jobs that staged its box
// are among them (they are the jobs the puller added runs to since its last
// send or step, and those jobs are not closed: later runs may still join
// them, up to the plan's chunk). A puller's steps run in their order, on
// its fan-out thread, as the agent's conversions do
// (plugin/receiver/transfer_executor.cc); its sends (the unit's fan-out, in
// the receivers' dtype, then the scales) go after it.
struct Convert {
  int32_t puller = 0;
  bool cast = false;            // a cast, not an F8_E4M3 quantization
  bool relayout = false;        // one dtype: a strided copy (docs/refresh.md, "Column-major receivers")
  int32_t wait_job = -1;        // into Sim::jobs_[puller]
  int64_t staged_bytes = 0;     // what the kernel reads, in the sources' dtype
  int64_t out_bytes = 0;        // what it writes, in the receivers' dtype
  uint32_t sends_begin = 0;     // into its puller's Sim::sends_
  uint32_t sends_count = 0;
};

// The sends of one puller to one peer (the rounds' fan-out): their range
// in the puller's order, and how far the rounds have passed them on. The
// peers to which the puller sends the same sequence (the same bytes and
// runs, ready at the same times: a shard's replicas in one domain, each
// sent every unit the puller pulled for them) are one Pair: `to` and
// `alike`. The rounds take the same from each of them in the same rounds,
// so one pass over the sequence serves them all.
struct Pair {
  int32_t from = 0;
  int32_t to = 0;
  uint64_t pos = 0;  // the next send's position (simulate_rounds)
  uint64_t end = 0;
  uint32_t runs_done = 0;  // runs of the next send already passed on
  std::vector<int32_t> alike;  // the other peers sent the same sequence
};

// What one rank moves in the round being simulated.
struct RankRound {
  bool touched = false;
  int64_t out_bytes = 0, in_bytes = 0;
  int64_t out_ops = 0, in_ops = 0;            // packs and unpacked sends
  int64_t gather_bytes = 0, scatter_bytes = 0;  // packed bytes it copies in GPU memory
};

// One resource: free from `free_at` on; what it carried.
struct Resource {
  double free_at = 0;
  double busy = 0;
  int64_t bytes = 0;
};

// Runs body(0) .. body(threads - 1), each on its own thread (body(0) on
// the caller's). Should one throw (out of memory), or a thread not start,
// `stop()` is called so that the others do not wait for it, every thread is
// joined, and the first exception is thrown on the caller's thread, as it
// would have been with one thread.
template <typename Body, typename Stop>
void parallel(int32_t threads, const Body& body, const Stop& stop) {
  std::mutex mu;
  std::exception_ptr failed;
  auto run = [&](int32_t k) {
    try {
      body(k);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed) failed = std::current_exception();
      }
      stop();
    }
  };
  std::vector<std::thread> helpers;
  try {
    for (int32_t k = 1; k < threads; ++k) helpers.emplace_back(run, k);
  } catch (...) {
    stop();
    for (std::thread& t : helpers) t.join();
    throw;
  }
  if (threads > 0) run(0);
  for (std::thread& t : helpers) t.join();
  if (failed) std::rethrow_exception(failed);
}
template <typename Body>
void parallel(int32_t threads, const Body& body) {
  parallel(threads, body, [] {});
}

// A barrier for a few threads that each wait a few microseconds at it, a
// hundred thousand times a simulation: they spin, then yield the core, then
// sleep (a shared machine, or more threads than cores).
class SpinBarrier {
 public:
  void reset(int32_t threads) {
    threads_ = threads;
    arrived_.store(0);
    broken_.store(false);
  }
  // False once the barrier is broken: a thread failed, and the others stop.
  bool wait() {
    if (threads_ == 1) return !broken_.load(std::memory_order_acquire);
    const uint32_t round = round_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      round_.fetch_add(1, std::memory_order_acq_rel);
      round_.notify_all();
      return !broken_.load(std::memory_order_acquire);
    }
    for (int spins = 0; round_.load(std::memory_order_acquire) == round; ++spins) {
      if (spins < 1024) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else if (spins < 1040) {
        std::this_thread::yield();
      } else {
        round_.wait(round, std::memory_order_acquire);  // more threads than free cores: sleep
      }
    }
    return !broken_.load(std::memory_order_acquire);
  }
  // Releases every waiting thread, now and at every later wait.
  void break_all() {
    broken_.store(true, std::memory_order_release);
    round_.fetch_add(1, std::memory_order_acq_rel);
    round_.notify_all();
  }

 private:
  int32_t threads_ = 1;
  std::atomic<int32_t> arrived_{0};
  std::atomic<uint32_t> round_{0};
  std::atomic<bool> broken_{false};
};

// Posts a source takes at one time, decided at one time, go in turns: by
// the receiver's number plus its count of posts before the ones it decided
// then, modulo the receivers. Receivers in lockstep tie at every source,
// each at the same count: the first place moves on as they post, so none is
// favoured. (Ordered by receiver, the last of them lost every tie.) All the
// posts one receiver decides at once share a turn, so they go in the order
// it posted them; it decides at one time once (its chunks land one after
// another).
uint32_t tie_turn(int32_t receiver, uint64_t posted_before, uint64_t receivers) {
  return static_cast<uint32_t>((static_cast<uint64_t>(receiver) + posted_before % receivers) % receivers);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The shared machine's bound (simulator.h): `cpu` seconds of CPU over the
// host's cores, which the prediction does not go below.
void apply_host_bound(double cpu, const HardwareModel& hw, SimResult& r) {
  r.host_cpu_seconds = cpu;
  r.host_bound_seconds = cpu / hw.host_cores;
  if (r.host_bound_seconds > r.predicted_seconds) {
    r.predicted_seconds = r.host_bound_seconds;
    r.host_bound = true;
  }
}

// A post of a window that a worker's source serves.
struct Serving {
  uint32_t worker;  // whose window's posts
  uint32_t index;   // into them
};

// What one worker of the network's simulation owns (Sim::simulate_network):
// a block of receivers and one of sources, its receivers' events, and
// what it found, summed up once the network is done.
struct Worker {
  int32_t lo = 0, hi = 0;          // its receivers
  int32_t src_lo = 0, src_hi = 0;  // its sources
  WindowQueue events;
  std::vector<Event> taken;        // the window's events, as taken from the queue
  std::vector<Event> posts;        // its receivers' chunks posted in the window
  std::vector<Event> landing;      // its receivers' chunks that land in the window
  std::vector<double> sent;        // per post: when its source's NIC has sent it
  std::vector<Serving> serving;    // the window's posts to its sources
  // Per window's parity: the first window after it that holds one of its
  // events, and the first that a post its sources sent can land in.
  uint64_t front[2] = {0, 0};
  uint64_t sent_window[2] = {0, 0};
  bool order_kept = true;
  bool window_kept = true;
  int64_t events_count = 0;
  double network_end = 0, h2d_end = 0, convert_end = 0;
  double first_get = -1, h2d_first = -1, convert_first = -1;
};

class Sim {
 public:
  Sim(const Plan& plan, const HardwareModel& hw, const SimOptions& options)
      : plan_(&plan), L_(plan.layout()), hw_(hw), opt_(options) {}
  // Owns the plan, and gives its memory back once it is read into jobs.
  Sim(Plan&& plan, const HardwareModel& hw, const SimOptions& options)
      : owned_(std::move(plan)), plan_(&*owned_), L_(owned_->layout()), hw_(hw), opt_(options) {}

  Result<SimResult> run() {
    const int32_t R = L_.num_ranks(Side::kReceiver);
    const int32_t S = L_.num_ranks(Side::kSource);
    using Clock = std::chrono::steady_clock;
    auto t = Clock::now();
    auto lap = [&t] {
      const auto now = Clock::now();
      const double s = std::chrono::duration<double>(now - t).count();
      t = now;
      return s;
    };
    jobs_.assign(R, {});
    r_.stage_threads.jobs = threads(R);
    r_.stage_threads.network = workers(R);
    if (hw_.fanout_rounds) r_.stage_threads.rounds = opt_.trace ? 1 : workers(R);
    REFIT_RETURN_IF_ERROR(build_jobs(R, S));
    if (owned_) {  // nothing past the jobs reads the plan
      plan_ = nullptr;
      owned_.reset();
      give_back_free_memory();
    }
    r_.stage_seconds.jobs = lap();
    src_nic_.assign(S, {});
    rcv_nic_.assign(R, {});
    post_.assign(R, {});
    h2d_.assign(R, {});
    nvl_out_.assign(R, {});
    nvl_in_.assign(R, {});
    conv_.assign(R, {});
    domain_size_.assign(R, 0);
    {
      std::vector<int32_t> gpus;
      for (const ReceiverRank& r : L_.receivers) {
        if (static_cast<size_t>(r.domain) >= gpus.size()) gpus.resize(r.domain + 1, 0);
        ++gpus[r.domain];
      }
      for (int32_t p = 0; p < R; ++p) domain_size_[p] = gpus[L_.receivers[p].domain];
    }
    last_span_.assign(static_cast<size_t>(Lane::kConvert) + 1, std::vector<int64_t>(std::max(R, S), -1));
    publish(S);
    if (hw_.fanout_rounds) send_ready_.assign(send_base_[R], std::numeric_limits<float>::infinity());
    REFIT_RETURN_IF_ERROR(simulate_network(R, S, r_.stage_threads.network));
    release_network();
    r_.stage_seconds.network = lap();
    if (hw_.fanout_rounds) simulate_rounds(R, r_.stage_threads.rounds);
    r_.stage_seconds.rounds = lap();
    finish(R, S);
    r_.stage_seconds.finish = lap();
    return std::move(r_);
  }

 private:
  // How many threads build the jobs and simulate the network
  // (SimOptions::threads): one per core the process may use
  // (usable_cores()), at most one per 256 receivers.
  int32_t threads(int32_t R) const {
    int32_t n = opt_.threads;
    if (n <= 0) n = std::min(cores_, R / 256);
    return std::clamp(n, 1, std::max(R, 1));
  }

  // How many of them simulate the network. A trace's spans and the fan-out
  // without rounds (each send holds two ranks' links as it comes) are
  // simulated in the order of their events: one.
  int32_t workers(int32_t R) const {
    if (opt_.trace || !hw_.fanout_rounds || R < 2) return 1;
    return threads(R);
  }

  // What one thread of build_jobs makes from its block of pullers: their
  // jobs and sends go straight into jobs_ and sends_ (one of each a
  // puller), their conversion steps here, numbered from 0, until
  // build_jobs joins them.
  struct Built {
    int32_t lo = 0, hi = 0;  // its pullers
    std::vector<Convert> converts;
    int64_t network_bytes = 0, local_bytes = 0, local_runs = 0, convert_bytes = 0;
    int64_t gets = 0, gathered_bytes = 0, gathers = 0;
    Status status = Status::ok();
    bool too_many_sends = false;  // a puller of the block has more than SendStore numbers
    // The walk's state between groups.
    // Per (source, puller - lo): its open job. By source first: the plan
    // gives a source's runs to one puller after another (a tensor's units
    // by puller), and so these reads mostly fall on the line of the one
    // before (six in ten at DeepSeek-V3 1024+1024, against 1 in 250 with
    // each puller's sources together).
    std::vector<int32_t> open;
    std::vector<int32_t> last;  // per puller - lo: its last job
    int64_t last_send_puller = -1;
    bool converting = false;        // some tensor converts: track what follows
    std::vector<int32_t> touched;   // per puller - lo: the last job it added runs to since its last send or step
    std::vector<int32_t> step;      // per puller - lo: the step its next sends follow (no GET since), or -1
  };

  // Walks the plan's runs in execution order, in their groups (RunGroup),
  // and makes them jobs and sends (simulator.h). Sends read the last job of
  // their puller: the runs of a chunk come right before its fan-out
  // (for_each_run's order). Small runs are grouped into gathers as the
  // receiver agents group them (planner/gather.h); a gather's one GET is
  // charged to the job that holds its last run, once it closes.
  // Each thread walks the units of its block of pullers (PullerRange): a
  // puller's jobs, sends and steps are the same whatever the blocks, and
  // gathers group the runs of one (receiver, source), so are theirs. The
  // threads' conversion steps are then joined, in block order, and every
  // send numbered (send_base_).
  Status build_jobs(int32_t R, int32_t S) {
    const int32_t n = threads(R);
    std::vector<int64_t> gets(R, 0);
    bool converting = plan_->options().relayout_below_bytes > 0;
    for (const Tensor& t : L_.tensors) converting |= t.dtype_on(Side::kReceiver) != t.dtype;
    steps_.assign(R, {});
    sends_.clear();
    sends_.resize(R);
    // The walks look the scale tensors up by name: the layout's index of
    // names is built here, on one thread (Layout::find_tensor).
    (void)L_.find_tensor("");
    std::vector<Built> built(static_cast<size_t>(n));
    parallel(n, [&](int32_t k) {
      Built& b = built[k];
      b.lo = static_cast<int32_t>(static_cast<int64_t>(R) * k / n);
      b.hi = static_cast<int32_t>(static_cast<int64_t>(R) * (k + 1) / n);
      b.converting = converting;
      walk(b, S, gets);
    });
    for (Built& b : built) {
      if (!b.status) {
        // The first error of the whole walk, whatever the blocks found.
        Status first = for_each_run_group(*plan_, [](const RunGroup&) {}, [](const ConvertStep&) {});
        return first ? b.status : first;
      }
    }
    for (Built& b : built) {
      const uint32_t conv_base = static_cast<uint32_t>(converts_.size());
      for (int32_t p = b.lo; p < b.hi; ++p)
        for (int32_t& st : steps_[p]) st += static_cast<int32_t>(conv_base);
      converts_.insert(converts_.end(), b.converts.begin(), b.converts.end());
      r_.network_bytes += b.network_bytes;
      r_.local_bytes += b.local_bytes;
      r_.local_runs += b.local_runs;
      r_.convert_bytes += b.convert_bytes;
      r_.gets += b.gets;
      r_.gathered_bytes += b.gathered_bytes;
      r_.gathers += b.gathers;
    }
    // Every send's number: its puller's base plus its place there.
    send_base_.assign(static_cast<size_t>(R) + 1, 0);
    for (int32_t p = 0; p < R; ++p) {
      const uint64_t next = uint64_t{send_base_[p]} + sends_[p].size();
      if (next > SendStore::kMaxSize) return SendStore::too_many();
      send_base_[p + 1] = static_cast<uint32_t>(next);
    }
    std::vector<Built>().swap(built);
    for (int32_t p = 0; p < R; ++p) {
      r_.gets_per_receiver_max = std::max(r_.gets_per_receiver_max, gets[p]);
      r_.jobs += static_cast<int64_t>(jobs_[p].size());
    }
    r_.local_sends = static_cast<int64_t>(send_base_[R]);
    r_.converts = static_cast<int64_t>(converts_.size());
    return Status::ok();
  }

  // One thread's walk of build_jobs: pullers [b.lo, b.hi).
  void walk(Built& b, int32_t S, std::vector<int64_t>& gets) {
    const int64_t get_chunk = static_cast<int64_t>(hw_.get_chunk_bytes);
    const auto P = static_cast<size_t>(b.hi - b.lo);
    GatherCounter counter(opt_.gather, [&](const GatherClose& c) {
      const int64_t n = (c.runs > 1 ? 1 : ceil_div(c.bytes, get_chunk)) * c.times;
      if (c.runs > 1) b.gathered_bytes += c.bytes * c.times;
      const auto p = static_cast<int32_t>(c.tag >> 32);
      jobs_[p][static_cast<uint32_t>(c.tag)].gets += n;
      gets[p] += n;
      b.gets += n;
    });
    b.open.assign(P * static_cast<size_t>(S), -1);
    b.last.assign(P, -1);
    b.touched.assign(P, -1);
    b.step.assign(P, -1);
    b.status = for_each_run_group(
        *plan_,
        [&](const RunGroup& g) {
          if (!opt_.expanded) return add_group(g, b, counter);
          for (int64_t k = 0; k < g.count; ++k) add_group(RunGroup{g.at(k)}, b, counter);
        },
        [&](const ConvertStep& c) { add_convert(c, b); }, PullerRange{b.lo, b.hi});
    if (b.status && b.too_many_sends) b.status = SendStore::too_many();
    counter.finish();
    b.gathers = static_cast<int64_t>(counter.gathers());
    std::vector<int32_t>().swap(b.open);
  }

  // A conversion step: it reads the jobs the puller added runs to since its
  // last send or step (the runs that staged its box, and the pieces of the
  // unit a source converted): it waits for the puller's jobs up to the
  // last of them, and for the puller's steps before it.
  void add_convert(const ConvertStep& c, Built& b) {
    const Tensor& t = L_.tensors[c.tensor];
    const int32_t p = c.rank;
    Convert cv;
    cv.puller = p;
    cv.cast = t.dtype_on(Side::kReceiver) != DType::kF8E4M3;
    cv.relayout = t.dtype_on(Side::kReceiver) == t.dtype;
    cv.wait_job = b.touched[p - b.lo];
    cv.staged_bytes = c.box.numel() * dtype_bytes(t.dtype);
    cv.out_bytes = c.box.numel() * dtype_bytes(t.dtype_on(Side::kReceiver));
    b.step[p - b.lo] = static_cast<int32_t>(b.converts.size());
    steps_[p].push_back(b.step[p - b.lo]);
    b.converts.push_back(cv);
    b.convert_bytes += cv.staged_bytes;
  }

  // A send of `bytes` to `to` from a job's or a step's sends (they are
  // contiguous in the puller's sends); runs to the same peer in a row are
  // one send.
  void add_send(uint32_t& begin, uint32_t& count, int32_t p, int32_t to, int64_t bytes, int64_t runs, Built& b) {
    b.local_bytes += bytes;
    SendStore& sends = sends_[p];
    if (b.last_send_puller == p && count > 0 && sends.back().to == to &&
        sends.back().runs + runs <= std::numeric_limits<uint32_t>::max()) {
      sends.back().bytes += bytes;
      sends.back().runs += static_cast<uint32_t>(runs);
      return;
    }
    if (count == 0) begin = sends.size();
    if (!sends.push_back(Send{to, static_cast<uint32_t>(runs), bytes})) {
      b.too_many_sends = true;
      return;
    }
    ++count;
    b.last_send_puller = p;
  }

  void add_group(const RunGroup& g, Built& b, GatherCounter& counter) {
    const Run& run = g.run;
    const int32_t p = run.local ? run.from.rank : run.to.rank;
    const size_t i = static_cast<size_t>(p - b.lo);
    std::vector<Job>& jobs = jobs_[p];
    if (!run.local) {
      const int64_t cap = plan_->options().chunk_bytes;
      const int32_t s = run.from.rank;
      int32_t& j = b.open[static_cast<size_t>(s) * (b.hi - b.lo) + i];
      const int64_t bytes = run.bytes;
      // The runs fill the open job up to `cap` bytes, then the next ones
      // (a run larger than `cap` is a job of its own).
      for (int64_t left = g.count; left > 0;) {
        if (j < 0 || jobs[j].closed || jobs[j].bytes + bytes > cap) {
          j = static_cast<int32_t>(jobs.size());
          jobs.push_back(Job{.source = s});
        }
        const int64_t m = std::min(left, std::max<int64_t>(1, (cap - jobs[j].bytes) / bytes));
        jobs[j].bytes += m * bytes;
        jobs[j].staged &= run.to.buffer == kStagingBuffer;
        b.network_bytes += m * bytes;
        counter.add(GatherInput{p, s, bytes}, m, (static_cast<uint64_t>(p) << 32) | static_cast<uint32_t>(j));
        if (b.converting) b.touched[i] = std::max(b.touched[i], j);
        left -= m;
      }
      b.last[i] = j;
      b.last_send_puller = -1;
      if (b.converting) b.step[i] = -1;
      return;
    }
    const int64_t bytes = run.bytes * g.count;
    b.local_runs += g.count;
    if (b.converting) {
      b.touched[i] = -1;
      if (b.step[i] >= 0) {  // the unit a step converted: its sends wait for it
        Convert& cv = b.converts[b.step[i]];
        return add_send(cv.sends_begin, cv.sends_count, p, run.to.rank, bytes, g.count, b);
      }
    }
    // A send reads bytes this puller pulled: its last job brought them.
    // Closed, it is no longer its source's open job (which it is: only a
    // run from that source changes either), so that the next run from the
    // source starts a job without reading this one.
    Job& job = jobs[b.last[i]];
    if (!job.closed) {
      job.closed = true;
      b.open[static_cast<size_t>(job.source) * (b.hi - b.lo) + i] = -1;
    }
    add_send(job.sends_begin, job.sends_count, p, run.to.rank, bytes, g.count, b);
  }

  // Sources that serve a host mirror copy each shard there at publish, and
  // sources that serve converted copies (Tensor::converted_sources, made by
  // "quantize": "source") convert them with the CPU kernel, one thread per
  // source (docs/conversion.md, "At the source"); a source's NIC serves
  // nothing before its publish is done.
  void publish(int32_t S) {
    std::vector<int64_t> shard(S, 0), converted(S, 0);
    for (const Tensor& t : L_.tensors) {
      const int eb = dtype_bytes(t.dtype);
      if (hw_.source_host_mirror) {
        for (const Region& reg : t.sources) {
          const int64_t b = reg.box.numel() * eb;
          for (int32_t s : L_.source_sets.get(reg.ranks)) shard[s] += b;
        }
      }
      if (t.derived_from >= 0) continue;  // scales: computed with their weight's copy
      for (const Region& reg : t.converted_sources) {
        const int64_t b = reg.box.numel() * eb;
        for (int32_t s : L_.source_sets.get(reg.ranks)) converted[s] += b;
      }
    }
    for (int32_t s = 0; s < S; ++s) {
      if (shard[s] == 0 && converted[s] == 0) continue;
      r_.source_convert_bytes += converted[s];
      const double end = static_cast<double>(shard[s]) / hw_.d2h_bytes_per_s() +
                         static_cast<double>(converted[s]) / hw_.host_convert_bytes_per_s();
      src_nic_[s].free_at = end;
      r_.phases.publish.end = std::max(r_.phases.publish.end, end);
      span(Lane::kPublish, s, 0, end, shard[s]);
    }
  }

  // The network's simulation in windows of time (docs/simulator.md, "The
  // network in windows"). Receivers interact only through the sources' NICs,
  // and a GET posted at t lands no earlier than t plus the latency and its
  // bytes on the wire. So within a window shorter than that, each receiver's
  // landed chunks (its scheduler, its conversions, the GETs they let it
  // post) touch only its own state, and what they post in the window lands
  // after it. A window is therefore simulated in three steps, each in
  // parallel over blocks of receivers or of sources: every receiver takes
  // its events in the window (landed chunks are simulated, posted ones set
  // aside); every source's NIC serves the window's posted chunks in the
  // order they were posted (ties: Event::decided, then tie_turn); every
  // receiver's NIC takes them in, and they land in a later window.
  // The result does not depend on the number of workers.
  Status simulate_network(int32_t R, int32_t S, int32_t threads) {
    ucx::WindowLimits limits;
    limits.chunk_bytes = static_cast<uint64_t>(hw_.get_chunk_bytes);
    limits.max_bytes_in_flight = static_cast<uint64_t>(hw_.window_bytes);
    limits.max_bytes_per_endpoint = static_cast<uint64_t>(hw_.window_bytes);
    // Jobs stand for many GETs each: only the byte window binds.
    limits.max_ops_in_flight = std::numeric_limits<uint64_t>::max();
    limits.max_ops_per_endpoint = std::numeric_limits<uint64_t>::max();
    // Each receiver's scheduler, on the threads, a block of receivers each.
    scheds_.clear();
    scheds_.resize(R);
    cur_.assign(R, {});
    std::vector<uint64_t> smallest(static_cast<size_t>(threads), limits.chunk_bytes);  // per block
    std::vector<Status> failed(static_cast<size_t>(threads), Status::ok());
    parallel(threads, [&](int32_t k) {
      std::vector<ucx::ChunkRun> runs;
      std::vector<int32_t> index_of(static_cast<size_t>(S), -1);
      const auto hi = static_cast<int32_t>(static_cast<int64_t>(R) * (k + 1) / threads);
      for (auto p = static_cast<int32_t>(static_cast<int64_t>(R) * k / threads); p < hi; ++p) {
        // Endpoints: this receiver's sources, densely numbered.
        std::vector<Current>& cur = cur_[p];
        runs.clear();
        for (const Job& j : jobs_[p]) {
          if (index_of[j.source] < 0) {
            index_of[j.source] = static_cast<int32_t>(cur.size());
            cur.push_back(Current{.source = j.source});
          }
          const auto b = static_cast<uint64_t>(j.bytes);
          runs.push_back(ucx::ChunkRun{static_cast<uint32_t>(index_of[j.source]), b});
          // The smallest chunk any job is cut into.
          smallest[k] = std::min(smallest[k], b % limits.chunk_bytes != 0 ? b % limits.chunk_bytes : limits.chunk_bytes);
        }
        for (const Current& c : cur) index_of[c.source] = -1;
        const auto n = static_cast<uint32_t>(cur.size());
        auto sched = ucx::ChunkScheduler::create(limits, runs, n, ucx::first_endpoint(static_cast<uint64_t>(p), n));
        if (!sched) {
          failed[k] = sched.status().with_context("receiver " + std::to_string(p));
          return;
        }
        scheds_[p] = std::move(*sched);
      }
    });
    for (const Status& f : failed) REFIT_RETURN_IF_ERROR(f);  // the lowest receiver's
    // Nine tenths of what separates a post from its landing at least: the
    // tenth left is far more than the rounding of the sums that compute
    // either, and the fewer the windows, the less the workers wait for each
    // other (DeepSeek-V3 at 1024 ranks a side: 213,596 windows at one half,
    // 120,190 at nine tenths).
    const double window = 0.9 * (hw_.latency_us * 1e-6 +
                                 static_cast<double>(*std::min_element(smallest.begin(), smallest.end())) /
                                     hw_.nic_bytes_per_s());
    landed_jobs_.assign(R, 0);
    landed_at_.assign(R, 0.0);
    next_step_.assign(R, 0);
    thread_from_.assign(R, 0.0);
    post_seq_.assign(R, 0);
    workers_.clear();
    workers_.resize(static_cast<size_t>(threads));
    for (int32_t k = 0; k < threads; ++k) {
      Worker& w = workers_[k];
      w.lo = static_cast<int32_t>(static_cast<int64_t>(R) * k / threads);
      w.hi = static_cast<int32_t>(static_cast<int64_t>(R) * (k + 1) / threads);
      w.src_lo = static_cast<int32_t>(static_cast<int64_t>(S) * k / threads);
      w.src_hi = static_cast<int32_t>(static_cast<int64_t>(S) * (k + 1) / threads);
      w.events.reset(window, R);
    }
    barrier_.reset(threads);
    parallel(threads, [&](int32_t k) { network_worker(k); }, [&] { barrier_.break_all(); });
    bool order_kept = true, window_kept = true;
    for (const Worker& w : workers_) {
      order_kept &= w.order_kept;
      window_kept &= w.window_kept;
      r_.events += w.events_count;
      r_.phases.network.end = std::max(r_.phases.network.end, w.network_end);
      r_.phases.h2d.end = std::max(r_.phases.h2d.end, w.h2d_end);
      r_.phases.convert.end = std::max(r_.phases.convert.end, w.convert_end);
      for (auto [first, mine] : {std::pair{&first_get_, w.first_get}, std::pair{&h2d_first_, w.h2d_first},
                                 std::pair{&convert_first_, w.convert_first}})
        if (mine >= 0 && (*first < 0 || mine < *first)) *first = mine;
    }
    std::vector<Worker>().swap(workers_);
    if (!order_kept)
      return Status::internal(
          "simulator: an event came before the last of its receiver's, or more than 2^62 windows from the start");
    if (!window_kept) return Status::internal("simulator: a GET landed within the window it was posted in");
    return Status::ok();
  }

  // Worker `k`'s part of every window (simulate_network); every worker runs
  // it, in step with the others: two barriers a window. The next window is
  // the first after this one that holds an event of any worker or that a
  // post of this window can land in (its source has sent it, plus the
  // latency): all known at the second barrier, kept per window's parity
  // so that a worker on to the next window overwrites nothing another
  // still reads.
  void network_worker(int32_t k) {
    constexpr uint64_t kNone = WindowQueue::kNoWindow;
    Worker& w = workers_[k];
    for (int32_t p = w.lo; p < w.hi; ++p) {
      run_steps(w, p);
      pump(w, p, 0.0);
    }
    w.front[1] = w.events.next_window();
    w.sent_window[1] = kNone;
    if (!barrier_.wait()) return;
    // The order of the window's events across receivers shows only where
    // its landed chunks touch what others' do: the fan-out without rounds,
    // simulated by one worker. There they go by time, then receiver, as
    // one queue of all events would give them. (A trace's spans are
    // merged per lane and rank, each in its own order: the same spans in
    // any order across receivers; the file lists them in the order the
    // simulation came to them.)
    const bool ordered = !hw_.fanout_rounds;
    auto by_time = [](const Event& a, const Event& b) { return a.t != b.t ? a.t < b.t : a.receiver < b.receiver; };
    for (int parity = 0;; parity ^= 1) {
      uint64_t window = kNone;
      for (const Worker& u : workers_) window = std::min({window, u.front[parity ^ 1], u.sent_window[parity ^ 1]});
      if (window == kNone) return;
      // Every chunk that lands in the window is in its bucket now (each
      // lands after the window it was posted in). They are simulated with
      // the memory of the ones a few places on loading meanwhile
      // (land_all); what they post in the window comes into the bucket
      // anew, taken after them.
      w.events.take(window, w.taken);
      w.landing.clear();
      for (const Event& e : w.taken) (e.landed ? w.landing : w.posts).push_back(e);
      if (ordered) std::stable_sort(w.landing.begin(), w.landing.end(), by_time);
      land_all(w);
      w.events.take(window, w.taken);
      for (const Event& e : w.taken) {
        w.window_kept &= !e.landed;  // a landing pushed in its own window
        w.posts.push_back(e);
      }
      w.front[parity] = w.events.next_window();
      w.sent.resize(w.posts.size());
      if (!barrier_.wait()) return;
      // Its sources serve the window's posted chunks, of every worker.
      w.serving.clear();
      for (uint32_t u = 0; u < workers_.size(); ++u) {
        const std::vector<Event>& posts = workers_[u].posts;
        for (uint32_t i = 0; i < posts.size(); ++i)
          if (posts[i].source >= w.src_lo && posts[i].source < w.src_hi) w.serving.push_back(Serving{u, i});
      }
      std::sort(w.serving.begin(), w.serving.end(), [&](const Serving& a, const Serving& b) {
        const Event& x = workers_[a.worker].posts[a.index];
        const Event& y = workers_[b.worker].posts[b.index];
        if (x.source != y.source) return x.source < y.source;
        if (x.t != y.t) return x.t < y.t;
        if (x.decided != y.decided) return x.decided < y.decided;
        if (x.turn != y.turn) return x.turn < y.turn;
        if (x.receiver != y.receiver) return x.receiver < y.receiver;
        return x.seq < y.seq;
      });
      double sent_min = std::numeric_limits<double>::infinity();
      for (const Serving& v : w.serving) {
        const double sent = serve(workers_[v.worker].posts[v.index]);
        workers_[v.worker].sent[v.index] = sent;
        sent_min = std::min(sent_min, sent);
      }
      w.sent_window[parity] = w.serving.empty() ? kNone : w.events.window_of(sent_min + hw_.latency_us * 1e-6);
      if (!barrier_.wait()) return;
      for (size_t i = 0; i < w.posts.size(); ++i) take_in(w, w.posts[i], w.sent[i], window);
      w.posts.clear();
    }
  }

  // Simulates the window's landed chunks (w.landing) in order. Each
  // touches its receiver's scheduler, jobs and queues, which no cache holds
  // from one of the receiver's chunks to the next (thousands of receivers
  // land chunks in between): so the memory of the chunk kLoad places on
  // starts to load (the scheduler's roots and the landed endpoint's state),
  // that of the one kNext places on, whose roots are loaded by then, the
  // state next() will most likely read (and the receiver's current job for
  // those endpoints), and that of the one kHead places on, whose endpoints
  // are loaded by then, the jobs of their next chunks.
  void land_all(Worker& w) {
    constexpr size_t kLoad = 8, kNext = 4, kHead = 2;
    std::array<uint32_t, 2> firsts[kNext + 1];  // per place from kNext on: prefetch_next's endpoints
    const size_t n = w.landing.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kLoad < n) {
        const Event& a = w.landing[i + kLoad];
        scheds_[a.receiver].prefetch_complete(a.chunk);
        __builtin_prefetch(&jobs_[a.receiver][a.chunk.run]);
      }
      if (i + kNext < n) {
        const int32_t p = w.landing[i + kNext].receiver;
        std::array<uint32_t, 2>& f = firsts[(i + kNext) % (kNext + 1)];
        f = scheds_[p].prefetch_next();
        for (uint32_t e : f)
          if (e != UINT32_MAX) __builtin_prefetch(&cur_[p][e]);
      }
      if (i + kHead < n && i + kHead >= kNext) {
        const int32_t p = w.landing[i + kHead].receiver;
        for (uint32_t e : firsts[(i + kHead) % (kNext + 1)]) {
          if (e == UINT32_MAX) continue;
          const ucx::Chunk& head = scheds_[p].head(e);
          if (head.bytes > 0) __builtin_prefetch(&jobs_[p][head.run]);
        }
      }
      const Event& e = w.landing[i];
      landed(w, e);
      pump(w, e.receiver, e.t);
    }
  }

  // Posts every GET chunk that the receiver's window lets go at `now`: the
  // receiver spends its GETs' cost posting them, one chunk after another.
  void pump(Worker& w, int32_t p, double now) {
    const double op = hw_.get_op_us * 1e-6;
    const uint32_t turn = tie_turn(p, post_seq_[p], jobs_.size());
    while (auto c = scheds_[p].next()) {
      Current& job = cur_[p][c->endpoint];
      if (job.run != c->run) {
        const Job& j = jobs_[p][c->run];
        job = Current{c->run, job.source, j.bytes, j.gets};
      }
      // The job's GETs, shared out over its chunks by their bytes.
      const __int128 g = job.gets;
      const int64_t gets = static_cast<int64_t>(g * (c->offset + c->bytes) / job.bytes - g * c->offset / job.bytes);
      Resource& post = post_[p];
      const double start = std::max(now, post.free_at);
      const double d = static_cast<double>(gets) * op;
      post.free_at = start + d;
      post.busy += d;
      post.bytes += gets;  // GETs, for this resource
      if (d > 0) span(Lane::kPosting, p, start, start + d, static_cast<int64_t>(c->bytes));
      if (w.first_get < 0 || start < w.first_get) w.first_get = start;
      w.order_kept &= w.events.push(Event{post.free_at, now, post_seq_[p]++, p, job.source, false, turn, *c});
      ++w.events_count;
    }
  }

  // A posted GET chunk's source NIC serves it: posted GETs in the order they
  // were posted. A source is not held back by a busy receiver (the switch
  // buffers), so a source idles only when no GET is posted to it. Returns
  // when the chunk has left the source.
  double serve(const Event& e) {
    const double wire = static_cast<double>(e.chunk.bytes) / hw_.nic_bytes_per_s();
    const auto bytes = static_cast<int64_t>(e.chunk.bytes);
    Resource& src = src_nic_[e.source];
    const double sent_from = std::max(e.t, src.free_at);
    src.free_at = sent_from + wire;
    src.busy += wire;
    src.bytes += bytes;
    span(Lane::kSourceNic, e.source, sent_from, src.free_at, bytes);
    return src.free_at;
  }

  // The receiver's NIC takes in what arrives at its own rate, one chunk
  // after another (in the order it posted them); the chunk lands a latency
  // later, in a window after the one it was posted in (`window`).
  void take_in(Worker& w, const Event& e, double sent_until, uint64_t window) {
    const int32_t p = e.receiver;
    const double wire = static_cast<double>(e.chunk.bytes) / hw_.nic_bytes_per_s();
    const auto bytes = static_cast<int64_t>(e.chunk.bytes);
    Resource& dst = rcv_nic_[p];
    const double in_until = std::max(sent_until, dst.free_at + wire);
    dst.free_at = in_until;
    dst.busy += wire;
    dst.bytes += bytes;
    span(Lane::kReceiverNic, p, in_until - wire, in_until, bytes);
    const double at = in_until + hw_.latency_us * 1e-6;
    w.window_kept &= w.events.window_of(at) > window;
    w.order_kept &= w.events.push(Event{at, e.decided, e.seq, p, e.source, true, e.turn, e.chunk});
  }

  // A GET chunk landed: copy it to the GPU where GETs land in host memory;
  // once its job has landed, the job's sends go.
  void landed(Worker& w, const Event& e) {
    const int32_t p = e.receiver;
    w.network_end = std::max(w.network_end, e.t);
    double ready = e.t;
    // The conversion staging area is host memory: what lands there is not
    // copied on by the landing ring (a job that also landed elsewhere is).
    if (hw_.gets_land_in_host && !jobs_[p][e.chunk.run].staged) {
      const double start = std::max(e.t, h2d_[p].free_at);
      ready = start + static_cast<double>(e.chunk.bytes) / hw_.h2d_bytes_per_s();
      hold(w, h2d_[p], Lane::kH2d, p, start, ready, static_cast<int64_t>(e.chunk.bytes));
    }
    // A receiver's chunks land in the order it posted them (its landed
    // events, in the order they were pushed), and one job's copies to the
    // GPU follow one another: the job is ready when its last chunk is.
    // Only then are its sends read (and, where GETs land in host memory,
    // whether it was staged, for every chunk).
    if (!scheds_[p].complete(e.chunk)) return;
    Job& job = jobs_[p][e.chunk.run];
    job.ready = ready;
    send(p, job.sends_begin, job.sends_count, ready);
    if (steps_[p].empty()) return;
    job.landed = true;
    int32_t& n = landed_jobs_[p];
    for (; n < static_cast<int32_t>(jobs_[p].size()) && jobs_[p][n].landed; ++n)
      landed_at_[p] = std::max(landed_at_[p], jobs_[p][n].ready);
    run_steps(w, p);
  }

  // Runs puller `p`'s conversion steps, in order, while the jobs each waits
  // for have landed.
  void run_steps(Worker& w, int32_t p) {
    size_t& k = next_step_[p];
    for (; k < steps_[p].size() && converts_[steps_[p][k]].wait_job < landed_jobs_[p]; ++k)
      run_convert(w, steps_[p][k], landed_at_[p]);
  }

  // Conversion step `k` runs on its puller's fan-out thread, which passes
  // no send meanwhile (sends passed before it go on: the fabric moves
  // them); into GPU memory an F8_E4M3 quantization copies the
  // staged box to the GPU and runs the CUDA kernel; a cast runs the CPU
  // kernel and copies its output over; into host memory (convert_on_host)
  // the CPU kernel alone. A relayout is a copy, no kernel: on the host at
  // the one-thread CPU rate (host_convert_gbyte, the rate a cast reads at);
  // into GPU memory the staged box to the GPU, then a device copy
  // (gpu_copy_bytes_per_s). Then its sends go.
  void run_convert(Worker& w, int32_t k, double ready) {
    const Convert& c = converts_[k];
    const int32_t p = c.puller;
    Resource& thread = conv_[p];
    Resource& h2d = h2d_[p];
    const double start = std::max(ready, thread.free_at);
    thread_from_[p] = start;
    const auto staged = static_cast<double>(c.staged_bytes);
    double end = start;
    if (hw_.convert_on_host) {
      end = start + staged / hw_.host_convert_bytes_per_s();
    } else if (c.relayout) {
      const double copied = std::max(start, h2d.free_at) + staged / hw_.h2d_bytes_per_s();
      hold(w, h2d, Lane::kH2d, p, copied - staged / hw_.h2d_bytes_per_s(), copied, c.staged_bytes);
      end = copied + staged / hw_.gpu_copy_bytes_per_s();
    } else if (!c.cast) {
      const double copied = std::max(start, h2d.free_at) + staged / hw_.h2d_bytes_per_s();
      hold(w, h2d, Lane::kH2d, p, copied - staged / hw_.h2d_bytes_per_s(), copied, c.staged_bytes);
      end = copied + staged / hw_.convert_bytes_per_s();
    } else {
      const double cast = start + staged / hw_.host_convert_bytes_per_s();
      const double copied = std::max(cast, h2d.free_at) + static_cast<double>(c.out_bytes) / hw_.h2d_bytes_per_s();
      hold(w, h2d, Lane::kH2d, p, copied - static_cast<double>(c.out_bytes) / hw_.h2d_bytes_per_s(), copied, c.out_bytes);
      end = copied;
    }
    thread.free_at = end;
    thread.busy += end - start;
    thread.bytes += c.staged_bytes;
    span(Lane::kConvert, p, start, end, c.staged_bytes);
    if (w.convert_first < 0 || start < w.convert_first) w.convert_first = start;
    w.convert_end = std::max(w.convert_end, end);
    send(p, c.sends_begin, c.sends_count, end);
  }

  // Resource `r`, a host-to-GPU copy, busy from `start` to `end`.
  void hold(Worker& w, Resource& r, Lane lane, int32_t rank, double start, double end, int64_t bytes) {
    r.free_at = end;
    r.busy += end - start;
    r.bytes += bytes;
    span(lane, rank, start, end, bytes);
    if (w.h2d_first < 0 || start < w.h2d_first) w.h2d_first = start;
    w.h2d_end = std::max(w.h2d_end, end);
  }

  // Puller `p`'s sends [begin, begin + count), their bytes ready at `ready`.
  // Packed (simulator.h): a small send joins the last pack to its peer if
  // that has not started by `ready`; the pack's extra time goes at the end
  // of both links' timelines (their busy time is exact, the order of what
  // follows on them is approximate).
  void send(int32_t p, uint32_t begin, uint32_t count, double ready) {
    if (ready >= thread_from_[p] && ready < conv_[p].free_at) ready = conv_[p].free_at;  // passed after it
    if (hw_.fanout_rounds) {  // passed on in rounds, once the network is simulated
      for (uint32_t k = 0; k < count; ++k) send_ready_[send_base_[p] + begin + k] = static_cast<float>(ready);
      return;
    }
    const double nvl = hw_.nvlink_bytes_per_s();
    const double op = hw_.local_op_us * 1e-6;
    const fabric::PackLimits limits{static_cast<uint64_t>(hw_.fanout_pack_bytes),
                                    static_cast<uint64_t>(hw_.fanout_pack_threshold)};
    const uint64_t share = fabric::pack_share(limits, static_cast<size_t>(domain_size_[p]));
    for (uint32_t k = 0; k < count; ++k) {
      const Send& s = sends_[p][begin + k];
      Resource& out = nvl_out_[p];
      Resource& in = nvl_in_[s.to];
      const auto b = static_cast<uint64_t>(s.bytes);
      const bool small = share > 0 && b < limits.pack_threshold && b <= share;
      // Gathered into the pack at the puller, scattered out of it at the peer.
      const double copies = small ? 2.0 * static_cast<double>(b) / hw_.gpu_copy_bytes_per_s() : 0;
      Pack* pk = small ? &packs_[(static_cast<uint64_t>(p) << 32) | static_cast<uint32_t>(s.to)] : nullptr;
      const uint64_t at = pk ? (pk->bytes + fabric::kPackAlign - 1) / fabric::kPackAlign * fabric::kPackAlign : 0;
      double start = std::max({ready, out.free_at, in.free_at});
      double d = op + static_cast<double>(s.bytes) / nvl + copies;
      if (pk && pk->start >= ready && at + b <= share && pk->count < fabric::kDefaultMaxSendsPerRound) {
        d -= op;
        start = std::max(out.free_at, in.free_at);
        pk->bytes = at + b;
        ++pk->count;
        ++r_.local_packed;
      } else {
        if (pk) *pk = Pack{start, b, 1};
        ++r_.local_ops;
      }
      out.free_at = in.free_at = start + d;
      out.busy += d;
      in.busy += d;
      out.bytes += s.bytes;
      in.bytes += s.bytes;
      span(Lane::kNvlinkOut, p, start, start + d, s.bytes);
      span(Lane::kNvlinkIn, s.to, start, start + d, s.bytes);
      if (fan_first_ < 0 || start < fan_first_) fan_first_ = start;
      r_.phases.fanout.end = std::max(r_.phases.fanout.end, start + d);
    }
  }

  // The network's state is not needed past it: its schedulers go, and what
  // the heap holds free is given back to the system, so that the rounds'
  // arrays (two of 4 bytes a send: ready times and plan positions) do not
  // come on top of it (DeepSeek-V3 at 4096 ranks has 163 million sends).
  void release_network() {
    std::vector<ucx::ChunkScheduler>().swap(scheds_);
    std::vector<std::vector<Current>>().swap(cur_);
    std::vector<uint64_t>().swap(post_seq_);
    give_back_free_memory();
  }

  static void give_back_free_memory() {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
  }

  // The fan-out in rounds (docs/simulator.md, "The fan-out in rounds"),
  // once the network is simulated: nothing on the network waits for the
  // fan-out, so every send's ready time is known by then. Ranks that pass
  // slices to each other, directly or through others, go in lockstep, as
  // the nccl fabric's count exchange with every active peer makes them.
  void simulate_rounds(int32_t R, int32_t threads) {
    // Each puller's sends by (peer, order): one range of positions per
    // (puller, peer), at the puller's place in the sends' numbering
    // (send_base_). Its sends, their ready times and their plan positions
    // are put in that order, so that the rounds read each one after the
    // other.
    plan_pos_.assign(send_base_[R], 0);
    // Pullers in blocks, one a thread; each block's pairs in puller order.
    std::vector<std::vector<Pair>> block_pairs(static_cast<size_t>(threads));
    parallel(threads, [&](int32_t k) {
      const auto lo = static_cast<int32_t>(static_cast<int64_t>(R) * k / threads);
      const auto hi = static_cast<int32_t>(static_cast<int64_t>(R) * (k + 1) / threads);
      order_sends(lo, hi, block_pairs[k]);
    });
    std::vector<Pair> pairs;
    for (std::vector<Pair>& b : block_pairs) {
      for (const Pair& x : b) r_.local_pairs += static_cast<int64_t>(1 + x.alike.size());
      r_.local_pair_sequences += static_cast<int64_t>(b.size());
      pairs.insert(pairs.end(), b.begin(), b.end());
      std::vector<Pair>().swap(b);
    }
    give_back_free_memory();
    std::vector<int32_t> parent(R);
    for (int32_t p = 0; p < R; ++p) parent[p] = p;
    auto root = [&](int32_t x) {
      while (parent[x] != x) x = parent[x] = parent[parent[x]];
      return x;
    };
    for (const Pair& x : pairs) {
      parent[root(x.from)] = root(x.to);
      for (const int32_t q : x.alike) parent[root(x.from)] = root(q);
    }
    std::vector<std::vector<uint32_t>> members(R);  // per component's root: its pairs
    for (size_t i = 0; i < pairs.size(); ++i) members[root(pairs[i].from)].push_back(static_cast<uint32_t>(i));
    std::vector<const std::vector<uint32_t>*> comps;
    for (const std::vector<uint32_t>& comp : members)
      if (!comp.empty()) comps.push_back(&comp);
    // Components share no rank: they go in parallel, each whole on one
    // thread, taken in turn from a shared count.
    acc_.assign(R, RankRound{});
    std::vector<RoundStats> stats(static_cast<size_t>(threads));
    std::atomic<size_t> next{0};
    parallel(std::min<int32_t>(threads, static_cast<int32_t>(comps.size())), [&](int32_t k) {
      for (size_t c; (c = next.fetch_add(1)) < comps.size();) run_rounds(*comps[c], pairs, stats[k]);
    });
    for (const RoundStats& st : stats) {
      r_.local_ops += st.ops;
      r_.local_packed += st.packed;
      r_.local_rounds += st.rounds;
      r_.phases.fanout.end = std::max(r_.phases.fanout.end, st.end);
      if (st.first >= 0 && (fan_first_ < 0 || st.first < fan_first_)) fan_first_ = st.first;
    }
  }

  // Pullers [lo, hi)'s sends put in the order of the rounds
  // (simulate_rounds), with their ready times and plan positions, and
  // their pairs. A peer sent the same sequence as an earlier peer (Pair)
  // joins that one's pair, and its sends are not kept: each puller's sends
  // are the first `kept` of its store from here on.
  void order_sends(int32_t lo, int32_t hi, std::vector<Pair>& pairs) {
    std::vector<uint32_t> at(jobs_.size(), 0);  // per peer: its count, then where its next send goes
    std::vector<int32_t> peers;
    std::vector<uint64_t> keys, spare;
    // A puller's sends by peer; the kept ones by position; per send, its
    // plan position.
    std::vector<uint32_t> order, kept, plan_of;
    std::vector<float> ready;
    std::vector<Send> copy;
    // The pairs of this puller so far: a hash of each one's sequence, and
    // where the sequence lies in `order` (to compare a later one with).
    struct Seq {
      uint64_t hash;
      uint32_t begin, size;
      size_t pair;
    };
    std::vector<Seq> seqs;
    for (int32_t p = lo; p < hi; ++p) {
      std::vector<Job>().swap(jobs_[p]);  // not read again
      if ((p - lo) % 256 == 255) give_back_free_memory();
      // Its sends are in plan order (the jobs' and the steps' interleave
      // there); grouped by peer, in that order.
      SendStore& mine = sends_[p];
      const uint32_t base = send_base_[p];
      const uint32_t n = mine.size();
      const float* rd = send_ready_.data() + base;
      peers.clear();
      for (uint32_t k = 0; k < n; ++k)
        if (at[mine[k].to]++ == 0) peers.push_back(mine[k].to);
      std::sort(peers.begin(), peers.end());
      uint32_t pos = 0;
      for (int32_t q : peers) pos += std::exchange(at[q], pos);
      order.resize(n);
      plan_of.resize(n);
      kept.clear();
      seqs.clear();
      for (uint32_t k = 0; k < n; ++k) order[at[mine[k].to]++] = k;
      for (int32_t q : peers) at[q] = 0;
      auto same = [&](uint32_t a, uint32_t b) {
        const Send& x = mine[order[a]];
        const Send& y = mine[order[b]];
        return x.runs == y.runs && x.bytes == y.bytes &&
               std::bit_cast<uint32_t>(rd[order[a]]) == std::bit_cast<uint32_t>(rd[order[b]]);
      };
      for (uint32_t i = 0; i < n;) {
        const int32_t q = mine[order[i]].to;
        uint32_t e = i;
        uint64_t hash = 0;
        for (; e < n && mine[order[e]].to == q; ++e) {
          const Send& x = mine[order[e]];
          hash = (hash ^ (static_cast<uint64_t>(x.runs) << 32 | std::bit_cast<uint32_t>(rd[order[e]]))) *
                     0x9e3779b97f4a7c15ULL +
                 static_cast<uint64_t>(x.bytes);
        }
        const uint32_t size = e - i;
        const Seq* match = nullptr;
        for (const Seq& o : seqs) {
          if (o.hash != hash || o.size != size) continue;
          uint32_t k = 0;
          while (k < size && same(o.begin + k, i + k)) ++k;
          if (k == size) {
            match = &o;
            break;
          }
        }
        if (match) {
          pairs[match->pair].alike.push_back(q);
          i = e;
          continue;
        }
        uint32_t runs = 0;  // the pair's plan-order positions, in runs
        for (uint32_t k = i; k < e; ++k) {
          plan_of[order[k]] = runs;
          runs += mine[order[k]].runs;
        }
        // The fabric passes them on in the order they became ready, ties
        // in the order above: sorted by (ready, place), the ready time's
        // bits above the place (a float at or above 0 orders as its bits),
        // so that sorting reads no send.
        keys.clear();
        for (uint32_t k = i; k < e; ++k)
          keys.push_back(static_cast<uint64_t>(std::bit_cast<uint32_t>(rd[order[k]])) << 32 | (k - i));
        sort_by_ready(keys, spare);
        const auto from = static_cast<uint32_t>(kept.size());
        for (const uint64_t key : keys) kept.push_back(order[i + static_cast<uint32_t>(key)]);
        if (opt_.fold_alike_peers) seqs.push_back(Seq{hash, i, size, pairs.size()});
        pairs.push_back(Pair{p, q, uint64_t{base} + from, uint64_t{base} + kept.size(), 0, {}});
        i = e;
      }
      // The kept sends, their ready times and plan positions, by position.
      const auto m = static_cast<uint32_t>(kept.size());
      copy.resize(m);
      ready.resize(m);
      for (uint32_t i = 0; i < m; ++i) {
        copy[i] = mine[kept[i]];
        ready[i] = rd[kept[i]];
        plan_pos_[base + i] = plan_of[kept[i]];
      }
      for (uint32_t i = 0; i < m; ++i) {
        mine[i] = copy[i];
        send_ready_[base + i] = ready[i];
      }
    }
  }

  // What a thread's components of rounds added up (simulate_rounds).
  struct RoundStats {
    int64_t ops = 0, packed = 0, rounds = 0;
    double first = -1, end = 0;
  };

  // One component's rounds. A round starts when the last one ended (or,
  // when nothing is ready, at the next ready send) and takes, per pair,
  // the prefix of its sends ready by then (take_round); it lasts two
  // local_op_us (the count exchange, the group's launch) and its busiest
  // rank's time (round_seconds).
  void run_rounds(const std::vector<uint32_t>& comp, std::vector<Pair>& pairs, RoundStats& st) {
    using Head = std::pair<float, uint32_t>;  // the pair's next send's ready time, the pair
    std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heads;
    auto head = [&](uint32_t i) { return Head{send_ready_[pairs[i].pos], i}; };
    for (uint32_t i : comp) heads.push(head(i));
    const double op = hw_.local_op_us * 1e-6;
    std::vector<uint32_t> taken;
    std::vector<int32_t> touched;
    double t = 0;
    while (!heads.empty()) {
      t = std::max(t, static_cast<double>(heads.top().first));
      if (st.first < 0 || t < st.first) st.first = t;
      taken.clear();
      touched.clear();
      while (!heads.empty() && static_cast<double>(heads.top().first) <= t) {
        const uint32_t i = heads.top().second;
        heads.pop();
        take_round(pairs[i], t, touched, st);
        taken.push_back(i);
      }
      double worst = 0;
      for (int32_t r : touched) worst = std::max(worst, round_seconds(r, t + 2 * op));
      for (int32_t r : touched) acc_[r] = RankRound{};
      t += 2 * op + worst;
      ++st.rounds;
      st.end = std::max(st.end, t);
      for (uint32_t i : taken)
        if (pairs[i].pos < pairs[i].end) heads.push(head(i));
    }
  }

  // What pair `x` passes on in the round at `t`: the prefix of its sends
  // ready by `t`, at most kDefaultMaxSendsPerRound runs; with packing, a run
  // below the threshold and within the peer's share goes in the pair's pack
  // (at the next 16-byte offset), and the round stops before the first
  // packed run that would pass the share (fabric::plan_pack's rule).
  void take_round(Pair& x, double t, std::vector<int32_t>& touched, RoundStats& st) {
    const uint64_t threshold = static_cast<uint64_t>(hw_.fanout_pack_threshold);
    const fabric::PackLimits limits{static_cast<uint64_t>(hw_.fanout_pack_bytes), threshold};
    const uint64_t share = fabric::pack_share(limits, static_cast<size_t>(domain_size_[x.from]));
    uint64_t cap = fabric::kDefaultMaxSendsPerRound;
    uint64_t at = 0;  // the pack's end so far
    int64_t bytes = 0, packed_bytes = 0, unpacked = 0, packed = 0;
    uint64_t ranges = 0, next = UINT64_MAX;  // ranges of consecutive positions, the next position of the last
    bool full = false;
    while (!full && cap > 0 && x.pos < x.end && static_cast<double>(send_ready_[x.pos]) <= t) {
      const Send& s = sends_[x.from][static_cast<uint32_t>(x.pos - send_base_[x.from])];
      const uint64_t left = s.runs - x.runs_done;
      const auto piece = static_cast<uint64_t>(s.bytes) / s.runs;  // the runs of one send: their mean
      const bool small = share > 0 && piece < threshold && piece <= share;
      const uint64_t position = static_cast<uint64_t>(plan_pos_[x.pos]) + x.runs_done;
      if (position != next) {
        if (ranges == fabric::kMaxRanges) break;
        ++ranges;
      }
      uint64_t n = std::min(left, cap);
      if (small) {
        const uint64_t from = packed > 0 ? (at + fabric::kPackAlign - 1) / fabric::kPackAlign * fabric::kPackAlign : 0;
        const uint64_t step = (piece + fabric::kPackAlign - 1) / fabric::kPackAlign * fabric::kPackAlign;
        const uint64_t fit = from + piece <= share ? 1 + (share - from - piece) / step : 0;
        if (fit < n) {
          n = fit;
          full = true;
        }
        if (n > 0) at = from + (n - 1) * step + piece;
      }
      // The bytes of runs [runs_done, runs_done + n) of the send.
      const auto part = [&](uint64_t k) {
        return static_cast<int64_t>(static_cast<__int128>(s.bytes) * static_cast<__int128>(k) / s.runs);
      };
      // A whole send (the most common) needs no division.
      const int64_t b = x.runs_done == 0 && n == s.runs ? s.bytes : part(x.runs_done + n) - part(x.runs_done);
      bytes += b;
      if (small) {
        packed_bytes += b;
        packed += static_cast<int64_t>(n);
      } else {
        unpacked += static_cast<int64_t>(n);
      }
      cap -= n;
      next = position + n;
      x.runs_done += static_cast<uint32_t>(n);
      if (x.runs_done == s.runs) {
        ++x.pos;
        x.runs_done = 0;
      }
    }
    const int64_t ops = unpacked + (packed > 0 ? 1 : 0);
    // As many times as the pair has peers.
    const auto peers = static_cast<int64_t>(1 + x.alike.size());
    st.ops += ops * peers;
    st.packed += (packed > 0 ? packed - 1 : 0) * peers;
    auto touch = [&](int32_t r) -> RankRound& {
      RankRound& a = acc_[r];
      if (!a.touched) touched.push_back(r);
      a.touched = true;
      return a;
    };
    RankRound& out = touch(x.from);
    out.out_bytes += bytes * peers;
    out.out_ops += ops * peers;
    out.gather_bytes += packed_bytes * peers;
    auto in = [&](int32_t q) {
      RankRound& a = touch(q);
      a.in_bytes += bytes;
      a.in_ops += ops;
      a.scatter_bytes += packed_bytes;
    };
    in(x.to);
    for (const int32_t q : x.alike) in(q);
  }

  // Rank `r`'s time in a round whose data starts at `start`: the gather of
  // its packs, its bytes out or in over NVLink with local_send_us per
  // operation (whichever direction is longer: the link is full duplex),
  // the scatter of the packs it received.
  double round_seconds(int32_t r, double start) {
    const RankRound& a = acc_[r];
    const double nvl = hw_.nvlink_bytes_per_s();
    const double send = hw_.local_send_us * 1e-6;
    const double gather = static_cast<double>(a.gather_bytes) / hw_.gpu_copy_bytes_per_s();
    const double scatter = static_cast<double>(a.scatter_bytes) / hw_.gpu_copy_bytes_per_s();
    const double out = static_cast<double>(a.out_bytes) / nvl + static_cast<double>(a.out_ops) * send;
    const double in = static_cast<double>(a.in_bytes) / nvl + static_cast<double>(a.in_ops) * send;
    if (a.out_bytes > 0 || a.out_ops > 0) {
      Resource& o = nvl_out_[r];
      o.busy += gather + out;
      o.bytes += a.out_bytes;
      o.free_at = start + gather + out;
      span(Lane::kNvlinkOut, r, start, o.free_at, a.out_bytes);
    }
    if (a.in_bytes > 0 || a.in_ops > 0) {
      Resource& i = nvl_in_[r];
      i.busy += in + scatter;
      i.bytes += a.in_bytes;
      i.free_at = start + gather + std::max(out, in) + scatter;
      span(Lane::kNvlinkIn, r, i.free_at - in - scatter, i.free_at, a.in_bytes);
    }
    return gather + std::max(out, in) + scatter;
  }

  void span(Lane lane, int32_t rank, double start, double end, int64_t bytes) {
    if (!opt_.trace) return;
    int64_t& last = last_span_[static_cast<size_t>(lane)][rank];
    if (last >= 0) {
      TraceSpan& t = r_.trace[last];
      if (start <= t.end + opt_.trace_merge_seconds) {
        t.end = std::max(t.end, end);
        t.bytes += bytes;
        return;
      }
    }
    last = static_cast<int64_t>(r_.trace.size());
    r_.trace.push_back(TraceSpan{lane, rank, start, end, bytes});
  }

  void finish(int32_t R, int32_t S) {
    r_.model = "event";
    Phases& ph = r_.phases;
    if (first_get_ >= 0) ph.network.start = first_get_;
    if (h2d_first_ >= 0) ph.h2d.start = h2d_first_;
    if (fan_first_ >= 0) ph.fanout.start = fan_first_;
    if (convert_first_ >= 0) ph.convert.start = convert_first_;
    r_.predicted_seconds = std::max({ph.publish.end, ph.network.end, ph.h2d.end, ph.fanout.end, ph.convert.end});
    if (hw_.host_cores > 0) {
      const auto plain = static_cast<double>(r_.network_bytes - r_.gathered_bytes);
      double cpu = (plain * hw_.get_cpu_ns + static_cast<double>(r_.gathered_bytes) * hw_.gather_cpu_ns +
                    static_cast<double>(r_.local_bytes) * hw_.local_cpu_ns) * 1e-9 +
                   static_cast<double>(r_.gets) * hw_.get_op_us * 1e-6;
      if (hw_.convert_on_host) cpu += static_cast<double>(r_.convert_bytes) / hw_.host_convert_bytes_per_s();
      apply_host_bound(cpu, hw_, r_);
    }
    auto busiest = [](const std::vector<Resource>& v, int32_t n) {
      LinkLoad best;
      for (int32_t i = 0; i < n; ++i)
        if (best.rank < 0 || v[i].busy > best.busy_seconds) best = LinkLoad{i, v[i].bytes, v[i].busy};
      return best;
    };
    r_.busiest_source_nic = busiest(src_nic_, S);
    r_.busiest_receiver_nic = busiest(rcv_nic_, R);
    r_.busiest_posting = busiest(post_, R);
    r_.busiest_nvlink_out = busiest(nvl_out_, R);
    r_.busiest_nvlink_in = busiest(nvl_in_, R);
    r_.busiest_convert = busiest(conv_, R);
  }

  const int32_t cores_ = usable_cores();  // read once: every stage splits its work alike
  std::optional<Plan> owned_;  // the plan, where the caller gave it up
  const Plan* plan_;           // null once read, where owned
  const Layout& L_;
  const HardwareModel& hw_;
  const SimOptions& opt_;
  SimResult r_;
  std::vector<std::vector<Job>> jobs_;  // per receiver, in its execution order
  std::vector<SendStore> sends_;    // per puller, in plan order (with rounds, put in their order there)
  std::vector<uint32_t> send_base_; // per puller: the number of its first send (the pullers before it have as many)
  std::vector<float> send_ready_;   // with rounds: per send (by number, then by position), when its bytes are usable
  std::vector<RankRound> acc_;     // with rounds: per rank, the round being simulated
  std::vector<uint32_t> plan_pos_; // with rounds: per send (by position), its first run's position in its pair's plan order
  std::vector<Convert> converts_;
  std::vector<std::vector<int32_t>> steps_;  // per puller: its conversion steps, in order
  std::vector<int32_t> landed_jobs_;         // per puller: its first jobs, all landed
  std::vector<double> landed_at_;            // per puller: when they were all usable
  std::vector<size_t> next_step_;            // per puller: its next step to run
  std::vector<double> thread_from_;          // per puller: when its last conversion started
  std::vector<ucx::ChunkScheduler> scheds_;
  // Per receiver and endpoint: its source and the
  // job it is issuing, so that a job's later chunks are posted without
  // reading the job again (a receiver's jobs are tens of megabytes).
  struct Current {
    uint32_t run = UINT32_MAX;
    int32_t source = 0;
    int64_t bytes = 0;
    int64_t gets = 0;
  };
  std::vector<std::vector<Current>> cur_;
  std::vector<Resource> src_nic_, rcv_nic_, post_, h2d_, nvl_out_, nvl_in_, conv_;
  std::vector<int32_t> domain_size_;               // per receiver: the GPUs of its domain
  std::unordered_map<uint64_t, Pack> packs_;       // per (puller, peer): its last pack
  std::vector<std::vector<int64_t>> last_span_;  // per lane and rank: its last trace span
  std::vector<Worker> workers_;
  std::vector<uint64_t> post_seq_;  // per receiver: the chunks it has posted
  SpinBarrier barrier_;
  double first_get_ = -1, h2d_first_ = -1, fan_first_ = -1, convert_first_ = -1;
};

}  // namespace

const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::kPublish: return "publish copy (source)";
    case Lane::kSourceNic: return "NIC (source)";
    case Lane::kReceiverNic: return "NIC (receiver)";
    case Lane::kPosting: return "GET posting (receiver)";
    case Lane::kH2d: return "host to GPU (receiver)";
    case Lane::kNvlinkOut: return "NVLink out (receiver)";
    case Lane::kNvlinkIn: return "NVLink in (receiver)";
    case Lane::kConvert: return "conversion (receiver)";
  }
  return "?";
}

namespace {
// What both simulate() refuse, before either touches the plan.
Status simulable(const Plan& plan, const HardwareModel& hw) {
  if (plan.options().strategy == Strategy::kBroadcast)
    return Status::invalid("the broadcast baseline has no runs to simulate; use estimate_broadcast");
  return check_hardware(hw, "hardware model", "");
}
}  // namespace

// The fan-out's rounds sort 163 million such keys for DeepSeek-V3 at 4096
// ranks, thousands a pair: a stable radix sort of the upper 32 bits (a pass
// whose digit every key shares moves nothing and is skipped).
void sort_by_ready(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare) {
  const size_t n = keys.size();
  if (n < 256) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  constexpr int kBits = 11;
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  std::array<uint32_t, size_t{1} << kBits> at;
  spare.resize(n);
  for (int shift = 32; shift < 64; shift += kBits) {
    at.fill(0);
    for (const uint64_t k : keys) ++at[k >> shift & kMask];
    if (at[keys[0] >> shift & kMask] == n) continue;
    uint32_t sum = 0;
    for (uint32_t& c : at) sum += std::exchange(c, sum);
    for (const uint64_t k : keys) spare[at[k >> shift & kMask]++] = k;
    keys.swap(spare);
  }
}

Result<SimResult> simulate(const Plan& plan, const HardwareModel& hw, const SimOptions& options) {
  REFIT_RETURN_IF_ERROR(simulable(plan, hw));
  Sim sim(plan, hw, options);
  return sim.run();
}

Result<SimResult> simulate(Plan&& plan, const HardwareModel& hw, const SimOptions& options) {
  REFIT_RETURN_IF_ERROR(simulable(plan, hw));
  Sim sim(std::move(plan), hw, options);
  return sim.run();
}

SimResult estimate_broadcast(const Plan& plan, const HardwareModel& hw) {
  SimResult r;
  r.model = "fluid";
  const PlanSummary& s = plan.summary();
  const double nic = hw.nic_bytes_per_s();
  const int64_t sources = static_cast<int64_t>(plan.layout().sources.size());
  const double gather = sources > 0 ? static_cast<double>(s.gather_bytes) / (static_cast<double>(sources) * nic) : 0;
  auto busiest = [](const std::vector<int64_t>& v) {
    LinkLoad best;
    for (size_t i = 0; i < v.size(); ++i)
      if (best.rank < 0 || v[i] > best.bytes) best = LinkLoad{static_cast<int32_t>(i), v[i], 0};
    return best;
  };
  r.busiest_source_nic = busiest(plan.source_nic_bytes());
  r.busiest_receiver_nic = busiest(plan.receiver_nic_bytes());
  r.busiest_source_nic.busy_seconds = static_cast<double>(r.busiest_source_nic.bytes) / nic;
  const int64_t rcv_gets = ceil_div(r.busiest_receiver_nic.bytes, static_cast<int64_t>(hw.get_chunk_bytes));
  r.busiest_receiver_nic.busy_seconds =
      static_cast<double>(r.busiest_receiver_nic.bytes) / nic + static_cast<double>(rcv_gets) * hw.get_op_us * 1e-6;
  for (int64_t b : plan.receiver_nic_bytes()) r.gets += ceil_div(b, static_cast<int64_t>(hw.get_chunk_bytes));
  r.gets_per_receiver_max = rcv_gets;
  r.network_bytes = s.network_bytes + s.gather_bytes;
  r.phases.network = Span{0, gather + std::max(r.busiest_source_nic.busy_seconds, r.busiest_receiver_nic.busy_seconds) +
                                 hw.latency_us * 1e-6};
  r.predicted_seconds = r.phases.network.end;
  if (hw.host_cores > 0) {
    // Both stages' bytes as plain GETs (whole tensors), and every
    // receiver's copy out of its slices.
    const Layout& L = plan.layout();
    int64_t copied = 0;
    for (const Tensor& t : L.tensors) {
      for (const Region& reg : t.receivers)
        copied += reg.box.numel() * dtype_bytes(t.dtype) * static_cast<int64_t>(L.receiver_sets.get(reg.ranks).size());
    }
    const double cpu = (static_cast<double>(r.network_bytes) * hw.get_cpu_ns +
                        static_cast<double>(copied) * hw.local_cpu_ns) * 1e-9 +
                       static_cast<double>(r.gets) * hw.get_op_us * 1e-6;
    apply_host_bound(cpu, hw, r);
  }
  return r;
}

namespace {

// The bound's third term (docs/simulator.md, "The lower bound"): per
// receiving GPU, everything it needs comes in through its NIC or its
// NVLink, at least in the narrower of the two sides' dtypes (a converted
// tensor's fan-out carries the receivers'); block scales can be computed
// from what came in, so they are not counted.
void gpu_ingress(const Layout& L, double bytes_per_s, LowerBound& lb) {
  std::vector<int64_t> need(L.receivers.size(), 0);
  for (const Tensor& t : L.tensors) {
    if (t.derived_from >= 0) continue;
    const int eb = std::min(dtype_bytes(t.dtype), dtype_bytes(t.dtype_on(Side::kReceiver)));
    for (const Region& reg : t.receivers) {
      const int64_t b = reg.box.numel() * eb;
      for (int32_t r : L.receiver_sets.get(reg.ranks)) need[r] += b;
    }
  }
  for (size_t g = 0; g < need.size(); ++g) {
    const double t = static_cast<double>(need[g]) / bytes_per_s;
    if (t > lb.gpu_ingress_seconds) {
      lb.gpu_ingress_seconds = t;
      lb.gpu = static_cast<int32_t>(g);
    }
  }
}

}  // namespace

namespace {

// The groups of sources that alone hold some bytes: for each set of
// holders' ranks X, the bytes whose holders all lie in X must cross X's
// NICs, B(X) / (|X| x NIC). Not part of the bound as defined (the bound
// spreads the network bytes over all source NICs), reported beside it: a
// trainer whose pipeline stages differ in bytes cannot serve faster than
// its largest stage's ranks.
void source_groups(const Layout& L, const std::map<std::vector<uint32_t>, int64_t>& by_holders, double nic,
                   LowerBound& lb) {
  std::vector<std::pair<std::vector<int32_t>, int64_t>> groups;  // ranks ascending, bytes
  for (const auto& [ids, bytes] : by_holders) {
    std::vector<int32_t> ranks;
    for (uint32_t id : ids)
      for (int32_t r : L.source_sets.get(id)) ranks.push_back(r);
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    if (!ranks.empty()) groups.emplace_back(std::move(ranks), bytes);
  }
  for (const auto& [x, unused] : groups) {
    int64_t bytes = 0;
    for (const auto& [y, b] : groups)
      if (y.size() <= x.size() && std::includes(x.begin(), x.end(), y.begin(), y.end())) bytes += b;
    const double t = static_cast<double>(bytes) / (static_cast<double>(x.size()) * nic);
    if (t > lb.source_group_seconds) {
      lb.source_group_seconds = t;
      lb.source_group_first = x.front();
      lb.source_group_size = static_cast<int32_t>(x.size());
    }
  }
}

}  // namespace

Result<LowerBound> lower_bound(const Plan& plan, const HardwareModel& hw) {
  if (plan.options().strategy != Strategy::kRefit)
    return Status::invalid("the lower bound is computed from a refit plan (its units carry the domains)");
  const Layout& L = plan.layout();
  const double nic = hw.nic_bytes_per_s();
  const double nvl = hw.nvlink_bytes_per_s();
  LowerBound lb;
  // Per receiving domain: a refit plan moves each byte a domain needs into
  // it exactly once, so its units' bytes are the domain's distinct bytes.
  std::vector<int64_t> domain_bytes;
  std::vector<int64_t> domain_gpus;
  for (const ReceiverRank& r : L.receivers) {
    if (static_cast<size_t>(r.domain) >= domain_gpus.size()) domain_gpus.resize(r.domain + 1, 0);
    ++domain_gpus[r.domain];
  }
  domain_bytes.assign(domain_gpus.size(), 0);
  std::vector<int64_t> exclusive(L.sources.size(), 0);
  // A tensor that sources also serve converted (docs/conversion.md, "At the
  // source") may cross in the receivers' dtype where that is narrower.
  auto network_elem_bytes = [](const Tensor& t) {
    const int eb = dtype_bytes(t.dtype);
    return t.converted_sources.empty() ? eb : std::min(eb, dtype_bytes(t.dtype_on(Side::kReceiver)));
  };
  int64_t network_bytes = 0;
  // Bytes per set of holders (their source-set ids, ascending): each set's
  // ranks alone can serve them.
  std::map<std::vector<uint32_t>, int64_t> by_holders;
  std::vector<uint32_t> key;
  for (const Unit& u : plan.units()) {
    const PullSet& ps = plan.pull_set(u);
    const Tensor& t = L.tensors[u.tensor];
    const int eb = network_elem_bytes(t);
    domain_bytes[u.domain] += plan.box(u).numel() * eb;
    network_bytes += plan.box(u).numel() * eb;
    for (const Piece& p : ps.pieces) {
      int32_t only = -1;
      bool one = true;
      for (uint32_t h : plan.holders(ps, p)) {
        for (int32_t r : L.source_sets.get(t.sources[h].ranks)) {
          if (only < 0) only = r;
          else if (r != only) one = false;
        }
      }
      if (one && only >= 0) exclusive[only] += p.box.numel() * eb;
      key.clear();
      for (uint32_t h : plan.holders(ps, p)) key.push_back(t.sources[h].ranks);
      std::sort(key.begin(), key.end());
      key.erase(std::unique(key.begin(), key.end()), key.end());
      by_holders[key] += p.box.numel() * eb;
    }
  }
  source_groups(L, by_holders, nic, lb);
  for (size_t d = 0; d < domain_bytes.size(); ++d) {
    if (domain_gpus[d] == 0) continue;
    const double t = static_cast<double>(domain_bytes[d]) / (static_cast<double>(domain_gpus[d]) * nic);
    if (t > lb.domain_nic_seconds) {
      lb.domain_nic_seconds = t;
      lb.domain = static_cast<int32_t>(d);
    }
  }
  if (!L.sources.empty())
    lb.source_nics_seconds = static_cast<double>(network_bytes) / (static_cast<double>(L.sources.size()) * nic);
  gpu_ingress(L, nic + nvl, lb);
  for (size_t s = 0; s < exclusive.size(); ++s) {
    const double t = static_cast<double>(exclusive[s]) / nic;
    if (t > lb.source_exclusive_seconds) {
      lb.source_exclusive_seconds = t;
      lb.exclusive_source = static_cast<int32_t>(s);
    }
  }
  lb.seconds = lb.domain_nic_seconds;
  lb.binding = "receiving domain's NICs";
  if (lb.source_nics_seconds > lb.seconds) {
    lb.seconds = lb.source_nics_seconds;
    lb.binding = "all source NICs";
  }
  if (lb.gpu_ingress_seconds > lb.seconds) {
    lb.seconds = lb.gpu_ingress_seconds;
    lb.binding = "one GPU's NIC and NVLink ingress";
  }
  return lb;
}

bool write_trace_json(const SimResult& r, const std::string& title, const TextSink& sink) {
  // Names are plain ASCII of our own; no escaping needed beyond the title.
  std::string esc;
  for (char c : title) {
    if (c == '"' || c == '\\') esc.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) esc.push_back(c);
  }
  std::string out = "{\"displayTimeUnit\": \"ms\", \"otherData\": {\"title\": \"" + esc +
                    "\", \"simulated\": true}, \"traceEvents\": [\n";
  bool first = true;
  char buf[256];
  for (int lane = 0; lane <= static_cast<int>(Lane::kConvert); ++lane) {
    std::snprintf(buf, sizeof buf, "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"%s\"}}",
                  first ? "" : ",\n", lane, lane_name(static_cast<Lane>(lane)));
    out += buf;
    first = false;
  }
  for (const TraceSpan& t : r.trace) {
    std::snprintf(buf, sizeof buf,
                  ",\n{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, "
                  "\"args\": {\"bytes\": %lld}}",
                  lane_name(t.lane), static_cast<int>(t.lane), t.rank, t.start * 1e6, (t.end - t.start) * 1e6,
                  static_cast<long long>(t.bytes));
    out += buf;
    if (out.size() > (1 << 20)) {
      if (!sink(out)) return false;
      out.clear();
    }
  }
  out += "\n]}\n";
  return sink(out);
}

}  // namespace refit::sim
