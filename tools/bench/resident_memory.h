#pragma once
// Resident memory of a process, as the kernel counts it: VmRSS of
// /proc/PID/status, in KiB. The bench samples its long-lived processes (every
// rank and itself, with the coordinator) at the first and the last version,
// so that a run of many refreshes shows whether memory stays flat.

#include <sys/types.h>

#include <cstdint>
#include <span>

#include "planner/status.h"

namespace refit::bench {

// VmRSS of process `pid` (0: this process) in KiB; an error naming the file
// when it cannot be read (the process is gone) or has no VmRSS line.
Result<int64_t> resident_kib(pid_t pid = 0);

// What this process has allocated with malloc and not freed, in KiB
// (glibc's mallinfo2: arena bytes in use plus mmapped chunks). Beside VmRSS
// it tells a leak (both grow) from memory that was freed but that malloc
// keeps for reuse (VmRSS grows, this does not). Counted by the process's own
// malloc, so a process reports it about itself.
int64_t heap_in_use_kib();

// CPU time the whole machine has spent busy (user, nice, system, irq,
// softirq and steal of /proc/stat's "cpu" line, all cores together) since
// boot, in seconds; the bench takes it before and after a refresh, so that
// the difference is the CPU a strategy costs (everything on the machine, in
// clock ticks of 10 ms). 0 when /proc/stat cannot be read.
double machine_busy_seconds();

// CPU time (user and system, all threads, those that ended included) that
// the processes `pids` (0: this process) have used since they started, in
// seconds, summed; from fields 14 and 15 of /proc/PID/stat, in clock ticks
// of 10 ms. A process that is gone counts 0. The bench takes it before and
// after a refresh over its own processes: what the refresh cost them,
// whatever else runs on the machine.
double processes_cpu_seconds(std::span<const pid_t> pids);

}  // namespace refit::bench
