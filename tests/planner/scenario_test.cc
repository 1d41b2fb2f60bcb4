#include "planner/scenario.h"

#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace refit {
namespace {

using nlohmann::json;

// A complete scenario in the shape of docs/formats.md, "Scenario".
json full() {
  return json::parse(R"({
    "about": "test", "model": "tiny",
    "train": {"gpus": 128, "tp": 1, "cp": 1, "dp": 32, "pp": 4, "ep": 16, "fsdp": false, "gpus_per_domain": 64},
    "infer": {"gpus": 128, "tp": 8, "dp": 16, "pp": 1, "expert_parallel": false, "gpus_per_domain": 64},
    "hardware": {"nic_gbit_per_gpu": 400, "nvlink_gbyte_per_gpu": 900},
    "reported": [{"system": "M2N", "seconds": 1.447, "source": "README"},
                 {"system": "NeMo", "seconds": 2.39, "seconds_max": 2.83, "source": "docs"}]})");
}

std::string error_of(const json& doc) {
  auto s = parse_scenario(doc.dump(), "s.json");
  return s ? std::string() : s.status().message();
}

TEST(Scenario, ParsesEveryField) {
  auto s = parse_scenario(full().dump(), "s.json");
  ASSERT_TRUE(s) << s.status().message();
  EXPECT_EQ(s->about, "test");
  EXPECT_EQ(s->model, "tiny");
  EXPECT_EQ(s->train.gpus, 128);
  EXPECT_EQ(s->train.dp, 32);
  EXPECT_EQ(s->train.pp, 4);
  EXPECT_EQ(s->train.ep, 16);
  EXPECT_FALSE(s->train.fsdp);
  EXPECT_EQ(s->train.gpus_per_domain, 64);
  EXPECT_EQ(s->infer.tp, 8);
  EXPECT_EQ(s->infer.dp, 16);
  EXPECT_FALSE(s->infer.expert_parallel);
  EXPECT_DOUBLE_EQ(s->hardware.nic_gbit_per_gpu, 400);
  EXPECT_DOUBLE_EQ(s->hardware.nvlink_gbyte_per_gpu, 900);
  ASSERT_EQ(s->reported.size(), 2u);
  EXPECT_EQ(s->reported[0].system, "M2N");
  EXPECT_DOUBLE_EQ(s->reported[0].seconds, 1.447);
  EXPECT_DOUBLE_EQ(s->reported[0].seconds_max, 0);
  EXPECT_DOUBLE_EQ(s->reported[1].seconds_max, 2.83);
}

TEST(Scenario, OptionalKeysTakeDefaults) {
  auto s = parse_scenario(R"({"model": "m",
      "train": {"gpus": 4, "tp": 2, "dp": 2, "pp": 1, "gpus_per_domain": 4},
      "infer": {"gpus": 4, "tp": 2, "dp": 2, "gpus_per_domain": 2}})",
                          "s.json");
  ASSERT_TRUE(s) << s.status().message();
  EXPECT_EQ(s->train.cp, 1);
  EXPECT_EQ(s->train.ep, 1);
  EXPECT_FALSE(s->train.fsdp);
  EXPECT_EQ(s->infer.pp, 1);
  EXPECT_FALSE(s->infer.expert_parallel);
  EXPECT_TRUE(s->reported.empty());
  EXPECT_TRUE(s->about.empty());
}

TEST(Scenario, WrongTypeNamesKeyAndValue) {
  json d = full();
  d["train"]["tp"] = "2";
  EXPECT_EQ(error_of(d), R"(s.json: "train.tp" must be a positive integer, got "2")");
  d = full();
  d["train"]["tp"] = 0;
  EXPECT_EQ(error_of(d), R"(s.json: "train.tp" must be a positive integer, got 0)");
  d = full();
  d["infer"]["dp"] = 1.5;
  EXPECT_EQ(error_of(d), R"(s.json: "infer.dp" must be a positive integer, got 1.5)");
  d = full();
  d["infer"]["dp"] = -3;
  EXPECT_EQ(error_of(d), R"(s.json: "infer.dp" must be a positive integer, got -3)");
  d = full();
  d["train"]["gpus"] = int64_t{1} << 40;
  EXPECT_EQ(error_of(d), R"(s.json: "train.gpus" must be a positive integer of at most 16777216, got 1099511627776)");
  d = full();
  d["train"]["fsdp"] = "yes";
  EXPECT_EQ(error_of(d), R"(s.json: "train.fsdp" must be true or false, got "yes")");
  d = full();
  d["infer"]["expert_parallel"] = 1;
  EXPECT_EQ(error_of(d), R"(s.json: "infer.expert_parallel" must be true or false, got 1)");
  d = full();
  d["model"] = 3;
  EXPECT_EQ(error_of(d), R"(s.json: "model" must be a non-empty string, got 3)");
  d = full();
  d["model"] = "";
  EXPECT_EQ(error_of(d), R"(s.json: "model" must be a non-empty string, got "")");
  d = full();
  d["train"] = json::array();
  EXPECT_EQ(error_of(d), R"(s.json: "train" must be an object, got [])");
  d = full();
  d["hardware"]["nic_gbit_per_gpu"] = 0;
  EXPECT_EQ(error_of(d), R"(s.json: "hardware.nic_gbit_per_gpu" must be a positive number, got 0)");
  d = full();
  d["reported"] = json::object();
  EXPECT_EQ(error_of(d), R"(s.json: "reported" must be a list, got {})");
  d = full();
  d["reported"][1]["seconds"] = "fast";
  EXPECT_EQ(error_of(d), R"(s.json: "reported[1].seconds" must be a positive number, got "fast")");
  d = full();
  d["reported"][0] = 1;
  EXPECT_EQ(error_of(d), R"(s.json: "reported[0]" must be an object, got 1)");
}

