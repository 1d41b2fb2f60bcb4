#pragma once
// Test helper: a forked process that serves one registered buffer over UCX.
// It sends its framed worker address and packed rkey to the parent through a
// socketpair, then progresses its worker until the parent closes the socket
// or writes a byte (dump_peer() asks it for its buffer). The buffer holds pattern_byte(seed, i) at offset i, so
// the parent can check every byte it pulls.

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>


namespace refit::ucx::testing {

inline uint8_t pattern_byte(uint32_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} << 32);
  x ^= x >> 29;
  return static_cast<uint8_t>(x * 0xBF58476D1CE4E5B9ull >> 56);
}

inline bool write_all(int fd, const void* p, size_t n) {
  auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

inline bool read_all(int fd, void* p, size_t n, std::chrono::steady_clock::time_point deadline) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
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

// Active-message ids the test peer serves (peer_main.cc).
constexpr unsigned kEchoId = 0x301;
constexpr unsigned kFailId = 0x302;

// The byte that asks a peer for a copy of its buffer (see peer_main.cc).
constexpr uint8_t kDumpCommand = 'D';

inline bool send_blob(int fd, const std::vector<uint8_t>& v) {
  uint32_t n = static_cast<uint32_t>(v.size());
  return write_all(fd, &n, 4) && write_all(fd, v.data(), v.size());
}

inline bool recv_blob(int fd, std::vector<uint8_t>* v,
                      std::chrono::steady_clock::time_point deadline) {
  uint32_t n = 0;
  if (!read_all(fd, &n, 4, deadline) || n > (1u << 24)) return false;
  v->resize(n);
  return read_all(fd, v->data(), n, deadline);
}

struct Peer {
  pid_t pid = -1;
  int fd = -1;
  std::vector<uint8_t> address;  // framed worker address
  std::vector<uint8_t> rkey;     // framed packed rkey
  uint64_t base = 0;             // remote buffer address
  uint64_t bytes = 0;
  std::string error;             // from the child, when it could not start
};

// Starting a peer (a target serving `bytes` of pattern(seed)) or a puller:
// fork, then exec the test binary, so the child starts with a clean UCX
// rather than a forked copy of this process's. Return false with `error` set
// if it could not start.
namespace internal {
// fork + exec `exe` with `args`, fd 3 being our end of a socketpair.
inline bool spawn(Peer* p, const char* env_var, const std::vector<std::string>& args) {
  const char* exe = std::getenv(env_var);
  if (exe == nullptr) {
    p->error = std::string(env_var) + " is not set (run through meson test)";
    return false;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
  std::vector<const char*> argv = {exe};
  for (const auto& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    ::dup2(sv[1], 3);  // dup2 clears CLOEXEC on fd 3
    ::execv(exe, const_cast<char* const*>(argv.data()));
    ::_exit(127);
  }
  ::close(sv[1]);
  p->pid = pid;
  p->fd = sv[0];
  return true;
}
}  // namespace internal

// `ucx_memory`: the peer's buffer comes from MemoryRegion::allocate.
// `as_source`: the peer serves it as a source serves a shard (peer_main.cc).
inline bool start_peer(Peer* p, const std::string& transports, uint32_t seed, uint64_t bytes,
                       bool ucx_memory = false, bool as_source = false) {
  std::vector<std::string> args = {transports, std::to_string(seed), std::to_string(bytes)};
  if (ucx_memory) args.push_back("ucx");
  if (as_source) args.push_back("source");
  if (!internal::spawn(p, "REFIT_UCX_TEST_PEER", args)) {
    return false;
  }
  p->bytes = bytes;
  return true;
}

// Starts a ucx_test_puller (path in $REFIT_UCX_TEST_PULLER) that pulls the
// whole buffer of `target` (serving pattern(seed)) over and over; see
// puller_main.cc. Its first byte on p->fd is 'P' once it pulls ok.
inline bool start_puller(Peer* p, const std::string& transports, uint32_t seed,
                         const Peer& target) {
  if (!internal::spawn(p, "REFIT_UCX_TEST_PULLER", {transports, std::to_string(seed)})) {
    return false;
  }
  std::vector<uint8_t> base(8), bytes(8);
  std::memcpy(base.data(), &target.base, 8);
  std::memcpy(bytes.data(), &target.bytes, 8);
  return send_blob(p->fd, target.address) && send_blob(p->fd, target.rkey) &&
         send_blob(p->fd, base) && send_blob(p->fd, bytes);
}

inline bool handshake(Peer* p, std::chrono::seconds timeout = std::chrono::seconds(15)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!recv_blob(p->fd, &p->address, deadline)) {
    p->error = "peer did not answer";
    return false;
  }
  if (p->address.empty()) {
    std::vector<uint8_t> e;
    recv_blob(p->fd, &e, deadline);
    p->error = std::string(e.begin(), e.end());
    return false;
  }
  std::vector<uint8_t> base;
  if (!recv_blob(p->fd, &p->rkey, deadline) || !recv_blob(p->fd, &base, deadline) ||
      base.size() != 8) {
    p->error = "peer handshake truncated";
    return false;
  }
  std::memcpy(&p->base, base.data(), 8);
  return true;
}

// Reads the peer's whole buffer back through the socket: what PUTs wrote
// there, as the peer's own CPU sees it.
inline bool dump_peer(Peer* p, std::vector<uint8_t>* out,
                      std::chrono::seconds timeout = std::chrono::seconds(15)) {
  if (!write_all(p->fd, &kDumpCommand, 1)) return false;
  return recv_blob(p->fd, out, std::chrono::steady_clock::now() + timeout) &&
         out->size() == p->bytes;
}

// Tells the peer to stop and reaps it; kills it if it does not exit in 5 s.
inline void stop_peer(Peer* p) {
  if (p->pid <= 0) return;
  uint8_t b = 1;
  (void)::send(p->fd, &b, 1, MSG_NOSIGNAL);  // the peer may be dead already
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int status = 0;
  while (::waitpid(p->pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(p->pid, SIGKILL);
      ::waitpid(p->pid, &status, 0);
      break;
    }
    ::usleep(1000);
  }
  ::close(p->fd);
  p->pid = -1;
}

}  // namespace refit::ucx::testing
