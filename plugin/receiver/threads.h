#pragma once
// How the receiver starts its threads. std::thread throws std::system_error
// when the system refuses a thread; every thread the receiver starts goes
// through start_thread(), which turns that into a Status (reason kNoThread),
// so that running out of threads fails the refresh instead of terminating
// the host process.
//
// Tests make the factory refuse threads through the test-only config key
// "test": {"refuse_threads_after": N} (include/refit/refit.h): it starts N
// threads, then refuses every later one as the system would.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "planner/status.h"

namespace refit::plugin::receiver {

class ThreadFactory {
 public:
  // A factory that starts every thread it is asked for.
  ThreadFactory() = default;
  // A factory that starts `allowed` threads and refuses the rest (tests).
  static ThreadFactory refusing_after(int64_t allowed);

  // Starts `body` on a new thread; `what` names it in the error.
  Result<std::thread> start(const std::string& what, std::function<void()> body) const;

 private:
  struct Budget;
  std::shared_ptr<Budget> budget_;  // null: no limit
};

}  // namespace refit::plugin::receiver
