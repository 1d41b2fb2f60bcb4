// The C ABI's entry points (include/refit/refit.h). Every call converts the
// agents' Status into a refit_status_t and this thread's last error, and
// catches every exception at the boundary: nothing but a status crosses it.
// Every symbol outside refit_* stays local (refit.map), so the library can
// share a process with other C++ libraries.
#include "refit/refit.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "plugin/log.h"
#include "plugin/receiver_agent.h"
#include "plugin/source_agent.h"

struct refit_source {
  std::unique_ptr<refit::plugin::SourceAgent> agent;
};
struct refit_receiver {
  std::unique_ptr<refit::plugin::ReceiverAgent> agent;
};

namespace {

using refit::Code;
using refit::Status;

thread_local std::string g_last_error;

refit_status_t to_c(const Status& s) {
  g_last_error = s.message();
  // Every source of a tensor is gone: a peer lost for good, whatever code
  // the coordinator's reply came back with.
  if (s.reason() == refit::Reason::kNoSource) return REFIT_PEER_LOST;
  switch (s.code()) {
    case Code::kOk: return REFIT_OK;
    case Code::kInvalidArgument: return REFIT_INVALID_ARGUMENT;
    case Code::kNotFound: return REFIT_NOT_FOUND;
    case Code::kIoError: break;  // by its reason, below
    case Code::kUnsupported: return REFIT_UNSUPPORTED;
    case Code::kInternal: return REFIT_INTERNAL;
    case Code::kTimeout: return REFIT_TIMEOUT;
  }
  if (s.code() != Code::kIoError) return REFIT_INTERNAL;
  switch (s.reason()) {
    case refit::Reason::kPeerLost:
    case refit::Reason::kStaleMembership: return REFIT_PEER_LOST;
    case refit::Reason::kInstanceAborted: return REFIT_ABORTED;
    case refit::Reason::kVerifyMismatch: return REFIT_VERIFY_FAILED;
    default: return REFIT_IO_ERROR;
  }
}

// Runs `body` (returning Status), turning exceptions into statuses.
template <typename F>
refit_status_t guarded(const char* what, F&& body) {
  try {
    return to_c(body());
  } catch (const std::bad_alloc&) {
    return to_c(Status::internal(std::string(what) + ": out of memory"));
  } catch (const std::exception& e) {
    return to_c(Status::internal(std::string(what) + ": " + e.what()));
  } catch (...) {
    return to_c(Status::internal(std::string(what) + ": unknown exception"));
  }
}

Status null_arg(const char* what, const char* arg) {
  return Status::invalid(std::string(what) + ": " + arg + " is NULL");
}

// A timeout from the C ABI as a duration that every layer below may add to
// steady_clock::now() without overflow: negative is 0 (as it always was),
// and anything from a century on (REFIT_NO_DEADLINE among them) is a
// century, which is no deadline. steady_clock counts int64 nanoseconds
// (292 years), so INT64_MAX ms converted as it is wraps into the past.
constexpr std::chrono::milliseconds kNoDeadline = std::chrono::hours(24 * 36525);
static_assert(std::chrono::duration_cast<std::chrono::nanoseconds>(kNoDeadline).count() < INT64_MAX / 2,
              "a deadline now + kNoDeadline must fit steady_clock for the next century of uptime");

std::chrono::milliseconds timeout_of(int64_t ms) {
  if (ms < 0) return std::chrono::milliseconds(0);
  return std::min(std::chrono::milliseconds(ms), kNoDeadline);
}

}  // namespace

