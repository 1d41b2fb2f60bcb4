#include "transport/control/frame_codec.h"

#include <gtest/gtest.h>

#include <random>

namespace refit::control {
namespace {

std::vector<uint8_t> frame_bytes(MsgType t, const Json& body) {
  auto r = encode_frame(t, body);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.value();
}

TEST(FrameCodec, RoundTripsOneFrame) {
  Json body = {{"rank", 3}, {"name", "w"}, {"blob", Json::binary({1, 2, 3})}};
  auto bytes = frame_bytes(MsgType::kRegisterSource, body);
  FrameDecoder d;
  d.feed(bytes.data(), bytes.size());
  auto f = d.next();
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  ASSERT_TRUE(f->has_value());
  EXPECT_EQ((*f)->type, MsgType::kRegisterSource);
  EXPECT_EQ((*f)->body, body);
  auto again = d.next();
  ASSERT_TRUE(again.is_ok());
  EXPECT_FALSE(again->has_value());
  EXPECT_FALSE(d.mid_frame());
}

TEST(FrameCodec, CountsTheBytesItBuffers) {
  auto big = frame_bytes(MsgType::kRegisterSource, Json{{"blob", Json::binary(std::vector<uint8_t>(1 << 20, 7))}});
  auto small = frame_bytes(MsgType::kHeartbeat, Json{{"rank", 1}});
  FrameDecoder d;
  EXPECT_EQ(d.buffered_bytes(), 0u);
  d.feed(big.data(), big.size() - 1);
  EXPECT_EQ(d.buffered_bytes(), big.size() - 1);
  ASSERT_FALSE(d.next()->has_value());
  d.feed(&big.back(), 1);
  d.feed(small.data(), 5);
  ASSERT_TRUE(d.next()->has_value());
  EXPECT_EQ(d.buffered_bytes(), 5u) << "what is left of the next frame";
  d.feed(small.data() + 5, small.size() - 5);
  ASSERT_TRUE(d.next()->has_value());
  EXPECT_EQ(d.buffered_bytes(), 0u);
}

TEST(FrameCodec, AssemblesFramesFedOneByteAtATime) {
  std::vector<uint8_t> stream;
  for (int i = 0; i < 5; ++i) {
    auto b = frame_bytes(MsgType::kHeartbeat, Json{{"role", "source"}, {"rank", i}});
    stream.insert(stream.end(), b.begin(), b.end());
  }
  FrameDecoder d;
  int got = 0;
  for (uint8_t byte : stream) {
    d.feed(&byte, 1);
    for (;;) {
      auto f = d.next();
      ASSERT_TRUE(f.is_ok()) << f.status().message();
      if (!f->has_value()) break;
      EXPECT_EQ((*f)->body["rank"], got);
      ++got;
    }
  }
  EXPECT_EQ(got, 5);
  EXPECT_FALSE(d.mid_frame());
}

TEST(FrameCodec, DecodesSeveralFramesFromOneFeed) {
  auto a = frame_bytes(MsgType::kSubscribe, Json::object());
  auto b = frame_bytes(MsgType::kPublishVersion, Json{{"version", 7}});
  a.insert(a.end(), b.begin(), b.end());
  FrameDecoder d;
  d.feed(a.data(), a.size());
  auto f1 = d.next();
  auto f2 = d.next();
  ASSERT_TRUE(f1.is_ok() && f1->has_value());
  ASSERT_TRUE(f2.is_ok() && f2->has_value());
  EXPECT_EQ((*f2)->body["version"], 7);
}

TEST(FrameCodec, RefusesOversizeAtTheHeader) {
  DecoderLimits lim;
  lim.max_frame_bytes = 1024;
  FrameDecoder d(lim);
  uint8_t h[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 1, 0, 19, 0x04, 0x2c, 0x1d, 0x80};  // 70000000
  d.feed(h, sizeof h);
  auto f = d.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().message(), "frame: length 70000000 exceeds the limit of 1024 bytes");
  EXPECT_FALSE(d.next().is_ok()) << "a failed decoder stays failed";
}

TEST(FrameCodec, EncoderRefusesOversizeBody) {
  auto r = encode_frame(MsgType::kReply, Json{{"s", std::string(2000, 'x')}}, 1000);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("exceeds the limit of 1000 bytes"), std::string::npos);
}

