#include "transport/control/frame_codec.h"

#include <cstring>
#include <map>

namespace refit::control {

bool is_known_type(uint16_t t) {
  switch (static_cast<MsgType>(t)) {
    case MsgType::kChallenge:
    case MsgType::kAuthResponse:
    case MsgType::kAuthOk:
    case MsgType::kError:
    case MsgType::kRegisterSource:
    case MsgType::kRegisterReceiver:
    case MsgType::kUnregister:
    case MsgType::kHeartbeat:
    case MsgType::kPublishVersion:
    case MsgType::kSubscribe:
    case MsgType::kFetchPlan:
    case MsgType::kReportStaged:
    case MsgType::kReportFailed:
    case MsgType::kLease:
    case MsgType::kRelease:
    case MsgType::kWaitDrained:
    case MsgType::kVerifyBoxes:
    case MsgType::kVersionHashes:
    case MsgType::kRefreshSummary:
    case MsgType::kCommit:
    case MsgType::kAbort:
    case MsgType::kDrained:
    case MsgType::kReply:
    case MsgType::kVersionNotify:
      return true;
  }
  return false;
}

const char* type_name(MsgType t) {
  switch (t) {
    case MsgType::kChallenge: return "challenge";
    case MsgType::kAuthResponse: return "auth_response";
    case MsgType::kAuthOk: return "auth_ok";
    case MsgType::kError: return "error";
    case MsgType::kRegisterSource: return "register_source";
    case MsgType::kRegisterReceiver: return "register_receiver";
    case MsgType::kUnregister: return "unregister";
    case MsgType::kHeartbeat: return "heartbeat";
    case MsgType::kPublishVersion: return "publish_version";
    case MsgType::kSubscribe: return "subscribe";
    case MsgType::kFetchPlan: return "fetch_plan";
    case MsgType::kReportStaged: return "report_staged";
    case MsgType::kReportFailed: return "report_failed";
    case MsgType::kLease: return "lease";
    case MsgType::kRelease: return "release";
    case MsgType::kWaitDrained: return "wait_drained";
    case MsgType::kVerifyBoxes: return "verify_boxes";
    case MsgType::kVersionHashes: return "version_hashes";
    case MsgType::kRefreshSummary: return "refresh_summary";
    case MsgType::kDrained: return "drained";
    case MsgType::kCommit: return "commit";
    case MsgType::kAbort: return "abort";
    case MsgType::kReply: return "reply";
    case MsgType::kVersionNotify: return "version_notify";
  }
  return "unknown";
}

namespace {

void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}
void put_u32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}
uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>((p[0] << 8) | p[1]); }
uint32_t get_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Builds a Json DOM from SAX events while enforcing BodyLimits. Returning
// false from a start_* event stops nlohmann's reader before it recurses, so
// depth is bounded by max_depth, not by the input. Containers are never
// reserved from a declared count: the count is untrusted.
class BoundedDomBuilder {
 public:
  using number_integer_t = Json::number_integer_t;
  using number_unsigned_t = Json::number_unsigned_t;
  using number_float_t = Json::number_float_t;
  using string_t = Json::string_t;
  using binary_t = Json::binary_t;

  BoundedDomBuilder(Json& root, const BodyLimits& limits) : root_(root), limits_(limits) {}

  bool null() { return value(nullptr); }
  bool boolean(bool v) { return value(v); }
  bool number_integer(number_integer_t v) { return value(v); }
  bool number_unsigned(number_unsigned_t v) { return value(v); }
  bool number_float(number_float_t v, const string_t&) { return value(v); }
  bool string(string_t& v) {
    if (!check_string(v.size()) || !check_utf8(v, "a text string")) return false;
    return value(std::move(v));
  }
  bool binary(binary_t& v) {
    if (!check_string(v.size())) return false;
    return value(Json::binary(std::move(v)));
  }
  bool start_object(std::size_t) { return open(Json::value_t::object); }
  bool key(string_t& k) {
    if (!check_string(k.size()) || !check_utf8(k, "a map key")) return false;
    key_target_ = &(*stack_.back())[k];
    return true;
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(Json::value_t::array); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    if (error_.empty()) {
      error_ = "malformed CBOR at byte " + std::to_string(position) + ": " + ex.what();
    }
    return false;
  }

  const std::string& error() const { return error_; }

