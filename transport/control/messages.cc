#include "transport/control/messages.h"

#include <algorithm>
#include <array>
#include <limits>

namespace refit::control {

const char* role_name(Role r) { return r == Role::kSource ? "source" : "receiver"; }

namespace {

// Reads fields of one message, naming the message and key path on failure.
// The first failure is kept; later reads are skipped.
class Reader {
 public:
  explicit Reader(const char* message) : message_(message) {}
  bool ok() const { return status_.is_ok(); }
  const Status& status() const { return status_; }

  bool fail(const std::string& path, const std::string& problem) {
    if (ok()) status_ = Status::invalid(std::string(message_) + ": " + path + " " + problem);
    return false;
  }
  static std::string shown(const Json& v) {
    std::string s = v.is_binary() ? "<" + std::to_string(v.get_binary().size()) + " bytes>"
                                  : v.dump(-1, ' ', true, Json::error_handler_t::replace);
    if (s.size() > 40) s = s.substr(0, 37) + "...";
    return s;
  }
  const Json* field(const Json& obj, const std::string& path, const char* key, bool required = true) {
    if (!ok()) return nullptr;
    if (!obj.is_object()) {
      fail(path.empty() ? "body" : path, "must be a map");
      return nullptr;
    }
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (required) fail(join(path, key), "is missing");
      return nullptr;
    }
    return &*it;
  }
  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? key : path + "." + key;
  }
  bool int_in(const Json& obj, const std::string& path, const char* key, int64_t lo, int64_t hi,
              int64_t* out, bool required = true) {
    const Json* v = field(obj, path, key, required);
    if (!v) return false;
    if (v->is_number_unsigned() && v->get<uint64_t>() <= static_cast<uint64_t>(hi) &&
        static_cast<int64_t>(v->get<uint64_t>()) >= lo) {
      *out = static_cast<int64_t>(v->get<uint64_t>());
      return true;
    }
    if (v->is_number_integer() && !v->is_number_unsigned() && v->get<int64_t>() >= lo &&
        v->get<int64_t>() <= hi) {
      *out = v->get<int64_t>();
      return true;
    }
    return fail(join(path, key), "must be an integer in [" + std::to_string(lo) + ", " +
                                     std::to_string(hi) + "], got " + shown(*v));
  }
  bool uint64(const Json& obj, const std::string& path, const char* key, uint64_t* out, bool required = false) {
    const Json* v = field(obj, path, key, required);
    if (!v) return ok();
    if (v->is_number_unsigned()) {
      *out = v->get<uint64_t>();
      return true;
    }
    if (v->is_number_integer() && v->get<int64_t>() >= 0) {  // a JSON document's non-negative integer
      *out = static_cast<uint64_t>(v->get<int64_t>());
      return true;
    }
    return fail(join(path, key), "must be an unsigned integer, got " + shown(*v));
  }
  bool boolean(const Json& obj, const std::string& path, const char* key, bool* out) {
    const Json* v = field(obj, path, key, false);
    if (!v) return ok();
    if (!v->is_boolean()) return fail(join(path, key), "must be a boolean, got " + shown(*v));
    *out = v->get<bool>();
    return true;
  }
  bool number_in(const Json& obj, const std::string& path, const char* key, double lo, double hi, double* out) {
    const Json* v = field(obj, path, key);
    if (!v) return false;
    // NaN and the infinities fail the range check too.
    if (v->is_number() && v->get<double>() >= lo && v->get<double>() <= hi) {
      *out = v->get<double>();
      return true;
    }
    return fail(join(path, key), "must be a number in [" + shown(Json(lo)) + ", " + shown(Json(hi)) + "], got " +
                                     shown(*v));
  }
  // One of `names`; its index.
  bool one_of(const Json& obj, const std::string& path, const char* key, std::initializer_list<const char*> names,
              size_t* out) {
    std::string s;
    if (!str(obj, path, key, 64, &s)) return false;
    size_t i = 0;
    std::string list;
    for (const char* n : names) {
      if (s == n) {
        *out = i;
        return true;
      }
      list += std::string(list.empty() ? "" : ", ") + "\"" + n + "\"";
      ++i;
    }
    return fail(join(path, key), "must be one of " + list + ", got " + shown(Json(s)));
  }
  bool str(const Json& obj, const std::string& path, const char* key, size_t max, std::string* out) {
    const Json* v = field(obj, path, key);
    if (!v) return false;
    if (!v->is_string()) return fail(join(path, key), "must be a string, got " + shown(*v));
    const auto& s = v->get_ref<const std::string&>();
    if (s.empty() || s.size() > max) {
      return fail(join(path, key), "must be 1 to " + std::to_string(max) + " bytes, got " +
                                       std::to_string(s.size()));
    }
    *out = s;
    return true;
  }
  // A byte string; a text string is accepted too (its bytes).
  bool bytes(const Json& obj, const std::string& path, const char* key, size_t max,
             std::vector<uint8_t>* out, bool required = true) {
    const Json* v = field(obj, path, key, required);
    if (!v) return ok();
    if (v->is_binary()) {
      const auto& b = v->get_binary();
      if (b.size() > max) return too_long(path, key, max, b.size());
      out->assign(b.begin(), b.end());
      return true;
    }
    if (v->is_string()) {
      const auto& s = v->get_ref<const std::string&>();
      if (s.size() > max) return too_long(path, key, max, s.size());
      out->assign(s.begin(), s.end());
      return true;
    }
    return fail(join(path, key), "must be a byte string, got " + shown(*v));
  }
  bool too_long(const std::string& path, const char* key, size_t max, size_t got) {
    return fail(join(path, key), "must be at most " + std::to_string(max) + " bytes, got " +
                                     std::to_string(got));
  }
  const Json* array(const Json& obj, const std::string& path, const char* key, size_t max) {
    const Json* v = field(obj, path, key);
    if (!v) return nullptr;
    if (!v->is_array()) {
      fail(join(path, key), "must be a list, got " + shown(*v));
      return nullptr;
    }
    if (v->size() > max) {
      fail(join(path, key), "has " + std::to_string(v->size()) + " entries, more than the limit of " +
                                std::to_string(max));
      return nullptr;
    }
    return v;
  }
  bool dims(const Json& obj, const std::string& path, const char* key, size_t max_dims, int64_t lo,
            std::vector<int64_t>* out) {
    const Json* a = array(obj, path, key, max_dims);
    if (!a) return false;
    out->clear();
    for (size_t i = 0; i < a->size(); ++i) {
      const Json& v = (*a)[i];
      const std::string p = join(path, key) + "[" + std::to_string(i) + "]";
      // A non-negative literal parses as an unsigned number: `lo` holds for
      // both kinds.
      if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t{1} << 62 &&
          v.get<uint64_t>() >= static_cast<uint64_t>(std::max<int64_t>(lo, 0))) {
        out->push_back(static_cast<int64_t>(v.get<uint64_t>()));
      } else if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() >= lo &&
                 v.get<int64_t>() >= 0) {
        out->push_back(v.get<int64_t>());
      } else {
        return fail(p, std::string(lo > 0 ? "must be a positive integer" : "must be a non-negative integer") +
                           ", got " + shown(v));
      }
    }
    return true;
  }

 private:
  const char* message_;
  Status status_;
};

