#include "planner/layout_json.h"

#include <array>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <functional>

#include <gtest/gtest.h>

#include "tests/common/small_llama.h"
#include <nlohmann/json.hpp>

#include "planner/plan.h"
#include "planner/recipes/recipe.h"

namespace refit {
namespace {

using nlohmann::json;

// The example of docs/formats.md, "Layout file".
json formats_example() {
  return json::parse(R"J({"format": "refit-layout/1",
     "sources":   [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0},
                   {"rank": 1, "domain": 0, "instance": 0}],
     "tensors": [
       {"name": "w", "dtype": "BF16", "shape": [10, 6],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
        "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["S(1)"]}},
       {"name": "q", "dtype": "BF16", "shape": [8, 4],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}],
     "buffers": [
       {"side": "receiver", "rank": 0, "name": "qkv", "dtype": "BF16", "bytes": 64,
        "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4],
                      "offset": 0, "strides": [4, 1]}]}]})J");
}

// Two receiving domains of two ranks, I32 elements (so a test can put a
// distinct id in every element): a cross-dim reshard, an explicit composite
// buffer with a gap, and a replicated norm that is fanned out locally.
json two_domains() {
  return json::parse(R"J({"format": "refit-layout/1",
     "sources":   [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                   {"rank": 2, "domain": 1, "instance": 1}, {"rank": 3, "domain": 1, "instance": 1}],
     "tensors": [
       {"name": "w", "dtype": "I32", "shape": [10, 6],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
        "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(1)"]}},
       {"name": "q", "dtype": "I32", "shape": [8, 4],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}},
       {"name": "k", "dtype": "I32", "shape": [4, 4],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]}},
       {"name": "norm", "dtype": "I32", "shape": [5],
        "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["R"]},
        "receiver": {"mesh": [4], "ranks": [0, 1, 2, 3], "placements": ["R"]}}],
     "buffers": [
       {"side": "receiver", "rank": 0, "name": "qk", "dtype": "I32", "bytes": 128,
        "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                     {"tensor": "k", "start": [0, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]},
       {"side": "receiver", "rank": 1, "name": "qk", "dtype": "I32", "bytes": 128,
        "segments": [{"tensor": "q", "start": [4, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                     {"tensor": "k", "start": [2, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]},
       {"side": "receiver", "rank": 2, "name": "qk", "dtype": "I32", "bytes": 128,
        "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                     {"tensor": "k", "start": [0, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]},
       {"side": "receiver", "rank": 3, "name": "qk", "dtype": "I32", "bytes": 128,
        "segments": [{"tensor": "q", "start": [4, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                     {"tensor": "k", "start": [2, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]}]})J");
}

Result<Layout> parse(const json& doc) { return parse_layout_json(doc.dump(), "L.json"); }

std::string error_of(const json& doc) {
  auto l = parse(doc);
  return l ? std::string() : l.status().message();
}

// Every (tensor, side, rank) placement of a layout, flattened per rank, in a
// canonical order: what a layout means regardless of how ranks share entries.
using Flat = std::tuple<std::string, int, int32_t, std::string, int64_t, std::string, int64_t, std::string>;
std::set<Flat> flatten(const Layout& L) {
  std::set<Flat> out;
  for (const Tensor& t : L.tensors) {
    for (Side side : {Side::kSource, Side::kReceiver}) {
      for (const Region& r : side == Side::kSource ? t.sources : t.receivers) {
        std::string strides;
        for (int d = 0; d < r.box.ndim; ++d) strides += std::to_string(r.strides[d]) + ",";
        const Buffer& b = L.buffers[t.buffer_of(side, r)];
        for (int32_t rank : L.sets(side).get(r.ranks))
          out.emplace(t.name, static_cast<int>(side), rank, b.name, b.bytes, r.box.to_string(), r.offset, strides);
      }
    }
  }
  return out;
}

// Global element index of the box element at row-major position `i`.
Index element(const Box& b, int64_t i) {
  Index g{};
  for (int d = b.ndim - 1; d >= 0; --d) {
    g[d] = b.start[d] + i % b.size[d];
    i /= b.size[d];
  }
  return g;
}

int64_t place(const Region& r, const Index& g) {
  int64_t p = r.offset;
  for (int d = 0; d < r.box.ndim; ++d) p += (g[d] - r.box.start[d]) * r.strides[d];
  return p;
}

int32_t id_of(size_t tensor, const std::vector<int64_t>& shape, const Index& g) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + g[d];
  return static_cast<int32_t>(tensor * 1000000 + flat + 1);
}

// Executes refit-runs/1 on byte buffers filled as the layout says and checks
// FORMATS' promises: every receiver byte a segment covers is written exactly
// once with the right value, nothing else is written, local runs read only
// bytes already written, and network bytes add up to the summary.
void execute_and_check(const Layout& L, const PlanSummary& summary, const json& runs) {
  struct Mem {
    std::vector<uint8_t> bytes;
    std::vector<int> writes;
  };
  std::map<std::tuple<int, int32_t, std::string>, Mem> mem;
  for (const Buffer& b : L.buffers)
    for (int32_t rank : L.sets(b.side).get(b.ranks))
      mem[{static_cast<int>(b.side), rank, b.name}] = Mem{std::vector<uint8_t>(b.bytes), std::vector<int>(b.bytes)};
  for (size_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    ASSERT_EQ(dtype_bytes(t.dtype), 4) << "execute_and_check needs 4-byte elements";
    for (const Region& r : t.sources)
      for (int32_t rank : L.source_sets.get(r.ranks)) {
        Mem& m = mem[{static_cast<int>(Side::kSource), rank, L.buffers[t.buffer_of(Side::kSource, r)].name}];
        for (int64_t i = 0; i < r.box.numel(); ++i) {
          const Index g = element(r.box, i);
          const int32_t v = id_of(ti, t.shape, g);
          std::memcpy(&m.bytes[place(r, g) * 4], &v, 4);
        }
      }
  }
  ASSERT_EQ(runs["format"], "refit-runs/1");
  int64_t net = 0, local = 0;
  for (const json& run : runs["runs"]) {
    const std::string kind = run["kind"];
    ASSERT_TRUE(kind == "net" || kind == "local") << run.dump();
    const json& f = run["from"];
    const json& to = run["to"];
    ASSERT_EQ(f["side"], kind == "net" ? "source" : "receiver") << run.dump();
    const int64_t n = run["bytes"];
    ASSERT_GT(n, 0);
    Mem& src = mem.at({kind == "net" ? 0 : 1, f["rank"].get<int32_t>(), f["buffer"].get<std::string>()});
    Mem& dst = mem.at({1, to["rank"].get<int32_t>(), to["buffer"].get<std::string>()});
    const int64_t fo = f["offset"], tofs = to["offset"];
    ASSERT_LE(fo + n, static_cast<int64_t>(src.bytes.size()));
    ASSERT_LE(tofs + n, static_cast<int64_t>(dst.bytes.size()));
    if (kind == "local") {
      const int32_t fr = f["rank"], tr = to["rank"];
      ASSERT_EQ(L.receivers[fr].domain, L.receivers[tr].domain) << run.dump();
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(src.writes[fo + i], 1) << "local run reads unwritten bytes: " << run.dump();
      local += n;
    } else {
      net += n;
    }
    for (int64_t i = 0; i < n; ++i) {
      dst.bytes[tofs + i] = src.bytes[fo + i];
      ++dst.writes[tofs + i];
    }
  }
  EXPECT_EQ(net, summary.network_bytes);
  EXPECT_EQ(local, summary.local_bytes);
  int64_t covered = 0;
  for (size_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    for (const Region& r : t.receivers)
      for (int32_t rank : L.receiver_sets.get(r.ranks)) {
        const Mem& m = mem.at({1, rank, L.buffers[t.buffer_of(Side::kReceiver, r)].name});
        for (int64_t i = 0; i < r.box.numel(); ++i) {
          const Index g = element(r.box, i);
          const int64_t p = place(r, g) * 4;
          int32_t v;
          std::memcpy(&v, &m.bytes[p], 4);
          ASSERT_EQ(v, id_of(ti, t.shape, g)) << t.name << " rank " << rank;
          for (int k = 0; k < 4; ++k) ASSERT_EQ(m.writes[p + k], 1) << t.name << " rank " << rank;
          covered += 4;
        }
      }
  }
  int64_t written = 0;
  for (const auto& [key, m] : mem)
    for (int w : m.writes) written += w;
  EXPECT_EQ(written, covered) << "bytes outside every segment were written";
}

TEST(ParseLayout, ExpandsSpecsAndExplicitBuffers) {
  auto l = parse(formats_example());
  ASSERT_TRUE(l) << l.status().message();
  const Layout& L = *l;
  ASSERT_EQ(L.sources.size(), 2u);
  ASSERT_EQ(L.receivers.size(), 2u);
  ASSERT_EQ(L.tensors.size(), 2u);
  const Tensor& w = L.tensors[0];
  EXPECT_EQ(w.name, "w");
  ASSERT_EQ(w.sources.size(), 2u);
  EXPECT_EQ(w.sources[0].box.to_string(), "[0:5, 0:6]");
  EXPECT_EQ(w.sources[1].box.to_string(), "[5:10, 0:6]");
  ASSERT_EQ(w.receivers.size(), 2u);
  EXPECT_EQ(w.receivers[1].box.to_string(), "[0:10, 3:6]");
  EXPECT_EQ(L.buffers[w.receivers[1].buffer].name, "w");
  EXPECT_EQ(L.buffers[w.receivers[1].buffer].bytes, 60);
  const Tensor& q = L.tensors[1];
  ASSERT_EQ(q.sources.size(), 1u);  // replicated: one region held by both ranks
  EXPECT_EQ(L.source_sets.get(q.sources[0].ranks), (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(q.receivers.size(), 1u);
  const Region& r = q.receivers[0];
  EXPECT_EQ(r.box.to_string(), "[0:4, 0:4]");
  EXPECT_EQ(L.buffers[r.buffer].name, "qkv");
  EXPECT_EQ(L.buffers[r.buffer].bytes, 64);
  EXPECT_EQ(L.receiver_sets.get(r.ranks), std::vector<int32_t>{0});
  EXPECT_EQ(r.strides[0], 4);
  EXPECT_EQ(r.strides[1], 1);
}

TEST(ParseLayout, IdenticalExplicitBuffersShareOneRankSet) {
  json d = two_domains();
  for (json& b : d["buffers"]) {  // make all four identical
    b["segments"][0]["start"] = {0, 0};
    b["segments"][1]["start"] = {0, 0};
  }
  auto l = parse(d);
  ASSERT_TRUE(l) << l.status().message();
  const Tensor& q = l->tensors[1];
  ASSERT_EQ(q.receivers.size(), 1u);
  EXPECT_EQ(l->receiver_sets.get(q.receivers[0].ranks), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(ParseLayout, MalformedAndWrongFormat) {
  auto l = parse_layout_json("{\"format\": ", "L.json");
  ASSERT_FALSE(l);
  EXPECT_EQ(l.status().message().rfind("L.json: not valid JSON: parse error at line 1", 0), 0u)
      << l.status().message();
  json d = formats_example();
  d["format"] = "refit-layout/2";
  EXPECT_EQ(error_of(d), R"J(L.json: format: must be "refit-layout/1", got "refit-layout/2")J");
  d.erase("format");
  EXPECT_EQ(error_of(d), R"J(L.json: missing key "format")J");
  EXPECT_EQ(error_of(json::array()), "L.json: a layout must be a JSON object, got []");
}

TEST(ParseLayout, UnknownMissingAndMistypedKeys) {
  json d = formats_example();
  d["plan"] = 1;
  EXPECT_EQ(error_of(d), R"J(L.json: unknown key "plan" (known: format, sources, receivers, tensors, buffers, weight_block_size))J");
  d = formats_example();
  d["tensors"][0]["layout"] = 1;
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0] (tensor "w"): unknown key "layout" (known: name, dtype, shape, source, receiver))J");
  d = formats_example();
  d["tensors"][1]["source"]["mesh_dims"] = 1;
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[1].source (tensor "q"): unknown key "mesh_dims" (known: mesh, ranks, placements))J");
  d = formats_example();
  d["buffers"][0]["segments"][0]["stride"] = 1;
  EXPECT_NE(error_of(d).find(R"J(L.json: buffers[0].segments[0] (receiver rank 0 buffer "qkv", tensor "q"): unknown key "stride")J"),
            std::string::npos)
      << error_of(d);
  d = formats_example();
  d.erase("receivers");
  EXPECT_EQ(error_of(d), R"J(L.json: missing key "receivers")J");
  d = formats_example();
  d["sources"][1]["rank"] = 3;
  EXPECT_EQ(error_of(d), "L.json: sources[1].rank: must be 1: ranks are listed in order from 0, got 3");
  d = formats_example();
  d["receivers"][0].erase("instance");
  EXPECT_EQ(error_of(d), R"J(L.json: receivers[0]: missing key "instance")J");
  d = formats_example();
  d["receivers"][1]["domain"] = "0";
  EXPECT_EQ(error_of(d), R"J(L.json: receivers[1].domain: must be a non-negative integer, got "0")J");
  d = formats_example();
  d["tensors"][0]["shape"] = {10, -6};
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0].shape (tensor "w"): must be a list of non-negative integers, got [10,-6])J");
  d = formats_example();
  d["tensors"][0]["dtype"] = "bf16";
  EXPECT_NE(error_of(d).find(R"J(L.json: tensors[0].dtype (tensor "w"): must be one of BF16)J"), std::string::npos);
  d = formats_example();
  d["tensors"][0]["name"] = "";
  EXPECT_EQ(error_of(d), R"J(L.json: tensors[0].name: must be a non-empty string, got "")J");
  d = formats_example();
  d["buffers"] = json::object();
  EXPECT_EQ(error_of(d), "L.json: buffers: must be a list, got {}");
}

TEST(ParseLayout, DuplicateTensorNames) {
  json d = formats_example();
  d["tensors"][1]["name"] = "w";
  EXPECT_EQ(error_of(d), R"J(L.json: tensors[1] (tensor "w"): tensor "w" is listed twice (first at tensors[0]))J");
}

TEST(ParseLayout, ShardDimOutOfRange) {
  json d = formats_example();
  d["tensors"][0]["receiver"]["placements"] = {"S(2)"};
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0].receiver.placements[0] (tensor "w"): placement S(2) shards dim 2 of a 2-dim tensor)J");
}

TEST(ParseLayout, StridedShardSplitFactorMismatch) {
  json d = formats_example();
  d["sources"] = json::parse(R"J([{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0},
                                  {"rank": 2, "domain": 0}, {"rank": 3, "domain": 0}])J");
  d["tensors"][0]["source"] = json::parse(R"J({"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["SS(0,3)", "S(0)"]})J");
  const std::string e = error_of(d);
  EXPECT_EQ(e.rfind(R"J(L.json: tensors[0].source (tensor "w"): placement SS(0,3) on mesh dim 0: split_factor)J", 0), 0u)
      << e;
  // The right factor parses.
  d["tensors"][0]["source"]["placements"] = {"SS(0,2)", "S(0)"};
  EXPECT_EQ(error_of(d), "");
}

TEST(ParseLayout, PartialIsRefused) {
  json d = formats_example();
  d["tensors"][1]["source"]["placements"] = {"P"};
  const std::string e = error_of(d);
  EXPECT_EQ(e.rfind(R"J(L.json: tensors[1].source.placements[0] (tensor "q"): placement "P": Partial)J", 0), 0u) << e;
  EXPECT_NE(e.find("reduce"), std::string::npos);
  d["tensors"][1]["source"]["placements"] = {"Shard(0)"};
  EXPECT_EQ(error_of(d).rfind(R"J(L.json: tensors[1].source.placements[0] (tensor "q"): placement "Shard(0)")J", 0), 0u);
  d["tensors"][1]["source"]["placements"] = {0};
  EXPECT_EQ(error_of(d).rfind(R"J(L.json: tensors[1].source.placements[0] (tensor "q"): must be a string)J", 0), 0u);
}

TEST(ParseLayout, MeshRanksOutOfRangeOrRepeated) {
  json d = formats_example();
  d["tensors"][0]["receiver"]["ranks"] = {0, 5};
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0].receiver.ranks[1] (tensor "w"): receiver rank 5 is out of range: the layout has 2 receiver ranks)J");
  d["tensors"][0]["receiver"]["ranks"] = {1, 1};
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0].receiver.ranks[1] (tensor "w"): receiver rank 1 is repeated (also at ranks[0]))J");
  d["tensors"][0]["receiver"]["ranks"] = {0};
  EXPECT_EQ(error_of(d), R"J(L.json: tensors[0].receiver.ranks (tensor "w"): lists 1 ranks for a mesh of 2)J");
  d["tensors"][0]["receiver"]["ranks"] = {0, 1};
  d["tensors"][0]["receiver"]["placements"] = {"S(0)", "R"};
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensors[0].receiver.placements (tensor "w"): has 2 entries; it needs one per mesh dim (1))J");
  d["tensors"][0]["receiver"]["placements"] = {"S(0)"};
  d["tensors"][0]["receiver"]["mesh"] = {0};
  EXPECT_EQ(error_of(d), R"J(L.json: tensors[0].receiver.mesh[0] (tensor "w"): must be a positive integer, got 0)J");
}

