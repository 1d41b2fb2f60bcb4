// Runs the built refit-plan as a user does, on files this test writes into a
// temporary folder: nothing outside the build and the source tree is read.

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/common/small_llama.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Outcome {
  int code = -1;
  std::string out;
  std::string err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class RefitPlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "refit_plan_cli_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path path(const std::string& name) const { return dir_ / name; }

  std::string write(const std::string& name, const std::string& text) const {
    fs::create_directories(path(name).parent_path());
    std::ofstream(path(name), std::ios::binary) << text;
    return path(name).string();
  }

  // Runs refit-plan with `args`; stdout and stderr go to files.
  Outcome run(const std::vector<std::string>& args) const {
    const std::string out = path("stdout").string(), err = path("stderr").string();
    std::vector<std::string> all = {REFIT_PLAN_BIN};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      const int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int e = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (o < 0 || e < 0) _exit(127);
      dup2(o, 1);
      dup2(e, 2);
      execv(argv[0], argv.data());
      _exit(127);
    }
    Outcome r;
    int status = 0;
    if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status)) r.code = WEXITSTATUS(status);
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  // A bad input: exit 2 and exactly one line on stderr, "refit-plan: ..."
  // containing `needle`.
  void expect_bad(const std::vector<std::string>& args, const std::string& needle) const {
    const Outcome r = run(args);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_EQ(r.err.rfind("refit-plan: ", 0), 0u) << r.err;
    ASSERT_FALSE(r.err.empty());
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "want \"" << needle << "\" in: " << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }

  fs::path dir_;
};

