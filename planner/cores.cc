#include "planner/cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

namespace refit {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The lines of /proc/self/cgroup: "id:controllers:path".
struct CgroupLine {
  std::string controllers;
  std::string path;
};
std::vector<CgroupLine> parse_cgroups(std::string_view text) {
  std::vector<CgroupLine> out;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    const size_t a = line.find(':');
    const size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    out.push_back(CgroupLine{std::string(line.substr(a + 1, b - a - 1)), std::string(line.substr(b + 1))});
  }
  return out;
}

// Whether a v1 line's comma-separated controllers include "cpu".
bool has_cpu(const std::string& controllers) {
  std::string_view c = controllers;
  while (!c.empty()) {
    const size_t end = std::min(c.find(','), c.size());
    if (c.substr(0, end) == "cpu") return true;
    c.remove_prefix(std::min(end + 1, c.size()));
  }
  return false;
}

// The folders from `dir`/`path` up to `dir` itself, the deepest first. A
// process in a cgroup namespace sees its own cgroup as "/", mounted at `dir`.
std::vector<std::string> up_from(const std::string& dir, const std::string& path) {
  std::vector<std::string> out;
  std::string p = path;
  while (!p.empty() && p.back() == '/') p.pop_back();
  for (;;) {
    out.push_back(dir + p);
    if (p.empty()) break;
    p.resize(p.rfind('/') == std::string::npos ? 0 : p.rfind('/'));
  }
  return out;
}

// Cores a quota of `quota` microseconds per `period` allows, rounded up;
// 0 for none.
int quota_cores(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return 0;
  const double cores = std::ceil(quota / period);
  return cores >= 1e6 ? 0 : std::max(1, static_cast<int>(cores));
}

// The smallest quota of the cgroups along `dirs`, 0 for none. v2: cpu.max
// is "max PERIOD" or "QUOTA PERIOD"; v1: cpu.cfs_quota_us (-1: none) and
// cpu.cfs_period_us.
int smallest_quota(const std::vector<std::string>& dirs, bool v2) {
  int best = 0;
  for (const std::string& d : dirs) {
    int cores = 0;
    if (v2) {
      std::istringstream in(read_file(d + "/cpu.max"));
      std::string quota;
      double period = 0;
      if (in >> quota >> period && quota != "max") cores = quota_cores(std::atof(quota.c_str()), period);
    } else {
      std::istringstream q(read_file(d + "/cpu.cfs_quota_us"));
      std::istringstream p(read_file(d + "/cpu.cfs_period_us"));
      double quota = 0, period = 0;
      if (q >> quota && p >> period) cores = quota_cores(quota, period);
    }
    if (cores > 0 && (best == 0 || cores < best)) best = cores;
  }
  return best;
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int usable_cores_from(int affinity, std::string_view proc_self_cgroup, const std::string& cgroup_root) {
  int cores = std::max(1, affinity);
  for (const CgroupLine& l : parse_cgroups(proc_self_cgroup)) {
    int quota = 0;
    if (l.controllers.empty()) {  // v2: "0::/path"
      quota = smallest_quota(up_from(cgroup_root, l.path), true);
    } else if (has_cpu(l.controllers)) {  // v1, mounted as cpu,cpuacct or cpu
      for (const char* dir : {"/cpu,cpuacct", "/cpu"}) {
        quota = smallest_quota(up_from(cgroup_root + dir, l.path), false);
        if (quota > 0) break;
      }
    }
    if (quota > 0) cores = std::min(cores, quota);
  }
  return cores;
}

int usable_cores() {
  return usable_cores_from(affinity_cores(), read_file("/proc/self/cgroup"), "/sys/fs/cgroup");
}

}  // namespace refit