std::string at(const char* key, size_t i) { return std::string(key) + "[" + std::to_string(i) + "]"; }

}  // namespace

namespace {

bool parse_buffers(Reader& r, const Json& body, const MessageLimits& lim, std::vector<MemberBuffer>* out) {
  const Json* buffers = r.array(body, "", "buffers", lim.max_buffers);
  if (!r.ok()) return false;
  size_t segments = 0;
  out->reserve(buffers->size());
  for (size_t i = 0; i < buffers->size() && r.ok(); ++i) {
    const Json& b = (*buffers)[i];
    const std::string p = at("buffers", i);
    MemberBuffer mb;
    r.str(b, p, "name", lim.max_name_bytes, &mb.name);
    r.str(b, p, "dtype", 16, &mb.dtype);
    r.int_in(b, p, "bytes", 0, std::numeric_limits<int64_t>::max(), &mb.bytes);
    r.uint64(b, p, "address", &mb.address);
    r.bytes(b, p, "rkey", lim.max_rkey_bytes, &mb.rkey, false);
    const Json* segs = r.array(b, p, "segments", lim.max_segments);
    if (!r.ok()) break;
    segments += segs->size();
    if (segments > lim.max_segments) {
      r.fail(p + ".segments", "bring the member's segments past the limit of " + std::to_string(lim.max_segments));
      break;
    }
    mb.segments.reserve(segs->size());
    for (size_t j = 0; j < segs->size() && r.ok(); ++j) {
      const Json& s = (*segs)[j];
      const std::string q = p + "." + at("segments", j);
      Segment sg;
      r.str(s, q, "tensor", lim.max_name_bytes, &sg.tensor);
      r.dims(s, q, "start", lim.max_dims, 0, &sg.start);
      r.dims(s, q, "size", lim.max_dims, 0, &sg.size);
      r.int_in(s, q, "offset", 0, std::numeric_limits<int64_t>::max(), &sg.offset);
      r.dims(s, q, "strides", lim.max_dims, 0, &sg.strides);
      if (s.is_object() && s.contains("dtype")) r.str(s, q, "dtype", 16, &sg.dtype);
      if (r.ok() && (sg.start.size() != sg.size.size() || sg.strides.size() != sg.size.size())) {
        r.fail(q, "has " + std::to_string(sg.start.size()) + " start, " + std::to_string(sg.size.size()) +
                      " size and " + std::to_string(sg.strides.size()) + " strides dims; they must agree");
      }
      mb.segments.push_back(std::move(sg));
    }
    out->push_back(std::move(mb));
  }
  return r.ok();
}

}  // namespace

Result<RegisterSource> parse_register_source(const Json& body, const MessageLimits& lim) {
  Reader r("register_source");
  RegisterSource m;
  int64_t v = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  if (r.int_in(body, "", "domain", 0, lim.max_rank - 1, &v)) m.domain = static_cast<int32_t>(v);
  r.bytes(body, "", "worker_address", lim.max_address_bytes, &m.worker_address);
  if (r.ok() && m.worker_address.empty()) r.fail("worker_address", "must not be empty");
  const Json* tensors = r.array(body, "", "tensors", lim.max_tensors);
  if (!r.ok()) return r.status();
  m.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size() && r.ok(); ++i) {
    const Json& t = (*tensors)[i];
    const std::string p = at("tensors", i);
    TensorDecl td;
    r.str(t, p, "name", lim.max_name_bytes, &td.name);
    r.str(t, p, "dtype", 16, &td.dtype);
    r.dims(t, p, "shape", lim.max_dims, 0, &td.shape);
    m.tensors.push_back(std::move(td));
  }
  if (!r.ok()) return r.status();
  parse_buffers(r, body, lim, &m.buffers);
  if (!r.ok()) return r.status();
  return m;
}

