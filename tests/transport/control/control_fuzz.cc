// libFuzzer target over everything that parses peer bytes: the frame decoder
// (fed in pieces, as a socket delivers them) and, for every frame it accepts,
// the request parser of that type. Built under clang only, with
// -fsanitize=fuzzer,address,undefined. Run:
//   control_fuzz -max_total_time=60 corpus/
// The first byte of the input picks where the stream is cut into pieces.

#include <cstddef>
#include <cstdint>

#include "transport/control/frame_codec.h"
#include "transport/control/messages.h"

using namespace refit::control;

namespace {

void parse_request(const Frame& f, const MessageLimits& lim) {
  switch (f.type) {
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
    default: break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 64;
  ++data;
  --size;
  DecoderLimits lim;
  lim.max_frame_bytes = 1 << 16;
  MessageLimits mlim;
  mlim.max_tensors = 64;
  mlim.max_buffers = 64;
  mlim.max_segments = 256;
  FrameDecoder d(lim);
  for (size_t at = 0; at < size; at += step) {
    d.feed(data + at, std::min(step, size - at));
    for (;;) {
      auto f = d.next();
      if (!f.is_ok()) return 0;
      if (!f->has_value()) break;
      parse_request(**f, mlim);
    }
  }
  // The body parser on its own, over the whole input.
  (void)decode_body(data, size, BodyLimits{});
  return 0;
}
