#include "transport/ucx/context.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string_view>

#include "transport/ucx/route.h"
#include "transport/ucx/ucx_status.h"

namespace refit::ucx {
namespace {

// UCX 1.13 transport and alias names. UCX itself only warns about a name it
// does not know and then runs with whatever else is listed, which would turn
// a typo into a silent fallback; refit refuses instead.
constexpr std::array<std::string_view, 36> kUcxTransports = {
    "all",       "tcp",      "self",     "sm",       "shm",       "posix",
    "sysv",      "cma",      "knem",     "xpmem",    "mm",        "ib",
    "rc",        "rc_v",     "rc_x",     "rc_verbs", "rc_mlx5",   "dc",
    "dc_x",      "dc_mlx5",  "ud",       "ud_v",     "ud_x",      "ud_verbs",
    "ud_mlx5",   "cuda",     "cuda_copy", "cuda_ipc", "gdr_copy", "rocm",
    "rocm_copy", "rocm_ipc", "ugni",     "ugni_rdma", "ugni_udt", "ugni_smsg",
};

// The device names of a context's transport resources, from
// ucp_context_print_info (UCX 1.13 has no API that lists them): lines like
// "#      resource 1  :  md 1  dev 1  flags -- tcp/lo" give "lo".
std::vector<std::string> resource_devices(ucp_context_h context) {
  std::vector<std::string> devs;
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return devs;
  ucp_context_print_info(context, f);
  std::fclose(f);
  std::istringstream in(std::string(buf, len));
  std::free(buf);
  for (std::string line; std::getline(in, line);) {
    if (line.find("resource") == std::string::npos) continue;
    auto slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    std::string dev = line.substr(slash + 1);
    while (!dev.empty() && std::isspace(static_cast<unsigned char>(dev.back()))) dev.pop_back();
    if (!dev.empty() && std::find(devs.begin(), devs.end(), dev) == devs.end()) {
      devs.push_back(dev);
    }
  }
  return devs;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += ",";
    out += s;
  }
  return out;
}

// Whether every transport is tcp, shared memory or self: none is RDMA.
bool tcp_or_local_only(const std::vector<std::string>& transports) {
  return !transports.empty() && std::all_of(transports.begin(), transports.end(), [](const std::string& t) {
    return t == "tcp" || t == "shm" || t == "self" || t == "posix" || t == "sysv" || t == "cma" || t == "sm" ||
           t == "mm";
  });
}

// Whether the transports reach other hosts only through tcp, whose devices
// are the kernel's interfaces: then the interface toward the coordinator is
// a UCX device name. rc, dc, ud and "all" name HCA ports instead.
bool network_is_tcp(const std::vector<std::string>& transports) {
  return tcp_or_local_only(transports) && std::any_of(transports.begin(), transports.end(), [](const std::string& t) {
           return t == "tcp" || t == "shm";
         });
}

}  // namespace

Result<std::string> ucx_tls_string(const std::vector<std::string>& transports,
                                   const std::string& context_name) {
  if (transports.empty()) return std::string("all");
  std::vector<std::string> tls;
  auto add = [&](const std::string& t) {
    if (std::find(tls.begin(), tls.end(), t) == tls.end()) tls.push_back(t);
  };
  for (const auto& t : transports) {
    if (t == "shm") {
      // posix and sysv carry the active messages and, for memory UCX
      // allocated (MemoryRegion::allocate), the GETs themselves: a memcpy
      // from the peer's mapped segment, as ucx_perftest does; for other
      // memory UCX 1.13 emulates GETs with posix/sysv active messages (cma
      // serves only its rendezvous protocol); UCX 1.22 reads every memory
      // with cma zero-copy. tcp is there for endpoints with
      // PeerErrorHandling::kPeer: posix/sysv/cma have no peer-failure
      // support (UCX 1.13 and 1.22), so such an endpoint gets only a tcp
      // lane (and refit's active-message GETs, am_rma.h). Measured lanes and
      // bandwidths: refit-ucx-bench --transport shm.
      add("posix");
      add("sysv");
      add("cma");
      add("tcp");
    } else if (std::find(kUcxTransports.begin(), kUcxTransports.end(), t) !=
               kUcxTransports.end()) {
      add(t);
    } else {
      return Status::invalid("ucx context \"" + context_name + "\": transport \"" + t +
                             "\" is not a UCX transport; use tcp, shm, self, or a UCX name "
                             "such as rc, dc, ud, posix, sysv, cma");
    }
  }
  add("self");
  return join(tls);
}

