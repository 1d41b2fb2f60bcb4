#include "transport/ucx/endpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "transport/ucx/ucx_status.h"
#include "transport/ucx/wire_blob.h"

namespace refit::ucx {
namespace {

// Whether UCX selects operations with its newer protocol layer
// (UCX_PROTO_ENABLE=y: the default of the UCX 1.22 that scripts/ucx-wheel
// builds against; Debian's 1.13 defaults to n). refit never sets
// PROTO_ENABLE itself, so the environment's value is every context's. Read
// once: ucp_config_read parses the whole environment.
bool new_protocols() {
  static const bool enabled = [] {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f != nullptr) {
      ucp_config_print(config, f, nullptr, UCS_CONFIG_PRINT_CONFIG);
      std::fclose(f);
    }
    ucp_config_release(config);
    std::istringstream text(buf != nullptr ? std::string(buf, len) : std::string());
    std::free(buf);
    for (std::string line; std::getline(text, line);) {
      if (line == "UCX_PROTO_ENABLE=y") return true;
    }
    return false;
  }();
  return enabled;
}

// Whether a lane line of ucp_ep_print_info names a lane that the newer
// protocols read remote memory on: a zero-copy RMA lane ("rma_bw#N") of a
// transport that can GET. tcp is such a lane only for PUT (its rendezvous),
// and UCX emulates a GET on it with active messages.
bool lane_gets_natively(const std::string& line) {
  if (line.find(" rma_bw#") == std::string::npos && line.find(" rma#") == std::string::npos) {
    return false;
  }
  // "lane[2]:  5:cma/memory.0 md[4] ...": the transport follows "N:".
  auto colon = line.find(':', line.find(']'));
  if (colon == std::string::npos) return false;
  auto start = line.find(':', colon + 1);
  auto slash = line.find('/', colon);
  if (start == std::string::npos || slash == std::string::npos || start > slash) return false;
  return line.substr(start + 1, slash - start - 1) != "tcp";
}

}  // namespace

Result<Endpoint> Endpoint::create(Worker& worker, std::span<const uint8_t> peer_address,
                                  std::string peer_name, PeerErrorHandling mode) {
  const std::string where = "ucx endpoint \"" + peer_name + "\"";
  auto blob = unframe_blob(BlobKind::kWorkerAddress, peer_address, where + " worker address");
  if (!blob) return blob.status();

  auto state = std::make_unique<State>();
  state->worker = worker.get();
  state->name = std::move(peer_name);

  ucp_ep_params_t params = {};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(blob->payload.data());
  params.err_mode =
      mode == PeerErrorHandling::kPeer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  params.err_handler.cb = &Endpoint::on_error;
  params.err_handler.arg = state.get();
  ucs_status_t st = ucp_ep_create(worker.get(), &params, &state->ep);
  if (st != UCS_OK) return from_ucs(st, where + ": ucp_ep_create");
  read_lanes(state.get());
  return Endpoint(std::move(state));
}

void Endpoint::read_lanes(State* s) {
  // ucp_ep_print_info is the only UCX 1.13 API that tells which transport
  // carries what; its lane lines look like
  //   "#   lane[2]:  3:cma/memory.0 md[3]  -> md[3]/cma/sysdev[255] rma_bw#0".
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return;
  ucp_ep_print_info(s->ep, f);
  std::fclose(f);
  std::istringstream in(std::string(buf, len));
  std::free(buf);
  // UCX 1.13 prints a "get[N]: <protocols>" line for each RMA lane it would
  // use for ucp_get_nbx (rc, posix/sysv for memory it allocated, ...); with
  // none, GETs go through its active-message emulation. The newer protocols
  // (UCX 1.22 here) print no such line for shared memory, yet read remote
  // memory with zero-copy on the cma lane (UCX_PROTO_INFO=y shows "remote
  // memory read ... zero-copy cma/memory" for every size); its lane line
  // then is what tells.
  const bool v2 = new_protocols();
  bool any_rma = false;
  for (std::string line; std::getline(in, line);) {
    auto at = line.find("get[");
    if (at != std::string::npos) any_rma = true;
    if (at == std::string::npos) {
      at = line.find("lane[");
      if (at != std::string::npos && v2 && lane_gets_natively(line.substr(at))) any_rma = true;
    }
    if (at == std::string::npos) continue;
    line = line.substr(at);
    if (!s->lanes.empty()) s->lanes += "\n";
    s->lanes += line;
  }
  s->rma_in_software = !any_rma;
}

void Endpoint::on_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* s = static_cast<State*>(arg);
  s->ucx_error = status;
  s->failed.store(true, std::memory_order_release);
}

Status Endpoint::failure() const {
  if (!failed()) return Status::ok();
  if (!state_) return Status::invalid("ucx endpoint: moved from");
  const std::string where = "ucx endpoint \"" + state_->name + "\"";
  if (!state_->reason.empty()) return Status::io_error(where + ": " + state_->reason);
  Status s = from_ucs(state_->ucx_error, where + ": peer failed");
  return s.is_ok() ? Status::io_error(where + ": failed") : s;
}

Status Endpoint::import_rkey(uint64_t id, std::span<const uint8_t> packed) {
  const std::string what =
      "ucx endpoint \"" + state_->name + "\" rkey id " + std::to_string(id);
  if (failed()) return failure();
  auto it = state_->rkeys.find(id);
  if (it != state_->rkeys.end()) {
    if (it->second.packed.size() == packed.size() &&
        std::equal(packed.begin(), packed.end(), it->second.packed.begin())) {
      return Status::ok();
    }
    return Status::invalid(what + ": already imported with different bytes; use a new id for "
                           "a new region");
  }
  auto key = RemoteKey::unpack(state_->ep, packed, what);
  if (!key) return key.status();
  state_->rkeys.emplace(
      id, State::Key{std::vector<uint8_t>(packed.begin(), packed.end()), std::move(*key)});
  return Status::ok();
}

const RemoteKey* Endpoint::rkey(uint64_t id) const {
  auto it = state_->rkeys.find(id);
  return it == state_->rkeys.end() ? nullptr : &it->second.key;
}

void Endpoint::close(bool force, std::chrono::steady_clock::time_point deadline) {
  if (!state_ || state_->ep == nullptr) return;
  // Keys are bound to the endpoint: release them first.
  state_->rkeys.clear();
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(state_->ep, &param);
  state_->ep = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  while (ucp_request_check_status(req) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(state_->worker);
  }
  // A close that has not finished by the deadline is handed back to UCX,
  // which frees it when it completes; it has no callback that could touch
  // refit memory.
  ucp_request_free(req);
}

void Endpoint::force_close(const std::string& reason,
                           std::chrono::steady_clock::time_point deadline) {
  if (!state_) return;
  if (state_->reason.empty()) state_->reason = reason;
  state_->failed.store(true, std::memory_order_release);
  close(/*force=*/true, deadline);
}

Endpoint& Endpoint::operator=(Endpoint&& other) noexcept {
  if (this != &other) {
    if (state_) close(failed(), std::chrono::steady_clock::now() + std::chrono::seconds(1));
    state_ = std::move(other.state_);
  }
  return *this;
}

Endpoint::~Endpoint() {
  if (state_) close(failed(), std::chrono::steady_clock::now() + std::chrono::seconds(1));
}

}  // namespace refit::ucx
