#pragma once
// Prometheus metrics: a registry of counters, gauges and histograms, and a
// small HTTP server that serves them as the Prometheus text format
// (version 0.0.4) on GET /metrics. docs/operations.md lists the metrics
// the coordinator exports and how to scrape them.
//
// The registry is thread-safe (one mutex): the coordinator's I/O thread
// updates it while the server's thread renders it.
//
// The server runs one thread of its own and is built to be exposed next to
// a training job without becoming a way to hurt it:
//  - read-only: only GET (and HEAD) of /metrics; any other path is 404, any
//    other method 405;
//  - a request's header must fit max_request_bytes, and arrive within
//    timeout; a connection serves one request and is closed;
//  - at most max_connections at once (more are closed at accept), and at
//    most max_requests_per_second answered (more get 429);
//  - with a bearer token, a request without "Authorization: Bearer TOKEN"
//    gets 401. The metrics hold no secret (no token, no address of a
//    member's memory), so the token is there for deployments whose policy
//    wants every endpoint authenticated.
// A failing server never affects the coordinator: it only reads the
// registry.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "planner/status.h"
#include "transport/common/threads.h"

namespace refit::control {

// Label names and values in a fixed order: {{"role", "source"}}.
using Labels = std::vector<std::pair<std::string, std::string>>;

class MetricsRegistry {
 public:
  enum class Type { kCounter, kGauge, kHistogram };

  // Declares a metric once, before its first update. `buckets` are the
  // histogram's upper bounds, ascending (+Inf is implied).
  void declare(const std::string& name, Type type, const std::string& help, std::vector<double> buckets = {});

  // Updates; a name that was not declared, or of another type, is ignored
  // (a programming error that must not take down the coordinator).
  void add(const std::string& name, const Labels& labels, double delta = 1);
  void set(const std::string& name, const Labels& labels, double value);
  void observe(const std::string& name, const Labels& labels, double value);
  // Drops every series of a gauge (e.g. before setting the current members).
  void clear(const std::string& name);
  // Drops one series (a label value that no longer exists).
  void erase(const std::string& name, const Labels& labels);

  // The value of one series (tests); 0 when absent.
  double value(const std::string& name, const Labels& labels) const;

  // The exposition: # HELP and # TYPE, then one line per series.
  std::string render() const;

 private:
  struct Series {
    double value = 0;                 // counters and gauges
    std::vector<uint64_t> counts;     // histograms: per bucket, not cumulative
    uint64_t count = 0;
    double sum = 0;
  };
  struct Metric {
    Type type = Type::kCounter;
    std::string help;
    std::vector<double> buckets;
    std::map<Labels, Series> series;
  };
  mutable std::mutex mu_;
  std::map<std::string, Metric> metrics_;
};

struct MetricsServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0: any free port; port() says which
  size_t max_connections = 64;
  size_t max_request_bytes = 8192;
  std::chrono::milliseconds timeout{5000};
  double max_requests_per_second = 20;
  std::string bearer_token;  // empty: no authentication
  std::function<void(const std::string&)> log;
  // Starts the server's thread (transport/common/threads.h): a refused one
  // fails start().
  ThreadFactory threads;
};

class MetricsServer {
 public:
  // Listens on options.host:options.port and serves render() on GET /metrics.
  // A host that does not resolve or a port that is taken fails naming it.
  static Result<std::unique_ptr<MetricsServer>> start(MetricsServerOptions options,
                                                      std::function<std::string()> render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  uint16_t port() const;
  void stop();

  struct Counts {
    uint64_t served = 0, refused = 0;  // 200s; 4xx and closed at accept
  };
  Counts counts() const;

  class Impl;

 private:
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "HOST:PORT" for --metrics and the embedded coordinator's "metrics" key.
Status parse_metrics_address(const std::string& text, std::string* host, uint16_t* port);

}  // namespace refit::control
