// Conversion on the way through the real agents (docs/conversion.md, "At the
// receiver"): a BF16 and an F32 source, receivers that hold FP8 with block
// scales and BF16. Every byte a receiver holds is checked against the CPU
// kernels applied to what the source served (the reference quantizer), and
// the refusals leave the live weights as they were. Sources and receivers
// run in this one process against a coordinator embedded in it; the two
// receivers of one domain refresh on threads of their own.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "refit/refit.h"
#include "tools/bench/local_coordinator.h"
#include "transport/convert/convert.h"

extern char** environ;

namespace {

using nlohmann::json;

constexpr unsigned kTestSeconds = 55;
constexpr int64_t kRows = 256, kCols = 192, kBlock = 64;  // "w": 4 x 3 blocks of 64 x 64
constexpr int64_t kXRows = 64, kXCols = 32;               // "x": F32 cast to BF16
constexpr int64_t kSplitRow = 96;  // start_split_sources: the first source's rows of "w"
// Over the network with start_split_sources and receivers holding all:
// at the receiver, "w" in BF16 and "x" in F32; at the source ("quantize":
// "source"), the blocks of rows [0, 64) and [128, 256) (whole at one source)
// in FP8 with their 9 scales, block row 1 (cut at row 96) in BF16, and "x"
// cast to BF16.
constexpr int64_t kNetworkAtReceiver = kRows * kCols * 2 + kXRows * kXCols * 4;
constexpr int64_t kNetworkAtSource = 192 * kCols + 9 * 4 + 64 * kCols * 2 + kXRows * kXCols * 2;
// What a receiver holding everything verifies: "w" in FP8, its scales, "x" in BF16.
constexpr int64_t kFullVerifyBytes = kRows * kCols + (kRows / kBlock) * (kCols / kBlock) * 4 + kXRows * kXCols * 2;

uint16_t bf16_bits(float f) {  // truncation: any BF16 value will do as a source
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// BF16 values of block-dependent magnitude: one block all zeros, one far
// past E4M3's range, one of tiny values, the rest around 1.
std::vector<uint16_t> weights(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> w(kRows * kCols);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const int64_t block = (r / kBlock) * (kCols / kBlock) + c / kBlock;
      const float scale = block == 1 ? 0.0f : block == 4 ? 3.0e6f : block == 7 ? 1.0e-6f : 1.0f;
      w[r * kCols + c] = bf16_bits(normal(rng) * scale);
    }
  }
  return w;
}

std::vector<float> cast_source(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  std::vector<float> x(kXRows * kXCols);
  for (float& v : x) v = u(rng);
  return x;
}

class Convert : public ::testing::Test {
 protected:
  void SetUp() override {
    ::alarm(kTestSeconds);
    auto c = refit::bench::LocalCoordinator::start();
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    coordinator_ = std::move(*c);
  }
  void TearDown() override {
    for (refit_receiver_t* r : receivers_) refit_receiver_destroy(r);
    refit_source_destroy(source_);
    refit_source_destroy(source1_);
    coordinator_.reset();
    ::alarm(0);
  }

  json config(int rank, bool receiver) const {
    json c = {{"rank", rank},
              {"coordinator",
               {{"address", coordinator_->address()}, {"token_file", coordinator_->token_file()}, {"timeout_ms", 5000}}},
              {"network", {{"transports", {"tcp"}}, {"devices", {"lo"}}}}};
    if (receiver) {
      c["local"] = {{"transports", {"shm"}}};
      c["weight_block_size"] = {kBlock, kBlock};
    }
    c["verify"] = true;
    return c;
  }

  // The source: "w" BF16 and "x" F32, both whole.
  void start_source() {
    ASSERT_EQ(refit_source_create(config(0, false).dump().c_str(), &source_), REFIT_OK) << refit_last_error();
    w_ = weights(1);
    x_ = cast_source(2);
    const json w = {{"name", "w"}, {"dtype", "BF16"}, {"shape", {kRows, kCols}},
                    {"segments", {{{"start", {0, 0}}, {"size", {kRows, kCols}}, {"offset", 0}, {"strides", {kCols, 1}}}}}};
    ASSERT_EQ(refit_source_add_tensor(source_, w.dump().c_str(), w_.data(), w_.size() * 2), REFIT_OK)
        << refit_last_error();
    const json x = {{"name", "x"}, {"dtype", "F32"}, {"shape", {kXRows, kXCols}},
                    {"segments", {{{"start", {0, 0}}, {"size", {kXRows, kXCols}}, {"offset", 0}, {"strides", {kXCols, 1}}}}}};
    ASSERT_EQ(refit_source_add_tensor(source_, x.dump().c_str(), x_.data(), x_.size() * 4), REFIT_OK)
        << refit_last_error();
    ASSERT_EQ(refit_source_join(source_), REFIT_OK) << refit_last_error();
  }

