#include "tools/bench/refresh_run.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "tools/bench/agent.h"
#include "tools/bench/hosts.h"
#include "tools/bench/local_coordinator.h"
#include "tools/bench/process_group.h"
#include "tools/bench/resident_memory.h"
#include "tools/bench/strategy_layouts.h"

namespace refit::bench {

namespace {

using ordered_json = nlohmann::ordered_json;

// The ranks of one role in a ProcessGroup, and their places in the layout.
struct Role {
  std::vector<size_t> children;
  std::vector<AgentPlace> places;
};

// The turns of interleaved runs: parties 0, 1, .., n-1, 0, .. in a ring;
// each holds the turn from wait() until pass(). A party that leaves is
// skipped from then on (a finished or failed run).
class Turns {
 public:
  explicit Turns(size_t parties) : active_(parties, true) {}
  void wait(size_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return current_ == id; });
  }
  void pass(size_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (current_ == id) advance();
    cv_.notify_all();
  }
  void leave(size_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    active_[id] = false;
    if (current_ == id) advance();
    cv_.notify_all();
  }

 private:
  void advance() {  // REQUIRES mu_
    for (size_t k = 1; k <= active_.size(); ++k) {
      const size_t c = (current_ + k) % active_.size();
      if (active_[c]) {
        current_ = c;
        return;
      }
    }
    current_ = SIZE_MAX;  // everyone left
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> active_;
  size_t current_ = 0;
};

class Runner {
 public:
  Runner(const Layout& layout, Strategy strategy, const RunOptions& options)
      : layout_(layout), strategy_(strategy), options_(options) {
    if (strategy == Strategy::kBroadcast) {
      options_.staged = false;
      options_.kill.reset();
      options_.churn = 0;
      options_.late_join_version = 0;
    }
    result_.strategy = strategy;
    result_.staged = options_.staged;
  }

  RunResult run() {
    Status s = spawn_all();
    if (s.is_ok()) s = run_versions();
    return finish(s);
  }

  // Interleaved runs (run_interleaved): spawn_all() of every runner from
  // the calling thread first, then run_versions() of each on a thread of its
  // own, taking turns version by version, then finish().
  void take_turns(Turns* turns, size_t id) {
    turns_ = turns;
    turn_id_ = id;
  }

  RunResult finish(Status s) {
    if (!s.is_ok()) {
      group_.kill_all();
      std::string logs;
      for (const auto& c : coordinators_)
        if (c && !c->logs().empty()) logs += c->logs();
      // A kill's error says what happened; the coordinator's log of it would bury that.
      const bool plain = logs.empty() || !result_.killed.empty();
      result_.status = plain ? s : Status::internal(s.message() + "\ncoordinator log:\n" + logs);
    } else {
      result_.status = group_.shut_down(Clock::now() + std::chrono::seconds(10));
    }
    for (auto& [key, sample] : resident_) result_.resident.push_back(std::move(sample));
    group_.kill_all();
    coordinators_.clear();
    if (turns_ != nullptr) turns_->leave(turn_id_);  // after the shutdown: it must not overlap another's refresh
    return std::move(result_);
  }

 private:
  Clock::time_point deadline() const { return Clock::now() + options_.step_timeout; }
  // Steps that pass refresh_timeout to the library wait for its own bound
  // (RunOptions::refresh_step_timeout), so that the library's error (which
  // names the cause) arrives first.
  Clock::time_point refresh_deadline() const { return Clock::now() + options_.refresh_step_timeout(); }

  // CPU time used so far by this run's processes: every child still
  // running and refit-bench itself (with the coordinator).
  double own_cpu_seconds() const {
    std::vector<pid_t> pids{0};
    for (size_t c = 0; c < group_.size(); ++c)
      if (group_.running(c)) pids.push_back(group_.pid(c));
    return processes_cpu_seconds(pids);
  }

  void step(const std::string& what) {
    ++done_;
    if (options_.progress) options_.progress(what, done_, total_);
  }

  Result<size_t> spawn(const std::string& name, AgentSpec spec, bool standby = false) {
    spec.serve_check = options_.serve_check && spec.receiver_layout != nullptr && spec.source_layout == nullptr;
    spec.sample_every = options_.sample_every;
    spec.huge_pages = options_.huge_pages;
    specs_.push_back(std::make_unique<AgentSpec>(spec));
    const AgentSpec* p = specs_.back().get();
    std::string netns;
    if (options_.hosts) {
      const RunOptions::HostPlaces& h = *options_.hosts;
      if (spec.source_layout != nullptr && spec.receiver_layout != nullptr) netns = h.gatherer_netns;
      else if (spec.source_layout != nullptr) netns = at(h.source_netns, spec.source_rank);
      else netns = at(h.receiver_netns, spec.receiver_rank);
    }
    if (standby) return group_.spawn(name, [p](Channel& ch) { return run_standby(*p, ch); }, netns);
    return group_.spawn(name, [p](Channel& ch) { return run_agent(*p, ch); }, netns);
  }

  static std::string at(const std::vector<std::string>& v, int32_t i) {
    return i >= 0 && static_cast<size_t>(i) < v.size() ? v[static_cast<size_t>(i)] : std::string();
  }
  // The device a rank's agent names: its host's interface (hosts), else "".
  std::string device_of(bool receiver, int32_t rank) const {
    if (!options_.hosts) return "";
    return at(receiver ? options_.hosts->receiver_device : options_.hosts->source_device, rank);
  }

  // Every host's interface counters now (hosts), else null.
  Result<Json> link_counters() const {
    if (!options_.hosts || !options_.hosts->counters) return Json();
    return options_.hosts->counters();
  }
  static Json counter_difference(const Json& before, const Json& after) {
    if (!before.is_object() || !after.is_object()) return Json();
    Json out = Json::object();
    for (auto it = after.begin(); it != after.end(); ++it) {
      if (!before.contains(it.key())) continue;
      Json d = Json::object();
      for (const char* k : {"rx_bytes", "tx_bytes"})
        d[k] = it.value().value(k, int64_t{0}) - before[it.key()].value(k, int64_t{0});
      out[it.key()] = d;
    }
    return out;
  }

  Status spawn_sources(const Layout& layout, Role* role) {
    for (int32_t s = 0; s < layout.num_ranks(Side::kSource); ++s) {
      AgentSpec spec;
      spec.source_layout = &layout;
      spec.source_rank = s;
      auto c = spawn("source " + std::to_string(s), spec);
      if (!c) return c.status();
      role->children.push_back(*c);
      role->places.push_back({false, s, layout.sources[s].domain, 0, device_of(false, s)});
    }
    return Status::ok();
  }

