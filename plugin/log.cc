#include "plugin/log.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include <nlohmann/json.hpp>

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

Log::Log(std::string role, int32_t rank, LogLevel level, LogFormat format)
    : role_(std::move(role)), rank_(rank), level_(level), format_(format) {
  if (const char* env = std::getenv("REFIT_LOG_LEVEL")) {
    if (!std::strcmp(env, "error")) level_ = LogLevel::kError;
    else if (!std::strcmp(env, "warn")) level_ = LogLevel::kWarn;
    else if (!std::strcmp(env, "info")) level_ = LogLevel::kInfo;
    else if (!std::strcmp(env, "debug")) level_ = LogLevel::kDebug;
  }
}

namespace {

const char* const kLevelNames[] = {"error", "warn", "info", "debug"};

// UTC with microseconds: "2026-12-01T22:04:05.123456Z".
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;  // >= 0 after 1970
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];  // room for any int the format may get, so no truncation warning
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%06lldZ", tm.tm_year + 1900, tm.tm_mon + 1,
                tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<long long>(micros));
  return buf;
}

}  // namespace

std::string Log::line(LogLevel level, const std::string& message, bool with_level) const {
  const int64_t version = version_.load(std::memory_order_relaxed);
  const char* level_name = kLevelNames[static_cast<int>(level)];
  if (format_ == LogFormat::kJson) {
    nlohmann::json j{{"time", utc_now()}, {"level", level_name}, {"role", role_}, {"rank", rank_},
                     {"version", version > 0 ? nlohmann::json(version) : nlohmann::json(nullptr)},
                     {"message", message}};
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  const std::string v = version > 0 ? "[v" + std::to_string(version) + "] " : "[v-] ";
  return "refit[" + role_ + " " + std::to_string(rank_) + "] " + v + (with_level ? std::string(level_name) + ": " : "") +
         message;
}

void Log::write(LogLevel level, const std::string& message) const {
  if (!enabled(level)) return;
  Sink& s = sink();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.fn != nullptr) {
      const std::string text = line(level, message, /*with_level=*/false);
      s.fn(to_c(level), text.c_str(), s.user);
      return;
    }
  }
  const std::string text = line(level, message, /*with_level=*/true) + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr);  // one write: lines of threads do not interleave
}

void set_log_callback(refit_log_fn fn, void* user) {
  Sink& s = sink();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.fn = fn;
  s.user = user;
}

}  // namespace refit::plugin
