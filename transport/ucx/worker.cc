#include "transport/ucx/worker.h"

#include <poll.h>

#include <cerrno>
#include <cstring>

#include "transport/ucx/active_message.h"
#include "transport/ucx/am_rma.h"
#include "transport/ucx/ucx_status.h"
#include "transport/ucx/wire_blob.h"

namespace refit::ucx {

Result<Worker> Worker::create(const Context& context, ThreadMode mode) {
  if (context.get() == nullptr) return Status::invalid("ucx worker: context is empty (moved from)");
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode =
      mode == ThreadMode::kSingle ? UCS_THREAD_MODE_SINGLE : UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h handle = nullptr;
  ucs_status_t st = ucp_worker_create(context.get(), &params, &handle);
  if (st != UCS_OK) {
    return from_ucs(st, "ucx context \"" + context.name() + "\": ucp_worker_create");
  }
  Worker worker(handle, mode);
  worker.am_by_copy_ = context.am_by_copy();
  // Every refit worker answers refit's AM ids, so that a request to a
  // process without an AmRmaServer is refused instead of crashing it.
  REFIT_RETURN_IF_ERROR(am_rma::install_fallback_handlers(handle).with_context(
      "ucx context \"" + context.name() + "\": worker"));
  REFIT_RETURN_IF_ERROR(active_message::install_fallback_handlers(handle).with_context(
      "ucx context \"" + context.name() + "\": worker"));
  return worker;
}

Worker::Worker(Worker&& other) noexcept
    : handle_(other.handle_), mode_(other.mode_), am_by_copy_(other.am_by_copy_) {
  other.handle_ = nullptr;
}

Worker& Worker::operator=(Worker&& other) noexcept {
  if (this != &other) {
    if (handle_) ucp_worker_destroy(handle_);
    handle_ = other.handle_;
    mode_ = other.mode_;
    am_by_copy_ = other.am_by_copy_;
    other.handle_ = nullptr;
  }
  return *this;
}

Worker::~Worker() {
  if (handle_) ucp_worker_destroy(handle_);
}

Result<std::vector<uint8_t>> Worker::address() const {
  ucp_worker_attr_t attr = {};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
  ucs_status_t st = ucp_worker_query(handle_, &attr);
  if (st != UCS_OK) return from_ucs(st, "ucx worker: ucp_worker_query(address)");
  auto bytes = frame_blob(
      BlobKind::kWorkerAddress,
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(attr.address), attr.address_length));
  ucp_worker_release_address(handle_, attr.address);
  return bytes;
}

Result<int> Worker::event_fd() const {
  int fd = -1;
  ucs_status_t st = ucp_worker_get_efd(handle_, &fd);
  if (st != UCS_OK) return from_ucs(st, "ucx worker: ucp_worker_get_efd");
  return fd;
}

Result<bool> Worker::arm() {
  ucs_status_t st = ucp_worker_arm(handle_);
  if (st == UCS_OK) return true;
  if (st == UCS_ERR_BUSY) return false;
  return from_ucs(st, "ucx worker: ucp_worker_arm");
}

Status Worker::wait(std::chrono::milliseconds timeout) {
  while (progress() != 0) {
  }
  auto armed = arm();
  if (!armed) return armed.status();
  if (!*armed) return Status::ok();  // events pending: caller progresses again
  auto fd = event_fd();
  if (!fd) return fd.status();
  pollfd p = {*fd, POLLIN, 0};
  int rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
  if (rc < 0 && errno != EINTR) {
    return Status::io_error(std::string("ucx worker: poll on event fd: ") + std::strerror(errno));
  }
  return Status::ok();
}

Status Worker::signal() {
  return from_ucs(ucp_worker_signal(handle_), "ucx worker: ucp_worker_signal");
}

Status set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p = {};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                 UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  p.id = id;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  p.cb = cb;
  p.arg = arg;
  return from_ucs(ucp_worker_set_am_recv_handler(worker, &p),
                  "ucx worker: registering the handler for AM id " + std::to_string(id));
}

}  // namespace refit::ucx
