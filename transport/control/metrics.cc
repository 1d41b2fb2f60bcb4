#include "transport/control/metrics.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <thread>

namespace refit::control {

// ---------------------------------------------------------------- registry

void MetricsRegistry::declare(const std::string& name, Type type, const std::string& help,
                              std::vector<double> buckets) {
  std::lock_guard<std::mutex> lock(mu_);
  Metric& m = metrics_[name];
  m.type = type;
  m.help = help;
  std::sort(buckets.begin(), buckets.end());
  m.buckets = std::move(buckets);
}

void MetricsRegistry::add(const std::string& name, const Labels& labels, double delta) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it == metrics_.end() || it->second.type == Type::kHistogram) return;
  it->second.series[labels].value += delta;
}

void MetricsRegistry::set(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it == metrics_.end() || it->second.type != Type::kGauge) return;
  it->second.series[labels].value = value;
}

void MetricsRegistry::observe(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it == metrics_.end() || it->second.type != Type::kHistogram || !std::isfinite(value)) return;
  Metric& m = it->second;
  Series& s = m.series[labels];
  if (s.counts.empty()) s.counts.assign(m.buckets.size(), 0);
  for (size_t i = 0; i < m.buckets.size(); ++i) {
    if (value <= m.buckets[i]) {
      ++s.counts[i];
      break;
    }
  }
  ++s.count;
  s.sum += value;
}

void MetricsRegistry::clear(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it != metrics_.end()) it->second.series.clear();
}

void MetricsRegistry::erase(const std::string& name, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it != metrics_.end()) it->second.series.erase(labels);
}

double MetricsRegistry::value(const std::string& name, const Labels& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = metrics_.find(name);
  if (it == metrics_.end()) return 0;
  auto s = it->second.series.find(labels);
  if (s == it->second.series.end()) return 0;
  return it->second.type == Type::kHistogram ? static_cast<double>(s->second.count) : s->second.value;
}

namespace {

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.9g", v);
  }
  return buf;
}

// Label values escape backslash, double quote and newline (the text format).
std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string label_text(const Labels& labels, const std::string& extra = {}) {
  std::string out;
  for (const auto& [k, v] : labels) out += (out.empty() ? "" : ",") + k + "=\"" + escape(v) + "\"";
  if (!extra.empty()) out += (out.empty() ? "" : ",") + extra;
  return out.empty() ? "" : "{" + out + "}";
}

const char* type_name(MetricsRegistry::Type t) {
  switch (t) {
    case MetricsRegistry::Type::kCounter: return "counter";
    case MetricsRegistry::Type::kGauge: return "gauge";
    case MetricsRegistry::Type::kHistogram: return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [name, m] : metrics_) {
    out += "# HELP " + name + " " + m.help + "\n";
    out += "# TYPE " + name + " " + type_name(m.type) + "\n";
    for (const auto& [labels, s] : m.series) {
      if (m.type != Type::kHistogram) {
        out += name + label_text(labels) + " " + number(s.value) + "\n";
        continue;
      }
      uint64_t cumulative = 0;
      for (size_t i = 0; i < m.buckets.size(); ++i) {
        cumulative += i < s.counts.size() ? s.counts[i] : 0;
        out += name + "_bucket" + label_text(labels, "le=\"" + number(m.buckets[i]) + "\"") + " " +
               std::to_string(cumulative) + "\n";
      }
      out += name + "_bucket" + label_text(labels, "le=\"+Inf\"") + " " + std::to_string(s.count) + "\n";
      out += name + "_sum" + label_text(labels) + " " + number(s.sum) + "\n";
      out += name + "_count" + label_text(labels) + " " + std::to_string(s.count) + "\n";
    }
  }
  return out;
}

// ------------------------------------------------------------------ server

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// Owned by MetricsServer. Everything but the atomics and port_ belongs to
// the server's one thread.
class MetricsServer::Impl {
 public:
  Impl(MetricsServerOptions options, std::function<std::string()> render)
      : options_(std::move(options)), render_(std::move(render)), acceptor_(io_) {
    tokens_ = options_.max_requests_per_second;
    last_refill_ = std::chrono::steady_clock::now();
    if (options_.log) options_.threads.set_log([log = options_.log](const std::string& line) { log("metrics: " + line); });
  }

  Status listen();
  Status run() {
    // A handler that throws ends the server's thread, logged; the process
    // and the coordinator go on without metrics.
    Result<std::thread> t = options_.threads.start("metrics server", [this] {
      accept();
      io_.run();
    });
    if (!t.is_ok()) return t.status().with_context("metrics");
    thread_ = std::move(t).value();
    return Status::ok();
  }
  void stop() {
    if (stopped_.exchange(true)) return;
    asio::post(io_, [this] {
      error_code ec;
      acceptor_.close(ec);
      io_.stop();
    });
    if (thread_.joinable()) thread_.join();
  }

  using error_code = boost::system::error_code;
  void accept();
  // The rate limit: a bucket of max_requests_per_second tokens, refilled
  // continuously.
  bool take_token() {
    const auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - last_refill_).count();
    last_refill_ = now;
    tokens_ = std::min(options_.max_requests_per_second, tokens_ + elapsed * options_.max_requests_per_second);
    if (tokens_ < 1) return false;
    tokens_ -= 1;
    return true;
  }
  void log(const std::string& line) {
    if (options_.log) options_.log("metrics: " + line);
  }

  MetricsServerOptions options_;
  std::function<std::string()> render_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  std::atomic<bool> stopped_{false};
  std::atomic<size_t> active_{0};
  std::atomic<uint64_t> served_{0}, refused_{0};
  double tokens_ = 0;
  std::chrono::steady_clock::time_point last_refill_;
  uint16_t port_ = 0;
};

