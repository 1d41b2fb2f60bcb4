#include "tools/bench/agent.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "planner/plan.h"
#include "plugin/host_memory.h"
#include "tools/bench/pattern.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/resident_memory.h"
#include "tools/bench/strategy_layouts.h"
#include "refit/refit.h"

namespace refit::bench {

namespace {

struct Memory {
  std::shared_ptr<uint8_t> data;
  int64_t bytes = 0;
};

// A buffer of the host, as a server would allocate it: on transparent huge
// pages (2 MiB-aligned, MADV_HUGEPAGE, as the library allocates its own
// memory) or, with huge_pages off, on small pages (MADV_NOHUGEPAGE, also
// where the kernel's default is "always").
std::shared_ptr<uint8_t> host_buffer(size_t bytes, bool huge_pages) {
  if (huge_pages) return plugin::map_host_memory(bytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  madvise(p, bytes, MADV_NOHUGEPAGE);
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [bytes](uint8_t* q) { munmap(q, bytes); });
}

double seconds_between(int64_t t0_ns, int64_t t1_ns) { return static_cast<double>(t1_ns - t0_ns) * 1e-9; }

// The stand-in for a server that reads its weights while refreshes run
// (agent.h, serve_check).
//
// Threads: the reader thread runs read_loop(); the agent's command thread
// calls everything else. The buffers' bytes are read under mutex_ shared and
// written (by whoever writes the live buffers) only under mutex_ exclusive;
// live_version_ changes only under mutex_ exclusive. writer_waiting_ makes
// the reader step aside for a waiting writer, since glibc's rwlock prefers
// readers and a reader that reads back to back could starve the commit.
class ServingReader {
 public:
  struct Target {
    const uint8_t* data = nullptr;
    std::vector<SampledElement> sample;
  };
  explicit ServingReader(std::vector<Target> targets) : targets_(std::move(targets)) {
    thread_ = std::thread([this] { read_loop(); });
  }
  ~ServingReader() {
    stop_.store(true);
    thread_.join();
  }
  ServingReader(const ServingReader&) = delete;
  ServingReader& operator=(const ServingReader&) = delete;

  // The writer's side: exclusive for as long as the returned lock lives.
  std::unique_lock<std::shared_mutex> pause() {
    writer_waiting_.store(true);
    std::unique_lock<std::shared_mutex> lock(mutex_);
    writer_waiting_.store(false);
    return lock;
  }
  // REQUIRES: the caller holds pause()'s lock.
  void set_live_version(int64_t v) { live_version_ = v; }

  int64_t reads() const { return reads_.load(); }
  int64_t mixed() const { return mixed_.load(); }

 private:
  void read_loop() {
    while (!stop_.load()) {
      if (writer_waiting_.load()) {
        std::this_thread::yield();
        continue;
      }
      bool counted = false, mixed = false;
      Clock::time_point t0;
      {
        std::shared_lock<std::shared_mutex> lock(mutex_);
        t0 = Clock::now();  // the read, not the wait for a writer's pause
        const int64_t live = live_version_;
        if (live > 0) {
          // The live version and its neighbours, so that a read half-way
          // between two versions is told from a read of neither.
          const int64_t versions[3] = {live, live + 1, live - 1};
          // Only the versions every element so far matched are computed:
          // one hash per element once the first has matched one version.
          uint64_t common = 0b111;
          for (const Target& t : targets_)
            for (const SampledElement& e : t.sample) {
              if (common == 0) break;
              common &= matching_versions(e, t.data, versions, 3, common);
            }
          counted = true;
          mixed = common == 0;
        }
      }
      const auto read_time = Clock::now() - t0;
      if (counted) {
        reads_.fetch_add(1);
        if (mixed) mixed_.fetch_add(1);
      }
      // A server does work between reads; and a reader in each receiver
      // process must leave the CPUs of a small machine to the refresh: at
      // most a tenth of one core each.
      // Slept in slices, so that a reader stops promptly when asked.
      const Clock::time_point until =
          Clock::now() + (counted ? std::max<Clock::duration>(std::chrono::microseconds(200), 9 * read_time)
                                  : Clock::duration(std::chrono::milliseconds(1)));
      for (Clock::time_point now = Clock::now(); now < until && !stop_.load(); now = Clock::now())
        std::this_thread::sleep_for(std::min<Clock::duration>(until - now, std::chrono::milliseconds(10)));
    }
  }

