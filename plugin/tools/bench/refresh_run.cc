#include "plugin/tools/bench/refresh_run.h"

#include <algorithm>
#include <cstdio>
#include <memory>

#include "plugin/tools/bench/agent.h"
#include "plugin/tools/bench/local_coordinator.h"
#include "plugin/tools/bench/process_group.h"
#include "plugin/tools/bench/strategy_layouts.h"

namespace refit::bench {

namespace {

using ordered_json = nlohmann::ordered_json;

// The ranks of one role in a ProcessGroup, and their places in the layout.
struct Role {
  std::vector<size_t> children;
  std::vector<AgentPlace> places;
};

class Runner {
 public:
  Runner(const Layout& layout, Strategy strategy, const RunOptions& options)
      : layout_(layout), strategy_(strategy), options_(options) {
    if (strategy == Strategy::kBroadcast) {
      options_.staged = false;
      options_.kill.reset();
    }
    result_.strategy = strategy;
    result_.staged = options_.staged;
  }

  RunResult run() {
    Status s = run_all();
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
    group_.kill_all();
    coordinators_.clear();
    return std::move(result_);
  }

 private:
  Clock::time_point deadline() const { return Clock::now() + options_.step_timeout; }
  // Steps that pass refresh_timeout to the library wait a little longer, so
  // that the library's own error (which names the cause) arrives first.
  Clock::time_point refresh_deadline() const {
    return Clock::now() + std::max<Clock::duration>(options_.step_timeout, options_.refresh_timeout + std::chrono::seconds(5));
  }

  void step(const std::string& what) {
    ++done_;
    if (options_.progress) options_.progress(what, done_, total_);
  }

  Result<size_t> spawn(const std::string& name, AgentSpec spec) {
    spec.serve_check = options_.serve_check && spec.receiver_layout != nullptr && spec.source_layout == nullptr;
    spec.sample_every = options_.sample_every;
    specs_.push_back(std::make_unique<AgentSpec>(spec));
    const AgentSpec* p = specs_.back().get();
    return group_.spawn(name, [p](Channel& ch) { return run_agent(*p, ch); });
  }

  Status spawn_sources(const Layout& layout, Role* role) {
    for (int32_t s = 0; s < layout.num_ranks(Side::kSource); ++s) {
      AgentSpec spec;
      spec.source_layout = &layout;
      spec.source_rank = s;
      auto c = spawn("source " + std::to_string(s), spec);
      if (!c) return c.status();
      role->children.push_back(*c);
      role->places.push_back({false, s, layout.sources[s].domain, 0});
    }
    return Status::ok();
  }

  std::vector<Json> configs(const Role& role, const std::string& cmd, const LocalCoordinator& coordinator) const {
    std::vector<Json> out;
    for (const AgentPlace& p : role.places)
      out.push_back(Json{{"cmd", cmd}, {"config", agent_config(p, coordinator.address(), coordinator.token_file(), options_)}});
    return out;
  }

