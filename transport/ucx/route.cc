#include "transport/ucx/route.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace refit::ucx {
namespace {

bool same_address(const sockaddr* a, const sockaddr* b) {
  if (a == nullptr || b == nullptr || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

bool wildcard(const sockaddr* a) {
  if (a->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == INADDR_ANY;
  if (a->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  }
  return false;
}

}  // namespace

Result<std::string> interface_toward(const std::string& host) {
  const std::string where = "the interface toward \"" + host + "\"";
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &found);
  if (rc != 0) return Status::invalid(where + ": cannot resolve it: " + gai_strerror(rc));
  struct Free {
    addrinfo* a;
    ~Free() { ::freeaddrinfo(a); }
  } free_found{found};
  std::string last_error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    if (wildcard(ai->ai_addr)) {
      return Status::invalid(where + ": a wildcard address names no host; set \"network.devices\"");
    }
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage local = {};
    socklen_t len = sizeof(local);
    const bool routed = ::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!routed) last_error = std::strerror(errno);
    ::close(fd);
    if (!routed) continue;
    ifaddrs* ifs = nullptr;
    if (::getifaddrs(&ifs) != 0) return Status::io_error(where + ": getifaddrs: " + std::strerror(errno));
    std::string name;
    for (ifaddrs* i = ifs; i != nullptr && name.empty(); i = i->ifa_next) {
      if (same_address(i->ifa_addr, reinterpret_cast<sockaddr*>(&local))) name = i->ifa_name;
    }
    ::freeifaddrs(ifs);
    if (!name.empty()) return name;
    last_error = "no interface holds the local address the route uses";
  }
  return Status::invalid(where + ": no route reaches it (" + last_error + ")");
}

}  // namespace refit::ucx
