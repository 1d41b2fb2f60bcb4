// refit-coordinator: the control plane as a process of its own. Listens on
// HOST:PORT, authenticates every connection with a key derived from the
// token in --token-file (transport/control/auth.h: a key per role), serves registration, heartbeats, versions, plans, commit barriers and
// leases (transport/control/coordinator.h) until SIGINT or SIGTERM. Logs one line per event on stderr.
//
// With --print-role-key ROLE it prints that role's key file (to give a
// member only its role's secret) and exits.
//
// Exit status: 0 after a signal, 2 on bad input (one line on stderr), 1 when
// it cannot listen or fails inside.

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "transport/control/auth.h"
#include "transport/control/coordinator.h"
#include "transport/control/fleet_metrics.h"
#include "transport/control/metrics.h"

namespace {

constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;

// "HOST:PORT" or "[V6]:PORT" into host and port.
bool split_listen(const std::string& s, std::string* host, uint16_t* port) {
  const size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return false;
  std::string h = s.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const std::string p = s.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return false;
  const unsigned long v = std::stoul(p);
  if (v > 65535) return false;
  *host = h;
  *port = static_cast<uint16_t>(v);
  return true;
}

void log_line(const std::string& line) {
  char stamp[32];
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::fprintf(stderr, "%s refit-coordinator: %s\n", stamp, line.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit-coordinator: the refit control plane (registration, heartbeats, versions)"};
  std::string listen;
  std::string token_file;
  int64_t relayout_below = 0, relayout_staging = int64_t{1} << 30;
  int64_t lease_ms = 60000, heartbeat_ms = 10000, read_ms = 10000, idle_ms = 60000, write_ms = 10000, auth_ms = 5000;
  uint32_t max_frame = refit::control::kDefaultMaxFrameBytes;
  std::string metrics, metrics_token_file;
  refit::control::CoordinatorConfig defaults;
  size_t max_connections = defaults.max_connections, max_unauthenticated = defaults.max_unauthenticated;
  auth_ms = defaults.auth_timeout.count();
  std::string print_role;
  size_t max_queued = defaults.max_queued_bytes, max_buffered = defaults.max_buffered_bytes;
  auto* listen_opt = app.add_option("--listen", listen, "HOST:PORT to listen on (port 0: any free port, printed)");
  app.add_option("--token-file", token_file,
                 "file holding the token (16 to 4096 bytes, mode 600: a file group or others may read is refused); "
                 "each role's key is derived from it")
      ->required();
  app.add_option("--print-role-key", print_role,
                 "print the key file of ROLE (source or receiver) and exit: a member given only its role's key "
                 "(as its coordinator.token_file, mode 600) can authenticate as that role only")
      ->check(CLI::IsMember({"source", "receiver"}));
  app.add_option("--heartbeat-timeout-ms", heartbeat_ms, "silence after which a member is declared dead")
      ->check(CLI::PositiveNumber);
  app.add_option("--relayout-below-bytes", relayout_below,
                 "relayout units whose network runs would average under N bytes (a column-major receiver of a "
                 "row-major source) in the puller's staging area; default 0: never (docs/refresh.md, "
                 "\"Column-major receivers\"; into GPU memory by a CUDA kernel)")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--relayout-staging-bytes", relayout_staging,
                 "the most staging bytes one puller's relayouts may take (default 1073741824)")
      ->type_name("N")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lease-timeout-ms", lease_ms, "time after which a receiver's unreleased lease expires")
      ->check(CLI::PositiveNumber);
  app.add_option("--read-timeout-ms", read_ms, "time a started frame has to finish")->check(CLI::PositiveNumber);
  app.add_option("--idle-timeout-ms", idle_ms, "time a connection may send nothing")->check(CLI::PositiveNumber);
  app.add_option("--write-timeout-ms", write_ms, "time a reply has to be taken")->check(CLI::PositiveNumber);
  app.add_option("--auth-timeout-ms", auth_ms, "time a new connection has to authenticate")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-frame-bytes", max_frame, "largest frame body accepted")->check(CLI::PositiveNumber);
  app.add_option("--max-connections", max_connections, "authenticated connections served at once")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-unauthenticated", max_unauthenticated,
                 "connections still authenticating, bounded on their own: past it a new one replaces the oldest, "
                 "so that strangers never shut a member out")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-queued-bytes", max_queued, "replies waiting to be written to one connection")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-buffered-bytes", max_buffered,
                 "queued replies and partly read requests of all connections together (at least the largest "
                 "frame); past it, a big reply is refused and a connection that sends more is dropped")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--metrics", metrics,
                 "HOST:PORT to serve Prometheus metrics on (GET /metrics, read-only; docs/operations.md)");
  app.add_option("--metrics-token-file", metrics_token_file,
                 "with --metrics: scrapes must send \"Authorization: Bearer TOKEN\" with the token in this file");
  app.footer("Example:\n  refit-coordinator --listen 0.0.0.0:7070 --token-file /etc/refit/token\n"
             "  refit-coordinator --token-file /etc/refit/token --print-role-key receiver > receiver.key\n"
             "Every frame after the handshake is authenticated (HMAC-SHA256, per direction, with a sequence\n"
             "number); see docs/security.md.\n"
             "Exit status: 0 after SIGINT/SIGTERM, 2 bad input (one line on stderr), 1 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "refit-coordinator: " << e.what() << " (see --help)\n";
    return kExitBadInput;
  }

  refit::control::CoordinatorConfig config;
  if (!print_role.empty()) {
    auto token = refit::control::read_token_file(token_file);
    if (!token.is_ok()) {
      std::cerr << "refit-coordinator: " << token.status().message() << "\n";
      return kExitBadInput;
    }
    const auto role = *refit::control::auth_role_from(print_role);
    auto key = refit::control::role_key(*token, role);
    if (!key.is_ok()) {
      std::cerr << "refit-coordinator: " << key.status().message() << "\n";
      return kExitInternal;
    }
    std::cout << refit::control::role_key_text(role, *key) << "\n";
    return 0;
  }
  if (listen_opt->count() == 0) {
    std::cerr << "refit-coordinator: --listen is required (see --help)\n";
    return kExitBadInput;
  }
  if (!split_listen(listen, &config.host, &config.port)) {
    std::cerr << "refit-coordinator: --listen must be HOST:PORT, got \"" << listen << "\"\n";
    return kExitBadInput;
  }
  auto token = refit::control::read_token_file(token_file);
  if (!token.is_ok()) {
    std::cerr << "refit-coordinator: " << token.status().message() << "\n";
    return kExitBadInput;
  }
  config.token = std::move(token).value();
  config.heartbeat_timeout = std::chrono::milliseconds(heartbeat_ms);
  config.lease_timeout = std::chrono::milliseconds(lease_ms);
  config.relayout_below_bytes = relayout_below;
  config.relayout_staging_bytes = relayout_staging;
  config.read_timeout = std::chrono::milliseconds(read_ms);
  config.idle_timeout = std::chrono::milliseconds(idle_ms);
  config.write_timeout = std::chrono::milliseconds(write_ms);
  config.auth_timeout = std::chrono::milliseconds(auth_ms);
  config.decoder.max_frame_bytes = max_frame;
  config.max_connections = max_connections;
  config.max_unauthenticated = max_unauthenticated;
  config.max_queued_bytes = max_queued;
  config.max_buffered_bytes = max_buffered;
  const size_t largest = size_t{max_frame} + refit::control::kHeaderBytes;
  for (const auto& [flag, value] : {std::pair{"--max-queued-bytes", max_queued},
                                    std::pair{"--max-buffered-bytes", max_buffered}}) {
    if (value < largest) {
      std::cerr << "refit-coordinator: " << flag << " must hold the largest frame, " << largest
                << " bytes (--max-frame-bytes plus the 12-byte header), got " << value << "\n";
      return kExitBadInput;
    }
  }
  config.log = log_line;
  refit::control::MetricsServerOptions metrics_options;
  if (!metrics.empty()) {
    refit::Status st = refit::control::parse_metrics_address(metrics, &metrics_options.host, &metrics_options.port);
    if (!st.is_ok()) {
      std::cerr << "refit-coordinator: --metrics: " << st.message() << "\n";
      return kExitBadInput;
    }
    if (!metrics_token_file.empty()) {
      auto bearer = refit::control::read_token_file(metrics_token_file);
      if (!bearer.is_ok()) {
        std::cerr << "refit-coordinator: --metrics-token-file: " << bearer.status().message() << "\n";
        return kExitBadInput;
      }
      metrics_options.bearer_token = std::move(bearer).value();
    }
    metrics_options.log = log_line;
  } else if (!metrics_token_file.empty()) {
    std::cerr << "refit-coordinator: --metrics-token-file needs --metrics\n";
    return kExitBadInput;
  }

  // Block the signals before the I/O thread starts so that only sigwait()
  // below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto fleet_metrics = std::make_shared<refit::control::FleetMetrics>();
  if (!metrics.empty()) config.metrics = fleet_metrics;
  auto co = refit::control::Coordinator::start(std::move(config));
  if (!co.is_ok()) {
    std::cerr << "refit-coordinator: " << co.status().message() << "\n";
    return co.status().code() == refit::Code::kInvalidArgument ? kExitBadInput : kExitInternal;
  }
  log_line("listening on " + listen.substr(0, listen.rfind(':')) + ":" + std::to_string((*co)->port()));

  // Metrics are read from the coordinator's stats at each scrape, and the
  // receivers' refresh summaries are counted as they come; a failing scrape
  // or a stopped server never touches the coordinator itself.
  std::unique_ptr<refit::control::MetricsServer> metrics_server;
  if (!metrics.empty()) {
    auto server = refit::control::serve_metrics(**co, fleet_metrics, metrics_options);
    if (!server.is_ok()) {
      std::cerr << "refit-coordinator: --metrics: " << server.status().message() << "\n";
      (*co)->stop();
      return kExitBadInput;
    }
    metrics_server = std::move(*server);
    log_line("metrics on http://" + metrics_options.host + ":" + std::to_string(metrics_server->port()) + "/metrics");
  }
  int sig = 0;
  sigwait(&signals, &sig);
  log_line(std::string("stopping on ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"));
  if (metrics_server) metrics_server->stop();
  (*co)->stop();
  return 0;
}
