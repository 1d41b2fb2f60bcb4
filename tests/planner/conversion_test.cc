// Dtype conversion on the way (planner/conversion.h): which conversions refit
// does and refuses, the layout file's receiver buffers of another dtype, the
// derived scale tensor, the whole-block rule, and the bytes each side moves.

#include "planner/conversion.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "planner/layout_json.h"
#include "planner/plan.h"

namespace refit {
namespace {

using nlohmann::json;

TEST(ConversionFor, SupportedPairs) {
  EXPECT_EQ(*conversion_for("w", DType::kBF16, DType::kBF16), ConversionKind::kNone);
  EXPECT_EQ(*conversion_for("w", DType::kF32, DType::kBF16), ConversionKind::kCast);
  EXPECT_EQ(*conversion_for("w", DType::kF32, DType::kF16), ConversionKind::kCast);
  EXPECT_EQ(*conversion_for("w", DType::kBF16, DType::kF16), ConversionKind::kCast);
  EXPECT_EQ(*conversion_for("w", DType::kBF16, DType::kF8E4M3), ConversionKind::kQuantizeE4M3);
  EXPECT_EQ(*conversion_for("w", DType::kF32, DType::kF8E4M3), ConversionKind::kQuantizeE4M3);
}

TEST(ConversionFor, RefusesNamingTheTensor) {
  auto fp8 = conversion_for("layers.0.w", DType::kF8E4M3, DType::kBF16);
  ASSERT_FALSE(fp8.is_ok());
  EXPECT_EQ(fp8.status().code(), Code::kUnsupported);
  EXPECT_NE(fp8.status().message().find("\"layers.0.w\""), std::string::npos) << fp8.status().message();
  EXPECT_NE(fp8.status().message().find("dequantize"), std::string::npos) << fp8.status().message();
  for (auto [from, to] : {std::pair{DType::kI32, DType::kF32}, std::pair{DType::kBF16, DType::kI8},
                          std::pair{DType::kBool, DType::kU8}, std::pair{DType::kBF16, DType::kF8E5M2},
                          std::pair{DType::kF16, DType::kBF16}, std::pair{DType::kBF16, DType::kF32}}) {
    auto r = conversion_for("t", from, to);
    ASSERT_FALSE(r.is_ok()) << dtype_name(from) << " -> " << dtype_name(to);
    EXPECT_NE(r.status().message().find(std::string(dtype_name(from))), std::string::npos) << r.status().message();
  }
}

TEST(ScaleShape, RoundsPartialBlocksUp) {
  EXPECT_EQ(scale_shape({576, 7168}, {128, 128}), (std::vector<int64_t>{5, 56}));
  EXPECT_EQ(scale_shape({384, 2048, 7168}, {128, 128}), (std::vector<int64_t>{384, 16, 56}));
  EXPECT_EQ(scale_shape({256, 384}, {64, 128}), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(scale_tensor_name("model.layers.0.mlp.down_proj.weight"), "model.layers.0.mlp.down_proj.weight_scale_inv");
}

// A BF16 weight [256, 384] on two source ranks (rows split in two) to two
// receiver ranks of one domain, each holding all of it in F8_E4M3 with its
// 2 x 3 F32 scales; a BF16 norm that stays BF16.
json fp8_layout() {
  return json::parse(R"J({"format": "refit-layout/1",
     "weight_block_size": [128, 128],
     "sources":   [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0}],
     "tensors": [
       {"name": "w.weight", "dtype": "BF16", "shape": [256, 384],
        "source": {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}},
       {"name": "w.weight_scale_inv", "dtype": "F32", "shape": [2, 3]},
       {"name": "norm", "dtype": "BF16", "shape": [384],
        "source": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]},
        "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}],
     "buffers": [
       {"side": "receiver", "rank": 0, "name": "w", "dtype": "F8_E4M3", "bytes": 98304,
        "segments": [{"tensor": "w.weight", "start": [0, 0], "size": [256, 384], "offset": 0, "strides": [384, 1]}]},
       {"side": "receiver", "rank": 1, "name": "w", "dtype": "F8_E4M3", "bytes": 98304,
        "segments": [{"tensor": "w.weight", "start": [0, 0], "size": [256, 384], "offset": 0, "strides": [384, 1]}]},
       {"side": "receiver", "rank": 0, "name": "w_scale_inv", "dtype": "F32", "bytes": 24,
        "segments": [{"tensor": "w.weight_scale_inv", "start": [0, 0], "size": [2, 3], "offset": 0, "strides": [3, 1]}]},
       {"side": "receiver", "rank": 1, "name": "w_scale_inv", "dtype": "F32", "bytes": 24,
        "segments": [{"tensor": "w.weight_scale_inv", "start": [0, 0], "size": [2, 3], "offset": 0, "strides": [3, 1]}]}
     ]})J");
}

Result<Layout> parse(const json& j) { return parse_layout_json(j.dump(), "fp8.json"); }

TEST(ConversionLayout, ReceiverBuffersDeclareTheirDtype) {
  auto L = parse(fp8_layout());
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  const Tensor& w = L->tensors[L->find_tensor("w.weight")];
  EXPECT_EQ(w.dtype, DType::kBF16);
  EXPECT_EQ(w.dtype_on(Side::kReceiver), DType::kF8E4M3);
  EXPECT_EQ(L->tensors[L->find_tensor("w.weight_scale_inv")].derived_from, L->find_tensor("w.weight"));
  EXPECT_FALSE(L->tensors[L->find_tensor("norm")].receiver_dtype.has_value());
  EXPECT_TRUE(has_conversions(*L));

  // Written and read back: the same conversions.
  auto again = parse_layout_json(write_layout_json(*L), "again.json");
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->tensors[again->find_tensor("w.weight")].dtype_on(Side::kReceiver), DType::kF8E4M3);
  EXPECT_EQ(again->tensors[again->find_tensor("w.weight_scale_inv")].derived_from, again->find_tensor("w.weight"));
}

