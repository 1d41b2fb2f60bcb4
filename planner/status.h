#pragma once
// Errors are values. A Status carries a code and a message that says what
// failed, with what input, and what to do; Result<T> is a value or a Status.
// Nothing in the planner throws across its API or aborts on user input.

#include <string>
#include <utility>
#include <variant>

namespace refit {

enum class Code {
  kOk = 0,
  kInvalidArgument,  // bad input: config, layout, placement, manifest
  kNotFound,         // a named thing (file, tensor, rank) does not exist
  kIoError,          // reading or writing a file failed
  kUnsupported,      // valid input that this build cannot handle
  kInternal,         // a broken invariant inside refit: a bug
  kTimeout,          // a deadline passed (a peer or the coordinator too slow or gone)
};

// Why a failure happened, where a caller decides on it (retry or not, which
// status the C ABI returns): a refresh retries on the reason, never on the
// message's text. Most statuses carry kNone.
enum class Reason {
  kNone = 0,
  kStaleMembership,     // a peer executed the plan of another membership epoch: replan and retry
  kPeerLost,            // a peer (source or receiver) died, left or failed its part: retry without it
  kInstanceAborted,     // staged: the instance aborted the version (a rank failed): not retried
  kVerifyMismatch,      // the bytes that arrived hash differently from the published ones: not retried
  kLeaseLost,           // the lease expired or was revoked under the refresh: not retried
  kDrained,             // the version was drained: the sources may be overwriting it
  kInstanceIncomplete,  // a rank of the instance has not registered (yet)
  kNoThread,            // the system refused a thread
  kRankHeld,            // the rank is registered on another open connection: tried again until the deadline
  kNotRegistered,       // the coordinator holds no registration of the member (declared dead): register again, retry
  kNoSource,            // no live source holds a tensor this rank needs (its sources died or left): not retried
};
inline const char* reason_name(Reason r) {
  switch (r) {
    case Reason::kNone: return "none";
    case Reason::kStaleMembership: return "stale_membership";
    case Reason::kPeerLost: return "peer_lost";
    case Reason::kInstanceAborted: return "instance_aborted";
    case Reason::kVerifyMismatch: return "verify_mismatch";
    case Reason::kLeaseLost: return "lease_lost";
    case Reason::kDrained: return "drained";
    case Reason::kInstanceIncomplete: return "instance_incomplete";
    case Reason::kNoThread: return "no_thread";
    case Reason::kRankHeld: return "rank_held";
    case Reason::kNotRegistered: return "not_registered";
    case Reason::kNoSource: return "no_source";
  }
  return "none";
}

// The reason named `name` (reason_name's inverse); kNone for any other text
// (a peer's word is untrusted).
inline Reason reason_from_name(const std::string& name) {
  for (Reason r : {Reason::kStaleMembership, Reason::kPeerLost, Reason::kInstanceAborted, Reason::kVerifyMismatch,
                   Reason::kLeaseLost, Reason::kDrained, Reason::kInstanceIncomplete, Reason::kNoThread,
                   Reason::kRankHeld, Reason::kNotRegistered, Reason::kNoSource}) {
    if (name == reason_name(r)) return r;
  }
  return Reason::kNone;
}

class Status {
 public:
  Status() = default;
  static Status ok() { return Status(); }
  static Status invalid(std::string msg) { return Status(Code::kInvalidArgument, std::move(msg)); }
  static Status not_found(std::string msg) { return Status(Code::kNotFound, std::move(msg)); }
  static Status io_error(std::string msg) { return Status(Code::kIoError, std::move(msg)); }
  static Status unsupported(std::string msg) { return Status(Code::kUnsupported, std::move(msg)); }
  static Status internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }
  static Status timeout(std::string msg) { return Status(Code::kTimeout, std::move(msg)); }

  // A copy that carries `reason` (an ok Status stays ok, without one).
  Status with_reason(Reason reason) const {
    if (is_ok()) return *this;
    Status s = *this;
    s.reason_ = reason;
    return s;
  }

  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  Reason reason() const { return reason_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message starts with `context: `, for errors that
  // travel up through layers that know more about where they came from. A
  // message that already starts with "context: " is kept as it is: a
  // refusal that names its request, passed up through the layer that sent
  // the request, does not name it twice.
  Status with_context(const std::string& context) const {
    if (is_ok()) return *this;
    if (message_.size() > context.size() + 1 && message_.compare(0, context.size(), context) == 0 &&
        message_.compare(context.size(), 2, ": ") == 0) {
      return *this;
    }
    Status s(code_, context + ": " + message_);
    s.reason_ = reason_;
    return s;
  }

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  Reason reason_ = Reason::kNone;
  std::string message_;
};



template <typename T>
class Result {
 public:
  Result(T value) : v_(std::move(value)) {}               // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}        // NOLINT: implicit by design

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace refit

// Early return of a failed Status from a function that returns Status or Result.
#define REFIT_RETURN_IF_ERROR(expr)           \
  do {                                        \
    ::refit::Status refit_status_ = (expr);   \
    if (!refit_status_.is_ok()) return refit_status_; \
  } while (0)
