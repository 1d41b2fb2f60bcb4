#include "tools/bench/predict.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "planner/hardware.h"
#include "tools/sim/simulator.h"

namespace refit::bench {

Result<HardwareModel> read_hardware_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found("--hardware: cannot read \"" + path + "\"");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::invalid("--hardware: \"" + path + "\" is not a JSON object of hardware figures");
  }
  HardwareModel model = default_hardware();
  // refit-bench's fabrics (cma, ucx) pass on one run per send, one after
  // another: the unpacked fan-out without rounds, unless the file says
  // otherwise.
  model.fanout_pack_bytes = 0;
  model.fanout_rounds = false;
  REFIT_RETURN_IF_ERROR(apply_hardware(j, path, "", /*require_link_rates=*/true, &model));
  REFIT_RETURN_IF_ERROR(check_hardware(model, path, ""));
  return model;
}

GatherOptions receiver_gathers(const nlohmann::json& receiver_config, bool gather) {
  GatherOptions o;
  if (!gather) o.below_bytes = 0;
  auto integer = [&](const char* key, int64_t* into) {
    const auto it = receiver_config.find(key);
    if (it == receiver_config.end() || !it->is_number_integer()) return false;
    *into = it->get<int64_t>();
    return true;
  };
  integer("gather_below_bytes", &o.below_bytes);
  int64_t window = 0;
  if (!integer("gather_bytes", &o.max_bytes) && integer("window_bytes", &window)) {
    o.max_bytes = std::min(o.max_bytes, window);
  }
  integer("gather_entries", &o.max_entries);
  o.enabled = o.below_bytes > 0;
  return o;
}

Result<Prediction> predict(const Layout& layout, Strategy strategy, const HardwareModel& hw,
                           const GatherOptions& gather) {
  if (Status st = validate(gather); !st.is_ok()) return st.with_context("predicting with the receivers' gathers");
  PlanOptions po;
  po.strategy = strategy;
  auto plan = make_plan(layout, po);
  if (!plan) return plan.status().with_context("predicting " + std::string(strategy_name(strategy)));
  if (strategy == Strategy::kBroadcast) {
    const sim::SimResult r = sim::estimate_broadcast(*plan, hw);
    return Prediction{r.predicted_seconds, r.model, r.host_cpu_seconds, r.host_bound_seconds, r.host_bound};
  }
  sim::SimOptions so;
  so.gather = gather;
  auto r = sim::simulate(*plan, hw, so);
  if (!r) return r.status().with_context("predicting " + std::string(strategy_name(strategy)));
  return Prediction{r->predicted_seconds, r->model, r->host_cpu_seconds, r->host_bound_seconds, r->host_bound};
}

}  // namespace refit::bench