 private:
  bool fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }
  bool check_string(size_t n) {
    if (n > limits_.max_string_bytes) {
      return fail("a string of " + std::to_string(n) + " bytes exceeds the limit of " +
                  std::to_string(limits_.max_string_bytes));
    }
    return true;
  }
  // A text string that is not UTF-8 would make nlohmann throw wherever the
  // document is later printed (type_error 316): refused here, once for all.
  bool check_utf8(const std::string& s, const char* what) {
    if (valid_utf8(s)) return true;
    return fail(std::string(what) + " of " + std::to_string(s.size()) + " bytes is not valid UTF-8 (value " +
                std::to_string(values_ + 1) + ")");
  }
  template <typename V>
  Json* place(V&& v) {
    if (++values_ > limits_.max_values) {
      fail("more than " + std::to_string(limits_.max_values) + " values");
      return nullptr;
    }
    if (stack_.empty()) {
      root_ = Json(std::forward<V>(v));
      return &root_;
    }
    Json* top = stack_.back();
    if (top->is_array()) {
      top->emplace_back(std::forward<V>(v));
      return &top->back();
    }
    *key_target_ = Json(std::forward<V>(v));
    return key_target_;
  }
  template <typename V>
  bool value(V&& v) {
    return place(std::forward<V>(v)) != nullptr;
  }
  bool open(Json::value_t t) {
    if (static_cast<int>(stack_.size()) >= limits_.max_depth) {
      return fail("nesting deeper than " + std::to_string(limits_.max_depth) + " levels");
    }
    Json* p = place(t);
    if (!p) return false;
    stack_.push_back(p);
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  Json& root_;
  const BodyLimits& limits_;
  std::vector<Json*> stack_;
  Json* key_target_ = nullptr;
  size_t values_ = 0;
  std::string error_;
};

}  // namespace

bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
    else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
    else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
    else return false;
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

namespace {

Status seal_of(const Mac& key, uint64_t seq, const uint8_t* frame, size_t size, Mac* out) {
  uint8_t s[8];
  for (int i = 0; i < 8; ++i) s[i] = static_cast<uint8_t>(seq >> (56 - 8 * i));
  Hmac h(key);
  REFIT_RETURN_IF_ERROR(h.begin());
  REFIT_RETURN_IF_ERROR(h.update(s, sizeof s));
  REFIT_RETURN_IF_ERROR(h.update(frame, size));
  Result<Mac> m = h.finish();
  if (!m.is_ok()) return m.status();
  *out = *m;
  return Status::ok();
}

}  // namespace

Status FrameSealer::seal(std::vector<uint8_t>& frame) {
  if (!active_) return Status::ok();
  Mac mac{};
  REFIT_RETURN_IF_ERROR(seal_of(key_, seq_, frame.data(), frame.size(), &mac));
  ++seq_;
  frame.insert(frame.end(), mac.begin(), mac.end());
  return Status::ok();
}

void FrameDecoder::expect_seals(const Mac& key) {
  seal_key_ = key;
  seq_ = 0;
}

Result<std::vector<uint8_t>> encode_frame(MsgType type, const Json& body, uint32_t max_frame_bytes, uint32_t id) {
  std::vector<uint8_t> out(kHeaderBytes);
  Json::to_cbor(body, out);
  const size_t len = out.size() - kHeaderBytes;
  if (len > max_frame_bytes) {
    return Status::invalid("frame: " + std::string(type_name(type)) + " body of " +
                           std::to_string(len) + " bytes exceeds the limit of " +
                           std::to_string(max_frame_bytes) + " bytes");
  }
  std::memcpy(out.data(), kMagic, 4);
  put_u16(out.data() + 4, kProtocolVersion);
  put_u16(out.data() + 6, static_cast<uint16_t>(type));
  put_u32(out.data() + 8, id);
  put_u32(out.data() + 12, static_cast<uint32_t>(len));
  return out;
}

namespace {

// The header of a CBOR map of `n` pairs (major type 5), as Json::to_cbor
// writes it.
void put_cbor_map_header(std::vector<uint8_t>& out, uint64_t n) {
  if (n <= 0x17) {
    out.push_back(static_cast<uint8_t>(0xa0 + n));
    return;
  }
  const int bytes = n <= 0xff ? 1 : n <= 0xffff ? 2 : n <= 0xffffffffu ? 4 : 8;
  out.push_back(static_cast<uint8_t>(bytes == 1 ? 0xb8 : bytes == 2 ? 0xb9 : bytes == 4 ? 0xba : 0xbb));
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
}

}  // namespace

Result<std::vector<uint8_t>> encode_frame_with(MsgType type, const Json& body,
                                               const std::vector<EncodedMember>& encoded,
                                               uint32_t max_frame_bytes, uint32_t id) {
  if (!body.is_object()) return Status::internal("frame: a body with encoded members must be an object");
  // Every member in key order, as nlohmann's object (a std::map) holds them.
  std::map<std::string, const std::vector<uint8_t>*> raw;
  size_t raw_bytes = 0;
  for (const EncodedMember& m : encoded) {
    if (!m.cbor || body.contains(m.key) || !raw.emplace(m.key, m.cbor).second) {
      return Status::internal("frame: encoded member \"" + m.key + "\" is missing or given twice");
    }
    raw_bytes += m.cbor->size();
  }
  std::vector<uint8_t> out(kHeaderBytes);
  out.reserve(kHeaderBytes + raw_bytes + 64 * (body.size() + raw.size()) + 16);
  put_cbor_map_header(out, body.size() + raw.size());
  auto item = body.items().begin();
  auto next_raw = raw.begin();
  while (item != body.items().end() || next_raw != raw.end()) {
    if (next_raw == raw.end() || (item != body.items().end() && item.key() < next_raw->first)) {
      Json::to_cbor(Json(item.key()), out);
      Json::to_cbor(item.value(), out);
      ++item;
    } else {
      Json::to_cbor(Json(next_raw->first), out);
      out.insert(out.end(), next_raw->second->begin(), next_raw->second->end());
      ++next_raw;
    }
  }
  const size_t len = out.size() - kHeaderBytes;
  if (len > max_frame_bytes) {
    return Status::invalid("frame: " + std::string(type_name(type)) + " body of " + std::to_string(len) +
                           " bytes exceeds the limit of " + std::to_string(max_frame_bytes) + " bytes");
  }
  std::memcpy(out.data(), kMagic, 4);
  put_u16(out.data() + 4, kProtocolVersion);
  put_u16(out.data() + 6, static_cast<uint16_t>(type));
  put_u32(out.data() + 8, id);
  put_u32(out.data() + 12, static_cast<uint32_t>(len));
  return out;
}