  std::vector<Json> configs(const Role& role, const std::string& cmd, const LocalCoordinator& coordinator) const {
    std::vector<Json> out;
    for (const AgentPlace& p : role.places)
      out.push_back(Json{{"cmd", cmd}, {"config", agent_config(p, coordinator.address(), coordinator.token_file(), options_)}});
    return out;
  }

  // metrics: the run's one coordinator serves options_.metrics_address.
  Result<std::unique_ptr<LocalCoordinator>> coordinator(bool metrics = false) {
    const std::string address = metrics ? options_.metrics_address : "";
    Result<std::unique_ptr<LocalCoordinator>> c = Status::internal("no coordinator");
    if (options_.hosts && !options_.hosts->coordinator_netns.empty()) {
      // Its threads start in the coordinator's host and stay there.
      NetnsScope there(options_.hosts->coordinator_netns);
      if (!there.status().is_ok()) return there.status();
      c = LocalCoordinator::start(options_.heartbeat_timeout, options_.hosts->coordinator_host, address,
                                  options_.relayout_below_bytes);
    } else {
      c = LocalCoordinator::start(options_.heartbeat_timeout, "127.0.0.1", address, options_.relayout_below_bytes);
    }
    if (!c) return c.status();
    if (!address.empty() && options_.on_metrics) options_.on_metrics((*c)->metrics_port());
    return std::move(*c);
  }

