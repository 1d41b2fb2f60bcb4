// A real Prometheus server scrapes a real refit-coordinator while a source
// publishes versions through the C ABI, and a refit-bench run's coordinator
// while its receivers refresh; the test asks Prometheus (its HTTP API,
// /api/v1/query) what it saw. Skips, with the reason, where Debian's
// prometheus package is not installed (scripts/install-deps installs it).

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// The body of GET path from 127.0.0.1:port; empty on any failure. Bounded by 5 s.
std::string http_get(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return {};
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return {};
  }
  std::string out;
  char buf[8192];
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return out.rfind("HTTP/1.", 0) == 0 && out.find(" 200 ") != std::string::npos && body != std::string::npos
             ? out.substr(body + 4)
             : std::string();
}

pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

void stop(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

std::string find_prometheus() {
  for (const char* p : {"/usr/bin/prometheus", "/usr/local/bin/prometheus"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return {};
}

// The value of an instant query's first sample, or "" when there is none yet.
std::string query(int port, const std::string& promql) {
  std::string q;
  for (char c : promql) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
      q += c;
    } else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
      q += hex;
    }
  }
  const std::string body = http_get(port, "/api/v1/query?query=" + q);
  if (body.empty()) return {};
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || j.value("status", "") != "success") return {};
  const auto& result = j["data"]["result"];
  if (!result.is_array() || result.empty()) return {};
  return result[0]["value"][1].get<std::string>();
}

// Starts Prometheus scraping 127.0.0.1:target every `interval`; returns its
// pid and sets *port to its HTTP port.
pid_t start_prometheus(const std::string& binary, const fs::path& dir, int target, const std::string& interval,
                       int* port) {
  *port = free_port();
  std::ofstream(dir / "prometheus.yml") << "global:\n  scrape_interval: " << interval
                                        << "\n  evaluation_interval: 1s\n"
                                           "scrape_configs:\n  - job_name: refit\n    static_configs:\n"
                                           "      - targets: ['127.0.0.1:"
                                        << target << "']\n";
  return spawn({binary, "--config.file=" + (dir / "prometheus.yml").string(),
                "--storage.tsdb.path=" + (dir / "tsdb").string(),
                "--web.listen-address=127.0.0.1:" + std::to_string(*port)},
               dir / "prometheus.log");
}

