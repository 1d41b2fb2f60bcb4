#include "transport/common/threads.h"

#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <new>
#include <system_error>

namespace refit {

struct ThreadFactory::Budget {
  std::atomic<int64_t> left{0};
};

ThreadFactory ThreadFactory::refusing_after(int64_t allowed) {
  ThreadFactory f;
  f.budget_ = std::make_shared<Budget>();
  f.budget_->left.store(allowed);
  return f;
}

void ThreadFactory::set_log(std::function<void(const std::string&)> log) {
  log_ = log ? std::make_shared<const LogFn>(std::move(log)) : nullptr;
}

namespace {

void write_log(const std::shared_ptr<const std::function<void(const std::string&)>>& log, const std::string& line) {
  try {
    if (log) {
      (*log)(line);
      return;
    }
  } catch (...) {  // a log that throws: stderr still gets the line
  }
  std::fprintf(stderr, "refit: %s\n", line.c_str());
}

}  // namespace

std::string ThreadFactory::system_name(const std::string& what) {
  // Linux keeps 15 bytes of a thread's name.
  std::string name = ("refit " + what).substr(0, 15);
  while (!name.empty() && name.back() == ' ') name.pop_back();
  return name;
}

Result<std::thread> ThreadFactory::start(const std::string& what, std::function<void()> body,
                                         std::function<void(const Status&)> on_exception) const {
  try {
    if (budget_ && budget_->left.fetch_sub(1) <= 0) {
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "refused by the test-only \"refuse_threads_after\"");
    }
    return std::thread([what, log = log_, body = std::move(body), on_exception = std::move(on_exception)] {
      // Best effort: a name the system refuses leaves the thread unnamed.
      pthread_setname_np(pthread_self(), system_name(what).c_str());
      std::string why;
      try {
        body();
        return;
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
        why = "an exception that is not a std::exception";
      }
      const Status failed = Status::internal("the " + what + " thread failed: " + why);
      write_log(log, failed.message());
      if (!on_exception) return;
      try {
        on_exception(failed);
      } catch (...) {
        write_log(log, "the " + what + " thread failed, and releasing its waiters failed too");
      }
    });
  } catch (const std::system_error& e) {
    return Status::io_error("cannot start the " + what + " thread: " + e.what() +
                            " (the process may be at its thread limit)")
        .with_reason(Reason::kNoThread);
  } catch (const std::bad_alloc&) {
    return Status::io_error("cannot start the " + what + " thread: out of memory").with_reason(Reason::kNoThread);
  }
}

}  // namespace refit