  struct Held {  // what one receiver registered
    std::vector<uint8_t> w;      // F8_E4M3 [kRows, kCols]
    std::vector<float> scales;   // [kRows / kBlock, kCols / kBlock]
    std::vector<uint16_t> x;     // BF16 [kXRows, kXCols]
  };

  // A receiver holding all of "w" as FP8 with its scales, and "x" as BF16.
  // `cuts`: "w" as segments of its buffer cut at these rows ({128}: rows
  // [0, 128) and [128, 256)), so that the plan converts it as that many
  // units.
  refit_receiver_t* add_receiver(int rank, Held* held, json extra = json::object(), std::vector<int64_t> cuts = {}) {
    json c = config(rank, true);
    c.update(extra);
    refit_receiver_t* r = nullptr;
    EXPECT_EQ(refit_receiver_create(c.dump().c_str(), &r), REFIT_OK) << refit_last_error();
    if (!r) return nullptr;
    receivers_.push_back(r);
    held->w.assign(kRows * kCols, 0x55);
    held->scales.assign((kRows / kBlock) * (kCols / kBlock), -1.0f);
    held->x.assign(kXRows * kXCols, 0x5555);
    json w = {{"name", "w"}, {"dtype", "F8_E4M3"},
              {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {kRows, kCols}}, {"offset", 0},
                             {"strides", {kCols, 1}}}}}};
    if (!cuts.empty()) {
      cuts.push_back(kRows);
      w["segments"] = json::array();
      for (size_t i = 0, lo = 0; i < cuts.size(); lo = cuts[i++]) {
        w["segments"].push_back({{"tensor", "w"}, {"start", {lo, 0}}, {"size", {cuts[i] - static_cast<int64_t>(lo), kCols}},
                                 {"offset", static_cast<int64_t>(lo) * kCols}, {"strides", {kCols, 1}}});
      }
    }
    const json s = {{"name", "w_scale_inv"}, {"dtype", "F32"},
                    {"segments", {{{"tensor", "w_scale_inv"}, {"start", {0, 0}}, {"size", {kRows / kBlock, kCols / kBlock}},
                                   {"offset", 0}, {"strides", {kCols / kBlock, 1}}}}}};
    const json x = {{"name", "x"}, {"dtype", "BF16"},
                    {"segments", {{{"tensor", "x"}, {"start", {0, 0}}, {"size", {kXRows, kXCols}}, {"offset", 0},
                                   {"strides", {kXCols, 1}}}}}};
    EXPECT_EQ(refit_receiver_add_buffer(r, w.dump().c_str(), held->w.data(), held->w.size()), REFIT_OK)
        << refit_last_error();
    EXPECT_EQ(refit_receiver_add_buffer(r, s.dump().c_str(), held->scales.data(), held->scales.size() * 4), REFIT_OK)
        << refit_last_error();
    EXPECT_EQ(refit_receiver_add_buffer(r, x.dump().c_str(), held->x.data(), held->x.size() * 2), REFIT_OK)
        << refit_last_error();
    return r;
  }

  // Two sources: rank 0 holds rows [0, kSplitRow) of "w" and all of "x",
  // rank 1 the rest of "w"; `extra` goes into both configs.
  void start_split_sources(const json& extra) {
    w_ = weights(1);
    x_ = cast_source(2);
    refit_source_t** agents[2] = {&source_, &source1_};
    for (int rank = 0; rank < 2; ++rank) {
      json c = config(rank, false);
      c.update(extra);
      ASSERT_EQ(refit_source_create(c.dump().c_str(), agents[rank]), REFIT_OK) << refit_last_error();
      const int64_t lo = rank == 0 ? 0 : kSplitRow, rows = rank == 0 ? kSplitRow : kRows - kSplitRow;
      const json w = {{"name", "w"}, {"dtype", "BF16"}, {"shape", {kRows, kCols}},
                      {"segments", {{{"start", {lo, 0}}, {"size", {rows, kCols}}, {"offset", 0}, {"strides", {kCols, 1}}}}}};
      ASSERT_EQ(refit_source_add_tensor(*agents[rank], w.dump().c_str(), w_.data() + lo * kCols, rows * kCols * 2),
                REFIT_OK)
          << refit_last_error();
      if (rank == 0) {
        const json x = {{"name", "x"}, {"dtype", "F32"}, {"shape", {kXRows, kXCols}},
                        {"segments", {{{"start", {0, 0}}, {"size", {kXRows, kXCols}}, {"offset", 0}, {"strides", {kXCols, 1}}}}}};
        ASSERT_EQ(refit_source_add_tensor(source_, x.dump().c_str(), x_.data(), x_.size() * 4), REFIT_OK)
            << refit_last_error();
      }
      ASSERT_EQ(refit_source_join(*agents[rank]), REFIT_OK) << refit_last_error();
    }
  }

  // Both sources publish `version`, then receivers r0 and r1 refresh to it
  // at once; the reports of both.
  std::pair<json, json> publish_and_refresh(refit_receiver_t* r0, refit_receiver_t* r1, int64_t version) {
    EXPECT_EQ(refit_source_publish(source_, version), REFIT_OK) << refit_last_error();
    if (source1_) {
      EXPECT_EQ(refit_source_publish(source1_, version), REFIT_OK) << refit_last_error();
    }
    auto other = std::async(std::launch::async, [&] {
      refit_status_t s = refit_receiver_refresh(r1, version, 20000);
      return std::make_pair(s, std::string(s == REFIT_OK ? "" : refit_last_error()));
    });
    const refit_status_t s0 = refit_receiver_refresh(r0, version, 20000);
    const std::string e0 = s0 == REFIT_OK ? "" : refit_last_error();
    const auto [s1, e1] = other.get();
    EXPECT_EQ(s0, REFIT_OK) << e0;
    EXPECT_EQ(s1, REFIT_OK) << e1;
    return {json::parse(refit_receiver_report(r0)), json::parse(refit_receiver_report(r1))};
  }

  // New contents for the source's tensors, in place: it serves them from
  // where they were registered.
  void set_weights(const std::vector<uint16_t>& w, const std::vector<float>& x) {
    std::copy(w.begin(), w.end(), w_.begin());
    std::copy(x.begin(), x.end(), x_.begin());
  }

  // What a receiver should hold: the CPU kernels applied to the source.
  Held expected() const {
    Held e;
    e.w.assign(kRows * kCols, 0);
    e.scales.assign((kRows / kBlock) * (kCols / kBlock), 0.0f);
    e.x.assign(kXRows * kXCols, 0);
    refit::convert::QuantizeArgs a;
    a.src_dtype = refit::DType::kBF16;
    a.src = w_.data();
    a.src_stride = kCols;
    a.rows = kRows;
    a.cols = kCols;
    a.dst = e.w.data();
    a.dst_stride = kCols;
    a.scales = e.scales.data();
    a.scale_stride = kCols / kBlock;
    a.block = {kBlock, kBlock};
    a.tensor = "w";
    EXPECT_TRUE(refit::convert::quantize_e4m3_blocks(a).is_ok());
    EXPECT_TRUE(refit::convert::cast(refit::DType::kF32, refit::DType::kBF16, x_.data(), e.x.data(),
                                     static_cast<int64_t>(x_.size()), "x")
                    .is_ok());
    return e;
  }

  static void expect_holds(const Held& got, const Held& want, const std::string& who) {
    size_t differ = 0;
    for (size_t i = 0; i < want.w.size(); ++i) differ += got.w[i] != want.w[i];
    EXPECT_EQ(differ, 0u) << who << ": bytes of \"w\" differ from the reference quantizer";
    EXPECT_EQ(std::memcmp(got.scales.data(), want.scales.data(), want.scales.size() * 4), 0)
        << who << ": the scales of \"w\" differ";
    EXPECT_EQ(std::memcmp(got.x.data(), want.x.data(), want.x.size() * 2), 0) << who << ": \"x\" differs";
  }

  std::unique_ptr<refit::bench::LocalCoordinator> coordinator_;
  refit_source_t* source_ = nullptr;
  refit_source_t* source1_ = nullptr;  // start_split_sources' second source
  std::vector<refit_receiver_t*> receivers_;
  std::vector<uint16_t> w_;
  std::vector<float> x_;
};

