#include "transport/control/fleet_metrics.h"

#include "transport/control/coordinator.h"

namespace refit::control {

namespace {

using Type = MetricsRegistry::Type;

// Refreshes take from milliseconds (a small model on one host) to minutes
// (hundreds of GB over a slow network); a staged commit's pause is a local
// copy or a pointer swap, from microseconds to seconds.
const std::vector<double> kRefreshBuckets{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
const std::vector<double> kPauseBuckets{0.0001, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};

}  // namespace

FleetMetrics::FleetMetrics() {
  registry_.declare("refit_members", Type::kGauge, "Live members of the job, by role.");
  registry_.declare("refit_published_version", Type::kGauge,
                    "The newest version every source rank has published (0: none yet).");
  registry_.declare("refit_connections", Type::kGauge, "Open control-plane connections.");
  registry_.declare("refit_connections_refused_total", Type::kCounter,
                    "Connections closed for a failed authentication or a protocol violation.");
  registry_.declare("refit_plans_total", Type::kCounter, "Plans made (one per membership asked for a plan).");
  registry_.declare("refit_buffered_bytes", Type::kGauge,
                    "Queued replies and partly read requests of all connections together.");
  registry_.declare("refit_refresh_seconds", Type::kHistogram,
                    "Receiver ranks' refreshes, from the call to its return, by mode and outcome.", kRefreshBuckets);
  registry_.declare("refit_pause_seconds", Type::kHistogram,
                    "Staged receiver ranks' commits: how long each paused its server.", kPauseBuckets);
  registry_.declare("refit_refresh_bytes_total", Type::kCounter,
                    "Bytes the receiver ranks' refreshes moved: network (GETs from sources) or local (within a "
                    "domain).");
  registry_.declare("refit_refresh_failures_total", Type::kCounter,
                    "Receiver ranks' refreshes and commits that failed, by reason.");
  registry_.declare("refit_aborts_total", Type::kCounter,
                    "Staged receiver ranks' refreshes that ended because their instance aborted the version.");
  registry_.declare("refit_retries_total", Type::kCounter,
                    "Attempts of receiver ranks' refreshes that failed and were tried again.");
  registry_.declare("refit_instance_version", Type::kGauge,
                    "The version each instance last refreshed (direct) or committed (staged) to.");
  // Counters start at zero, visible before the first refresh (a rate over
  // a counter that appears late misses its first increase).
  for (const char* kind : {"network", "local"}) registry_.add("refit_refresh_bytes_total", {{"kind", kind}}, 0);
  registry_.add("refit_aborts_total", {}, 0);
  registry_.add("refit_retries_total", {}, 0);
}

const char* FleetMetrics::reason_label(Reason reason) {
  return reason == Reason::kNone ? "other" : reason_name(reason);
}

void FleetMetrics::record(const RefreshSummary& s, int32_t instance) {
  using Event = RefreshSummary::Event;
  using Outcome = RefreshSummary::Outcome;
  const bool ok = s.outcome == Outcome::kOk;
  if (!ok) registry_.add("refit_refresh_failures_total", {{"reason", reason_label(s.reason)}});
  if (s.event == Event::kCommit) {
    if (ok) registry_.observe("refit_pause_seconds", {}, s.seconds);
  } else {
    registry_.observe("refit_refresh_seconds",
                      {{"mode", s.staged ? "staged" : "direct"}, {"outcome", outcome_name(s.outcome)}}, s.seconds);
    registry_.add("refit_refresh_bytes_total", {{"kind", "network"}}, static_cast<double>(s.network_bytes));
    registry_.add("refit_refresh_bytes_total", {{"kind", "local"}}, static_cast<double>(s.local_bytes));
    registry_.add("refit_retries_total", {}, s.retries);
    if (s.outcome == Outcome::kAborted) registry_.add("refit_aborts_total", {});
  }
  // A direct refresh serves the version once it returns; a staged one once
  // committed.
  if (ok && (s.event == Event::kCommit || !s.staged) && s.version > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    instances_.insert(instance);
    registry_.set("refit_instance_version", {{"instance", std::to_string(instance)}}, static_cast<double>(s.version));
  }
}

void FleetMetrics::update(const CoordinatorStats& st) {
  registry_.set("refit_members", {{"role", "source"}}, static_cast<double>(st.sources));
  registry_.set("refit_members", {{"role", "receiver"}}, static_cast<double>(st.receivers));
  registry_.set("refit_published_version", {}, static_cast<double>(st.version));
  registry_.set("refit_connections", {}, static_cast<double>(st.connections));
  // Counters mirror the coordinator's own monotonic counts.
  registry_.add("refit_connections_refused_total", {},
                static_cast<double>(st.refused) - registry_.value("refit_connections_refused_total", {}));
  registry_.add("refit_plans_total", {}, static_cast<double>(st.plans) - registry_.value("refit_plans_total", {}));
  registry_.set("refit_buffered_bytes", {}, static_cast<double>(st.buffered_bytes));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = instances_.begin(); it != instances_.end();) {
    if (st.instances.count(*it)) {
      ++it;
      continue;
    }
    registry_.erase("refit_instance_version", {{"instance", std::to_string(*it)}});
    it = instances_.erase(it);
  }
}

Result<std::unique_ptr<MetricsServer>> serve_metrics(const Coordinator& coordinator,
                                                     std::shared_ptr<FleetMetrics> metrics,
                                                     MetricsServerOptions options) {
  const Coordinator* co = &coordinator;
  return MetricsServer::start(std::move(options), [co, metrics] {
    Result<CoordinatorStats> st = co->stats();
    if (st.is_ok()) metrics->update(*st);
    return metrics->render();
  });
}

}  // namespace refit::control
