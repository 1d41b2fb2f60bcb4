// refit-ucx-bench [--transport tcp|shm] [--memory ucx|user] [--peer-errors]
//                 [--no-peer-errors] [--repeat N] [--gathers] [--json F]
//
// For message sizes from 64 KiB to 64 MiB: the GET engine's bandwidth (this
// process pulling from a server process it starts, a window of several MiB
// in flight) beside `ucx_perftest -t ucp_get` with the same size, transport
// and window, and their ratio. Both transports when none is named. Prints
// the lanes UCX gave the engine's endpoint and perftest's (its "ep_cfg" log
// line), then a table; with --json F also writes {"results": [{"transport",
// "kind", "memory", "bytes", "engine_gbps", "cpu_ns_per_byte", "perftest_gbps",
// "ratio"}, ...]}.
//
// Error handling: tcp endpoints use PeerErrorHandling::kPeer, shm endpoints
// kNone, as refit does: in UCX 1.13 and 1.22 kPeer takes every
// shared-memory lane away (posix/sysv/cma have no peer-failure support)
// and leaves only tcp.
// --peer-errors / --no-peer-errors force one mode for both.
//
// CPU: beside each row's bandwidth, the CPU time (user and system) that
// this process and the server used per byte moved, over the same turns
// ("cpu_ns_per_byte"; the best turn's): what the transfer costs a machine
// whose cores the ranks share (scripts/calibrate, docs/simulator.md).
//
// --gathers (tcp): after the GET rows, gathers (docs/refresh.md, "Gathers")
// of runs of 512 B, 4 KiB and 64 KiB, as the receiver agent groups them
// (at most 8192 runs and 16 MiB a gather, 1 MiB chunks, a 64 MiB window),
// each run from every other run's place in the server's buffer into one
// contiguous local range: the rate and CPU of the path that the source
// copies into its replies and the receiver scatters. Rows of "kind"
// "gather" with "bytes" the run size; no perftest beside them.
//
// Memory: the server's buffer is allocated by UCX (--memory ucx, the default
// for shm: a posix/sysv segment the puller maps and GETs from with memcpy,
// which is also what ucx_perftest uses), or is plain user memory (--memory
// user, the default for tcp: on shm UCX 1.13 then emulates the GETs with
// posix/sysv active messages, as strace shows no process_vm_readv; cma only
// serves rendezvous; UCX 1.22 reads either memory with cma zero-copy, and
// perftest prints that protocol). Like ucx_perftest, every GET of a size uses
// the same remote and local range, so both measure the transport, not DRAM.
//
// Noise: the engine and perftest take turns, --repeat times per size (3 by
// default), and each side's best turn is reported. On a small shared
// machine a single turn of either can lose half its bandwidth to other
// work; the best of several is what the transport can do, for both alike.
//
// The server is this binary re-executed with --serve (a clean process: UCX
// does not survive fork). Every wait has a deadline; a server or perftest
// that does not answer is killed and the row reports the error.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "transport/ucx/am_rma.h"
#include "transport/ucx/context.h"
#include "transport/ucx/endpoint.h"
#include "transport/ucx/get_engine.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace {

using namespace refit;
using namespace refit::ucx;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kBufferBytes = 64ull << 20;
constexpr uint64_t kWindowBytes = 8ull << 20;
const std::vector<uint64_t> kSizes = {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20};

bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n, Clock::time_point deadline) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pf = {fd, POLLIN, 0};
    if (::poll(&pf, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t k = ::read(fd, b, n);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool send_blob(int fd, const std::vector<uint8_t>& v) {
  uint32_t n = static_cast<uint32_t>(v.size());
  return write_all(fd, &n, 4) && write_all(fd, v.data(), v.size());
}

bool recv_blob(int fd, std::vector<uint8_t>* v, Clock::time_point deadline) {
  uint32_t n = 0;
  if (!read_all(fd, &n, 4, deadline) || n > (1u << 24)) return false;
  v->resize(n);
  return read_all(fd, v->data(), n, deadline);
}

ContextConfig context_config(const std::string& transport, const std::string& name) {
  ContextConfig cfg;
  cfg.name = name;
  cfg.transports = {transport};
  if (transport == "tcp") cfg.devices = {"lo"};
  return cfg;
}

// --serve TRANSPORT MEMORY: registers a buffer, sends address, rkey and base
// on fd 3, serves tcp GETs (AmRmaServer), progresses until the parent
// writes a byte or goes away.
int serve(const std::string& transport, const std::string& memory) {
  const int fd = 3;
  auto ctx = Context::create(context_config(transport, "bench-server"));
  if (!ctx) {
    std::cerr << ctx.status().message() << "\n";
    return 2;
  }
  auto worker = Worker::create(*ctx);
  if (!worker) return 2;
  std::vector<uint8_t> buf;
  Result<MemoryRegion> region = Status::internal("unset");
  if (memory == "ucx") {
    region = MemoryRegion::allocate(*ctx, kBufferBytes, "bench buffer");
  } else {
    buf.assign(kBufferBytes, 0x5A);
    region = MemoryRegion::map(*ctx, buf.data(), buf.size(), "bench buffer");
  }
  auto addr = worker->address();
  if (!region || !addr) {
    std::cerr << (region ? addr.status() : region.status()).message() << "\n";
    return 2;
  }
  std::memset(region->base(), 0x5A, region->length());
  auto server = AmRmaServer::create(*worker);
  if (!server) return 2;
  (*server)->export_region(*region);
  uint64_t base = reinterpret_cast<uint64_t>(region->base());
  std::vector<uint8_t> b(8);
  std::memcpy(b.data(), &base, 8);
  if (!send_blob(fd, *addr) || !send_blob(fd, region->packed_rkey()) || !send_blob(fd, b)) return 3;
  // Sleeps on the worker's event fd between requests: on a 2-core machine
  // a spinning server starves the puller (measured: tcp 0.45 vs 0.75 GB/s).
  while (true) {
    while (worker->progress() != 0) {
    }
    pollfd pf = {fd, POLLIN, 0};
    if (::poll(&pf, 1, 0) > 0) break;
    (void)worker->wait(std::chrono::milliseconds(1));
  }
  return 0;
}

struct Child {
  pid_t pid = -1;
  int fd = -1;
  int log_fd = -1;  // the server's stderr, where UCX logs its lanes
};

// The "ep_cfg[N]: ..." lines UCX logged at info level (the lanes of each
// endpoint configuration it made) in what `fd` has buffered so far.
std::string ep_cfg_lines(int fd) {
  std::string text;
  char buf[4096];
  while (true) {
    pollfd pf = {fd, POLLIN, 0};
    if (::poll(&pf, 1, 0) <= 0) break;
    ssize_t k = ::read(fd, buf, sizeof(buf));
    if (k <= 0) break;
    text.append(buf, static_cast<size_t>(k));
  }
  std::string out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    auto at = line.find("ep_cfg[");
    if (at != std::string::npos) out += (out.empty() ? "" : "; ") + line.substr(at);
  }
  return out;
}

void reap(pid_t pid, std::chrono::milliseconds grace) {
  auto deadline = Clock::now() + grace;
  int st = 0;
  while (::waitpid(pid, &st, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return;
    }
    ::usleep(2000);
  }
}

Result<Child> start_server(const std::string& self, const std::string& transport,
                           const std::string& memory) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return Status::io_error("bench: socketpair failed");
  }
  int log[2];
  if (::pipe2(log, O_CLOEXEC) != 0) return Status::io_error("bench: pipe failed");
  pid_t pid = ::fork();
  if (pid < 0) return Status::io_error("bench: fork failed");
  if (pid == 0) {
    ::dup2(sv[1], 3);
    ::dup2(log[1], 1);  // UCX logs to stdout
    ::dup2(log[1], 2);
    // The server's UCX logs the lanes of its side of each endpoint.
    ::setenv("UCX_LOG_LEVEL", "info", 1);
    const char* argv[] = {self.c_str(), "--serve", transport.c_str(), memory.c_str(), nullptr};
    ::execv(self.c_str(), const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(sv[1]);
  ::close(log[1]);
  return Child{pid, sv[0], log[0]};
}

// Runs a command with extra environment, stdout captured, within `timeout`.
Result<std::string> run_capture(std::vector<std::string> args,
                                std::vector<std::pair<std::string, std::string>> env,
                                std::chrono::milliseconds timeout, pid_t* bg = nullptr) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return Status::io_error("bench: pipe failed");
  pid_t pid = ::fork();
  if (pid < 0) return Status::io_error("bench: fork failed");
  if (pid == 0) {
    ::dup2(pipefd[1], 1);
    ::dup2(pipefd[1], 2);
    ::close(pipefd[0]);
    for (auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(pipefd[1]);
  if (bg) {  // background: caller reaps; output discarded
    ::close(pipefd[0]);
    *bg = pid;
    return std::string();
  }
  std::string out;
  auto deadline = Clock::now() + timeout;
  char buf[4096];
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd pf = {pipefd[0], POLLIN, 0};
    if (::poll(&pf, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t k = ::read(pipefd[0], buf, sizeof(buf));
    if (k <= 0) break;
    out.append(buf, static_cast<size_t>(k));
  }
  ::close(pipefd[0]);
  reap(pid, std::chrono::milliseconds(500));
  return out;
}

struct Perftest {
  double gbps = 0;
  std::string lanes;  // its "ep_cfg[N]: ..." info lines
};

// The rows of the "remote memory read" table that UCX's newer protocols
// print with UCX_PROTO_INFO=y ("| 0..inf | zero-copy | cma/memory |"), as
// "get 0..inf: zero-copy cma/memory"; empty under UCX 1.13's protocols.
std::string get_protocol_rows(const std::string& text) {
  std::string out;
  bool in_table = false;
  bool in_rows = false;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (!in_table) {
      in_table = line.find("remote memory read") != std::string::npos;
      continue;
    }
    auto bar = line.find('|');
    if (!in_rows) {
      in_rows = line.find("Range") != std::string::npos;
      continue;
    }
    if (bar == std::string::npos) {  // a "+---+" rule: below the header, or the table's end
      if (out.empty()) continue;
      break;
    }
    std::vector<std::string> cells;
    std::istringstream row(line.substr(bar + 1));
    for (std::string cell; std::getline(row, cell, '|');) {
      auto b = cell.find_first_not_of(' ');
      auto e = cell.find_last_not_of(' ');
      if (b != std::string::npos) cells.push_back(cell.substr(b, e - b + 1));
    }
    if (cells.size() != 3) break;
    out += (out.empty() ? "get " : "; get ") + cells[0] + ": " + cells[1] + " " + cells[2];
  }
  return out;
}

// ucx_perftest's "Final:" row; overall bandwidth is column 6, in MB/s of
// 2^20 bytes. The client runs with UCX_LOG_LEVEL=info so that it logs the
// lanes it got (ucp_worker_print_used_tls: "ep_cfg[0]: rma(sysv/memory)";
// UCX 1.13), and with UCX_PROTO_INFO=y so that UCX's newer protocols
// (1.22) print the protocol its GETs take.
Result<Perftest> run_perftest(const std::string& tls, const std::string& transport,
                              uint64_t size, uint64_t outstanding, uint64_t iters, int port) {
  std::vector<std::pair<std::string, std::string>> env = {{"UCX_TLS", tls}};
  if (transport == "tcp") env.push_back({"UCX_NET_DEVICES", "lo"});
  pid_t server = -1;
  auto s = run_capture({"ucx_perftest", "-p", std::to_string(port)}, env,
                       std::chrono::seconds(60), &server);
  if (!s) return s.status();
  ::usleep(300000);  // the server listens within milliseconds; no readiness signal exists
  auto client_env = env;
  client_env.push_back({"UCX_LOG_LEVEL", "info"});
  client_env.push_back({"UCX_PROTO_INFO", "y"});
  auto out = run_capture({"ucx_perftest", "127.0.0.1", "-p", std::to_string(port), "-t", "ucp_get",
                          "-s", std::to_string(size), "-n", std::to_string(iters), "-O",
                          std::to_string(outstanding), "-w", std::to_string(iters / 10 + 1)},
                         client_env, std::chrono::seconds(60));
  reap(server, std::chrono::seconds(2));
  if (!out) return out.status();
  Perftest result;
  std::istringstream lines(*out);
  for (std::string line; std::getline(lines, line);) {
    auto at = line.find("ep_cfg[");
    if (at != std::string::npos) result.lanes += (result.lanes.empty() ? "" : "; ") + line.substr(at);
  }
  if (result.lanes.empty()) result.lanes = get_protocol_rows(*out);
  // The row is "Final: <iterations> <typical lat> <avg lat> <overall lat>
  // <avg MB/s> <overall MB/s> <avg msg/s> <overall msg/s>". The columns are
  // fixed-width: a wide number (large sizes give bandwidths or latencies
  // above the column width) runs into its neighbour, so split on
  // whitespace and insist on all eight fields.
  auto pos = out->rfind("Final:");
  if (pos == std::string::npos) {
    return Status::io_error("ucx_perftest (" + std::to_string(size) +
                            " bytes) gave no \"Final:\" row: " + out->substr(0, 300));
  }
  auto eol = out->find('\n', pos);
  const std::string final_row = out->substr(pos + 6, eol == std::string::npos ? eol : eol - pos - 6);
  std::istringstream row(final_row);
  std::vector<double> cols;
  for (std::string tok; row >> tok;) {
    char* end = nullptr;
    double v = std::strtod(tok.c_str(), &end);
    if (end == tok.c_str() || *end != 0) {
      return Status::io_error("ucx_perftest (" + std::to_string(size) + " bytes): field \"" +
                              tok + "\" of its Final row is not a number: \"" + final_row + "\"");
    }
    cols.push_back(v);
  }
  if (cols.size() != 8) {
    return Status::io_error("ucx_perftest (" + std::to_string(size) + " bytes): Final row has " +
                            std::to_string(cols.size()) + " fields, expected 8: \"" + final_row +
                            "\"");
  }
  result.gbps = cols[5] * 1048576.0 / 1e9;
  return result;
}

struct Row {
  std::string transport;
  std::string memory;
  uint64_t bytes = 0;  // "gather": the size of each run
  std::string kind = "get";
  double engine_gbps = 0;
  double cpu_ns_per_byte = 0;  // this process and the server, the best turn's
  double perftest_gbps = 0;
  std::string error;
};

// CPU seconds (user and system) used so far by this process and by `server`
// (/proc/PID/stat, in clock ticks); the server's part is 0 if unreadable.
double cpu_seconds(pid_t server) {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  double cpu = static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  std::ifstream f("/proc/" + std::to_string(server) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return cpu;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {  // fields 14 and 15: utime, stime
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return cpu + static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Runs `batch` for at least 3 batches and 0.5 s, `repeat` times; the best
// turn's bandwidth and CPU per byte go into `row`.
Status time_turns(GetEngine& engine, const std::vector<GetRun>& batch, pid_t server, int repeat, Row* row) {
  for (int turn = 0; turn < repeat; ++turn) {
    uint64_t bytes = 0;
    const double cpu0 = cpu_seconds(server);
    const auto start = Clock::now();
    int batches = 0;
    while (batches < 3 || Clock::now() - start < std::chrono::milliseconds(500)) {
      auto r = engine.run_batch(batch, Clock::now() + std::chrono::seconds(30));
      if (!r.status.is_ok()) return r.status;
      bytes += r.bytes_done;
      ++batches;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - start).count();
    const double cpu_ns = (cpu_seconds(server) - cpu0) * 1e9 / static_cast<double>(bytes);
    row->engine_gbps = std::max(row->engine_gbps, static_cast<double>(bytes) / secs / 1e9);
    if (row->cpu_ns_per_byte == 0 || cpu_ns < row->cpu_ns_per_byte) row->cpu_ns_per_byte = cpu_ns;
  }
  return Status::ok();
}

Status bench_transport(const std::string& self, const std::string& transport,
                       PeerErrorHandling err_mode, const std::string& memory, int repeat, bool gathers,
                       std::vector<Row>* rows) {
  auto tls = ucx_tls_string({transport}, "bench");
  if (!tls) return tls.status();
  auto child = start_server(self, transport, memory);
  if (!child) return child.status();
  struct Stop {
    Child c;
    ~Stop() {
      uint8_t b = 1;
      (void)::send(c.fd, &b, 1, MSG_NOSIGNAL);
      reap(c.pid, std::chrono::seconds(3));
      ::close(c.fd);
      ::close(c.log_fd);
    }
  } stop{*child};
  std::vector<uint8_t> addr, rkey, base_bytes;
  auto deadline = Clock::now() + std::chrono::seconds(20);
  if (!recv_blob(child->fd, &addr, deadline) || !recv_blob(child->fd, &rkey, deadline) ||
      !recv_blob(child->fd, &base_bytes, deadline) || base_bytes.size() != 8) {
    return Status::io_error("bench: server for \"" + transport + "\" did not start");
  }
  uint64_t remote_base;
  std::memcpy(&remote_base, base_bytes.data(), 8);

  auto ctx = Context::create(context_config(transport, "bench"));
  if (!ctx) return ctx.status();
  auto worker = Worker::create(*ctx);
  if (!worker) return worker.status();
  auto ep = Endpoint::create(*worker, addr, "bench-server", err_mode);
  if (!ep) return ep.status();
  std::printf("%s, %s memory, %s: engine endpoint lanes%s:\n  %s\n", transport.c_str(),
              memory.c_str(), err_mode == PeerErrorHandling::kPeer ? "kPeer" : "kNone",
              ep->rma_in_software() ? " (no RMA lane: GETs go as refit active messages)" : "",
              [&] {
                std::string l = ep->lanes();
                for (size_t i = 0; (i = l.find('\n', i)) != std::string::npos; i += 3) {
                  l.replace(i, 1, "\n  ");
                }
                return l;
              }().c_str());
  bool printed_perftest_lanes = false;
  bool printed_server_lanes = false;
  REFIT_RETURN_IF_ERROR(ep->import_rkey(1, rkey));
  // Page-aligned, as ucx_perftest's buffers are: on shm a GET is a memcpy,
  // and a destination off a 64-byte boundary costs it about a tenth.
  std::unique_ptr<uint8_t, decltype(&std::free)> local_buf(
      static_cast<uint8_t*>(std::aligned_alloc(4096, kBufferBytes)), &std::free);
  if (!local_buf) return Status::io_error("bench: cannot allocate the local buffer");
  std::memset(local_buf.get(), 0, kBufferBytes);
  uint8_t* const local = local_buf.get();
  auto region = MemoryRegion::map(*ctx, local, kBufferBytes, "bench local");
  if (!region) return region.status();

  // A fresh port for every perftest pair, across transports too: a server
  // that is still going away holds its port for a moment.
  static int port = 20000 + (::getpid() % 20000);
  for (uint64_t size : kSizes) {
    Row row{transport, memory, size};
    const uint64_t ops = std::max<uint64_t>(1, kWindowBytes / size);
    GetEngineOptions opts;
    opts.limits.chunk_bytes = size;
    opts.limits.max_bytes_per_endpoint = std::max(kWindowBytes, size);
    opts.limits.max_bytes_in_flight = std::max(kWindowBytes, size);
    opts.limits.max_ops_per_endpoint = ops;
    opts.limits.max_ops_in_flight = ops;
    auto engine = GetEngine::create(*worker, opts);
    if (!engine) return engine.status();
    (*engine)->add_local_region(*region);
    // Like ucx_perftest, every GET uses the same remote and local range
    // (perftest reuses one buffer), so both measure the transport, not DRAM.
    std::vector<GetRun> runs;
    for (uint64_t i = 0; i < std::max<uint64_t>(1, kBufferBytes / size); ++i) {
      runs.push_back(GetRun{&*ep, 1, remote_base, local, size});
    }
    auto warm = (*engine)->run_batch(runs, Clock::now() + std::chrono::seconds(30));
    if (!warm.status.is_ok()) return warm.status;
    if (!printed_server_lanes) {  // its side of the endpoint exists by now
      const std::string lines = ep_cfg_lines(child->log_fd);
      std::printf("%s: server lanes:\n  %s\n", transport.c_str(),
                  lines.empty() ? "(none logged: no endpoint config on the server's side)"
                                : lines.c_str());
      printed_server_lanes = true;
    }
    for (int turn = 0; turn < repeat; ++turn) {
      REFIT_RETURN_IF_ERROR(time_turns(**engine, runs, child->pid, 1, &row));
      const uint64_t iters = std::max<uint64_t>(20, static_cast<uint64_t>(row.engine_gbps * 1e9 * 0.5) / size);
      auto pt = run_perftest(*tls, transport, size, ops, iters, port++);
      if (!pt) {
        if (row.perftest_gbps == 0) row.error = pt.status().message();
        continue;
      }
      row.error.clear();
      row.perftest_gbps = std::max(row.perftest_gbps, pt->gbps);
      if (!printed_perftest_lanes) {
        std::printf("%s: ucx_perftest lanes:\n  %s\n", transport.c_str(),
                    pt->lanes.empty() ? "(not logged)" : pt->lanes.c_str());
        printed_perftest_lanes = true;
      }
    }
    rows->push_back(row);
  }
  if (!gathers) return Status::ok();
  // Gathers as the receiver agent posts them (plugin/config.h defaults):
  // every other run's place of the server's buffer, into one local range.
  for (uint64_t run : {uint64_t{512}, uint64_t{4096}, uint64_t{64} << 10}) {
    Row row{transport, memory, run, "gather"};
    const uint64_t entries = std::min<uint64_t>(8192, (16ull << 20) / run);
    const uint64_t count = kBufferBytes / (2 * run * entries);  // gathers that fit, runs never overlapping
    std::vector<std::vector<GatherPart>> parts(count);
    std::vector<GetRun> batch;
    for (uint64_t g = 0; g < count; ++g) {
      for (uint64_t e = 0; e < entries; ++e) {
        const uint64_t k = g * entries + e;
        parts[g].push_back(GatherPart{1, remote_base + 2 * k * run, local + k * run, run});
      }
      GetRun r;
      r.endpoint = &*ep;
      r.bytes = run * entries;
      r.gather = parts[g];
      batch.push_back(r);
    }
    GetEngineOptions opts;
    opts.limits.chunk_bytes = 1 << 20;
    opts.limits.gather_chunk_bytes = 16 << 20;
    opts.limits.max_bytes_per_endpoint = 64 << 20;
    opts.limits.max_bytes_in_flight = 64 << 20;
    auto engine = GetEngine::create(*worker, opts);
    if (!engine) return engine.status();
    (*engine)->add_local_region(*region);
    auto warm = (*engine)->run_batch(batch, Clock::now() + std::chrono::seconds(30));
    if (!warm.status.is_ok()) return warm.status;
    REFIT_RETURN_IF_ERROR(time_turns(**engine, batch, child->pid, repeat, &row));
    rows->push_back(row);
  }
  return Status::ok();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 3 && args[0] == "--serve") return serve(args[1], args[2]);
  std::vector<std::string> transports = {"tcp", "shm"};
  std::string json_path;
  std::optional<PeerErrorHandling> forced_mode;
  std::string memory;  // empty: per transport
  int repeat = 3;
  bool gathers = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--no-peer-errors") {
      forced_mode = PeerErrorHandling::kNone;
    } else if (args[i] == "--peer-errors") {
      forced_mode = PeerErrorHandling::kPeer;
    } else if (args[i] == "--transport" && i + 1 < args.size()) {
      transports = {args[++i]};
    } else if (args[i] == "--memory" && i + 1 < args.size()) {
      memory = args[++i];
      if (memory != "ucx" && memory != "user") {
        std::cerr << "refit-ucx-bench: --memory must be ucx or user, got \"" << memory << "\"\n";
        return 2;
      }
    } else if (args[i] == "--repeat" && i + 1 < args.size()) {
      const std::string& v = args[++i];
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != 0 || n < 1 || n > 100) {
        std::cerr << "refit-ucx-bench: --repeat must be an integer from 1 to 100, got \"" << v
                  << "\"\n";
        return 2;
      }
      repeat = static_cast<int>(n);
    } else if (args[i] == "--gathers") {
      gathers = true;
    } else if (args[i] == "--json" && i + 1 < args.size()) {
      json_path = args[++i];
    } else {
      std::cerr << "usage: refit-ucx-bench [--transport tcp|shm] [--memory ucx|user] "
                   "[--peer-errors|--no-peer-errors] [--repeat N] [--gathers] [--json FILE]\n";
      return 2;
    }
  }
  for (const auto& t : transports) {
    if (t != "tcp" && t != "shm") {
      std::cerr << "refit-ucx-bench: --transport must be tcp or shm, got \"" << t << "\"\n";
      return 2;
    }
  }
  std::signal(SIGPIPE, SIG_IGN);
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 2;
  self[n] = 0;

  std::vector<Row> rows;
  int rc = 0;
  for (const auto& t : transports) {
    const PeerErrorHandling mode =
        forced_mode.value_or(t == "shm" ? PeerErrorHandling::kNone : PeerErrorHandling::kPeer);
    const std::string mem = !memory.empty() ? memory : t == "shm" ? "ucx" : "user";
    Status s = bench_transport(self, t, mode, mem, repeat, gathers && t == "tcp", &rows);
    if (!s.is_ok()) {
      std::cerr << "refit-ucx-bench: " << t << ": " << s.message() << "\n";
      rc = 1;
    }
  }
  std::printf("%-9s %-6s %-6s %10s %12s %10s %14s %7s\n", "transport", "memory", "kind", "bytes", "engine GB/s",
              "cpu ns/B", "perftest GB/s", "ratio");
  nlohmann::json results = nlohmann::json::array();
  for (const auto& r : rows) {
    double ratio = r.perftest_gbps > 0 ? r.engine_gbps / r.perftest_gbps : 0;
    std::printf("%-9s %-6s %-6s %10llu %12.2f %10.3f %14.2f %7.2f%s%s\n", r.transport.c_str(), r.memory.c_str(),
                r.kind.c_str(), static_cast<unsigned long long>(r.bytes), r.engine_gbps, r.cpu_ns_per_byte,
                r.perftest_gbps, ratio, r.error.empty() ? "" : "  ", r.error.c_str());
    nlohmann::json j = {{"transport", r.transport},
                        {"memory", r.memory},
                        {"kind", r.kind},
                        {"bytes", r.bytes},
                        {"engine_gbps", r.engine_gbps},
                        {"cpu_ns_per_byte", r.cpu_ns_per_byte},
                        {"perftest_gbps", r.perftest_gbps},
                        {"ratio", ratio}};
    if (!r.error.empty()) j["error"] = r.error;
    results.push_back(j);
  }
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << nlohmann::json{{"results", results}}.dump(2) << "\n";
    if (!f) {
      std::cerr << "refit-ucx-bench: cannot write " << json_path << "\n";
      return 1;
    }
  }
  return rc;
}