Result<RegisterReceiver> parse_register_receiver(const Json& body, const MessageLimits& lim) {
  Reader r("register_receiver");
  RegisterReceiver m;
  int64_t v = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  if (r.int_in(body, "", "instance", 0, lim.max_rank - 1, &v)) m.instance = static_cast<int32_t>(v);
  if (r.int_in(body, "", "domain", 0, lim.max_rank - 1, &v)) m.domain = static_cast<int32_t>(v);
  if (r.int_in(body, "", "instance_ranks", 1, lim.max_rank, &v, /*required=*/false)) {
    m.instance_ranks = static_cast<int32_t>(v);
  }
  if (auto wb = body.find("weight_block_size"); wb != body.end()) {
    if (!wb->is_array() || wb->size() != 2 || !(*wb)[0].is_number_integer() || !(*wb)[1].is_number_integer() ||
        (*wb)[0].get<int64_t>() < 1 || (*wb)[1].get<int64_t>() < 1 || (*wb)[0].get<int64_t>() > (1 << 20) ||
        (*wb)[1].get<int64_t>() > (1 << 20)) {
      r.fail("weight_block_size", "must be [rows, cols], two positive integers, got " + Reader::shown(*wb));
    } else {
      m.weight_block_size = {(*wb)[0].get<int64_t>(), (*wb)[1].get<int64_t>()};
    }
  }
  r.bytes(body, "", "worker_address", lim.max_address_bytes, &m.worker_address);
  if (r.ok() && m.worker_address.empty()) r.fail("worker_address", "must not be empty");
  if (!r.ok()) return r.status();
  parse_buffers(r, body, lim, &m.buffers);
  if (!r.ok()) return r.status();
  return m;
}

Result<MemberRef> parse_member_ref(const Json& body, const char* message, const MessageLimits& lim) {
  Reader r(message);
  MemberRef m;
  std::string role;
  r.str(body, "", "role", 16, &role);
  if (r.ok()) {
    if (role == "source") m.role = Role::kSource;
    else if (role == "receiver") m.role = Role::kReceiver;
    else r.fail("role", "must be \"source\" or \"receiver\", got \"" + role + "\"");
  }
  int64_t v = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  if (!r.ok()) return r.status();
  return m;
}

Result<PublishVersion> parse_publish_version(const Json& body, const char* message, const MessageLimits& lim) {
  Reader r(message);
  PublishVersion m;
  r.int_in(body, "", "version", 1, std::numeric_limits<int64_t>::max(), &m.version);
  if (!r.ok()) return r.status();
  if (!body.contains("hashes")) return m;
  const Json* hashes = r.array(body, "", "hashes", lim.max_segments);
  if (!r.ok()) return r.status();
  m.hashes.reserve(hashes->size());
  for (size_t i = 0; i < hashes->size() && r.ok(); ++i) {
    const Json& h = (*hashes)[i];
    const std::string p = at("hashes", i);
    BoxHash bh;
    int64_t v = 0;
    if (r.int_in(h, p, "rank", 0, lim.max_rank - 1, &v)) bh.rank = static_cast<int32_t>(v);
    r.str(h, p, "tensor", lim.max_name_bytes, &bh.tensor);
    r.dims(h, p, "start", lim.max_dims, 0, &bh.start);
    r.dims(h, p, "size", lim.max_dims, 0, &bh.size);
    if (r.ok() && !h.contains("hash")) r.fail(p + ".hash", "is missing");
    r.uint64(h, p, "hash", &bh.hash);
    if (h.contains("dtype")) r.str(h, p, "dtype", 16, &bh.dtype);
    if (r.ok() && bh.start.size() != bh.size.size()) {
      r.fail(p, "has " + std::to_string(bh.start.size()) + " start and " + std::to_string(bh.size.size()) +
                    " size dims; they must agree");
    }
    m.hashes.push_back(std::move(bh));
  }
  if (!r.ok()) return r.status();
  return m;
}

Result<VersionHashes> parse_version_hashes(const Json& body, const MessageLimits& lim) {
  Reader r("version_hashes");
  VersionHashes m;
  int64_t v = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  r.int_in(body, "", "version", 1, std::numeric_limits<int64_t>::max(), &m.version);
  if (!r.ok()) return r.status();
  return m;
}

Result<StageReport> parse_stage_report(const Json& body, bool failed, const MessageLimits& lim,
                                       const char* message) {
  Reader r(message ? message : failed ? "report_failed" : "report_staged");
  StageReport m;
  int64_t v = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  r.int_in(body, "", "version", 1, std::numeric_limits<int64_t>::max(), &m.version);
  if (failed) r.str(body, "", "reason", lim.max_name_bytes, &m.reason);
  if (!r.ok()) return r.status();
  return m;
}

const char* event_name(RefreshSummary::Event e) { return e == RefreshSummary::Event::kCommit ? "commit" : "refresh"; }

const char* outcome_name(RefreshSummary::Outcome o) {
  switch (o) {
    case RefreshSummary::Outcome::kOk: return "ok";
    case RefreshSummary::Outcome::kFailed: return "failed";
    case RefreshSummary::Outcome::kAborted: return "aborted";
  }
  return "failed";
}