TEST(ParseLayout, BufferErrors) {
  json d = formats_example();
  d["buffers"][0]["segments"][0]["tensor"] = "x";
  EXPECT_EQ(error_of(d), R"J(L.json: buffers[0].segments[0].tensor (receiver rank 0 buffer "qkv"): unknown tensor "x")J");
  d = formats_example();
  d["buffers"][0]["dtype"] = "F32";
  // A receiver buffer of another dtype asks for a conversion on the way
  // (planner/conversion.h); BF16 to F32 is not one refit does.
  EXPECT_EQ(error_of(d),
            R"J(L.json: tensor "q": BF16 on the sources, F32 on the receivers: not a conversion refit does (F32 to BF16 or F16, BF16 to F16, BF16 or F32 to F8_E4M3 with block scales))J");
  d["buffers"][0]["side"] = "source";
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0] (source rank 0 buffer "qkv", tensor "q"): the tensor is BF16 on the source side but the buffer is F32; all of a tensor's buffers on one side hold one dtype)J");
  // A tensor's receivers hold it in one dtype, whichever buffer comes
  // first: the sources' dtype beside a cast, or a cast beside the sources'.
  for (const char* first : {"BF16", "F16"}) {
    d = formats_example();
    const char* second = std::string(first) == "BF16" ? "F16" : "BF16";
    d["buffers"][0]["dtype"] = first;
    json other = d["buffers"][0];
    other["name"] = "q16";
    other["dtype"] = second;
    d["buffers"].push_back(other);
    EXPECT_EQ(error_of(d), std::string(R"J(L.json: buffers[1].segments[0] (receiver rank 0 buffer "q16", tensor "q"): the tensor is )J") +
                               first + " in another receiver buffer but this buffer is " + second +
                               "; all of a tensor's buffers on one side hold one dtype");
  }
  d = formats_example();
  d["buffers"][0]["side"] = "trainer";
  EXPECT_EQ(error_of(d), R"J(L.json: buffers[0].side: must be "source" or "receiver", got "trainer")J");
  d = formats_example();
  d["buffers"][0]["rank"] = 2;
  EXPECT_EQ(error_of(d),
            "L.json: buffers[0].rank: receiver rank 2 is out of range: the layout has 2 receiver ranks");
  d = formats_example();
  d["buffers"][0]["bytes"] = 63;
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].bytes (receiver rank 0 buffer "qkv"): 63 is not a whole number of BF16 elements)J");
  d = formats_example();
  d["buffers"].push_back(d["buffers"][0]);
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[1] (receiver rank 0 buffer "qkv"): receiver rank 0 already has a buffer "qkv" (buffers[0]))J");
  d = formats_example();
  d["buffers"][0]["name"] = "w";  // the receiver spec of "w" already gave rank 0 a buffer "w"
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0] (receiver rank 0 buffer "w"): receiver rank 0 already has a buffer "w" from the receiver spec of tensor "w")J");
}

