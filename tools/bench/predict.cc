#include "tools/bench/predict.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

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
  // refit-bench's fabrics (cma, ucx) pass on one run per send: the unpacked
  // fan-out, unless the file says otherwise.
  model.fanout_pack_bytes = 0;
  REFIT_RETURN_IF_ERROR(apply_hardware(j, path, "", /*require_link_rates=*/true, &model));
  REFIT_RETURN_IF_ERROR(check_hardware(model, path, ""));
  return model;
}

Result<Prediction> predict(const Layout& layout, Strategy strategy, const HardwareModel& hw, bool gather) {
  PlanOptions po;
  po.strategy = strategy;
  auto plan = make_plan(layout, po);
  if (!plan) return plan.status().with_context("predicting " + std::string(strategy_name(strategy)));
  if (strategy == Strategy::kBroadcast) {
    const sim::SimResult r = sim::estimate_broadcast(*plan, hw);
    return Prediction{r.predicted_seconds, r.model};
  }
  sim::SimOptions so;
  so.gather.enabled = gather;
  auto r = sim::simulate(*plan, hw, so);
  if (!r) return r.status().with_context("predicting " + std::string(strategy_name(strategy)));
  return Prediction{r->predicted_seconds, r->model};
}

}  // namespace refit::bench
