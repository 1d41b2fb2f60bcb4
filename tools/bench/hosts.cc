#include "tools/bench/hosts.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace refit::bench {
namespace {

constexpr const char* kNetnsDir = "/run/netns/";
constexpr const char* kSubnet = "10.77.0.";

// The namespaces of the live Hosts, for the signal handler: fixed buffers,
// since the handler may not allocate.
constexpr int kMaxPaths = 256;
char g_paths[kMaxPaths][96];
volatile sig_atomic_t g_count = 0;
struct sigaction g_previous[3];
constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};

void remove_namespace_paths() {
  for (int i = g_count - 1; i >= 0; --i) {
    ::umount2(g_paths[i], MNT_DETACH);
    ::unlink(g_paths[i]);
  }
  g_count = 0;
}

void on_signal(int sig) {
  remove_namespace_paths();
  for (int i = 0; i < 3; ++i)
    if (kSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  ::raise(sig);
}

void register_path(const std::string& netns) {
  if (g_count >= kMaxPaths) return;
  std::snprintf(g_paths[g_count], sizeof g_paths[0], "%s%s", kNetnsDir, netns.c_str());
  if (g_count == 0) {
    struct sigaction sa = {};
    sa.sa_handler = &on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &g_previous[i]);
  }
  g_count = g_count + 1;
}

void unregister_path(const std::string& netns) {
  const std::string path = kNetnsDir + netns;
  for (int i = 0; i < g_count; ++i) {
    if (path != g_paths[i]) continue;
    std::memmove(g_paths[i], g_paths[g_count - 1], sizeof g_paths[0]);
    g_count = g_count - 1;
    break;
  }
  if (g_count == 0)
    for (int i = 0; i < 3; ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
}

bool process_alive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string join(const std::vector<std::string>& argv) {
  std::string s;
  for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
  return s;
}

}  // namespace