  // Keeps the coordinator up until its metrics endpoint answered one more
  // scrape (one that saw every version of the run), at most
  // metrics_final_scrape.
  void wait_for_final_scrape(const LocalCoordinator& C) const {
    if (C.metrics_port() == 0) return;
    const uint64_t before = C.scrapes();
    const auto until = Clock::now() + options_.metrics_final_scrape;
    while (C.scrapes() == before && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  Json versioned(const char* cmd, int64_t v, bool with_timeout = false) const {
    Json j{{"cmd", cmd}, {"version", v}};
    if (with_timeout) j["timeout_ms"] = options_.refresh_timeout.count();
    return j;
  }

  static void sum_reports(const std::vector<Json>& replies, VersionResult* vr, int64_t t0_ns, int64_t* end_ns) {
    for (const Json& r : replies) {
      const Json& rep = r.contains("report") ? r["report"] : Json::object();
      vr->network_bytes += rep.value("network_bytes", int64_t{0});
      vr->local_bytes += rep.value("local_bytes", int64_t{0});
      *end_ns = std::max(*end_ns, r.value("end_ns", t0_ns));
    }
  }

  // The slowest receiver's refresh ("seconds.total") and pause.
  static void slowest(const std::vector<Json>& replies, VersionResult* vr) {
    for (const Json& r : replies) {
      if (!r.contains("report")) continue;
      const Json& rep = r["report"];
      if (rep.contains("seconds") && rep["seconds"].is_object())
        vr->refresh_seconds = std::max(vr->refresh_seconds, rep["seconds"].value("total", 0.0));
      vr->pause_seconds = std::max(vr->pause_seconds, rep.value("pause_seconds", 0.0));
    }
  }

  // Sums the serving readers' counts into the result: the readers of
  // `receivers` now, and what the readers of processes that are gone (a
  // killed receiver) had counted when last asked.
  // Staged mode: the receivers commit one after another. Each stands for a
  // server on a GPU of its own, whose commit copies within that GPU's
  // memory; on this one host concurrent commits would share one memory bus
  // and each pause would measure the others' copies too.
  Result<std::vector<Json>> commit_one_by_one(const std::vector<size_t>& receivers) {
    std::vector<Json> replies;
    for (size_t rx : receivers) {
      Result<Json> one = group_.request(rx, Json{{"cmd", "commit"}}, deadline());
      if (!one.is_ok()) return one.status();
      replies.push_back(std::move(one).value());
    }
    return replies;
  }

  Status collect_serve_stats(const std::vector<size_t>& receivers) {
    if (!options_.serve_check) return Status::ok();
    auto r = group_.request(receivers, Json{{"cmd", "serve_stats"}}, deadline());
    if (!r) return r.status();
    for (size_t i = 0; i < receivers.size(); ++i)
      serve_counts_[receivers[i]] = {(*r)[i].value("reads", int64_t{0}),
                                     (*r)[i].value("mixed_version_reads", int64_t{0})};
    result_.serve_reads = 0;
    result_.mixed_version_reads = 0;
    for (const auto& [child, counts] : serve_counts_) {
      result_.serve_reads += counts.first;
      result_.mixed_version_reads += counts.second;
    }
    return Status::ok();
  }

  // The receivers that have joined (late joiners only from their version
  // on; a killed one not until its replacement has joined).
  std::vector<size_t> active(const Role& receivers) const {
    std::vector<size_t> out;
    for (size_t r = 0; r < receivers.children.size(); ++r)
      if (joined_[r]) out.push_back(receivers.children[r]);
    return out;
  }

  Json config_command(const char* cmd, const AgentPlace& place, const LocalCoordinator& coordinator) const {
    return Json{{"cmd", cmd},
                {"config", agent_config(place, coordinator.address(), coordinator.token_file(), options_)},
                {"join_retry_ms", options_.refresh_timeout.count()}};
  }

  // Resident memory of the bench and of `children`, after version v
  // verified on them: the first sample of a process is kept, the last
  // replaced.
  Status sample_resident(int64_t v, const std::vector<size_t>& children) {
    auto take = [&](int64_t key, const std::string& name, pid_t pid, int64_t heap_kib) -> Status {
      auto kib = resident_kib(pid);
      if (!kib) return kib.status().with_context("resident memory of " + name);
      auto [it, fresh] = resident_.try_emplace(key);
      ResidentSample& r = it->second;
      if (fresh) {
        r.process = name;
        r.pid = pid == 0 ? static_cast<int64_t>(::getpid()) : static_cast<int64_t>(pid);
        r.first_version = v;
        r.first_kib = *kib;
        r.first_heap_kib = heap_kib;
      }
      r.last_version = v;
      r.last_kib = *kib;
      r.last_heap_kib = heap_kib;
      return Status::ok();
    };
    std::vector<size_t> running;
    for (size_t c : children)
      if (group_.running(c)) running.push_back(c);
    auto heaps = group_.request(running, Json{{"cmd", "memory"}}, deadline());
    if (!heaps) return heaps.status();
    REFIT_RETURN_IF_ERROR(take(-1, "refit-bench", 0, heap_in_use_kib()));
    for (size_t i = 0; i < running.size(); ++i)
      REFIT_RETURN_IF_ERROR(take(static_cast<int64_t>(running[i]), group_.name(running[i]), group_.pid(running[i]),
                                 (*heaps)[i].value("heap_kib", int64_t{0})));
    return Status::ok();
  }

  // Processes that wait for a later version (late joiners, a standby) are
  // asked to answer once per version, so that their idle deadline never
  // passes while the run goes on.
  Status ping_idle(const Role& receivers) {
    std::vector<size_t> idle;
    for (size_t r = 0; r < receivers.children.size(); ++r)
      if (!joined_[r] && group_.running(receivers.children[r])) idle.push_back(receivers.children[r]);
    if (standby_ != SIZE_MAX && group_.running(standby_)) idle.push_back(standby_);
    if (idle.empty()) return Status::ok();
    auto r = group_.request(idle, Json{{"cmd", "ping"}}, deadline());
    return r ? Status::ok() : r.status();
  }

  // RunOptions::churn receivers, in turn over the ranks, leave and rejoin.
  Status churn(const Role& receivers, const LocalCoordinator& C, VersionResult* vr) {
    const size_t n = receivers.children.size();
    size_t joined = 0;
    for (size_t r = 0; r < n; ++r) joined += joined_[r] ? 1 : 0;
    const size_t want = std::min(static_cast<size_t>(options_.churn), joined);
    std::vector<size_t> children;
    std::vector<Json> commands;
    for (size_t tried = 0; children.size() < want && tried < n; ++tried) {
      const size_t r = churn_next_;
      churn_next_ = (churn_next_ + 1) % n;
      if (!joined_[r]) continue;
      children.push_back(receivers.children[r]);
      commands.push_back(config_command("rejoin", receivers.places[r], C));
      vr->rejoined.push_back(static_cast<int32_t>(r));
    }
    auto replies = group_.request_each(children, commands, refresh_deadline());
    if (!replies) return replies.status();
    for (const Json& x : *replies) vr->rejoin_seconds = std::max(vr->rejoin_seconds, x.value("seconds", 0.0));
    result_.rejoins += static_cast<int64_t>(children.size());
    return Status::ok();
  }

 public:
  // Checks the options and forks every process of the run (no threads yet).
  Status spawn_all() {
    if (options_.versions < 1) return Status::invalid("versions must be at least 1");
    if (options_.partition && options_.versions < 3)
      return Status::invalid("partition needs at least 3 versions: it hits the one before the last, and the last "
                             "must verify after it");
    if (options_.partition && options_.kill) return Status::invalid("partition and kill: give one of them");
    if (options_.kill && options_.versions < 2)
      return Status::invalid("kill needs at least 2 versions: the one before says when to kill");
    if (options_.kill && options_.kill->rejoin && options_.versions < 3)
      return Status::invalid("kill with rejoin needs at least 3 versions: one before the killed one, one after it");
    first_ = options_.first_version;
    const int64_t first = first_;
    const int64_t last = first + options_.versions - 1;
    if (options_.late_join_version != 0 &&
        (options_.late_join_version <= first || options_.late_join_version > last))
      return Status::invalid("late join at version " + std::to_string(options_.late_join_version) +
                             ": it must be one of the versions after the first, " + std::to_string(first + 1) + ".." +
                             std::to_string(last));
    if (strategy_ == Strategy::kBroadcast) return Status::ok();  // run_broadcast forks in stages

    // Fork every rank first, while this process has no threads.
    const Layout* L = &layout_;
    if (strategy_ == Strategy::kNoDedup) {
      derived_.push_back(std::make_unique<Layout>(no_dedup_layout(layout_)));
      L = derived_.back().get();
    }
    L_ = L;
    const int32_t num_receivers = L->num_ranks(Side::kReceiver);
    int32_t& late_instance = late_instance_;
    if (options_.late_join_version != 0) {
      for (const auto& r : L->receivers) late_instance = std::max(late_instance, r.instance);
      bool others = false;
      for (const auto& r : L->receivers) others = others || r.instance != late_instance;
      if (!others)
        return Status::invalid("late join needs two inference instances or more: one joins late, the others "
                               "refresh before it");
    }
    if (options_.kill) {
      const RunOptions::Kill& k = *options_.kill;
      const int32_t ranks = k.receiver ? num_receivers : L->num_ranks(Side::kSource);
      if (k.rank < 0 || k.rank >= ranks)
        return Status::invalid(std::string("kill: there is no ") + (k.receiver ? "receiver " : "source ") +
                               std::to_string(k.rank) + " (" + std::to_string(ranks) + " of them)");
    }
    kill_version_ = !options_.kill ? 0 : options_.kill->rejoin ? last - 1 : last;
    const int64_t kill_version = kill_version_;
    Role& sources = sources_;
    Role& receivers = receivers_;
    total_ = 3 + options_.versions * (options_.staged ? 5 : 4) + (options_.churn > 0 ? options_.versions - 1 : 0) +
             (late_instance >= 0 ? 1 : 0) + (kill_version != 0 && options_.kill->rejoin ? 1 : 0);
    REFIT_RETURN_IF_ERROR(spawn_sources(*L, &sources));
    for (int32_t r = 0; r < num_receivers; ++r) {
      AgentSpec spec;
      spec.receiver_layout = L;
      spec.receiver_rank = r;
      auto c = spawn("receiver " + std::to_string(r), spec);
      if (!c) return c.status();
      receivers.children.push_back(*c);
      receivers.places.push_back({true, r, L->receivers[r].domain, L->receivers[r].instance, device_of(true, r)});
    }
    if (kill_version != 0 && options_.kill->rejoin) {
      const RunOptions::Kill& k = *options_.kill;
      AgentSpec spec;
      (k.receiver ? spec.receiver_layout : spec.source_layout) = L;
      (k.receiver ? spec.receiver_rank : spec.source_rank) = k.rank;
      auto c = spawn(std::string(k.receiver ? "receiver " : "source ") + std::to_string(k.rank) + " (replacement)",
                     spec, /*standby=*/true);
      if (!c) return c.status();
      standby_ = *c;
    }
    step("started " + std::to_string(group_.size()) + " processes");
    return Status::ok();
  }

  // Starts the coordinator, has every rank join, and runs the versions.
  Status run_versions() {
    if (strategy_ == Strategy::kBroadcast) return run_broadcast(first_);
    const Layout* L = L_;
    const int32_t num_receivers = L->num_ranks(Side::kReceiver);
    const int32_t late_instance = late_instance_;
    const int64_t first = first_;
    const int64_t last = first + options_.versions - 1;
    const int64_t kill_version = kill_version_;
    Role& sources = sources_;
    Role& receivers = receivers_;
    take_turn();  // the set-up and the first version
    auto coord = coordinator(/*metrics=*/true);
    if (!coord) return coord.status();
    const LocalCoordinator& C = **coord;
    coordinators_.push_back(std::move(*coord));

    auto r = group_.request_each(sources.children, configs(sources, "source", C), deadline());
    if (!r) return r.status();
    step("sources joined");
    joined_.assign(static_cast<size_t>(num_receivers), false);
    Role early;
    for (int32_t i = 0; i < num_receivers; ++i) {
      if (receivers.places[i].instance == late_instance) continue;
      early.children.push_back(receivers.children[i]);
      early.places.push_back(receivers.places[i]);
      joined_[i] = true;
    }
    r = group_.request_each(early.children, configs(early, "receiver", C), deadline());
    if (!r) return r.status();
    step("receivers joined");

    for (int64_t v = first; v <= last; ++v) {
      if (v > first) {  // the other runs' version, then this one's
        pass_turn();
        take_turn();
      }
      VersionResult vr;
      vr.version = v;
      vr.begin_ns = monotonic_ns();
      const std::string tag = "version " + std::to_string(v) + ": ";
      REFIT_RETURN_IF_ERROR(ping_idle(receivers));
      if (v > first) {
        r = group_.request(sources.children, versioned("drain", v - 1, true), refresh_deadline());
        if (!r) return r.status();
      }
      if (v == options_.late_join_version) {
        Role late;
        std::string ranks;
        for (int32_t i = 0; i < num_receivers; ++i) {
          if (receivers.places[i].instance != late_instance) continue;
          late.children.push_back(receivers.children[i]);
          late.places.push_back(receivers.places[i]);
          joined_[i] = true;
          ranks += (ranks.empty() ? "" : ", ") + std::to_string(i);
        }
        r = group_.request_each(late.children, configs(late, "receiver", C), deadline());
        if (!r) return r.status();
        result_.late_joined = "instance " + std::to_string(late_instance) + " (receivers " + ranks +
                              ") joined at version " + std::to_string(v);
        step(tag + "instance " + std::to_string(late_instance) + " joined");
      }
      if (options_.churn > 0 && v > first) {
        REFIT_RETURN_IF_ERROR(churn(receivers, C, &vr));
        step(tag + "receivers left and rejoined");
      }
      r = group_.request(sources.children, versioned("fill", v), deadline());
      if (!r) return r.status();
      step(tag + "filled");
      const int64_t p0 = monotonic_ns();
      r = group_.request(sources.children, versioned("publish", v), deadline());
      if (!r) return r.status();
      vr.publish_seconds = static_cast<double>(monotonic_ns() - p0) * 1e-9;
      step(tag + "published");
      const std::vector<size_t> rx = active(receivers);
      if (options_.serve_check && !options_.staged) {  // the servers pause before any peer may push
        r = group_.request(rx, Json{{"cmd", "pause"}}, deadline());
        if (!r) return r.status();
      }
      if (v == kill_version && v > first) {
        REFIT_RETURN_IF_ERROR(refresh_with_kill(v, sources, receivers, C));
        continue;
      }
      if (options_.partition && v == last - 1) {
        REFIT_RETURN_IF_ERROR(refresh_with_partition(v, sources, receivers));
        continue;
      }
      auto links0 = link_counters();
      if (!links0) return links0.status();
      const double cpu0 = own_cpu_seconds(), busy0 = machine_busy_seconds();
      const int64_t t0 = monotonic_ns();
      r = group_.request(rx, versioned("refresh", v, true), refresh_deadline());
      if (!r) return r.status();
      auto links1 = link_counters();
      if (!links1) return links1.status();
      vr.link_bytes = counter_difference(*links0, *links1);
      vr.machine_cpu_seconds = machine_busy_seconds() - busy0;
      vr.cpu_seconds = own_cpu_seconds() - cpu0;
      int64_t end = t0;
      sum_reports(*r, &vr, t0, &end);
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      slowest(*r, &vr);
      step(tag + "refreshed");
      if (options_.staged) {
        r = commit_one_by_one(rx);
        if (!r) return r.status();
        vr.pause_seconds = 0;
        slowest(*r, &vr);
        step(tag + "committed");
      }
      for (Json& x : *r) vr.reports.push_back(std::move(x["report"]));
      result_.versions.push_back(std::move(vr));
      r = group_.request(rx, versioned("verify", v), deadline());
      if (!r) return r.status();
      result_.versions.back().verified = true;
      REFIT_RETURN_IF_ERROR(collect_serve_stats(rx));
      std::vector<size_t> all = sources.children;
      all.insert(all.end(), rx.begin(), rx.end());
      REFIT_RETURN_IF_ERROR(sample_resident(v, all));
      result_.versions.back().end_ns = monotonic_ns();
      step(tag + "verified");
    }
    if (!result_.late_joined.empty())
      result_.late_joined += "; versions " + std::to_string(options_.late_join_version) + ".." + std::to_string(last) +
                             " verified on all " + std::to_string(num_receivers) + " receivers";
    wait_for_final_scrape(C);
    return Status::ok();
  }

 private:
  // The version whose refresh loses a rank (RunOptions::kill). The version
  // before it is live everywhere and verified. Returns OK when the run may
  // go on (or end well): with rejoin, once the replacement has joined; without,
  // when a source was killed and every receiver still completed the version
  // (a replica carried it), or when the kill landed after every refresh had
  // returned (kill_missed: the version completed untouched).
  Status refresh_with_kill(int64_t v, Role& sources, Role& receivers, const LocalCoordinator& C) {
    const RunOptions::Kill& k = *options_.kill;
    Role& role = k.receiver ? receivers : sources;
    const size_t victim = role.children[k.rank];
    const double estimate = result_.versions.back().seconds;
    const Clock::time_point kill_at =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(k.fraction * estimate));
    char when[96];
    std::snprintf(when, sizeof when, " at %.3f s (%.2f of the previous refresh's %.3f s)", k.fraction * estimate,
                  k.fraction, estimate);
    const std::string victim_name = group_.name(victim);
    result_.killed = victim_name + when;
    result_.killed_version = v;
    VersionResult vr;
    vr.version = v;
    const std::vector<size_t> rx = active(receivers);
    const int64_t t0 = monotonic_ns();
    int64_t killed_ns = 0;
    auto answers = group_.request_tolerating(rx, versioned("refresh", v, true), refresh_deadline(), victim, kill_at,
                                             &killed_ns);
    REFIT_RETURN_IF_ERROR(no_late_answer(answers, v));
    std::vector<size_t> ok, failed;  // the other receivers, by how their refresh ended
    std::vector<Json> replies;       // ok's
    std::string error, victim_error;  // the first other receiver's error; the victim's
    int64_t last_end = t0;
    for (size_t i = 0; i < answers.size(); ++i) {
      if (answers[i].ok) last_end = std::max(last_end, answers[i].reply.value("end_ns", t0));
      if (rx[i] == victim) {
        if (!answers[i].ok) victim_error = answers[i].error;
      } else if (answers[i].ok) {
        ok.push_back(rx[i]);
        replies.push_back(answers[i].reply);
      } else {
        failed.push_back(rx[i]);
        if (error.empty()) error = answers[i].error;
      }
    }
    result_.kill_refresh_seconds = static_cast<double>(monotonic_ns() - t0) * 1e-9;
    if (k.receiver) joined_[static_cast<size_t>(k.rank)] = false;
    for (size_t r = 0; r < receivers.children.size(); ++r)
      if (std::find(ok.begin(), ok.end(), receivers.children[r]) != ok.end())
        result_.refreshed_without_killed.push_back(static_cast<int32_t>(r));
    if (k.receiver && options_.staged) {
      for (size_t r = 0; r < receivers.children.size(); ++r)
        if (static_cast<int32_t>(r) != k.rank && receivers.places[r].instance == receivers.places[k.rank].instance &&
            std::find(ok.begin(), ok.end(), receivers.children[r]) != ok.end())
          result_.committed_without_killed.push_back(static_cast<int32_t>(r));
    }
    const bool during = !victim_error.empty() || !failed.empty() || killed_ns < last_end;
    if (!during) {
      result_.killed += ", after every refresh had returned";
      result_.kill_missed = true;
      // The answers were in before the kill; the wait for it is no part of the refresh.
      result_.kill_refresh_seconds = static_cast<double>(last_end - t0) * 1e-9;
    }
    const size_t others = ok.size() + failed.size();
    step("version " + std::to_string(v) + ": refreshed, " + victim_name + " killed");
    // The receivers whose refresh returned OK complete the version.
    if (!ok.empty()) {
      int64_t end = t0;
      sum_reports(replies, &vr, t0, &end);
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      slowest(replies, &vr);
      if (options_.staged) {
        auto c = commit_one_by_one(ok);
        if (!c) return c.status();
        vr.pause_seconds = 0;
        slowest(*c, &vr);
        replies = std::move(*c);
      }
      auto c = group_.request(ok, versioned("verify", v), deadline());
      if (!c) return c.status();
      vr.verified = true;
      for (Json& x : replies) vr.reports.push_back(std::move(x["report"]));
    }
    // Staged: the receivers that lost the refresh still serve the version before.
    if (options_.staged && !failed.empty()) {
      bool intact = true;
      std::string broken;
      for (const auto& a : group_.request_tolerating(failed, versioned("verify", v - 1), deadline())) {
        if (a.ok) continue;
        intact = false;
        broken += "\nlive weights: " + a.error;
      }
      result_.live_weights_intact = intact;
      error += broken;
    }
    result_.kill_error = error.empty() ? victim_error : error;
    if (failed.empty()) {  // the version verified on every receiver left
      result_.versions.push_back(std::move(vr));
      REFIT_RETURN_IF_ERROR(collect_serve_stats(ok));
      std::vector<size_t> all;
      for (size_t c : sources.children)
        if (group_.running(c)) all.push_back(c);
      all.insert(all.end(), ok.begin(), ok.end());
      REFIT_RETURN_IF_ERROR(sample_resident(v, all));
    }
    const std::string outcome = " (" + std::to_string(ok.size()) + " of the " + std::to_string(others) +
                                " other receivers' refreshes returned OK)";
    if (!k.rejoin) {
      // A kill that missed the refresh left every receiver with the version,
      // verified (failed is empty); the run is untested, not failed.
      if (!during) return Status::ok();
      if (!k.receiver && failed.empty()) return Status::ok();
      return Status::io_error("version " + std::to_string(v) + ": " + result_.killed + ": " + result_.kill_error +
                              outcome);
    }
    // Rejoin: every receiver left must still be alive, and (staged) those
    // that lost the refresh must still serve the version before it.
    if (result_.live_weights_intact && !*result_.live_weights_intact)
      return Status::io_error("version " + std::to_string(v) + ": " + result_.killed +
                              ": the live weights did not survive: " + result_.kill_error);
    if (!failed.empty()) {
      auto alive = group_.request(failed, Json{{"cmd", "ping"}}, deadline());
      if (!alive) return alive.status().with_context("after " + result_.killed);
    }
    auto became = group_.request(standby_, Json{{"cmd", "become"}}, deadline());
    if (!became) return became.status();
    const size_t replacement = standby_;
    standby_ = SIZE_MAX;
    role.children[static_cast<size_t>(k.rank)] = replacement;
    auto joined = group_.request(replacement,
                                 config_command(k.receiver ? "receiver" : "source", role.places[k.rank], C),
                                 refresh_deadline());
    if (!joined) return joined.status().with_context("the replacement of " + victim_name);
    if (k.receiver) joined_[static_cast<size_t>(k.rank)] = true;
    result_.rejoin_seconds = static_cast<double>(monotonic_ns() - killed_ns) * 1e-9;
    char took[160];
    std::snprintf(took, sizeof took, "a standby process (pid %lld) took %s %d, joined %.3f s after the kill (%lld join attempts)",
                  static_cast<long long>(became->value("pid", int64_t{0})), k.receiver ? "receiver" : "source", k.rank,
                  result_.rejoin_seconds, static_cast<long long>(joined->value("join_attempts", int64_t{0})));
    result_.rejoined = took;
    step("version " + std::to_string(v) + ": " + group_.name(replacement) + " joined");
    return Status::ok();
  }

  // A receiver that did not answer a tolerated refresh by its deadline
  // (RunOptions::refresh_step_timeout) broke the library's bound on a
  // failing refresh; asking it anything more would read that refresh's late
  // answer as the next command's, so the run fails here.
  Status no_late_answer(const std::vector<ProcessGroup::Answer>& answers, int64_t v) const {
    std::string late;
    for (const auto& a : answers)
      if (a.late) late += (late.empty() ? "" : "; ") + a.error;
    if (late.empty()) return Status::ok();
    const auto bound = std::chrono::duration<double>(options_.refresh_step_timeout()).count();
    char why[200];
    std::snprintf(why, sizeof why,
                  ": the refresh of version %lld outlasted the library's bound of %.1f s (refresh timeout, two "
                  "coordinator calls, the lease's release)",
                  static_cast<long long>(v), bound);
    return Status::timeout(late + why);
  }

  // The version whose refresh loses a host's link for a while
  // (RunOptions::partition). The version before it is live everywhere and
  // verified. The receivers whose refresh returned OK complete it (commit,
  // staged) and are verified; staged, those whose refresh failed must still
  // hold the version before. Returns OK when the run may go on to the last
  // version, which must verify on every receiver.
  Status refresh_with_partition(int64_t v, Role& sources, Role& receivers) {
    const RunOptions::Partition& p = *options_.partition;
    const double estimate = result_.versions.back().seconds;
    const double after = p.fraction * estimate;
    char when[160];
    std::snprintf(when, sizeof when, "host %s's link down at %.3f s (%.2f of the previous refresh's %.3f s), %s",
                  p.host.c_str(), after, p.fraction, estimate,
                  p.seconds > 0 ? ("for " + std::to_string(p.seconds) + " s").c_str() : "until the refresh ended");
    result_.partitioned = when;
    result_.partitioned_version = v;
    const std::vector<size_t> rx = active(receivers);
    // The link goes down and (with seconds) up again on a thread of its own,
    // while this one waits for the receivers' answers.
    Status link_status;
    std::mutex link_mu;
    std::condition_variable link_cv;
    bool refresh_over = false, link_down = false, cut = false;
    const Clock::time_point down_at =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(after));
    std::thread cutter([&] {
      std::unique_lock<std::mutex> lock(link_mu);
      if (link_cv.wait_until(lock, down_at, [&] { return refresh_over; })) return;  // over before the cut
      lock.unlock();
      Status down = p.set_link(false);
      lock.lock();
      link_down = down.is_ok();
      // A refresh that ended while the link was going down was not cut.
      cut = link_down && !refresh_over;
      if (!down.is_ok()) link_status = down;
      if (p.seconds > 0 && link_down) {
        link_cv.wait_for(lock, std::chrono::duration<double>(p.seconds), [] { return false; });
        lock.unlock();
        Status up = p.set_link(true);
        lock.lock();
        if (!up.is_ok() && link_status.is_ok()) link_status = up;
        link_down = !up.is_ok();
      }
    });
    auto links0 = link_counters();
    const int64_t t0 = monotonic_ns();
    auto answers = group_.request_tolerating(rx, versioned("refresh", v, true), refresh_deadline());
    result_.partition_refresh_seconds = static_cast<double>(monotonic_ns() - t0) * 1e-9;
    {
      std::lock_guard<std::mutex> lock(link_mu);
      refresh_over = true;
    }
    link_cv.notify_all();
    cutter.join();
    if (link_down) {  // "until the refresh ended", or a timed partition whose up failed
      Status up = p.set_link(true);
      if (!up.is_ok() && link_status.is_ok()) link_status = up;
    }
    if (!link_status.is_ok()) return link_status.with_context("partition");
    REFIT_RETURN_IF_ERROR(no_late_answer(answers, v));
    if (!cut) {
      result_.partitioned += "; the refresh ended before the cut";
      result_.partition_missed = true;
    }
    VersionResult vr;
    vr.version = v;
    auto links1 = link_counters();
    if (links0 && links1) vr.link_bytes = counter_difference(*links0, *links1);
    std::vector<size_t> ok, failed;
    std::vector<Json> replies;
    for (size_t i = 0; i < answers.size(); ++i) {
      if (answers[i].ok) {
        ok.push_back(rx[i]);
        replies.push_back(answers[i].reply);
      } else {
        failed.push_back(rx[i]);
        if (result_.partition_error.empty()) result_.partition_error = group_.name(rx[i]) + ": " + answers[i].error;
      }
    }
    for (size_t r = 0; r < receivers.children.size(); ++r)
      if (std::find(failed.begin(), failed.end(), receivers.children[r]) != failed.end())
        result_.partition_failed.push_back(static_cast<int32_t>(r));
    step("version " + std::to_string(v) + ": refreshed, " + result_.partitioned);
    if (!p.holds_sources) {
      // Only the partitioned host's receivers lost their way to the sources.
      for (int32_t r : result_.partition_failed) {
        if (std::find(p.receivers.begin(), p.receivers.end(), r) != p.receivers.end()) continue;
        return Status::io_error("version " + std::to_string(v) + ": " + result_.partitioned + ": receiver " +
                                std::to_string(r) + ", on another host, failed too: " + result_.partition_error);
      }
    }
    if (!ok.empty()) {
      int64_t end = t0;
      sum_reports(replies, &vr, t0, &end);
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      slowest(replies, &vr);
      if (options_.staged) {
        auto c = commit_one_by_one(ok);
        if (!c) return c.status();
        vr.pause_seconds = 0;
        slowest(*c, &vr);
        replies = std::move(*c);
      }
      auto c = group_.request(ok, versioned("verify", v), deadline());
      if (!c) return c.status();
      vr.verified = true;
      for (Json& x : replies) vr.reports.push_back(std::move(x["report"]));
    }
    if (options_.staged && !failed.empty()) {
      bool intact = true;
      for (const auto& a : group_.request_tolerating(failed, versioned("verify", v - 1), deadline())) {
        if (a.ok) continue;
        intact = false;
        result_.partition_error += "\nlive weights: " + a.error;
      }
      result_.partition_live_intact = intact;
      if (!intact) return Status::io_error("version " + std::to_string(v) + ": " + result_.partitioned +
                                           ": the live weights did not survive: " + result_.partition_error);
    }
    if (failed.empty()) result_.versions.push_back(std::move(vr));
    (void)sources;
    return Status::ok();
  }

