#pragma once
// The coordinator's metrics: what the whole job looks like from the
// coordinator (members, the published version, connections) and what every
// receiver's refreshes did (their refresh_summary messages, messages.h),
// aggregated so that one scrape sees the fleet. docs/operations.md lists
// every metric with its type and labels.
//
// Label sets are bounded: mode, outcome and reason come from fixed sets
// (parse_refresh_summary refuses anything else), and an instance is labelled
// only while it has registered receivers; update() drops the series of
// instances that left.
//
// Thread safety: every method may be called from any thread (the
// coordinator's I/O thread records, the metrics server's thread renders).

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "planner/status.h"
#include "transport/control/messages.h"
#include "transport/control/metrics.h"

namespace refit::control {

class Coordinator;
struct CoordinatorStats;

class FleetMetrics {
 public:
  FleetMetrics();

  // One receiver's summary; `instance` is the instance the coordinator has
  // the receiver registered in (never the peer's word).
  void record(const RefreshSummary& summary, int32_t instance);
  // The coordinator's own figures, read at each scrape. Instances not in
  // stats.instances lose their refit_instance_version series.
  void update(const CoordinatorStats& stats);

  std::string render() const { return registry_.render(); }
  const MetricsRegistry& registry() const { return registry_; }

  // The label a failure reason gets in refit_refresh_failures_total:
  // reason_name(), and "other" for a failure without one (a timeout, bad
  // input).
  static const char* reason_label(Reason reason);

 private:
  MetricsRegistry registry_;
  std::mutex mu_;
  std::set<int32_t> instances_;  // labelled in refit_instance_version; guarded by mu_
};

// Serves `metrics` on options' address, each scrape reading `coordinator`'s
// stats first. Both must outlive the server (stop it before the
// coordinator). A failing or flooded server never touches the coordinator
// beyond its stats() call.
Result<std::unique_ptr<MetricsServer>> serve_metrics(const Coordinator& coordinator,
                                                     std::shared_ptr<FleetMetrics> metrics,
                                                     MetricsServerOptions options);

}  // namespace refit::control