// Two receivers of one domain, each holding everything: one pulls each unit
// in the sources' dtype, converts it and passes FP8 and scales to the other.
TEST_F(Convert, ReceiversOfADomainHoldTheReferenceQuantization) {
  start_source();
  Held held[2];
  refit_receiver_t* r0 = add_receiver(0, &held[0]);
  refit_receiver_t* r1 = add_receiver(1, &held[1]);
  ASSERT_TRUE(r0 && r1);
  ASSERT_EQ(refit_receiver_join(r0), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_join(r1), REFIT_OK) << refit_last_error();
  for (int64_t version = 1; version <= 3; ++version) {
    if (version > 1) {  // new weights for each version
      set_weights(weights(static_cast<uint32_t>(10 + version)), cast_source(static_cast<uint32_t>(20 + version)));
    }
    ASSERT_EQ(refit_source_publish(source_, version), REFIT_OK) << refit_last_error();
    auto other = std::async(std::launch::async, [&] {
      refit_status_t s = refit_receiver_refresh(r1, version, 20000);
      return std::make_pair(s, std::string(s == REFIT_OK ? "" : refit_last_error()));
    });
    const refit_status_t s0 = refit_receiver_refresh(r0, version, 20000);
    const std::string e0 = s0 == REFIT_OK ? "" : refit_last_error();
    const auto [s1, e1] = other.get();
    ASSERT_EQ(s0, REFIT_OK) << e0;
    ASSERT_EQ(s1, REFIT_OK) << e1;
    const Held want = expected();
    expect_holds(held[0], want, "receiver 0, version " + std::to_string(version));
    expect_holds(held[1], want, "receiver 1, version " + std::to_string(version));
    // Exactly one of them converted each unit, and the other received the
    // converted bytes over the local fabric.
    const json rep0 = json::parse(refit_receiver_report(r0));
    const json rep1 = json::parse(refit_receiver_report(r1));
    EXPECT_EQ(rep0["converts"]["units"].get<int>() + rep1["converts"]["units"].get<int>(), 2)
        << rep0.dump() << "\n" << rep1.dump();
    // "verify": the source hashed the converted bytes and the block scales
    // it computed; each receiver checked all of "w" (FP8), its scales (F32)
    // and "x" (BF16) against them.
    for (const json& rep : {rep0, rep1}) {
      EXPECT_EQ(rep["verify"]["boxes"].get<int64_t>(), 3) << rep.dump();
      EXPECT_EQ(rep["verify"]["bytes"].get<int64_t>(), kFullVerifyBytes) << rep.dump();
      EXPECT_EQ(rep["verify"]["unverified_bytes"].get<int64_t>(), 0) << rep.dump();
    }
  }
}

