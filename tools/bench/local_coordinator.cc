#include "tools/bench/local_coordinator.h"

#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "transport/control/auth.h"

namespace refit::bench {

namespace {
constexpr size_t kKeptLogLines = 100;
}

Result<std::string> write_token_file() {
  const char* dir = std::getenv("TMPDIR");
  std::string path = std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/refit-token-XXXXXX";
  int fd = ::mkstemp(path.data());  // mode 0600
  if (fd < 0) return Status::io_error("cannot create a token file " + path + ": " + std::strerror(errno));
  std::random_device rd;
  std::string token;
  static const char kHex[] = "0123456789abcdef";
  for (int i = 0; i < 64; ++i) token += kHex[rd() & 15];
  token += '\n';
  const bool ok = ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    return Status::io_error("cannot write the token file " + path);
  }
  return path;
}

Result<std::unique_ptr<LocalCoordinator>> LocalCoordinator::start(std::chrono::milliseconds heartbeat_timeout,
                                                                  const std::string& host, const std::string& metrics,
                                                                  int64_t relayout_below_bytes) {
  std::unique_ptr<LocalCoordinator> c(new LocalCoordinator());
  auto path = write_token_file();
  if (!path) return path.status();
  c->token_file_ = *path;
  auto token = control::read_token_file(c->token_file_);
  if (!token) return token.status();
  control::CoordinatorConfig cfg;
  cfg.host = host;
  cfg.port = 0;
  cfg.token = *token;
  if (heartbeat_timeout.count() > 0) cfg.heartbeat_timeout = heartbeat_timeout;
  cfg.relayout_below_bytes = relayout_below_bytes;
  LocalCoordinator* self = c.get();
  cfg.log = [self](const std::string& line) {
    std::lock_guard<std::mutex> lock(self->mu_);
    // A line repeated (members trying again, interleaved) is counted, not
    // kept again: it would push the line that says why out of the kept tail.
    const size_t recent = std::min<size_t>(self->logs_.size(), 8);
    for (auto it = self->logs_.end() - static_cast<std::ptrdiff_t>(recent); it != self->logs_.end(); ++it) {
      if (it->first == line) {
        ++it->second;
        return;
      }
    }
    self->logs_.emplace_back(line, 1);
    if (self->logs_.size() > kKeptLogLines) self->logs_.pop_front();
  };
  control::MetricsServerOptions metrics_options;
  auto fleet = std::make_shared<control::FleetMetrics>();
  if (!metrics.empty()) {
    REFIT_RETURN_IF_ERROR(control::parse_metrics_address(metrics, &metrics_options.host, &metrics_options.port));
    cfg.metrics = fleet;
    metrics_options.log = cfg.log;
  }
  auto started = control::Coordinator::start(std::move(cfg));
  if (!started) return started.status().with_context("coordinator");
  c->coordinator_ = std::move(*started);
  if (!metrics.empty()) {
    auto server = control::serve_metrics(*c->coordinator_, fleet, std::move(metrics_options));
    if (!server) return server.status().with_context("metrics " + metrics);
    c->metrics_server_ = std::move(*server);
  }
  c->address_ = host + ":" + std::to_string(c->coordinator_->port());
  return c;
}

LocalCoordinator::~LocalCoordinator() {
  stop();
  if (!token_file_.empty()) ::unlink(token_file_.c_str());
}

void LocalCoordinator::stop() {
  if (metrics_server_) metrics_server_->stop();
  metrics_server_.reset();
  if (coordinator_) coordinator_->stop();
  coordinator_.reset();
}

std::string LocalCoordinator::logs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [l, times] : logs_) {
    out += l + (times > 1 ? " (" + std::to_string(times) + " times)" : std::string()) + "\n";
  }
  return out;
}

}  // namespace refit::bench
