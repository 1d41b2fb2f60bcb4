#include "plugin/receiver/threads.h"

#include <atomic>
#include <cerrno>
#include <new>
#include <system_error>

namespace refit::plugin::receiver {

struct ThreadFactory::Budget {
  std::atomic<int64_t> left{0};
};

ThreadFactory ThreadFactory::refusing_after(int64_t allowed) {
  ThreadFactory f;
  f.budget_ = std::make_shared<Budget>();
  f.budget_->left.store(allowed);
  return f;
}

Result<std::thread> ThreadFactory::start(const std::string& what, std::function<void()> body) const {
  try {
    if (budget_ && budget_->left.fetch_sub(1) <= 0) {
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "refused by the test-only \"refuse_threads_after\"");
    }
    return std::thread(std::move(body));
  } catch (const std::system_error& e) {
    return Status::io_error("cannot start the " + what + " thread: " + e.what() +
                            " (the process may be at its thread limit)")
        .with_reason(Reason::kNoThread);
  } catch (const std::bad_alloc&) {
    return Status::io_error("cannot start the " + what + " thread: out of memory").with_reason(Reason::kNoThread);
  }
}

}  // namespace refit::plugin::receiver