// "quantize": "source" (docs/conversion.md, "At the source"), with "w" split
// between two sources at row 96 and receivers whose segments of "w" are
// rows [0, 64), [64, 128) and [128, 256): the units of rows [0, 64) and
// [128, 256) are whole blocks at one source and cross as FP8 with their
// scales, the unit of block row 1 is cut by the sources and crosses as BF16
// for its puller to quantize, and "x" is cast at its source. Every byte and
// scale is the CPU kernels' on what the sources served, for 3 versions.
TEST_F(Convert, QuantizedAtTheSourceTheNetworkCarriesFp8) {
  start_split_sources({{"quantize", "source"}});
  Held held[2];
  refit_receiver_t* r0 = add_receiver(0, &held[0], json::object(), {64, 128});
  refit_receiver_t* r1 = add_receiver(1, &held[1], json::object(), {64, 128});
  ASSERT_TRUE(r0 && r1);
  ASSERT_EQ(refit_receiver_join(r0), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_join(r1), REFIT_OK) << refit_last_error();
  for (int64_t version = 1; version <= 3; ++version) {
    if (version > 1) set_weights(weights(static_cast<uint32_t>(10 + version)), cast_source(static_cast<uint32_t>(20 + version)));
    const auto [rep0, rep1] = publish_and_refresh(r0, r1, version);
    const Held want = expected();
    expect_holds(held[0], want, "receiver 0, version " + std::to_string(version));
    expect_holds(held[1], want, "receiver 1, version " + std::to_string(version));
    EXPECT_EQ(rep0["network_bytes"].get<int64_t>() + rep1["network_bytes"].get<int64_t>(), kNetworkAtSource)
        << rep0.dump() << "\n" << rep1.dump();
    // Only the unit of block row 1 is quantized by a receiver.
    EXPECT_EQ(rep0["converts"]["units"].get<int>() + rep1["converts"]["units"].get<int>(), 1)
        << rep0.dump() << "\n" << rep1.dump();
    // Verified: "x" and the FP8 bytes and scales of the whole blocks; block
    // row 1, which no one source holds, has no hash (docs/conversion.md).
    for (const json& rep : {rep0, rep1}) {
      EXPECT_EQ(rep["verify"]["bytes"].get<int64_t>(), 192 * kCols + 9 * 4 + kXRows * kXCols * 2) << rep.dump();
      EXPECT_EQ(rep["verify"]["unverified_bytes"].get<int64_t>(), 64 * kCols + 3 * 4) << rep.dump();
    }
  }
}

