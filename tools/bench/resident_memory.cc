#include "tools/bench/resident_memory.h"

#include <malloc.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace refit::bench {

Result<int64_t> resident_kib(pid_t pid) {
  const std::string path = pid == 0 ? "/proc/self/status" : "/proc/" + std::to_string(pid) + "/status";
  std::ifstream in(path);
  if (!in) return Status::not_found(path + ": cannot open (is the process gone?)");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    std::istringstream fields(line.substr(6));
    int64_t kib = -1;
    std::string unit;
    fields >> kib >> unit;
    if (kib < 0 || unit != "kB") return Status::internal(path + ": cannot read \"" + line + "\"");
    return kib;
  }
  return Status::not_found(path + ": no VmRSS line (a zombie or a kernel thread?)");
}

int64_t heap_in_use_kib() {
  const struct mallinfo2 m = ::mallinfo2();
  return static_cast<int64_t>((m.uordblks + m.hblkhd) / 1024);
}

double machine_busy_seconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  if (!(in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu") return 0;
  const long ticks = sysconf(_SC_CLK_TCK);
  return static_cast<double>(user + nice + system + irq + softirq + steal) / static_cast<double>(ticks > 0 ? ticks : 100);
}

double processes_cpu_seconds(std::span<const pid_t> pids) {
  const long ticks = sysconf(_SC_CLK_TCK);
  uint64_t sum = 0;
  for (pid_t pid : pids) {
    std::ifstream in(pid == 0 ? std::string("/proc/self/stat") : "/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!in || !std::getline(in, text)) continue;  // gone
    const size_t paren = text.rfind(')');  // the command name may hold spaces
    if (paren == std::string::npos || paren + 2 > text.size()) continue;
    std::istringstream fields(text.substr(paren + 2));
    std::string f;
    uint64_t utime = 0, stime = 0;
    for (int i = 3; i <= 15 && fields >> f; ++i) {
      if (i == 14) utime = std::strtoull(f.c_str(), nullptr, 10);
      if (i == 15) stime = std::strtoull(f.c_str(), nullptr, 10);
    }
    sum += utime + stime;
  }
  return static_cast<double>(sum) / static_cast<double>(ticks > 0 ? ticks : 100);
}

}  // namespace refit::bench