  Status run_broadcast(int64_t first) {
    derived_.push_back(std::make_unique<Layout>(gather_layout(layout_)));
    const Layout* G = derived_.back().get();
    derived_.push_back(std::make_unique<Layout>(spread_layout(layout_)));
    const Layout* P = derived_.back().get();
    total_ = 3 + options_.versions * 6;

    Role sources, gatherer_rx, gatherer_tx, receivers;
    REFIT_RETURN_IF_ERROR(spawn_sources(layout_, &sources));
    AgentSpec gspec;
    gspec.receiver_layout = G;
    gspec.receiver_rank = 0;
    gspec.source_layout = P;
    gspec.source_rank = 0;
    auto g = spawn("gatherer", gspec);
    if (!g) return g.status();
    gatherer_rx.children = {*g};
    const std::string gatherer_device = options_.hosts ? options_.hosts->gatherer_device : "";
    gatherer_rx.places = {{true, 0, 0, 0, gatherer_device}};
    gatherer_tx.children = {*g};
    gatherer_tx.places = {{false, 0, 0, 0, gatherer_device}};
    for (int32_t r = 0; r < P->num_ranks(Side::kReceiver); ++r) {
      AgentSpec spec;
      spec.receiver_layout = P;
      spec.receiver_rank = r;
      spec.final_layout = &layout_;
      spec.final_rank = r;
      auto c = spawn("receiver " + std::to_string(r), spec);
      if (!c) return c.status();
      receivers.children.push_back(*c);
      receivers.places.push_back({true, r, P->receivers[r].domain, P->receivers[r].instance, device_of(true, r)});
    }
    step("started " + std::to_string(group_.size()) + " processes");
    auto c1 = coordinator();
    if (!c1) return c1.status();
    auto c2 = coordinator();
    if (!c2) return c2.status();
    const LocalCoordinator& C1 = **c1;
    const LocalCoordinator& C2 = **c2;
    coordinators_.push_back(std::move(*c1));
    coordinators_.push_back(std::move(*c2));

    auto r = group_.request_each(sources.children, configs(sources, "source", C1), deadline());
    if (!r) return r.status();
    r = group_.request_each(gatherer_rx.children, configs(gatherer_rx, "receiver", C1), deadline());
    if (!r) return r.status();
    step("stage 1 joined");
    r = group_.request_each(gatherer_tx.children, configs(gatherer_tx, "source", C2), deadline());
    if (!r) return r.status();
    r = group_.request_each(receivers.children, configs(receivers, "receiver", C2), deadline());
    if (!r) return r.status();
    step("stage 2 joined");

    for (int64_t v = first; v < first + options_.versions; ++v) {
      VersionResult vr;
      vr.version = v;
      const std::string tag = "version " + std::to_string(v) + ": ";
      if (v > first) {
        r = group_.request(sources.children, versioned("drain", v - 1, true), refresh_deadline());
        if (!r) return r.status();
        r = group_.request(gatherer_tx.children, versioned("drain", v - 1, true), refresh_deadline());
        if (!r) return r.status();
      }
      r = group_.request(sources.children, versioned("fill", v), deadline());
      if (!r) return r.status();
      r = group_.request(sources.children, versioned("publish", v), deadline());
      if (!r) return r.status();
      step(tag + "published");
      auto links0 = link_counters();
      if (!links0) return links0.status();
      const double cpu0 = own_cpu_seconds(), busy0 = machine_busy_seconds();
      const int64_t t0 = monotonic_ns();
      int64_t end = t0;
      r = group_.request(gatherer_rx.children, versioned("refresh", v, true), refresh_deadline());
      if (!r) return r.status();
      sum_reports(*r, &vr, t0, &end);
      step(tag + "gathered");
      r = group_.request(gatherer_tx.children, versioned("publish", v), deadline());
      if (!r) return r.status();
      r = group_.request(receivers.children, versioned("refresh", v, true), refresh_deadline());
      if (!r) return r.status();
      sum_reports(*r, &vr, t0, &end);
      slowest(*r, &vr);
      for (Json& x : *r) vr.reports.push_back(std::move(x["report"]));
      auto links1 = link_counters();
      if (!links1) return links1.status();
      vr.link_bytes = counter_difference(*links0, *links1);
      step(tag + "broadcast");
      r = group_.request(receivers.children, versioned("unpack", v), deadline());
      if (!r) return r.status();
      for (const Json& x : *r) {
        vr.unpack_seconds = std::max(vr.unpack_seconds, x.value("seconds", 0.0));
        end = std::max(end, x.value("end_ns", end));
      }
      vr.pause_seconds = vr.unpack_seconds;  // the served (final) buffers are written only here
      vr.machine_cpu_seconds = machine_busy_seconds() - busy0;
      vr.cpu_seconds = own_cpu_seconds() - cpu0;
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      step(tag + "copied out");
      result_.versions.push_back(std::move(vr));
      r = group_.request(receivers.children, versioned("verify", v), deadline());
      if (!r) return r.status();
      result_.versions.back().verified = true;
      REFIT_RETURN_IF_ERROR(collect_serve_stats(receivers.children));
      std::vector<size_t> all = sources.children;
      all.push_back(gatherer_rx.children[0]);
      all.insert(all.end(), receivers.children.begin(), receivers.children.end());
      REFIT_RETURN_IF_ERROR(sample_resident(v, all));
      step(tag + "verified");
    }
    return Status::ok();
  }

