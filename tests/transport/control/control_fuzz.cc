// libFuzzer target over everything that parses peer bytes: the frame decoder
// (fed in pieces, as a socket delivers them), unsealed and sealed, and, for
// every frame it accepts, the request parser of that type (auth_response
// included). Built under clang only, with -fsanitize=fuzzer,address,undefined.
// Run:
//   control_fuzz -max_total_time=60 corpus/
// The first byte of the input picks where the stream is cut into pieces
// (low 6 bits) and the mode (high 2 bits): 0 and 1 decode the bytes as they
// come; 2 seals each frame of a first decoding pass with a session key and
// decodes the sealed stream (every body reaches its parser through the seal
// check); 3 does the same with one bit of the sealed stream flipped, which
// must fail the stream.

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "transport/control/frame_codec.h"
#include "transport/control/messages.h"

using namespace refit::control;

namespace {

void parse_request(const Frame& f, const MessageLimits& lim) {
  switch (f.type) {
    case MsgType::kAuthResponse: (void)parse_auth_response(f.body); break;
    case MsgType::kRegisterSource: (void)parse_register_source(f.body, lim); break;
    case MsgType::kRegisterReceiver: (void)parse_register_receiver(f.body, lim); break;
    case MsgType::kUnregister:
    case MsgType::kHeartbeat: (void)parse_member_ref(f.body, "heartbeat", lim); break;
    case MsgType::kPublishVersion: (void)parse_publish_version(f.body, "publish_version", lim); break;
    case MsgType::kFetchPlan: (void)parse_fetch_plan(f.body, lim); break;
    case MsgType::kReportStaged: (void)parse_stage_report(f.body, false, lim); break;
    case MsgType::kReportFailed: (void)parse_stage_report(f.body, true, lim); break;
    case MsgType::kLease: (void)parse_lease(f.body, lim); break;
    case MsgType::kRelease: (void)parse_stage_report(f.body, false, lim, "release"); break;
    case MsgType::kWaitDrained: (void)parse_publish_version(f.body, "wait_drained"); break;
    case MsgType::kVersionHashes: (void)parse_version_hashes(f.body, lim); break;
    case MsgType::kRefreshSummary: {  // a summary that parses serializes to one that parses again
      refit::Result<RefreshSummary> s = parse_refresh_summary(f.body, lim);
      if (s.is_ok() && !parse_refresh_summary(to_json(*s), lim).is_ok()) __builtin_trap();
      break;
    }
    // What the coordinator sends a receiver, which parses it as untrusted:
    // a plan part that parses (its run groups expanded) serializes, one
    // entry per run, to one that parses again into as many runs.
    case MsgType::kReply: {
      refit::Result<PlanPart> part = parse_plan_part(f.body, lim);
      // The coordinator's check without the runs says what the parse says.
      if (f.body.is_object() && f.body.contains("runs")) {
        refit::Result<std::vector<PlanRun>> runs = parse_plan_runs(f.body["runs"], lim);
        refit::Result<size_t> counted = check_plan_runs(f.body["runs"], lim);
        if (runs.status().message() != counted.status().message()) __builtin_trap();
        if (runs.is_ok() && *counted != runs->size()) __builtin_trap();
      }
      if (!part.is_ok()) break;
      refit::Result<PlanPart> again = parse_plan_part(to_json(*part), lim);
      if (!again.is_ok() || again->runs.size() != part->runs.size()) __builtin_trap();
      break;
    }
    case MsgType::kVersionNotify:
    case MsgType::kCommit:
    case MsgType::kAbort: {
      refit::Result<VersionNotice> n = parse_notice(f.type, f.body, lim);
      if (n.is_ok() && !parse_notice(f.type, to_json(*n), lim).is_ok()) __builtin_trap();
      break;
    }
    default: break;
  }
  // Whatever was accepted prints as JSON: every string is UTF-8 (a string
  // that is not would throw type_error 316 here).
  (void)f.body.dump();
}

// Feeds `bytes` to `d` in pieces of `step`; every frame to its parser.
// Returns the frames, re-encoded, or stops at the first error.
std::vector<Frame> run(FrameDecoder& d, const uint8_t* data, size_t size, size_t step, const MessageLimits& mlim,
                       bool* failed) {
  std::vector<Frame> frames;
  *failed = false;
  for (size_t at = 0; at < size; at += step) {
    d.feed(data + at, std::min(step, size - at));
    for (;;) {
      auto f = d.next();
      if (!f.is_ok()) {
        *failed = true;
        return frames;
      }
      if (!f->has_value()) break;
      parse_request(**f, mlim);
      frames.push_back(std::move(**f));
    }
  }
  return frames;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + (data[0] & 63);
  const int mode = data[0] >> 6;
  ++data;
  --size;
  DecoderLimits lim;
  lim.max_frame_bytes = 1 << 16;
  MessageLimits mlim;
  mlim.max_tensors = 64;
  mlim.max_buffers = 64;
  mlim.max_segments = 256;
  // A run group ("count") expands within this bound: a frame of a few bytes
  // reaches it, so it stays small enough for many runs a second.
  mlim.max_runs = 4096;
  FrameDecoder d(lim);
  bool failed = false;
  std::vector<Frame> frames = run(d, data, size, step, mlim, &failed);
  if (mode >= 2 && !frames.empty()) {
    Mac key{};
    for (size_t i = 0; i < key.size(); ++i) key[i] = static_cast<uint8_t>(i * 7 + 1);
    FrameSealer sealer(key);
    std::vector<uint8_t> stream;
    for (const Frame& f : frames) {
      auto bytes = encode_frame(f.type, f.body, lim.max_frame_bytes, f.id);
      if (!bytes.is_ok()) return 0;
      if (!sealer.seal(*bytes).is_ok()) std::abort();
      stream.insert(stream.end(), bytes->begin(), bytes->end());
    }
    const bool flip = mode == 3;
    if (flip) stream[(size * 131) % stream.size()] ^= static_cast<uint8_t>(1u << (size % 8));
    FrameDecoder sealed(lim);
    sealed.expect_seals(key);
    bool sealed_failed = false;
    std::vector<Frame> again = run(sealed, stream.data(), stream.size(), step, mlim, &sealed_failed);
    // Unaltered: every frame comes back. Altered: the stream never yields
    // all of them (a flipped length may leave it waiting for more bytes).
    if (!flip && (sealed_failed || again.size() != frames.size())) std::abort();
    if (flip && again.size() == frames.size() && !sealed_failed) std::abort();
  }
  // The body parser on its own, over the whole input.
  (void)decode_body(data, size, BodyLimits{});
  return 0;
}
