#pragma once
// The body of one rank's child process: a command loop over its Channel that
// drives librefit through the C ABI only (the function table of
// refit_get_api), on host buffers laid out as a planner Layout says.
//
// A process may hold a source, a receiver, or both (the broadcast baseline's
// gatherer is a receiver of the trainers and a source for everyone else).
// Buffers are allocated once per name: a source buffer and a receiver buffer
// of the same name and size are the same memory. Receiver buffers start out
// holding kGuardByte, so that verification also sees bytes written outside
// every segment.
//
// Commands (JSON objects with "cmd"), each answered by {"ok": true, ...} or
// {"ok": false, "error": "..."}:
//   {"cmd": "source", "config": "<JSON text>"}     create, add every tensor, join
//   {"cmd": "receiver", "config": "<JSON text>"}   create, add every buffer, join
//       Both take "join_retry_ms": t: while the coordinator still holds
//       this rank for a predecessor that died (until it declares it dead,
//       its heartbeat timeout), join again every 100 ms for at most t ms.
//       -> {"join_seconds", "join_attempts"}
//   {"cmd": "rejoin", "config": "<JSON text>", "join_retry_ms": t}
//       leave and come back: refit_receiver_destroy, then create, add the
//       same buffers (the memory the server reads stays) and join as
//       "receiver" does -> {"seconds", "leave_seconds", "join_seconds"}
//   {"cmd": "ping"}                                answered at once
//   {"cmd": "memory"} -> {"heap_kib"}: heap_in_use_kib() (resident_memory.h)
//   {"cmd": "fill", "version": v}                  write the pattern of v into the source buffers
//   {"cmd": "drain", "version": v, "timeout_ms": t} refit_source_wait_drained
//   {"cmd": "publish", "version": v}
//   {"cmd": "refresh", "version": v, "timeout_ms": t}
//       -> {"seconds", "end_ns", "report": {...}}
//   {"cmd": "pause"}   direct mode with serve_check: take the server's lock
//       exclusively (waits for the reader's current read); the next
//       "refresh" releases it when it returns, as a server pauses for a
//       direct refresh
//   {"cmd": "commit"}  staged mode: refit_receiver_commit under the server's
//       exclusive lock -> {"seconds", "end_ns", "report": {...}}
//   {"cmd": "unpack", "version": v}  copy the final layout's slices out of the
//       scratch buffers (under the server's exclusive lock) -> {"seconds", "end_ns"}
//   {"cmd": "serve_stats"} -> {"reads", "mixed_version_reads"} so far
//   {"cmd": "verify", "version": v}                check every receiver (or final) buffer byte
//   {"cmd": "exit"}                                destroy the agents and leave with 0
// Times are stamped with monotonic_ns() when the work ended.
//
// With serve_check, a receiver process runs a reader thread (started after
// the fork, once the receiver exists) that stands in for a server: it reads
// the live buffers (the final ones for broadcast) over and over, each full
// read under a shared lock (std::shared_mutex), and checks a sample of the
// elements of every segment (every sample_every-th, plus each segment's first
// and last) against the pattern of the live version and its neighbours. A
// read is mixed when no one version matches every sampled element (elements
// of two versions, or of none). Reads start once a first version is live.
// Whatever writes the live buffers takes the lock exclusively: "commit",
// "unpack", and a direct "refresh" after "pause".

#include <chrono>
#include <cstdint>
#include <string>

#include "planner/layout.h"
#include "tools/bench/process_group.h"

namespace refit::bench {

struct AgentSpec {
  const Layout* source_layout = nullptr;  // with source_rank: the tensors this process serves
  int32_t source_rank = -1;
  const Layout* receiver_layout = nullptr;  // with receiver_rank: the buffers this process refreshes
  int32_t receiver_rank = -1;
  // Broadcast stage 2: the buffers the receiver's scratch buffers are copied
  // into ("unpack") and that "verify" then checks.
  const Layout* final_layout = nullptr;
  int32_t final_rank = -1;
  // Run the serving reader (see above) in a receiver process.
  bool serve_check = false;
  int64_t sample_every = 4096;
  // The host's buffers on transparent huge pages (as the library allocates
  // its own), or on small pages.
  bool huge_pages = true;
  // How long the child waits for its next command before it gives up.
  std::chrono::milliseconds idle_timeout{300000};
};

// Runs the command loop until "exit" (returns 0) or until the parent goes
// away or stays silent past idle_timeout (returns 3).
int run_agent(const AgentSpec& spec, Channel& channel);

// A standby process, forked with the others before any thread exists, that
// takes the place of a rank that dies: it answers "ping" and "exit" until
// {"cmd": "become"} arrives (answered with {"pid"}), then runs
// run_agent(spec) as the rank's own process would. Returns as run_agent does.
int run_standby(const AgentSpec& spec, Channel& channel);

}  // namespace refit::bench
