#include "planner/cores.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
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

// The lines of `text`, and the fields of a line split at `sep`.
std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t end = text.find(sep);
    out.push_back(text.substr(0, end));
    if (end == std::string_view::npos) return out;
    text.remove_prefix(end + 1);
  }
}

// Whether the comma-separated `list` holds `item`.
bool lists(std::string_view list, std::string_view item) {
  for (std::string_view x : split(list, ','))
    if (x == item) return true;
  return false;
}

// A path as mountinfo writes it: space, tab, newline and backslash as
// three octal digits after a backslash.
std::string unescape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() &&
        std::all_of(s.begin() + i + 1, s.begin() + i + 4, [](char c) { return c >= '0' && c <= '7'; })) {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// A mount of a cgroup hierarchy: the cgroup it shows at its mount point,
// and whether it is v2 or (v1) has the cpu controller.
struct CgroupMount {
  std::string root;
  std::string point;
  bool v2 = false;
};

std::vector<CgroupMount> cgroup_mounts(std::string_view mountinfo) {
  // "ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER"
  std::vector<CgroupMount> out;
  for (std::string_view line : split(mountinfo, '\n')) {
    const std::vector<std::string_view> f = split(line, ' ');
    size_t dash = 6;
    while (dash < f.size() && f[dash] != "-") ++dash;
    if (dash + 3 >= f.size()) continue;
    const std::string_view type = f[dash + 1];
    const bool v2 = type == "cgroup2";
    if (!v2 && !(type == "cgroup" && lists(f[dash + 3], "cpu"))) continue;
    out.push_back(CgroupMount{unescape(f[3]), unescape(f[4]), v2});
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

// The quota of the cgroup in folder `dir`, 0 for none. v2: cpu.max is
// "max PERIOD" or "QUOTA PERIOD"; v1: cpu.cfs_quota_us (-1: none) and
// cpu.cfs_period_us.
int quota_of(const std::string& dir, bool v2) {
  if (v2) {
    std::istringstream in(read_file(dir + "/cpu.max"));
    std::string quota;
    double period = 0;
    if (in >> quota >> period && quota != "max") return quota_cores(std::atof(quota.c_str()), period);
    return 0;
  }
  std::istringstream q(read_file(dir + "/cpu.cfs_quota_us"));
  std::istringstream p(read_file(dir + "/cpu.cfs_period_us"));
  double quota = 0, period = 0;
  return q >> quota && p >> period ? quota_cores(quota, period) : 0;
}

// The smallest quota of cgroup `path` (from its hierarchy's root) and the
// cgroups above it that `m` shows, 0 for none or when `m` does not show
// it. A mount may show a cgroup below the root (a container's own cgroup,
// bind-mounted): the path is taken relative to that.
int smallest_quota(const CgroupMount& m, const std::string& path) {
  std::string rel;
  if (m.root == "/") {
    rel = path;
  } else if (path == m.root || (path.size() > m.root.size() && path.compare(0, m.root.size(), m.root) == 0 &&
                                path[m.root.size()] == '/')) {
    rel = path.substr(m.root.size());
  } else {
    return 0;
  }
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  int best = 0;
  for (;;) {
    const int q = quota_of(m.point + rel, m.v2);
    if (q > 0 && (best == 0 || q < best)) best = q;
    if (rel.empty()) return best;
    rel.resize(rel.rfind('/'));
  }
}

int affinity_cores() {
  for (int cpus = CPU_SETSIZE; cpus <= (1 << 20); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const size_t size = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(size, set);
    const int rc = sched_getaffinity(0, size, set);
    const int n = rc == 0 ? CPU_COUNT_S(size, set) : 0;
    const int err = errno;
    CPU_FREE(set);
    if (rc == 0 && n > 0) return n;
    if (rc != 0 && err != EINVAL) break;  // EINVAL: the mask is larger than this
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int usable_cores_from(int affinity, std::string_view proc_self_cgroup, std::string_view proc_self_mountinfo) {
  int cores = std::max(1, affinity);
  const std::vector<CgroupMount> mounts = cgroup_mounts(proc_self_mountinfo);
  if (mounts.empty()) return cores;
  for (std::string_view line : split(proc_self_cgroup, '\n')) {
    // "ID:CONTROLLERS:PATH"; v2 is "0::PATH". The path may hold colons.
    const size_t a = line.find(':');
    const size_t b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, a);
    const std::string_view controllers = line.substr(a + 1, b - a - 1);
    const std::string path(line.substr(b + 1));
    // A cgroup outside this process's cgroup namespace ("/../x") is not
    // one its mounts show.
    const std::vector<std::string_view> parts = split(path, '/');
    if (path.empty() || path[0] != '/' || std::find(parts.begin(), parts.end(), "..") != parts.end()) continue;
    const bool v2 = controllers.empty();
    if (v2 ? id != "0" : !lists(controllers, "cpu")) continue;
    for (const CgroupMount& m : mounts) {
      if (m.v2 != v2) continue;
      const int q = smallest_quota(m, path);
      if (q > 0) cores = std::min(cores, q);
    }
  }
  return cores;
}

int usable_cores() {
  return usable_cores_from(affinity_cores(), read_file("/proc/self/cgroup"), read_file("/proc/self/mountinfo"));
}

}  // namespace refit