TEST(FrameCodec, RefusesWrongMagicAtTheFirstByte) {
  FrameDecoder d;
  uint8_t b = 'G';  // "GET / HTTP/1.1"
  d.feed(&b, 1);
  auto f = d.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("bad magic byte 0"), std::string::npos) << f.status().message();
}

TEST(FrameCodec, RefusesWrongProtocolVersion) {
  auto bytes = frame_bytes(MsgType::kSubscribe, Json::object());
  bytes[5] = 9;
  FrameDecoder d;
  d.feed(bytes.data(), 6);
  auto f = d.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().message(), "frame: protocol version 9 is not supported (this build speaks version 1)");
}

TEST(FrameCodec, RefusesUnknownType) {
  auto bytes = frame_bytes(MsgType::kSubscribe, Json::object());
  bytes[7] = 77;
  FrameDecoder d;
  d.feed(bytes.data(), bytes.size());
  auto f = d.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().message(), "frame: unknown message type 77");
}

TEST(FrameCodec, RefusesDeepNestingWithoutRecursing) {
  // 100000 nested one-element arrays: 0x81 0x81 ... 0x00.
  std::vector<uint8_t> body(100000, 0x81);
  body.push_back(0x00);
  auto r = decode_body(body.data(), body.size(), BodyLimits{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("nesting deeper than 16 levels"), std::string::npos) << r.status().message();
}

TEST(FrameCodec, RefusesTooManyValuesAndLongStrings) {
  BodyLimits lim;
  lim.max_values = 10;
  auto many = Json::to_cbor(Json(std::vector<int>(100, 1)));
  auto r = decode_body(many.data(), many.size(), lim);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("more than 10 values"), std::string::npos);
  lim = BodyLimits{};
  lim.max_string_bytes = 8;
  auto s = Json::to_cbor(Json("a string longer than eight"));
  r = decode_body(s.data(), s.size(), lim);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("exceeds the limit of 8"), std::string::npos);
}

TEST(FrameCodec, RefusesDeclaredHugeArrayWithoutAllocating) {
  // Array header declaring 2^32-1 elements, then nothing.
  std::vector<uint8_t> body = {0x9a, 0xff, 0xff, 0xff, 0xff};
  auto r = decode_body(body.data(), body.size(), BodyLimits{});
  ASSERT_FALSE(r.is_ok());
}

TEST(FrameCodec, RefusesMalformedAndTrailingCbor) {
  std::vector<uint8_t> body = {0x01, 0x02};  // two values: trailing bytes in strict mode
  EXPECT_FALSE(decode_body(body.data(), body.size(), BodyLimits{}).is_ok());
  std::vector<uint8_t> cut = {0x63, 'a'};  // text of 3 bytes, 1 present
  EXPECT_FALSE(decode_body(cut.data(), cut.size(), BodyLimits{}).is_ok());
  std::vector<uint8_t> tag = {0xc1, 0x00};  // tagged value
  EXPECT_FALSE(decode_body(tag.data(), tag.size(), BodyLimits{}).is_ok());
}

TEST(FrameCodec, NeverCrashesOnRandomBytes) {
  std::mt19937_64 rng(42);
  int refused = 0;
  for (int round = 0; round < 20000; ++round) {
    DecoderLimits lim;
    lim.max_frame_bytes = 4096;
    FrameDecoder d(lim);
    // Half the rounds start with a valid header so the body parser is reached.
    std::vector<uint8_t> bytes(rng() % 200);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    if (round % 2 == 0) {
      uint8_t h[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 1, 0, 16, 0, 0, 0, static_cast<uint8_t>(bytes.size())};
      bytes.insert(bytes.begin(), h, h + kHeaderBytes);
    }
    size_t at = 0;
    while (at < bytes.size()) {
      size_t n = std::min<size_t>(1 + rng() % 17, bytes.size() - at);
      d.feed(bytes.data() + at, n);
      at += n;
      auto f = d.next();
      if (!f.is_ok()) {
        ++refused;
        break;
      }
    }
  }
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace refit::control