TEST(ConversionLayout, PlanCountsTheBytesOfEachSide) {
  auto L = parse(fp8_layout());
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  // The scale tensor is derived: no unit of it.
  for (const Unit& u : plan->units()) EXPECT_NE(L->tensors[u.tensor].name, "w.weight_scale_inv");
  const int64_t w_elems = 256 * 384, norm = 384 * 2, scales = 2 * 3 * 4;
  EXPECT_EQ(plan->summary().network_bytes, w_elems * 2 + norm);  // the sources' dtype
  // At the receiver: BF16 over the network, FP8 and scales to the second rank.
  const ConversionBytes r = count_conversion_bytes(*plan, ConvertAt::kReceiver);
  EXPECT_EQ(r.converted_tensors, 1);
  EXPECT_EQ(r.derived_tensors, 1);
  EXPECT_EQ(r.network_bytes, w_elems * 2 + norm);
  EXPECT_EQ(r.local_bytes, w_elems + scales + norm);
  EXPECT_EQ(r.local_scale_bytes, scales);
  EXPECT_EQ(r.quantized_at_receiver_bytes, w_elems * 2);
  // At the source: each source rank holds whole blocks (rows 0:128, 128:256).
  const ConversionBytes s = count_conversion_bytes(*plan, ConvertAt::kSource);
  EXPECT_EQ(s.network_bytes, w_elems + scales + norm);
  EXPECT_EQ(s.network_scale_bytes, scales);
  EXPECT_EQ(s.quantized_at_source_bytes, w_elems * 2);
  EXPECT_EQ(s.quantized_at_receiver_bytes, 0);
}

TEST(ConversionLayout, SourceShardsCuttingBlocksAreQuantizedAtTheReceiver) {
  json j = fp8_layout();
  // Four source ranks of 64 rows: no source holds a block whole.
  j["sources"] = json::parse(R"([{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0},
                                 {"rank": 2, "domain": 0}, {"rank": 3, "domain": 0}])");
  for (auto& t : j["tensors"])
    if (t.contains("source")) t["source"] = json::parse(R"J({"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["S(0)"]})J");
  auto L = parse(j);
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const ConversionBytes s = count_conversion_bytes(*plan, ConvertAt::kSource);
  EXPECT_EQ(s.quantized_at_source_bytes, 0);
  EXPECT_EQ(s.quantized_at_receiver_bytes, 256 * 384 * 2);
  EXPECT_EQ(s.network_bytes, 256 * 384 * 2 + 384 * 2);
}