Result<RefreshSummary> parse_refresh_summary(const Json& body, const MessageLimits& lim) {
  Reader r("refresh_summary");
  RefreshSummary m;
  int64_t v = 0;
  size_t i = 0;
  if (r.int_in(body, "", "rank", 0, lim.max_rank - 1, &v)) m.rank = static_cast<int32_t>(v);
  r.int_in(body, "", "version", 0, std::numeric_limits<int64_t>::max(), &m.version);
  if (r.one_of(body, "", "event", {"refresh", "commit"}, &i)) m.event = static_cast<RefreshSummary::Event>(i);
  if (r.one_of(body, "", "mode", {"direct", "staged"}, &i)) m.staged = i == 1;
  if (r.one_of(body, "", "outcome", {"ok", "failed", "aborted"}, &i)) m.outcome = static_cast<RefreshSummary::Outcome>(i);
  std::string reason;
  if (r.str(body, "", "reason", 64, &reason)) {
    m.reason = reason_from_name(reason);
    if (m.reason == Reason::kNone && reason != reason_name(Reason::kNone)) {
      r.fail("reason", "must be a failure reason of planner/status.h (\"none\", \"peer_lost\", ...), got \"" +
                           reason.substr(0, 40) + "\"");
    }
  }
  r.number_in(body, "", "seconds", 0, kMaxSummarySeconds, &m.seconds);
  if (r.int_in(body, "", "network_bytes", 0, static_cast<int64_t>(kMaxSummaryBytes), &v)) {
    m.network_bytes = static_cast<uint64_t>(v);
  }
  if (r.int_in(body, "", "local_bytes", 0, static_cast<int64_t>(kMaxSummaryBytes), &v)) {
    m.local_bytes = static_cast<uint64_t>(v);
  }
  if (r.int_in(body, "", "retries", 0, kMaxSummaryRetries, &v)) m.retries = static_cast<uint32_t>(v);
  if (!r.ok()) return r.status();
  if (m.event == RefreshSummary::Event::kCommit && !m.staged) {
    return Status::invalid("refresh_summary: a commit's mode must be \"staged\", got \"direct\"");
  }
  if (m.outcome == RefreshSummary::Outcome::kOk && m.reason != Reason::kNone) {
    return Status::invalid(std::string("refresh_summary: an ok outcome has reason \"none\", got \"") +
                           reason_name(m.reason) + "\"");
  }
  return m;
}

Json to_json(const RefreshSummary& m) {
  return Json{{"rank", m.rank},
              {"version", m.version},
              {"event", event_name(m.event)},
              {"mode", m.staged ? "staged" : "direct"},
              {"outcome", outcome_name(m.outcome)},
              {"reason", reason_name(m.reason)},
              {"seconds", m.seconds},
              {"network_bytes", m.network_bytes},
              {"local_bytes", m.local_bytes},
              {"retries", m.retries}};
}

Result<FetchPlan> parse_fetch_plan(const Json& body, const MessageLimits& lim) {
  Reader r("fetch_plan");
  int64_t rank = 0, epoch = 0;
  r.int_in(body, "", "rank", 0, lim.max_rank - 1, &rank);
  r.int_in(body, "", "epoch", 0, std::numeric_limits<int64_t>::max(), &epoch, /*required=*/false);
  if (!r.ok()) return r.status();
  return FetchPlan{static_cast<int32_t>(rank), static_cast<uint64_t>(epoch)};
}

Result<AuthResponse> parse_auth_response(const Json& body) {
  Reader r("auth_response");
  AuthResponse m;
  std::string role;
  r.str(body, "", "role", 16, &role);
  if (r.ok()) {
    std::optional<AuthRole> parsed = auth_role_from(role);
    if (parsed) m.role = *parsed;
    else r.fail("role", "must be \"source\", \"receiver\" or \"any\", got \"" + role + "\"");
  }
  std::vector<uint8_t> nonce, mac;
  r.bytes(body, "", "nonce", kNonceBytes, &nonce);
  r.bytes(body, "", "mac", kMacBytes, &mac);
  if (r.ok() && nonce.size() != kNonceBytes) r.fail("nonce", "must be " + std::to_string(kNonceBytes) + " bytes");
  if (r.ok() && mac.size() != kMacBytes) r.fail("mac", "must be " + std::to_string(kMacBytes) + " bytes");
  if (!r.ok()) return r.status();
  std::copy(nonce.begin(), nonce.end(), m.nonce.begin());
  std::copy(mac.begin(), mac.end(), m.mac.begin());
  return m;
}

namespace {

Json buffers_json(const std::vector<MemberBuffer>& buffers) {
  Json out = Json::array();
  for (const auto& b : buffers) {
    Json segs = Json::array();
    for (const auto& s : b.segments) {
      segs.push_back({{"tensor", s.tensor}, {"start", s.start}, {"size", s.size}, {"offset", s.offset},
                      {"strides", s.strides}});
      if (!s.dtype.empty()) segs.back()["dtype"] = s.dtype;
    }
    out.push_back({{"name", b.name}, {"dtype", b.dtype}, {"bytes", b.bytes}, {"address", b.address},
                   {"rkey", Json::binary(b.rkey)}, {"segments", std::move(segs)}});
  }
  return out;
}

}  // namespace

Json to_json(const RegisterSource& m) {
  Json tensors = Json::array();
  for (const auto& t : m.tensors) tensors.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape}});
  return {{"rank", m.rank}, {"domain", m.domain}, {"worker_address", Json::binary(m.worker_address)},
          {"tensors", std::move(tensors)}, {"buffers", buffers_json(m.buffers)}};
}

Json to_json(const RegisterReceiver& m) {
  Json j{{"rank", m.rank}, {"instance", m.instance}, {"domain", m.domain},
         {"worker_address", Json::binary(m.worker_address)}, {"buffers", buffers_json(m.buffers)}};
  if (m.instance_ranks > 0) j["instance_ranks"] = m.instance_ranks;
  if (m.weight_block_size != std::array<int64_t, 2>{128, 128}) j["weight_block_size"] = m.weight_block_size;
  return j;
}

Json to_json(const MemberRef& m) { return {{"role", role_name(m.role)}, {"rank", m.rank}}; }