  Result<std::unique_ptr<LocalCoordinator>> coordinator() {
    auto c = LocalCoordinator::start();
    if (!c) return c.status();
    return std::move(*c);
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

  // Sums the serving readers' counts into the result.
  Status collect_serve_stats(const Role& receivers) {
    if (!options_.serve_check) return Status::ok();
    auto r = group_.request(receivers.children, Json{{"cmd", "serve_stats"}}, deadline());
    if (!r) return r.status();
    result_.serve_reads = 0;
    result_.mixed_version_reads = 0;
    for (const Json& x : *r) {
      result_.serve_reads += x.value("reads", int64_t{0});
      result_.mixed_version_reads += x.value("mixed_version_reads", int64_t{0});
    }
    return Status::ok();
  }

  Status run_all() {
    if (options_.versions < 1) return Status::invalid("versions must be at least 1");
    if (options_.kill && options_.versions < 2)
      return Status::invalid("kill needs at least 2 versions: the one before says when to kill");
    const int64_t first = options_.first_version;
    if (strategy_ == Strategy::kBroadcast) return run_broadcast(first);

    // Fork every rank first, while this process has no threads.
    const Layout* L = &layout_;
    if (strategy_ == Strategy::kNoDedup) {
      derived_.push_back(std::make_unique<Layout>(no_dedup_layout(layout_)));
      L = derived_.back().get();
    }
    Role sources, receivers;
    total_ = 3 + options_.versions * (options_.staged ? 5 : 4);
    REFIT_RETURN_IF_ERROR(spawn_sources(*L, &sources));
    for (int32_t r = 0; r < L->num_ranks(Side::kReceiver); ++r) {
      AgentSpec spec;
      spec.receiver_layout = L;
      spec.receiver_rank = r;
      auto c = spawn("receiver " + std::to_string(r), spec);
      if (!c) return c.status();
      receivers.children.push_back(*c);
      receivers.places.push_back({true, r, L->receivers[r].domain, L->receivers[r].instance});
    }
    step("started " + std::to_string(group_.size()) + " processes");
    auto coord = coordinator();
    if (!coord) return coord.status();
    const LocalCoordinator& C = **coord;
    coordinators_.push_back(std::move(*coord));

    auto r = group_.request_each(sources.children, configs(sources, "source", C), deadline());
    if (!r) return r.status();
    step("sources joined");
    r = group_.request_each(receivers.children, configs(receivers, "receiver", C), deadline());
    if (!r) return r.status();
    step("receivers joined");

    for (int64_t v = first; v < first + options_.versions; ++v) {
      VersionResult vr;
      vr.version = v;
      const std::string tag = "version " + std::to_string(v) + ": ";
      if (v > first) {
        r = group_.request(sources.children, versioned("drain", v - 1, true), refresh_deadline());
        if (!r) return r.status();
      }
      r = group_.request(sources.children, versioned("fill", v), deadline());
      if (!r) return r.status();
      step(tag + "filled");
      r = group_.request(sources.children, versioned("publish", v), deadline());
      if (!r) return r.status();
      step(tag + "published");
      if (options_.serve_check && !options_.staged) {  // the servers pause before any peer may push
        r = group_.request(receivers.children, Json{{"cmd", "pause"}}, deadline());
        if (!r) return r.status();
      }
      if (options_.kill && v == first + options_.versions - 1 && v > first)
        return refresh_with_kill(v, sources, receivers, *L);
      const int64_t t0 = monotonic_ns();
      r = group_.request(receivers.children, versioned("refresh", v, true), refresh_deadline());
      if (!r) return r.status();
      int64_t end = t0;
      sum_reports(*r, &vr, t0, &end);
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      slowest(*r, &vr);
      step(tag + "refreshed");
      if (options_.staged) {
        r = group_.request(receivers.children, Json{{"cmd", "commit"}}, deadline());
        if (!r) return r.status();
        vr.pause_seconds = 0;
        slowest(*r, &vr);
        step(tag + "committed");
      }
      for (Json& x : *r) vr.reports.push_back(std::move(x["report"]));
      result_.versions.push_back(std::move(vr));
      r = group_.request(receivers.children, versioned("verify", v), deadline());
      if (!r) return r.status();
      result_.versions.back().verified = true;
      REFIT_RETURN_IF_ERROR(collect_serve_stats(receivers));
      step(tag + "verified");
    }
    return Status::ok();
  }

  // The last version, whose refresh loses a rank (RunOptions::kill). The
  // version before it is live everywhere and verified.
  Status refresh_with_kill(int64_t v, const Role& sources, const Role& receivers, const Layout& L) {
    const RunOptions::Kill& k = *options_.kill;
    const Role& role = k.receiver ? receivers : sources;
    if (k.rank < 0 || static_cast<size_t>(k.rank) >= role.children.size())
      return Status::invalid(std::string("kill: there is no ") + (k.receiver ? "receiver " : "source ") +
                             std::to_string(k.rank) + " (" + std::to_string(role.children.size()) + " of them)");
    const size_t victim = role.children[k.rank];
    const double estimate = result_.versions.back().seconds;
    const Clock::time_point kill_at =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(k.fraction * estimate));
    char when[96];
    std::snprintf(when, sizeof when, " at %.3f s (%.2f of the previous refresh's %.3f s)", k.fraction * estimate,
                  k.fraction, estimate);
    result_.killed = group_.name(victim) + when;
    VersionResult vr;
    vr.version = v;
    const int64_t t0 = monotonic_ns();
    auto answers = group_.request_tolerating(receivers.children, versioned("refresh", v, true), refresh_deadline(),
                                             victim, kill_at);
    std::vector<size_t> survivors, lost;  // lost: survivors that must still hold v - 1
    std::vector<Json> replies;
    std::string error, victim_error;  // the first survivor's error; the victim's
    size_t survivors_ok = 0;
    for (size_t i = 0; i < answers.size(); ++i) {
      const size_t child = receivers.children[i];
      if (child != victim) survivors.push_back(child);
      if (answers[i].ok) {
        replies.push_back(answers[i].reply);
        if (child != victim) ++survivors_ok;
      } else if (child == victim) {
        victim_error = answers[i].error;
      } else if (error.empty()) {
        error = answers[i].error;
      }
    }
    if (error.empty()) error = victim_error;
    error += " (" + std::to_string(survivors_ok) + " of the " + std::to_string(survivors.size()) +
             " other receivers' refreshes returned OK" + (options_.staged ? "; none was told to commit)" : ")");
    step("version " + std::to_string(v) + ": refreshed, " + group_.name(victim) + " killed");
    if (victim_error.empty() && survivors_ok == survivors.size()) {
      // Every refresh returned before the kill: finish the version on the survivors.
      int64_t end = t0;
      sum_reports(replies, &vr, t0, &end);
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      slowest(replies, &vr);
      if (options_.staged) {
        auto c = group_.request(survivors, Json{{"cmd", "commit"}}, deadline());
        if (!c) return c.status();
        vr.pause_seconds = 0;
        slowest(*c, &vr);
        replies = std::move(*c);
      }
      for (Json& x : replies) vr.reports.push_back(std::move(x["report"]));
      result_.versions.push_back(std::move(vr));
      auto c = group_.request(survivors, versioned("verify", v), deadline());
      if (!c) return c.status();
      result_.versions.back().verified = true;
      return Status::io_error(result_.killed + ", after every refresh of version " + std::to_string(v) +
                              " had returned; the run stops here");
    }
    if (options_.staged) {
      const int32_t instance = k.receiver ? L.receivers[k.rank].instance : -1;
      for (size_t i = 0; i < receivers.children.size(); ++i)
        if (receivers.children[i] != victim && (instance < 0 || receivers.places[i].instance == instance))
          lost.push_back(receivers.children[i]);
      bool intact = true;
      for (const auto& a : group_.request_tolerating(lost, versioned("verify", v - 1), deadline())) {
        if (a.ok) continue;
        intact = false;
        error += "\nlive weights: " + a.error;
      }
      result_.live_weights_intact = intact;
    }
    return Status::io_error("version " + std::to_string(v) + ": " + result_.killed + ": " + error);
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
    gatherer_rx.places = {{true, 0, 0, 0}};
    gatherer_tx.children = {*g};
    gatherer_tx.places = {{false, 0, 0, 0}};
    for (int32_t r = 0; r < P->num_ranks(Side::kReceiver); ++r) {
      AgentSpec spec;
      spec.receiver_layout = P;
      spec.receiver_rank = r;
      spec.final_layout = &layout_;
      spec.final_rank = r;
      auto c = spawn("receiver " + std::to_string(r), spec);
      if (!c) return c.status();
      receivers.children.push_back(*c);
      receivers.places.push_back({true, r, P->receivers[r].domain, P->receivers[r].instance});
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
      step(tag + "broadcast");
      r = group_.request(receivers.children, versioned("unpack", v), deadline());
      if (!r) return r.status();
      for (const Json& x : *r) {
        vr.unpack_seconds = std::max(vr.unpack_seconds, x.value("seconds", 0.0));
        end = std::max(end, x.value("end_ns", end));
      }
      vr.pause_seconds = vr.unpack_seconds;  // the served (final) buffers are written only here
      vr.seconds = static_cast<double>(end - t0) * 1e-9;
      step(tag + "copied out");
      result_.versions.push_back(std::move(vr));
      r = group_.request(receivers.children, versioned("verify", v), deadline());
      if (!r) return r.status();
      result_.versions.back().verified = true;
      REFIT_RETURN_IF_ERROR(collect_serve_stats(receivers));
      step(tag + "verified");
    }
    return Status::ok();
  }