Result<Json> decode_body(const uint8_t* data, size_t size, const BodyLimits& limits) {
  Json root;
  BoundedDomBuilder builder(root, limits);
  bool ok = false;
  try {
    ok = Json::sax_parse(data, data + size, &builder, nlohmann::json::input_format_t::cbor,
                         /*strict=*/true);
  } catch (const std::exception& e) {
    // nlohmann reports through parse_error; this is a belt for anything else.
    return Status::invalid(std::string("body: ") + e.what());
  }
  if (!ok) {
    return Status::invalid("body: " + (builder.error().empty() ? std::string("malformed CBOR")
                                                              : builder.error()));
  }
  return root;
}

void FrameDecoder::feed(const uint8_t* data, size_t size) {
  if (failed() || size == 0) return;
  buffer_.insert(buffer_.end(), data, data + size);
}

Status FrameDecoder::check_header() const {
  const size_t have = buffer_.size();
  for (size_t i = 0; i < 4 && i < have; ++i) {
    if (buffer_[i] != kMagic[i]) {
      char hex[3];
      std::snprintf(hex, sizeof hex, "%02x", buffer_[i]);
      return Status::invalid("frame: bad magic byte " + std::to_string(i) + " (0x" + hex +
                             "): not a refit control-plane peer");
    }
  }
  if (have >= 6) {
    const uint16_t v = get_u16(buffer_.data() + 4);
    if (v != kProtocolVersion) {
      return Status::invalid("frame: protocol version " + std::to_string(v) +
                             " is not supported (this build speaks version " +
                             std::to_string(kProtocolVersion) + ")");
    }
  }
  if (have >= 8) {
    const uint16_t t = get_u16(buffer_.data() + 6);
    if (!is_known_type(t)) return Status::invalid("frame: unknown message type " + std::to_string(t));
  }
  if (have >= kHeaderBytes) {
    const uint32_t len = get_u32(buffer_.data() + 12);
    if (len > limits_.max_frame_bytes) {
      return Status::invalid("frame: length " + std::to_string(len) + " exceeds the limit of " +
                             std::to_string(limits_.max_frame_bytes) + " bytes");
    }
  }
  return Status::ok();
}

Result<std::optional<Frame>> FrameDecoder::next() {
  if (failed()) return error_;
  if (buffer_.empty()) return std::optional<Frame>();
  Status s = check_header();
  if (!s.is_ok()) {
    error_ = s;
    buffer_.clear();
    buffer_.shrink_to_fit();
    return error_;
  }
  if (buffer_.size() < kHeaderBytes) return std::optional<Frame>();
  const uint32_t len = get_u32(buffer_.data() + 12);
  const size_t seal = seal_key_ ? kMacBytes : 0;
  if (buffer_.size() - kHeaderBytes < size_t{len} + seal) return std::optional<Frame>();
  const auto type = static_cast<MsgType>(get_u16(buffer_.data() + 6));
  const uint32_t id = get_u32(buffer_.data() + 8);
  if (seal_key_) {
    // Checked before the body is decoded: a frame that is not the peer's
    // next one reaches no parser.
    Mac mac{};
    Status st = seal_of(*seal_key_, seq_, buffer_.data(), kHeaderBytes + len, &mac);
    if (st.is_ok() && !mac_equal_bytes(mac, buffer_.data() + kHeaderBytes + len)) {
      st = Status::invalid("frame: " + std::string(type_name(type)) + " (frame " + std::to_string(seq_) +
                           " after authentication) fails its seal: it was altered, injected or replayed, or a "
                           "frame before it was dropped");
    }
    if (!st.is_ok()) {
      error_ = st;
      buffer_.clear();
      buffer_.shrink_to_fit();
      return error_;
    }
    ++seq_;
  }
  Result<Json> body = decode_body(buffer_.data() + kHeaderBytes, len, limits_.body);
  if (!body.is_ok()) {
    error_ = body.status().with_context(std::string("frame: ") + type_name(type));
    buffer_.clear();
    buffer_.shrink_to_fit();
    return error_;
  }
  buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes + len + seal));
  // A big frame must not pin its memory for the connection's lifetime.
  if (buffer_.empty() && buffer_.capacity() > kKeptCapacity) std::vector<uint8_t>().swap(buffer_);
  return std::optional<Frame>(Frame{type, std::move(body).value(), id});
}

}  // namespace refit::control