// The same layout converted at the receivers: the network carries BF16 and F32.
TEST_F(Convert, QuantizedAtTheReceiverTheNetworkCarriesTheSourcesDtype) {
  start_split_sources(json::object());
  Held held[2];
  refit_receiver_t* r0 = add_receiver(0, &held[0], json::object(), {64, 128});
  refit_receiver_t* r1 = add_receiver(1, &held[1], json::object(), {64, 128});
  ASSERT_TRUE(r0 && r1);
  ASSERT_EQ(refit_receiver_join(r0), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_join(r1), REFIT_OK) << refit_last_error();
  const auto [rep0, rep1] = publish_and_refresh(r0, r1, 1);
  expect_holds(held[0], expected(), "receiver 0");
  expect_holds(held[1], expected(), "receiver 1");
  EXPECT_EQ(rep0["network_bytes"].get<int64_t>() + rep1["network_bytes"].get<int64_t>(), kNetworkAtReceiver);
  EXPECT_EQ(rep0["converts"]["units"].get<int>() + rep1["converts"]["units"].get<int>(), 4);
  static_assert(kNetworkAtSource < kNetworkAtReceiver);
}

// NaN in a block a source holds whole, with "quantize": "source": that
// source serves the version of "w" unconverted (it logs the tensor and the
// block), the receiver's own quantization refuses it naming the block, and
// a staged receiver keeps version 1. Version 3, finite again, crosses as
// FP8 again and lands in full.
TEST_F(Convert, NaNAtTheSourceServesUnconvertedAndTheReceiverRefuses) {
  static std::mutex mu;
  static std::string warnings;
  refit_set_log_callback(
      [](refit_log_level_t, const char* line, void*) {
        std::lock_guard<std::mutex> lock(mu);
        warnings += std::string(line) + "\n";
      },
      nullptr);
  start_split_sources({{"quantize", "source"}});
  Held held;
  refit_receiver_t* r = add_receiver(0, &held, {{"mode", "staged"}}, {64, 128});
  ASSERT_TRUE(r);
  ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(source1_, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 1, 20000), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_commit(r), REFIT_OK) << refit_last_error();
  expect_holds(held, expected(), "version 1");
  const Held before = held;
  set_weights(weights(12), cast_source(22));
  w_[200 * kCols + 130] = bf16_bits(std::nanf(""));  // row 200, column 130: block (3, 2), whole at source 1
  ASSERT_EQ(refit_source_publish(source_, 2), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(source1_, 2), REFIT_OK) << refit_last_error();
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_NE(warnings.find("not serving a converted copy of tensor \"w\""), std::string::npos) << warnings;
    EXPECT_NE(warnings.find("(3, 2)"), std::string::npos) << warnings;
  }
  const refit_status_t s = refit_receiver_refresh(r, 2, 5000);
  const std::string error = refit_last_error();
  EXPECT_EQ(s, REFIT_INVALID_ARGUMENT) << refit_status_name(s) << ": " << error;
  EXPECT_NE(error.find("\"w\""), std::string::npos) << error;
  EXPECT_NE(error.find("(3, 2)"), std::string::npos) << error;
  EXPECT_EQ(refit_receiver_version(r), 1);
  EXPECT_EQ(held.w, before.w) << "the live FP8 weights changed";
  EXPECT_EQ(std::memcmp(held.scales.data(), before.scales.data(), before.scales.size() * 4), 0);

  set_weights(weights(13), cast_source(23));
  ASSERT_EQ(refit_source_publish(source_, 3), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_source_publish(source1_, 3), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 3, 20000), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_commit(r), REFIT_OK) << refit_last_error();
  expect_holds(held, expected(), "version 3");
  const json rep = json::parse(refit_receiver_report(r));
  EXPECT_EQ(rep["network_bytes"].get<int64_t>(), kNetworkAtSource) << rep.dump();
  refit_set_log_callback(nullptr, nullptr);
}