Json to_json(const BoxHash& h) {
  Json j{{"rank", h.rank}, {"tensor", h.tensor}, {"start", h.start}, {"size", h.size}, {"hash", h.hash}};
  if (!h.dtype.empty()) j["dtype"] = h.dtype;
  return j;
}

// ---- Leases that live as long as the refresh holding them ----------------

Result<LeaseRequest> parse_lease(const Json& body, const MessageLimits& lim) {
  Result<StageReport> report = parse_stage_report(body, false, lim, "lease");
  if (!report.is_ok()) return report.status();
  LeaseRequest m{std::move(report).value(), false};
  auto it = body.find("renew");
  if (it != body.end()) {
    if (!it->is_boolean()) {
      return Status::invalid("lease: renew must be a boolean, got " +
                             it->dump(-1, ' ', true, Json::error_handler_t::replace).substr(0, 40));
    }
    m.renew = it->get<bool>();
  }
  return m;
}

// ---- The plan part a receiver executes ------------------------------------

namespace {

bool parse_end(Reader& r, const Json& end, const std::string& path, bool to, const MessageLimits& lim,
               RunEnd* out) {
  int64_t rank = 0;
  if (!to) {
    std::string side;
    if (r.str(end, path, "side", 16, &side)) {
      if (side == "source") out->side = Role::kSource;
      else if (side == "receiver") out->side = Role::kReceiver;
      else r.fail(path + ".side", "must be \"source\" or \"receiver\", got \"" + side.substr(0, 40) + "\"");
    }
  }
  if (r.int_in(end, path, "rank", 0, lim.max_rank - 1, &rank)) out->rank = static_cast<int32_t>(rank);
  if (to) r.boolean(end, path, "stage", &out->stage);
  if (!out->stage) r.str(end, path, "buffer", lim.max_name_bytes, &out->buffer);
  r.uint64(end, path, "offset", &out->offset, /*required=*/true);
  return r.ok();
}

// A conversion step ("kind": "convert", docs/conversion.md).
std::shared_ptr<const ConvertSpec> parse_convert(Reader& r, const Json& run, const std::string& p,
                                                 const MessageLimits& lim) {
  auto c = std::make_shared<ConvertSpec>();
  r.str(run, p, "tensor", lim.max_name_bytes, &c->tensor);
  r.str(run, p, "from_dtype", 16, &c->from_dtype);
  r.str(run, p, "to_dtype", 16, &c->to_dtype);
  std::vector<int64_t> block;
  if (r.dims(run, p, "block", 2, 1, &block) && (block.size() != 2 || block[0] < 1 || block[1] < 1)) {
    r.fail(p + ".block", "must be [rows, cols], two positive integers");
  }
  if (r.ok()) c->block = {block[0], block[1]};
  r.uint64(run, p, "stage", &c->stage, /*required=*/true);
  r.dims(run, p, "start", lim.max_dims, 0, &c->start);
  r.dims(run, p, "size", lim.max_dims, 1, &c->size);
  if (const Json* dst = r.field(run, p, "dst")) {
    r.str(*dst, p + ".dst", "buffer", lim.max_name_bytes, &c->buffer);
    r.uint64(*dst, p + ".dst", "offset", &c->offset, /*required=*/true);
    r.dims(*dst, p + ".dst", "strides", lim.max_dims, 0, &c->strides);
  }
  if (const Json* sc = r.field(run, p, "scales", /*required=*/false)) {
    r.str(*sc, p + ".scales", "buffer", lim.max_name_bytes, &c->scale_buffer);
    r.uint64(*sc, p + ".scales", "offset", &c->scale_offset, /*required=*/true);
    r.dims(*sc, p + ".scales", "strides", lim.max_dims, 0, &c->scale_strides);
  }
  if (r.ok() && (c->start.size() != c->size.size() || c->strides.size() != c->size.size() ||
                 (!c->scale_buffer.empty() && c->scale_strides.size() != c->size.size()))) {
    r.fail(p, "start, size and strides must have the same dims");
  }
  if (r.ok() && run.contains("count")) r.fail(p + ".count", "is given on a \"convert\" step, which is never grouped");
  return c;
}

// A "net" or "local" run, one of a group or alone: as on the wire.
void parse_move(Reader& r, const Json& run, const std::string& p, bool network, const MessageLimits& lim,
                PlanRun* out) {
  out->network = network;
  const Json* from = r.field(run, p, "from");
  const Json* to = r.field(run, p, "to");
  if (from) parse_end(r, *from, p + ".from", /*to=*/false, lim, &out->from);
  if (to) parse_end(r, *to, p + ".to", /*to=*/true, lim, &out->to);
  r.uint64(run, p, "bytes", &out->bytes, /*required=*/true);
  if (r.ok() && out->bytes == 0) r.fail(p + ".bytes", "must be positive, got 0");
  if (r.ok() && out->network != (out->from.side == Role::kSource)) {
    r.fail(p + ".from.side", out->network ? "must be \"source\" for a \"net\" run"
                                          : "must be \"receiver\" for a \"local\" run");
  }
}

// What most often makes a part too long: a receiver that orders a tensor's
// dims otherwise in memory than its source gets one run per element.
constexpr const char* kManyRunsHint =
    " (a receiver's \"max_plan_runs\" sets the limit, at most 2^26; a receiver that holds a tensor in another memory "
    "order than its source, column-major from a row-major trainer, gets a run per element: the coordinator's "
    "\"relayout_below_bytes\" pulls such tensors in large transfers, docs/refresh.md \"Column-major receivers\")";

// A run group's "count" and "stride" (docs/refresh.md, "The plan part"):
// `*count` stays 1 without "count". `expanded`: the runs the entries before
// this one expand to; with this group they must stay within lim.max_runs.
bool parse_group(Reader& r, const Json& run, const std::string& p, size_t expanded, const MessageLimits& lim,
                 int64_t* count, std::array<int64_t, 2>* stride) {
  if (!run.contains("count")) {
    return run.contains("stride") ? r.fail(p + ".stride", "is given without \"count\"") : r.ok();
  }
  // A count over the limit is refused as the limit's, naming the setting.
  if (const Json& c = run["count"]; c.is_number_integer() && (c.is_number_unsigned() || c.get<int64_t>() > 0)) {
    const uint64_t asked = c.get<uint64_t>();
    if (asked > lim.max_runs) {
      return r.fail(p + ".count", "asks for " + std::to_string(asked) + " runs, more than the limit of " +
                                      std::to_string(lim.max_runs) + kManyRunsHint);
    }
  }
  const int64_t most = static_cast<int64_t>(std::min<size_t>(lim.max_runs, std::numeric_limits<int64_t>::max()));
  if (!r.int_in(run, p, "count", 2, std::max<int64_t>(most, 2), count)) return false;
  if (expanded + static_cast<size_t>(*count) > lim.max_runs) {
    return r.fail(p + ".count", "expands the part to " + std::to_string(expanded + static_cast<size_t>(*count)) +
                                    " runs, more than the limit of " + std::to_string(lim.max_runs) + kManyRunsHint);
  }
  const Json* s = r.array(run, p, "stride", 2);
  if (!s) return false;
  if (s->size() != 2) return r.fail(p + ".stride", "must be [from_stride, to_stride], got " + Reader::shown(*s));
  for (size_t k = 0; k < 2; ++k) {
    const Json& v = (*s)[k];
    const bool fits = v.is_number_integer() &&
                      (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()});
    if (!fits) return r.fail(p + ".stride[" + std::to_string(k) + "]", "must be an integer in [-2^63, 2^63), got " +
                                                                          Reader::shown(v));
    (*stride)[k] = v.get<int64_t>();
  }
  return true;
}