TEST(ParseLayout, SegmentOutOfBounds) {
  json d = formats_example();
  d["buffers"][0]["segments"][0]["start"] = {6, 0};
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0] (receiver rank 0 buffer "qkv", tensor "q"): box [6:10, 0:4] is outside the shape [8, 4])J");
  d = formats_example();
  d["buffers"][0]["segments"][0]["offset"] = 17;
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0] (receiver rank 0 buffer "qkv", tensor "q"): box [0:4, 0:4] at element offset 17 with strides [4, 1] reaches past the end of the buffer (32 elements))J");
  d = formats_example();
  d["buffers"][0]["segments"][0]["size"] = {4, 0};
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0].size (receiver rank 0 buffer "qkv", tensor "q"): must be a list of positive integers, got [4,0])J");
  d = formats_example();
  d["buffers"][0]["segments"][0]["strides"] = {4};
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0].strides (receiver rank 0 buffer "qkv", tensor "q"): must list 2 non-negative integers (one per tensor dim), got [4])J");
}

TEST(ParseLayout, SegmentStridesThatAlias) {
  json d = formats_example();
  d["buffers"][0]["segments"][0]["strides"] = {2, 1};
  EXPECT_EQ(error_of(d),
            R"J(L.json: buffers[0].segments[0] (receiver rank 0 buffer "qkv", tensor "q"): strides [2, 1] map two elements of box [0:4, 0:4] to the same place)J");
}