  const Layout& layout_;
  void take_turn() {
    if (turns_ != nullptr) turns_->wait(turn_id_);
  }
  void pass_turn() {
    if (turns_ != nullptr) turns_->pass(turn_id_);
  }

  Strategy strategy_;
  RunOptions options_;  // a copy: broadcast clears `staged`
  Turns* turns_ = nullptr;  // interleaved with other runs, or not
  size_t turn_id_ = 0;
  // What spawn_all() set up for run_versions().
  const Layout* L_ = nullptr;
  Role sources_, receivers_;
  int32_t late_instance_ = -1;
  int64_t first_ = 1;
  int64_t kill_version_ = 0;
  RunResult result_;
  int done_ = 0, total_ = 1;
  std::vector<std::unique_ptr<Layout>> derived_;
  std::vector<std::unique_ptr<AgentSpec>> specs_;
  std::vector<bool> joined_;      // by receiver rank: joined and not killed
  size_t standby_ = SIZE_MAX;     // the standby process, until it takes a rank
  size_t churn_next_ = 0;         // the receiver rank churn takes next
  std::map<int64_t, ResidentSample> resident_;  // by child; -1: this process
  std::map<size_t, std::pair<int64_t, int64_t>> serve_counts_;  // by child: reads, mixed
  // Destroyed after the group's children are gone (run() clears them last).
  std::vector<std::unique_ptr<LocalCoordinator>> coordinators_;
  ProcessGroup group_;
};

}  // namespace

