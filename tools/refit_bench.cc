// refit-bench: live refreshes of a scenario on this machine, refit against
// the two strategies it replaces. One process per rank (sources and
// receivers), host memory, a coordinator embedded in this process, UCX tcp as
// the network and the receivers' default local fabric ("cma": cross-memory
// attach, or UCX shared memory where the kernel forbids it). Every receiver byte
// is verified after every refresh. Prints one row per strategy; --json writes
// the same figures for other tools.
//
// Exit status: 0 when every strategy ran and verified (and, with
// --serve-check, no read saw two versions), 1 when one failed, a byte was
// wrong or a read was mixed, 2 on bad arguments or input files.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "planner/conversion.h"
#include "planner/layout.h"
#include "planner/layout_json.h"
#include "planner/manifest.h"
#include "planner/plan.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "planner/status.h"
#include "tools/bench/hosts.h"
#include "tools/bench/predict.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/refresh_run.h"
#include "transport/control/metrics.h"

namespace {

namespace fs = std::filesystem;
using refit::Layout;
using refit::Manifest;
using refit::Result;
using refit::Status;
using refit::Strategy;
using ordered_json = nlohmann::ordered_json;

constexpr int kExitFailed = 1;
constexpr int kExitBadInput = 2;
// --kill landed after every refresh of its version had returned: every byte
// verified, but nothing was killed during a refresh (the automake/meson
// convention for a test that did not run).
constexpr int kExitUntested = 77;
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::not_found(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::io_error(path + ": read failed");
  return ss.str();
}

Result<Manifest> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::not_found(path + ": cannot open");
  std::error_code ec;
  const uint64_t file_size = fs::file_size(path, ec);
  if (ec) return Status::io_error(path + ": " + ec.message());
  std::string bytes(8, '\0');
  in.read(bytes.data(), 8);
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (bytes.size() == 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<uint8_t>(bytes[i]);
    if (n <= kMaxSafetensorsHeader && n <= file_size - 8) {
      bytes.resize(8 + n);
      in.read(bytes.data() + 8, static_cast<std::streamsize>(n));
      bytes.resize(8 + static_cast<size_t>(in.gcount()));
    }
  }
  return refit::parse_safetensors_header(bytes, file_size, path);
}

// <dir>/<model>.json, <dir>/<model>.safetensors, or the folder <dir>/<model>/
// of .safetensors files, as refit-plan looks for them.
Result<Manifest> read_tensors(const std::string& dir, const std::string& model, const std::string& scenario) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::not_found(dir + ": no such folder (--models)");
  const fs::path base(dir);
  if (fs::exists(base / (model + ".json"), ec)) {
    const std::string p = (base / (model + ".json")).string();
    auto text = read_file(p);
    if (!text) return text.status();
    return refit::parse_manifest_json(*text, p);
  }
  if (fs::exists(base / (model + ".safetensors"), ec)) return read_safetensors((base / (model + ".safetensors")).string());
  if (fs::is_directory(base / model, ec)) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(base / model, ec))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    if (files.empty()) return Status::not_found((base / model).string() + ": the folder holds no .safetensors files");
    Manifest all;
    for (const std::string& f : files) {
      auto m = read_safetensors(f);
      if (!m) return m.status();
      REFIT_RETURN_IF_ERROR(refit::merge_manifest(all, std::move(*m), f));
    }
    return all;
  }
  return Status::not_found(dir + ": no manifest for model \"" + model + "\" of " + scenario + " (looked for " + model +
                           ".json, " + model + ".safetensors and the folder " + model + "/)");
}

// The tensors and the Hugging Face config beside them: <dir>/<model>.config.json,
// or config.json in the folder <dir>/<model>/. Without a config the recipes
// refuse, naming the key they need.
Result<Manifest> read_model(const std::string& dir, const std::string& model, const std::string& scenario) {
  auto m = read_tensors(dir, model, scenario);
  if (!m) return m.status();
  std::error_code ec;
  const fs::path base(dir);
  const bool folder = !fs::exists(base / (model + ".json"), ec) && !fs::exists(base / (model + ".safetensors"), ec);
  const std::string config = folder ? refit::model_config_path((base / model).string(), true)
                                    : (base / (model + ".config.json")).string();
  if (!fs::exists(config, ec)) return m;
  auto text = read_file(config);
  if (!text) return text.status();
  auto c = refit::parse_model_config(*text, config);
  if (!c) return c.status();
  m->config = std::move(*c);
  return m;
}

std::string fixed(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string human_bytes(int64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? std::to_string(b) + " B" : fixed(v, 2) + " " + kUnits[u];
}

// The progress of the whole run on stderr: a bar redrawn in place on a
// terminal; elsewhere (a log file, a pipe) one line per finished strategy.
class Progress {
 public:
  Progress() : tty_(::isatty(STDERR_FILENO) == 1) {}
  // Called from the threads of interleaved runs too.
  void update(const std::string& strategy, const std::string& step, int done, int total) {
    if (!tty_) return;
    std::lock_guard<std::mutex> lock(mu_);
    constexpr int kWidth = 24;
    const int filled = total > 0 ? std::min(kWidth, done * kWidth / total) : 0;
    std::string line = "\r[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "] " + strategy + ": " + step;
    if (line.size() > 100) line.resize(100);
    std::fprintf(stderr, "%s\x1b[K", line.c_str());
    std::fflush(stderr);
  }
  void finish(const std::string& strategy, const refit::bench::RunResult& r) {
    std::lock_guard<std::mutex> lock(mu_);
    if (tty_) std::fprintf(stderr, "\r\x1b[K");
    if (!r.status.is_ok()) {
      std::fprintf(stderr, "refit-bench: %s failed: %s\n", strategy.c_str(), r.status.message().c_str());
    } else if (!tty_) {
      std::fprintf(stderr, "refit-bench: %s: %zu refreshes verified, median %.3f s\n", strategy.c_str(),
                   r.versions.size(), r.median_seconds());
    }
    std::fflush(stderr);
  }

 private:
  bool tty_;
  std::mutex mu_;
};

struct Row {
  std::string strategy;
  double seconds_median = 0;
  double gbps = 0;
  int64_t network_bytes = 0;
  int64_t minimum_network_bytes = 0;
  int64_t local_bytes = 0;
  bool verified = false;
  std::string mode;
  double refresh_seconds_median = 0;
  double pause_seconds_median = 0;
  double publish_seconds_median = 0;
  double cpu_seconds_median = 0;
  double machine_cpu_seconds_median = 0;
  int64_t completed = 0;
  std::string error;  // "" when none
  std::optional<refit::bench::Prediction> predicted;  // --hardware
  int64_t serve_reads = 0;
  int64_t mixed_version_reads = 0;
  std::string killed;  // --kill: who and when, else ""
  std::optional<bool> live_weights_intact;
  int64_t killed_version = 0;
  std::string kill_error;  // what the killed version's refresh ended with
  bool kill_missed = false;  // the kill landed after every refresh had returned
  double kill_refresh_seconds = 0;
  std::vector<int32_t> committed_without_killed;
  std::string rejoined;    // --rejoin: who took the killed rank
  double rejoin_seconds = 0;
  int64_t rejoins = 0;  // --churn
  double churn_seconds_median = 0;
  double churn_seconds_max = 0;
  std::string late_joined;  // --late-join
  // --hosts: the last completed version's interface bytes per host, and
  // the receivers' reported network bytes per receiving host.
  nlohmann::json link_bytes;
  std::map<std::string, int64_t> plan_bytes_by_host;
  // --partition
  std::string partitioned;
  int64_t partitioned_version = 0;
  double partition_refresh_seconds = 0;
  std::vector<int32_t> partition_failed;
  std::string partition_error;
  std::optional<bool> partition_live_intact;
  bool partition_missed = false;
  std::vector<refit::bench::ResidentSample> resident;
  int64_t rss_first_kib = 0;
  int64_t rss_last_kib = 0;
  int64_t rss_max_growth_kib = 0;
  std::string rss_max_growth_process;
  int64_t heap_first_kib = 0;
  int64_t heap_last_kib = 0;
};

std::string kib_text(int64_t kib) { return human_bytes(kib * 1024); }

std::string growth_text(int64_t kib) { return (kib < 0 ? "-" : "+") + human_bytes((kib < 0 ? -kib : kib) * 1024); }

