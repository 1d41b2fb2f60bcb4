#pragma once
// A receiver's trace ("trace": "PATH", include/refit/refit.h): every
// refresh as Chrome trace events (the JSON array format, which Perfetto and
// chrome://tracing open), one track per rank: the process is this process,
// the thread id is the rank. docs/operations.md lists the spans.
//
// Events are kept in memory while a refresh runs and written when it ends
// (flush()), so that writing the file never slows the transfer. The file is
// valid JSON after every flush: the closing "]" is written each time and
// overwritten by the next flush. A file that cannot be opened fails at
// create; a write that fails later is logged once and the trace stops,
// never the refresh.
//
// Timestamps are CLOCK_MONOTONIC (steady_clock) in microseconds, the same
// clock in every process of a machine, so that the traces of many ranks
// merge into one timeline (refit-bench --trace).
//
// Thread safety: every method may be called from any thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/status.h"
#include "plugin/log.h"

namespace refit::plugin {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;

  // Creates (truncates) `path` and writes the track's names: "receiver
  // RANK". A path that cannot be written fails naming it.
  static Result<std::unique_ptr<Trace>> open(const std::string& path, const std::string& role, int32_t rank,
                                             const Log& log);
  ~Trace();  // flushes
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // A complete span ("ph": "X") on this rank's track.
  void span(const char* name, Clock::time_point begin, Clock::time_point end,
            nlohmann::json args = nlohmann::json::object());
  // A counter sample ("ph": "C"): its value from `at` on.
  void counter(const char* name, Clock::time_point at, double value);
  // Appends what was recorded since the last flush to the file.
  void flush();

 private:
  Trace(int fd, std::string path, int32_t rank, const Log& log) : fd_(fd), path_(std::move(path)), rank_(rank), log_(log) {}
  void add(nlohmann::json event);

  std::mutex mu_;
  int fd_ = -1;             // mu_; -1 once a write failed
  std::string path_;
  int32_t rank_ = 0;
  int64_t pid_ = 0;
  const Log& log_;
  std::vector<std::string> pending_;  // mu_: serialized events not yet written
  int64_t end_ = 0;        // mu_: where the closing "\n]\n" starts
  bool any_ = false;       // mu_: an event was written
};

// A span from its construction to its destruction (or end()); a null
// trace records nothing.
class TraceSpan {
 public:
  TraceSpan(Trace* trace, const char* name) : trace_(trace), name_(name), begin_(Trace::Clock::now()) {}
  ~TraceSpan() { end(); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  // Adds an argument shown with the span.
  template <typename T>
  void arg(const char* key, const T& value) {
    if (trace_) args_[key] = value;
  }
  void end() {
    if (trace_) trace_->span(name_, begin_, Trace::Clock::now(), std::move(args_));
    trace_ = nullptr;
  }

 private:
  Trace* trace_;
  const char* name_;
  Trace::Clock::time_point begin_;
  nlohmann::json args_ = nlohmann::json::object();
};

}  // namespace refit::plugin