// Run `i` of a group's offset of one end: `base` + i * `stride`, which must
// lie in [0, 2^63); computed without overflow.
bool group_offset(Reader& r, const std::string& p, const char* end, uint64_t base, int64_t stride, int64_t i,
                  int64_t count, uint64_t* out) {
  int64_t step = 0, at = 0;
  const bool past = base > uint64_t{std::numeric_limits<int64_t>::max()} ||
                    __builtin_mul_overflow(stride, i, &step) ||
                    __builtin_add_overflow(static_cast<int64_t>(base), step, &at);
  if (!past && at >= 0) {
    *out = static_cast<uint64_t>(at);
    return true;
  }
  const bool below = !past || (stride < 0 && base <= uint64_t{std::numeric_limits<int64_t>::max()});
  return r.fail(p + ".stride", std::string("takes ") + end + ".offset of run " + std::to_string(i) + " of " +
                                   std::to_string(count) + (below ? " below 0" : " past 2^63 - 1"));
}

// The `count` runs of a group, `first` at their offsets, in order.
bool expand_group(Reader& r, const std::string& p, const PlanRun& first, int64_t count,
                  const std::array<int64_t, 2>& stride, std::vector<PlanRun>* out) {
  for (int64_t i = 0; i < count; ++i) {
    PlanRun run = first;
    if (!group_offset(r, p, "from", first.from.offset, stride[0], i, count, &run.from.offset) ||
        !group_offset(r, p, "to", first.to.offset, stride[1], i, count, &run.to.offset)) {
      return false;
    }
    out->push_back(std::move(run));
  }
  return true;
}

// A group's checks without its runs: its last run's offsets (the group's
// extremes, as they step evenly), and where those fail, the first run that
// fails, as expand_group reports it.
bool check_group(Reader& r, const std::string& p, const PlanRun& first, int64_t count,
                 const std::array<int64_t, 2>& stride) {
  uint64_t at = 0;
  Reader probe("plan");
  if (group_offset(probe, p, "from", first.from.offset, stride[0], count - 1, count, &at) &&
      group_offset(probe, p, "to", first.to.offset, stride[1], count - 1, count, &at)) {
    return true;
  }
  for (int64_t i = 0; i < count; ++i) {
    if (!group_offset(r, p, "from", first.from.offset, stride[0], i, count, &at) ||
        !group_offset(r, p, "to", first.to.offset, stride[1], i, count, &at)) {
      return false;
    }
  }
  return true;
}

// The part's runs, each group expanded: at most lim.max_runs entries on the
// wire and at most lim.max_runs runs once expanded. With `out` null, the
// same checks, the runs only counted (*counted): the coordinator checks a
// part of millions of runs without holding them.
bool parse_runs(Reader& r, const Json& runs, const std::string& path, const MessageLimits& lim,
                std::vector<PlanRun>* out, size_t* counted = nullptr) {
  if (!runs.is_array()) return r.fail(path, "must be a list, got " + Reader::shown(runs));
  if (runs.size() > lim.max_runs) {
    return r.fail(path, "has " + std::to_string(runs.size()) + " entries, more than the limit of " +
                            std::to_string(lim.max_runs) + kManyRunsHint);
  }
  size_t n = 0;  // runs so far, groups expanded
  if (out && out->capacity() < runs.size()) out->reserve(runs.size());
  for (size_t i = 0; i < runs.size() && r.ok(); ++i) {
    const Json& run = runs[i];
    const std::string p = path + "[" + std::to_string(i) + "]";
    if (n >= lim.max_runs) {
      return r.fail(p, "expands the part past the limit of " + std::to_string(lim.max_runs) + " runs" + kManyRunsHint);
    }
    PlanRun pr;
    std::string kind;
    if (r.str(run, p, "kind", 16, &kind) && kind != "net" && kind != "local" && kind != "convert") {
      r.fail(p + ".kind", "must be \"net\", \"local\" or \"convert\", got \"" + kind.substr(0, 40) + "\"");
    }
    if (!r.ok()) break;
    if (kind == "convert") {
      pr.convert = parse_convert(r, run, p, lim);
      ++n;
      if (out) out->push_back(std::move(pr));
      continue;
    }
    parse_move(r, run, p, kind == "net", lim, &pr);
    int64_t count = 1;
    std::array<int64_t, 2> stride{};
    if (!r.ok() || !parse_group(r, run, p, n, lim, &count, &stride)) break;
    n += static_cast<size_t>(count);
    if (!out) {
      if (count > 1) check_group(r, p, pr, count, stride);
    } else if (count == 1) {
      out->push_back(std::move(pr));
    } else {
      expand_group(r, p, pr, count, stride, out);
    }
  }
  if (counted) *counted = n;
  return r.ok();
}