  const std::vector<Target> targets_;
  std::shared_mutex mutex_;
  int64_t live_version_ = 0;  // guarded by mutex_
  std::atomic<bool> writer_waiting_{false};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> reads_{0}, mixed_{0};
  std::thread thread_;  // last: starts after every member above exists
};

class Agent {
 public:
  explicit Agent(const AgentSpec& spec) : spec_(spec) {}
  ~Agent() {
    paused_ = {};
    reader_.reset();  // before the receiver (and its buffers) go
    // Receivers first: they read from sources, possibly this process's.
    if (api_ != nullptr) {
      api_->receiver_destroy(receiver_);
      api_->source_destroy(source_);
    }
  }

  Result<Json> handle(const Json& cmd) {
    const std::string what = cmd.value("cmd", std::string());
    if (what == "source") return create_source(cmd);
    if (what == "receiver") return create_receiver(cmd);
    if (what == "rejoin") return rejoin(cmd);
    if (what == "ping") return Json{{"ok", true}};
    if (what == "memory") return Json{{"ok", true}, {"heap_kib", heap_in_use_kib()}};
    if (what == "fill") return fill_sources(cmd);
    if (what == "drain") return drain(cmd);
    if (what == "publish") return publish(cmd);
    if (what == "refresh") return refresh(cmd);
    if (what == "pause") return pause();
    if (what == "commit") return commit();
    if (what == "serve_stats") return serve_stats();
    if (what == "unpack") return unpack(cmd);
    if (what == "verify") return verify_buffers(cmd);
    return Status::invalid("unknown command \"" + what + "\"");
  }

 private:
  Status load_api() {
    if (api_ != nullptr) return Status::ok();
    api_ = refit_get_api(REFIT_ABI_VERSION);
    if (api_ == nullptr) return Status::internal(std::string("refit_get_api: ") + refit_last_error());
    return Status::ok();
  }

  // "refit_source_publish(3): REFIT_TIMEOUT: <the library's message>"
  Status abi_error(const std::string& call, refit_status_t s) const {
    return Status::internal(call + ": " + api_->status_name(s) + ": " + api_->last_error());
  }