// Each side may name its own model (a BF16 trainer, an FP8 server of the
// same architecture: docs/conversion.md); absent, both are "model".
TEST(Scenario, EachSideMayNameItsModel) {
  json d = full();
  auto s = parse_scenario(d.dump(), "s.json");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_EQ(s->train.model, s->model);
  EXPECT_EQ(s->infer.model, s->model);
  d["infer"]["model"] = "kimi-k2-fp8";
  s = parse_scenario(d.dump(), "s.json");
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_EQ(s->train.model, s->model);
  EXPECT_EQ(s->infer.model, "kimi-k2-fp8");
  d["train"]["model"] = "";
  EXPECT_EQ(error_of(d), R"(s.json: "train.model" must be a non-empty string, got "")");
}

TEST(Scenario, UnknownKeysAreNamed) {
  json d = full();
  d["trian"] = json::object();
  EXPECT_EQ(error_of(d), R"(s.json: unknown key "trian" (known: about, model, train, infer, hardware, reported))");
  d = full();
  d["train"]["tpp"] = 2;
  EXPECT_EQ(error_of(d),
            R"(s.json: unknown key "train.tpp" (known: gpus, tp, cp, dp, pp, ep, fsdp, gpus_per_domain, model))");
  d = full();
  d["infer"]["ep"] = 2;  // the inference side has expert_parallel, not ep
  EXPECT_EQ(error_of(d),
            R"(s.json: unknown key "infer.ep" (known: gpus, tp, dp, pp, expert_parallel, gpus_per_domain, model))");
  d = full();
  d["hardware"]["nic"] = 1;
  EXPECT_EQ(error_of(d), R"(s.json: unknown key "hardware.nic" (known: nic_gbit_per_gpu, nic_achievable, latency_us, get_op_us, )"
            R"(nvlink_gbyte_per_gpu, nvlink_achievable, local_op_us, fanout_rounds, local_send_us, fanout_pack_bytes, )"
            R"(fanout_pack_threshold, )"
            R"(gpu_memory_gbyte_per_gpu, gpu_memory_achievable, h2d_gbyte_per_gpu, d2h_gbyte_per_gpu, )"
            R"(gets_land_in_host, source_host_mirror, convert_gbyte_per_gpu, host_convert_gbyte, convert_on_host, )"
            R"(host_cores, get_cpu_ns, gather_cpu_ns, local_cpu_ns, window_bytes, get_chunk_bytes))");
  d = full();
  d["reported"][0]["url"] = "x";
  EXPECT_EQ(error_of(d),
            R"(s.json: unknown key "reported[0].url" (known: system, seconds, seconds_max, source))");
}

TEST(Scenario, MissingKeysAreNamed) {
  for (const char* k : {"model", "train", "infer"}) {
    json d = full();
    d.erase(k);
    EXPECT_EQ(error_of(d), std::string("s.json: missing key \"") + k + "\"");
  }
  for (const char* k : {"gpus", "tp", "dp", "pp", "gpus_per_domain"}) {
    json d = full();
    d["train"].erase(k);
    EXPECT_EQ(error_of(d), std::string("s.json: missing key \"train.") + k + "\"");
  }
  for (const char* k : {"gpus", "tp", "dp", "gpus_per_domain"}) {
    json d = full();
    d["infer"].erase(k);
    EXPECT_EQ(error_of(d), std::string("s.json: missing key \"infer.") + k + "\"");
  }
  json d = full();
  d["hardware"].erase("nvlink_gbyte_per_gpu");
  EXPECT_EQ(error_of(d), R"(s.json: missing key "hardware.nvlink_gbyte_per_gpu")");
  d = full();
  d["reported"][0].erase("system");
  EXPECT_EQ(error_of(d), R"(s.json: missing key "reported[0].system")");
}

TEST(Scenario, InconsistentGpuCounts) {
  json d = full();
  d["train"]["gpus"] = 64;
  EXPECT_EQ(error_of(d), R"(s.json: "train.gpus" is 64 but tp*cp*dp*pp = 1*1*32*4 = 128)");
  d = full();
  d["train"]["ep"] = 3;
  EXPECT_EQ(error_of(d), R"(s.json: "train.ep" (3) must divide tp*cp*dp = 1*1*32 = 32)");
  d = full();
  d["infer"]["gpus"] = 8;
  EXPECT_EQ(error_of(d), R"(s.json: "infer.gpus" is 8 but tp*dp*pp = 8*16*1 = 128)");
  d = full();
  d["reported"][1]["seconds_max"] = 1.0;
  EXPECT_EQ(error_of(d), R"(s.json: "reported[1].seconds_max" (1.0) must not be below "reported[1].seconds" (2.39))");
}

TEST(Scenario, MalformedJson) {
  auto s = parse_scenario(R"({"model": "m", })", "s.json");
  ASSERT_FALSE(s);
  EXPECT_EQ(s.status().message().rfind("s.json: not valid JSON: parse error at line 1", 0), 0u)
      << s.status().message();
  auto t = parse_scenario("[]", "s.json");
  ASSERT_FALSE(t);
  EXPECT_EQ(t.status().message(), "s.json: a scenario must be a JSON object, got []");
}

}  // namespace
}  // namespace refit