// A buffer is bytes: one receiver buffer holds tensor "q" (BF16) and a
// tensor "s" of F32 scales, each segment counting elements of its own
// dtype. It parses, validates, and writes back to the same layout. The same
// segments overlapping by one byte range are refused, naming both.
TEST(ParseLayout, ABufferHoldsSegmentsOfSeveralDtypes) {
  json d = formats_example();
  d["tensors"].push_back(json::parse(R"J({"name": "s", "dtype": "F32", "shape": [4],
      "source": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}})J"));
  d["buffers"][0]["bytes"] = 48;  // q: bytes [0, 32); s: F32 elements [8, 12), bytes [32, 48)
  d["buffers"][0]["segments"].push_back(
      json::parse(R"J({"tensor": "s", "dtype": "F32", "start": [0], "size": [4], "offset": 8, "strides": [1]})J"));
  auto l = parse(d);
  ASSERT_TRUE(l) << l.status().message();
  ASSERT_TRUE(validate(*l).is_ok()) << validate(*l).message();
  auto again = parse_layout_json(write_layout_json(*l), "written");
  ASSERT_TRUE(again) << again.status().message();
  EXPECT_EQ(flatten(*again), flatten(*l));

  d["buffers"][0]["segments"][1]["offset"] = 7;  // bytes [28, 44): over q's last row
  const std::string e = error_of(d);
  EXPECT_EQ(e, R"J(L.json: buffer "qkv": the segment of tensor "q" [0:4, 0:4] and the segment of tensor "s" [0:4] overlap)J");
  d["buffers"][0]["segments"][1]["offset"] = 9;  // bytes [36, 52): past the end
  EXPECT_NE(error_of(d).find("reaches past the end of the buffer (12 elements)"), std::string::npos) << error_of(d);
  d["buffers"][0]["segments"][1]["offset"] = 8;
  d["buffers"][0]["segments"][1]["dtype"] = "F33";
  EXPECT_NE(error_of(d).find("buffers[0].segments[1].dtype"), std::string::npos) << error_of(d);
}

