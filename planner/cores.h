#pragma once
// How many cores this process may use: what "one per core" means for the
// planner's and the simulator's threads. std::thread::hardware_concurrency()
// counts the machine's cores, whatever the process is allowed: a planner in
// a container limited to 2 CPUs of a 128-core host started 128 threads
// (docs/planner.md, "Planning on threads").

#include <string_view>

namespace refit {

// The CPUs of the calling thread's affinity mask (the threads it starts
// inherit it), lowered to its cgroup's CPU quota rounded up: cgroup v2
// cpu.max, or v1 cpu.cfs_quota_us over cpu.cfs_period_us, the smallest of
// its cgroup and those above it as far as this process's mounts of the
// cgroup file systems show them. At least 1; read at every call (about
// 20 us), so a mask or quota changed meanwhile counts.
int usable_cores();

// The same from what usable_cores() reads: the number of CPUs in the
// affinity mask, the text of /proc/self/cgroup and that of
// /proc/self/mountinfo (which says where each cgroup hierarchy is mounted
// and which of its cgroups the mount shows as its root). A quota file that
// is missing or unreadable, or a cgroup no mount shows, limits nothing.
int usable_cores_from(int affinity, std::string_view proc_self_cgroup, std::string_view proc_self_mountinfo);

}  // namespace refit