namespace {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(MetricsServer::Impl& server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), buffer_(server.options_.max_request_bytes), timer_(server.io_) {
    ++server_.active_;
    parser_.header_limit(static_cast<uint32_t>(server.options_.max_request_bytes));
    parser_.body_limit(0);
  }
  ~Connection() { --server_.active_; }

  void start() {
    auto self = shared_from_this();
    timer_.expires_after(server_.options_.timeout);
    timer_.async_wait([self](boost::system::error_code ec) {
      if (!ec) self->close();  // too slow: a request or a reader that never finishes
    });
    http::async_read(socket_, buffer_, parser_, [self](boost::system::error_code ec, size_t) { self->on_read(ec); });
  }

 private:
  void close() {
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  void on_read(boost::system::error_code ec) {
    if (ec) {
      // Oversize, malformed or cut short: closed without an answer.
      if (ec != asio::error::operation_aborted && ec != http::error::end_of_stream) {
        ++server_.refused_;
        server_.log("closed a connection: " + ec.message());
      }
      timer_.cancel();
      close();
      return;
    }
    const auto& req = parser_.get();
    http::status status = http::status::ok;
    std::string body;
    const std::string target(req.target());
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      status = http::status::method_not_allowed;
      body = "only GET\n";
    } else if (target != "/metrics" && target.rfind("/metrics?", 0) != 0) {
      status = http::status::not_found;
      body = "only /metrics\n";
    } else if (!server_.options_.bearer_token.empty() &&
               std::string(req[http::field::authorization]) != "Bearer " + server_.options_.bearer_token) {
      status = http::status::unauthorized;
      body = "a bearer token is required\n";
    } else if (!server_.take_token()) {
      status = http::status::too_many_requests;
      body = "too many requests\n";
    } else {
      body = server_.render_();
    }
    if (status == http::status::ok) {
      ++server_.served_;
    } else {
      ++server_.refused_;
    }
    response_.result(status);
    response_.version(11);
    response_.set(http::field::server, "refit");
    response_.set(http::field::content_type,
                  status == http::status::ok ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain");
    if (status == http::status::unauthorized) response_.set(http::field::www_authenticate, "Bearer");
    response_.keep_alive(false);
    if (req.method() == http::verb::head) {
      response_.content_length(body.size());
    } else {
      response_.body() = std::move(body);
      response_.prepare_payload();
    }
    auto self = shared_from_this();
    http::async_write(socket_, response_, [self](boost::system::error_code, size_t) {
      self->timer_.cancel();
      self->close();
    });
  }

  MetricsServer::Impl& server_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
  http::request_parser<http::empty_body> parser_;
  http::response<http::string_body> response_;
  asio::steady_timer timer_;
};

}  // namespace

Status MetricsServer::Impl::listen() {
  error_code ec;
  auto addr = asio::ip::make_address(options_.host, ec);
  tcp::endpoint ep;
  if (ec) {
    tcp::resolver resolver(io_);
    auto results = resolver.resolve(options_.host, std::to_string(options_.port), ec);
    if (ec || results.empty()) {
      return Status::invalid("metrics: cannot resolve host \"" + options_.host + "\": " + ec.message());
    }
    ep = *results.begin();
  } else {
    ep = tcp::endpoint(addr, options_.port);
  }
  const std::string where = options_.host + ":" + std::to_string(options_.port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::io_error("metrics: cannot listen on " + where + ": " + ec.message());
  port_ = acceptor_.local_endpoint().port();
  return Status::ok();
}

void MetricsServer::Impl::accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      // Out of file descriptors, for instance: try again shortly instead of
      // spinning; the coordinator itself is not affected.
      log("accept failed: " + ec.message());
      auto retry = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(100));
      retry->async_wait([this, retry](error_code) { accept(); });
      return;
    }
    if (active_.load() >= options_.max_connections) {
      ++refused_;
      error_code ignored;
      socket.close(ignored);
    } else {
      std::make_shared<Connection>(*this, std::move(socket))->start();
    }
    accept();
  });
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(MetricsServerOptions options,
                                                           std::function<std::string()> render) {
  if (options.max_connections == 0 || options.max_request_bytes < 64 || options.max_requests_per_second <= 0) {
    return Status::invalid("metrics: max_connections, max_request_bytes (>= 64) and max_requests_per_second "
                           "must be positive");
  }
  auto impl = std::make_unique<Impl>(std::move(options), std::move(render));
  REFIT_RETURN_IF_ERROR(impl->listen());
  REFIT_RETURN_IF_ERROR(impl->run());
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MetricsServer::~MetricsServer() { stop(); }
void MetricsServer::stop() { impl_->stop(); }
uint16_t MetricsServer::port() const { return impl_->port_; }
MetricsServer::Counts MetricsServer::counts() const { return {impl_->served_.load(), impl_->refused_.load()}; }

Status parse_metrics_address(const std::string& text, std::string* host, uint16_t* port) {
  const size_t colon = text.rfind(':');
  auto bad = [&] {
    return Status::invalid("metrics address must be \"HOST:PORT\" with a port in 0..65535, got \"" + text + "\"");
  };
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return bad();
  std::string h = text.substr(0, colon);
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const std::string p = text.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return bad();
  const unsigned long v = std::stoul(p);
  if (v > 65535) return bad();
  *host = h;
  *port = static_cast<uint16_t>(v);
  return Status::ok();
}

}  // namespace refit::control
