#include "plugin/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace refit::plugin {

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
  const std::string line = "refit[" + who_ + "] " + kNames[static_cast<int>(level)] + ": " + message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of threads do not interleave
}

}  // namespace refit::plugin