bool parse_peer_list(Reader& r, const Json& obj, const std::string& path, const char* key, const MessageLimits& lim,
                     std::vector<PlanPeer>* out) {
  const Json* list = r.array(obj, path, key, lim.max_peers);
  if (!list) return false;
  out->reserve(list->size());
  for (size_t i = 0; i < list->size() && r.ok(); ++i) {
    const Json& p = (*list)[i];
    const std::string q = Reader::join(path, key) + "[" + std::to_string(i) + "]";
    PlanPeer peer;
    int64_t rank = 0;
    if (r.int_in(p, q, "rank", 0, lim.max_rank - 1, &rank)) peer.rank = static_cast<int32_t>(rank);
    r.bytes(p, q, "worker_address", lim.max_address_bytes, &peer.worker_address);
    const Json* buffers = r.array(p, q, "buffers", lim.max_buffers);
    for (size_t j = 0; buffers && j < buffers->size() && r.ok(); ++j) {
      const Json& b = (*buffers)[j];
      const std::string bq = q + "." + at("buffers", j);
      PeerBuffer pb;
      r.str(b, bq, "name", lim.max_name_bytes, &pb.name);
      r.uint64(b, bq, "address", &pb.address, /*required=*/true);
      r.bytes(b, bq, "rkey", lim.max_rkey_bytes, &pb.rkey);
      peer.buffers.push_back(std::move(pb));
    }
    out->push_back(std::move(peer));
  }
  return r.ok();
}

bool parse_peers(Reader& r, const Json& peers, const std::string& path, const MessageLimits& lim, PlanPeers* out) {
  parse_peer_list(r, peers, path, "sources", lim, &out->sources);
  parse_peer_list(r, peers, path, "receivers", lim, &out->receivers);
  if (r.ok() && r.field(peers, path, "domain", /*required=*/false)) {
    const Json* list = r.array(peers, path, "domain", lim.max_peers);
    for (size_t i = 0; list && i < list->size() && r.ok(); ++i) {
      const std::string q = Reader::join(path, "domain") + "[" + std::to_string(i) + "]";
      DomainContact m;
      int64_t rank = 0;
      if (r.int_in((*list)[i], q, "rank", 0, lim.max_rank - 1, &rank)) m.rank = static_cast<int32_t>(rank);
      r.bytes((*list)[i], q, "worker_address", lim.max_address_bytes, &m.worker_address);
      out->domain.push_back(std::move(m));
    }
  }
  return r.ok();
}

bool parse_totals(Reader& r, const Json& totals, const std::string& path, PlanTotals* out) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  if (!totals.is_object()) return r.fail(path, "must be a map, got " + Reader::shown(totals));
  r.int_in(totals, path, "network_bytes", 0, kMax, &out->network_bytes, /*required=*/false);
  r.int_in(totals, path, "minimum_network_bytes", -1, kMax, &out->minimum_network_bytes, /*required=*/false);
  r.int_in(totals, path, "local_bytes", 0, kMax, &out->local_bytes, /*required=*/false);
  r.boolean(totals, path, "solo", &out->solo);
  return r.ok();
}

}  // namespace

Result<PlanPart> parse_plan_part(const Json& body, const MessageLimits& lim, bool with_runs) {
  Reader r("plan");
  PlanPart m;
  uint64_t epoch = 0;
  r.int_in(body, "", "version", 0, std::numeric_limits<int64_t>::max(), &m.version, /*required=*/false);
  r.uint64(body, "", "epoch", &epoch, /*required=*/true);
  m.epoch = PlanEpoch::from_wire(epoch);
  r.boolean(body, "", "unchanged", &m.unchanged);
  if (const Json* totals = r.field(body, "", "plan", /*required=*/false)) parse_totals(r, *totals, "plan", &m.totals);
  if (r.ok() && !m.unchanged) {
    if (const Json* runs = r.field(body, "", "runs"); runs && with_runs) {
      // Counted and checked first: a part over the limit is refused before
      // any run is made, and the runs are held in one allocation.
      size_t n = 0;
      if (parse_runs(r, *runs, "runs", lim, nullptr, &n)) {
        m.runs.reserve(n);
        parse_runs(r, *runs, "runs", lim, &m.runs);
      }
    }
    if (const Json* peers = r.field(body, "", "peers")) parse_peers(r, *peers, "peers", lim, &m.peers);
  }
  if (!r.ok()) return r.status();
  return m;
}

