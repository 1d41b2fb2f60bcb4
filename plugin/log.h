#pragma once
// The library's log: one line per event, "refit[source 3] warn: ...", to
// stderr, or to the host's callback (refit_set_log_callback, one per
// process). The level comes from the agent's config; REFIT_LOG_LEVEL (error,
// warn, info, debug) overrides it. Thread-safe.

#include <string>

#include "plugin/config.h"
#include "refit/refit.h"

namespace refit::plugin {

class Log {
 public:
  Log(std::string who, LogLevel level);
  bool enabled(LogLevel level) const { return level <= level_; }
  void write(LogLevel level, const std::string& message) const;
  void error(const std::string& m) const { write(LogLevel::kError, m); }
  void warn(const std::string& m) const { write(LogLevel::kWarn, m); }
  void info(const std::string& m) const { write(LogLevel::kInfo, m); }
  void debug(const std::string& m) const { write(LogLevel::kDebug, m); }

 private:
  std::string who_;
  LogLevel level_;
};

// Sends every log line of every agent of the process to `fn` (with `user`),
// or to stderr again when `fn` is null. Lines are delivered one at a time:
// the callback is never entered by two threads at once, and once this
// returns no call to the previous callback is running or will start.
void set_log_callback(refit_log_fn fn, void* user);

}  // namespace refit::plugin
