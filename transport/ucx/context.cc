#include "transport/ucx/context.h"

#include <algorithm>
#include <array>
#include <string_view>

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

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += ",";
    out += s;
  }
  return out;
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
      // cma does the zero-copy GETs from user memory. UCX 1.13's posix and
      // sysv have no peer-failure support, so with UCP_ERR_HANDLING_MODE_PEER
      // (which refit needs on every endpoint) UCX refuses them for the
      // wireup/keepalive AM lane; tcp carries that lane instead. The data
      // path stays cma (UCX picks the highest-bandwidth RMA lane).
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

Result<Context> Context::create(const ContextConfig& config) {
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
  if (config.keepalive_interval.count() > 0) {
    REFIT_RETURN_IF_ERROR(modify("KEEPALIVE_INTERVAL",
                                 std::to_string(config.keepalive_interval.count()) + "ms",
                                 "keepalive_interval"));
  }

  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  params.name = config.name.c_str();
  ucp_context_h handle = nullptr;
  st = ucp_init(&params, ucp_config, &handle);
  if (st != UCS_OK) {
    return from_ucs(st, where + ": ucp_init with transports \"" + *tls + "\"" +
                            (config.devices.empty() ? "" : " devices \"" + join(config.devices) + "\"") +
                            "; check that these transports and devices exist here (ucx_info -d)");
  }
  return Context(handle, config.name);
}

Context::Context(Context&& other) noexcept
    : handle_(other.handle_), name_(std::move(other.name_)) {
  other.handle_ = nullptr;
}

Context& Context::operator=(Context&& other) noexcept {
  if (this != &other) {
    if (handle_) ucp_cleanup(handle_);
    handle_ = other.handle_;
    name_ = std::move(other.name_);
    other.handle_ = nullptr;
  }
  return *this;
}

Context::~Context() {
  if (handle_) ucp_cleanup(handle_);
}

}  // namespace refit::ucx
