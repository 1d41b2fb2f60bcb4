#include "plugin/trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace refit::plugin {

namespace {

int64_t micros(Trace::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

// Writes all of `data` at `offset`; false on any failure.
bool write_at(int fd, const std::string& data, int64_t offset) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<Trace>> Trace::open(const std::string& path, const std::string& role, int32_t rank,
                                           const Log& log) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::io_error("config: \"trace\": cannot write \"" + path + "\": " + std::strerror(errno));
  }
  std::unique_ptr<Trace> t(new Trace(fd, path, rank, log));
  t->pid_ = ::getpid();
  const std::string name = role + " " + std::to_string(rank);
  t->add({{"ph", "M"}, {"name", "process_name"}, {"pid", t->pid_}, {"args", {{"name", name}}}});
  t->add({{"ph", "M"}, {"name", "thread_name"}, {"pid", t->pid_}, {"tid", rank}, {"args", {{"name", name}}}});
  t->flush();
  std::lock_guard<std::mutex> lock(t->mu_);
  if (t->fd_ < 0) return Status::io_error("config: \"trace\": cannot write \"" + path + "\"");
  return t;
}

Trace::~Trace() {
  flush();
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) ::close(fd_);
}

void Trace::add(nlohmann::json event) {
  std::string text = event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) pending_.push_back(std::move(text));
}

void Trace::span(const char* name, Clock::time_point begin, Clock::time_point end, nlohmann::json args) {
  args["rank"] = rank_;
  add({{"ph", "X"},
       {"name", name},
       {"cat", "refit"},
       {"pid", pid_},
       {"tid", rank_},
       {"ts", micros(begin)},
       {"dur", std::max<int64_t>(0, micros(end) - micros(begin))},
       {"args", std::move(args)}});
}

void Trace::counter(const char* name, Clock::time_point at, double value) {
  add({{"ph", "C"}, {"name", name}, {"pid", pid_}, {"tid", rank_}, {"ts", micros(at)}, {"args", {{"bytes", value}}}});
}

void Trace::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ < 0 || pending_.empty()) return;
  // The events replace the closing bracket, which follows them again.
  std::string out = any_ ? ",\n" : "[\n";
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (i > 0) out += ",\n";
    out += pending_[i];
  }
  const std::string tail = "\n]\n";
  if (!write_at(fd_, out + tail, end_)) {
    log_.warn("trace \"" + path_ + "\": a write failed (" + std::strerror(errno) + "); tracing stops, the refreshes go on");
    ::close(fd_);
    fd_ = -1;
    pending_.clear();
    return;
  }
  end_ += static_cast<int64_t>(out.size());
  any_ = true;
  pending_.clear();
}

}  // namespace refit::plugin