Result<std::string> run_command(const std::vector<std::string>& argv, double timeout_s) {
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return Status::io_error("pipe: " + std::string(std::strerror(errno)));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out[0]);
    ::close(out[1]);
    return Status::io_error("fork for " + argv[0] + ": " + std::strerror(errno));
  }
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(out[1]);
  std::string text;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  bool timed_out = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p = {out[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    char buf[4096];
    const ssize_t k = ::read(out[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    text.append(buf, static_cast<size_t>(k));
  }
  ::close(out[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (timed_out) return Status::timeout("`" + join(argv) + "` took more than " + num(timeout_s) + " s");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return Status::io_error("`" + join(argv) + "` failed: " + (text.empty() ? "no message" : text));
  return text;
}

Status check_link_settings(const LinkSettings& link) {
  if (!(link.mbit >= 0) || link.mbit > 400000 || (link.mbit > 0 && link.mbit < 1))
    return Status::invalid("--link-mbit " + num(link.mbit) + ": the rate must be from 1 to 400000 Mbit/s");
  if (!(link.delay_ms >= 0) || link.delay_ms > 10000)
    return Status::invalid("--link-delay-ms " + num(link.delay_ms) + ": the delay must be from 0 to 10000 ms");
  if (!(link.loss_percent >= 0) || link.loss_percent >= 100)
    return Status::invalid("--link-loss " + num(link.loss_percent) +
                           ": the loss must be a percentage from 0 up to (not including) 100");
  return Status::ok();
}

Status Hosts::check_link(const LinkSettings& link) {
  REFIT_RETURN_IF_ERROR(check_link_settings(link));
  if (!link.any()) return Status::ok();
  // What this kernel and these tools can do, tried on a namespace of our own.
  const std::string probe = "refit-" + std::to_string(::getpid()) + "-probe";
  REFIT_RETURN_IF_ERROR(run_command({"ip", "netns", "add", probe}, 10).status());
  Status st =
      run_command({"ip", "-n", probe, "link", "add", "rprobe", "type", "veth", "peer", "name", "rprobe1"}, 10).status();
  if (st.is_ok() && link.delay_ms > 0) {
    auto r = run_command({"tc", "-n", probe, "qdisc", "add", "dev", "rprobe", "root", "netem", "delay", "1ms"}, 10);
    if (!r.is_ok())
      st = Status::unsupported("--link-delay-ms " + num(link.delay_ms) +
                               ": this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), which the delay needs (" +
                               r.status().message() + ")");
  }
  if (st.is_ok() && link.mbit > 0) {
    auto r = run_command({"tc", "-n", probe, "qdisc", "replace", "dev", "rprobe", "root", "tbf", "rate", "100mbit",
                          "burst", "262144", "latency", "100ms"},
                         10);
    if (!r.is_ok())
      st = Status::unsupported("--link-mbit " + num(link.mbit) + ": this kernel has no tbf qdisc (" +
                               r.status().message() + ")");
  }
  if (st.is_ok() && link.loss_percent > 0) {
    auto r = run_command({"ip", "netns", "exec", probe, "nft", "add table inet refit_probe"}, 10);
    if (!r.is_ok())
      st = Status::unsupported("--link-loss " + num(link.loss_percent) +
                               ": the loss needs nftables (`nft`, scripts/install-deps): " + r.status().message());
  }
  (void)run_command({"ip", "netns", "del", probe}, 10);
  return st;
}

Status Hosts::check() {
  if (::geteuid() != 0) return Status::unsupported("hosts need root (network namespaces, veth, tc); running as uid " +
                                                   std::to_string(::geteuid()));
  for (const char* tool : {"ip", "tc"}) {
    auto r = run_command({tool, "-V"}, 10);
    if (!r.is_ok())
      return Status::unsupported(std::string("hosts need iproute2's `") + tool + "` (scripts/install-deps): " +
                                 r.status().message());
  }
  // A namespace of our own, made and removed: what create() needs.
  const std::string probe = "refit-" + std::to_string(::getpid()) + "-probe";
  auto made = run_command({"ip", "netns", "add", probe}, 10);
  if (!made.is_ok()) return Status::unsupported("cannot make a network namespace here: " + made.status().message());
  (void)run_command({"ip", "netns", "del", probe}, 10);
  return Status::ok();
}

std::vector<std::string> Hosts::sweep_stale() {
  std::vector<std::string> removed;
  auto list = run_command({"ip", "netns", "list"}, 10);
  if (!list.is_ok()) return removed;
  std::istringstream in(*list);
  for (std::string line; std::getline(in, line);) {
    const std::string name = line.substr(0, line.find(' '));
    if (name.rfind("refit-", 0) != 0) continue;
    const size_t dash = name.find('-', 6);
    if (dash == std::string::npos) continue;
    int pid = 0;
    try {
      pid = std::stoi(name.substr(6, dash - 6));
    } catch (const std::exception&) {
      continue;
    }
    if (process_alive(pid)) continue;
    if (run_command({"ip", "netns", "del", name}, 10).is_ok()) removed.push_back(name);
  }
  return removed;
}

Status Hosts::make_host(Host* h, const std::string& address) {
  REFIT_RETURN_IF_ERROR(run_command({"ip", "netns", "add", h->netns}).status());
  made_.push_back(h->netns);
  register_path(h->netns);
  REFIT_RETURN_IF_ERROR(run_command({"ip", "link", "add", h->device, "netns", h->netns, "type", "veth", "peer", "name",
                                     h->switch_device, "netns", switch_netns_})
                            .status());
  h->address = address;
  REFIT_RETURN_IF_ERROR(run_command({"ip", "-n", h->netns, "addr", "add", address + "/24", "dev", h->device}).status());
  REFIT_RETURN_IF_ERROR(run_command({"ip", "-n", h->netns, "link", "set", "lo", "up"}).status());
  REFIT_RETURN_IF_ERROR(run_command({"ip", "-n", h->netns, "link", "set", h->device, "up"}).status());
  REFIT_RETURN_IF_ERROR(
      run_command({"ip", "-n", switch_netns_, "link", "set", h->switch_device, "master", bridge_, "up"}).status());
  // The rate: tbf on both ends, so both directions are capped. Its bucket
  // holds at least a few GSO packets (64 KiB each) or 4 ms at the rate.
  const double burst = std::max(256.0 * 1024, link_.mbit * 1e6 / 8 * 0.004);
  const std::vector<std::string> tbf = {"tbf", "rate", num(link_.mbit) + "mbit", "burst",
                                        std::to_string(static_cast<int64_t>(burst)), "latency", "100ms"};
  auto qdisc = [&](const std::string& netns, const std::string& dev, std::vector<std::string> args) {
    std::vector<std::string> argv = {"tc", "-n", netns, "qdisc", "add", "dev", dev};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv).status();
  };
  if (link_.delay_ms > 0) {
    // The delay on what the host sends: netem at the root, the rate (if
    // any) under it.
    REFIT_RETURN_IF_ERROR(qdisc(h->netns, h->device,
                                {"root", "handle", "1:", "netem", "limit", "100000", "delay", num(link_.delay_ms) + "ms"}));
    if (link_.mbit > 0) {
      std::vector<std::string> child = {"parent", "1:1", "handle", "2:"};
      child.insert(child.end(), tbf.begin(), tbf.end());
      REFIT_RETURN_IF_ERROR(qdisc(h->netns, h->device, child));
    }
  } else if (link_.mbit > 0) {
    std::vector<std::string> root = {"root"};
    root.insert(root.end(), tbf.begin(), tbf.end());
    REFIT_RETURN_IF_ERROR(qdisc(h->netns, h->device, root));
  }
  if (link_.mbit > 0) {
    std::vector<std::string> root = {"root"};
    root.insert(root.end(), tbf.begin(), tbf.end());
    REFIT_RETURN_IF_ERROR(qdisc(switch_netns_, h->switch_device, root));
  }
  if (link_.loss_percent > 0) {
    // The loss on what the host sends: an nftables rule in the host's
    // output hook drops a random share of the packets (in 1/100000 steps).
    const int64_t per_100k = static_cast<int64_t>(std::llround(link_.loss_percent * 1000));
    REFIT_RETURN_IF_ERROR(run_command({"ip", "netns", "exec", h->netns, "nft",
                                       "add table inet refit_link; "
                                       "add chain inet refit_link out { type filter hook output priority 0; }; "
                                       "add rule inet refit_link out numgen random mod 100000 < " +
                                           std::to_string(per_100k) + " drop"})
                              .status());
  }
  return Status::ok();
}

Result<std::unique_ptr<Hosts>> Hosts::create(int count, const LinkSettings& link) {
  REFIT_RETURN_IF_ERROR(check_link(link));
  if (count < 1 || count > 200) return Status::invalid("hosts: " + std::to_string(count) + " hosts (1 to 200)");
  (void)sweep_stale();
  std::unique_ptr<Hosts> h(new Hosts());
  const std::string pid = std::to_string(::getpid());
  h->prefix_ = "refit-" + pid + "-";
  h->link_ = link;
  h->switch_netns_ = h->prefix_ + "switch";
  h->bridge_ = "rbr-" + pid;
  Status st = run_command({"ip", "netns", "add", h->switch_netns_}).status();
  if (st.is_ok()) {
    h->made_.push_back(h->switch_netns_);
    register_path(h->switch_netns_);
    st = run_command({"ip", "-n", h->switch_netns_, "link", "add", h->bridge_, "type", "bridge"}).status();
  }
  if (st.is_ok()) st = run_command({"ip", "-n", h->switch_netns_, "link", "set", h->bridge_, "up"}).status();
  for (int k = 0; k < count && st.is_ok(); ++k) {
    Host host;
    host.name = std::to_string(k);
    host.netns = h->prefix_ + "h" + host.name;
    host.device = "rh" + host.name + "-" + pid;
    host.switch_device = "rp" + host.name + "-" + pid;
    st = h->make_host(&host, kSubnet + std::to_string(k + 1));
    h->hosts_.push_back(host);
  }
  if (st.is_ok()) {
    Host& c = h->coordinator_;
    c.name = "coordinator";
    c.netns = h->prefix_ + "coordinator";
    c.device = "rhc-" + pid;
    c.switch_device = "rpc-" + pid;
    st = h->make_host(&c, std::string(kSubnet) + "254");
  }
  if (!st.is_ok()) {
    h->remove();
    return st.with_context("making the hosts");
  }
  return h;
}

Hosts::~Hosts() { remove(); }

void Hosts::remove() {
  // Hosts first: deleting a namespace takes its end of each veth with it,
  // and the pair goes with either end.
  for (auto it = made_.rbegin(); it != made_.rend(); ++it) {
    (void)run_command({"ip", "netns", "del", *it}, 10);
    unregister_path(*it);
  }
  made_.clear();
}

Status Hosts::set_up(size_t k, bool up) const {
  if (k >= hosts_.size()) return Status::invalid("hosts: there is no host " + std::to_string(k));
  const Host& h = hosts_[k];
  REFIT_RETURN_IF_ERROR(
      run_command({"ip", "-n", switch_netns_, "link", "set", h.switch_device, up ? "up" : "down"}).status());
  if (!up) return Status::ok();
  // "ip link set up" returns before the link carries: the carrier reaches
  // both ends, and the bridge enables its port, only when the kernel's
  // link watcher runs, which waits for the rtnl lock that namespace
  // creation and removal elsewhere hold, at times for seconds. Until then
  // the host's end drops what it sends. So up means both ends operationally
  // up and the bridge port forwarding.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::string seen;
  while (true) {
    auto host_end = run_command({"ip", "-n", h.netns, "-o", "link", "show", "dev", h.device}, 10);
    auto switch_end = run_command({"ip", "-n", switch_netns_, "-o", "link", "show", "dev", h.switch_device}, 10);
    auto port = run_command({"bridge", "-n", switch_netns_, "-o", "link", "show", "dev", h.switch_device}, 10);
    for (const auto* r : {&host_end, &switch_end, &port})
      if (!r->is_ok()) return r->status().with_context("hosts: the state of host " + h.name + "'s link");
    if (host_end->find(" state UP ") != std::string::npos && switch_end->find(" state UP ") != std::string::npos &&
        port->find(" state forwarding ") != std::string::npos)
      return Status::ok();
    seen = *host_end + *switch_end + *port;
    if (std::chrono::steady_clock::now() >= deadline) break;
    ::usleep(20 * 1000);
  }
  return Status::timeout("hosts: host " + h.name + "'s link is not up 20 s after it was set up: " + seen);
}

Result<nlohmann::json> Hosts::counters() const {
  nlohmann::json out = nlohmann::json::object();
  std::vector<const Host*> all;
  for (const Host& h : hosts_) all.push_back(&h);
  all.push_back(&coordinator_);
  for (const Host* h : all) {
    const std::string dir = "/sys/class/net/" + h->device + "/statistics/";
    // `ip netns exec` mounts the namespace's own /sys for the command.
    auto text = run_command({"ip", "netns", "exec", h->netns, "cat", dir + "rx_bytes", dir + "tx_bytes"}, 10);
    if (!text.is_ok()) return text.status();
    std::istringstream in(*text);
    int64_t rx = -1, tx = -1;
    if (!(in >> rx >> tx)) return Status::io_error("hosts: unreadable counters of " + h->device + ": " + *text);
    out[h->name] = {{"rx_bytes", rx}, {"tx_bytes", tx}};
  }
  return out;
}

Status enter_netns(const std::string& netns) {
  const std::string path = kNetnsDir + netns;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::io_error("network namespace " + netns + ": " + std::strerror(errno));
  const int rc = ::setns(fd, CLONE_NEWNET);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::io_error("entering network namespace " + netns + ": " + std::strerror(err));
  return Status::ok();
}

Status enter_host(const std::string& netns) {
  REFIT_RETURN_IF_ERROR(enter_netns(netns));
  if (::unshare(CLONE_NEWNS) != 0) return Status::io_error("unshare(CLONE_NEWNS): " + std::string(std::strerror(errno)));
  // Nothing mounted here may reach the machine's mount namespace.
  if (::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0)
    return Status::io_error("making / a slave mount: " + std::string(std::strerror(errno)));
  (void)::umount2("/sys", MNT_DETACH);
  if (::mount(netns.c_str(), "/sys", "sysfs", 0, nullptr) != 0)
    return Status::io_error("mounting /sys for " + netns + ": " + std::strerror(errno));
  return Status::ok();
}

NetnsScope::NetnsScope(const std::string& netns) {
  saved_ = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (saved_ < 0) {
    status_ = Status::io_error("network namespace of this thread: " + std::string(std::strerror(errno)));
    return;
  }
  status_ = enter_netns(netns);
}

NetnsScope::~NetnsScope() {
  if (saved_ < 0) return;
  if (status_.is_ok()) (void)::setns(saved_, CLONE_NEWNET);
  ::close(saved_);
}

}  // namespace refit::bench