// Resident memory of every long-lived process of a strategy's run: the
// first and the last sample, and the growth between them.
void print_resident(const Row& r, bool per_process) {
  if (r.resident.empty()) return;
  std::printf("%s: resident memory (VmRSS) of %zu processes, first -> last version: %s -> %s; largest growth %s (%s)\n",
              r.strategy.c_str(), r.resident.size(), kib_text(r.rss_first_kib).c_str(),
              kib_text(r.rss_last_kib).c_str(), growth_text(r.rss_max_growth_kib).c_str(),
              r.rss_max_growth_process.c_str());
  std::printf("%s: malloc'd and not freed (heap in use), summed: %s -> %s\n", r.strategy.c_str(),
              kib_text(r.heap_first_kib).c_str(), kib_text(r.heap_last_kib).c_str());
  if (!per_process) return;
  std::printf("  %-24s %8s %8s %12s %8s %12s %12s %12s %12s\n", "process", "pid", "version", "VmRSS", "version",
              "VmRSS", "growth", "heap first", "heap last");
  for (const auto& p : r.resident)
    std::printf("  %-24s %8lld %8lld %12s %8lld %12s %12s %12s %12s\n", p.process.c_str(),
                static_cast<long long>(p.pid), static_cast<long long>(p.first_version), kib_text(p.first_kib).c_str(),
                static_cast<long long>(p.last_version), kib_text(p.last_kib).c_str(),
                growth_text(p.last_kib - p.first_kib).c_str(), kib_text(p.first_heap_kib).c_str(),
                kib_text(p.last_heap_kib).c_str());
}

void print_table(const std::vector<Row>& rows, int64_t payload, int versions, bool serve_check, bool per_process) {
  std::printf("%-10s %10s %8s %14s %14s %14s %9s %7s %10s %10s %8s %8s %9s", "strategy", "median s", "GB/s", "network",
              "minimum", "local", "verified", "mode", "refresh s", "pause s", "cpu s", "busy s", "completed");
  if (serve_check) std::printf(" %8s %6s", "reads", "mixed");
  std::printf("\n");
  for (const Row& r : rows) {
    std::printf("%-10s %10s %8s %14s %14s %14s %9s %7s %10s %10s %8s %8s %9s", r.strategy.c_str(),
                fixed(r.seconds_median, 4).c_str(), fixed(r.gbps, 3).c_str(), human_bytes(r.network_bytes).c_str(),
                human_bytes(r.minimum_network_bytes).c_str(), human_bytes(r.local_bytes).c_str(),
                r.verified ? "yes" : "NO", r.mode.c_str(), fixed(r.refresh_seconds_median, 4).c_str(),
                fixed(r.pause_seconds_median, 4).c_str(), fixed(r.cpu_seconds_median, 2).c_str(),
                fixed(r.machine_cpu_seconds_median, 2).c_str(),
                (std::to_string(r.completed) + "/" + std::to_string(versions)).c_str());
    if (serve_check)
      std::printf(" %8lld %6lld", static_cast<long long>(r.serve_reads), static_cast<long long>(r.mixed_version_reads));
    std::printf("\n");
  }
  std::printf("GB/s: %s delivered to the receivers per refresh (10^9 bytes per second of the median)\n",
              human_bytes(payload).c_str());
  const Row* refit = nullptr;
  for (const Row& r : rows)
    if (r.strategy == "refit") refit = &r;
  for (const Row& r : rows) {
    if (refit == nullptr || &r == refit || refit->seconds_median <= 0 || r.seconds_median <= 0) continue;
    std::printf("refit / %s: %.3f of the time", r.strategy.c_str(), refit->seconds_median / r.seconds_median);
    if (r.cpu_seconds_median > 0)
      std::printf(", %.3f of the CPU", refit->cpu_seconds_median / r.cpu_seconds_median);
    std::printf("\n");
  }
  for (const Row& r : rows) {
    if (!r.predicted) continue;
    const refit::bench::Prediction& p = *r.predicted;
    std::string host;
    if (p.host_cpu_seconds > 0) {
      char b[160];
      std::snprintf(b, sizeof b, "; the shared host: %.3f CPU s, %.4f s over its cores%s", p.host_cpu_seconds,
                    p.host_bound_seconds, p.host_bound ? ", which binds" : "");
      host = b;
    }
    std::printf("%s: predicted %.4f s (simulated on --hardware, %s model%s); measured / predicted %.3f\n",
                r.strategy.c_str(), p.seconds, p.model.c_str(), host.c_str(),
                p.seconds > 0 ? r.seconds_median / p.seconds : 0.0);
  }
  for (const Row& r : rows) {
    const char* s = r.strategy.c_str();
    if (r.rejoins > 0)
      std::printf("%s: churn: %lld receivers left and rejoined (before every version after the first), "
                  "leave and rejoin median %.3f s, slowest %.3f s\n",
                  s, static_cast<long long>(r.rejoins), r.churn_seconds_median, r.churn_seconds_max);
    if (!r.late_joined.empty()) std::printf("%s: late join: %s\n", s, r.late_joined.c_str());
    if (!r.killed.empty()) {
      std::printf("%s: killed %s, in the refresh of version %lld\n", s, r.killed.c_str(),
                  static_cast<long long>(r.killed_version));
      // The verdict (exit status, the table's verified column) follows from
      // the same facts: an error fails the run; a kill that missed every
      // refresh leaves it verified but untested.
      const char* outcome = !r.kill_error.empty() ? r.kill_error.c_str()
                            : r.kill_missed
                                ? "completed and verified on every receiver before the kill landed: the kill "
                                  "tested nothing (exit status 77; use --versions >= 3 or a smaller fraction)"
                                : "completed and verified on every receiver left";
      std::printf("%s: version %lld's refresh, %.3f s: %s\n", s, static_cast<long long>(r.killed_version),
                  r.kill_refresh_seconds, outcome);
      if (!r.committed_without_killed.empty()) {
        std::string ranks;
        for (int32_t x : r.committed_without_killed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(x);
        std::printf("%s: the killed receiver's instance committed version %lld without it: receivers %s\n", s,
                    static_cast<long long>(r.killed_version), ranks.c_str());
      }
    }
    if (r.live_weights_intact) std::printf("%s: live weights intact: %s\n", s, *r.live_weights_intact ? "yes" : "NO");
    if (!r.rejoined.empty()) std::printf("%s: rejoined: %s\n", s, r.rejoined.c_str());
    if (!r.error.empty()) std::printf("%s: error: %s\n", s, r.error.c_str());
    print_resident(r, per_process);
  }
}

// --hosts: where everything ran, the links, and per strategy each host's
// interface bytes in the last completed refresh beside the bytes the
// receivers' reports say the plan moved over the network into that host.
struct HostMap;
void print_hosts(const refit::bench::Hosts& hosts, const HostMap& map, const std::vector<Row>& rows);

Result<std::vector<Strategy>> parse_strategies(const std::string& text) {
  std::vector<Strategy> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    Strategy s;
    if (item == "refit") s = Strategy::kRefit;
    else if (item == "no-dedup") s = Strategy::kNoDedup;
    else if (item == "broadcast") s = Strategy::kBroadcast;
    else return Status::invalid("--strategies: unknown strategy \"" + item + "\" (refit, no-dedup, broadcast)");
    if (std::find(out.begin(), out.end(), s) != out.end())
      return Status::invalid("--strategies: \"" + item + "\" is listed twice");
    out.push_back(s);
  }
  if (out.empty()) return Status::invalid("--strategies: name at least one of refit, no-dedup, broadcast");
  return out;
}

// "receiver:1@0.5" -> a receiver, rank 1, half way.
Result<refit::bench::RunOptions::Kill> parse_kill(const std::string& text) {
  const std::string form = "--kill: expected ROLE:RANK@FRACTION (ROLE source or receiver), e.g. receiver:1@0.5, got \"" +
                           text + "\"";
  const size_t colon = text.find(':'), at = text.find('@');
  if (colon == std::string::npos || at == std::string::npos || at < colon) return Status::invalid(form);
  refit::bench::RunOptions::Kill k;
  const std::string role = text.substr(0, colon);
  if (role == "receiver") k.receiver = true;
  else if (role != "source") return Status::invalid(form);
  try {
    size_t used = 0;
    const std::string rank = text.substr(colon + 1, at - colon - 1);
    k.rank = std::stoi(rank, &used);
    if (used != rank.size() || k.rank < 0) return Status::invalid(form);
    const std::string fraction = text.substr(at + 1);
    k.fraction = std::stod(fraction, &used);
    if (used != fraction.size() || !(k.fraction >= 0) || k.fraction > 100) return Status::invalid(form);
  } catch (const std::exception&) {
    return Status::invalid(form);
  }
  return k;
}