TEST(ParseLayout, OverlappingSegmentsInOneBuffer) {
  json d = formats_example();
  d["buffers"][0]["segments"].push_back(
      json::parse(R"J({"tensor": "q", "start": [4, 0], "size": [2, 4], "offset": 12, "strides": [4, 1]})J"));
  const std::string e = error_of(d);
  EXPECT_EQ(e.rfind(R"J(L.json: buffer "qkv": the segment of tensor "q")J", 0), 0u) << e;
  EXPECT_NE(e.find("overlap"), std::string::npos) << e;
  // Side by side is fine.
  d["buffers"][0]["segments"][1]["offset"] = 16;
  d["buffers"][0]["bytes"] = 64;
  EXPECT_EQ(error_of(d), "");
}

// The text with its keys in a given order (a json object dumps them
// sorted, "buffers" first).
std::string in_order(const json& doc, std::initializer_list<const char*> keys) {
  std::string text = "{";
  for (const char* k : keys) {
    if (!doc.contains(k)) continue;
    if (text.size() > 1) text += ", ";
    text += json(k).dump() + ": " + doc.at(k).dump();
  }
  return text + "}";
}

// The buffers are read one at a time as the text is parsed: listed after
// the tensors (as written) or before them (held until the tensors are read),
// the layout is the same; the checks on the document's keys still see
// every key, wherever it comes.
TEST(ParseLayout, BuffersAreReadWhereverTheDocumentListsThem) {
  const json d = two_domains();
  auto sorted = parse(d);  // "buffers" first
  ASSERT_TRUE(sorted) << sorted.status().message();
  auto last = parse_layout_json(in_order(d, {"format", "sources", "receivers", "tensors", "buffers"}), "L.json");
  ASSERT_TRUE(last) << last.status().message();
  auto middle = parse_layout_json(in_order(d, {"format", "sources", "buffers", "receivers", "tensors"}), "L.json");
  ASSERT_TRUE(middle) << middle.status().message();
  EXPECT_EQ(flatten(*last), flatten(*sorted));
  EXPECT_EQ(flatten(*middle), flatten(*sorted));
  EXPECT_EQ(write_layout_json(*last), write_layout_json(*sorted));

  // A key after the buffers is checked, and so is a second "buffers".
  std::string text = in_order(d, {"format", "sources", "receivers", "tensors", "buffers"});
  text.pop_back();
  EXPECT_EQ(parse_layout_json(text + ", \"plan\": 1}", "L.json").status().message(),
            R"J(L.json: unknown key "plan" (known: format, sources, receivers, tensors, buffers, weight_block_size))J");
  EXPECT_EQ(parse_layout_json(text + ", \"buffers\": []}", "L.json").status().message(),
            R"J(L.json: key "buffers" is given twice)J");
  EXPECT_EQ(parse_layout_json(text + ", \"weight_block_size\": [0, 1]}", "L.json").status().message(),
            "L.json: weight_block_size: must be two positive integers (rows, cols), got [0,1]");
  // A buffer error names the buffer by its place in the list, read last or first.
  json bad = d;
  bad["buffers"][2]["rank"] = 9;
  const std::string want =
      "L.json: buffers[2].rank: receiver rank 9 is out of range: the layout has 4 receiver ranks";
  EXPECT_EQ(parse_layout_json(in_order(bad, {"format", "sources", "receivers", "tensors", "buffers"}), "L.json")
                .status()
                .message(),
            want);
  EXPECT_EQ(error_of(bad), want);
  // Cut short inside the buffers: not JSON, whatever was read before.
  const std::string whole = in_order(d, {"format", "sources", "receivers", "tensors", "buffers"});
  auto cut = parse_layout_json(whole.substr(0, whole.size() - 40), "L.json");
  ASSERT_FALSE(cut);
  EXPECT_EQ(cut.status().message().rfind("L.json: not valid JSON: parse error", 0), 0u) << cut.status().message();
}

// The coordinator hands its document over piece by piece: the same layout
// as parse_layout_json's, and a mistake in the order of calls is refused.
TEST(LayoutBuilder, GivesWhatParseGivesAndKeepsItsFirstFailure) {
  json d = two_domains();
  const json buffers = d["buffers"];
  d.erase("buffers");
  LayoutBuilder b("membership");
  ASSERT_TRUE(b.head(d).is_ok());
  for (const json& x : buffers) ASSERT_TRUE(b.buffer(x).is_ok());
  auto built = b.finish(d);
  ASSERT_TRUE(built) << built.status().message();
  auto parsed = parse(two_domains());
  ASSERT_TRUE(parsed);
  EXPECT_EQ(write_layout_json(*built), write_layout_json(*parsed));
  EXPECT_EQ(b.finish(d).status().code(), Code::kInternal);  // twice

  LayoutBuilder whole("membership");
  EXPECT_EQ(whole.head(two_domains()).code(), Code::kInternal);  // its buffers would be dropped

  LayoutBuilder early("membership");
  EXPECT_EQ(early.buffer(buffers[0]).code(), Code::kInternal);  // before the head
  EXPECT_EQ(early.head(d).code(), Code::kInternal);             // the failure stays

  LayoutBuilder wrong("membership");
  ASSERT_TRUE(wrong.head(d).is_ok());
  json b0 = buffers[0];
  b0["side"] = "trainer";
  const Status st = wrong.buffer(b0);
  EXPECT_EQ(st.message(), R"J(membership: buffers[0].side: must be "source" or "receiver", got "trainer")J");
  EXPECT_EQ(wrong.buffer(buffers[1]).message(), st.message());
  EXPECT_EQ(wrong.finish(d).status().message(), st.message());
}

