// A buffer is bytes, and a timeout of any size works, through the C ABI in
// one process: a source with an embedded coordinator and receivers that
// connect to it, over real UCX on loopback (include/refit/refit.h).
//  - A source buffer holds F32, U8, BF16 and F32 tensors; a receiver buffer
//    holds BF16 weights and their F32 scales, another F32 and U8 tensors.
//    Every byte lands where its segment says, in its own dtype's elements,
//    and no byte outside a segment is written.
//  - Segments that share a byte, whatever their dtypes, are refused naming
//    both.
//  - timeout_ms = REFIT_NO_DEADLINE (INT64_MAX) waits as long as it takes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "refit/refit.h"

namespace {

class Buffers : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(token_) << "0123456789abcdef0123456789abcdef";
    ::chmod(token_.c_str(), 0600);  // a token others may read is refused
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    close(fd);
  }
  void TearDown() override {
    refit_receiver_destroy(receiver_);
    refit_source_destroy(source_);
    std::remove(token_.c_str());
  }
  // The source embeds the coordinator; receivers connect to it.
  std::string config(int rank, bool embedded, const std::string& extra = "") const {
    return "{\"rank\": " + std::to_string(rank) + ", \"domain\": " + std::to_string(rank) +
           ", \"coordinator\": {\"address\": \"127.0.0.1:" + std::to_string(port_) + "\", \"token_file\": \"" +
           token_ + "\"" + (embedded ? ", \"embedded\": true" : "") + ", \"timeout_ms\": 5000}" + extra + "}";
  }
  std::string token_ = "/tmp/refit-buffers-test-token-" + std::to_string(::getpid());
  int port_ = 0;
  refit_source_t* source_ = nullptr;
  refit_receiver_t* receiver_ = nullptr;
};

uint8_t pattern(int64_t version, size_t i) { return static_cast<uint8_t>(version * 37 + i * 11 + (i >> 8)); }

// The source's buffer "fused" (832 bytes):
//   "a"  F32  [8, 16] elements [0, 128)    bytes [0, 512)
//   "m"  U8   [40]    elements [512, 552)  bytes [512, 552)
//   "wq" BF16 [16, 8] elements [280, 408)  bytes [560, 816)
//   "ws" F32  [4]     elements [204, 208)  bytes [816, 832)
const char* const kSourceTensors[] = {
    R"J({"name": "a", "dtype": "F32", "shape": [8, 16], "buffer": "fused",
         "segments": [{"start": [0, 0], "size": [8, 16], "offset": 0}]})J",
    R"J({"name": "m", "dtype": "U8", "shape": [40], "buffer": "fused",
         "segments": [{"start": [0], "size": [40], "offset": 512}]})J",
    R"J({"name": "wq", "dtype": "BF16", "shape": [16, 8], "buffer": "fused",
         "segments": [{"start": [0, 0], "size": [16, 8], "offset": 280}]})J",
    R"J({"name": "ws", "dtype": "F32", "shape": [4], "buffer": "fused",
         "segments": [{"start": [0], "size": [4], "offset": 204}]})J",
};
constexpr size_t kFusedBytes = 832;

// The receiver's buffers:
//   "packed" (no top-level dtype, 288 bytes): "wq" BF16 bytes [0, 256),
//            "ws" F32 elements [64, 68) = bytes [256, 272); [272, 288) unused
//   "misc"   ("dtype": "F32", 576 bytes): "a" bytes [0, 512), "m" U8
//            elements [520, 560); bytes [512, 520) and [560, 576) unused
const char* const kPacked = R"J({"name": "packed", "segments": [
    {"tensor": "wq", "dtype": "BF16", "start": [0, 0], "size": [16, 8], "offset": 0},
    {"tensor": "ws", "dtype": "F32", "start": [0], "size": [4], "offset": 64}]})J";
const char* const kMisc = R"J({"name": "misc", "dtype": "F32", "segments": [
    {"tensor": "a", "start": [0, 0], "size": [8, 16], "offset": 0},
    {"tensor": "m", "dtype": "U8", "start": [0], "size": [40], "offset": 520}]})J";
constexpr uint8_t kUntouched = 0xEE;

// Where each receiver byte comes from in the source's buffer: (receiver
// offset, source offset, bytes).
struct Span {
  size_t to, from, bytes;
};
const Span kPackedSpans[] = {{0, 560, 256}, {256, 816, 16}};
const Span kMiscSpans[] = {{0, 0, 512}, {520, 512, 40}};

