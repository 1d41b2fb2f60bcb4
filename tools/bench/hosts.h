#pragma once
// Many hosts on one machine: each host a network namespace whose one
// interface (besides lo) is a veth on a private bridge, the way a cluster's
// hosts sit on one switch. The bridge lives in a namespace of its own, so
// nothing of the harness touches the machine's own network.
//
//   refit-<pid>-h<K>          host K: interface rh<K>-<pid>, 10.77.0.<K+1>/24
//   refit-<pid>-coordinator   the coordinator's host: rhc-<pid>, 10.77.0.254/24
//   refit-<pid>-switch        the bridge rbr-<pid> and the hosts' other ends
//                             rp<K>-<pid> (rpc-<pid> for the coordinator)
//
// Names carry the creating process's pid, so concurrent runs never collide,
// and a run that was killed is recognised by its dead pid: create() first
// removes every refit-<pid>-* namespace whose process is gone. Removing a
// namespace removes its interfaces and their qdiscs with it once no process
// is left in it, and the ranks die with refit-bench (PR_SET_PDEATHSIG), so
// teardown is the namespaces' removal: at destruction, and from a SIGINT,
// SIGTERM or SIGHUP handler (umount and unlink, which are safe there).
//
// Links (every host's, the coordinator's too): a rate on both directions
// (tc tbf on both ends); a delay and a loss on what the host sends (a netem
// qdisc on the host's end; an nftables rule in the host's output hook that
// drops a random share), so that between two hosts a packet is delayed
// once and lost with the given probability once.
//
// Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (ip, tc), for a
// loss nftables (nft), for a delay a kernel with netem; check() and
// check_link() say what is missing before anything is made.
//
// Thread safety: one thread creates and destroys; counters() and set_up()
// may be called from any thread (they only run commands).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/status.h"

namespace refit::bench {

struct LinkSettings {
  double mbit = 0;          // 0: no rate limit
  double delay_ms = 0;      // one way
  double loss_percent = 0;  // of the packets a host sends
  bool any() const { return mbit > 0 || delay_ms > 0 || loss_percent > 0; }
};

// The option ranges, for refit-bench's checks: an error naming the option
// and its value when one is out of range.
Status check_link_settings(const LinkSettings& link);

struct Host {
  std::string name;     // "0", "1", ..., "coordinator"
  std::string netns;    // refit-<pid>-h<K>
  std::string device;   // the host's interface, inside netns
  std::string address;  // its IPv4 address
  std::string switch_device;  // the other end, in the switch's namespace
};

class Hosts {
 public:
  // Whether hosts can be made here: root, ip and tc, network namespaces.
  // The error says what is missing (for a test's skip and refit-bench's
  // message).
  static Status check();
  // Whether `link` is in range and this machine can apply it (tbf, netem,
  // nft), tried on a namespace of its own; the error names the option.
  static Status check_link(const LinkSettings& link);

  // Removes the namespaces of runs whose process is gone; returns their
  // names.
  static std::vector<std::string> sweep_stale();

  // Sweeps, then makes `count` hosts and the coordinator's, with `link` on
  // every link. On error whatever was made is removed.
  static Result<std::unique_ptr<Hosts>> create(int count, const LinkSettings& link);
  ~Hosts();
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  const std::vector<Host>& hosts() const { return hosts_; }
  const Host& coordinator() const { return coordinator_; }
  const LinkSettings& link() const { return link_; }
  const std::string& switch_netns() const { return switch_netns_; }

  // Takes host `k`'s link down (its switch end) or up again. Up returns
  // once the link carries: both ends operationally up and the bridge port
  // forwarding (up to 20 s, else a timeout naming what it saw).
  Status set_up(size_t k, bool up) const;

  // The byte counters of every host's interface, read from
  // /sys/class/net/<dev>/statistics inside its namespace:
  // {"<host name>": {"rx_bytes": n, "tx_bytes": n}, ...}.
  Result<nlohmann::json> counters() const;

  // Removes everything now (the destructor does the same).
  void remove();

 private:
  Hosts() = default;
  Status make_host(Host* h, const std::string& address);
  std::string prefix_;
  std::string switch_netns_;
  std::string bridge_;
  std::vector<Host> hosts_;
  Host coordinator_;
  LinkSettings link_;
  std::vector<std::string> made_;  // namespaces made, in order
};

// Moves the calling thread into network namespace `netns` (a name under
// /run/netns). For a forked child before it starts, or around the start
// of something whose threads must live there (NetnsScope).
Status enter_netns(const std::string& netns);

// enter_netns, and a mount namespace of the process's own whose /sys is
// that network namespace's (what `ip netns exec` does): UCX finds its
// network devices under /sys/class/net, which otherwise still lists the
// devices of the namespace /sys was mounted in. For a forked child (it
// unshares the whole process's mounts).
Status enter_host(const std::string& netns);

// Enters `netns` for the scope's life and returns the calling thread to
// the namespace it was in. ok() says whether it entered.
class NetnsScope {
 public:
  explicit NetnsScope(const std::string& netns);
  ~NetnsScope();
  NetnsScope(const NetnsScope&) = delete;
  NetnsScope& operator=(const NetnsScope&) = delete;
  const Status& status() const { return status_; }

 private:
  int saved_ = -1;
  Status status_;
};

// Runs argv[0] (looked up in PATH) with argv, at most `timeout_s`; an error
// with its stderr when it fails. Exposed for tests.
Result<std::string> run_command(const std::vector<std::string>& argv, double timeout_s = 20);

}  // namespace refit::bench