  Result<uint8_t*> memory(const std::string& name, int64_t bytes, uint8_t initial) {
    auto it = memory_.find(name);
    if (it != memory_.end()) {
      if (it->second.bytes != bytes)
        return Status::invalid("buffer \"" + name + "\" is wanted with " + std::to_string(bytes) + " and " +
                               std::to_string(it->second.bytes) + " bytes");
      return it->second.data.get();
    }
    const size_t n = static_cast<size_t>((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    std::shared_ptr<uint8_t> p = host_buffer(n, spec_.huge_pages);
    if (p == nullptr) return Status::internal("out of memory for buffer \"" + name + "\" (" + std::to_string(bytes) + " bytes)");
    std::memset(p.get(), initial, n);
    Memory& m = memory_[name];
    m.data = std::move(p);
    m.bytes = bytes;
    return m.data.get();
  }

  static int64_t version_of(const Json& cmd) { return cmd.value("version", int64_t{0}); }

  Result<Json> create_source(const Json& cmd) {
    if (spec_.source_layout == nullptr) return Status::invalid("this process has no source rank");
    if (source_ != nullptr) return Status::invalid("the source exists already");
    REFIT_RETURN_IF_ERROR(load_api());
    auto bufs = rank_buffers(*spec_.source_layout, Side::kSource, spec_.source_rank);
    if (!bufs) return bufs.status();
    source_buffers_ = std::move(*bufs);
    const std::string config = cmd.value("config", std::string());
    refit_status_t s = api_->source_create(config.c_str(), &source_);
    if (s != REFIT_OK) return abi_error("refit_source_create", s);
    int tensors = 0;
    for (const RankBuffer& b : source_buffers_) {
      auto mem = memory(b.name, b.bytes, 0);
      if (!mem) return mem.status();
      for (const std::string& desc : source_tensor_jsons(*spec_.source_layout, b)) {
        s = api_->source_add_tensor(source_, desc.c_str(), *mem, static_cast<uint64_t>(b.bytes));
        if (s != REFIT_OK) return abi_error("refit_source_add_tensor(" + desc + ")", s);
        ++tensors;
      }
    }
    auto joined = join_retrying("refit_source_join", [this] { return api_->source_join(source_); }, cmd);
    if (!joined) return joined.status();
    Json reply = std::move(*joined);
    reply["buffers"] = source_buffers_.size();
    reply["tensors"] = tensors;
    return reply;
  }

  // join(), again every 100 ms for at most the command's "join_retry_ms"
  // while the coordinator refuses the rank as already registered: a rank
  // that died is held until the coordinator declares it dead.
  template <typename Join>
  Result<Json> join_retrying(const char* call, Join join, const Json& cmd) {
    const int64_t t0 = monotonic_ns();
    const Clock::time_point deadline =
        Clock::now() + std::chrono::milliseconds(std::max<int64_t>(0, cmd.value("join_retry_ms", int64_t{0})));
    int64_t attempts = 0;
    for (;;) {
      ++attempts;
      const refit_status_t s = join();
      if (s == REFIT_OK) break;
      const std::string error = api_->last_error();
      if (error.find("already registered") == std::string::npos ||
          Clock::now() + std::chrono::milliseconds(100) >= deadline) {
        Status e = abi_error(call, s);
        return Status::internal(e.message() + " (after " + std::to_string(attempts) + " attempts)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return Json{{"ok", true}, {"join_seconds", seconds_between(t0, monotonic_ns())}, {"join_attempts", attempts}};
  }

  Result<Json> create_receiver(const Json& cmd) {
    if (spec_.receiver_layout == nullptr) return Status::invalid("this process has no receiver rank");
    if (receiver_ != nullptr) return Status::invalid("the receiver exists already");
    REFIT_RETURN_IF_ERROR(load_api());
    auto bufs = rank_buffers(*spec_.receiver_layout, Side::kReceiver, spec_.receiver_rank);
    if (!bufs) return bufs.status();
    receiver_buffers_ = std::move(*bufs);
    if (spec_.final_layout != nullptr) {
      auto fin = rank_buffers(*spec_.final_layout, Side::kReceiver, spec_.final_rank);
      if (!fin) return fin.status();
      final_buffers_ = std::move(*fin);
      for (const RankBuffer& b : final_buffers_) {
        auto mem = memory(b.name, b.bytes, kGuardByte);
        if (!mem) return mem.status();
      }
    }
    auto joined = make_receiver(cmd);
    if (!joined) return joined.status();
    if (spec_.serve_check) start_reader();
    Json reply = std::move(*joined);
    reply["buffers"] = receiver_buffers_.size();
    return reply;
  }

  // refit_receiver_create, every buffer (allocated on first use, the same
  // memory afterwards), join.
  Result<Json> make_receiver(const Json& cmd) {
    const std::string config = cmd.value("config", std::string());
    refit_status_t s = api_->receiver_create(config.c_str(), &receiver_);
    if (s != REFIT_OK) return abi_error("refit_receiver_create", s);
    for (const RankBuffer& b : receiver_buffers_) {
      auto mem = memory(b.name, b.bytes, kGuardByte);
      if (!mem) return mem.status();
      const std::string desc = receiver_buffer_json(*spec_.receiver_layout, b);
      s = api_->receiver_add_buffer(receiver_, desc.c_str(), *mem, static_cast<uint64_t>(b.bytes));
      if (s != REFIT_OK) return abi_error("refit_receiver_add_buffer(" + desc + ")", s);
    }
    return join_retrying("refit_receiver_join", [this] { return api_->receiver_join(receiver_); }, cmd);
  }

  // The receiver leaves (destroyed: it unregisters, its staging copies and
  // registrations go) and a new one joins with the same rank and buffers.
  // The served buffers and the serving reader stay: a server that restarts
  // its refit agent keeps serving what it holds.
  Result<Json> rejoin(const Json& cmd) {
    if (receiver_ == nullptr) return Status::invalid("rejoin before \"receiver\"");
    if (paused_.owns_lock()) return Status::invalid("rejoin while paused");
    const int64_t t0 = monotonic_ns();
    api_->receiver_destroy(receiver_);
    receiver_ = nullptr;
    const int64_t t1 = monotonic_ns();
    auto joined = make_receiver(cmd);
    if (!joined) return joined.status();
    const int64_t t2 = monotonic_ns();
    Json reply = std::move(*joined);
    reply["seconds"] = seconds_between(t0, t2);
    reply["leave_seconds"] = seconds_between(t0, t1);
    reply["join_seconds"] = seconds_between(t1, t2);
    return reply;
  }

  // The reader reads what a server serves from: the final buffers when there
  // are (broadcast), else the receiver buffers.
  void start_reader() {
    const bool final = spec_.final_layout != nullptr;
    const Layout& L = final ? *spec_.final_layout : *spec_.receiver_layout;
    std::vector<ServingReader::Target> targets;
    for (const RankBuffer& b : final ? final_buffers_ : receiver_buffers_)
      targets.push_back({memory_.at(b.name).data.get(), sample_elements(L, b, spec_.sample_every)});
    reader_ = std::make_unique<ServingReader>(std::move(targets));
  }

  Result<Json> pause() {
    if (reader_ == nullptr) return Status::invalid("pause without a serving reader (serve_check)");
    if (paused_.owns_lock()) return Status::invalid("pause: already paused");
    paused_ = reader_->pause();
    return Json{{"ok", true}};
  }

  Result<Json> commit() {
    if (receiver_ == nullptr) return Status::invalid("commit before \"receiver\"");
    std::unique_lock<std::shared_mutex> lock;
    if (reader_ != nullptr) lock = reader_->pause();
    const int64_t t0 = monotonic_ns();
    refit_status_t s = api_->receiver_commit(receiver_);
    const int64_t t1 = monotonic_ns();
    if (s != REFIT_OK) return abi_error("refit_receiver_commit", s);
    if (reader_ != nullptr) reader_->set_live_version(api_->receiver_version(receiver_));
    lock = {};
    Json report = Json::parse(api_->receiver_report(receiver_), nullptr, false);
    if (report.is_discarded()) return Status::internal("refit_receiver_report is not JSON");
    return Json{{"ok", true},
                {"seconds", seconds_between(t0, t1)},
                {"end_ns", t1},
                {"version", api_->receiver_version(receiver_)},
                {"report", std::move(report)}};
  }

  Result<Json> serve_stats() {
    if (reader_ == nullptr) return Status::invalid("serve_stats without a serving reader (serve_check)");
    return Json{{"ok", true}, {"reads", reader_->reads()}, {"mixed_version_reads", reader_->mixed()}};
  }

  Result<Json> fill_sources(const Json& cmd) {
    const int64_t t0 = monotonic_ns();
    for (const RankBuffer& b : source_buffers_)
      fill(*spec_.source_layout, b, memory_.at(b.name).data.get(), version_of(cmd));
    const int64_t t1 = monotonic_ns();
    return Json{{"ok", true}, {"seconds", seconds_between(t0, t1)}};
  }

  Result<Json> drain(const Json& cmd) {
    if (source_ == nullptr) return Status::invalid("drain before \"source\"");
    const int64_t v = version_of(cmd);
    refit_status_t s = api_->source_wait_drained(source_, v, cmd.value("timeout_ms", int64_t{10000}));
    if (s != REFIT_OK) return abi_error("refit_source_wait_drained(" + std::to_string(v) + ")", s);
    return Json{{"ok", true}};
  }

  Result<Json> publish(const Json& cmd) {
    if (source_ == nullptr) return Status::invalid("publish before \"source\"");
    const int64_t v = version_of(cmd);
    refit_status_t s = api_->source_publish(source_, v);
    if (s != REFIT_OK) return abi_error("refit_source_publish(" + std::to_string(v) + ")", s);
    return Json{{"ok", true}, {"end_ns", monotonic_ns()}};
  }

  Result<Json> refresh(const Json& cmd) {
    if (receiver_ == nullptr) return Status::invalid("refresh before \"receiver\"");
    const int64_t v = version_of(cmd);
    const int64_t t0 = monotonic_ns();
    refit_status_t s = api_->receiver_refresh(receiver_, v, cmd.value("timeout_ms", int64_t{30000}));
    const int64_t t1 = monotonic_ns();
    if (paused_.owns_lock()) {  // a direct refresh wrote the live buffers: serve again
      reader_->set_live_version(api_->receiver_version(receiver_));
      paused_ = {};
    }
    if (s != REFIT_OK) {
      Status e = abi_error("refit_receiver_refresh(" + std::to_string(v) + ")", s);
      return Json{{"ok", false}, {"status", api_->status_name(s)}, {"error", e.message()},
                  {"seconds", seconds_between(t0, t1)}};
    }
    Json report = Json::parse(api_->receiver_report(receiver_), nullptr, false);
    if (report.is_discarded()) return Status::internal("refit_receiver_report is not JSON");
    return Json{{"ok", true},
                {"seconds", seconds_between(t0, t1)},
                {"end_ns", t1},
                {"version", api_->receiver_version(receiver_)},
                {"report", std::move(report)}};
  }

  Result<Json> unpack(const Json& cmd) {
    if (spec_.final_layout == nullptr) return Status::invalid("this process has no final buffers to unpack into");
    const Layout& fin = *spec_.final_layout;
    const Layout& scratch = *spec_.receiver_layout;
    std::unique_lock<std::shared_mutex> lock;
    if (reader_ != nullptr) lock = reader_->pause();
    const int64_t t0 = monotonic_ns();
    for (const RankBuffer& b : final_buffers_) {
      uint8_t* to = memory_.at(b.name).data.get();
      for (const Placed& p : b.placed) {
        const Tensor& t = fin.tensors[p.tensor];
        const Tensor& st = scratch.tensors[p.tensor];  // same index (strategy_layouts.h)
        if (st.receivers.empty()) return Status::internal("no scratch buffer for tensor \"" + t.name + "\"");
        const Region& whole = st.receivers[0];
        auto it = memory_.find(scratch_buffer_name(t.name));
        if (it == memory_.end()) return Status::internal("no scratch memory for tensor \"" + t.name + "\"");
        const uint8_t* from = it->second.data.get();
        for_each_copy(p.region->box, whole, *p.region, dtype_bytes(t.dtype),
                      [&](int64_t fo, int64_t too, int64_t n) { std::memcpy(to + too, from + fo, static_cast<size_t>(n)); });
      }
    }
    const int64_t t1 = monotonic_ns();
    if (reader_ != nullptr) reader_->set_live_version(version_of(cmd));
    return Json{{"ok", true}, {"seconds", seconds_between(t0, t1)}, {"end_ns", t1}};
  }

  Result<Json> verify_buffers(const Json& cmd) {
    const bool final = spec_.final_layout != nullptr;
    const Layout& L = final ? *spec_.final_layout : *spec_.receiver_layout;
    const std::vector<RankBuffer>& bufs = final ? final_buffers_ : receiver_buffers_;
    int64_t bytes = 0;
    for (const RankBuffer& b : bufs) {
      REFIT_RETURN_IF_ERROR(verify(L, b, memory_.at(b.name).data.get(), version_of(cmd)));
      bytes += b.covered_bytes(L);
    }
    return Json{{"ok", true}, {"bytes", bytes}};
  }

  const AgentSpec& spec_;
  const refit_api_t* api_ = nullptr;
  refit_source_t* source_ = nullptr;
  refit_receiver_t* receiver_ = nullptr;
  std::vector<RankBuffer> source_buffers_, receiver_buffers_, final_buffers_;
  std::map<std::string, Memory> memory_;
  // serve_check: the reader, and its lock while "pause" holds it.
  std::unique_ptr<ServingReader> reader_;
  std::unique_lock<std::shared_mutex> paused_;
};

}  // namespace

int run_standby(const AgentSpec& spec, Channel& channel) {
  for (;;) {
    auto cmd = channel.receive(Clock::now() + spec.idle_timeout);
    if (!cmd) return 3;
    const std::string what = cmd->value("cmd", std::string());
    if (what == "become") {
      if (!channel.send(Json{{"ok", true}, {"pid", static_cast<int64_t>(::getpid())}}).is_ok()) return 3;
      return run_agent(spec, channel);
    }
    Json reply = what == "ping" || what == "exit"
                     ? Json{{"ok", true}}
                     : Json{{"ok", false}, {"error", "a standby answers only ping, become and exit, not \"" + what + "\""}};
    if (!channel.send(reply).is_ok()) return 3;
    if (what == "exit") return 0;
  }
}

int run_agent(const AgentSpec& spec, Channel& channel) {
  Agent agent(spec);
  for (;;) {
    auto cmd = channel.receive(Clock::now() + spec.idle_timeout);
    if (!cmd) return 3;
    if (cmd->value("cmd", std::string()) == "exit") {
      channel.send(Json{{"ok", true}});
      return 0;
    }
    Result<Json> reply = agent.handle(*cmd);
    Status sent = reply ? channel.send(*reply) : channel.send(Json{{"ok", false}, {"error", reply.status().message()}});
    if (!sent.is_ok()) return 3;
  }
}

}  // namespace refit::bench
