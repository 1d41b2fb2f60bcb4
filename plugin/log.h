#pragma once
// The library's log: one line per event to stderr, "refit[source 3] warn: ...".
// The level comes from the agent's config; REFIT_LOG_LEVEL (error, warn,
// info, debug) overrides it. Thread-safe.

#include <string>

#include "plugin/config.h"

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

}  // namespace refit::plugin
