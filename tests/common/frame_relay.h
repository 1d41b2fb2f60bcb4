#pragma once
// A TCP relay between control-plane clients and a coordinator, as a party on
// the path would be: it listens on 127.0.0.1 (any free port) and forwards
// every connection to the coordinator, frame by frame, handing each frame to
// a hook that may alter it, drop it, send it twice or hold it. It knows the
// framing (transport/control/frame_codec.h) but no key: after the
// handshake (the challenge and auth_ok one way, the auth response the other)
// each frame is followed by its 32-byte seal, which it passes on as bytes.
// For tests only; every thread ends when the relay is destroyed.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace refit::testing {

class FrameRelay {
 public:
  enum class Direction { kToCoordinator, kToClient };
  // index: the frame's position in its direction on its connection, from 0.
  // The hook returns the frames to send in its place (none: dropped).
  using Hook = std::function<std::vector<std::vector<uint8_t>>(Direction, size_t index, std::vector<uint8_t> frame)>;

  FrameRelay(uint16_t target_port, Hook hook) : target_(target_port), hook_(std::move(hook)) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_fd_, 64) != 0) return;
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~FrameRelay() {
    stopping_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    ::close(listen_fd_);
    cut_all();
    std::vector<std::thread> pumps;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pumps = std::move(pumps_);
    }
    for (auto& t : pumps) t.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) ::close(fd);
  }
  FrameRelay(const FrameRelay&) = delete;
  FrameRelay& operator=(const FrameRelay&) = delete;

  uint16_t port() const { return port_; }
  // Cuts every relayed connection, both ways (as a network that drops would).
  void cut_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  }
  size_t connections() const { return connections_.load(); }

 private:
  static constexpr size_t kHeader = 16, kSeal = 32;

  void accept_loop() {
    while (!stopping_) {
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        if (stopping_) return;
        continue;
      }
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(target_);
      if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      int one = 1;
      ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ++connections_;
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { pump(client, server, Direction::kToCoordinator); });
      pumps_.emplace_back([this, client, server] { pump(server, client, Direction::kToClient); });
    }
  }

  static bool read_exact(int fd, uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t got = ::recv(fd, p, n, 0);
      if (got <= 0) return false;
      p += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }
  static bool write_all(int fd, const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
      if (put <= 0) return false;
      p += put;
      n -= static_cast<size_t>(put);
    }
    return true;
  }

  void pump(int from, int to, Direction d) {
    // Unsealed: the challenge and auth_ok to the client, the auth response
    // to the coordinator.
    const size_t unsealed = d == Direction::kToClient ? 2 : 1;
    for (size_t index = 0;; ++index) {
      std::vector<uint8_t> frame(kHeader);
      if (!read_exact(from, frame.data(), kHeader)) break;
      const uint32_t len = (uint32_t{frame[12]} << 24) | (uint32_t{frame[13]} << 16) | (uint32_t{frame[14]} << 8) |
                           frame[15];
      if (len > (64u << 20)) break;
      frame.resize(kHeader + len + (index >= unsealed ? kSeal : 0));
      if (!read_exact(from, frame.data() + kHeader, frame.size() - kHeader)) break;
      bool ok = true;
      for (auto& out : hook_(d, index, std::move(frame))) ok = ok && write_all(to, out.data(), out.size());
      if (!ok) break;
    }
    ::shutdown(from, SHUT_RDWR);
    ::shutdown(to, SHUT_RDWR);
  }

  uint16_t target_;
  Hook hook_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> connections_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;            // guarded by mu_
  std::vector<std::thread> pumps_;  // guarded by mu_
};

}  // namespace refit::testing