// Every byte of `got` is the source's for `version` inside a span, and
// kUntouched outside every span.
void expect_bytes(const std::vector<uint8_t>& got, const Span* spans, size_t n, int64_t version, const char* name) {
  std::vector<int> from(got.size(), -1);
  for (size_t s = 0; s < n; ++s)
    for (size_t k = 0; k < spans[s].bytes; ++k) from[spans[s].to + k] = static_cast<int>(spans[s].from + k);
  size_t wrong = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const uint8_t want = from[i] < 0 ? kUntouched : pattern(version, static_cast<size_t>(from[i]));
    if (got[i] != want && wrong++ < 4) {
      ADD_FAILURE() << name << " byte " << i << ": " << int(got[i]) << ", want " << int(want) << " (version " << version
                    << (from[i] < 0 ? ", outside every segment)" : ")");
    }
  }
  EXPECT_EQ(wrong, 0u) << name;
}

TEST_F(Buffers, SourceAndReceiverBuffersHoldTensorsOfSeveralDtypes) {
  // 8-byte aligned, as a framework's allocation is.
  std::vector<uint64_t> fused_words(kFusedBytes / 8);
  uint8_t* fused = reinterpret_cast<uint8_t*>(fused_words.data());
  ASSERT_EQ(refit_source_create(config(0, true, ", \"verify\": true").c_str(), &source_), REFIT_OK)
      << refit_last_error();
  for (const char* t : kSourceTensors) {
    ASSERT_EQ(refit_source_add_tensor(source_, t, fused, kFusedBytes), REFIT_OK) << t << "\n" << refit_last_error();
  }
  std::vector<uint8_t> packed(288, kUntouched), misc(576, kUntouched);
  ASSERT_EQ(refit_receiver_create(config(0, false, ", \"verify\": true").c_str(), &receiver_), REFIT_OK)
      << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(receiver_, kPacked, packed.data(), packed.size()), REFIT_OK)
      << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(receiver_, kMisc, misc.data(), misc.size()), REFIT_OK) << refit_last_error();
  // Both joined before the first publish, so that the source hashes the
  // boxes this receiver gets.
  ASSERT_EQ(refit_source_join(source_), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_join(receiver_), REFIT_OK) << refit_last_error();
  for (int64_t v = 1; v <= 2; ++v) {
    if (v > 1) {
      ASSERT_EQ(refit_source_wait_drained(source_, v - 1, 10000), REFIT_OK) << refit_last_error();
    }
    for (size_t i = 0; i < kFusedBytes; ++i) fused[i] = pattern(v, i);
    ASSERT_EQ(refit_source_publish(source_, v), REFIT_OK) << refit_last_error();
    ASSERT_EQ(refit_receiver_refresh(receiver_, REFIT_LATEST, 20000), REFIT_OK) << refit_last_error();
    EXPECT_EQ(refit_receiver_version(receiver_), v);
    expect_bytes(packed, kPackedSpans, 2, v, "packed");
    expect_bytes(misc, kMiscSpans, 2, v, "misc");
    // Verification hashed every segment in its own dtype's elements, on
    // both sides, and found them equal.
    const std::string report = refit_receiver_report(receiver_);
    EXPECT_NE(report.find("\"bytes\":" + std::to_string(256 + 16 + 512 + 40)), std::string::npos) << report;
    EXPECT_NE(report.find("\"unverified_bytes\":0"), std::string::npos) << report;
  }
}

