// refit-coordinator: the control plane as a process of its own. Listens on
// HOST:PORT, authenticates every connection with the token in --token-file,
// serves registration, heartbeats, versions, plans, commit barriers and
// leases (transport/control/coordinator.h) until SIGINT or SIGTERM. Logs one line per event on stderr.
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
  int64_t lease_ms = 60000, heartbeat_ms = 10000, read_ms = 10000, idle_ms = 60000, write_ms = 10000, auth_ms = 5000;
  uint32_t max_frame = refit::control::kDefaultMaxFrameBytes;
  size_t max_connections = 4096;
  refit::control::CoordinatorConfig defaults;
  size_t max_queued = defaults.max_queued_bytes, max_buffered = defaults.max_buffered_bytes;
  app.add_option("--listen", listen, "HOST:PORT to listen on (port 0: any free port, printed)")->required();
  app.add_option("--token-file", token_file, "file holding the shared token (16 to 4096 bytes)")->required();
  app.add_option("--heartbeat-timeout-ms", heartbeat_ms, "silence after which a member is declared dead")
      ->check(CLI::PositiveNumber);
  app.add_option("--lease-timeout-ms", lease_ms, "time after which a receiver's unreleased lease expires")
      ->check(CLI::PositiveNumber);
  app.add_option("--read-timeout-ms", read_ms, "time a started frame has to finish")->check(CLI::PositiveNumber);
  app.add_option("--idle-timeout-ms", idle_ms, "time a connection may send nothing")->check(CLI::PositiveNumber);
  app.add_option("--write-timeout-ms", write_ms, "time a reply has to be taken")->check(CLI::PositiveNumber);
  app.add_option("--auth-timeout-ms", auth_ms, "time a new connection has to authenticate")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-frame-bytes", max_frame, "largest frame body accepted")->check(CLI::PositiveNumber);
  app.add_option("--max-connections", max_connections, "connections served at once")->check(CLI::PositiveNumber);
  app.add_option("--max-queued-bytes", max_queued, "replies waiting to be written to one connection")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-buffered-bytes", max_buffered,
                 "queued replies and partly read requests of all connections together (at least the largest "
                 "frame); past it, a big reply is refused and a connection that sends more is dropped")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.footer("Example:\n  refit-coordinator --listen 0.0.0.0:7070 --token-file /etc/refit/token\n"
             "Exit status: 0 after SIGINT/SIGTERM, 2 bad input (one line on stderr), 1 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "refit-coordinator: " << e.what() << " (see --help)\n";
    return kExitBadInput;
  }

  refit::control::CoordinatorConfig config;
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
  config.read_timeout = std::chrono::milliseconds(read_ms);
  config.idle_timeout = std::chrono::milliseconds(idle_ms);
  config.write_timeout = std::chrono::milliseconds(write_ms);
  config.auth_timeout = std::chrono::milliseconds(auth_ms);
  config.decoder.max_frame_bytes = max_frame;
  config.max_connections = max_connections;
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

  // Block the signals before the I/O thread starts so that only sigwait()
  // below receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto co = refit::control::Coordinator::start(std::move(config));
  if (!co.is_ok()) {
    std::cerr << "refit-coordinator: " << co.status().message() << "\n";
    return co.status().code() == refit::Code::kInvalidArgument ? kExitBadInput : kExitInternal;
  }
  log_line("listening on " + listen.substr(0, listen.rfind(':')) + ":" + std::to_string((*co)->port()));
  int sig = 0;
  sigwait(&signals, &sig);
  log_line(std::string("stopping on ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"));
  (*co)->stop();
  return 0;
}
