#pragma once
// How many cores this process may use: what "one per core" means for the
// planner's and the simulator's threads. std::thread::hardware_concurrency()
// counts the machine's cores, whatever the process is allowed: a planner in
// a container limited to 2 CPUs of a 128-core host started 128 threads
// (docs/planner.md, "Planning on threads").

#include <string>
#include <string_view>

namespace refit {

// The cores this process may run on (its CPU affinity), lowered to its
// cgroup's CPU quota rounded up (cgroup v2 cpu.max, or v1
// cpu.cfs_quota_us over cpu.cfs_period_us, the smallest of its cgroup and
// the cgroups above it), at least 1, as they stand at the call.
int usable_cores();

// The same from what usable_cores() reads: the number of CPUs in the
// affinity mask, the text of /proc/self/cgroup and the folder the cgroup
// file systems are mounted under (normally /sys/fs/cgroup). A quota file
// that is missing or unreadable limits nothing.
int usable_cores_from(int affinity, std::string_view proc_self_cgroup, const std::string& cgroup_root);

}  // namespace refit