// "2@0.5" or "2@0.5:3" -> host 2, half way, for 3 s (0: the rest of the
// refresh). The host is a number or "coordinator".
struct PartitionArg {
  std::string host;
  double fraction = 0;
  double seconds = 0;
};
Result<PartitionArg> parse_partition(const std::string& text) {
  const std::string form = "--partition: expected HOST@FRACTION[:SECONDS], e.g. 2@0.5 or 2@0.5:3, got \"" + text + "\"";
  const size_t at = text.find('@');
  if (at == std::string::npos || at == 0) return Status::invalid(form);
  PartitionArg p;
  p.host = text.substr(0, at);
  const size_t colon = text.find(':', at);
  try {
    size_t used = 0;
    const std::string f = text.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1);
    p.fraction = std::stod(f, &used);
    if (used != f.size() || !(p.fraction >= 0) || p.fraction > 100)
      return Status::invalid("--partition " + text + ": the fraction must be from 0 to 100");
    if (colon != std::string::npos) {
      const std::string sec = text.substr(colon + 1);
      p.seconds = std::stod(sec, &used);
      if (used != sec.size() || !(p.seconds > 0) || p.seconds > 3600)
        return Status::invalid("--partition " + text + ": the seconds must be more than 0 and at most 3600");
    }
  } catch (const std::exception&) {
    return Status::invalid(form);
  }
  return p;
}

// Where every rank of a scenario runs with --hosts: the training domains
// on hosts 0, 1, ..., then the receiving domains, each domain a host; the
// broadcast baseline's gatherer on a host of its own after them.
struct HostMap {
  std::vector<std::string> names;            // hosts in order
  std::vector<std::vector<std::string>> ranks;  // per host: "source 0", ...
  std::vector<size_t> source_host, receiver_host;  // by rank
  size_t gatherer_host = SIZE_MAX;
};
HostMap map_hosts(const refit::Layout& layout, bool gatherer) {
  HostMap m;
  std::vector<int32_t> sdom, rdom;
  for (const auto& s : layout.sources) sdom.push_back(s.domain);
  for (const auto& r : layout.receivers) rdom.push_back(r.domain);
  auto distinct = [](std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  };
  const std::vector<int32_t> sd = distinct(sdom), rd = distinct(rdom);
  auto index = [](const std::vector<int32_t>& v, int32_t x) {
    return static_cast<size_t>(std::lower_bound(v.begin(), v.end(), x) - v.begin());
  };
  const size_t n = sd.size() + rd.size() + (gatherer ? 1 : 0);
  for (size_t k = 0; k < n; ++k) m.names.push_back(std::to_string(k));
  m.ranks.resize(n);
  for (size_t s = 0; s < sdom.size(); ++s) {
    m.source_host.push_back(index(sd, sdom[s]));
    m.ranks[m.source_host.back()].push_back("source " + std::to_string(s));
  }
  for (size_t r = 0; r < rdom.size(); ++r) {
    m.receiver_host.push_back(sd.size() + index(rd, rdom[r]));
    m.ranks[m.receiver_host.back()].push_back("receiver " + std::to_string(r));
  }
  if (gatherer) {
    m.gatherer_host = n - 1;
    m.ranks[n - 1].push_back("gatherer (broadcast)");
  }
  return m;
}

void print_hosts(const refit::bench::Hosts& hosts, const HostMap& map, const std::vector<Row>& rows) {
  const refit::bench::LinkSettings& l = hosts.link();
  std::printf("hosts: %zu and the coordinator's, one veth each on a bridge; links: %s, delay %s ms, loss %s %%\n",
              hosts.hosts().size(), l.mbit > 0 ? (fixed(l.mbit, 0) + " Mbit/s").c_str() : "no rate limit",
              fixed(l.delay_ms, 2).c_str(), fixed(l.loss_percent, 2).c_str());
  for (size_t k = 0; k < hosts.hosts().size(); ++k) {
    const refit::bench::Host& h = hosts.hosts()[k];
    std::string ranks;
    for (const auto& r : map.ranks[k]) ranks += (ranks.empty() ? "" : ", ") + r;
    std::printf("  host %s: %s %s (%s)\n", h.name.c_str(), h.device.c_str(), h.address.c_str(), ranks.c_str());
  }
  std::printf("  host coordinator: %s %s\n", hosts.coordinator().device.c_str(), hosts.coordinator().address.c_str());
  for (const Row& r : rows) {
    if (!r.link_bytes.is_object()) continue;
    std::printf("%s: the last refresh's bytes on each host's interface (/sys/class/net/*/statistics), beside the "
                "network bytes the receivers' reports give:\n", r.strategy.c_str());
    std::printf("  %-12s %14s %14s %14s\n", "host", "rx", "tx", "plan (rx)");
    for (auto it = r.link_bytes.begin(); it != r.link_bytes.end(); ++it) {
      auto plan = r.plan_bytes_by_host.find(it.key());
      std::printf("  %-12s %14s %14s %14s\n", it.key().c_str(),
                  human_bytes(it.value().value("rx_bytes", int64_t{0})).c_str(),
                  human_bytes(it.value().value("tx_bytes", int64_t{0})).c_str(),
                  plan == r.plan_bytes_by_host.end() ? "-" : human_bytes(plan->second).c_str());
    }
  }
  for (const Row& r : rows) {
    if (r.partitioned.empty()) continue;
    const char* s = r.strategy.c_str();
    std::printf("%s: partition: %s, in the refresh of version %lld\n", s, r.partitioned.c_str(),
                static_cast<long long>(r.partitioned_version));
    std::string failed;
    for (int32_t x : r.partition_failed) failed += (failed.empty() ? "" : ", ") + std::to_string(x);
    std::printf("%s: version %lld's refresh, %.3f s until every receiver answered: %s\n", s,
                static_cast<long long>(r.partitioned_version), r.partition_refresh_seconds,
                failed.empty() ? "completed and verified on every receiver" : ("receivers " + failed + " failed: " + r.partition_error).c_str());
    if (r.partition_live_intact) std::printf("%s: live weights intact: %s\n", s, *r.partition_live_intact ? "yes" : "NO");
    // The verdict (exit status, the verified column) from the same facts.
    std::string verdict;
    if (!r.error.empty()) {
      verdict = "FAILED (exit status 1): " + r.error.substr(0, r.error.find('\n'));
    } else if (r.partition_missed) {
      verdict = "untested (exit status 77): the link went down after every refresh of version " +
                std::to_string(r.partitioned_version) + " had returned; use a smaller fraction";
    } else {
      verdict = "passed: version " + std::to_string(r.partitioned_version) +
                (failed.empty() ? " completed on every receiver" : " failed cleanly on receivers " + failed) +
                ", and every version after it verified on every receiver";
    }
    std::printf("%s: partition verdict: %s\n", s, verdict.c_str());
  }
}

// --trace: a private folder the receiver agents write their traces to.
refit::Result<std::string> make_trace_dir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/refit-bench-trace-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) return refit::Status::io_error("cannot make a folder like " + dir);
  return dir;
}

// Merges every agent's trace in `dir` (each a JSON array of trace events)
// into one array at `out`, and removes `dir`. The ranks' timestamps share
// one clock (CLOCK_MONOTONIC), so their spans line up.
refit::Status merge_traces(const std::string& dir, const std::string& out) {
  nlohmann::json all = nlohmann::json::array();
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  refit::Status st;
  for (const fs::path& f : files) {
    std::ifstream in(f);
    nlohmann::json events = nlohmann::json::parse(in, nullptr, false);
    if (!events.is_array()) {
      st = refit::Status::io_error(f.string() + " is not a JSON array of trace events");
      continue;
    }
    for (auto& e : events) all.push_back(std::move(e));
  }
  fs::remove_all(dir, ec);
  std::ofstream o(out);
  o << all.dump() << "\n";
  if (!o) return refit::Status::io_error("cannot write " + out);
  if (files.empty()) return refit::Status::io_error("no receiver wrote a trace");
  return st;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "refit-bench: %s\n(run refit-bench --help for the options)\n", message.c_str());
  return kExitBadInput;
}

}  // namespace