extern "C" {

REFIT_EXPORT const char* refit_version(void) { return REFIT_VERSION_STRING; }

REFIT_EXPORT const char* refit_last_error(void) { return g_last_error.c_str(); }

REFIT_EXPORT const char* refit_status_name(refit_status_t status) {
  switch (status) {
    case REFIT_OK: return "REFIT_OK";
    case REFIT_INVALID_ARGUMENT: return "REFIT_INVALID_ARGUMENT";
    case REFIT_NOT_FOUND: return "REFIT_NOT_FOUND";
    case REFIT_IO_ERROR: return "REFIT_IO_ERROR";
    case REFIT_TIMEOUT: return "REFIT_TIMEOUT";
    case REFIT_UNSUPPORTED: return "REFIT_UNSUPPORTED";
    case REFIT_INTERNAL: return "REFIT_INTERNAL";
    case REFIT_IN_PROGRESS: return "REFIT_IN_PROGRESS";
    case REFIT_PEER_LOST: return "REFIT_PEER_LOST";
    case REFIT_ABORTED: return "REFIT_ABORTED";
    case REFIT_VERIFY_FAILED: return "REFIT_VERIFY_FAILED";
  }
  return "unknown";
}

REFIT_EXPORT void refit_set_log_callback(refit_log_fn fn, void* user) { refit::plugin::set_log_callback(fn, user); }

REFIT_EXPORT refit_status_t refit_source_create(const char* config_json, refit_source_t** out) {
  return guarded("refit_source_create", [&]() -> Status {
    if (!out) return null_arg("refit_source_create", "out");
    *out = nullptr;
    if (!config_json) return null_arg("refit_source_create", "config_json");
    auto agent = refit::plugin::SourceAgent::create(config_json);
    if (!agent.is_ok()) return agent.status();
    *out = new refit_source{std::move(agent).value()};
    return Status::ok();
  });
}

REFIT_EXPORT refit_status_t refit_source_add_tensor(refit_source_t* source, const char* tensor_json, void* data,
                                                    uint64_t bytes) {
  return guarded("refit_source_add_tensor", [&]() -> Status {
    if (!source) return null_arg("refit_source_add_tensor", "source");
    if (!tensor_json) return null_arg("refit_source_add_tensor", "tensor_json");
    return source->agent->add_tensor(tensor_json, data, bytes);
  });
}

REFIT_EXPORT refit_status_t refit_source_join(refit_source_t* source) {
  return guarded("refit_source_join", [&]() -> Status {
    if (!source) return null_arg("refit_source_join", "source");
    return source->agent->join();
  });
}

REFIT_EXPORT refit_status_t refit_source_publish(refit_source_t* source, int64_t version) {
  return guarded("refit_source_publish", [&]() -> Status {
    if (!source) return null_arg("refit_source_publish", "source");
    return source->agent->publish(version);
  });
}

REFIT_EXPORT refit_status_t refit_source_wait_drained(refit_source_t* source, int64_t version, int64_t timeout_ms) {
  return guarded("refit_source_wait_drained", [&]() -> Status {
    if (!source) return null_arg("refit_source_wait_drained", "source");
    return source->agent->wait_drained(version, timeout_of(timeout_ms));
  });
}

REFIT_EXPORT void refit_source_destroy(refit_source_t* source) {
  try {
    delete source;
  } catch (...) {
  }
}

REFIT_EXPORT refit_status_t refit_receiver_create(const char* config_json, refit_receiver_t** out) {
  return guarded("refit_receiver_create", [&]() -> Status {
    if (!out) return null_arg("refit_receiver_create", "out");
    *out = nullptr;
    if (!config_json) return null_arg("refit_receiver_create", "config_json");
    auto agent = refit::plugin::ReceiverAgent::create(config_json);
    if (!agent.is_ok()) return agent.status();
    *out = new refit_receiver{std::move(agent).value()};
    return Status::ok();
  });
}

REFIT_EXPORT refit_status_t refit_receiver_add_buffer(refit_receiver_t* receiver, const char* buffer_json,
                                                      void* data, uint64_t bytes) {
  return guarded("refit_receiver_add_buffer", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_add_buffer", "receiver");
    if (!buffer_json) return null_arg("refit_receiver_add_buffer", "buffer_json");
    return receiver->agent->add_buffer(buffer_json, data, bytes);
  });
}

REFIT_EXPORT refit_status_t refit_receiver_join(refit_receiver_t* receiver) {
  return guarded("refit_receiver_join", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_join", "receiver");
    if (receiver->agent->refresh_running()) return Status::invalid("refit_receiver_join: a refresh is running");
    return receiver->agent->join();
  });
}

REFIT_EXPORT refit_status_t refit_receiver_refresh(refit_receiver_t* receiver, int64_t version, int64_t timeout_ms) {
  return guarded("refit_receiver_refresh", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_refresh", "receiver");
    return receiver->agent->refresh(version, timeout_of(timeout_ms));
  });
}

REFIT_EXPORT refit_status_t refit_receiver_commit(refit_receiver_t* receiver) {
  return guarded("refit_receiver_commit", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_commit", "receiver");
    return receiver->agent->commit();
  });
}

