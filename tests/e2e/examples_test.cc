// The integration examples, run as a user runs them: integration/examples/
// refresh.c (built by meson) and refresh.py (through python3 and the ctypes
// binding) each refresh rows 2..5 of "example.w" (F32 [8, 16]) from a source
// process this test starts, and the bytes they write out must be the
// source's, element for element.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "planner/layout_json.h"
#include "tools/bench/agent.h"
#include "tools/bench/local_coordinator.h"
#include "tools/bench/pattern.h"
#include "tools/bench/process_group.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/refresh_run.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using refit::bench::Clock;
using refit::bench::Json;

constexpr unsigned kTestSeconds = 55;
constexpr int64_t kVersion = 4;

// The source serves "example.w" whole; the receiver side is what the
// examples register: rows 2..5 in a 256-byte buffer "w_rows".
constexpr const char* kLayout = R"json({"format": "refit-layout/1",
  "sources": [{"rank": 0, "domain": 0}],
  "receivers": [{"rank": 0, "domain": 0, "instance": 0}],
  "tensors": [{"name": "example.w", "dtype": "F32", "shape": [8, 16],
               "source": {"mesh": [1], "ranks": [0], "placements": ["R"]}}],
  "buffers": [{"side": "receiver", "rank": 0, "name": "w_rows", "dtype": "F32", "bytes": 256,
               "segments": [{"tensor": "example.w", "start": [2, 0], "size": [4, 16], "offset": 0,
                             "strides": [16, 1]}]}]})json";

struct Outcome {
  int code = -1;  // exit status; 128 + signal when killed
  std::string output;
};

// Runs argv with its stdout and stderr in a file, killing it after
// `timeout`. The child is exec'd at once, so spawning from this threaded
// process is safe.
Outcome run(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
            std::chrono::seconds timeout, const fs::path& log) {
  Outcome o;
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_store(extra_env);
  for (char** e = environ; *e != nullptr; ++e) env_store.emplace_back(*e);
  std::vector<char*> env;
  for (std::string& e : env_store) env.push_back(e.data());
  env.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) {
    o.output = "cannot start " + argv[0] + ": " + std::strerror(err);
    return o;
  }
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  for (;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) break;
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    ::usleep(5000);
  }
  o.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(log);
  std::stringstream s;
  s << in.rdbuf();
  o.output += s.str();
  return o;
}

bool python3_path(std::string* out) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    const fs::path p = fs::path(dir) / "python3";
    if (::access(p.c_str(), X_OK) == 0) {
      *out = p.string();
      return true;
    }
  }
  return false;
}

