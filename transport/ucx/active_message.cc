#include "transport/ucx/active_message.h"

#include <algorithm>
#include <cstring>

#include "transport/ucx/ucx_status.h"

namespace refit::ucx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x52414d31;  // "RAM1": format version 1

// Response status on the wire.
enum : int32_t { kOk = 0, kHandlerError = 1, kNoHandler = 2, kTooLarge = 3 };

struct RequestHeader {
  uint32_t magic = kMagic;
  uint32_t reserved = 0;
  uint64_t token = 0;
};

struct ResponseHeader {
  uint32_t magic = kMagic;
  int32_t status = kOk;
  uint64_t token = 0;
};

// Lives until UCX completes the send (UCX 1.13 cannot copy the header).
template <typename Header>
struct SendState {
  Header header;
  std::vector<uint8_t> bytes;
  std::shared_ptr<ucs_status_t> result;  // the send's status, when someone waits
};

template <typename Header>
void on_sent(void* request, ucs_status_t status, void* user_data) {
  auto* st = static_cast<SendState<Header>*>(user_data);
  if (st->result) *st->result = status;
  delete st;
  ucp_request_free(request);
}

// Sends header + bytes eager on `ep`; the state is freed when UCX is done
// with it. Returns the immediate status (UCS_INPROGRESS while in flight).
template <typename Header>
ucs_status_t send(ucp_ep_h ep, unsigned id, SendState<Header>* st, bool reply) {
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  param.cb.send = &on_sent<Header>;
  param.user_data = st;
  ucs_status_ptr_t req = ucp_am_send_nbx(ep, id, &st->header, sizeof(st->header),
                                         st->bytes.data(), st->bytes.size(), &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    ucs_status_t s = req == nullptr ? UCS_OK : UCS_PTR_STATUS(req);
    if (st->result) *st->result = s;
    delete st;
    return s;
  }
  return UCS_INPROGRESS;
}

// Answers a request from inside a handler. A failed send (the requester is
// gone) is dropped: its own deadline covers it.
void respond(ucp_ep_h reply_ep, uint64_t token, int32_t status, std::vector<uint8_t> bytes) {
  auto* st = new SendState<ResponseHeader>{};
  st->header.token = token;
  st->header.status = status;
  st->bytes = std::move(bytes);
  (void)send(reply_ep, ActiveMessages::kResponseId, st, /*reply=*/false);
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

bool read_request(const void* header, size_t header_length, const ucp_am_recv_param_t* param,
                  RequestHeader* h) {
  if (header_length != sizeof(*h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return false;
  }
  std::memcpy(h, header, sizeof(*h));
  return h->magic == kMagic;
}

ucs_status_t no_handler(void* arg, const void* header, size_t header_length, void*, size_t,
                        const ucp_am_recv_param_t* param) {
  RequestHeader h;
  if (!read_request(header, header_length, param, &h)) return UCS_OK;
  const auto id = static_cast<unsigned>(reinterpret_cast<uintptr_t>(arg));
  respond(param->reply_ep, h.token, kNoHandler,
          to_bytes("no handler for AM id " + std::to_string(id) + " at the peer"));
  return UCS_OK;
}

ucs_status_t drop(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
  return UCS_OK;
}

bool in_range(unsigned id) {
  return id >= ActiveMessages::kFirstRequestId &&
         id < ActiveMessages::kFirstRequestId + ActiveMessages::kRequestIds;
}

}  // namespace

namespace active_message {

Status install_fallback_handler(ucp_worker_h worker, unsigned id) {
  if (id == ActiveMessages::kResponseId) return set_am_handler(worker, id, &drop, nullptr);
  return set_am_handler(worker, id, &no_handler, reinterpret_cast<void*>(static_cast<uintptr_t>(id)));
}

Status install_fallback_handlers(ucp_worker_h worker) {
  for (unsigned i = 0; i < ActiveMessages::kRequestIds; ++i) {
    REFIT_RETURN_IF_ERROR(install_fallback_handler(worker, ActiveMessages::kFirstRequestId + i));
  }
  return install_fallback_handler(worker, ActiveMessages::kResponseId);
}

}  // namespace active_message

Result<std::unique_ptr<ActiveMessages>> ActiveMessages::create(Worker& worker) {
  if (worker.get() == nullptr) return Status::invalid("ucx active messages: worker is empty");
  std::unique_ptr<ActiveMessages> am(new ActiveMessages(worker));
  REFIT_RETURN_IF_ERROR(set_am_handler(worker.get(), kResponseId, &on_response, am.get()));
  return am;
}

ActiveMessages::~ActiveMessages() {
  for (auto& [id, s] : served_) (void)active_message::install_fallback_handler(worker_.get(), id);
  (void)active_message::install_fallback_handler(worker_.get(), kResponseId);
}

Status ActiveMessages::serve(unsigned id, Handler handler) {
  if (!in_range(id)) {
    return Status::invalid("ucx active messages: AM id " + std::to_string(id) +
                           " is outside the request range [" + std::to_string(kFirstRequestId) +
                           ", " + std::to_string(kFirstRequestId + kRequestIds) + ")");
  }
  if (!handler) return Status::invalid("ucx active messages: empty handler for AM id " +
                                       std::to_string(id));
  auto s = std::make_unique<Served>(Served{this, id, std::move(handler)});
  REFIT_RETURN_IF_ERROR(set_am_handler(worker_.get(), id, &on_request, s.get()));
  served_[id] = std::move(s);
  return Status::ok();
}

Status ActiveMessages::stop_serving(unsigned id) {
  auto it = served_.find(id);
  if (it == served_.end()) {
    return Status::not_found("ucx active messages: AM id " + std::to_string(id) + " is not served");
  }
  REFIT_RETURN_IF_ERROR(active_message::install_fallback_handler(worker_.get(), id));
  served_.erase(it);
  return Status::ok();
}

ucs_status_t ActiveMessages::on_request(void* arg, const void* header, size_t header_length,
                                        void* data, size_t length,
                                        const ucp_am_recv_param_t* param) {
  auto* s = static_cast<Served*>(arg);
  RequestHeader h;
  if (!read_request(header, header_length, param, &h)) return UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    respond(param->reply_ep, h.token, kTooLarge, to_bytes("request was not sent eager"));
    return UCS_OK;
  }
  auto result = s->handler(std::span<const uint8_t>(static_cast<const uint8_t*>(data), length));
  if (!result) {
    respond(param->reply_ep, h.token, kHandlerError, to_bytes(result.status().message()));
  } else if (result->size() > kMaxBytes) {
    respond(param->reply_ep, h.token, kTooLarge,
            to_bytes("handler for AM id " + std::to_string(s->id) + " returned " +
                     std::to_string(result->size()) + " bytes, more than " +
                     std::to_string(kMaxBytes)));
  } else {
    respond(param->reply_ep, h.token, kOk, std::move(*result));
  }
  return UCS_OK;
}

