#pragma once
// Control-plane frames (DESIGN.md section 5). On the wire, big-endian:
//
//   magic    u32  "RFCP"
//   version  u16  kProtocolVersion
//   type     u16  a MsgType
//   length   u32  bytes of the body that follows
//   body     CBOR (nlohmann::json::to_cbor)
//
// Everything a peer sends is untrusted. The decoder checks each header field
// as soon as its bytes arrive (random bytes are refused at the first wrong
// magic byte; an oversize frame at its header, before its body is buffered),
// and decodes the body with bounded nesting depth, value count and string
// length, so no input can make it recurse deeply, allocate without bound or
// crash. A decoder that refused something stays failed: the stream cannot be
// resynchronised, and the connection must be closed.
//
// Thread safety: a FrameDecoder belongs to one thread (the connection's).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "planner/status.h"

namespace refit::control {

using Json = nlohmann::json;

inline constexpr uint8_t kMagic[4] = {'R', 'F', 'C', 'P'};
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kHeaderBytes = 12;
inline constexpr uint32_t kDefaultMaxFrameBytes = uint32_t{64} << 20;

enum class MsgType : uint16_t {
  kChallenge = 1,         // server -> client: {nonce: bytes}
  kAuthResponse = 2,      // client -> server: {mac: bytes}
  kAuthOk = 3,            // server -> client: {}
  kError = 4,             // server -> client: {reason}; the server closes after it
  kRegisterSource = 16,
  kRegisterReceiver = 17,
  kUnregister = 18,
  kHeartbeat = 19,
  kPublishVersion = 20,   // {version, hashes?}: this connection's sources hold it (control_state.h)
  kSubscribe = 21,        // {}: reply {version}: the group version; version_notify follows each advance
  kFetchPlan = 22,        // {rank, epoch?}: reply {version, epoch, plan, runs, peers} (or unchanged): what receiver `rank` executes
                          // in membership `epoch` (the same runs until the epoch changes)
  kReportStaged = 23,     // {rank, version}
  kReportFailed = 24,     // {rank, version, reason}
  kLease = 25,            // {rank, version}: receiver `rank` reads version v from the sources
  kRelease = 26,          // {rank, version}
  kWaitDrained = 27,      // {version}: reply {drained}; if false, a drained notice follows
  kVerifyBoxes = 28,      // {}: reply {boxes}: the boxes this connection's sources hash at publish
  kVersionHashes = 29,    // {rank, version}: reply {hashes, unverified_bytes}: what receiver `rank` checks
  kReply = 32,            // server -> client: one per request, in order: {ok, error?, ...}
  kVersionNotify = 33,    // server -> subscribed client: {version}
  kCommit = 34,           // server -> every rank of an instance: {instance, version}
  kAbort = 35,            // server -> every rank of an instance: {instance, version, reason}
  kDrained = 36,          // server -> a source that waited: {version}
};
bool is_known_type(uint16_t type);
const char* type_name(MsgType type);

// Bounds on one decoded body. Defaults fit a 90k-tensor registration.
struct BodyLimits {
  int max_depth = 16;
  size_t max_values = size_t{1} << 22;
  size_t max_string_bytes = size_t{1} << 20;
};

struct DecoderLimits {
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;  // body bytes
  BodyLimits body;
};

struct Frame {
  MsgType type = MsgType::kError;
  Json body;
};

// The bytes of one frame. Fails when the body's CBOR exceeds `max_frame_bytes`.
Result<std::vector<uint8_t>> encode_frame(MsgType type, const Json& body,
                                          uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

// Decodes a CBOR document within `limits`; the message names what was exceeded.
Result<Json> decode_body(const uint8_t* data, size_t size, const BodyLimits& limits);

class FrameDecoder {
 public:
  explicit FrameDecoder(DecoderLimits limits = {}) : limits_(limits) {}

  // Appends bytes. Never fails: problems surface from next().
  void feed(const uint8_t* data, size_t size);

  // The next complete frame; nullopt when more bytes are needed; a Status
  // naming the problem when the stream is bad (and from then on).
  Result<std::optional<Frame>> next();

  // Changes the limits for frames not yet started (a connection raises them
  // once its peer has authenticated).
  void set_limits(const DecoderLimits& limits) { limits_ = limits; }

  // True when some bytes of an unfinished frame are buffered.
  bool mid_frame() const { return !buffer_.empty(); }
  // Bytes fed and not yet returned as frames. Once they are all returned,
  // the decoder keeps at most kKeptCapacity bytes of memory.
  size_t buffered_bytes() const { return buffer_.size(); }
  static constexpr size_t kKeptCapacity = size_t{64} << 10;
  bool failed() const { return !error_.is_ok(); }

 private:
  Status check_header() const;

  DecoderLimits limits_;
  std::vector<uint8_t> buffer_;  // bytes of the current frame (and maybe more)
  Status error_;
};

}  // namespace refit::control