// NaN in a block of a new version: the refresh fails naming the tensor and
// the block, and a staged receiver keeps the version it had.
TEST_F(Convert, NaNInASourceBlockFailsAndStagedKeepsTheOldVersion) {
  start_source();
  Held held;
  refit_receiver_t* r = add_receiver(0, &held, {{"mode", "staged"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 1, 20000), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_commit(r), REFIT_OK) << refit_last_error();
  const Held first = expected();
  expect_holds(held, first, "version 1");
  const Held before = held;
  w_[70 * kCols + 130] = bf16_bits(std::nanf(""));  // row 70, column 130: block (1, 2)
  ASSERT_EQ(refit_source_publish(source_, 2), REFIT_OK) << refit_last_error();
  const refit_status_t s = refit_receiver_refresh(r, 2, 5000);
  const std::string error = refit_last_error();
  EXPECT_EQ(s, REFIT_INVALID_ARGUMENT) << refit_status_name(s);
  EXPECT_NE(error.find("\"w\""), std::string::npos) << error;
  EXPECT_NE(error.find("(1, 2)"), std::string::npos) << error;
  EXPECT_EQ(refit_receiver_version(r), 1);
  EXPECT_EQ(held.w, before.w) << "the live FP8 weights changed";
  EXPECT_EQ(std::memcmp(held.scales.data(), before.scales.data(), before.scales.size() * 4), 0);
}

// NaN in a block of a new version in direct mode (docs/conversion.md, "A
// refusal"): the refresh fails naming the tensor and the block; the refused
// unit (rows [128, 256) of "w", which hold block (3, 2)) and its scales are
// as they were, a unit converted before it holds the new version, and the
// receiver holds no version until a refresh succeeds, which version 3 does.
TEST_F(Convert, NaNInASourceBlockFailsAndDirectKeepsTheRefusedUnit) {
  start_source();
  Held held;
  refit_receiver_t* r = add_receiver(0, &held, json::object(), {kRows / 2});
  ASSERT_TRUE(r);
  ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 1, 20000), REFIT_OK) << refit_last_error();
  const Held first = expected();
  expect_holds(held, first, "version 1");
  const json rep1 = json::parse(refit_receiver_report(r));
  EXPECT_EQ(rep1["mode"], "direct") << rep1.dump();
  EXPECT_EQ(rep1["converts"]["units"], 3) << "two units of \"w\" and \"x\": " << rep1.dump();

  set_weights(weights(12), cast_source(22));
  const Held second = expected();
  w_[200 * kCols + 130] = bf16_bits(std::nanf(""));  // row 200, column 130: block (3, 2)
  ASSERT_EQ(refit_source_publish(source_, 2), REFIT_OK) << refit_last_error();
  const refit_status_t s = refit_receiver_refresh(r, 2, 5000);
  const std::string error = refit_last_error();
  EXPECT_EQ(s, REFIT_INVALID_ARGUMENT) << refit_status_name(s) << ": " << error;
  EXPECT_NE(error.find("\"w\""), std::string::npos) << error;
  EXPECT_NE(error.find("(3, 2)"), std::string::npos) << error;
  EXPECT_EQ(refit_receiver_version(r), 0);
  // The refused unit: FP8 bytes of rows [128, 256) and block rows 2 and 3
  // of the scales, as version 1 left them.
  const size_t half = kRows / 2 * kCols, scale_half = (kRows / kBlock / 2) * (kCols / kBlock);
  auto same = [](const auto* got, const auto* want, size_t n) { return std::memcmp(got, want, n * sizeof *got) == 0; };
  EXPECT_TRUE(same(held.w.data() + half, first.w.data() + half, half)) << "the refused unit was written";
  EXPECT_TRUE(same(held.scales.data() + scale_half, first.scales.data() + scale_half, scale_half))
      << "the refused unit's scales were written";
  // The other units: each wholly of version 2 (converted before the
  // refusal) or of version 1 (not reached), never a mix. The order of the
  // units is not promised (so far rows [0, 128) come first, and "x" after
  // the refused unit).
  const bool top_2 = same(held.w.data(), second.w.data(), half) && same(held.scales.data(), second.scales.data(), scale_half);
  const bool top_1 = same(held.w.data(), first.w.data(), half) && same(held.scales.data(), first.scales.data(), scale_half);
  EXPECT_TRUE(top_2 || top_1) << "rows [0, 128) of \"w\" and their scales are neither version";
  EXPECT_TRUE(held.x == second.x || held.x == first.x) << "\"x\" is neither version";

  // A version without NaN refreshes and verifies every byte.
  set_weights(weights(13), cast_source(23));
  ASSERT_EQ(refit_source_publish(source_, 3), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 3, 20000), REFIT_OK) << refit_last_error();
  expect_holds(held, expected(), "version 3");
  EXPECT_EQ(refit_receiver_version(r), 3);
  const json rep3 = json::parse(refit_receiver_report(r));
  EXPECT_EQ(rep3["verify"]["bytes"].get<int64_t>(), kFullVerifyBytes) << rep3.dump();
  EXPECT_EQ(rep3["verify"]["unverified_bytes"].get<int64_t>(), 0) << rep3.dump();
}

