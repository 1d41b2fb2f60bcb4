#include "plugin/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace refit::plugin {
namespace {

// The host's callback. Calls into it are made holding the mutex, which
// serializes them (a host logger need not be thread-safe) and lets
// set_log_callback() promise that the old callback is no longer in use.
struct Sink {
  std::mutex mutex;
  refit_log_fn fn = nullptr;
  void* user = nullptr;
};

Sink& sink() {
  static Sink* s = new Sink;  // never destroyed: agents may log during static destruction
  return *s;
}

refit_log_level_t to_c(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return REFIT_LOG_ERROR;
    case LogLevel::kWarn: return REFIT_LOG_WARN;
    case LogLevel::kInfo: return REFIT_LOG_INFO;
    case LogLevel::kDebug: return REFIT_LOG_DEBUG;
  }
  return REFIT_LOG_ERROR;
}

}  // namespace

Log::Log(std::string who, LogLevel level) : who_(std::move(who)), level_(level) {
  if (const char* env = std::getenv("REFIT_LOG_LEVEL")) {
    if (!std::strcmp(env, "error")) level_ = LogLevel::kError;
    else if (!std::strcmp(env, "warn")) level_ = LogLevel::kWarn;
    else if (!std::strcmp(env, "info")) level_ = LogLevel::kInfo;
    else if (!std::strcmp(env, "debug")) level_ = LogLevel::kDebug;
  }
}

void Log::write(LogLevel level, const std::string& message) const {
  if (!enabled(level)) return;
  static const char* const kNames[] = {"error", "warn", "info", "debug"};
  Sink& s = sink();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.fn != nullptr) {
      const std::string line = "refit[" + who_ + "] " + message;
      s.fn(to_c(level), line.c_str(), s.user);
      return;
    }
  }
  const std::string line = "refit[" + who_ + "] " + kNames[static_cast<int>(level)] + ": " + message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of threads do not interleave
}

void set_log_callback(refit_log_fn fn, void* user) {
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.fn = fn;
  s.user = user;
}

}  // namespace refit::plugin