std::string refusal(const json& j) {
  auto L = parse(j);
  EXPECT_FALSE(L.is_ok());
  return L.is_ok() ? std::string() : L.status().message();
}

TEST(ConversionLayout, RefusesABoxThatCutsABlock) {
  json j = fp8_layout();
  // Receiver rank 1 holds rows 0:100 only.
  j["buffers"][1]["segments"][0]["size"] = {100, 384};
  const std::string m = refusal(j);
  EXPECT_NE(m.find("\"w.weight\""), std::string::npos) << m;
  EXPECT_NE(m.find("receiver rank 1"), std::string::npos) << m;
  EXPECT_NE(m.find("block 0 of dim 0"), std::string::npos) << m;
  EXPECT_NE(m.find("whole blocks"), std::string::npos) << m;
}

TEST(ConversionLayout, RefusesABlockSizeThatDoesNotDivideTheShard) {
  json j = fp8_layout();
  j["weight_block_size"] = {96, 128};  // scales [3, 3]; rank 0 holds all rows (ends at the edge)
  j["buffers"][1]["segments"][0]["size"] = {128, 384};  // ends at 128, inside block 1 (96:192)
  j["tensors"][1]["shape"] = {3, 3};
  for (int b : {2, 3}) {
    j["buffers"][b]["bytes"] = 36;
    j["buffers"][b]["segments"][0]["size"] = {3, 3};
  }
  const std::string m = refusal(j);
  EXPECT_NE(m.find("block 1 of dim 0"), std::string::npos) << m;
  EXPECT_NE(m.find("96x128"), std::string::npos) << m;
}

TEST(ConversionLayout, RefusesAMissingScaleTensor) {
  json j = fp8_layout();
  j["tensors"].erase(1);
  j["buffers"].erase(3);
  j["buffers"].erase(2);
  const std::string m = refusal(j);
  EXPECT_NE(m.find("\"w.weight_scale_inv\" is missing on the receivers"), std::string::npos) << m;
}

TEST(ConversionLayout, RefusesARankWithoutItsScales) {
  json j = fp8_layout();
  j["buffers"].erase(3);  // receiver rank 1 has no scale buffer
  const std::string m = refusal(j);
  EXPECT_NE(m.find("receiver rank 1"), std::string::npos) << m;
  EXPECT_NE(m.find("not its scales"), std::string::npos) << m;
}

TEST(ConversionLayout, RefusesAScaleTensorOfTheWrongShapeOrDtype) {
  json j = fp8_layout();
  j["tensors"][1]["shape"] = {2, 4};
  for (int b : {2, 3}) {
    j["buffers"][b]["bytes"] = 32;
    j["buffers"][b]["segments"][0]["size"] = {2, 4};
    j["buffers"][b]["segments"][0]["strides"] = {4, 1};
  }
  std::string m = refusal(j);
  EXPECT_NE(m.find("expected F32 [2, 3]"), std::string::npos) << m;
  j = fp8_layout();
  j["tensors"][1]["dtype"] = "BF16";
  for (int b : {2, 3}) {
    j["buffers"][b]["dtype"] = "BF16";
    j["buffers"][b]["bytes"] = 12;
  }
  m = refusal(j);
  EXPECT_NE(m.find("is BF16 [2, 3], expected F32"), std::string::npos) << m;
}

TEST(ConversionLayout, RefusesUnsupportedConversions) {
  json j = fp8_layout();
  j["tensors"][0]["dtype"] = "F8_E4M3";  // FP8 sources, F8 receivers: fine; make the receivers BF16
  for (int b : {0, 1}) {
    j["buffers"][b]["dtype"] = "BF16";
    j["buffers"][b]["bytes"] = 256 * 384 * 2;
  }
  std::string m = refusal(j);
  EXPECT_NE(m.find("\"w.weight\""), std::string::npos) << m;
  EXPECT_NE(m.find("dequantize"), std::string::npos) << m;

  j = fp8_layout();
  j["tensors"][2]["dtype"] = "I32";
  j["tensors"][2].erase("receiver");
  j["buffers"].push_back(json::parse(R"({"side": "receiver", "rank": 0, "name": "norm", "dtype": "F32", "bytes": 1536,
      "segments": [{"tensor": "norm", "start": [0], "size": [384], "offset": 0, "strides": [1]}]})"));
  m = refusal(j);
  EXPECT_NE(m.find("\"norm\""), std::string::npos) << m;
  EXPECT_NE(m.find("integer"), std::string::npos) << m;
}