std::chrono::milliseconds RunOptions::refresh_step_timeout() const {
  // kReleaseGrace (500 ms) of the refresh session, and the answer's way back.
  constexpr std::chrono::milliseconds kRelease{1000};
  return std::max(step_timeout, refresh_timeout + 2 * coordinator_call_timeout() + kRelease);
}

bool RunResult::verified() const {
  if (!status.is_ok() || versions.empty()) return false;
  for (const VersionResult& v : versions)
    if (!v.verified) return false;
  return true;
}

namespace {
template <typename Field>
double median_of(const std::vector<VersionResult>& versions, Field field) {
  if (versions.empty()) return 0;
  std::vector<double> s;
  for (const VersionResult& v : versions) s.push_back(v.*field);
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}
}  // namespace

double RunResult::median_seconds() const { return median_of(versions, &VersionResult::seconds); }
double RunResult::median_refresh_seconds() const { return median_of(versions, &VersionResult::refresh_seconds); }
double RunResult::median_pause_seconds() const { return median_of(versions, &VersionResult::pause_seconds); }
double RunResult::median_publish_seconds() const { return median_of(versions, &VersionResult::publish_seconds); }
double RunResult::median_cpu_seconds() const { return median_of(versions, &VersionResult::cpu_seconds); }
double RunResult::median_machine_cpu_seconds() const {
  return median_of(versions, &VersionResult::machine_cpu_seconds);
}