Result<std::vector<PlanRun>> parse_plan_runs(const Json& runs, const MessageLimits& lim) {
  Reader r("plan");
  std::vector<PlanRun> out;
  if (!parse_runs(r, runs, "runs", lim, &out)) return r.status();
  return out;
}

Result<size_t> check_plan_runs(const Json& runs, const MessageLimits& lim) {
  Reader r("plan");
  size_t n = 0;
  if (!parse_runs(r, runs, "runs", lim, nullptr, &n)) return r.status();
  return n;
}

Result<PlanPeers> parse_plan_peers(const Json& peers, const MessageLimits& lim) {
  Reader r("plan");
  PlanPeers out;
  if (!parse_peers(r, peers, "peers", lim, &out)) return r.status();
  return out;
}

Result<PlanTotals> parse_plan_totals(const Json& totals) {
  Reader r("plan");
  PlanTotals out;
  if (!parse_totals(r, totals, "plan", &out)) return r.status();
  return out;
}

Json to_json(const PlanRun& run) {
  if (run.convert) {
    const ConvertSpec& c = *run.convert;
    Json j{{"kind", "convert"}, {"tensor", c.tensor}, {"from_dtype", c.from_dtype}, {"to_dtype", c.to_dtype},
           {"block", c.block}, {"stage", c.stage}, {"start", c.start}, {"size", c.size},
           {"dst", {{"buffer", c.buffer}, {"offset", c.offset}, {"strides", c.strides}}}};
    if (!c.scale_buffer.empty()) {
      j["scales"] = {{"buffer", c.scale_buffer}, {"offset", c.scale_offset}, {"strides", c.scale_strides}};
    }
    return j;
  }
  if (run.to.stage) {
    return Json{{"kind", "net"},
                {"from", {{"side", "source"}, {"rank", run.from.rank}, {"buffer", run.from.buffer},
                          {"offset", run.from.offset}}},
                {"to", {{"rank", run.to.rank}, {"stage", true}, {"offset", run.to.offset}}},
                {"bytes", run.bytes}};
  }
  return Json{{"kind", run.network ? "net" : "local"},
              {"from", {{"side", run.from.side == Role::kSource ? "source" : "receiver"}, {"rank", run.from.rank},
                        {"buffer", run.from.buffer}, {"offset", run.from.offset}}},
              {"to", {{"rank", run.to.rank}, {"buffer", run.to.buffer}, {"offset", run.to.offset}}},
              {"bytes", run.bytes}};
}

Json to_json(const PlanPeers& peers) {
  auto list = [](const std::vector<PlanPeer>& ps) {
    Json out = Json::array();
    for (const PlanPeer& p : ps) {
      Json bs = Json::array();
      for (const PeerBuffer& b : p.buffers) {
        bs.push_back({{"name", b.name}, {"address", b.address}, {"rkey", Json::binary(b.rkey)}});
      }
      out.push_back({{"rank", p.rank}, {"worker_address", Json::binary(p.worker_address)}, {"buffers", std::move(bs)}});
    }
    return out;
  };
  Json domain = Json::array();
  for (const DomainContact& m : peers.domain) {
    domain.push_back({{"rank", m.rank}, {"worker_address", Json::binary(m.worker_address)}});
  }
  return Json{{"sources", list(peers.sources)}, {"receivers", list(peers.receivers)}, {"domain", std::move(domain)}};
}

Json to_json(const PlanTotals& t) {
  Json j{{"network_bytes", t.network_bytes}, {"minimum_network_bytes", t.minimum_network_bytes},
         {"local_bytes", t.local_bytes}};
  if (t.solo) j["solo"] = true;
  return j;
}

Json to_json(const PlanPart& part) {
  Json j{{"ok", true}, {"version", part.version}, {"epoch", part.epoch.wire()}, {"plan", to_json(part.totals)}};
  if (part.unchanged) {
    j["unchanged"] = true;
    return j;
  }
  Json runs = Json::array();
  for (const PlanRun& run : part.runs) runs.push_back(to_json(run));
  j["runs"] = std::move(runs);
  j["peers"] = to_json(part.peers);
  return j;
}

// ---- Notices ----------------------------------------------------------------

Result<VersionNotice> parse_notice(MsgType type, const Json& body, const MessageLimits& lim) {
  if (type != MsgType::kVersionNotify && type != MsgType::kCommit && type != MsgType::kAbort) {
    return Status::invalid(std::string("notice: ") + type_name(type) + " is not a notice to a receiver");
  }
  Reader r(type_name(type));
  VersionNotice n;
  n.type = type;
  r.int_in(body, "", "version", 0, std::numeric_limits<int64_t>::max(), &n.version);
  if (type != MsgType::kVersionNotify) {
    int64_t instance = 0;
    if (r.int_in(body, "", "instance", 0, lim.max_rank - 1, &instance, /*required=*/false)) {
      n.instance = static_cast<int32_t>(instance);
    }
  }
  const Json* reason = type == MsgType::kAbort ? r.field(body, "", "reason", /*required=*/false) : nullptr;
  if (reason && !reason->is_string()) r.fail("reason", "must be a string, got " + Reader::shown(*reason));
  if (reason && r.ok()) {
    n.reason = reason->get<std::string>();
    if (n.reason.size() > lim.max_reason_bytes) r.too_long("", "reason", lim.max_reason_bytes, n.reason.size());
  }
  if (!r.ok()) return r.status();
  return n;
}

Json to_json(const VersionNotice& n) {
  if (n.type == MsgType::kVersionNotify) return Json{{"version", n.version}};
  Json j{{"instance", n.instance}, {"version", n.version}};
  if (n.type == MsgType::kAbort) j["reason"] = n.reason;
  return j;
}

}  // namespace refit::control