// Scales unlike the ones the source computed fail verification, naming the
// scale tensor. The source serves its weights in place and doubles block
// (0, 0) of "w" after publishing: x * 2 * (1 / (scale * 2)) is x / scale
// exactly, so every FP8 byte the receiver computes is still the one hashed
// and only that block's scale differs: only the scales can tell.
TEST_F(Convert, ScalesUnlikeThePublishedOnesFailVerification) {
  start_source();
  Held held;
  refit_receiver_t* r = add_receiver(0, &held);
  ASSERT_TRUE(r);
  ASSERT_EQ(refit_source_publish(source_, 1), REFIT_OK) << refit_last_error();
  ASSERT_EQ(refit_receiver_refresh(r, 1, 20000), REFIT_OK) << refit_last_error();
  set_weights(weights(12), cast_source(22));
  ASSERT_EQ(refit_source_publish(source_, 2), REFIT_OK) << refit_last_error();
  const Held published = expected();
  for (int64_t row = 0; row < kBlock; ++row) {
    for (int64_t col = 0; col < kBlock; ++col) w_[row * kCols + col] = bf16_bits(2.0f * bf16_value(w_[row * kCols + col]));
  }
  const refit_status_t s = refit_receiver_refresh(r, 2, 5000);
  const std::string error = refit_last_error();
  EXPECT_EQ(s, REFIT_VERIFY_FAILED) << refit_status_name(s) << ": " << error;
  EXPECT_NE(error.find("tensor \"w_scale_inv\""), std::string::npos) << error;
  // What landed: the FP8 bytes that were hashed, and block (0, 0)'s scale doubled.
  EXPECT_EQ(held.w, published.w);
  EXPECT_EQ(held.scales[0], 2.0f * published.scales[0]);
  EXPECT_EQ(std::memcmp(held.scales.data() + 1, published.scales.data() + 1, (held.scales.size() - 1) * 4), 0);
}