class PrometheusScrape : public ::testing::Test {
 protected:
  void SetUp() override {
    prometheus_ = find_prometheus();
    if (prometheus_.empty()) GTEST_SKIP() << "Debian's prometheus package is not installed (scripts/install-deps)";
    std::string tmpl = (fs::temp_directory_path() / "refit_prom_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    std::ofstream(dir_ / "token") << "prometheus-test-token-0123456789\n";
    chmod((dir_ / "token").c_str(), 0600);
  }
  void TearDown() override {
    stop(prom_);
    stop(coordinator_);
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  std::string prometheus_;
  fs::path dir_;
  pid_t prom_ = -1, coordinator_ = -1;
};

TEST_F(PrometheusScrape, SeesTheCoordinatorsMembersAndPublishedVersion) {
  const int port = free_port();
  coordinator_ = spawn({REFIT_COORDINATOR_BIN, "--listen", "127.0.0.1:" + std::to_string(port), "--token-file",
                        (dir_ / "token").string(), "--metrics", "127.0.0.1:0"},
                       dir_ / "coordinator.log");
  int metrics_port = 0;
  const std::regex metrics_line("metrics on http://127\\.0\\.0\\.1:([0-9]+)/metrics");
  for (auto deadline = Clock::now() + std::chrono::seconds(10); Clock::now() < deadline && metrics_port == 0;) {
    std::smatch m;
    const std::string log = slurp(dir_ / "coordinator.log");
    if (std::regex_search(log, m, metrics_line)) metrics_port = std::stoi(m[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(metrics_port, 0) << slurp(dir_ / "coordinator.log");

  // A source publishes three versions through the C ABI.
  const std::string cfg = "{\"rank\": 0, \"coordinator\": {\"address\": \"127.0.0.1:" + std::to_string(port) +
                          "\", \"token_file\": \"" + (dir_ / "token").string() + "\", \"timeout_ms\": 5000}}";
  refit_source_t* s = nullptr;
  ASSERT_EQ(refit_source_create(cfg.c_str(), &s), REFIT_OK) << refit_last_error();
  float w[4] = {1, 2, 3, 4};
  const char* desc = R"J({"name": "w", "dtype": "F32", "shape": [4], "segments": [{"start": [0], "size": [4], "offset": 0}]})J";
  ASSERT_EQ(refit_source_add_tensor(s, desc, w, sizeof w), REFIT_OK) << refit_last_error();
  for (int64_t v = 1; v <= 3; ++v) ASSERT_EQ(refit_source_publish(s, v), REFIT_OK) << refit_last_error();

  int prom_port = 0;
  prom_ = start_prometheus(prometheus_, dir_, metrics_port, "1s", &prom_port);

  // Prometheus starts, scrapes once a second, and answers queries.
  std::string version, sources, up;
  for (auto deadline = Clock::now() + std::chrono::seconds(45); Clock::now() < deadline;) {
    up = query(prom_port, "up{job=\"refit\"}");
    version = query(prom_port, "refit_published_version");
    sources = query(prom_port, "refit_members{role=\"source\"}");
    if (up == "1" && version == "3" && sources == "1") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  EXPECT_EQ(up, "1") << slurp(dir_ / "prometheus.log");
  EXPECT_EQ(version, "3");
  EXPECT_EQ(sources, "1");
  EXPECT_EQ(query(prom_port, "refit_members{role=\"receiver\"}"), "0");
  refit_source_destroy(s);
}

// refit-bench's coordinator serves its metrics while 4 staged receivers
// refresh 3 versions; Prometheus scrapes it every 200 ms during the run, and
// what it stored must match the bench's own reports: one refresh and one
// commit per receiver rank and version, and the last version published.
TEST_F(PrometheusScrape, CountsEveryRefreshOfARefitBenchRun) {
  const int metrics_port = free_port();
  int prom_port = 0;
  prom_ = start_prometheus(prometheus_, dir_, metrics_port, "200ms", &prom_port);
  const std::string root = REFIT_SOURCE_ROOT;
  const fs::path reports = dir_ / "reports.json";
  const pid_t bench = spawn({REFIT_BENCH_BIN, "--scenario", root + "/examples/scenarios/tp2-to-tp2x2.json", "--models",
                             root + "/examples/models", "--strategies", "refit", "--versions", "3", "--mode", "staged",
                             "--timeout", "30", "--metrics", "127.0.0.1:" + std::to_string(metrics_port),
                             "--reports", reports.string()},
                            dir_ / "bench.log");
  int status = -1;
  for (auto deadline = Clock::now() + std::chrono::seconds(90); Clock::now() < deadline;) {
    if (waitpid(bench, &status, WNOHANG) == bench) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (status == -1) stop(bench);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << slurp(dir_ / "bench.log");
  const std::string bench_log = slurp(dir_ / "bench.log");
  EXPECT_NE(bench_log.find("metrics on http://127.0.0.1:" + std::to_string(metrics_port) + "/metrics"),
            std::string::npos)
      << bench_log;

  // The bench's own count: its reports, per version and receiver rank.
  auto doc = nlohmann::json::parse(slurp(reports), nullptr, false);
  ASSERT_TRUE(doc.is_object() && doc.contains("refit")) << slurp(reports);
  int refreshes = 0, committed = 0;
  int64_t last_version = 0;
  for (const auto& v : doc["refit"]) {
    last_version = std::max(last_version, v["version"].get<int64_t>());
    for (const auto& r : v["reports"]) {
      refreshes += r.value("ok", false) ? 1 : 0;
      committed += r.value("committed", false) ? 1 : 0;
    }
  }
  ASSERT_EQ(refreshes, 12) << slurp(reports);  // 4 receiver ranks x 3 versions
  ASSERT_EQ(last_version, 3);

  // The bench has exited: its series are stale now, so the queries read
  // the last sample each series had.
  std::string count, ok_count, pauses, version, up;
  for (auto deadline = Clock::now() + std::chrono::seconds(30); Clock::now() < deadline;) {
    count = query(prom_port, "sum(last_over_time(refit_refresh_seconds_count[10m]))");
    ok_count = query(prom_port, "last_over_time(refit_refresh_seconds_count{mode=\"staged\",outcome=\"ok\"}[10m])");
    pauses = query(prom_port, "last_over_time(refit_pause_seconds_count[10m])");
    version = query(prom_port, "last_over_time(refit_published_version[10m])");
    up = query(prom_port, "max_over_time(up{job=\"refit\"}[10m])");
    if (count == std::to_string(refreshes) && version == std::to_string(last_version)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  std::printf("refit-bench reports: %d refreshes, %d commits, last version %lld; Prometheus: "
              "refit_refresh_seconds_count %s, refit_pause_seconds_count %s, refit_published_version %s\n",
              refreshes, committed, static_cast<long long>(last_version), count.c_str(), pauses.c_str(),
              version.c_str());
  EXPECT_EQ(up, "1") << slurp(dir_ / "prometheus.log");
  EXPECT_EQ(count, std::to_string(refreshes)) << bench_log;
  EXPECT_EQ(ok_count, std::to_string(refreshes));
  EXPECT_EQ(pauses, std::to_string(committed));
  EXPECT_EQ(version, std::to_string(last_version));
  EXPECT_EQ(query(prom_port, "last_over_time(refit_refresh_failures_total[10m])"), "");  // none failed
  EXPECT_NE(query(prom_port, "last_over_time(refit_refresh_bytes_total{kind=\"network\"}[10m]) > 0"), "");
}

}  // namespace