// A buffer object as LayoutBuilder::BufferView, over storage it keeps.
struct ViewOf {
  explicit ViewOf(const json& b) {
    for (const json& s : b["segments"]) {
      segs.push_back({s["tensor"].get<std::string>(), s["start"].get<std::vector<int64_t>>(),
                      s["size"].get<std::vector<int64_t>>(), s["strides"].get<std::vector<int64_t>>(),
                      s.value("dtype", std::string())});
      offsets.push_back(s["offset"].get<int64_t>());
    }
    for (size_t i = 0; i < segs.size(); ++i) {
      views.push_back(LayoutBuilder::SegmentView{segs[i].tensor, segs[i].start, segs[i].size, segs[i].strides,
                                                 offsets[i], segs[i].dtype});
    }
    name = b["name"].get<std::string>();
    dtype = b["dtype"].get<std::string>();
    view = LayoutBuilder::BufferView{b["side"] == "source" ? Side::kSource : Side::kReceiver, b["rank"].get<int64_t>(),
                                     name, dtype, b["bytes"].get<int64_t>(), views};
  }
  struct Owned {
    std::string tensor;
    std::vector<int64_t> start, size, strides;
    std::string dtype;
  };
  std::vector<Owned> segs;
  std::vector<int64_t> offsets;
  std::vector<LayoutBuilder::SegmentView> views;
  std::string name, dtype;
  LayoutBuilder::BufferView view;
};

// A buffer handed over as values is checked as its JSON object is: the same
// layout from good ones, the same message for every value a well-formed
// object can get wrong.
TEST(LayoutBuilder, ABufferAsValuesIsCheckedAsItsJsonIs) {
  json d = two_domains();
  const json buffers = d["buffers"];
  d.erase("buffers");
  struct Case {
    const char* what;
    std::function<void(json&)> change;  // of buffers[0]
    bool ok = false;                     // buffers[0] is taken
  };
  const std::vector<Case> cases = {
      {"as it is", [](json&) {}, true},
      {"rank out of range", [](json& b) { b["rank"] = 7; }},
      {"negative rank", [](json& b) { b["rank"] = -1; }},
      {"empty name", [](json& b) { b["name"] = ""; }},
      {"unknown dtype", [](json& b) { b["dtype"] = "X8"; }},
      {"negative bytes", [](json& b) { b["bytes"] = -4; }},
      {"part of an element", [](json& b) { b["bytes"] = 130; }},
      {"the name of a spec's buffer", [](json& b) { b["name"] = "w"; }},
      {"unknown tensor", [](json& b) { b["segments"][0]["tensor"] = "zz"; }},
      {"another dtype", [](json& b) { b["segments"][1]["dtype"] = "F32"; }, true},
      {"start of one dim", [](json& b) { b["segments"][0]["start"] = {0}; }},
      {"negative start", [](json& b) { b["segments"][0]["start"] = {-1, 0}; }},
      {"empty size", [](json& b) { b["segments"][1]["size"] = {0, 4}; }},
      {"negative stride", [](json& b) { b["segments"][0]["strides"] = {4, -1}; }},
      {"negative offset", [](json& b) { b["segments"][1]["offset"] = -1; }},
      {"outside the shape", [](json& b) { b["segments"][0]["start"] = {6, 0}; }},
      {"past the end", [](json& b) { b["segments"][1]["offset"] = 100; }},
      {"overlapping strides", [](json& b) { b["segments"][0]["strides"] = {1, 1}; }},
  };
  for (const Case& c : cases) {
    json b0 = buffers[0];
    c.change(b0);
    LayoutBuilder as_json("membership"), as_values("membership");
    ASSERT_TRUE(as_json.head(d).is_ok());
    ASSERT_TRUE(as_values.head(d).is_ok());
    const ViewOf v(b0);
    const Status a = as_json.buffer(b0);
    const Status b = as_values.buffer(v.view);
    EXPECT_EQ(a.message(), b.message()) << c.what;
    EXPECT_EQ(a.code(), b.code()) << c.what;
    EXPECT_EQ(b.is_ok(), c.ok) << c.what << ": " << b.message();
    if (!a.is_ok()) {
      EXPECT_EQ(a.code(), Code::kInvalidArgument) << c.what << ": " << a.message();
      continue;
    }
    // The others as they are (a tensor in another dtype is refused at the
    // next buffer that holds it in the first).
    for (size_t i = 1; i < buffers.size(); ++i) {
      const ViewOf rest(buffers[i]);
      EXPECT_EQ(as_json.buffer(buffers[i]).message(), as_values.buffer(rest.view).message()) << c.what;
    }
    auto x = as_json.finish(d);
    auto y = as_values.finish(d);
    EXPECT_EQ(x.status().message(), y.status().message()) << c.what;
    if (x && y) EXPECT_EQ(write_layout_json(*x), write_layout_json(*y)) << c.what;
  }
  // Two of the messages as they read (the JSON path's are pinned above).
  for (const auto& [change, want] : std::vector<std::pair<std::function<void(json&)>, std::string>>{
           {[](json& b) { b["segments"][1]["offset"] = 100; },
            "membership: buffers[0].segments[1] (receiver rank 0 buffer \"qk\", tensor \"k\"): box [0:2, 0:4] at "
            "element offset 100 with strides [4, 1] reaches past the end of the buffer (32 elements)"},
           {[](json& b) { b["segments"][0]["tensor"] = "zz"; },
            "membership: buffers[0].segments[0].tensor (receiver rank 0 buffer \"qk\"): unknown tensor \"zz\""}}) {
    json b0 = buffers[0];
    change(b0);
    LayoutBuilder builder("membership");
    ASSERT_TRUE(builder.head(d).is_ok());
    const ViewOf v(b0);
    EXPECT_EQ(builder.buffer(v.view).message(), want);
  }

  LayoutBuilder twice_json("membership"), twice_values("membership");
  ASSERT_TRUE(twice_json.head(d).is_ok());
  ASSERT_TRUE(twice_values.head(d).is_ok());
  const ViewOf v(buffers[0]);
  ASSERT_TRUE(twice_json.buffer(buffers[0]).is_ok());
  ASSERT_TRUE(twice_values.buffer(v.view).is_ok());
  const Status again = twice_values.buffer(v.view);
  EXPECT_EQ(again.message(), twice_json.buffer(buffers[0]).message());
  EXPECT_NE(again.message().find("already has a buffer \"qk\" (buffers[0])"), std::string::npos) << again.message();
}