// UCX's tcp send buffer for refit's contexts that send by copy: a GET
// reply's piece and its headers in one (am_rma::kReplyPieceBytes is 63 KiB).
constexpr const char* kTcpSendSegment = "64K";

Result<Context> Context::create(const ContextConfig& asked) {
  ContextConfig config = asked;
  if (config.devices.empty() && !config.route_to.empty() && network_is_tcp(config.transports)) {
    Result<std::string> dev = interface_toward(config.route_to);
    if (!dev.is_ok()) {
      return dev.status().with_context("ucx context \"" + config.name +
                                       "\": choosing the default of \"devices\"");
    }
    config.devices = {*dev};
  }
  auto tls = ucx_tls_string(config.transports, config.name);
  if (!tls) return tls.status();
  const std::string where = "ucx context \"" + config.name + "\"";

  ucp_config_t* ucp_config = nullptr;
  // The environment prefix is UCX's default; refit's settings are applied
  // on top with ucp_config_modify, so they win over UCX_* variables.
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &ucp_config);
  if (st != UCS_OK) return from_ucs(st, where + ": ucp_config_read");
  struct ConfigGuard {
    ucp_config_t* c;
    ~ConfigGuard() { ucp_config_release(c); }
  } guard{ucp_config};

  auto modify = [&](const char* key, const std::string& value, const char* setting) -> Status {
    ucs_status_t s = ucp_config_modify(ucp_config, key, value.c_str());
    if (s != UCS_OK) {
      return Status::invalid(where + ": setting " + setting + " = \"" + value +
                             "\" refused by UCX (" + key + "): " + ucs_status_string(s));
    }
    return Status::ok();
  };
  REFIT_RETURN_IF_ERROR(modify("TLS", *tls, "transports"));
  if (!config.devices.empty()) {
    REFIT_RETURN_IF_ERROR(modify("NET_DEVICES", join(config.devices), "devices"));
  }
  // refit's active messages go by copy where the transports are tcp and
  // shared memory only (by_copy.h); tcp's send buffers then take a GET
  // reply's piece (am_rma::kReplyPieceBytes) in one message instead of
  // eight of UCX's default 8 KiB. The key is tcp's UCX_TCP_TX_SEG_SIZE, and
  // the two UCX versions refit is tested with spell it differently:
  // UCX 1.13 applies "TX_SEG_SIZE" to the tcp interface and takes
  // "TCP_TX_SEG_SIZE" without applying it (its transports match keys
  // without their prefix); UCX 1.22 refuses "TX_SEG_SIZE" and applies
  // "TCP_TX_SEG_SIZE". The first that UCX takes is the one it applies.
  const bool by_copy = tcp_or_local_only(config.transports);
  if (by_copy && ucp_config_modify(ucp_config, "TX_SEG_SIZE", kTcpSendSegment) != UCS_OK) {
    REFIT_RETURN_IF_ERROR(modify("TCP_TX_SEG_SIZE", kTcpSendSegment, "tcp send segment"));
  }
  // tcp connects without blocking (UCX_TCP_CONN_NB; UCX's default is a
  // blocking connect()). A blocking one runs inside ucp_ep_create, where
  // no deadline reaches: toward a host whose link went down it waits for
  // the kernel's SYN retries, about two minutes, and a refresh that made an
  // endpoint to a source just cut off outlasted its bound by that much.
  // Non-blocking, the endpoint is made at once, and what is posted on it
  // ends by the peer's failure or the caller's deadline. Set whatever the
  // transports ("all" may come to tcp too), under the same two spellings as
  // the send segment's (UCX 1.13 applies "CONN_NB", 1.22 "TCP_CONN_NB").
  if (ucp_config_modify(ucp_config, "CONN_NB", "y") != UCS_OK) {
    REFIT_RETURN_IF_ERROR(modify("TCP_CONN_NB", "y", "tcp non-blocking connect"));
  }
  if (config.keepalive_interval.count() > 0) {
    REFIT_RETURN_IF_ERROR(modify("KEEPALIVE_INTERVAL",
                                 std::to_string(config.keepalive_interval.count()) + "ms",
                                 "keepalive_interval"));
  }

  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  if (!config.serves_only) params.features |= UCP_FEATURE_RMA;
  params.mt_workers_shared = 0;
  params.name = config.name.c_str();
  ucp_context_h handle = nullptr;
  st = ucp_init(&params, ucp_config, &handle);
  if (st != UCS_OK) {
    return from_ucs(st, where + ": ucp_init with transports \"" + *tls + "\"" +
                            (config.devices.empty() ? "" : " devices \"" + join(config.devices) + "\"") +
                            "; check that these transports and devices exist here (ucx_info -d)");
  }
  Context context(handle, config.name);
  context.devices_ = config.devices;
  context.am_by_copy_ = by_copy;
  REFIT_RETURN_IF_ERROR(check_devices(context, config, *tls));
  return context;
}