  const Layout& layout_;
  Strategy strategy_;
  RunOptions options_;  // a copy: broadcast clears `staged`
  RunResult result_;
  int done_ = 0, total_ = 1;
  std::vector<std::unique_ptr<Layout>> derived_;
  std::vector<std::unique_ptr<AgentSpec>> specs_;
  // Destroyed after the group's children are gone (run() clears them last).
  std::vector<std::unique_ptr<LocalCoordinator>> coordinators_;
  ProcessGroup group_;
};

}  // namespace

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

RunResult run_refreshes(const Layout& layout, Strategy strategy, const RunOptions& options) {
  return Runner(layout, strategy, options).run();
}

std::string agent_config(const AgentPlace& place, const std::string& coordinator_address, const std::string& token_file,
                         const RunOptions& options) {
  ordered_json c = ordered_json::object();
  c["rank"] = place.rank;
  c["domain"] = place.domain;
  if (place.receiver) c["instance"] = place.instance;
  c["coordinator"] = {{"address", coordinator_address}, {"token_file", token_file},
                      {"timeout_ms", options.step_timeout.count()}};
  ordered_json net = {{"transports", options.network_transports}};
  if (!options.network_devices.empty()) net["devices"] = options.network_devices;
  c["network"] = std::move(net);
  if (place.receiver) c["local"] = {{"transports", options.local_transports}};
  if (place.receiver && options.staged) c["mode"] = "staged";
  c["log_level"] = options.log_level;
  return c.dump();
}

}  // namespace refit::bench