int main(int argc, char** argv) {
  std::string scenario_path, layout_path, models_dir, json_out, reports_out, strategies_text = "refit,no-dedup,broadcast";
  std::string mode = "direct", kill_text, local_fabric, metrics_address, trace_out;
  bool serve_check = false, rejoin = false, small_pages = false, sequential = false, no_gather = false;
  std::string receiver_config_text, source_config_text;
  int64_t relayout_below = 0;
  std::string hardware_file;
  int versions = 3, churn = 0, late_join = 0;
  bool memory_table = false;
  double timeout_s = 60, heartbeat_timeout_s = 0, coordinator_timeout_s = 0;
  bool hosts_mode = false;
  std::string partition_text;
  refit::bench::LinkSettings link;
  CLI::App app(
      "refit-bench: live weight refreshes of a scenario on this machine, refit against its baselines.\n"
      "\n"
      "One process per rank (every source and receiver of the scenario), host memory, a\n"
      "coordinator inside refit-bench, UCX tcp on the loopback device as the network and the\n"
      "receivers' default local fabric (cross-memory attach, or UCX shared memory where the\n"
      "kernel forbids it; --local-fabric chooses). For each strategy and each version\n"
      "v = 1..N the sources write a pattern that changes with v and publish v, then every receiver\n"
      "refreshes to v at once; the time is from that command to the last receiver done, and\n"
      "every receiver byte is verified afterwards (bytes outside the segments must be\n"
      "untouched).\n"
      "\n"
      "Strategies:\n"
      "  refit      the scenario's domains: each domain pulls a slice once, fans it out locally\n"
      "  no-dedup   every receiver rank in a domain of its own: each pulls all it needs itself\n"
      "  broadcast  the conventional refit, executed with the same library: one gatherer\n"
      "             process pulls every whole tensor from the sources, then every receiver\n"
      "             rank pulls the whole tensors it touches from it (a second coordinator)\n"
      "             and copies its slices out with memcpy (timed)\n"
      "\n"
      "Modes (--mode): direct receivers refresh into the buffers the server reads, so the\n"
      "server pauses for the whole refresh; staged receivers (\"mode\": \"staged\") refresh\n"
      "into staging copies, and once every receiver's refresh returned OK refit-bench tells\n"
      "the receivers to commit (refit_receiver_commit), the only pause, one after another:\n"
      "each stands for a server on a GPU of its own, and concurrent commits on this one\n"
      "host would share one memory bus (each pause would time the others' copies too).\n"
      "broadcast ignores\n"
      "--mode: its served buffers are written only by its copy out, which is its pause.\n"
      "\n"
      "--serve-check: every receiver process runs a reader thread, a stand-in for the\n"
      "server, that reads its served buffers over and over while the refreshes run, each\n"
      "full read under a shared lock (std::shared_mutex) that whatever writes those buffers\n"
      "takes exclusively: the commit (staged), the whole refresh (direct; every receiver\n"
      "takes it before the refresh command goes out), the copy out (broadcast). A read\n"
      "checks every 4096th element of each segment plus its first and last against the\n"
      "pattern; it is mixed when no one version matches them all (two versions, or none).\n"
      "Reads start once a first version is live; each reader sleeps 9 times as long as a\n"
      "read took (at least 0.2 ms) before the next, so it takes at most a tenth of a core.\n"
      "\n"
      "--kill ROLE:RANK@FRACTION (refit and no-dedup; broadcast ignores it): SIGKILLs that\n"
      "source or receiver rank during the refresh of the last version (N). When to kill is\n"
      "an estimate: FRACTION times version N-1's refresh wall time (the median s column's\n"
      "measure), counted from version N's refresh command. Refreshes vary, so the kill\n"
      "lands only near that fraction of the refresh, or after it has finished; use N >= 3,\n"
      "since version 1 also plans and connects and is slower. The other receivers whose\n"
      "refresh returned OK commit (staged) and are verified; the version counts as\n"
      "completed when all of them did. The run reports the error and how long the refresh\n"
      "took to end; in staged mode, when some refresh failed, also live_weights_intact:\n"
      "whether the receivers whose refresh failed still hold the previous version, every\n"
      "byte checked. Exit status 1 (the run failed), as for any failure, except when a source\n"
      "was killed and every receiver still completed and verified the version (a replica\n"
      "of the source's data carried it, once the coordinator had declared it dead). When the\n"
      "kill lands after every refresh of version N had returned, that version completed and\n"
      "verified untouched and the kill tested nothing: the run says so (\"kill_missed\" in the\n"
      "JSON) and, if nothing failed, exits with 77.\n"
      "\n"
      "--rejoin (with --kill): the kill lands in the refresh of version N-1 instead (use\n"
      "N >= 4), and a standby process, forked at the start with the ranks, takes the killed\n"
      "rank: once the refresh has ended, it joins with that rank, again every 100 ms while\n"
      "the coordinator still holds the rank for the killed process (until its heartbeat\n"
      "timeout declares it dead); a source then fills and publishes the next version.\n"
      "Version N must refresh and verify on every receiver. Version N-1 may fail: it is then\n"
      "not completed, and its error is printed; the run passes (exit status 0) when every\n"
      "version after it verified, every receiver is still alive and, staged, the receivers\n"
      "that lost the refresh still held version N-2, every byte checked.\n"
      "\n"
      "--churn[=K] (refit and no-dedup): before every version after the first, K receivers\n"
      "(default 1), taken in turn over the ranks, leave and rejoin: each destroys its\n"
      "receiver (refit_receiver_destroy, which leaves the membership) and creates and joins\n"
      "a new one with the same rank and the same served buffers, in the same process, whose\n"
      "serving reader goes on. Every version is still verified on every receiver.\n"
      "\n"
      "--late-join V (refit and no-dedup): the receivers of the last inference instance\n"
      "join only at version V (2..N); their processes exist from the start. Versions before\n"
      "V refresh and verify the other instances; from V on every receiver is verified.\n"
      "\n"
      "Resident memory: after the first version a process took part in and after the last,\n"
      "VmRSS (/proc/PID/status) of every long-lived process: refit-bench itself (with the\n"
      "coordinator), each source and each receiver rank's process (broadcast: the gatherer\n"
      "too; a replacement is a process of its own). Below the table: the sums and the largest\n"
      "growth of one process, and with --memory-table (implied by --churn, --kill and\n"
      "--late-join) every process; beside VmRSS, what each process has\n"
      "allocated with malloc and not freed (glibc's mallinfo2), which tells a leak (both\n"
      "grow) from freed memory that malloc keeps for reuse (only VmRSS grows).\n"
      "\n"
      "Columns: median seconds of the N refreshes; GB/s = bytes delivered to the receivers\n"
      "per refresh / median seconds; network and local bytes summed over the receivers'\n"
      "refresh reports (broadcast: the gatherer's too); the minimum network bytes of the\n"
      "scenario from the planner (each domain receives each needed byte once); mode;\n"
      "refresh s and pause s: the median over versions of the slowest receiver's report\n"
      "\"seconds.total\" and \"pause_seconds\" (staged: the commit's; broadcast: refresh s\n"
      "is stage 2's and pause s its copy out); cpu s: the median over versions of the CPU\n"
      "time (user and system, /proc/PID/stat) of the strategy's processes (every rank and\n"
      "refit-bench with its coordinator) from the refresh command to the last receiver done,\n"
      "what the refresh cost in CPU whatever else the machine runs; busy s: the same span's\n"
      "busy CPU time of the whole machine (all cores, /proc/stat), which is cores x seconds\n"
      "when the machine was saturated; completed: refreshes that completed (and\n"
      "committed) of N; with --serve-check, reads and mixed (mixed-version reads), summed\n"
      "over the receivers. A strategy's first error is printed below the table, and below\n"
      "it refit's median time and cpu s as fractions of each other strategy's.\n"
      "\n"
      "Turns: refit and no-dedup run at once, each with processes of its own, and take\n"
      "turns version by version (refit's version 1, no-dedup's version 1, refit's version 2,\n"
      "..., in the order of --strategies); each holds its turn from its sources' fill through\n"
      "its verification, so no two strategies' work overlaps, while a change of the\n"
      "machine's load (other tenants, memory bandwidth) between versions affects both alike.\n"
      "Their processes are alive together: the memory of both strategies at once.\n"
      "--sequential runs every strategy after the one before; --kill, --churn and\n"
      "--late-join imply it. broadcast always runs on its own.\n"
      "\n"
      "Host memory: every rank's buffers are allocated as a server would, 2 MiB-aligned on\n"
      "transparent huge pages (MADV_HUGEPAGE), as the library allocates its own staging\n"
      "copies; --small-pages puts them on 4 KiB pages (MADV_NOHUGEPAGE). The cma fabric's\n"
      "writes into a peer's small pages cost about 2.3 times those into huge pages\n"
      "(refit-cma-bench).\n"
      "\n"
      "Hosts (--hosts; root and iproute2): every domain runs on a host of its own, a network\n"
      "namespace whose one interface is a veth on a private bridge (itself in a namespace),\n"
      "and the coordinator on one more host. Hosts are numbered as the scenario's domains:\n"
      "the training domains first (0, 1, ...), then the receiving domains; with broadcast,\n"
      "its gatherer gets the next host. Each agent's \"network.devices\" names its host's\n"
      "interface, so UCX listens and connects only there. Namespaces are named\n"
      "refit-<pid>-<host> and removed at exit; those of a run that was killed are removed by\n"
      "the next start. --link-mbit caps every link in both directions (tc tbf on both ends);\n"
      "--link-delay-ms (tc netem: the kernel needs it) and --link-loss (nftables) apply to what\n"
      "each host sends, so a packet between two hosts is delayed and may be lost once. Below the\n"
      "table: each host's interface bytes (/sys/class/net/*/statistics) in each strategy's\n"
      "last refresh, beside the network bytes the receivers' reports give for that host.\n"
      "--partition HOST@F[:S] takes that host's link down in the refresh of version N-1 (use\n"
      "N >= 3), F times version N-2's refresh wall time after the refresh command, for S\n"
      "seconds (default: until every receiver answered), then up again; the receivers whose\n"
      "refresh returned OK complete the version (staged: the others must still hold version\n"
      "N-2, every byte checked), and version N must verify on every receiver. Every receiver\n"
      "must answer within the library's bound on a failing refresh: --timeout, then two\n"
      "coordinator calls (--coordinator-timeout) and the lease's release, plus 1 s. When the\n"
      "host holds no source, every receiver of the other hosts must complete the version;\n"
      "when it holds sources, the others complete it only from a replica on another host,\n"
      "once the coordinator has declared the cut-off sources dead (--heartbeat-timeout).\n"
      "A line \"partition verdict\" gives the outcome; a link that went down after every\n"
      "refresh had returned tested nothing (exit status 77).\n"
      "\n"
      "A progress bar is drawn on stderr when it is a terminal; otherwise one line per\n"
      "strategy. Exit status: 0 all verified (and no mixed read), 1 a strategy failed, a\n"
      "byte was wrong or a read was mixed, 2 bad arguments or input files, 77 all verified\n"
      "but a --kill or --partition landed after every refresh had returned (it tested nothing).",
      "refit-bench");
  auto* scenario_option = app.add_option("--scenario", scenario_path, "scenario file (docs/formats.md)");
  app.add_option("--models", models_dir,
                 "folder of model manifests: <model>.json, <model>.safetensors or <model>/ (with --scenario)");
  app.add_option("--layout", layout_path,
                 "instead of --scenario and --models: a refit-layout/1 file (docs/formats.md) to refresh as it "
                 "is; no tensor may convert on the way")
      ->excludes(scenario_option)
      ->type_name("FILE");
  app.add_option("--versions", versions, "refreshes per strategy (default 3)")->check(CLI::Range(1, 1000));
  app.add_option("--json", json_out,
                 "write {\"scenario\", \"results\": [{\"strategy\", \"seconds_median\", \"gbps\", \"network_bytes\", "
                 "\"minimum_network_bytes\", \"local_bytes\", \"verified\", \"mode\", \"refresh_seconds_median\", "
                 "\"pause_seconds_median\", \"publish_seconds_median\" (the sources' publish), \"cpu_seconds_median\", \"machine_cpu_seconds_median\", \"completed\", "
                 "\"error\" (null when none), with --serve-check "
                 "\"serve_reads\", \"mixed_version_reads\", with --kill \"killed\", \"killed_version\", "
                 "\"kill_error\" (null when every receiver left completed it), \"kill_missed\" (the kill landed after "
                 "every refresh had returned), \"kill_refresh_seconds\" (that refresh, "
                 "until every receiver left had answered), \"committed_without_killed\" (staged: ranks of a killed "
                 "receiver's instance that committed that version without it) and (staged, when some failed) "
                 "\"live_weights_intact\", with --rejoin \"rejoined\" and \"rejoin_seconds\" (from the kill to "
                 "the replacement joined), with --churn \"churn\" (K), \"rejoins\", \"rejoin_seconds_median\", "
                 "\"rejoin_seconds_max\" (the slowest receiver's leave and rejoin of a version), with --late-join "
                 "\"late_joined\", and always \"rss_first_kib\", \"rss_last_kib\" (VmRSS summed over the "
                 "processes), \"rss_max_growth_kib\", \"rss_max_growth_process\", \"heap_first_kib\", "
                 "\"heap_last_kib\" (malloc'd and not freed, summed), \"rss\": [{\"process\", \"pid\", "
                 "\"first_version\", \"first_kib\", \"last_version\", \"last_kib\", \"first_heap_kib\", "
                 "\"last_heap_kib\"}]}]} to this file");
  app.add_option("--reports", reports_out,
                 "write every receiver's refresh report (refit_receiver_report) of every version and strategy, "
                 "as {\"<strategy>\": [{\"version\", \"seconds\", \"cpu_seconds\", \"machine_cpu_seconds\", "
                 "\"reports\": [...]}]}, to this file");
  CLI::Option* strategies_option = app.add_option(
      "--strategies", strategies_text,
      "comma-separated, run in this order (default refit,no-dedup,broadcast; refit alone for a scenario that "
      "converts dtypes on the way)");
  app.add_option("--mode", mode, "direct or staged (default direct); see Modes above")
      ->check(CLI::IsMember({"direct", "staged"}));
  app.add_flag("--memory-table", memory_table,
               "print every process's resident memory, not only the sums (always with --churn, --kill, "
               "--late-join)");
  app.add_flag("--sequential", sequential,
               "run refit and no-dedup one after the other instead of taking turns version by version (see above)");
  app.add_option("--local-fabric", local_fabric,
                 "the receivers' local fabric: cma (cross-memory attach) or ucx (UCX shared memory); "
                 "default: the library's (cma where the kernel allows it)")
      ->check(CLI::IsMember({"cma", "ucx"}));
  app.add_option("--hardware", hardware_file,
                 "a hardware model of this machine (docs/simulator.md, \"Calibration\"; scripts/calibrate measures "
                 "one): every strategy's refresh is also simulated on it, and the table and --json give "
                 "predicted_seconds beside the measured median (with its \"host_cores\": "
                 "predicted_host_cpu_seconds and predicted_host_bound, the shared machine's CPU bound)");
  app.add_option("--relayout-below", relayout_below,
                 "the coordinator relayouts units whose network runs would average under N bytes in the "
                 "puller's staging area (docs/refresh.md, \"Column-major receivers\"; default 0: never)")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-gather", no_gather,
               "receivers pull every network run as its own GET (\"gather_below_bytes\": 0), for a before/after "
               "of gathers (docs/refresh.md)");
  app.add_option("--receiver-config", receiver_config_text,
                 "a JSON object whose keys are set in every receiver's config, e.g. "
                 "'{\"chunk_bytes\": 1048576, \"gather_below_bytes\": 65536}', for a before/after of the "
                 "transfer knobs (docs/refresh.md, \"Gathers\"); a key the agents do not know fails the run")
      ->type_name("JSON");
  app.add_option("--source-config", source_config_text,
                 "the same for every source's config, e.g. '{\"gather_reply_bytes\": 1048576}'")
      ->type_name("JSON");
  app.add_flag("--small-pages", small_pages,
               "the ranks' buffers on 4 KiB pages instead of transparent huge pages (see above)");
  app.add_flag("--serve-check", serve_check,
               "run a serving reader in every receiver process and count mixed-version reads (see above)");
  app.add_option("--kill", kill_text, "ROLE:RANK@FRACTION, e.g. receiver:1@0.5: kill a rank during the last "
                 "refresh (see above; needs --versions 2 or more)");
  app.add_flag("--rejoin", rejoin,
               "with --kill: kill in version N-1's refresh, a standby process takes the rank, version N must "
               "verify everywhere (see above)");
  app.add_flag("--churn{1}", churn,
               "K receivers leave and rejoin before every version after the first (see above; --churn is --churn=1)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--late-join", late_join, "the last instance's receivers join only at this version (see above)")
      ->check(CLI::Range(2, 1000));
  app.add_option("--heartbeat-timeout", heartbeat_timeout_s,
                 "seconds of silence after which the coordinator declares a rank dead (default 10); the ranks "
                 "send a heartbeat every quarter of it")
      ->check(CLI::Range(0.4, 3600.0));
  app.add_flag("--hosts", hosts_mode,
               "run every domain on a host of its own: a network namespace with one veth on a private bridge, "
               "the coordinator on a host of its own (see Hosts above; needs root and iproute2)");
  app.add_option("--link-mbit", link.mbit, "with --hosts: every host link's rate, Mbit/s, both directions");
  app.add_option("--link-delay-ms", link.delay_ms, "with --hosts: the one-way delay a host adds to what it sends, ms");
  app.add_option("--link-loss", link.loss_percent,
                 "with --hosts: the percentage of the packets a host sends that are lost");
  app.add_option("--partition", partition_text,
                 "with --hosts: HOST@FRACTION[:SECONDS]: take that host's link down in the refresh of version N-1 "
                 "(see Hosts above; needs --versions 3 or more)");
  app.add_option("--trace", trace_out,
                 "write one Chrome trace (Perfetto, chrome://tracing) of every receiver rank's refreshes, all "
                 "ranks and strategies merged, to this file (docs/operations.md)");
  app.add_option("--metrics", metrics_address,
                 "HOST:PORT: the coordinator serves Prometheus metrics there while the run lasts, and stays up "
                 "after the last version until one more scrape came (at most 30 s); one strategy, refit or "
                 "no-dedup (docs/operations.md)");
  app.add_option("--timeout", timeout_s, "seconds each step may take before the run fails, and each refresh's deadline (default 60)")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--coordinator-timeout", coordinator_timeout_s,
                 "seconds each coordinator call of a rank may take (the agents' \"coordinator.timeout_ms\"; default: "
                 "--timeout). A refresh step waits for the library's bound on a failing refresh: --timeout, then "
                 "two coordinator calls and the lease's release (include/refit/refit.h)")
      ->check(CLI::Range(0.1, 3600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(e.what());
  }

  auto strategies = parse_strategies(strategies_text);
  if (!strategies) return usage_error(strategies.status().message());
  const std::string& input_path = layout_path.empty() ? scenario_path : layout_path;
  refit::Result<refit::Scenario> scenario = refit::Status::internal("unset");
  refit::Result<refit::Layout> layout = refit::Status::internal("unset");
  bool converts = false;
  std::string run_name, model_name;  // the table's title
  if (!layout_path.empty()) {
    if (!models_dir.empty()) return usage_error("--models goes with --scenario, not with --layout");
    auto text = read_file(layout_path);
    if (!text) return usage_error(text.status().message());
    layout = refit::parse_layout_json(*text, layout_path);
    if (!layout) return usage_error(layout.status().message());
    for (const refit::Tensor& t : layout->tensors)
      if (t.dtype_on(refit::Side::kReceiver) != t.dtype)
        return usage_error("--layout " + layout_path + ": tensor \"" + t.name +
                           "\" converts on the way; run such a layout from a --scenario");
    run_name = fs::path(layout_path).stem().string();
    model_name = "layout";
  } else {
    if (scenario_path.empty() || models_dir.empty())
      return usage_error("give --scenario FILE with --models DIR, or --layout FILE");
    auto scenario_text = read_file(scenario_path);
    if (!scenario_text) return usage_error(scenario_text.status().message());
    scenario = refit::parse_scenario(*scenario_text, scenario_path);
    if (!scenario) return usage_error(scenario.status().message());
    run_name = fs::path(scenario_path).stem().string();
    model_name = scenario->model;
  }
  // A scenario whose sides hold different models (a BF16 trainer, an FP8
  // server) converts on the way (docs/conversion.md): each side laid out
  // from its own model, the block from the server's quantization_config.
  if (scenario) converts = scenario->train.model != scenario->infer.model;
  if (!scenario) {
    // --layout: laid out above.
  } else if (converts) {
    auto train = read_model(models_dir, scenario->train.model, scenario_path);
    if (!train) return usage_error(train.status().message());
    auto infer = read_model(models_dir, scenario->infer.model, scenario_path);
    if (!infer) return usage_error(infer.status().message());
    std::array<int64_t, 2> block{128, 128};
    if (infer->config.weight_block_size) block = *infer->config.weight_block_size;
    layout = refit::layout_from_scenario_models(*scenario, *train, *infer, block);
    if (serve_check) return usage_error("--serve-check does not check tensors converted on the way yet");
  } else {
    auto model = read_model(models_dir, scenario->model, scenario_path);
    if (!model) return usage_error(model.status().message());
    layout = refit::layout_from_scenario(*scenario, *model);
  }
  if (!layout) return usage_error(layout.status().message());
  auto plan = refit::make_plan(*layout);
  if (!plan) return usage_error(plan.status().message());
  const int64_t minimum = plan->summary().minimum_network_bytes;
  const int64_t payload = refit::bench::receiver_payload_bytes(*layout);
  std::optional<refit::HardwareModel> hardware;
  if (!hardware_file.empty()) {
    auto hw = refit::bench::read_hardware_file(hardware_file);
    if (!hw) return usage_error(hw.status().message());
    hardware = *hw;
  }

  refit::bench::RunOptions options;
  if (converts) {
    if (strategies_option->count() == 0) *strategies = {refit::Strategy::kRefit};
    for (refit::Strategy st : *strategies)
      if (st != refit::Strategy::kRefit)
        return usage_error(std::string("--strategies ") + refit::strategy_name(st) +
                           ": a scenario that converts on the way runs the refit strategy only");
    options.weight_block_size = layout->weight_block_size;
    options.converts = true;
  }
  options.versions = versions;
  options.relayout_below_bytes = relayout_below;
  options.step_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.refresh_timeout = options.step_timeout;
  if (coordinator_timeout_s > 0)
    options.coordinator_timeout = std::chrono::milliseconds(static_cast<int64_t>(coordinator_timeout_s * 1000));
  options.staged = mode == "staged";
  options.serve_check = serve_check;
  options.huge_pages = !small_pages;
  options.gather = !no_gather;
  for (const auto& [text, flag, into] : {std::tuple{&receiver_config_text, "--receiver-config", &options.receiver_config},
                                         std::tuple{&source_config_text, "--source-config", &options.source_config}}) {
    if (text->empty()) continue;
    nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {
      return usage_error(std::string(flag) + " must be a JSON object, got: " + *text);
    }
    *into = std::move(j);
  }
  options.local_fabric = local_fabric;
  if (!kill_text.empty()) {
    auto k = parse_kill(kill_text);
    if (!k) return usage_error(k.status().message());
    if (versions < 2)
      return usage_error("--kill needs --versions 2 or more: the version before the last says when to kill");
    if (rejoin && versions < 3)
      return usage_error("--kill with --rejoin needs --versions 3 or more: the kill lands in version N-1, and "
                         "version N comes after it");
    k->rejoin = rejoin;
    options.kill = *k;
  } else if (rejoin) {
    return usage_error("--rejoin replaces a rank that --kill killed: give --kill too");
  }
  if (late_join > 0) {
    if (late_join > versions)
      return usage_error("--late-join " + std::to_string(late_join) + ": there are only " + std::to_string(versions) +
                         " versions");
    if (!kill_text.empty()) return usage_error("--late-join and --kill: give one of them");
    options.late_join_version = late_join;
  }
  options.churn = churn;
  std::string trace_dir;
  if (!trace_out.empty()) {
    if (!std::ofstream(trace_out)) return usage_error("--trace: cannot write " + trace_out);
    auto dir = make_trace_dir();
    if (!dir) return usage_error("--trace: " + dir.status().message());
    trace_dir = *dir;
    options.trace_dir = trace_dir;
  }
  if (!metrics_address.empty()) {
    if (strategies->size() != 1 || strategies->front() == refit::Strategy::kBroadcast)
      return usage_error("--metrics serves one coordinator: give one strategy, refit or no-dedup (--strategies)");
    std::string host;
    uint16_t port = 0;
    refit::Status st = refit::control::parse_metrics_address(metrics_address, &host, &port);
    if (!st.is_ok()) return usage_error("--metrics: " + st.message());
    options.metrics_address = metrics_address;
    options.on_metrics = [host](uint16_t port) {
      std::fprintf(stderr, "refit-bench: metrics on http://%s:%u/metrics\n", host.c_str(), static_cast<unsigned>(port));
    };
  }
  if (heartbeat_timeout_s > 0)
    options.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(heartbeat_timeout_s * 1000));
  // --hosts: every check before any namespace or process is made.
  std::optional<HostMap> host_map;
  std::optional<PartitionArg> partition;
  if (!hosts_mode && (link.any() || !partition_text.empty()))
    return usage_error("--link-mbit, --link-delay-ms, --link-loss and --partition need --hosts");
  if (hosts_mode) {
    Status ok = refit::bench::check_link_settings(link);
    if (!ok.is_ok()) return usage_error(ok.message());
    const bool broadcast = std::find(strategies->begin(), strategies->end(), refit::Strategy::kBroadcast) !=
                           strategies->end();
    host_map = map_hosts(*layout, broadcast);
    if (!partition_text.empty()) {
      auto p = parse_partition(partition_text);
      if (!p) return usage_error(p.status().message());
      if (std::find(host_map->names.begin(), host_map->names.end(), p->host) == host_map->names.end())
        return usage_error("--partition: there is no host \"" + p->host + "\": " + input_path + " runs on hosts 0.." +
                           std::to_string(host_map->names.size() - 1));
      if (versions < 3)
        return usage_error("--partition needs --versions 3 or more: it hits version N-1, and version N must "
                           "verify after it heals");
      if (!kill_text.empty()) return usage_error("--partition and --kill: give one of them");
      partition = *p;
    }
    Status can = refit::bench::Hosts::check();
    if (can.is_ok()) can = refit::bench::Hosts::check_link(link);
    if (!can.is_ok()) return usage_error("--hosts: " + can.message());
  }
  if (options.kill) {
    const size_t ranks = options.kill->receiver ? layout->receivers.size() : layout->sources.size();
    if (static_cast<size_t>(options.kill->rank) >= ranks)
      return usage_error("--kill: " + std::string(options.kill->receiver ? "receiver" : "source") + " rank " +
                         std::to_string(options.kill->rank) + " does not exist: " + input_path + " has " +
                         std::to_string(ranks) + " (ranks 0.." + std::to_string(static_cast<int64_t>(ranks) - 1) + ")");
  }
  std::unique_ptr<refit::bench::Hosts> hosts;
  if (host_map) {
    auto made = refit::bench::Hosts::create(static_cast<int>(host_map->names.size()), link);
    if (!made) {
      std::fprintf(stderr, "refit-bench: --hosts: %s\n", made.status().message().c_str());
      return kExitFailed;
    }
    hosts = std::move(*made);
    refit::bench::RunOptions::HostPlaces places;
    const auto& hs = hosts->hosts();
    for (size_t h : host_map->source_host) {
      places.source_netns.push_back(hs[h].netns);
      places.source_device.push_back(hs[h].device);
    }
    for (size_t h : host_map->receiver_host) {
      places.receiver_netns.push_back(hs[h].netns);
      places.receiver_device.push_back(hs[h].device);
    }
    if (host_map->gatherer_host != SIZE_MAX) {
      places.gatherer_netns = hs[host_map->gatherer_host].netns;
      places.gatherer_device = hs[host_map->gatherer_host].device;
    }
    places.coordinator_netns = hosts->coordinator().netns;
    places.coordinator_host = hosts->coordinator().address;
    const refit::bench::Hosts* hp = hosts.get();
    places.counters = [hp]() { return hp->counters(); };
    options.hosts = places;
    options.network_devices.clear();
    if (partition) {
      refit::bench::RunOptions::Partition p;
      p.host = partition->host;
      p.fraction = partition->fraction;
      p.seconds = partition->seconds;
      const size_t k = static_cast<size_t>(std::stoul(partition->host));
      p.set_link = [hp, k](bool up) { return hp->set_up(k, up); };
      for (size_t r = 0; r < host_map->receiver_host.size(); ++r)
        if (host_map->receiver_host[r] == k) p.receivers.push_back(static_cast<int32_t>(r));
      p.holds_sources = std::find(host_map->source_host.begin(), host_map->source_host.end(), k) !=
                        host_map->source_host.end();
      options.partition = p;
    }
  }
  Progress progress;
  std::vector<Row> rows;
  ordered_json all_reports = ordered_json::object();
  bool all_ok = true;
  bool trace_failed = false;
  bool any_kill_missed = false;  // some --kill or --partition landed after every refresh had returned
  // refit and no-dedup take turns version by version, each with processes
  // of its own (run_interleaved), unless --sequential or a membership test;
  // broadcast runs on its own.
  std::vector<refit::bench::RunResult> results(strategies->size());
  std::vector<size_t> together;
  if (!sequential && kill_text.empty() && churn == 0 && late_join == 0 && partition_text.empty()) {
    for (size_t i = 0; i < strategies->size(); ++i)
      if ((*strategies)[i] != refit::Strategy::kBroadcast) together.push_back(i);
    if (together.size() < 2) together.clear();
  }
  if (!together.empty()) {
    std::vector<refit::Strategy> ss;
    std::vector<refit::bench::RunOptions> os;
    for (size_t i : together) {
      const std::string name = refit::strategy_name((*strategies)[i]);
      ss.push_back((*strategies)[i]);
      os.push_back(options);
      os.back().progress = [&progress, name](const std::string& step, int done, int total) {
        progress.update(name, step, done, total);
      };
    }
    std::vector<refit::bench::RunResult> rs = refit::bench::run_interleaved(*layout, ss, os);
    for (size_t k = 0; k < together.size(); ++k) {
      progress.finish(refit::strategy_name(ss[k]), rs[k]);
      results[together[k]] = std::move(rs[k]);
    }
  }
  for (size_t i = 0; i < strategies->size(); ++i) {
    if (std::find(together.begin(), together.end(), i) != together.end()) continue;
    const std::string name = refit::strategy_name((*strategies)[i]);
    options.progress = [&](const std::string& step, int done, int total) { progress.update(name, step, done, total); };
    results[i] = refit::bench::run_refreshes(*layout, (*strategies)[i], options);
    progress.finish(name, results[i]);
  }
  if (!trace_dir.empty()) {
    refit::Status merged = merge_traces(trace_dir, trace_out);
    if (!merged.is_ok()) {
      std::fprintf(stderr, "refit-bench: --trace: %s\n", merged.message().c_str());
      trace_failed = true;
    }
  }
  for (size_t i = 0; i < strategies->size(); ++i) {
    const refit::bench::RunResult& r = results[i];
    const std::string name = refit::strategy_name((*strategies)[i]);
    Row row;
    row.strategy = name;
    row.seconds_median = r.median_seconds();
    row.gbps = row.seconds_median > 0 ? static_cast<double>(payload) / row.seconds_median * 1e-9 : 0;
    if (!r.versions.empty()) {
      row.network_bytes = r.versions.back().network_bytes;
      row.local_bytes = r.versions.back().local_bytes;
    }
    row.minimum_network_bytes = minimum;
    if (hardware) {
      auto p = refit::bench::predict(*layout, (*strategies)[i], *hardware,
                                     refit::bench::receiver_gathers(options.receiver_config, !no_gather));
      if (!p) {
        std::fprintf(stderr, "refit-bench: %s\n", p.status().message().c_str());
        return 1;
      }
      row.predicted = *p;
    }
    row.verified = r.verified();
    row.mode = r.staged ? "staged" : "direct";
    row.refresh_seconds_median = r.median_refresh_seconds();
    row.pause_seconds_median = r.median_pause_seconds();
    row.publish_seconds_median = r.median_publish_seconds();
    row.cpu_seconds_median = r.median_cpu_seconds();
    row.machine_cpu_seconds_median = r.median_machine_cpu_seconds();
    row.completed = static_cast<int64_t>(r.versions.size());
    if (!r.status.is_ok()) row.error = r.status.message();
    row.serve_reads = r.serve_reads;
    row.mixed_version_reads = r.mixed_version_reads;
    row.killed = r.killed;
    row.live_weights_intact = r.live_weights_intact;
    row.killed_version = r.killed_version;
    row.kill_error = r.kill_error;
    row.kill_missed = r.kill_missed;
    row.kill_refresh_seconds = r.kill_refresh_seconds;
    row.committed_without_killed = r.committed_without_killed;
    row.rejoined = r.rejoined;
    row.rejoin_seconds = r.rejoin_seconds;
    row.rejoins = r.rejoins;
    row.churn_seconds_median = r.median_rejoin_seconds();
    row.churn_seconds_max = r.max_rejoin_seconds();
    row.late_joined = r.late_joined;
    if (host_map && !r.versions.empty()) {
      const auto& last = r.versions.back();
      row.link_bytes = last.link_bytes;
      // The receivers' reports come in receiver rank order when all of them
      // refreshed (broadcast: stage 2's, one per receiver rank too).
      if (last.reports.size() == host_map->receiver_host.size())
        for (size_t k = 0; k < last.reports.size(); ++k)
          row.plan_bytes_by_host[host_map->names[host_map->receiver_host[k]]] +=
              last.reports[k].value("network_bytes", int64_t{0});
    }
    row.partitioned = r.partitioned;
    row.partitioned_version = r.partitioned_version;
    row.partition_refresh_seconds = r.partition_refresh_seconds;
    row.partition_failed = r.partition_failed;
    row.partition_error = r.partition_error;
    row.partition_live_intact = r.partition_live_intact;
    row.partition_missed = r.partition_missed;
    row.resident = r.resident;
    row.rss_first_kib = r.resident_first_kib();
    row.rss_last_kib = r.resident_last_kib();
    row.rss_max_growth_kib = r.resident_max_growth_kib(&row.rss_max_growth_process);
    row.heap_first_kib = r.heap_first_kib();
    row.heap_last_kib = r.heap_last_kib();
    ordered_json per_version = ordered_json::array();
    for (const auto& v : r.versions)
      per_version.push_back({{"version", v.version},
                             {"seconds", v.seconds},
                             {"cpu_seconds", v.cpu_seconds},
                             {"machine_cpu_seconds", v.machine_cpu_seconds},
                             {"reports", v.reports}});
    if (host_map)
      for (size_t k = 0; k < r.versions.size(); ++k) per_version[k]["link_bytes"] = r.versions[k].link_bytes;
    all_reports[name] = std::move(per_version);
    all_ok = all_ok && row.verified && row.mixed_version_reads == 0;
    any_kill_missed = any_kill_missed || row.kill_missed || row.partition_missed;
    rows.push_back(row);
  }

  std::printf("%s: %s, %zu sources, %zu receivers, %d refreshes per strategy\n", run_name.c_str(), model_name.c_str(), layout->sources.size(), layout->receivers.size(), versions);
  print_table(rows, payload, versions, serve_check,
              memory_table || churn > 0 || late_join > 0 || !kill_text.empty());
  if (hosts) print_hosts(*hosts, *host_map, rows);

  if (!json_out.empty()) {
    ordered_json doc = ordered_json::object();
    doc["scenario"] = run_name;
    if (hosts) {
      ordered_json hs = ordered_json::array();
      auto add = [&](const refit::bench::Host& h, const std::vector<std::string>& ranks) {
        hs.push_back({{"name", h.name}, {"netns", h.netns}, {"device", h.device}, {"address", h.address},
                      {"ranks", ranks}});
      };
      for (size_t k = 0; k < hosts->hosts().size(); ++k) add(hosts->hosts()[k], host_map->ranks[k]);
      add(hosts->coordinator(), {"coordinator"});
      doc["hosts"] = std::move(hs);
      doc["link"] = {{"mbit", link.mbit},
                     {"delay_ms", link.delay_ms},
                     {"loss_percent", link.loss_percent},
                     {"rate", "both directions: tc tbf on both ends of each host's veth"},
                     {"delay", "on what each host sends: tc netem on the host's end"},
                     {"loss", "on what each host sends: an nftables rule in the host's output hook"}};
    }
    ordered_json results = ordered_json::array();
    for (const Row& r : rows) {
      results.push_back({{"strategy", r.strategy},
                         {"seconds_median", r.seconds_median},
                         {"gbps", r.gbps},
                         {"network_bytes", r.network_bytes},
                         {"minimum_network_bytes", r.minimum_network_bytes},
                         {"local_bytes", r.local_bytes},
                         {"verified", r.verified},
                         {"mode", r.mode},
                         {"refresh_seconds_median", r.refresh_seconds_median},
                         {"pause_seconds_median", r.pause_seconds_median},
                         {"publish_seconds_median", r.publish_seconds_median},
                         {"cpu_seconds_median", r.cpu_seconds_median},
                         {"machine_cpu_seconds_median", r.machine_cpu_seconds_median},
                         {"completed", r.completed},
                         {"error", r.error.empty() ? ordered_json(nullptr) : ordered_json(r.error)}});
      if (r.predicted) {
        results.back()["predicted_seconds"] = r.predicted->seconds;
        results.back()["predicted_model"] = r.predicted->model;
        results.back()["predicted_host_cpu_seconds"] = r.predicted->host_cpu_seconds;
        results.back()["predicted_host_bound"] = r.predicted->host_bound;
        results.back()["measured_over_predicted"] =
            r.predicted->seconds > 0 ? r.seconds_median / r.predicted->seconds : 0.0;
      }
      if (serve_check) {
        results.back()["serve_reads"] = r.serve_reads;
        results.back()["mixed_version_reads"] = r.mixed_version_reads;
      }
      ordered_json& j = results.back();
      auto text_or_null = [](const std::string& t) { return t.empty() ? ordered_json(nullptr) : ordered_json(t); };
      if (!kill_text.empty()) {
        j["killed"] = text_or_null(r.killed);
        j["killed_version"] = r.killed_version;
        j["kill_error"] = text_or_null(r.kill_error);
        j["kill_missed"] = r.kill_missed;
        j["kill_refresh_seconds"] = r.kill_refresh_seconds;
        j["committed_without_killed"] = r.committed_without_killed;
        if (r.live_weights_intact) j["live_weights_intact"] = *r.live_weights_intact;
        if (rejoin) {
          j["rejoined"] = text_or_null(r.rejoined);
          j["rejoin_seconds"] = r.rejoin_seconds;
        }
      }
      if (churn > 0) {
        j["churn"] = churn;
        j["rejoins"] = r.rejoins;
        j["rejoin_seconds_median"] = r.churn_seconds_median;
        j["rejoin_seconds_max"] = r.churn_seconds_max;
      }
      if (late_join > 0) j["late_joined"] = text_or_null(r.late_joined);
      if (hosts) {
        j["link_bytes"] = r.link_bytes;
        j["plan_network_bytes_by_host"] = r.plan_bytes_by_host;
      }
      if (!partition_text.empty()) {
        j["partitioned"] = text_or_null(r.partitioned);
        j["partitioned_version"] = r.partitioned_version;
        j["partition_refresh_seconds"] = r.partition_refresh_seconds;
        j["partition_failed_receivers"] = r.partition_failed;
        j["partition_error"] = text_or_null(r.partition_error);
        if (r.partition_live_intact) j["live_weights_intact"] = *r.partition_live_intact;
        j["partition_missed"] = r.partition_missed;
      }
      j["rss_first_kib"] = r.rss_first_kib;
      j["rss_last_kib"] = r.rss_last_kib;
      j["rss_max_growth_kib"] = r.rss_max_growth_kib;
      j["rss_max_growth_process"] = text_or_null(r.rss_max_growth_process);
      j["heap_first_kib"] = r.heap_first_kib;
      j["heap_last_kib"] = r.heap_last_kib;
      ordered_json rss = ordered_json::array();
      for (const auto& p : r.resident)
        rss.push_back({{"process", p.process},
                       {"pid", p.pid},
                       {"first_version", p.first_version},
                       {"first_kib", p.first_kib},
                       {"last_version", p.last_version},
                       {"last_kib", p.last_kib},
                       {"first_heap_kib", p.first_heap_kib},
                       {"last_heap_kib", p.last_heap_kib}});
      j["rss"] = std::move(rss);
    }
    doc["results"] = std::move(results);
    std::ofstream out(json_out);
    out << doc.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "refit-bench: cannot write %s\n", json_out.c_str());
      return kExitFailed;
    }
  }
  if (!reports_out.empty()) {
    std::ofstream out(reports_out);
    out << all_reports.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "refit-bench: cannot write %s\n", reports_out.c_str());
      return kExitFailed;
    }
  }
  if (!all_ok || trace_failed) return kExitFailed;
  return any_kill_missed ? kExitUntested : 0;
}
