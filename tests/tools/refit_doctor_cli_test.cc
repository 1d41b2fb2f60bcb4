// Runs the built refit-doctor as a user does: on configs this test writes,
// against a real coordinator started in this process.

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "transport/control/coordinator.h"

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

const char kToken[] = "doctor-test-token-0123456789abcdef";

class RefitDoctorCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "refit_doctor_cli_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    write_token(path("token"), kToken, 0600);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path path(const std::string& name) const { return dir_ / name; }

  static void write_token(const fs::path& p, const std::string& token, mode_t mode) {
    std::ofstream(p) << token << "\n";
    chmod(p.c_str(), mode);
  }

  fs::path write_config(const std::string& name, const json& config) {
    std::ofstream(path(name)) << config.dump();
    return path(name);
  }

  // The doctor with `args`, bounded: it never waits for anything longer than
  // its own 5 s connect timeout.
  Outcome run(const std::string& args) {
    const std::string cmd = "timeout 60 " + std::string(REFIT_DOCTOR_BIN) + " " + args + " >" +
                            path("out").string() + " 2>" + path("err").string();
    const int status = std::system(cmd.c_str());
    Outcome o;
    o.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    o.out = slurp(path("out"));
    o.err = slurp(path("err"));
    return o;
  }

  static json receiver_config(uint16_t port, const std::string& token_file) {
    return {{"rank", 0},
            {"coordinator", {{"address", "127.0.0.1:" + std::to_string(port)}, {"token_file", token_file}}},
            {"network", {{"transports", {"tcp"}}, {"devices", {"lo"}}}},
            {"local", {{"fabric", "ucx"}}}};
  }

  fs::path dir_;
};

TEST_F(RefitDoctorCli, PrintsOneLinePerCheckAndASummary) {
  Outcome o = run("--json " + path("checks.json").string());
  ASSERT_TRUE(o.code == 0 || o.code == 1) << o.err;
  EXPECT_NE(o.out.find("] cma"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("] memlock"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("] ucx"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("] network"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("] cuda"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("] nccl"), std::string::npos) << o.out;
  json checks = json::parse(slurp(path("checks.json")));
  int failed = 0;
  for (const auto& c : checks) failed += c["outcome"] == "fail";
  // The exit status agrees with the checks it printed.
  EXPECT_EQ(o.code, failed > 0 ? 1 : 0) << o.out;
  EXPECT_NE(o.out.find(std::to_string(failed) + " failed"), std::string::npos) << o.out;
}

TEST_F(RefitDoctorCli, ADeviceThatDoesNotExistFailsWithAdvice) {
  json config = receiver_config(1, path("token").string());
  config["network"]["devices"] = {"refitnodev0"};
  Outcome o = run("--config " + write_config("c.json", config).string());
  EXPECT_EQ(o.code, 1) << o.out << o.err;
  EXPECT_NE(o.out.find("[FAIL] device       network interface \"refitnodev0\" does not exist"), std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("-> name an interface that `ip link` lists"), std::string::npos) << o.out;
  // refit's own UCX context refuses it too, naming the device.
  EXPECT_NE(o.out.find("[FAIL] network"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("refitnodev0"), std::string::npos) << o.out;
}

TEST_F(RefitDoctorCli, ReachesAndAuthenticatesWithARealCoordinator) {
  refit::control::CoordinatorConfig cc;
  cc.token = kToken;
  cc.log = [](const std::string&) {};
  auto co = refit::control::Coordinator::start(std::move(cc));
  ASSERT_TRUE(co.is_ok()) << co.status().message();
  const uint16_t port = (*co)->port();

  Outcome good = run("--config " + write_config("good.json", receiver_config(port, path("token").string())).string());
  EXPECT_NE(good.out.find("[ ok ] coordinator"), std::string::npos) << good.out << good.err;
  EXPECT_NE(good.out.find("reachable; authenticated as a receiver"), std::string::npos) << good.out;
  EXPECT_NE(good.out.find("[ ok ] device       network interface \"lo\""), std::string::npos) << good.out;

  write_token(path("wrong"), "another-token-that-is-long-enough", 0600);
  Outcome wrong = run("--config " + write_config("wrong.json", receiver_config(port, path("wrong").string())).string());
  EXPECT_EQ(wrong.code, 1) << wrong.out;
  EXPECT_NE(wrong.out.find("[FAIL] coordinator"), std::string::npos) << wrong.out;
  EXPECT_NE(wrong.out.find("token"), std::string::npos) << wrong.out;
  (*co)->stop();

  // Nobody listens any more.
  Outcome gone = run("--config " + path("good.json").string());
  EXPECT_EQ(gone.code, 1) << gone.out;
  EXPECT_NE(gone.out.find("[FAIL] coordinator"), std::string::npos) << gone.out;
  EXPECT_NE(gone.out.find("start refit-coordinator there"), std::string::npos) << gone.out;
}

TEST_F(RefitDoctorCli, AReadableTokenFileFailsWithAdvice) {
  write_token(path("open"), kToken, 0644);
  json config = receiver_config(1, path("open").string());
  config["coordinator"]["embedded"] = true;
  config["coordinator"]["address"] = "127.0.0.1:0";
  Outcome o = run("--config " + write_config("c.json", config).string());
  EXPECT_EQ(o.code, 1) << o.out;
  EXPECT_NE(o.out.find("[FAIL] token"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("mode 0644"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("umask 077"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("embedded coordinator: 127.0.0.1:0 is free"), std::string::npos) << o.out;
}

TEST_F(RefitDoctorCli, ASourceKeyInAReceiversConfigFails) {
  const std::string key = std::string(REFIT_COORDINATOR_BIN) + " --token-file " + path("token").string() +
                          " --print-role-key source > " + path("source.key").string();
  ASSERT_EQ(std::system(key.c_str()), 0);
  chmod(path("source.key").c_str(), 0600);
  Outcome o = run("--config " + write_config("c.json", receiver_config(1, path("source.key").string())).string());
  EXPECT_EQ(o.code, 1) << o.out;
  EXPECT_NE(o.out.find("[FAIL] token        token file \"" + path("source.key").string() + "\": a source role key"),
            std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("--print-role-key receiver"), std::string::npos) << o.out;
}

TEST_F(RefitDoctorCli, BadInputIsNamed) {
  Outcome missing = run("--config " + path("nope.json").string());
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("cannot read --config"), std::string::npos) << missing.err;

  std::ofstream(path("bad.json")) << "{\"rank\": 0, \"colour\": 1}";
  Outcome unknown = run("--config " + path("bad.json").string());
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("colour"), std::string::npos) << unknown.err;

  std::ofstream(path("broken.json")) << "{\"rank\": ";
  Outcome broken = run("--config " + path("broken.json").string());
  EXPECT_EQ(broken.code, 2);
  EXPECT_NE(broken.err.find("broken.json"), std::string::npos) << broken.err;

  Outcome role = run("--role trainer");
  EXPECT_EQ(role.code, 2);
}

}  // namespace