ucs_status_t ActiveMessages::on_response(void* arg, const void* header, size_t header_length,
                                         void* data, size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<ActiveMessages*>(arg);
  ResponseHeader h;
  if (header_length != sizeof(h)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  auto it = self->pending_.find(h.token);
  if (h.magic != kMagic || it == self->pending_.end()) return UCS_OK;  // late: dropped
  Pending& p = it->second;
  p.done = true;
  p.status = h.status;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    p.status = kTooLarge;
    p.bytes = to_bytes("response was not sent eager");
  } else {
    const auto* b = static_cast<const uint8_t*>(data);
    p.bytes.assign(b, b + length);
  }
  return UCS_OK;
}

Result<std::vector<uint8_t>> ActiveMessages::request(Endpoint& endpoint, unsigned id,
                                                     std::span<const uint8_t> bytes,
                                                     Clock::time_point deadline) {
  const auto start = Clock::now();
  // failure() names the endpoint (and copes with a moved-from one).
  if (endpoint.failed()) {
    return endpoint.failure().with_context("ucx active message id " + std::to_string(id));
  }
  const std::string where = "ucx active message id " + std::to_string(id) + " to endpoint \"" +
                            endpoint.name() + "\"";
  if (!in_range(id)) return Status::invalid(where + ": id outside the request range");
  if (bytes.size() > kMaxBytes) {
    return Status::invalid(where + ": " + std::to_string(bytes.size()) +
                           " request bytes, more than " + std::to_string(kMaxBytes));
  }

  const uint64_t token = ++next_token_;
  pending_[token] = Pending{};
  auto send_status = std::make_shared<ucs_status_t>(UCS_INPROGRESS);
  auto* st = new SendState<RequestHeader>{};
  st->header.token = token;
  st->bytes.assign(bytes.begin(), bytes.end());
  st->result = send_status;
  ucs_status_t s = send(endpoint.get(), id, st, /*reply=*/true);
  if (s != UCS_OK && s != UCS_INPROGRESS) {
    pending_.erase(token);
    return from_ucs(s, where + ": ucp_am_send_nbx");
  }

  // Spins on progress like the GET engine, and sleeps on the worker's event
  // fd after 10 ms without events, so a silent peer costs no core.
  auto last_event = Clock::now();
  while (true) {
    if (worker_.progress() != 0) last_event = Clock::now();
    auto it = pending_.find(token);
    if (it->second.done) {
      Pending p = std::move(it->second);
      pending_.erase(it);
      const std::string text(p.bytes.begin(), p.bytes.end());
      switch (p.status) {
        case kOk: return std::move(p.bytes);
        case kHandlerError: return Status::io_error(where + ": the peer's handler failed: " + text);
        case kNoHandler: return Status::not_found(where + ": " + text);
        default: return Status::io_error(where + ": refused by the peer: " + text);
      }
    }
    if (endpoint.failed()) {
      pending_.erase(it);
      return endpoint.failure().with_context(where + ": no response");
    }
    if (*send_status != UCS_OK && *send_status != UCS_INPROGRESS) {
      pending_.erase(it);
      return from_ucs(*send_status, where + ": sending the request");
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      pending_.erase(it);
      return Status::io_error(
          where + ": no response within " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
          " ms (deadline); a late response will be dropped");
    }
    if (now - last_event > std::chrono::milliseconds(10)) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
      (void)worker_.wait(std::clamp(left, std::chrono::milliseconds(0), std::chrono::milliseconds(1)));
    }
  }
}

}  // namespace refit::ucx