// A receiver that quantizes without registering the scales is refused at
// join, naming the scale tensor.
TEST_F(Convert, QuantizedTensorWithoutItsScalesIsRefused) {
  start_source();
  refit_receiver_t* r = nullptr;
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &r), REFIT_OK) << refit_last_error();
  receivers_.push_back(r);
  std::vector<uint8_t> w(kRows * kCols);
  const json b = {{"name", "w"}, {"dtype", "F8_E4M3"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {kRows, kCols}}, {"offset", 0},
                                 {"strides", {kCols, 1}}}}}};
  ASSERT_EQ(refit_receiver_add_buffer(r, b.dump().c_str(), w.data(), w.size()), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_join(r), REFIT_INVALID_ARGUMENT);
  EXPECT_NE(std::string(refit_last_error()).find("w_scale_inv"), std::string::npos) << refit_last_error();
}

// BF16 to an integer dtype is no conversion refit does: refused at join.
TEST_F(Convert, UnsupportedConversionIsRefused) {
  start_source();
  refit_receiver_t* r = nullptr;
  ASSERT_EQ(refit_receiver_create(config(0, true).dump().c_str(), &r), REFIT_OK) << refit_last_error();
  receivers_.push_back(r);
  std::vector<uint8_t> w(kRows * kCols * 4);
  const json b = {{"name", "w"}, {"dtype", "I32"},
                  {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {kRows, kCols}}, {"offset", 0},
                                 {"strides", {kCols, 1}}}}}};
  ASSERT_EQ(refit_receiver_add_buffer(r, b.dump().c_str(), w.data(), w.size()), REFIT_OK) << refit_last_error();
  EXPECT_EQ(refit_receiver_join(r), REFIT_INVALID_ARGUMENT);
  const std::string error = refit_last_error();
  EXPECT_NE(error.find("\"w\""), std::string::npos) << error;
  EXPECT_NE(error.find("I32"), std::string::npos) << error;
}

// refit-bench on the shipped FP8 scenario (small-moe BF16 to small-moe-fp8):
// every receiver byte, FP8 values and block scales, checked against the CPU
// kernels applied to the sources' pattern, for 2 versions; `source_config`
// goes to refit-bench's --source-config. The JSON row of the refit strategy.
json run_fp8_bench(const std::string& source_config) {
  std::string dir = (std::filesystem::temp_directory_path() / "refit-convert-XXXXXX").string();
  EXPECT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string out_json = dir + "/out.json", log = dir + "/log.txt";
  const std::string root = REFIT_SOURCE_ROOT;
  std::vector<std::string> argv = {REFIT_BENCH, "--scenario", root + "/examples/scenarios/moe-bf16-to-fp8.json",
                                   "--models", root + "/examples/models", "--versions", "2", "--timeout", "20",
                                   "--source-config", source_config, "--json", out_json};
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ), 0) << argv[0];
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (pid > 0 && ::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    ::usleep(10000);
  }
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << text;
  std::ifstream j(out_json);
  const json doc = json::parse(j, nullptr, false);
  std::filesystem::remove_all(dir);
  if (doc.is_discarded() || doc["results"].size() != 1u) {  // refit alone: the baselines do not convert
    ADD_FAILURE() << text << doc.dump();
    return json::object();
  }
  return doc["results"][0];
}

TEST_F(Convert, RefitBenchVerifiesTheFp8Scenario) {
  const json at_receiver = run_fp8_bench("{}");
  const json at_source = run_fp8_bench(R"({"quantize": "source"})");
  for (const json& row : {at_receiver, at_source}) {
    EXPECT_EQ(row.value("strategy", ""), "refit") << row.dump();
    EXPECT_EQ(row.value("verified", false), true) << row.dump();
    EXPECT_EQ(row.value("completed", 0), 2) << row.dump();
  }
  // At the receiver the fan-out carries FP8: less than the BF16 the network
  // brings. At the source the network carries FP8 where a source holds
  // whole blocks: what refit-plan counts as convert_at_source_network_bytes.
  EXPECT_LT(at_receiver.value("local_bytes", int64_t{0}), at_receiver.value("network_bytes", int64_t{0}));
  EXPECT_LT(at_source.value("network_bytes", int64_t{0}), at_receiver.value("network_bytes", int64_t{0}))
      << at_source.dump() << "\n" << at_receiver.dump();
}

}  // namespace