// The head as values is checked as its JSON is, and the layout made from
// values is the one made from the document.
TEST(LayoutBuilder, AHeadAsValuesIsCheckedAsItsJsonIs) {
  struct Owned {
    std::vector<LayoutBuilder::RankView> sources{{0, 0}}, receivers{{0, 0}, {0, 0}};
    std::vector<std::string> names{"w", "b"}, dtypes{"BF16", "F32"};
    std::vector<std::vector<int64_t>> shapes{{4, 6}, {6}};
    std::array<int64_t, 2> block{128, 128};
  };
  auto doc_of = [](const Owned& o) {
    json d = {{"format", "refit-layout/1"}, {"sources", json::array()}, {"receivers", json::array()},
              {"tensors", json::array()}, {"weight_block_size", o.block}};
    for (size_t i = 0; i < o.sources.size(); ++i) d["sources"].push_back({{"rank", i}, {"domain", o.sources[i].domain}});
    for (size_t i = 0; i < o.receivers.size(); ++i)
      d["receivers"].push_back({{"rank", i}, {"domain", o.receivers[i].domain}, {"instance", o.receivers[i].instance}});
    for (size_t i = 0; i < o.names.size(); ++i)
      d["tensors"].push_back({{"name", o.names[i]}, {"dtype", o.dtypes[i]}, {"shape", o.shapes[i]}});
    return d;
  };
  const json buffer = json::parse(R"J({"side": "receiver", "rank": 1, "name": "w", "dtype": "BF16", "bytes": 48,
      "segments": [{"tensor": "w", "start": [0, 0], "size": [4, 6], "offset": 0, "strides": [6, 1]}]})J");
  struct Case {
    const char* what;
    std::function<void(Owned&)> change;
    bool ok = false;
  };
  const std::vector<Case> cases = {
      {"as it is", [](Owned&) {}, true},
      {"no sources", [](Owned& o) { o.sources.clear(); }},
      {"no receivers", [](Owned& o) { o.receivers.clear(); }},
      {"negative domain", [](Owned& o) { o.sources[0].domain = -1; }},
      {"negative instance", [](Owned& o) { o.receivers[1].instance = -2; }},
      {"empty name", [](Owned& o) { o.names[1] = ""; }},
      {"unknown dtype", [](Owned& o) { o.dtypes[1] = "F12"; }},
      {"negative dim", [](Owned& o) { o.shapes[1] = {-6}; }},
      {"too many dims", [](Owned& o) { o.shapes[1] = {1, 1, 1, 1, 1, 1, 1, 1, 6}; }},
      {"too large", [](Owned& o) { o.shapes[1] = {int64_t{1} << 40, int64_t{1} << 40}; }},
      {"listed twice", [](Owned& o) { o.names[1] = "w"; }},
      {"no block", [](Owned& o) { o.block = {0, 128}; }},
  };
  for (const Case& c : cases) {
    Owned o;
    c.change(o);
    std::vector<LayoutBuilder::TensorView> tensors;
    for (size_t i = 0; i < o.names.size(); ++i) tensors.push_back({o.names[i], o.dtypes[i], o.shapes[i]});
    const json d = doc_of(o);
    LayoutBuilder as_json("membership"), as_values("membership");
    const ViewOf v(buffer);
    Status a = as_json.head(d);
    if (a.is_ok()) a = as_json.buffer(buffer);
    Result<Layout> x = a.is_ok() ? as_json.finish(d) : Result<Layout>(a);
    Status b = as_values.head(LayoutBuilder::HeadView{o.sources, o.receivers, tensors, o.block});
    if (b.is_ok()) b = as_values.buffer(v.view);
    Result<Layout> y = b.is_ok() ? as_values.finish() : Result<Layout>(b);
    EXPECT_EQ(x.status().message(), y.status().message()) << c.what;
    EXPECT_EQ(y.is_ok(), c.ok) << c.what << ": " << y.status().message();
    if (x && y) EXPECT_EQ(write_layout_json(*x), write_layout_json(*y)) << c.what;
  }
  LayoutBuilder wrong("membership");
  const Owned o;
  ASSERT_TRUE(wrong.head(doc_of(o)).is_ok());
  EXPECT_EQ(wrong.finish().status().code(), Code::kInternal);  // a document's head is finished with it
}

TEST(WriteLayout, RoundTripGivesTheSameRegions) {
  for (const json& doc : {formats_example(), two_domains()}) {
    auto a = parse(doc);
    ASSERT_TRUE(a) << a.status().message();
    const std::string text = write_layout_json(*a);
    auto b = parse_layout_json(text, "written.json");
    ASSERT_TRUE(b) << b.status().message() << "\n" << text;
    EXPECT_EQ(flatten(*a), flatten(*b));
    EXPECT_EQ(write_layout_json(*b), text);
    ASSERT_EQ(a->buffers.size(), b->buffers.size());  // rank sets come back as written
  }
}