Status Context::check_devices(const Context& context, const ContextConfig& config,
                              const std::string& tls) {
  if (config.devices.empty()) return Status::ok();
  // UCX only warns about a network device it does not have and runs without
  // it, which would turn a typo into a context with no network at all.
  const std::vector<std::string> have = resource_devices(context.get());
  std::vector<std::string> missing;
  for (const auto& d : config.devices) {
    if (d != "all" && std::find(have.begin(), have.end(), d) == have.end()) missing.push_back(d);
  }
  if (missing.empty()) return Status::ok();
  // What is there: the same transports on every device.
  std::string available = "(none)";
  ucp_config_t* probe_config = nullptr;
  if (ucp_config_read(nullptr, nullptr, &probe_config) == UCS_OK) {
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
    ucp_context_h probe = nullptr;
    if (ucp_config_modify(probe_config, "TLS", tls.c_str()) == UCS_OK &&
        ucp_config_modify(probe_config, "NET_DEVICES", "all") == UCS_OK &&
        ucp_init(&params, probe_config, &probe) == UCS_OK) {
      std::vector<std::string> all = resource_devices(probe);
      all.erase(std::remove_if(all.begin(), all.end(),
                               [](const std::string& d) {
                                 return d.rfind("memory", 0) == 0;  // shm and self
                               }),
                all.end());
      if (!all.empty()) available = join(all);
      ucp_cleanup(probe);
    }
    ucp_config_release(probe_config);
  }
  return Status::invalid("ucx context \"" + config.name + "\": device \"" + missing.front() +
                         "\" in devices is not a UCX network device here for transports \"" +
                         tls + "\"; UCX reports: " + available);
}

Context::Context(Context&& other) noexcept
    : handle_(other.handle_),
      name_(std::move(other.name_)),
      devices_(std::move(other.devices_)),
      am_by_copy_(other.am_by_copy_) {
  other.handle_ = nullptr;
}

Context& Context::operator=(Context&& other) noexcept {
  if (this != &other) {
    if (handle_) ucp_cleanup(handle_);
    handle_ = other.handle_;
    name_ = std::move(other.name_);
    devices_ = std::move(other.devices_);
    am_by_copy_ = other.am_by_copy_;
    other.handle_ = nullptr;
  }
  return *this;
}

Context::~Context() {
  if (handle_) ucp_cleanup(handle_);
}

}  // namespace refit::ucx
