#include "planner/manifest.h"

#include <chrono>
#include <string>

#include <gtest/gtest.h>

namespace refit {
namespace {

// The message of a failed parse, or "" when it succeeded.
template <typename T>
std::string error_of(const Result<T>& r) {
  return r ? std::string() : r.status().message();
}

// A .safetensors file: 8-byte little-endian header length, the header,
// then `data_bytes` of zeros. `length` overrides the announced length.
std::string safetensors(const std::string& header, uint64_t data_bytes, int64_t length = -1) {
  const uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

TEST(ManifestJson, KeepsFileOrderAndFields) {
  auto m = parse_manifest_json(
      R"({"model.norm.weight": {"shape": [4096], "dtype": "BF16"},
          "lm_head.weight": {"dtype": "F8_E4M3", "shape": [10, 4096]},
          "bias": {"shape": [], "dtype": "F32"}})",
      "m.json");
  ASSERT_TRUE(m) << error_of(m);
  ASSERT_EQ(m->size(), 3u);
  EXPECT_EQ((*m)[0].name, "model.norm.weight");
  EXPECT_EQ((*m)[0].shape, std::vector<int64_t>{4096});
  EXPECT_EQ((*m)[0].dtype, DType::kBF16);
  EXPECT_EQ((*m)[1].name, "lm_head.weight");
  EXPECT_EQ((*m)[1].dtype, DType::kF8E4M3);
  EXPECT_EQ((*m)[1].shape, (std::vector<int64_t>{10, 4096}));
  EXPECT_EQ((*m)[2].name, "bias");
  EXPECT_TRUE((*m)[2].shape.empty());
}

TEST(ManifestJson, AcceptsMetadataAndOffsets) {
  auto m = parse_manifest_json(
      R"({"__metadata__": {"format": "pt"}, "w": {"shape": [2, 2], "dtype": "F32", "data_offsets": [0, 16]}})",
      "m.json");
  ASSERT_TRUE(m) << error_of(m);
  ASSERT_EQ(m->size(), 1u);
  EXPECT_EQ((*m)[0].name, "w");
}

TEST(ManifestJson, MalformedJsonSaysWhere) {
  const std::string e = error_of(parse_manifest_json(R"({"w": {"shape": [1], "dtype": "BF16"})", "m.json"));
  EXPECT_EQ(e.rfind("m.json: not valid JSON: ", 0), 0u) << e;
  EXPECT_NE(e.find("line 1"), std::string::npos) << e;
}

TEST(ManifestJson, RejectsNonObjectAndEmpty) {
  EXPECT_NE(error_of(parse_manifest_json("[1, 2]", "m.json")).find("m.json: a manifest must be a JSON object"),
            std::string::npos);
  EXPECT_EQ(error_of(parse_manifest_json("{}", "m.json")), "m.json: the manifest lists no tensors");
}

TEST(ManifestJson, ShapeErrorsNameTensorAndKey) {
  for (const char* shape : {R"("4")", "[-1]", "[1.5]", R"([1, "2"])", "{}", "null"}) {
    const std::string text = std::string(R"({"model.norm.weight": {"shape": )") + shape + R"(, "dtype": "BF16"}})";
    const std::string e = error_of(parse_manifest_json(text, "deepseek.json"));
    EXPECT_EQ(e.rfind(R"(deepseek.json: tensor "model.norm.weight": "shape" must be a list of non-negative integers)",
                      0),
              0u)
        << shape << " -> " << e;
  }
}

TEST(ManifestJson, RejectsMoreThanEightDims) {
  const std::string e =
      error_of(parse_manifest_json(R"({"w": {"shape": [1,1,1,1,1,1,1,1,1], "dtype": "BF16"}})", "m.json"));
  EXPECT_EQ(e, R"(m.json: tensor "w": "shape" has 9 dims; at most 8 are supported)");
}

TEST(ManifestJson, RejectsSizesThatOverflow) {
  const std::string e = error_of(
      parse_manifest_json(R"({"w": {"shape": [4294967296, 4294967296], "dtype": "BF16"}})", "m.json"));
  EXPECT_NE(e.find(R"(m.json: tensor "w": "shape")"), std::string::npos) << e;
  EXPECT_NE(e.find("too large"), std::string::npos) << e;
}

TEST(ManifestJson, DtypeErrors) {
  EXPECT_EQ(error_of(parse_manifest_json(R"({"w": {"shape": [1]}})", "m.json")),
            R"(m.json: tensor "w": missing key "dtype")");
  const std::string e = error_of(parse_manifest_json(R"({"w": {"shape": [1], "dtype": "Q4"}})", "m.json"));
  EXPECT_EQ(e.rfind(R"(m.json: tensor "w": "dtype" must be one of BF16)", 0), 0u) << e;
  EXPECT_NE(e.find(R"(got "Q4")"), std::string::npos) << e;
  EXPECT_NE(error_of(parse_manifest_json(R"({"w": {"shape": [1], "dtype": 2}})", "m.json"))
                .find(R"("dtype" must be a string, got 2)"),
            std::string::npos);
}

TEST(ManifestJson, UnknownAndMissingKeys) {
  EXPECT_EQ(error_of(parse_manifest_json(R"({"w": {"shape": [1], "dtype": "BF16", "stride": [1]}})", "m.json")),
            R"(m.json: tensor "w": unknown key "stride" (known: dtype, shape, data_offsets))");
  EXPECT_EQ(error_of(parse_manifest_json(R"({"w": {"dtype": "BF16"}})", "m.json")),
            R"(m.json: tensor "w": missing key "shape")");
  EXPECT_EQ(error_of(parse_manifest_json(R"({"w": [1]})", "m.json")),
            R"(m.json: tensor "w": must be an object with "dtype" and "shape", got [1])");
}

TEST(ManifestJson, RejectsTensorListedTwice) {
  EXPECT_EQ(error_of(parse_manifest_json(
                R"({"w": {"shape": [1], "dtype": "BF16"}, "w": {"shape": [2], "dtype": "BF16"}})", "m.json")),
            R"(m.json: tensor "w" is listed twice)");
}

TEST(ManifestJson, RejectsBadMetadata) {
  EXPECT_EQ(error_of(parse_manifest_json(R"({"__metadata__": {"n": 1}, "w": {"shape": [1], "dtype": "BF16"}})",
                                         "m.json")),
            R"(m.json: "__metadata__": "n" must be a string, got 1)");
}

TEST(ManifestJson, LargeManifestParsesInLinearTime) {
  // 60k tensors: a quadratic parser takes minutes here, a linear one well
  // under a second.
  std::string text = "{";
  for (int i = 0; i < 60000; ++i) {
    if (i) text += ",";
    text += "\"model.layers." + std::to_string(i) + ".w\": {\"shape\": [16, 16], \"dtype\": \"BF16\"}";
  }
  text += "}";
  const auto t0 = std::chrono::steady_clock::now();
  auto m = parse_manifest_json(text, "big.json");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(m) << error_of(m);
  EXPECT_EQ(m->size(), 60000u);
  EXPECT_EQ((*m)[59999].name, "model.layers.59999.w");
  EXPECT_LT(secs, 10.0);
}

TEST(Safetensors, ParsesHeader) {
  const std::string h =
      R"({"__metadata__": {"format": "pt"}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},)"
      R"( "a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}})";
  const std::string f = safetensors(h, 16);
  auto m = parse_safetensors_header(f, f.size(), "x.safetensors");
  ASSERT_TRUE(m) << error_of(m);
  ASSERT_EQ(m->size(), 2u);
  EXPECT_EQ((*m)[0].name, "b");
  EXPECT_EQ((*m)[1].name, "a");
  EXPECT_EQ((*m)[1].shape, (std::vector<int64_t>{2, 2}));
}