TEST(WriteLayout, WrittenFileIsTheExplicitForm) {
  auto a = parse(formats_example());
  ASSERT_TRUE(a);
  const json j = json::parse(write_layout_json(*a));
  EXPECT_EQ(j["format"], "refit-layout/1");
  for (const json& t : j["tensors"]) {
    EXPECT_FALSE(t.contains("source"));
    EXPECT_FALSE(t.contains("receiver"));
  }
  // w: 2 source ranks + 2 receiver ranks; q: 2 source ranks (one replicated
  // Buffer); qkv: receiver rank 0.
  EXPECT_EQ(j["buffers"].size(), 7u);
  EXPECT_EQ(j["buffers"][0]["segments"][0]["tensor"], "w");
}

TEST(WriteLayout, EscapesNames) {
  json d = formats_example();
  d["tensors"][1]["name"] = "q\"\\\n\x01";
  d["buffers"][0]["segments"][0]["tensor"] = "q\"\\\n\x01";
  auto a = parse(d);
  ASSERT_TRUE(a) << a.status().message();
  auto b = parse_layout_json(write_layout_json(*a), "written.json");
  ASSERT_TRUE(b) << b.status().message();
  EXPECT_EQ(b->tensors[1].name, "q\"\\\n\x01");
}

TEST(WriteLayout, RecipeLayoutRoundTripPlansIdentically) {
  // A small Llama-like model through the recipes: rank sets, fused buffers
  // and padded vocabularies all survive the explicit form.
  const json m = refit::testing::small_llama_manifest();
  auto manifest = parse_manifest_json(m.dump(), "m.json");
  ASSERT_TRUE(manifest) << manifest.status().message();
  auto config = parse_model_config(refit::testing::small_llama_config().dump(), "m.config.json");
  ASSERT_TRUE(config) << config.status().message();
  manifest->config = *config;
  auto scenario = parse_scenario(R"J({"model": "m",
      "train": {"gpus": 4, "tp": 2, "dp": 2, "pp": 1, "gpus_per_domain": 4},
      "infer": {"gpus": 8, "tp": 4, "dp": 2, "gpus_per_domain": 4}})J",
                                 "s.json");
  ASSERT_TRUE(scenario) << scenario.status().message();
  auto a = layout_from_scenario(*scenario, *manifest);
  ASSERT_TRUE(a) << a.status().message();
  const std::string text = write_layout_json(*a);
  auto b = parse_layout_json(text, "written.json");
  ASSERT_TRUE(b) << b.status().message();
  EXPECT_EQ(flatten(*a), flatten(*b));
  auto pa = make_plan(*a);
  auto pb = make_plan(*b);
  ASSERT_TRUE(pa) << pa.status().message();
  ASSERT_TRUE(pb) << pb.status().message();
  const PlanSummary& x = pa->summary();
  const PlanSummary& y = pb->summary();
  EXPECT_EQ(x.network_bytes, y.network_bytes);
  EXPECT_EQ(x.minimum_network_bytes, y.minimum_network_bytes);
  EXPECT_EQ(x.local_bytes, y.local_bytes);
  EXPECT_EQ(x.units, y.units);
  EXPECT_EQ(x.pulls, y.pulls);
  EXPECT_EQ(x.chunks, y.chunks);
  EXPECT_EQ(x.max_source_nic_bytes, y.max_source_nic_bytes);
  EXPECT_EQ(x.max_receiver_nic_bytes, y.max_receiver_nic_bytes);
}

TEST(WriteRuns, HasTheFormatsShape) {
  auto l = parse(formats_example());
  ASSERT_TRUE(l);
  auto plan = make_plan(*l);
  ASSERT_TRUE(plan) << plan.status().message();
  const json j = json::parse(write_runs_json(*plan));
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j["format"], "refit-runs/1");
  ASSERT_TRUE(j["runs"].is_array());
  ASSERT_FALSE(j["runs"].empty());
  for (const json& r : j["runs"]) {
    ASSERT_EQ(r.size(), 4u) << r.dump();
    EXPECT_TRUE(r["kind"] == "net" || r["kind"] == "local");
    EXPECT_EQ(r["from"].size(), 4u);
    EXPECT_TRUE(r["from"]["side"].is_string());
    EXPECT_TRUE(r["from"]["rank"].is_number_integer());
    EXPECT_TRUE(r["from"]["buffer"].is_string());
    EXPECT_TRUE(r["from"]["offset"].is_number_integer());
    EXPECT_EQ(r["to"].size(), 3u);
    EXPECT_TRUE(r["to"]["rank"].is_number_integer());
    EXPECT_TRUE(r["to"]["buffer"].is_string());
    EXPECT_TRUE(r["to"]["offset"].is_number_integer());
    EXPECT_GT(r["bytes"].get<int64_t>(), 0);
  }
}

TEST(WriteRuns, ExecutedInOrderTheyFillEveryReceiver) {
  auto l = parse(two_domains());
  ASSERT_TRUE(l) << l.status().message();
  for (Strategy s : {Strategy::kRefit, Strategy::kNoDedup}) {
    for (int64_t chunk : {int64_t{4} << 20, int64_t{12}}) {
      PlanOptions o;
      o.strategy = s;
      o.chunk_bytes = chunk;
      auto plan = make_plan(*l, o);
      ASSERT_TRUE(plan) << plan.status().message();
      SCOPED_TRACE(std::string(strategy_name(s)) + " chunk " + std::to_string(chunk));
      execute_and_check(*l, plan->summary(), json::parse(write_runs_json(*plan)));
      // And the same on the layout read back from its explicit form.
      auto b = parse_layout_json(write_layout_json(*l), "written.json");
      ASSERT_TRUE(b) << b.status().message();
      auto pb = make_plan(*b, o);
      ASSERT_TRUE(pb) << pb.status().message();
      execute_and_check(*b, pb->summary(), json::parse(write_runs_json(*pb)));
    }
  }
}

}  // namespace
}  // namespace refit
