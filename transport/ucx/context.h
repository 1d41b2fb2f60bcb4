#pragma once
// A UCP context configured from refit's own settings, not from the process
// environment: one process may hold a "network" context (tcp, or rc on a
// cluster) and a "local" one (shared memory) at the same time.
// Move-only; the context must outlive its workers and memory regions.

#include <ucp/api/ucp.h>

#include <chrono>
#include <string>
#include <vector>

#include "planner/status.h"

namespace refit::ucx {

struct ContextConfig {
  // Names this context in error messages ("network", "local").
  std::string name = "ucx";
  // refit transport names. "tcp", "shm" (cma for the GETs, plus tcp for the
  // control lane that peer-failure handling needs in UCX 1.13), "self", or a
  // UCX transport name (rc, dc, ud, cma, posix, ...). Empty means UCX's
  // default ("all"). "self" is always added so that a process can GET from
  // itself.
  std::vector<std::string> transports;
  // Network devices (UCX NET_DEVICES), e.g. {"lo"} or {"mlx5_0:1"}; empty
  // means all.
  std::vector<std::string> devices;
  // How soon UCX notices a silent dead peer (UCX KEEPALIVE_INTERVAL). Zero
  // keeps UCX's default.
  std::chrono::milliseconds keepalive_interval{0};
};

class Context {
 public:
  // Reads UCX's defaults, applies `config` with ucp_config_modify and calls
  // ucp_init with RMA, AM and WAKEUP. An unknown transport name or a setting
  // UCX refuses gives an invalid-argument Status naming the setting.
  static Result<Context> create(const ContextConfig& config);

  Context(Context&& other) noexcept;
  Context& operator=(Context&& other) noexcept;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context();

  ucp_context_h get() const { return handle_; }
  const std::string& name() const { return name_; }

 private:
  Context(ucp_context_h handle, std::string name) : handle_(handle), name_(std::move(name)) {}
  ucp_context_h handle_ = nullptr;
  std::string name_;
};

// The UCX TLS string a refit transport list maps to, or an error naming the
// first unknown transport. Exposed for tests.
Result<std::string> ucx_tls_string(const std::vector<std::string>& transports,
                                   const std::string& context_name);

}  // namespace refit::ucx