TEST(Safetensors, AcceptsHeaderPaddedWithSpacesAndOnlyTheHeaderBytes) {
  const std::string h = R"({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}    )";
  const std::string f = safetensors(h, 3);
  // The caller may hand in only the length and the header.
  auto m = parse_safetensors_header(std::string_view(f).substr(0, 8 + h.size()), f.size(), "x.safetensors");
  ASSERT_TRUE(m) << error_of(m);
  EXPECT_EQ(m->size(), 1u);
}

TEST(Safetensors, RejectsFileShorterThanTheLength) {
  const std::string f("\x05\x00\x00", 3);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            "x.safetensors: 3 bytes is too short for a safetensors file (an 8-byte header length comes first)");
}

TEST(Safetensors, RejectsLengthPastTheEndOfTheFile) {
  const std::string h = R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})";
  const std::string f = safetensors(h, 1, 1000);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            "x.safetensors: the header length 1000 runs past the end of the file (" + std::to_string(f.size()) +
                " bytes)");
}

TEST(Safetensors, RejectsAbsurdLength) {
  const std::string f = safetensors("{}", 0, int64_t{1} << 40);
  const std::string e = error_of(parse_safetensors_header(f, uint64_t{1} << 41, "x.safetensors"));
  EXPECT_NE(e.find("x.safetensors: the header length 1099511627776 is above the safetensors limit"),
            std::string::npos)
      << e;
}

