#pragma once
// Scenario files (docs/formats.md, "Scenario"): a model, the training side, the inference
// side, the hardware, and figures other systems reported.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "planner/hardware.h"
#include "planner/status.h"

namespace refit {

struct TrainSide {
  int64_t gpus = 0, tp = 1, cp = 1, dp = 1, pp = 1, ep = 1;
  bool fsdp = false;
  int64_t gpus_per_domain = 0;
  // The model this side holds ("train.model"), the scenario's "model" when
  // absent: a BF16 trainer may feed an FP8 server of the same architecture
  // (docs/conversion.md).
  std::string model;
};

struct InferSide {
  int64_t gpus = 0, tp = 1, dp = 1, pp = 1;
  bool expert_parallel = false;
  int64_t gpus_per_domain = 0;
  std::string model;  // "infer.model", as TrainSide::model
};

struct Hardware {
  double nic_gbit_per_gpu = 0;
  double nvlink_gbyte_per_gpu = 0;
};

struct Reported {
  std::string system;
  double seconds = 0;
  double seconds_max = 0;  // 0 when the source gave one figure
  std::string source;
};

struct Scenario {
  std::string about;
  std::string model;  // manifest name, without ".json"
  TrainSide train;
  InferSide infer;
  Hardware hardware;
  // The simulator's hardware model: the defaults (hardware.h) with what the
  // scenario's `hardware` object gives applied; `hardware_given` lists the
  // keys it gave (empty without the object).
  HardwareModel hardware_model = default_hardware();
  std::vector<std::string> hardware_given;
  std::vector<Reported> reported;
};

// Parses and checks a scenario: every key known and of the right type, the
// required ones present, train.model and infer.model set (to "model" when
// absent), gpus == tp*cp*dp*pp (train) and tp*dp*pp (infer),
// ep divides tp*cp*dp, gpus_per_domain >= 1. `origin` starts every message.
Result<Scenario> parse_scenario(std::string_view json_text, const std::string& origin);

}  // namespace refit
