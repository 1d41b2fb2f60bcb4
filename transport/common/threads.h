#pragma once
// How refit starts its threads. std::thread throws std::system_error when
// the system refuses a thread, and std::terminate ends the process when a
// thread's body lets an exception out; refit may live inside a trainer or
// an inference server, so every thread of the library (the agents', the
// coordinator link's, the transports', the embedded coordinator's) starts
// through ThreadFactory::start(), which turns both into values:
//  - a refused thread is a Status (code kIoError, reason kNoThread) that
//    names the thread, returned by the call that wanted it;
//  - an exception that leaves a thread's body ends that thread only: it is
//    logged, and the starter's `on_exception` releases whoever waits on the
//    thread's work with an error.
//
// Tests make a factory refuse threads (refusing_after): the agents' test-only
// config key "test": {"refuse_threads_after": N} (include/refit/refit.h),
// or a factory handed to a transport object's options.
//
// Copies share their refusal budget and their log: an agent hands copies of
// its factory to the objects it owns, and N counts the threads of them all.
// Thread-safe.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "planner/status.h"

namespace refit {

class ThreadFactory {
 public:
  // A factory that starts every thread it is asked for and logs to stderr.
  ThreadFactory() = default;
  // A factory that starts `allowed` threads and refuses the rest, as the
  // system does at its thread limit (tests).
  static ThreadFactory refusing_after(int64_t allowed);

  // Where the lines about a thread's escaped exception go, for this factory
  // and its copies made from now on (default: stderr).
  void set_log(std::function<void(const std::string&)> log);

  // Starts `body` on a new thread; `what` names it in errors ("heartbeat"),
  // and to the system as system_name(what), which top -H, ps -T, perf and
  // gdb show.
  // Returns the thread, or a Status when the system refuses one (nothing
  // was started, and `body` is destroyed without running).
  // An exception that leaves `body` is caught on the thread: a line naming
  // the thread and the exception is logged, then `on_exception` (if given)
  // is called on that thread with a Status (kInternal) that says so, to
  // fail the work the thread stood for and wake its waiters. An exception
  // from `on_exception` itself is logged and dropped.
  Result<std::thread> start(const std::string& what, std::function<void()> body,
                            std::function<void(const Status&)> on_exception = {}) const;

  // "refit " + what, cut to the 15 bytes Linux keeps of a thread's name
  // ("refit heartbeat", "refit fan-out", "refit landing r").
  static std::string system_name(const std::string& what);

 private:
  struct Budget;
  using LogFn = std::function<void(const std::string&)>;
  std::shared_ptr<Budget> budget_;  // null: no limit
  std::shared_ptr<const LogFn> log_;  // null: stderr
};

}  // namespace refit