TEST(ConversionLayout, OneDtypePerTensorOnTheReceivers) {
  json j = fp8_layout();
  j["buffers"][1]["dtype"] = "BF16";
  j["buffers"][1]["bytes"] = 256 * 384 * 2;
  const std::string m = refusal(j);
  EXPECT_NE(m.find("the tensor is F8_E4M3 in another receiver buffer but this buffer is BF16"), std::string::npos) << m;
  // The other order: the sources' dtype first, then a converted buffer.
  j = fp8_layout();
  j["buffers"][0]["dtype"] = "BF16";
  j["buffers"][0]["bytes"] = 256 * 384 * 2;
  const std::string m2 = refusal(j);
  EXPECT_NE(m2.find("the tensor is BF16 in another receiver buffer but this buffer is F8_E4M3"), std::string::npos) << m2;
}

TEST(JoinSides, MatchesTensorsByNameAndDerivesScales) {
  // Sources: BF16 w.weight on one rank. Receivers: the FP8 model on one rank.
  Layout S;
  S.sources.push_back({0});
  S.add_tensor("w.weight", DType::kBF16, {256, 128});
  S.add_tensor("trainer_only", DType::kF32, {4});
  const RankSetId s0 = S.source_sets.intern({0});
  const uint32_t sb = S.add_buffer(Buffer{Side::kSource, "w", DType::kBF16, 256 * 128 * 2, s0});
  S.tensors[0].sources.push_back(Region{Box::whole({256, 128}), s0, sb, 0, row_major_strides({256, 128})});

  Layout R;
  R.receivers.push_back({0, 0});
  R.add_tensor("w.weight", DType::kF8E4M3, {256, 128});
  R.add_tensor("w.weight_scale_inv", DType::kF32, {2, 1});
  const RankSetId r0 = R.receiver_sets.intern({0});
  const uint32_t rw = R.add_buffer(Buffer{Side::kReceiver, "w", DType::kF8E4M3, 256 * 128, r0});
  const uint32_t rs = R.add_buffer(Buffer{Side::kReceiver, "w_scale_inv", DType::kF32, 8, r0});
  R.tensors[0].receivers.push_back(Region{Box::whole({256, 128}), r0, rw, 0, row_major_strides({256, 128})});
  R.tensors[1].receivers.push_back(Region{Box::whole({2, 1}), r0, rs, 0, row_major_strides({2, 1})});

  auto L = join_sides(std::move(S), std::move(R));
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  ASSERT_EQ(L->tensors.size(), 2u);
  EXPECT_EQ(L->tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(L->tensors[0].dtype_on(Side::kReceiver), DType::kF8E4M3);
  EXPECT_EQ(L->tensors[1].derived_from, 0);
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_EQ(plan->summary().network_bytes, 256 * 128 * 2);
  EXPECT_EQ(count_conversion_bytes(*plan, ConvertAt::kSource).network_bytes, 256 * 128 + 8);
}

TEST(JoinSides, RefusesAReceiverTensorTheSourcesLack) {
  Layout S;
  S.sources.push_back({0});
  Layout R;
  R.receivers.push_back({0, 0});
  R.add_tensor("extra", DType::kBF16, {4});
  const RankSetId r0 = R.receiver_sets.intern({0});
  const uint32_t rb = R.add_buffer(Buffer{Side::kReceiver, "extra", DType::kBF16, 8, r0});
  R.tensors[0].receivers.push_back(Region{Box::whole({4}), r0, rb, 0, row_major_strides({4})});
  auto L = join_sides(std::move(S), std::move(R));
  ASSERT_FALSE(L.is_ok());
  EXPECT_NE(L.status().message().find("\"extra\""), std::string::npos) << L.status().message();
}

// "quantize": "source" (docs/conversion.md, "At the source"). w.weight
// [256, 384] BF16 on explicit source buffers: `rows` gives each source
// rank's row range; `copies` the ranks that also serve an F8_E4M3 copy of
// their whole blocks with its scales (buffer "refit.converted").
json source_quantized_layout(const std::vector<std::pair<int64_t, int64_t>>& rows, const std::vector<int>& copies) {
  json j = fp8_layout();
  j["sources"] = json::array();
  for (size_t r = 0; r < rows.size(); ++r) j["sources"].push_back({{"rank", r}, {"domain", 0}});
  for (auto& t : j["tensors"]) {
    if (t["name"] == "w.weight") t.erase("source");
    if (t["name"] == "norm")
      t["source"] = {{"mesh", {static_cast<int>(rows.size())}}, {"ranks", json::array()}, {"placements", {"R"}}};
  }
  for (size_t r = 0; r < rows.size(); ++r) j["tensors"][2]["source"]["ranks"].push_back(r);
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto [lo, hi] = rows[r];
    j["buffers"].push_back({{"side", "source"}, {"rank", r}, {"name", "w"}, {"dtype", "BF16"},
                            {"bytes", (hi - lo) * 384 * 2},
                            {"segments", {{{"tensor", "w.weight"}, {"start", {lo, 0}}, {"size", {hi - lo, 384}},
                                           {"offset", 0}, {"strides", {384, 1}}}}}});
  }
  for (int r : copies) {
    const auto [lo, hi] = rows[r];
    const int64_t qlo = (lo + 127) / 128 * 128, qhi = hi == 256 ? 256 : hi / 128 * 128;
    if (qhi <= qlo) continue;  // no whole block
    const int64_t bytes = (qhi - qlo) * 384;
    j["buffers"].push_back(
        {{"side", "source"}, {"rank", r}, {"name", "refit.converted"}, {"dtype", "U8"}, {"bytes", bytes + 64},
         {"segments",
          {{{"tensor", "w.weight"}, {"dtype", "F8_E4M3"}, {"start", {qlo, 0}}, {"size", {qhi - qlo, 384}},
            {"offset", 0}, {"strides", {384, 1}}},
           {{"tensor", "w.weight_scale_inv"}, {"dtype", "F32"}, {"start", {qlo / 128, 0}},
            {"size", {(qhi - qlo) / 128, 3}}, {"offset", bytes / 4}, {"strides", {3, 1}}}}}});
  }
  return j;
}