const char* kLayout = R"J({"format": "refit-layout/1",
 "sources":   [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
 "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
               {"rank": 2, "domain": 0, "instance": 1}, {"rank": 3, "domain": 0, "instance": 1}],
 "tensors": [
   {"name": "w", "dtype": "BF16", "shape": [10, 6],
    "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
    "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(1)"]}},
   {"name": "q", "dtype": "BF16", "shape": [8, 4],
    "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}],
 "buffers": [
   {"side": "receiver", "rank": 0, "name": "qkv", "dtype": "BF16", "bytes": 64,
    "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]}]}]})J";

json manifest() { return refit::testing::small_llama_manifest(); }

int64_t manifest_bytes(const json& m) {
  int64_t total = 0;
  for (const auto& [name, t] : m.items()) {
    int64_t n = 2;
    for (int64_t d : t["shape"]) n *= d;
    total += n;
  }
  return total;
}

json scenario(const std::string& model = "tiny") {
  json s = json::parse(R"J({"about": "test", "reported": [],
      "train": {"gpus": 2, "tp": 2, "cp": 1, "dp": 1, "pp": 1, "ep": 1, "gpus_per_domain": 2},
      "infer": {"gpus": 4, "tp": 2, "dp": 2, "pp": 1, "expert_parallel": false, "gpus_per_domain": 4},
      "hardware": {"nic_gbit_per_gpu": 400, "nvlink_gbyte_per_gpu": 450}})J");
  s["model"] = model;
  return s;
}

// A .safetensors file of `m`'s tensors (data zeros), header padded to 8.
std::string safetensors(const json& m) {
  json h = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : m.items()) {
    uint64_t n = 2;
    for (int64_t d : t["shape"]) n *= d;
    h[name] = {{"dtype", t["dtype"]}, {"shape", t["shape"]}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + std::string(offset, '\0');
}

const std::vector<std::string> kSummaryKeys = {
    "tensors", "total_bytes", "network_bytes", "minimum_network_bytes", "local_bytes", "gather_bytes",
    "units", "pulls", "chunks", "max_source_nic_bytes", "max_receiver_nic_bytes", "plan_seconds",
    "strategy", "sources", "receivers"};

TEST_F(RefitPlanCli, HelpListsTheOptions) {
  const Outcome r = run({"--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* opt : {"--layout", "--scenario", "--models", "--model", "--layout-out", "--runs", "--json",
                          "--strategy", "--no-dedup", "--chunk-bytes", "--compare", "--quiet", "--simulate",
                          "--trace", "--hardware", "--progress-after", "--no-gather", "--gather-below",
                          "--gather-bytes", "--gather-entries"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
}

TEST_F(RefitPlanCli, LayoutSummaryJson) {
  const std::string l = write("l.json", kLayout);
  const Outcome r = run({"--layout", l, "--json", path("s.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
  const json s = json::parse(slurp(path("s.json")));
  for (const std::string& k : kSummaryKeys) EXPECT_TRUE(s.contains(k)) << k;
  EXPECT_EQ(s["strategy"], "refit");
  EXPECT_EQ(s["sources"], 2);
  EXPECT_EQ(s["receivers"], 4);
  EXPECT_EQ(s["tensors"], 2);
  EXPECT_EQ(s["total_bytes"], 120 + 64);
  // One domain: each needed byte crosses the network once.
  EXPECT_EQ(s["network_bytes"], s["minimum_network_bytes"]);
  EXPECT_EQ(s["network_bytes"], 120 + 32);
  EXPECT_EQ(s["local_bytes"], 120);
}

TEST_F(RefitPlanCli, TableByDefaultAndNothingUnderQuiet) {
  const std::string l = write("l.json", kLayout);
  Outcome r = run({"--layout", l});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("network_bytes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("152 B  (152)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layout_seconds"), std::string::npos) << r.out;
  r = run({"--layout", l, "--quiet"});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST_F(RefitPlanCli, ScenarioWithModelsFolderAndModelFile) {
  const json m = manifest();
  const std::string mj = write("models/tiny.json", m.dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string s = write("tp2.json", scenario().dump());
  Outcome r = run({"--scenario", s, "--models", path("models").string(), "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json a = json::parse(r.out);
  EXPECT_EQ(a["name"], "tp2");
  EXPECT_EQ(a["tensors"], m.size());
  EXPECT_EQ(a["total_bytes"], manifest_bytes(m));
  EXPECT_EQ(a["sources"], 2);
  EXPECT_EQ(a["receivers"], 4);
  EXPECT_EQ(a["network_bytes"], a["minimum_network_bytes"]);
  r = run({"--scenario", s, "--model", mj, "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["network_bytes"], a["network_bytes"]);
}

// A long run shows its steps on stderr (from 2 s on by default; from the
// start here), never on stdout, and nothing under --quiet.
TEST_F(RefitPlanCli, ProgressLinesGoToStderrOnly) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string s = write("tp2.json", scenario().dump());
  const std::vector<std::string> args = {"--scenario", s, "--models", path("models").string(), "--progress-after",
                                         "0"};
  std::vector<std::string> with_json = args;
  with_json.insert(with_json.end(), {"--json", "-"});
  Outcome r = run(with_json);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["name"], "tp2");  // stdout holds the result alone
  // One line per step, each naming it and the seconds so far.
  EXPECT_NE(r.err.find("refit-plan: reading " + s + ", 0 s\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("refit-plan: planning tp2 (refit)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("refit-plan: counting the GETs of tp2 (refit)"), std::string::npos) << r.err;
  std::vector<std::string> simulate = args;
  simulate.push_back("--simulate");
  r = run(simulate);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("refit-plan: simulating tp2 (refit)"), std::string::npos) << r.err;
  std::vector<std::string> quiet = args;
  quiet.push_back("--quiet");
  r = run(quiet);
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(r.err.empty()) << r.err;
  // By default a short run shows none.
  r = run({"--scenario", s, "--models", path("models").string()});
  EXPECT_EQ(r.code, 0);
  EXPECT_TRUE(r.err.empty()) << r.err;
  std::vector<std::string> negative = args;
  negative.back() = "-1";
  expect_bad(negative, "--progress-after");
}

TEST_F(RefitPlanCli, SafetensorsFileAndFolder) {
  const json m = manifest();
  const std::string s = write("tp2.json", scenario("ckpt").dump());
  write("one/ckpt.safetensors", safetensors(m));
  write("one/ckpt.config.json", refit::testing::small_llama_config().dump());
  Outcome r = run({"--scenario", s, "--models", path("one").string(), "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["tensors"], m.size());
  // A checkpoint in two shards, as a folder.
  json a = json::object(), b = json::object();
  for (const auto& [name, t] : m.items()) (name < "model.layers.1" ? a : b)[name] = t;
  write("two/ckpt/model-00001-of-00002.safetensors", safetensors(a));
  write("two/ckpt/model-00002-of-00002.safetensors", safetensors(b));
  write("two/ckpt/config.json", refit::testing::small_llama_config().dump());
  r = run({"--scenario", s, "--models", path("two").string(), "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["tensors"], m.size());
  r = run({"--scenario", s, "--model", path("two/ckpt").string(), "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["total_bytes"], manifest_bytes(m));
}

TEST_F(RefitPlanCli, RunsHaveTheFormatsShape) {
  const std::string l = write("l.json", kLayout);
  const Outcome r = run({"--layout", l, "--runs", path("runs.json").string(), "--json", path("s.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  const json runs = json::parse(slurp(path("runs.json")));
  const json s = json::parse(slurp(path("s.json")));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs["format"], "refit-runs/1");
  ASSERT_TRUE(runs["runs"].is_array());
  int64_t net = 0, local = 0;
  for (const json& run : runs["runs"]) {
    ASSERT_EQ(run.size(), 4u) << run.dump();
    const std::string kind = run["kind"];
    ASSERT_TRUE(kind == "net" || kind == "local") << run.dump();
    EXPECT_EQ(run["from"]["side"], kind == "net" ? "source" : "receiver");
    EXPECT_TRUE(run["from"]["rank"].is_number_integer());
    EXPECT_TRUE(run["from"]["buffer"].is_string());
    EXPECT_GE(run["from"]["offset"].get<int64_t>(), 0);
    EXPECT_EQ(run["to"].size(), 3u);
    EXPECT_TRUE(run["to"]["rank"].is_number_integer());
    EXPECT_TRUE(run["to"]["buffer"].is_string());
    EXPECT_GE(run["to"]["offset"].get<int64_t>(), 0);
    (kind == "net" ? net : local) += run["bytes"].get<int64_t>();
  }
  EXPECT_EQ(net, s["network_bytes"]);
  EXPECT_EQ(local, s["local_bytes"]);
}

TEST_F(RefitPlanCli, LayoutOutPlansLikeItsInput) {
  const json m = manifest();
  write("models/tiny.json", m.dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string s = write("tp2.json", scenario().dump());
  Outcome r = run({"--scenario", s, "--models", path("models").string(), "--layout-out", path("out.json").string(),
                   "--json", path("a.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  r = run({"--layout", path("out.json").string(), "--json", path("b.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  json a = json::parse(slurp(path("a.json"))), b = json::parse(slurp(path("b.json")));
  for (const char* k : {"tensors", "total_bytes", "network_bytes", "minimum_network_bytes", "local_bytes", "units",
                        "pulls", "chunks", "max_source_nic_bytes", "max_receiver_nic_bytes"})
    EXPECT_EQ(a[k], b[k]) << k;
}

TEST_F(RefitPlanCli, StrategiesAndChunkBytes) {
  const std::string l = write("l.json", kLayout);
  auto summary = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"--layout", l, "--json", "-"};
    args.insert(args.end(), extra.begin(), extra.end());
    const Outcome r = run(args);
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? json::parse(r.out) : json::object();
  };
  const json refit = summary({});
  const json no_dedup = summary({"--no-dedup"});
  EXPECT_EQ(no_dedup["strategy"], "no-dedup");
  EXPECT_EQ(summary({"--strategy", "no-dedup"})["network_bytes"], no_dedup["network_bytes"]);
  EXPECT_GT(no_dedup["network_bytes"].get<int64_t>(), refit["network_bytes"].get<int64_t>());
  const json broadcast = summary({"--strategy", "broadcast"});
  EXPECT_EQ(broadcast["strategy"], "broadcast");
  EXPECT_GT(broadcast["network_bytes"].get<int64_t>(), refit["network_bytes"].get<int64_t>());
  EXPECT_EQ(summary({"--chunk-bytes", "4MiB"})["chunks"], refit["chunks"]);
  EXPECT_EQ(summary({"--chunk-bytes", "4M"})["chunks"], refit["chunks"]);
  EXPECT_GT(summary({"--chunk-bytes", "8"})["chunks"].get<int64_t>(), refit["chunks"].get<int64_t>());
}

TEST_F(RefitPlanCli, CompareOneRowPerScenario) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string a = write("a.json", scenario().dump());
  json sb = scenario();
  sb["infer"]["gpus_per_domain"] = 2;  // two receiving domains: twice the minimum
  const std::string b = write("b.json", sb.dump());
  Outcome r = run({"--compare", "--models", path("models").string(), "--scenario", a, "--scenario", b, "--json",
                   path("c.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  const json c = json::parse(slurp(path("c.json")));
  ASSERT_EQ(c["rows"].size(), 2u);
  EXPECT_EQ(c["rows"][0]["name"], "a");
  EXPECT_EQ(c["rows"][1]["name"], "b");
  for (const json& row : c["rows"]) {
    for (const char* k : {"network_bytes", "minimum_network_bytes", "ratio", "no_dedup_bytes", "no_dedup_ratio",
                          "broadcast_bytes", "broadcast_ratio", "plan_seconds"})
      EXPECT_TRUE(row.contains(k)) << k;
    EXPECT_EQ(row["network_bytes"], row["minimum_network_bytes"]);
    EXPECT_DOUBLE_EQ(row["ratio"].get<double>(), 1.0);
  }
  EXPECT_EQ(c["rows"][1]["network_bytes"].get<int64_t>(), 2 * c["rows"][0]["network_bytes"].get<int64_t>());
  r = run({"--compare", "--models", path("models").string(), "--scenario", a, "--scenario", b});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("no-dedup"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\na "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nb "), std::string::npos) << r.out;
}

TEST_F(RefitPlanCli, BadUsage) {
  expect_bad({}, "give --layout FILE or --scenario FILE");
  expect_bad({"--frobnicate"}, "--frobnicate");
  expect_bad({"--layout", path("none.json").string()}, path("none.json").string() + ": cannot open");
  const std::string l = write("l.json", kLayout);
  expect_bad({"--layout", l, "--strategy", "fast"}, "--strategy");
  expect_bad({"--layout", l, "--chunk-bytes", "4MB"}, R"(--chunk-bytes must be a positive byte count)");
  expect_bad({"--layout", l, "--chunk-bytes", "0"}, "--chunk-bytes");
  expect_bad({"--layout", l, "--strategy", "broadcast", "--runs", path("r.json").string()}, "--runs");
  expect_bad({"--layout", l, "--strategy", "refit", "--no-dedup"}, "--no-dedup");
  const std::string s = write("s.json", scenario().dump());
  expect_bad({"--scenario", s}, "--scenario needs --models DIR or --model PATH");
  expect_bad({"--scenario", s, "--scenario", s, "--models", dir_.string()}, "several --scenario files need --compare");
  expect_bad({"--scenario", s, "--layout", l, "--models", dir_.string()}, "exclude each other");
}

TEST_F(RefitPlanCli, BadInputsNameFileKeyAndProblem) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string models = path("models").string();

  const std::string broken = write("broken.json", "{\"format\": ");
  expect_bad({"--layout", broken}, broken + ": not valid JSON");

  json bad = scenario();
  bad["train"]["tp"] = "2";
  const std::string s1 = write("s1.json", bad.dump());
  expect_bad({"--scenario", s1, "--models", models}, s1 + R"(: "train.tp" must be a positive integer, got "2")");

  bad = scenario();
  bad["infer"]["tpp"] = 2;
  const std::string s2 = write("s2.json", bad.dump());
  expect_bad({"--scenario", s2, "--models", models}, s2 + R"(: unknown key "infer.tpp")");

  const std::string s3 = write("s3.json", scenario("absent").dump());
  expect_bad({"--scenario", s3, "--models", models}, R"(no manifest for model "absent")");

  // No config beside the manifest, a config without a key the layout needs,
  // a config that is not JSON: each refused, naming what is missing.
  write("noconf/tiny.json", manifest().dump());
  const std::string s4 = write("s4.json", scenario().dump());
  expect_bad({"--scenario", s4, "--models", path("noconf").string()}, "has no Hugging Face config");
  json conf = refit::testing::small_llama_config();
  conf.erase("num_key_value_heads");
  write("nokv/tiny.json", manifest().dump());
  write("nokv/tiny.config.json", conf.dump());
  expect_bad({"--scenario", s4, "--models", path("nokv").string()},
             path("nokv/tiny.config.json").string() + R"(: the key "num_key_value_heads" is missing)");
  write("badconf/tiny.json", manifest().dump());
  write("badconf/tiny.config.json", "{\"head_dim\": ");
  expect_bad({"--scenario", s4, "--models", path("badconf").string()},
             path("badconf/tiny.config.json").string() + ": not valid JSON");

  json m = manifest();
  m["model.norm.weight"]["shape"] = {-1};
  write("badm/tiny.json", m.dump());
  const std::string s = write("s.json", scenario().dump());
  expect_bad({"--scenario", s, "--models", path("badm").string()},
             R"(tiny.json: tensor "model.norm.weight": "shape" must be a list of non-negative integers)");

  std::string st = safetensors(manifest());
  st[0] = static_cast<char>(0xff);  // the header length now lies
  st[1] = static_cast<char>(0xff);
  st[2] = static_cast<char>(0x7f);
  write("lying/tiny.safetensors", st);
  expect_bad({"--scenario", s, "--models", path("lying").string()}, "tiny.safetensors: the header length");

  json layout = json::parse(kLayout);
  layout["tensors"][1]["source"]["placements"] = {"Partial"};
  const std::string l1 = write("l1.json", layout.dump());
  expect_bad({"--layout", l1}, l1 + R"(: tensors[1].source.placements[0] (tensor "q"): placement "Partial")");

  layout = json::parse(kLayout);
  layout["tensors"][0].erase("source");  // receivers need "w", nobody holds it
  const std::string l2 = write("l2.json", layout.dump());
  expect_bad({"--layout", l2}, l2 + ": ");

  layout = json::parse(kLayout);
  layout["buffers"][0]["segments"][0]["tensor"] = "nope";
  const std::string l3 = write("l3.json", layout.dump());
  expect_bad({"--layout", l3}, R"(unknown tensor "nope")");
}

TEST_F(RefitPlanCli, GetStatisticsInTheSummary) {
  // kLayout: each w unit (10 rows x 3 of 6 columns) comes as two pieces of
  // 5 rows, each row its own 6-byte run (the source holds whole rows); q is
  // one 32-byte run. The two w units go to receivers 2 and 1, q to 0.
  // Grouped (the agents' default, docs/refresh.md "Gathers"): each w unit's
  // rows from one source are one gather of 30 bytes, so 2 per receiver.
  const std::string l = write("l.json", kLayout);
  const Outcome r = run({"--layout", l, "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json s = json::parse(r.out);
  EXPECT_EQ(s["gets"], 5);
  EXPECT_EQ(s["gets_per_receiver_max"], 2);
  EXPECT_EQ(s["gets_busiest_receiver"], 1);
  EXPECT_EQ(s["get_bytes_median"], 30);
  EXPECT_EQ(s["get_bytes_min"], 30);
  EXPECT_EQ(s["get_bytes_max"], 32);
  EXPECT_EQ(s["gathers"], 4);
  EXPECT_EQ(s["gathered_runs"], 20);
  EXPECT_EQ(s["gather_unpacked"], 0);
  // Receiver 1's two GETs are gathers; no small run travels alone.
  EXPECT_EQ(s["gets_busiest_receiver_gathers"], 2);
  EXPECT_EQ(s["gets_busiest_receiver_small_alone"], 0);
  // Four gathers of 30 bytes and q's 32: all in the class up to 32 bytes.
  EXPECT_EQ(s["get_size_classes"], json::parse(R"({"32": 5})"));
  // Each source serves one 30-byte gather to each of receivers 1 and 2:
  // that is what a source may hold for them, well within its bound.
  EXPECT_EQ(s["gather_reply_bytes_wanted"], 60);
  EXPECT_EQ(s["gather_reply_bytes_bound"], 60);
  EXPECT_EQ(s["ungrouped_gets"], 21);
  EXPECT_EQ(s["ungrouped_gets_per_receiver_max"], 10);
  EXPECT_EQ(s["ungrouped_get_bytes_median"], 6);
  // Without grouping, every run is its own GET.
  const Outcome off = run({"--layout", l, "--no-gather", "--json", "-"});
  ASSERT_EQ(off.code, 0) << off.err;
  const json o = json::parse(off.out);
  EXPECT_EQ(o["gets"], 21);
  EXPECT_EQ(o["gets_per_receiver_max"], 10);
  EXPECT_EQ(o["get_bytes_median"], 6);
  EXPECT_EQ(o["get_bytes_min"], 6);
  EXPECT_EQ(o["gathers"], 0);
  // Every GET of receiver 1 is a row below "gather_below_bytes", alone.
  EXPECT_EQ(o["gets_busiest_receiver"], 1);
  EXPECT_EQ(o["gets_busiest_receiver_gathers"], 0);
  EXPECT_EQ(o["gets_busiest_receiver_small_alone"], 10);
  EXPECT_EQ(o["get_size_classes"], json::parse(R"({"8": 20, "32": 1})"));
  // A gather bound smaller than a row: the 20 rows and q travel unpacked, counted.
  const Outcome small = run({"--layout", l, "--gather-bytes", "4", "--json", "-"});
  ASSERT_EQ(small.code, 0) << small.err;
  EXPECT_EQ(json::parse(small.out)["gather_unpacked"], 21);
  // The broadcast baseline has no runs, so no GET figures.
  const Outcome b = run({"--layout", l, "--strategy", "broadcast", "--json", "-"});
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_FALSE(json::parse(b.out).contains("gets"));
}

// --gather-entries sets the agents' "gather_entries": at 2 runs a gather,
// each source's 5 rows for receivers 1 and 2 (GetStatisticsInTheSummary)
// travel as gathers of 2, 2 and a row alone.
TEST_F(RefitPlanCli, GatherEntriesBoundsTheRunsOfAGather) {
  const std::string l = write("l.json", kLayout);
  const Outcome r = run({"--layout", l, "--gather-entries", "2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json s = json::parse(r.out);
  EXPECT_EQ(s["gathers"], 8);
  EXPECT_EQ(s["gathered_runs"], 16);
  EXPECT_EQ(s["gets"], 13);
  EXPECT_EQ(s["gets_per_receiver_max"], 6);
  EXPECT_EQ(s["gets_busiest_receiver"], 1);
  EXPECT_EQ(s["gets_busiest_receiver_gathers"], 4);
  EXPECT_EQ(s["gets_busiest_receiver_small_alone"], 2);
  // Rows of 6 bytes, gathers of 12, q's 32.
  EXPECT_EQ(s["get_size_classes"], json::parse(R"({"8": 4, "16": 8, "32": 1})"));
  for (const char* bad : {"0", "1", "65537"}) {
    SCOPED_TRACE(bad);
    expect_bad({"--layout", l, "--gather-entries", bad},
               std::string(R"(--gather-entries: "gather_entries" must lie in [2, 65536], got )") + bad);
  }
  expect_bad({"--layout", l, "--gather-entries", "abc"}, "--gather-entries");
}

// The table prints the size classes as "<=BOUND: COUNT" and the busiest
// receiver's split as plain counts.
TEST_F(RefitPlanCli, TablePrintsTheGetSizeClassesAndTheBusiestReceiversSplit) {
  const std::string l = write("l.json", kLayout);
  const Outcome r = run({"--layout", l, "--gather-entries", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto line = [&](const std::string& key) {
    const size_t at = r.out.find("\n" + key + " ");
    if (at == std::string::npos) return std::string("(no line " + key + ")");
    const size_t end = r.out.find('\n', at + 1);
    std::string text = r.out.substr(at + 1, end - at - 1);
    text.erase(0, text.find_first_not_of(' ', key.size()));  // the value, after the padding
    return text;
  };
  EXPECT_EQ(line("get_size_classes"), "<=8 B: 4, <=16 B: 8, <=32 B: 1") << r.out;
  EXPECT_EQ(line("gets_busiest_receiver_gathers"), "4") << r.out;
  EXPECT_EQ(line("gets_busiest_receiver_small_alone"), "2") << r.out;
}

TEST_F(RefitPlanCli, SimulateWritesPredictionBoundAndTrace) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  json sc = scenario();
  sc["reported"] = json::array({{{"system", "other"}, {"seconds", 1.5}, {"source", "a paper"}}});
  const std::string s = write("tp2.json", sc.dump());
  Outcome r = run({"--scenario", s, "--models", path("models").string(), "--simulate", "--json", "-", "--trace",
                   path("trace.json").string()});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;  // the scenario gives hardware figures: no note
  const json j = json::parse(r.out);
  EXPECT_EQ(j["simulated"], true);
  EXPECT_EQ(j["strategy"], "refit");
  EXPECT_GT(j["lower_bound_seconds"].get<double>(), 0);
  EXPECT_GE(j["predicted_seconds"].get<double>(), j["lower_bound_seconds"].get<double>());
  for (const char* k : {"source_nic", "receiver_nic", "nvlink_out", "nvlink_in"})
    EXPECT_TRUE(j["busiest"][k].contains("busy_seconds")) << k;
  for (const char* k : {"publish", "network", "h2d", "fanout"}) EXPECT_TRUE(j["phases"].contains(k)) << k;
  double stages = 0;
  for (const char* k : {"jobs", "network", "rounds", "finish"}) {
    EXPECT_GE(j["simulate_stage_seconds"][k].get<double>(), 0) << k;
    stages += j["simulate_stage_seconds"][k].get<double>();
  }
  EXPECT_LE(stages, j["simulate_seconds"].get<double>());
  // The threads: a trace simulates the network and the rounds on one.
  EXPECT_GE(j["plan_threads"].get<int>(), 1);
  EXPECT_GE(j["simulate_stage_threads"]["jobs"].get<int>(), 1);
  EXPECT_EQ(j["simulate_stage_threads"]["network"], 1);
  EXPECT_EQ(j["simulate_stage_threads"]["rounds"], 1);
  {
    const Outcome t = run({"--scenario", s, "--models", path("models").string(), "--simulate", "--json", "-",
                           "--threads", "2"});
    ASSERT_EQ(t.code, 0) << t.err;
    const json k = json::parse(t.out);
    EXPECT_EQ(k["plan_threads"], 2);
    EXPECT_EQ(k["simulate_stage_threads"], (json{{"jobs", 2}, {"network", 2}, {"rounds", 2}}));
    EXPECT_EQ(k["predicted_seconds"], j["predicted_seconds"]);  // whatever the threads
  }
  EXPECT_EQ(j["reported"][0]["seconds"], 1.5);
  EXPECT_EQ(j["hardware"]["from"], "scenario");
  EXPECT_EQ(j["network_bytes"], manifest_bytes(manifest()));
  const json t = json::parse(slurp(path("trace.json")));
  EXPECT_FALSE(t["traceEvents"].empty());
  // The table names the figures and says they are simulated.
  r = run({"--scenario", s, "--models", path("models").string(), "--simulate", "--strategy", "no-dedup"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("predicted (simulated)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1.500 s: other"), std::string::npos) << r.out;
  r = run({"--scenario", s, "--models", path("models").string(), "--simulate", "--strategy", "broadcast",
           "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["model"], "fluid");
  EXPECT_FALSE(json::parse(r.out).contains("simulate_stage_seconds"));  // not simulated
  EXPECT_FALSE(json::parse(r.out).contains("simulate_stage_threads"));
}

TEST_F(RefitPlanCli, SimulateSaysWhenItUsesTheDefaults) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  json sc = scenario();
  sc.erase("hardware");
  const std::string s = write("s.json", sc.dump());
  const Outcome r = run({"--scenario", s, "--models", path("models").string(), "--simulate", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("gives no hardware figures; simulating with the defaults"), std::string::npos) << r.err;
  EXPECT_EQ(json::parse(r.out)["hardware"]["from"], "defaults");
}

// A scenario of two models (a BF16 trainer, an FP8 server) keeps its
// hardware figures and reported times in the simulation.
TEST_F(RefitPlanCli, SimulateTwoModelScenarioUsesItsHardwareAndReported) {
  const fs::path root = REFIT_SOURCE_ROOT;
  json sc = json::parse(slurp(root / "examples/scenarios/moe-bf16-to-fp8.json"));
  sc["hardware"]["nic_gbit_per_gpu"] = 200;
  sc["reported"] = json::array({{{"system", "other"}, {"seconds", 2.5}, {"source", "a paper"}}});
  const std::string s = write("two.json", sc.dump());
  const Outcome r = run({"--scenario", s, "--models", (root / "examples/models").string(), "--simulate", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["hardware"]["from"], "scenario");
  EXPECT_EQ(j["hardware"]["values"]["nic_gbit_per_gpu"], 200);
  ASSERT_EQ(j["reported"].size(), 1u);
  EXPECT_EQ(j["reported"][0]["seconds"], 2.5);
}

TEST_F(RefitPlanCli, SimulateRefusesBadHardware) {
  write("models/tiny.json", manifest().dump());
  write("models/tiny.config.json", refit::testing::small_llama_config().dump());
  const std::string models = path("models").string();
  json sc = scenario();
  sc["hardware"]["get_op_us"] = -1;
  const std::string s1 = write("s1.json", sc.dump());
  expect_bad({"--scenario", s1, "--models", models, "--simulate"},
             s1 + R"(: "hardware.get_op_us" must be a positive number, got -1)");
  sc = scenario();
  sc["hardware"]["nic_gbit_per_gpu"] = 400000;  // 50 TB/s against 450 GB/s NVLink
  const std::string s2 = write("s2.json", sc.dump());
  expect_bad({"--scenario", s2, "--models", models, "--simulate"}, R"("hardware.nic_gbit_per_gpu")");
  const std::string s = write("s.json", scenario().dump());
  const std::string hw = write("hw.json", R"({"nvlink_achievable": 0})");
  expect_bad({"--scenario", s, "--models", models, "--simulate", "--hardware", hw},
             hw + R"(: "nvlink_achievable" must be a positive number, got 0)");
  const std::string hw2 = write("hw2.json", R"({"nvlink": 1})");
  expect_bad({"--scenario", s, "--models", models, "--simulate", "--hardware", hw2}, R"(unknown key "nvlink")");
  expect_bad({"--scenario", s, "--models", models, "--trace", path("t.json").string()},
             "--trace and --hardware go with --simulate");
  expect_bad({"--scenario", s, "--models", models, "--hardware", hw}, "--trace and --hardware go with --simulate");
  expect_bad({"--scenario", s, "--models", models, "--threads", "-1"}, "--threads");
  expect_bad({"--scenario", s, "--models", models, "--simulate", "--threads", "-1"}, "--threads");
  expect_bad({"--scenario", s, "--models", models, "--simulate", "--strategy", "broadcast", "--trace",
              path("t.json").string()},
             "--trace needs --strategy refit or no-dedup");
}

TEST_F(RefitPlanCli, ShippedExamplesPlan) {
  const fs::path root = REFIT_SOURCE_ROOT;
  std::vector<std::string> args = {"--compare", "--models", (root / "examples/models").string(), "--json", "-"};
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(root / "examples/scenarios")) {
    if (e.path().extension() != ".json") continue;
    args.push_back("--scenario");
    args.push_back(e.path().string());
    ++n;
  }
  if (n == 0) GTEST_SKIP() << "no examples/scenarios in " << root;
  Outcome r = run(args);
  ASSERT_EQ(r.code, 0) << r.err;
  const json c = json::parse(r.out);
  ASSERT_EQ(c["rows"].size(), n);
  for (const json& row : c["rows"]) EXPECT_EQ(row["network_bytes"], row["minimum_network_bytes"]) << row.dump();
  r = run({"--layout", (root / "examples/layouts/cross-dim.json").string(), "--runs", path("runs.json").string(),
           "--quiet"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(json::parse(slurp(path("runs.json")))["runs"].empty());
}

// A BF16 trainer to an FP8 server (docs/conversion.md): the shipped
// moe-bf16-to-fp8 scenario plans, with the bytes of each place of
// conversion; the same servers in BF16 move as many network bytes as
// conversion at the receiver, more over the local fabric.
TEST_F(RefitPlanCli, BF16TrainerToFP8Server) {
  const fs::path root = REFIT_SOURCE_ROOT;
  const std::string models = (root / "examples/models").string();
  const std::string scenario = (root / "examples/scenarios/moe-bf16-to-fp8.json").string();
  Outcome r = run({"--scenario", scenario, "--models", models, "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json fp8 = json::parse(r.out);
  EXPECT_EQ(fp8["converted_tensors"], 112);
  EXPECT_EQ(fp8["derived_scale_tensors"], 112);
  EXPECT_EQ(fp8["convert_at_receiver_network_bytes"], fp8["network_bytes"]);
  EXPECT_LT(fp8["convert_at_source_network_bytes"].get<int64_t>(), fp8["network_bytes"].get<int64_t>());
  EXPECT_GT(fp8["convert_at_source_scale_bytes"].get<int64_t>(), 0);
  EXPECT_GT(fp8["quantized_at_source_bytes"].get<int64_t>(), 0);

  json bf16_scenario = json::parse(slurp(scenario));
  bf16_scenario["infer"]["model"] = "small-moe";
  r = run({"--scenario", write("bf16.json", bf16_scenario.dump()), "--models", models, "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const json bf16 = json::parse(r.out);
  EXPECT_FALSE(bf16.contains("converted_tensors"));
  EXPECT_EQ(bf16["network_bytes"], fp8["network_bytes"]);
  EXPECT_LT(fp8["convert_at_receiver_local_bytes"].get<int64_t>(), bf16["local_bytes"].get<int64_t>());

  // Two models need --models: --model names one file.
  r = run({"--scenario", scenario, "--model", (root / "examples/models/small-moe.json").string()});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("infer.model"), std::string::npos) << r.err;
}

TEST_F(RefitPlanCli, FP8ServerWithoutAScaleTensorIsRefused) {
  const fs::path root = REFIT_SOURCE_ROOT;
  json fp8 = json::parse(slurp(root / "examples/models/small-moe-fp8.json"));
  fp8.erase("model.layers.0.self_attn.o_proj.weight_scale_inv");
  write("models/small-moe-fp8.json", fp8.dump());
  write("models/small-moe-fp8.config.json", slurp(root / "examples/models/small-moe-fp8.config.json"));
  write("models/small-moe.json", slurp(root / "examples/models/small-moe.json"));
  write("models/small-moe.config.json", slurp(root / "examples/models/small-moe.config.json"));
  Outcome r = run({"--scenario", (root / "examples/scenarios/moe-bf16-to-fp8.json").string(), "--models",
                   path("models").string()});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("\"model.layers.0.self_attn.o_proj.weight_scale_inv\" is missing on the receivers"),
            std::string::npos)
      << r.err;
}

}  // namespace
