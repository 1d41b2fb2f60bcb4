#include "transport/control/messages.h"

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
  bool uint64(const Json& obj, const std::string& path, const char* key, uint64_t* out) {
    const Json* v = field(obj, path, key, false);
    if (!v) return ok();
    if (v->is_number_unsigned()) {
      *out = v->get<uint64_t>();
      return true;
    }
    return fail(join(path, key), "must be an unsigned integer, got " + shown(*v));
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
      if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t{1} << 62) {
        out->push_back(static_cast<int64_t>(v.get<uint64_t>()));
      } else if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() >= lo &&
                 v.get<int64_t>() >= 0) {
        out->push_back(v.get<int64_t>());
      } else {
        return fail(p, "must be a non-negative integer, got " + shown(v));
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
  return j;
}

Json to_json(const MemberRef& m) { return {{"role", role_name(m.role)}, {"rank", m.rank}}; }

Json to_json(const BoxHash& h) {
  return {{"rank", h.rank}, {"tensor", h.tensor}, {"start", h.start}, {"size", h.size}, {"hash", h.hash}};
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

}  // namespace refit::control
