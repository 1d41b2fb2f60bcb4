// The metrics registry's text format, and the HTTP endpoint under use and
// misuse, over real sockets.

#include "transport/control/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace refit::control {
namespace {

TEST(MetricsRegistry, RendersCountersGaugesAndCumulativeHistograms) {
  MetricsRegistry r;
  r.declare("refit_members", MetricsRegistry::Type::kGauge, "Members by role.");
  r.declare("refit_aborts_total", MetricsRegistry::Type::kCounter, "Aborted versions.");
  r.declare("refit_refresh_seconds", MetricsRegistry::Type::kHistogram, "Refresh time.", {0.5, 0.1, 1});
  r.set("refit_members", {{"role", "source"}}, 2);
  r.set("refit_members", {{"role", "receiver"}}, 8);
  r.add("refit_aborts_total", {});
  r.add("refit_aborts_total", {}, 2);
  r.observe("refit_refresh_seconds", {{"mode", "staged"}}, 0.05);
  r.observe("refit_refresh_seconds", {{"mode", "staged"}}, 0.7);
  r.observe("refit_refresh_seconds", {{"mode", "staged"}}, 3);
  r.add("refit_undeclared_total", {});  // ignored, not a crash
  const std::string text = r.render();
  EXPECT_NE(text.find("# TYPE refit_members gauge\n"), std::string::npos) << text;
  EXPECT_NE(text.find("refit_members{role=\"receiver\"} 8\n"), std::string::npos) << text;
  EXPECT_NE(text.find("refit_members{role=\"source\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE refit_aborts_total counter\nrefit_aborts_total 3\n"), std::string::npos) << text;
  // Buckets sorted, cumulative, +Inf equal to the count.
  EXPECT_NE(text.find("refit_refresh_seconds_bucket{mode=\"staged\",le=\"0.1\"} 1\n"
                      "refit_refresh_seconds_bucket{mode=\"staged\",le=\"0.5\"} 1\n"
                      "refit_refresh_seconds_bucket{mode=\"staged\",le=\"1\"} 2\n"
                      "refit_refresh_seconds_bucket{mode=\"staged\",le=\"+Inf\"} 3\n"
                      "refit_refresh_seconds_sum{mode=\"staged\"} 3.75\n"
                      "refit_refresh_seconds_count{mode=\"staged\"} 3\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("undeclared"), std::string::npos);
  EXPECT_DOUBLE_EQ(r.value("refit_refresh_seconds", {{"mode", "staged"}}), 3);
}

TEST(MetricsRegistry, EscapesLabelValues) {
  MetricsRegistry r;
  r.declare("refit_x", MetricsRegistry::Type::kGauge, "x");
  r.set("refit_x", {{"reason", "a\"b\\c\nd"}}, 1);
  EXPECT_NE(r.render().find("refit_x{reason=\"a\\\"b\\\\c\\nd\"} 1\n"), std::string::npos) << r.render();
}

// One HTTP exchange over a fresh connection: what came back before the
// server closed (empty when it closed without a word), bounded by 5 s.
std::string http_exchange(uint16_t port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return "connect failed";
  }
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server closed on an oversize request
    sent += static_cast<size_t>(n);
  }
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

std::string get(uint16_t port, const std::string& path, const std::string& extra = {}) {
  return http_exchange(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\n" + extra + "\r\n");
}

class MetricsServerTest : public ::testing::Test {
 protected:
  void start(MetricsServerOptions options = {}) {
    registry_.declare("refit_published_version", MetricsRegistry::Type::kGauge, "Newest version.");
    registry_.set("refit_published_version", {}, 7);
    options.log = [](const std::string&) {};
    auto s = MetricsServer::start(std::move(options), [this] { return registry_.render(); });
    ASSERT_TRUE(s.is_ok()) << s.status().message();
    server_ = std::move(*s);
  }
  MetricsRegistry registry_;
  std::unique_ptr<MetricsServer> server_;
};

// The server's thread refused: start() says so, and the port is free again.
TEST(MetricsServer, AThreadThatCannotStartFailsStart) {
  MetricsServerOptions o;
  o.threads = ThreadFactory::refusing_after(0);
  auto s = MetricsServer::start(o, [] { return std::string(); });
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().reason(), Reason::kNoThread);
  EXPECT_NE(s.status().message().find("cannot start the metrics server thread"), std::string::npos)
      << s.status().message();
}

TEST_F(MetricsServerTest, ServesTheTextFormatOnGetMetrics) {
  start();
  const std::string r = get(server_->port(), "/metrics");
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  EXPECT_NE(r.find("text/plain; version=0.0.4"), std::string::npos) << r;
  EXPECT_NE(r.find("refit_published_version 7\n"), std::string::npos) << r;
}

TEST_F(MetricsServerTest, RefusesOtherPathsMethodsAndOversizeRequests) {
  start();
  EXPECT_EQ(get(server_->port(), "/").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(get(server_->port(), "/metrics/../etc/passwd").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(http_exchange(server_->port(), "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                .rfind("HTTP/1.1 405", 0),
            0u);
  // A 1 MiB request line: closed without an answer, and the server goes on.
  const std::string huge = "GET /" + std::string(1 << 20, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_EQ(http_exchange(server_->port(), huge).find("200"), std::string::npos);
  EXPECT_EQ(http_exchange(server_->port(), "this is not http\r\n\r\n").find("200"), std::string::npos);
  EXPECT_EQ(get(server_->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_GE(server_->counts().refused, 4u);
}

TEST_F(MetricsServerTest, AThousandIdleConnectionsDoNotStopIt) {
  MetricsServerOptions o;
  o.max_connections = 16;
  o.timeout = std::chrono::milliseconds(1000);
  start(o);
  std::vector<int> fds;
  for (int i = 0; i < 1000; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server_->port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      fds.push_back(fd);
    } else {
      close(fd);
    }
  }
  EXPECT_GT(fds.size(), 100u);
  // The idle ones time out (after o.timeout) or were closed at accept; a
  // scrape gets through within a few request timeouts.
  std::string r;
  for (const auto until = std::chrono::steady_clock::now() + 5 * o.timeout;
       r.rfind("HTTP/1.1 200", 0) != 0 && std::chrono::steady_clock::now() < until;) {
    r = get(server_->port(), "/metrics");
    if (r.rfind("HTTP/1.1 200", 0) != 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(r.rfind("HTTP/1.1 200", 0), 0u) << r;
  for (int fd : fds) close(fd);
}

TEST_F(MetricsServerTest, ABearerTokenIsRequiredWhenConfigured) {
  MetricsServerOptions o;
  o.bearer_token = "scrape-secret";
  start(o);
  EXPECT_EQ(get(server_->port(), "/metrics").rfind("HTTP/1.1 401", 0), 0u);
  EXPECT_EQ(get(server_->port(), "/metrics", "Authorization: Bearer wrong\r\n").rfind("HTTP/1.1 401", 0), 0u);
  const std::string ok = get(server_->port(), "/metrics", "Authorization: Bearer scrape-secret\r\n");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  EXPECT_EQ(ok.find("scrape-secret"), std::string::npos);
}

TEST_F(MetricsServerTest, ScrapesPastTheRateAreRefused) {
  MetricsServerOptions o;
  o.max_requests_per_second = 3;
  start(o);
  int ok = 0, limited = 0;
  for (int i = 0; i < 10; ++i) {
    const std::string r = get(server_->port(), "/metrics");
    ok += r.rfind("HTTP/1.1 200", 0) == 0;
    limited += r.rfind("HTTP/1.1 429", 0) == 0;
  }
  EXPECT_GE(ok, 3);
  EXPECT_GE(limited, 1);
  EXPECT_EQ(ok + limited, 10);
}

TEST(MetricsServer, ATakenPortOrABadAddressIsNamed) {
  MetricsServerOptions o;
  o.log = [](const std::string&) {};
  auto first = MetricsServer::start(o, [] { return std::string(); });
  ASSERT_TRUE(first.is_ok());
  o.port = (*first)->port();
  auto second = MetricsServer::start(o, [] { return std::string(); });
  ASSERT_FALSE(second.is_ok());
  EXPECT_NE(second.status().message().find("127.0.0.1:" + std::to_string(o.port)), std::string::npos)
      << second.status().message();

  std::string host;
  uint16_t port = 0;
  EXPECT_FALSE(parse_metrics_address("localhost", &host, &port).is_ok());
  EXPECT_FALSE(parse_metrics_address("h:99999", &host, &port).is_ok());
  EXPECT_NE(parse_metrics_address("h:x", &host, &port).message().find("\"h:x\""), std::string::npos);
  EXPECT_TRUE(parse_metrics_address("[::1]:9100", &host, &port).is_ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 9100);
}

}  // namespace
}  // namespace refit::control
