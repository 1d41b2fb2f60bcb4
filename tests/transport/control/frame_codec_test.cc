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

// A body with members encoded beforehand (a plan part's runs and peers)
// makes the same bytes as the whole body encoded at once, whatever the
// keys' order and however many members the map holds (the CBOR map header
// grows a length byte past 23).
TEST(FrameCodec, SplicedMembersMakeTheSameFrameAsTheWholeBody) {
  std::vector<Json> bodies = {
      Json{{"ok", true}, {"version", 7}, {"epoch", 3}, {"plan", {{"network_bytes", 1}}}},
      Json::object(),
  };
  Json wide = Json::object();
  for (int i = 0; i < 30; ++i) wide["k" + std::to_string(i)] = i;
  bodies.push_back(wide);
  const Json runs = Json::array({{{"kind", "net"}, {"bytes", 64}}, {{"kind", "local"}, {"bytes", 1}}});
  const Json peers = {{"sources", Json::array({{{"rank", 0}, {"worker_address", Json::binary({1, 2})}}})}};
  const std::vector<uint8_t> runs_cbor = Json::to_cbor(runs), peers_cbor = Json::to_cbor(peers);
  for (const Json& small : bodies) {
    Json whole = small;
    whole["runs"] = runs;
    whole["peers"] = peers;
    auto expected = encode_frame(MsgType::kReply, whole, kDefaultMaxFrameBytes, 42);
    auto spliced = encode_frame_with(MsgType::kReply, small, {{"runs", &runs_cbor}, {"peers", &peers_cbor}},
                                     kDefaultMaxFrameBytes, 42);
    ASSERT_TRUE(expected.is_ok() && spliced.is_ok()) << spliced.status().message();
    EXPECT_EQ(*spliced, *expected) << small.dump();
  }
  // A member given twice, or also in the body, is a bug of the caller.
  EXPECT_FALSE(encode_frame_with(MsgType::kReply, Json{{"runs", 1}}, {{"runs", &runs_cbor}}).is_ok());
  EXPECT_FALSE(encode_frame_with(MsgType::kReply, Json::object(), {{"a", &runs_cbor}, {"a", &runs_cbor}}).is_ok());
  // The body's limit counts the spliced bytes.
  auto over = encode_frame_with(MsgType::kReply, Json::object(), {{"runs", &runs_cbor}},
                                static_cast<uint32_t>(runs_cbor.size()));
  ASSERT_FALSE(over.is_ok());
  EXPECT_NE(over.status().message().find("exceeds the limit"), std::string::npos) << over.status().message();
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
  uint8_t h[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 2, 0, 19, 0, 0, 0, 0, 0x04, 0x2c, 0x1d, 0x80};  // 70000000
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
  EXPECT_EQ(f.status().message(), "frame: protocol version 9 is not supported (this build speaks version 2)");
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
      uint8_t h[kHeaderBytes] = {'R', 'F', 'C', 'P', 0, 2, 0, 16, 0, 0, 0, 0, 0, 0, 0, static_cast<uint8_t>(bytes.size())};
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

// A text string is CBOR major type 3; nlohmann writes a std::string's bytes
// as they are, so invalid UTF-8 reaches the wire as a peer would send it.
TEST(FrameCodec, RefusesStringsAndKeysThatAreNotUtf8) {
  const std::string bad = "w\xff\xfe";
  for (const Json& body : {Json{{"tensors", Json::array({Json{{"name", bad}}})}}, Json{{bad, 1}},
                           Json{{"name", std::string("\xc0\xaf")}},           // overlong "/"
                           Json{{"name", std::string("\xed\xa0\x80")}},       // a surrogate
                           Json{{"name", std::string("\xf4\x90\x80\x80")}}}) {  // past U+10FFFF
    std::vector<uint8_t> cbor = Json::to_cbor(body);
    auto decoded = decode_body(cbor.data(), cbor.size(), BodyLimits{});
    ASSERT_FALSE(decoded.is_ok());
    EXPECT_NE(decoded.status().message().find("is not valid UTF-8"), std::string::npos) << decoded.status().message();
    auto bytes = frame_bytes(MsgType::kRegisterSource, body);
    FrameDecoder d;
    d.feed(bytes.data(), bytes.size());
    auto f = d.next();
    ASSERT_FALSE(f.is_ok());
    EXPECT_NE(f.status().message().find("frame: register_source: body: "), std::string::npos) << f.status().message();
  }
  for (const std::string good : {"w", "embed_tokens.weight", "\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80", ""}) {
    EXPECT_TRUE(valid_utf8(good)) << good;
    std::vector<uint8_t> cbor = Json::to_cbor(Json{{"name", good}});
    EXPECT_TRUE(decode_body(cbor.data(), cbor.size(), BodyLimits{}).is_ok()) << good;
  }
}

TEST(FrameCodec, CarriesTheRequestId) {
  auto bytes = encode_frame(MsgType::kHeartbeat, Json::object(), kDefaultMaxFrameBytes, 0xa1b2c3d4);
  ASSERT_TRUE(bytes.is_ok());
  FrameDecoder d;
  d.feed(bytes->data(), bytes->size());
  auto f = d.next();
  ASSERT_TRUE(f.is_ok() && f->has_value());
  EXPECT_EQ((*f)->id, 0xa1b2c3d4u);
}

Mac test_key(uint8_t seed) {
  Mac k{};
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(seed + i);
  return k;
}

std::vector<uint8_t> sealed_stream(FrameSealer& sealer, const std::vector<Json>& bodies) {
  std::vector<uint8_t> out;
  uint32_t id = 1;
  for (const Json& b : bodies) {
    auto bytes = encode_frame(MsgType::kHeartbeat, b, kDefaultMaxFrameBytes, id++);
    EXPECT_TRUE(bytes.is_ok());
    EXPECT_TRUE(sealer.seal(*bytes).is_ok());
    out.insert(out.end(), bytes->begin(), bytes->end());
  }
  return out;
}

TEST(FrameCodec, SealedFramesPassAndEveryFlippedBitFails) {
  const Json body = {{"role", "source"}, {"rank", 3}};
  FrameSealer sealer(test_key(1));
  const std::vector<uint8_t> one = sealed_stream(sealer, {body});
  ASSERT_EQ(one.size(), frame_bytes(MsgType::kHeartbeat, body).size() + kMacBytes);
  {
    FrameDecoder d;
    d.expect_seals(test_key(1));
    d.feed(one.data(), one.size());
    auto f = d.next();
    ASSERT_TRUE(f.is_ok() && f->has_value()) << f.status().message();
    EXPECT_EQ((*f)->body, body);
  }
  size_t failed = 0;
  for (size_t bit = 0; bit < one.size() * 8; ++bit) {
    std::vector<uint8_t> flipped = one;
    flipped[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    FrameDecoder d;
    d.expect_seals(test_key(1));
    d.feed(flipped.data(), flipped.size());
    auto f = d.next();
    // A flipped length bit leaves the decoder waiting for bytes that never
    // come (the connection's read deadline ends it); every other bit fails.
    if (!f.is_ok()) ++failed;
    else EXPECT_FALSE(f->has_value()) << "bit " << bit << " passed";
  }
  EXPECT_GE(failed, one.size() * 8 - 32);
  // Another key: fails.
  FrameDecoder other;
  other.expect_seals(test_key(2));
  other.feed(one.data(), one.size());
  auto f = other.next();
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find("fails its seal: it was altered, injected or replayed"), std::string::npos)
      << f.status().message();
}

TEST(FrameCodec, ReplayedOrDroppedSealedFramesFail) {
  FrameSealer sealer(test_key(5));
  std::vector<uint8_t> a = sealed_stream(sealer, {Json{{"n", 0}}});
  std::vector<uint8_t> b = sealed_stream(sealer, {Json{{"n", 1}}});
  std::vector<uint8_t> c = sealed_stream(sealer, {Json{{"n", 2}}});
  auto decode = [](const std::vector<std::vector<uint8_t>>& frames) {
    FrameDecoder d;
    d.expect_seals(test_key(5));
    int ok = 0;
    for (const auto& f : frames) {
      d.feed(f.data(), f.size());
      auto r = d.next();
      if (!r.is_ok()) return -ok - 1;
      if (r->has_value()) ++ok;
    }
    return ok;
  };
  EXPECT_EQ(decode({a, b, c}), 3);
  EXPECT_EQ(decode({a, b, b}), -3) << "a replayed frame fails";
  EXPECT_EQ(decode({a, a}), -2) << "a replayed frame fails";
  EXPECT_EQ(decode({a, c}), -2) << "after a dropped frame, the next fails";
  EXPECT_EQ(decode({b}), -1) << "a frame out of its place fails";
}

}  // namespace
}  // namespace refit::control