class Examples : public ::testing::Test {
 protected:
  void SetUp() override {
    ::alarm(kTestSeconds);
    auto layout = refit::parse_layout_json(kLayout, "examples layout");
    ASSERT_TRUE(layout.is_ok()) << layout.status().message();
    layout_ = std::make_unique<refit::Layout>(std::move(*layout));
    std::string tmpl = (fs::temp_directory_path() / "refit-examples-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    group_.kill_all();
    coordinator_.reset();
    std::error_code ec;
    fs::remove_all(dir_, ec);
    ::alarm(0);
  }

  // Forks the source process (before any thread starts), then starts the
  // coordinator, and has the source publish kVersion of the pattern.
  void start_source() {
    spec_.source_layout = layout_.get();
    spec_.source_rank = 0;
    const refit::bench::AgentSpec* spec = &spec_;
    auto child = group_.spawn("source 0", [spec](refit::bench::Channel& ch) { return run_agent(*spec, ch); });
    ASSERT_TRUE(child.is_ok()) << child.status().message();
    auto c = refit::bench::LocalCoordinator::start();
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    coordinator_ = std::move(*c);
    refit::bench::RunOptions o;
    const std::string config =
        refit::bench::agent_config({false, 0, 0, 0}, coordinator_->address(), coordinator_->token_file(), o);
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (const Json& cmd : {Json{{"cmd", "source"}, {"config", config}}, Json{{"cmd", "fill"}, {"version", kVersion}},
                            Json{{"cmd", "publish"}, {"version", kVersion}}}) {
      auto r = group_.request(*child, cmd, deadline);
      ASSERT_TRUE(r.is_ok()) << r.status().message() << "\ncoordinator log:\n" << coordinator_->logs();
    }
  }

  // Checks what an example wrote against the pattern of kVersion.
  void check_output(const fs::path& out) {
    std::ifstream in(out, std::ios::binary);
    ASSERT_TRUE(in.good()) << out << " was not written";
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(bytes.size(), 256u);
    auto bufs = refit::bench::rank_buffers(*layout_, refit::Side::kReceiver, 0);
    ASSERT_TRUE(bufs.is_ok()) << bufs.status().message();
    ASSERT_EQ(bufs->size(), 1u);
    refit::Status s = refit::bench::verify(*layout_, bufs->front(), bytes.data(), kVersion);
    EXPECT_TRUE(s.is_ok()) << s.message();
  }

  std::vector<std::string> example_args(const fs::path& out) const {
    return {REFIT_LIBRARY, coordinator_->address(), coordinator_->token_file(), out.string(), "lo"};
  }

  std::unique_ptr<refit::Layout> layout_;
  refit::bench::AgentSpec spec_;
  refit::bench::ProcessGroup group_;
  std::unique_ptr<refit::bench::LocalCoordinator> coordinator_;
  fs::path dir_;
};

TEST_F(Examples, CProgramRefreshesFromASource) {
  start_source();
  if (HasFatalFailure()) return;
  const fs::path out = dir_ / "c.bin";
  std::vector<std::string> argv = {REFIT_REFRESH_C};
  for (const std::string& a : example_args(out)) argv.push_back(a);
  Outcome o = run(argv, {}, std::chrono::seconds(40), dir_ / "c.log");
  ASSERT_EQ(o.code, 0) << o.output;
  EXPECT_NE(o.output.find("refreshed to version " + std::to_string(kVersion)), std::string::npos) << o.output;
  check_output(out);
}

TEST_F(Examples, PythonScriptRefreshesFromASource) {
  std::string python;
  if (!python3_path(&python)) GTEST_SKIP() << "python3 is not on PATH";
  start_source();
  if (HasFatalFailure()) return;
  const fs::path out = dir_ / "py.bin";
  std::vector<std::string> argv = {python, std::string(REFIT_SOURCE_ROOT) + "/integration/examples/refresh.py"};
  for (const std::string& a : example_args(out)) argv.push_back(a);
  Outcome o = run(argv, {"PYTHONDONTWRITEBYTECODE=1"}, std::chrono::seconds(40), dir_ / "py.log");
  ASSERT_EQ(o.code, 0) << o.output;
  EXPECT_NE(o.output.find("refreshed to version " + std::to_string(kVersion)), std::string::npos) << o.output;
  check_output(out);
}

// The binding's errors carry the library's message.
TEST_F(Examples, PythonBindingRaisesWithTheLibrarysMessage) {
  std::string python;
  if (!python3_path(&python)) GTEST_SKIP() << "python3 is not on PATH";
  const std::string script =
      "import sys\n"
      "sys.path.insert(0, '" + std::string(REFIT_SOURCE_ROOT) + "/integration/python')\n"
      "import refit\n"
      "lib = refit.Library()\n"
      "try:\n"
      "    lib.source({'rank': 0, 'netwrok': {}, 'coordinator': {'address': '127.0.0.1:1', 'token_file': '/x'}})\n"
      "except refit.RefitError as e:\n"
      "    assert e.status == refit.INVALID_ARGUMENT, e\n"
      "    assert 'netwrok' in e.message, e\n"
      "    print('raised:', e)\n"
      "    sys.exit(0)\n"
      "sys.exit(1)\n";
  Outcome o = run({python, "-c", script}, {std::string("REFIT_LIBRARY=") + REFIT_LIBRARY}, std::chrono::seconds(20),
                  dir_ / "binding.log");
  EXPECT_EQ(o.code, 0) << o.output;
}

}  // namespace
