// The simulator's hardware model: documented defaults, overrides by key,
// and figures no machine has refused with the key named.

#include "planner/hardware.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "planner/scenario.h"

namespace refit {
namespace {

using nlohmann::json;

std::string error_of(const json& hw, bool require = false) {
  HardwareModel m = default_hardware();
  Status s = apply_hardware(hw, "h.json", "hardware", require, &m);
  return s.is_ok() ? "" : s.message();
}

TEST(Hardware, DefaultsAreDocumentedAndPassTheirOwnChecks) {
  const HardwareModel m = default_hardware();
  EXPECT_TRUE(check_hardware(m, "defaults", "").is_ok());
  EXPECT_DOUBLE_EQ(m.nic_gbit_per_gpu, 400);
  EXPECT_DOUBLE_EQ(m.nvlink_gbyte_per_gpu, 450);
  EXPECT_FALSE(m.gets_land_in_host);
  for (const HardwareKey& k : hardware_keys()) {
    EXPECT_GT(std::string(k.source).size(), 20u) << k.key << " has no source";
    EXPECT_GT(std::string(k.unit).size(), 0u) << k.key;
  }
}

TEST(Hardware, KeysOverrideTheDefaults) {
  HardwareModel m = default_hardware();
  std::vector<std::string> given;
  ASSERT_TRUE(apply_hardware(json{{"nvlink_gbyte_per_gpu", 900}, {"get_op_us", 0.5}, {"gets_land_in_host", true}},
                             "h.json", "hardware", false, &m, &given)
                  .is_ok());
  EXPECT_DOUBLE_EQ(m.nvlink_gbyte_per_gpu, 900);
  EXPECT_DOUBLE_EQ(m.get_op_us, 0.5);
  EXPECT_TRUE(m.gets_land_in_host);
  EXPECT_DOUBLE_EQ(m.nic_gbit_per_gpu, 400);
  EXPECT_EQ(given.size(), 3u);
}

TEST(Hardware, BadValuesAreRefusedNamingTheKey) {
  EXPECT_EQ(error_of(json{{"nic_gbit_per_gpu", 0}}),
            R"(h.json: "hardware.nic_gbit_per_gpu" must be a positive number, got 0)");
  EXPECT_EQ(error_of(json{{"latency_us", -3}}), R"(h.json: "hardware.latency_us" must be a positive number, got -3)");
  EXPECT_EQ(error_of(json{{"get_op_us", "1us"}}),
            R"(h.json: "hardware.get_op_us" must be a positive number, got "1us")");
  EXPECT_EQ(error_of(json{{"gets_land_in_host", 1}}),
            R"(h.json: "hardware.gets_land_in_host" must be true or false, got 1)");
  EXPECT_NE(error_of(json{{"nic_achievable", 1.5}}).find(R"("hardware.nic_achievable")"), std::string::npos);
  // A NIC 100x faster than NVLink: Gbit/s and GB/s mixed up.
  const std::string absurd = error_of(json{{"nic_gbit_per_gpu", 400}, {"nvlink_gbyte_per_gpu", 0.45}});
  EXPECT_NE(absurd.find(R"("hardware.nic_gbit_per_gpu")"), std::string::npos) << absurd;
  EXPECT_NE(absurd.find("100x"), std::string::npos) << absurd;
  EXPECT_NE(error_of(json{{"nvlink_gbyte_per_gpu", 1e9}}).find("100 TB/s"), std::string::npos);
  EXPECT_NE(error_of(json{{"get_op_us", 2e6}}).find("one second"), std::string::npos);
  // More than the default window (64 MiB).
  EXPECT_NE(error_of(json{{"get_chunk_bytes", 128e6}}).find(R"("hardware.get_chunk_bytes")"), std::string::npos);
  // The pack keys are byte counts the simulator casts to integers.
  for (const char* k : {"fanout_pack_bytes", "fanout_pack_threshold"}) {
    for (double v : {1e30, 65536.5, 0.5, 1099511627777.0}) {
      const std::string e = error_of(json{{k, v}});
      EXPECT_NE(e.find("\"hardware." + std::string(k) + "\" must be a whole number of bytes"), std::string::npos)
          << k << " " << v << ": " << e;
    }
    EXPECT_EQ(error_of(json{{k, 1099511627776.0}}), "") << k << " at 2^40";
  }
  EXPECT_EQ(error_of(json{{"fanout_pack_bytes", 0}}), "");
  // The shared machine's keys: 0 is "no shared machine".
  for (const char* k : {"host_cores", "get_cpu_ns", "gather_cpu_ns", "local_cpu_ns"}) {
    EXPECT_EQ(error_of(json{{k, 0}}), "") << k;
    EXPECT_NE(error_of(json{{k, -1}}).find("\"hardware." + std::string(k) + "\" must be a positive number or 0"),
              std::string::npos)
        << k;
  }
  EXPECT_EQ(error_of(json{{"host_cores", 2}, {"get_cpu_ns", 0.41}}), "");
  EXPECT_NE(error_of(json{{"host_cores", 2.5}}).find(R"("hardware.host_cores" must be a whole number of cores)"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"gather_cpu_ns", 2e6}}).find("check the unit (ns per byte)"), std::string::npos);
  EXPECT_NE(error_of(json{{"fanout_pack_threshold", 0}}).find("positive"), std::string::npos);
  EXPECT_NE(error_of(json{{"nic", 1}}).find(R"(unknown key "hardware.nic")"), std::string::npos);
  EXPECT_EQ(error_of(json{{"nic_gbit_per_gpu", 400}}, /*require=*/true),
            R"(h.json: missing key "hardware.nvlink_gbyte_per_gpu")");
}

TEST(Hardware, AScenarioWithoutFiguresKeepsTheDefaults) {
  const char* text = R"({"model": "m",
    "train": {"gpus": 2, "tp": 2, "dp": 1, "pp": 1, "gpus_per_domain": 2},
    "infer": {"gpus": 2, "tp": 2, "dp": 1, "gpus_per_domain": 2}})";
  auto s = parse_scenario(text, "s.json");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_TRUE(s->hardware_given.empty());
  EXPECT_DOUBLE_EQ(s->hardware_model.nic_gbit_per_gpu, default_hardware().nic_gbit_per_gpu);
  json d = json::parse(text);
  d["hardware"] = {{"nic_gbit_per_gpu", 400}, {"nvlink_gbyte_per_gpu", 900}, {"get_op_us", 2}};
  s = parse_scenario(d.dump(), "s.json");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_EQ(s->hardware_given.size(), 3u);
  EXPECT_DOUBLE_EQ(s->hardware_model.get_op_us, 2);
  EXPECT_DOUBLE_EQ(s->hardware.nvlink_gbyte_per_gpu, 900);
  d["hardware"]["nvlink_gbyte_per_gpu"] = 0.001;
  s = parse_scenario(d.dump(), "s.json");
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find(R"("hardware.nic_gbit_per_gpu")"), std::string::npos) << s.status().message();
}

}  // namespace
}  // namespace refit