TEST_F(Buffers, SegmentsThatShareAByteAreRefusedWhateverTheirDtypes) {
  std::vector<uint64_t> words(16);
  void* data = words.data();
  ASSERT_EQ(refit_source_create(config(0, true).c_str(), &source_), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_add_tensor(source_, R"J({"name": "a", "dtype": "F32", "shape": [4], "buffer": "f",
      "segments": [{"start": [0], "size": [4], "offset": 0}]})J", data, 128), REFIT_OK) << refit_last_error();
  // U8 elements [12, 20) reach into "a"'s bytes [0, 16).
  EXPECT_EQ(refit_source_add_tensor(source_, R"J({"name": "b", "dtype": "U8", "shape": [8], "buffer": "f",
      "segments": [{"start": [0], "size": [8], "offset": 12}]})J", data, 128), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error())
                .find(R"(buffer "f": segment 0 (tensor "a", F32) and segment 1 (tensor "b", U8) overlap)"),
            std::string::npos)
      << refit_last_error();
  // Right after it is fine, and the buffer is then bytes of two dtypes.
  EXPECT_EQ(refit_source_add_tensor(source_, R"J({"name": "b", "dtype": "U8", "shape": [8], "buffer": "f",
      "segments": [{"start": [0], "size": [8], "offset": 16}]})J", data, 128), REFIT_OK) << refit_last_error();

  ASSERT_EQ(refit_receiver_create(config(0, false).c_str(), &receiver_), REFIT_OK) << refit_last_error();
  struct Case {
    const char* json;
    const char* expect;
  } cases[] = {
      // BF16 bytes [0, 16) and F32 elements [3, 7) = bytes [12, 28).
      {R"J({"name": "r", "segments": [{"tensor": "x", "dtype": "BF16", "start": [0], "size": [8], "offset": 0},
                                      {"tensor": "y", "dtype": "F32", "start": [0], "size": [4], "offset": 3}]})J",
       R"(buffer "r": segment 0 (tensor "x", BF16) and segment 1 (tensor "y", F32) overlap)"},
      // The same dtype, a strided segment interleaved with another: rows
      // of 4 of 8 elements, and an element in the gap of row 1 and in row 2.
      {R"J({"name": "r", "dtype": "I32", "segments": [
            {"tensor": "x", "start": [0, 0], "size": [3, 4], "offset": 0, "strides": [8, 1]},
            {"tensor": "y", "start": [0], "size": [2], "offset": 12, "strides": [4]}]})J",
       R"(buffer "r": segment 0 (tensor "x", I32) and segment 1 (tensor "y", I32) overlap)"},
      // No dtype for a segment, from itself or the buffer.
      {R"J({"name": "r", "segments": [{"tensor": "x", "dtype": "BF16", "start": [0], "size": [8], "offset": 0},
                                      {"tensor": "y", "start": [0], "size": [4], "offset": 8}]})J",
       R"("segments[1]" (tensor "y") needs a "dtype": the buffer names none)"},
      {R"J({"name": "r", "segments": [{"tensor": "x", "dtype": "B16", "start": [0], "size": [8], "offset": 0}]})J",
       R"(segments[0].dtype)"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(refit_receiver_add_buffer(receiver_, c.json, data, 128), REFIT_INVALID_ARGUMENT) << c.json;
    EXPECT_NE(std::string(refit_last_error()).find(c.expect), std::string::npos)
        << c.json << "\n  got: " << refit_last_error();
  }
  // Side by side, the strided one's gaps filled by the other: fine.
  EXPECT_EQ(refit_receiver_add_buffer(receiver_, R"J({"name": "r", "dtype": "I32", "segments": [
            {"tensor": "x", "start": [0, 0], "size": [3, 4], "offset": 0, "strides": [8, 1]},
            {"tensor": "y", "dtype": "U8", "start": [0], "size": [16], "offset": 16}]})J", data, 128), REFIT_OK)
      << refit_last_error();
}

// timeout_ms = REFIT_NO_DEADLINE (INT64_MAX): a refresh started before any
// version exists is still waiting after 300 ms (it used to time out at
// once: INT64_MAX ms wrapped into a deadline in the past), and completes
// once the version is published; the other calls take it too.
TEST_F(Buffers, AHugeTimeoutIsNoDeadline) {
  float src[4] = {1, 2, 3, 4}, dst[4] = {};
  ASSERT_EQ(refit_source_create(config(0, true).c_str(), &source_), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_add_tensor(source_, R"J({"name": "w", "dtype": "F32", "shape": [4],
      "segments": [{"start": [0], "size": [4], "offset": 0}]})J", src, sizeof src), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_join(source_), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_create(config(0, false).c_str(), &receiver_), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_add_buffer(receiver_, R"J({"name": "w", "dtype": "F32",
      "segments": [{"tensor": "w", "start": [0], "size": [4], "offset": 0}]})J", dst, sizeof dst), REFIT_OK)
      << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh_start(receiver_, REFIT_LATEST, REFIT_NO_DEADLINE), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_refresh_wait(receiver_, 300), REFIT_IN_PROGRESS) << refit_last_error();
  ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_refresh_wait(receiver_, REFIT_NO_DEADLINE), REFIT_OK) << refit_last_error();
  EXPECT_EQ(dst[3], 4.0f);
  EXPECT_EQ(refit_source_wait_drained(source_, 1, REFIT_NO_DEADLINE), REFIT_OK) << refit_last_error();
  src[3] = 5;
  ASSERT_EQ(refit_source_publish(source_, 2), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_refresh(receiver_, 2, REFIT_NO_DEADLINE), REFIT_OK) << refit_last_error();
  EXPECT_EQ(dst[3], 5.0f);
  // A century less a millisecond is the same; a negative timeout is 0.
  EXPECT_EQ(refit_source_wait_drained(source_, 2, INT64_C(3155760000000) - 1), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_refresh_wait(receiver_, -5), REFIT_OK) << "no started refresh: its last result";
}

}  // namespace
