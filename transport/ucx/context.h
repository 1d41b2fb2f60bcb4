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
  // refit transport names. "tcp", "shm" (posix, sysv and cma, plus tcp for
  // endpoints with PeerErrorHandling::kPeer: see endpoint.h), "self", or a
  // UCX transport name (rc, dc, ud, cma, posix, ...). Empty means UCX's
  // default ("all"). "self" is always added so that a process can GET from
  // itself.
  std::vector<std::string> transports;
  // Network devices (UCX NET_DEVICES), e.g. {"lo"} or {"mlx5_0:1"}. A name
  // UCX does not report for these transports is an error naming it and
  // listing the ones UCX has (UCX itself only warns). Empty: the interface
  // that reaches `route_to` when that is set and the transports reach the
  // network through tcp only (route.h), else all of UCX's devices.
  std::vector<std::string> devices;
  // A host (the coordinator's) whose route picks the default device.
  std::string route_to;
  // How soon UCX notices a silent dead peer (UCX KEEPALIVE_INTERVAL). Zero
  // keeps UCX's default.
  std::chrono::milliseconds keepalive_interval{0};
  // A context that only serves its memory to peers and never issues RMA
  // itself (a source's): ucp_init without UCP_FEATURE_RMA, so that UCX
  // installs none of its own software RMA handlers (its GET/PUT emulation
  // for transports without RMA, such as tcp), which read or write whatever
  // address a peer's request names with no check against registered
  // memory. Peers then reach the memory only through the AmRmaServer
  // (am_rma.h), which checks every request, or through hardware RMA that
  // the memory's protection flags govern (memory.h).
  bool serves_only = false;
};

class Context {
 public:
  // Reads UCX's defaults, applies `config` with ucp_config_modify and calls
  // ucp_init with RMA, AM and WAKEUP. An unknown transport or device name,
  // or a setting UCX refuses, gives an invalid-argument Status naming it.
  static Result<Context> create(const ContextConfig& config);

  Context(Context&& other) noexcept;
  Context& operator=(Context&& other) noexcept;
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  ~Context();

  ucp_context_h get() const { return handle_; }
  const std::string& name() const { return name_; }
  // The devices the context was created with: those configured, or the one
  // picked from route_to; empty means all of UCX's.
  const std::vector<std::string>& devices() const { return devices_; }
  // Active-message payloads go by copy, never zero-copy (by_copy.h): the
  // transports are only tcp, shared memory (shm, posix, sysv, cma, sm, mm) and
  // self. Such a context's tcp sends buffers of 64 KiB (UCX's 8 KiB
  // otherwise), so that a GET reply's piece goes as one message.
  bool am_by_copy() const { return am_by_copy_; }

 private:
  Context(ucp_context_h handle, std::string name) : handle_(handle), name_(std::move(name)) {}
  static Status check_devices(const Context& context, const ContextConfig& config,
                              const std::string& tls);
  ucp_context_h handle_ = nullptr;
  std::string name_;
  std::vector<std::string> devices_;
  bool am_by_copy_ = false;
};

// The UCX TLS string a refit transport list maps to, or an error naming the
// first unknown transport. Exposed for tests.
Result<std::string> ucx_tls_string(const std::vector<std::string>& transports,
                                   const std::string& context_name);

}  // namespace refit::ucx