double RunResult::median_rejoin_seconds() const {
  std::vector<VersionResult> churned;
  for (const VersionResult& v : versions)
    if (!v.rejoined.empty()) churned.push_back(v);
  return median_of(churned, &VersionResult::rejoin_seconds);
}

double RunResult::max_rejoin_seconds() const {
  double m = 0;
  for (const VersionResult& v : versions) m = std::max(m, v.rejoin_seconds);
  return m;
}

int64_t RunResult::resident_first_kib() const {
  int64_t sum = 0;
  for (const ResidentSample& r : resident) sum += r.first_kib;
  return sum;
}

int64_t RunResult::resident_last_kib() const {
  int64_t sum = 0;
  for (const ResidentSample& r : resident) sum += r.last_kib;
  return sum;
}

int64_t RunResult::heap_first_kib() const {
  int64_t sum = 0;
  for (const ResidentSample& r : resident) sum += r.first_heap_kib;
  return sum;
}

int64_t RunResult::heap_last_kib() const {
  int64_t sum = 0;
  for (const ResidentSample& r : resident) sum += r.last_heap_kib;
  return sum;
}

int64_t RunResult::resident_max_growth_kib(std::string* process) const {
  int64_t most = 0;
  bool any = false;
  for (const ResidentSample& r : resident) {
    if (any && r.last_kib - r.first_kib <= most) continue;
    most = r.last_kib - r.first_kib;
    any = true;
    if (process != nullptr) *process = r.process;
  }
  return most;
}