struct Walk {
  int64_t network = 0, staged = 0, scale_network = 0;
  std::vector<ConvertStep> steps;
};

Walk walk(const Plan& plan) {
  Walk w;
  const Layout& L = plan.layout();
  Status st = for_each_run(
      plan,
      [&](const Run& r) {
        if (r.local) return;
        w.network += r.bytes;
        if (r.to.buffer == kStagingBuffer) w.staged += r.bytes;
        else if (L.buffers[r.to.buffer].name == "w_scale_inv") w.scale_network += r.bytes;
      },
      [&](const ConvertStep& c) { w.steps.push_back(c); });
  EXPECT_TRUE(st.is_ok()) << st.message();
  return w;
}

TEST(QuantizeAtSource, WholeBlockPiecesArePulledAsFp8WithTheirScales) {
  auto L = parse(source_quantized_layout({{0, 128}, {128, 256}}, {0, 1}));
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  EXPECT_EQ(L->tensors[L->find_tensor("w.weight")].converted_sources.size(), 2u);
  EXPECT_EQ(L->tensors[L->find_tensor("w.weight_scale_inv")].converted_sources.size(), 2u);
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Walk w = walk(*plan);
  EXPECT_TRUE(w.steps.empty());  // nothing left for the receiver to convert
  EXPECT_EQ(w.staged, 0);
  EXPECT_EQ(w.scale_network, 2 * 3 * 4);
  EXPECT_EQ(w.network, 256 * 384 + 2 * 3 * 4 + 384 * 2);
  // What refit-plan prints as convert_at_source_* is what the runs move.
  EXPECT_EQ(w.network, count_conversion_bytes(*plan, ConvertAt::kSource).network_bytes);
}