REFIT_EXPORT refit_status_t refit_receiver_refresh_start(refit_receiver_t* receiver, int64_t version,
                                                         int64_t timeout_ms) {
  return guarded("refit_receiver_refresh_start", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_refresh_start", "receiver");
    return receiver->agent->refresh_start(version, timeout_of(timeout_ms));
  });
}

REFIT_EXPORT refit_status_t refit_receiver_refresh_poll(refit_receiver_t* receiver) {
  return refit_receiver_refresh_wait(receiver, 0);
}

REFIT_EXPORT refit_status_t refit_receiver_refresh_wait(refit_receiver_t* receiver, int64_t timeout_ms) {
  bool running = false;
  refit_status_t st = guarded("refit_receiver_refresh_wait", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_refresh_wait", "receiver");
    std::optional<Status> done = receiver->agent->refresh_wait(timeout_of(timeout_ms));
    if (!done) {
      running = true;
      return Status::ok();
    }
    return *done;
  });
  if (running) {
    g_last_error = "the refresh is still running";
    return REFIT_IN_PROGRESS;
  }
  return st;
}

REFIT_EXPORT const char* refit_receiver_report(refit_receiver_t* receiver) {
  if (!receiver) {
    g_last_error = "refit_receiver_report: receiver is NULL";
    return "{}";
  }
  if (receiver->agent->refresh_running()) return "{}";
  return receiver->agent->report().c_str();
}

REFIT_EXPORT int64_t refit_receiver_version(refit_receiver_t* receiver) {
  return receiver ? receiver->agent->version() : 0;
}

REFIT_EXPORT refit_status_t refit_receiver_progress(refit_receiver_t* receiver, refit_progress_t* out) {
  return guarded("refit_receiver_progress", [&]() -> Status {
    if (!receiver) return null_arg("refit_receiver_progress", "receiver");
    if (!out) return null_arg("refit_receiver_progress", "out");
    constexpr size_t kLeast = offsetof(refit_progress_t, state) + sizeof(const char*);
    if (out->size < kLeast) {
      return Status::invalid("refit_receiver_progress: out->size is " + std::to_string(out->size) +
                             ", below the " + std::to_string(kLeast) +
                             " bytes of its first fields (set it to sizeof(refit_progress_t))");
    }
    const refit::plugin::receiver::Progress& p = receiver->agent->progress();
    refit_progress_t now{};
    now.size = out->size;
    now.attempt = p.attempt.load();
    now.version = p.version.load();
    now.state = refit::plugin::receiver::state_name(receiver->agent->state());
    // Clamped: an attempt that starts between the two loads resets both.
    const uint64_t landed = p.landed.load();
    now.network_bytes_planned = p.planned.load();
    now.network_bytes_landed = std::min(landed, now.network_bytes_planned);
    std::memcpy(out, &now, std::min<size_t>(out->size, sizeof(now)));
    return Status::ok();
  });
}

REFIT_EXPORT void refit_receiver_destroy(refit_receiver_t* receiver) {
  try {
    delete receiver;
  } catch (...) {
  }
}

REFIT_EXPORT const refit_api_t* refit_get_api(uint32_t abi_version) {
  static const refit_api_t kApi = {
      REFIT_ABI_VERSION,
      sizeof(refit_api_t),
      refit_version,
      refit_last_error,
      refit_status_name,
      refit_source_create,
      refit_source_add_tensor,
      refit_source_join,
      refit_source_publish,
      refit_source_wait_drained,
      refit_source_destroy,
      refit_receiver_create,
      refit_receiver_add_buffer,
      refit_receiver_join,
      refit_receiver_refresh,
      refit_receiver_refresh_start,
      refit_receiver_refresh_poll,
      refit_receiver_refresh_wait,
      refit_receiver_report,
      refit_receiver_version,
      refit_receiver_destroy,
      refit_receiver_commit,
      refit_set_log_callback,
      refit_receiver_progress,
  };
  if (abi_version != REFIT_ABI_VERSION) {
    g_last_error = "refit_get_api: this library serves ABI version " + std::to_string(REFIT_ABI_VERSION) +
                   ", not " + std::to_string(abi_version);
    return nullptr;
  }
  return &kApi;
}

}  // extern "C"
