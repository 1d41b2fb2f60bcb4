#pragma once
// The library's log: one line per event, to stderr, or to the host's
// callback (refit_set_log_callback, one per process). The level comes from
// the agent's config; REFIT_LOG_LEVEL (error, warn, info, debug) overrides
// it. Every line names the agent's role and rank and the version its work
// concerns now ("v-" before it has one), in one of two formats
// ("log_format", docs/operations.md):
//   text  refit[receiver 3] [v7] warn: refresh failed ...   (stderr)
//         refit[receiver 3] [v7] refresh failed ...         (the callback,
//                                                           which gets the level apart)
//   json  {"time": "2026-12-01T22:04:05.123456Z", "level": "warn",
//          "role": "receiver", "rank": 3, "version": 7, "message": "..."}
//         (the same object to stderr and the callback; "version": null
//         before the agent has one)
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <string>

#include "plugin/config.h"
#include "refit/refit.h"

namespace refit::plugin {

class Log {
 public:
  Log(std::string role, int32_t rank, LogLevel level, LogFormat format = LogFormat::kText);
  // The version the agent's work concerns from now on (a refresh's, once
  // leased; a publish's); lines carry it.
  void set_version(int64_t version) const { version_.store(version, std::memory_order_relaxed); }
  bool enabled(LogLevel level) const { return level <= level_; }
  void write(LogLevel level, const std::string& message) const;
  void error(const std::string& m) const { write(LogLevel::kError, m); }
  void warn(const std::string& m) const { write(LogLevel::kWarn, m); }
  void info(const std::string& m) const { write(LogLevel::kInfo, m); }
  void debug(const std::string& m) const { write(LogLevel::kDebug, m); }

 private:
  std::string line(LogLevel level, const std::string& message, bool with_level) const;

  std::string role_;
  int32_t rank_;
  LogLevel level_;
  LogFormat format_;
  mutable std::atomic<int64_t> version_{0};  // 0: none yet
};

// Sends every log line of every agent of the process to `fn` (with `user`),
// or to stderr again when `fn` is null. Lines are delivered one at a time:
// the callback is never entered by two threads at once, and once this
// returns no call to the previous callback is running or will start.
void set_log_callback(refit_log_fn fn, void* user);

}  // namespace refit::plugin