TEST(QuantizeAtSource, PiecesCuttingABlockAreConvertedByThePuller) {
  // Rank 0 holds block row 0 whole; ranks 1 and 2 split block row 1.
  auto L = parse(source_quantized_layout({{0, 128}, {128, 200}, {200, 256}}, {0}));
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Walk w = walk(*plan);
  ASSERT_EQ(w.steps.size(), 1u);
  EXPECT_EQ(w.steps[0].box.to_string(), "[128:256, 0:384]");
  EXPECT_EQ(w.staged, 128 * 384 * 2);
  EXPECT_EQ(w.scale_network, 3 * 4);
  EXPECT_EQ(w.network, 128 * 384 + 3 * 4 + 128 * 384 * 2 + 384 * 2);
  const ConversionBytes c = count_conversion_bytes(*plan, ConvertAt::kSource);
  EXPECT_EQ(w.network, c.network_bytes);
  EXPECT_EQ(c.quantized_at_source_bytes, 128 * 384 * 2);
  EXPECT_EQ(c.quantized_at_receiver_bytes, 128 * 384 * 2);
}

TEST(QuantizeAtSource, APieceIsCutIntoItsWholeBlocksAndTheRest) {
  // Rank 1 holds rows [100, 256): its whole blocks [128, 256) come from its
  // copy, rows [100, 128) and rank 0's [0, 100) are converted by the puller.
  auto L = parse(source_quantized_layout({{0, 100}, {100, 256}}, {0, 1}));
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  EXPECT_EQ(L->tensors[L->find_tensor("w.weight")].converted_sources.size(), 1u);  // rank 0 has no whole block
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Walk w = walk(*plan);
  ASSERT_EQ(w.steps.size(), 1u);
  EXPECT_EQ(w.steps[0].box.to_string(), "[0:128, 0:384]");
  EXPECT_EQ(w.staged, 128 * 384 * 2);
  EXPECT_EQ(w.network, 128 * 384 + 3 * 4 + 128 * 384 * 2 + 384 * 2);
  EXPECT_EQ(w.network, count_conversion_bytes(*plan, ConvertAt::kSource).network_bytes);
}

TEST(QuantizeAtSource, SplitWholeBlocks) {
  const std::vector<int64_t> shape{300, 300};
  Box b;
  b.ndim = 2;
  b.start = {10, 0};
  b.size = {290, 200};
  const BlockSplit s = split_whole_blocks(b, shape, {128, 128});
  EXPECT_EQ(s.whole.to_string(), "[128:300, 0:128]");
  int64_t n = s.whole.numel();
  for (const Box& r : s.rest) {
    EXPECT_FALSE(overlaps(r, s.whole)) << r.to_string();
    n += r.numel();
  }
  EXPECT_EQ(n, b.numel());
  b.start = {10, 10};
  b.size = {100, 100};
  EXPECT_TRUE(split_whole_blocks(b, shape, {128, 128}).whole.empty());
}

TEST(QuantizeAtSource, ACopyOfAnotherBlockOrWithoutScalesIsNotUsed) {
  // Receivers of 64 x 64 blocks: the copies' scales are of 128 x 128.
  json j = source_quantized_layout({{0, 128}, {128, 256}}, {0, 1});
  j["weight_block_size"] = {64, 64};
  j["tensors"][1]["shape"] = {4, 6};
  for (auto& b : j["buffers"]) {
    if (b["name"] == "w_scale_inv") {
      b["bytes"] = 4 * 6 * 4;
      b["segments"][0]["size"] = {4, 6};
      b["segments"][0]["strides"] = {6, 1};
    }
  }
  auto L = parse(j);
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  EXPECT_TRUE(L->tensors[L->find_tensor("w.weight")].converted_sources.empty());
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Walk w = walk(*plan);
  EXPECT_EQ(w.network, 256 * 384 * 2 + 384 * 2);  // BF16, converted by the puller
}

TEST(QuantizeAtSource, PrefersTheCopyOfAnyHolder) {
  // Both ranks hold all of w; only rank 1 serves a copy: every piece is FP8.
  auto L = parse(source_quantized_layout({{0, 256}, {0, 256}}, {1}));
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const Walk w = walk(*plan);
  EXPECT_TRUE(w.steps.empty());
  EXPECT_EQ(w.network, 256 * 384 + 2 * 3 * 4 + 384 * 2);
}

}  // namespace
}  // namespace refit