TEST(Safetensors, RejectsTruncatedHeaderBytes) {
  const std::string h = R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}})";
  const std::string f = safetensors(h, 1);
  const std::string e = error_of(parse_safetensors_header(f.substr(0, 20), f.size(), "x.safetensors"));
  EXPECT_EQ(e, "x.safetensors: truncated header: it announces " + std::to_string(h.size()) + " bytes, only 12 were given");
}

TEST(Safetensors, RejectsHeaderThatIsNotAnObject) {
  const std::string f = safetensors("[1, 2, 3]", 0);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            "x.safetensors: the header must be a JSON object starting with '{'");
  const std::string g = safetensors("{\"a\": ", 0);
  EXPECT_EQ(error_of(parse_safetensors_header(g, g.size(), "x.safetensors")).rfind("x.safetensors: not valid JSON", 0),
            0u);
}

TEST(Safetensors, RequiresDataOffsets) {
  const std::string f = safetensors(R"({"a": {"dtype": "U8", "shape": [1]}})", 1);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            R"(x.safetensors: tensor "a": missing key "data_offsets")");
}

TEST(Safetensors, RejectsOffsetsThatDisagreeWithTheShape) {
  const std::string f = safetensors(R"({"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 10]}})", 10);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            R"(x.safetensors: tensor "a": "data_offsets" [0,10] span 10 bytes, but shape [4] of BF16 needs 8)");
  const std::string g = safetensors(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [3, 2]}})", 3);
  EXPECT_NE(error_of(parse_safetensors_header(g, g.size(), "x.safetensors"))
                .find(R"(tensor "a": "data_offsets" must be [begin, end] with 0 <= begin <= end, got [3,2])"),
            std::string::npos);
}

TEST(Safetensors, RejectsOffsetsPastTheData) {
  const std::string f = safetensors(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}})", 4);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            R"(x.safetensors: tensor "a": "data_offsets" [0, 8] run past the data (4 bytes after the header): the file is truncated)");
}

TEST(Safetensors, RejectsOverlappingTensors) {
  const std::string f = safetensors(
      R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]}})",
      10);
  EXPECT_EQ(error_of(parse_safetensors_header(f, f.size(), "x.safetensors")),
            R"(x.safetensors: tensors "a" and "b" overlap in the data section)");
}

TEST(MergeManifest, JoinsShardsInOrder) {
  Manifest a = {{"x", DType::kBF16, {2}}};
  Manifest b = {{"y", DType::kF32, {3}}, {"z", DType::kU8, {}}};
  ASSERT_TRUE(merge_manifest(a, std::move(b), "2.safetensors"));
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[1].name, "y");
  EXPECT_EQ(a[2].name, "z");
}

TEST(MergeManifest, RejectsTensorInTwoShards) {
  Manifest a = {{"x", DType::kBF16, {2}}};
  Manifest b = {{"x", DType::kBF16, {2}}};
  Status s = merge_manifest(a, std::move(b), "model-00002.safetensors");
  EXPECT_EQ(s.message(), R"(model-00002.safetensors: tensor "x" is also in an earlier file of the checkpoint)");
  EXPECT_EQ(a.size(), 1u);
}

}  // namespace
}  // namespace refit