RunResult run_refreshes(const Layout& layout, Strategy strategy, const RunOptions& options) {
  return Runner(layout, strategy, options).run();
}

std::vector<RunResult> run_interleaved(const Layout& layout, const std::vector<Strategy>& strategies,
                                       const std::vector<RunOptions>& options) {
  const size_t n = strategies.size();
  std::vector<RunResult> results(n);
  if (options.size() != n) {
    for (size_t i = 0; i < n; ++i) {
      results[i].strategy = strategies[i];
      results[i].status = Status::invalid("run_interleaved: one RunOptions per strategy");
    }
    return results;
  }
  Turns turns(n);
  std::vector<std::unique_ptr<Runner>> runners;
  std::vector<Status> spawned;
  for (size_t i = 0; i < n; ++i) {
    runners.push_back(std::make_unique<Runner>(layout, strategies[i], options[i]));
    runners[i]->take_turns(&turns, i);
    Status st;
    if (strategies[i] == Strategy::kBroadcast)
      st = Status::invalid("broadcast forks its second stage while it runs: it cannot be interleaved");
    else if (options[i].kill || options[i].churn > 0 || options[i].late_join_version != 0)
      st = Status::invalid("interleaved runs are steady refreshes: no kill, churn or late join");
    else
      st = runners[i]->spawn_all();  // every fork before the first thread
    spawned.push_back(st);
  }
  for (size_t i = 0; i < n; ++i)
    if (!spawned[i].is_ok()) results[i] = runners[i]->finish(spawned[i]);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    if (!spawned[i].is_ok()) continue;
    threads.emplace_back([&, i] { results[i] = runners[i]->finish(runners[i]->run_versions()); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

std::string agent_config(const AgentPlace& place, const std::string& coordinator_address, const std::string& token_file,
                         const RunOptions& options) {
  ordered_json c = ordered_json::object();
  c["rank"] = place.rank;
  c["domain"] = place.domain;
  if (place.receiver) c["instance"] = place.instance;
  c["coordinator"] = {{"address", coordinator_address}, {"token_file", token_file},
                      {"timeout_ms", options.coordinator_call_timeout().count()}};
  ordered_json net = {{"transports", options.network_transports}};
  if (!place.device.empty()) net["devices"] = {place.device};
  else if (!options.network_devices.empty()) net["devices"] = options.network_devices;
  c["network"] = std::move(net);
  if (place.receiver) {
    c["local"] = {{"transports", options.local_transports}};
    if (!options.local_fabric.empty()) c["local"]["fabric"] = options.local_fabric;
  }
  if (place.receiver && options.staged) c["mode"] = "staged";
  if (place.receiver && !options.trace_dir.empty()) {
    // A rank that leaves and joins again is a new agent: a file of its own.
    static std::atomic<int> agents{0};
    c["trace"] = options.trace_dir + "/receiver-" + std::to_string(place.rank) + "-" + std::to_string(agents++) + ".json";
  }
  if (place.receiver && !options.gather) c["gather_below_bytes"] = 0;
  if (place.receiver && options.converts) c["weight_block_size"] = options.weight_block_size;
  if (options.heartbeat_timeout.count() > 0)
    c["heartbeat_ms"] = std::max<int64_t>(100, options.heartbeat_timeout.count() / 4);
  c["log_level"] = options.log_level;
  for (const auto& [key, value] : (place.receiver ? options.receiver_config : options.source_config).items()) {
    c[key] = value;
  }
  return c.dump();
}

}  // namespace refit::bench
