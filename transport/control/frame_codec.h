#pragma once
// Control-plane frames (docs/architecture.md, "Control-plane frames"). On the wire, big-endian:
//
//   magic    u32  "RFCP"
//   version  u16  kProtocolVersion
//   type     u16  a MsgType
//   id       u32  a request's id, chosen by the client; its reply carries
//                 the same id; 0 in every other frame
//   length   u32  bytes of the body that follows
//   body     CBOR (nlohmann::json::to_cbor)
//   seal     32 bytes, after the handshake only: HMAC-SHA256 under the
//                 direction's session key (auth.h) over the frame's
//                 sequence number in its direction (u64, from 0, never
//                 sent) and every byte of the frame before the seal
//
// Everything a peer sends is untrusted. The decoder checks each header field
// as soon as its bytes arrive (random bytes are refused at the first wrong
// magic byte; an oversize frame at its header, before its body is buffered),
// checks a sealed frame's seal before it decodes the body, and decodes the
// body with bounded nesting depth, value count and string length, every
// string (keys too) checked to be UTF-8, so no input can make it recurse
// deeply, allocate without bound or crash, and no string that could not be
// printed as JSON gets in. A decoder that refused something stays failed: the stream cannot be
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
#include "transport/control/auth.h"

namespace refit::control {

using Json = nlohmann::json;

inline constexpr uint8_t kMagic[4] = {'R', 'F', 'C', 'P'};
// Version 2: the request id in the header, and sealed frames.
inline constexpr uint16_t kProtocolVersion = 2;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint32_t kDefaultMaxFrameBytes = uint32_t{64} << 20;

enum class MsgType : uint16_t {
  kChallenge = 1,         // server -> client: {nonce: bytes}
  kAuthResponse = 2,      // client -> server: {role, nonce: bytes, mac: bytes} (auth.h)
  kAuthOk = 3,            // server -> client: {mac: bytes}: the server's proof (auth.h)
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
  kRefreshSummary = 30,   // {rank, version, event, mode, outcome, reason, seconds, ...}: for the metrics (messages.h)
  kReply = 32,            // server -> client: one per request, in order, with its id: {ok, error?, ...}
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
  uint32_t id = 0;  // the request's id (header); 0: not a request or reply
};

// The bytes of one frame, unsealed. Fails when the body's CBOR exceeds
// `max_frame_bytes`.
Result<std::vector<uint8_t>> encode_frame(MsgType type, const Json& body,
                                          uint32_t max_frame_bytes = kDefaultMaxFrameBytes, uint32_t id = 0);

// A member of a frame's body whose value is already CBOR (Json::to_cbor of
// it): a large value is encoded once, off the thread that writes, and
// spliced into each frame that carries it.
struct EncodedMember {
  std::string key;
  const std::vector<uint8_t>* cbor = nullptr;  // borrowed for the call
};

// The bytes of one frame, unsealed, whose body is the object `body` (it must
// be one) with `encoded` added: byte for byte what encode_frame() makes of
// the merged object, keys in order. Fails as encode_frame() does, and when a
// key of `encoded` is also in `body` or repeats.
Result<std::vector<uint8_t>> encode_frame_with(MsgType type, const Json& body,
                                               const std::vector<EncodedMember>& encoded,
                                               uint32_t max_frame_bytes = kDefaultMaxFrameBytes, uint32_t id = 0);

// True when `s` is well-formed UTF-8 (no overlong forms, no surrogates,
// nothing past U+10FFFF), as JSON text requires.
bool valid_utf8(const std::string& s);

// The sending side of a sealed stream: appends each frame's seal under the
// direction's key and the next sequence number. Frames must be sealed in the
// order they are written. Belongs to the thread that writes.
class FrameSealer {
 public:
  FrameSealer() = default;
  explicit FrameSealer(const Mac& key) : key_(key), active_(true) {}
  bool active() const { return active_; }
  // Appends the seal to `frame`, one whole frame from encode_frame.
  Status seal(std::vector<uint8_t>& frame);

 private:
  Mac key_{};
  bool active_ = false;
  uint64_t seq_ = 0;
};

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
  // From the next frame on, every frame must carry a seal under `key` (the
  // peer's direction) and the next sequence number, from 0; one that does
  // not fails the stream, before its body is decoded.
  void expect_seals(const Mac& key);
  // Frames returned since expect_seals().
  uint64_t sealed_frames() const { return seq_; }

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
  std::optional<Mac> seal_key_;
  uint64_t seq_ = 0;
};

}  // namespace refit::control
