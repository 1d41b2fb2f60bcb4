// The plan compiler (plugin/receiver/plan_compiler.h) and the typed plan
// part it reads (transport/control/messages.h): pure, no UCX.
#include "plugin/receiver/plan_compiler.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace refit::plugin::receiver {
namespace {

using control::Json;
using control::PlanPart;
using control::PlanRun;
using control::Role;

constexpr int32_t kMe = 0;
constexpr uint64_t kSourceAddress = 0x10000;

// Rank 0 holds buffer "w" of 1024 bytes; source rank 5 holds "s" at
// kSourceAddress; receiver rank 1 of the domain holds "w" too.
class PlanCompiler : public ::testing::Test {
 protected:
  PlanCompiler() : memory_(1024) {
    buffers_.push_back(LocalBuffer{"w", memory_.data(), memory_.size(), false});
    part_.epoch = PlanEpoch{7, false};
    part_.peers.sources.push_back({5, {1, 2, 3}, {{"s", kSourceAddress, {9, 9}}}});
    part_.peers.receivers.push_back({1, {4, 5}, {{"w", 0x20000, {8}}}});
    part_.peers.domain = {{0, {6}}, {1, {4, 5}}};
  }
  static PlanRun get(uint64_t from, uint64_t to, uint64_t bytes) {
    return PlanRun{true, {Role::kSource, 5, "s", from}, {Role::kReceiver, kMe, "w", to}, bytes};
  }
  static PlanRun send(uint64_t from, int32_t to_rank, uint64_t to, uint64_t bytes) {
    return PlanRun{false, {Role::kReceiver, kMe, "w", from}, {Role::kReceiver, to_rank, "w", to}, bytes};
  }
  Result<std::shared_ptr<const CompiledPart>> compile() {
    return compile_plan(part_, kMe, buffers_, [this](int32_t rank, const std::string& buffer, const std::vector<uint8_t>&) {
      ++asked_[{rank, buffer}];
      return uint64_t{42};
    });
  }

  std::vector<uint8_t> memory_;
  std::vector<LocalBuffer> buffers_;
  PlanPart part_;
  std::map<std::pair<int32_t, std::string>, int> asked_;
};

TEST_F(PlanCompiler, AGetLandsInItsPlaceAndReleasesTheSendsThatReadIt) {
  part_.runs = {get(100, 0, 512), send(0, 1, 64, 256)};
  auto c = compile();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const CompiledPart& p = **c;
  ASSERT_EQ(p.gets.size(), 1u);
  EXPECT_EQ(p.gets[0].source, 5);
  EXPECT_EQ(p.gets[0].remote, kSourceAddress + 100);
  EXPECT_EQ(p.gets[0].local, memory_.data());
  EXPECT_EQ(p.gets[0].rkey_id, 42u);
  EXPECT_EQ(p.gets[0].device, nullptr);
  ASSERT_EQ(p.schedule.sends.size(), 1u);
  EXPECT_EQ(p.schedule.sends[0].peer, 0u);
  EXPECT_EQ(p.schedule.sends[0].offset, 64u);
  EXPECT_EQ(p.send_deps, std::vector<uint32_t>{1});
  EXPECT_EQ(p.dependents, std::vector<std::vector<uint32_t>>{{0}});
  EXPECT_EQ(p.network_bytes, 512u);
  EXPECT_EQ(p.local_bytes, 256u);
  EXPECT_EQ(p.written, (std::vector<Ranges>{{{0, 512}}}));
  EXPECT_EQ(p.schedule.epoch, part_.epoch);
  EXPECT_EQ(p.schedule.domain.size(), 2u);
  EXPECT_EQ((asked_[{5, "s"}]), 1) << "one rkey id per source buffer";
}

TEST_F(PlanCompiler, ASendSpanningTwoGetsWaitsForBoth) {
  part_.runs = {get(0, 512, 512), get(512, 0, 512), send(256, 1, 0, 512), send(0, 1, 512, 64)};
  auto c = compile();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ((*c)->send_deps, (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ((*c)->dependents, (std::vector<std::vector<uint32_t>>{{0}, {0, 1}}));
  EXPECT_EQ((*c)->written, (std::vector<Ranges>{{{0, 1024}}})) << "touching ranges merge";
}

TEST_F(PlanCompiler, ASendOfBytesThisRankNeverPullsIsRefused) {
  part_.runs = {get(0, 0, 256), send(128, 1, 0, 256)};
  auto c = compile();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("local run 0 passes on bytes that this rank does not pull"), std::string::npos)
      << c.status().message();
}

TEST_F(PlanCompiler, ARunOutsideTheBufferIsRefusedNamingTheRun) {
  part_.runs = {get(0, 0, 256), get(0, 1000, 25)};
  auto c = compile();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("run 1 [1000, +25) lies outside buffer \"w\" (1024 bytes)"), std::string::npos)
      << c.status().message();
}

TEST_F(PlanCompiler, ARunNamingAPeerThatIsNotListedIsRefused) {
  PlanRun r = get(0, 0, 16);
  r.from.rank = 6;
  part_.runs = {r};
  auto c = compile();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("source rank 6, which is not among the peers"), std::string::npos)
      << c.status().message();
  part_.runs = {send(0, 3, 0, 16)};
  c = compile();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("receiver rank 3, which is not among the peers"), std::string::npos);
}

TEST_F(PlanCompiler, AGetThroughALandingSlotNamesItsPlaceOnTheDevice) {
  buffers_[0].through_slot = true;
  part_.runs = {get(0, 128, 256)};
  auto c = compile();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_TRUE((*c)->through_slots);
  EXPECT_EQ((*c)->gets[0].local, nullptr);
  EXPECT_EQ((*c)->gets[0].device, memory_.data() + 128);
}

TEST_F(PlanCompiler, WhatAPeerSendsLandsInThisRanksBuffer) {
  part_.runs = {PlanRun{false, {Role::kReceiver, 1, "w", 0}, {Role::kReceiver, kMe, "w", 512}, 128}};
  auto c = compile();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  ASSERT_EQ((*c)->schedule.recvs.size(), 1u);
  EXPECT_EQ((*c)->schedule.recvs[0].dst, memory_.data() + 512);
  EXPECT_EQ((*c)->written, (std::vector<Ranges>{{{512, 128}}}));
  EXPECT_TRUE((*c)->gets.empty());
}

// The wire form: what the coordinator serializes, the receiver parses back
// to the same part; a bad field is refused by its name.
TEST(PlanMessages, APartRoundTripsThroughItsJson) {
  PlanPart p;
  p.version = 3;
  p.epoch = PlanEpoch{12, true};
  p.totals = control::PlanTotals{1000, 800, 200, true};
  p.runs = {PlanRun{true, {Role::kSource, 2, "s", 8}, {Role::kReceiver, 0, "w", 16}, 64}};
  p.peers.sources.push_back({2, {1, 2}, {{"s", 4096, {3}}}});
  p.peers.domain = {{0, {7}}};
  const Json j = control::to_json(p);
  EXPECT_EQ(j["epoch"].get<uint64_t>(), 12 | PlanEpoch::kWireSoloBit);
  Result<PlanPart> back = control::parse_plan_part(j);
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->epoch, p.epoch);
  EXPECT_EQ(control::to_json(*back), j);
}

TEST(PlanMessages, ABadFieldIsRefusedByItsName) {
  PlanPart p;
  p.epoch = PlanEpoch{1, false};
  p.runs = {PlanRun{true, {Role::kSource, 2, "s", 8}, {Role::kReceiver, 0, "w", 16}, 64}};
  Json j = control::to_json(p);
  j["runs"][0]["from"]["side"] = "elsewhere";
  Result<PlanPart> bad = control::parse_plan_part(j);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("runs[0].from.side must be \"source\" or \"receiver\""), std::string::npos)
      << bad.status().message();
  j = control::to_json(p);
  j["runs"][0]["bytes"] = 0;
  bad = control::parse_plan_part(j);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("runs[0].bytes must be positive"), std::string::npos) << bad.status().message();
  j = control::to_json(p);
  j["peers"]["sources"] = Json::array({Json{{"rank", -1}}});
  bad = control::parse_plan_part(j);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("peers.sources[0].rank"), std::string::npos) << bad.status().message();
}

TEST(PlanMessages, AnAbortNoticeCarriesItsVersionAndReason) {
  control::VersionNotice n{control::MsgType::kAbort, 2, 9, "receiver rank 1 failed"};
  Result<control::VersionNotice> back = control::parse_notice(control::MsgType::kAbort, control::to_json(n));
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->version, 9);
  EXPECT_EQ(back->instance, 2);
  EXPECT_EQ(back->reason, "receiver rank 1 failed");
  EXPECT_FALSE(control::parse_notice(control::MsgType::kCommit, Json{{"version", "9"}}).is_ok());
}

// A tensor converted on the way (docs/conversion.md): rank 0 holds "w" as
// F8_E4M3 [16, 16] in "q" and its 8 x 8 block scales [2, 2] in "qs"; the
// source serves it in BF16. The GET lands in the staging area, the
// conversion waits for it, and the sends of the converted bytes and of the
// scales wait for the conversion.
class PlanCompilerConvert : public PlanCompiler {
 protected:
  PlanCompilerConvert() : q_(256, 0), qs_(16, 0), staging_(1024, 0) {
    buffers_.push_back(LocalBuffer{"q", q_.data(), q_.size(), false});
    buffers_.push_back(LocalBuffer{"qs", qs_.data(), qs_.size(), false});
    part_.peers.receivers[0].buffers.push_back({"q", 0x30000, {7}});
    part_.peers.receivers[0].buffers.push_back({"qs", 0x40000, {7}});
  }
  PlanRun staged_get(uint64_t from, uint64_t stage, uint64_t bytes) const {
    PlanRun r{true, {Role::kSource, 5, "s", from}, {Role::kReceiver, kMe, "", stage}, bytes};
    r.to.stage = true;
    return r;
  }
  static PlanRun convert_step() {
    auto c = std::make_shared<control::ConvertSpec>();
    c->tensor = "w";
    c->from_dtype = "BF16";
    c->to_dtype = "F8_E4M3";
    c->block = {8, 8};
    c->stage = 0;
    c->start = {0, 0};
    c->size = {16, 16};
    c->buffer = "q";
    c->offset = 0;
    c->strides = {16, 1};
    c->scale_buffer = "qs";
    c->scale_offset = 0;
    c->scale_strides = {2, 1};
    PlanRun r;
    r.convert = std::move(c);
    return r;
  }
  static PlanRun send_of(const std::string& buffer, uint64_t from, uint64_t bytes) {
    return PlanRun{false, {Role::kReceiver, kMe, buffer, from}, {Role::kReceiver, 1, buffer, from}, bytes};
  }
  Result<std::shared_ptr<const CompiledPart>> compile_staged() {
    return compile_plan(
        part_, kMe, buffers_, [](int32_t, const std::string&, const std::vector<uint8_t>&) { return uint64_t{42}; },
        [this](uint64_t bytes) -> Result<uint8_t*> {
          staging_asked_ = bytes;
          return staging_.data();
        });
  }
  // A step into GPU memory: the CUDA kernel where the build has it, else
  // refused naming the tensor and the GPU.
  static void expect_gpu_step(const Result<std::shared_ptr<const CompiledPart>>& c, bool relayout) {
#ifdef REFIT_HAVE_CONVERT_KERNEL
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    ASSERT_EQ((*c)->converts.size(), 1u);
    EXPECT_EQ((*c)->converts[0].relayout, relayout);
    EXPECT_TRUE((*c)->converts[0].device);
#else
    (void)relayout;
    ASSERT_FALSE(c.is_ok());
    EXPECT_NE(c.status().message().find("\"w\""), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("GPU"), std::string::npos) << c.status().message();
#endif
  }
  std::vector<uint8_t> q_, qs_, staging_;
  uint64_t staging_asked_ = 0;
};

TEST_F(PlanCompilerConvert, ConversionWaitsForItsGetsAndItsSendsWaitForIt) {
  part_.runs = {staged_get(0, 0, 256), staged_get(256, 256, 256), convert_step(), send_of("q", 0, 256),
                send_of("qs", 0, 16)};
  auto c = compile_staged();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const CompiledPart& p = **c;
  EXPECT_EQ(staging_asked_, 512u);
  EXPECT_EQ(p.staging_bytes, 512u);
  ASSERT_EQ(p.gets.size(), 2u);
  EXPECT_EQ(p.gets[0].local, staging_.data());
  EXPECT_EQ(p.gets[1].local, staging_.data() + 256);
  ASSERT_EQ(p.converts.size(), 1u);
  EXPECT_EQ(p.converts[0].staged, staging_.data());
  EXPECT_EQ(p.converts[0].dst, q_.data());
  EXPECT_EQ(p.converts[0].scales, reinterpret_cast<float*>(qs_.data()));
  EXPECT_EQ(p.convert_deps, std::vector<uint32_t>{2});
  EXPECT_EQ(p.get_converts, (std::vector<std::vector<uint32_t>>{{0}, {0}}));
  // The GETs release no send; the conversion (index 2) releases both.
  EXPECT_EQ(p.send_deps, (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(p.dependents, (std::vector<std::vector<uint32_t>>{{}, {}, {0, 1}}));
  // Staged mode commits what the conversion wrote; the staging area is not a buffer.
  EXPECT_EQ(p.written[0], Ranges{});
  EXPECT_EQ(p.written[1], (Ranges{{0, 256}}));
  EXPECT_EQ(p.written[2], (Ranges{{0, 16}}));
}

// Into GPU memory: the CUDA kernel where the build has it, else refused
// naming the tensor.
TEST_F(PlanCompilerConvert, AConversionIntoGpuMemoryTakesTheCudaKernel) {
  buffers_[1].device = true;
  part_.runs = {staged_get(0, 0, 512), convert_step()};
  expect_gpu_step(compile_staged(), /*relayout=*/false);
}

TEST_F(PlanCompilerConvert, AStagedBoxBeyondTheStagingAreaIsRefused) {
  part_.runs = {staged_get(0, 0, 256), convert_step()};  // the box needs 512 staged bytes
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("staging area"), std::string::npos) << c.status().message();
}

TEST_F(PlanCompilerConvert, WithoutAStagingAreaStagedGetsAreRefused) {
  part_.runs = {staged_get(0, 0, 512), convert_step()};
  auto c = compile();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("staging"), std::string::npos) << c.status().message();
}

// A relayout (docs/refresh.md, "Column-major receivers"): "w" is BF16 on
// both sides, [8, 16] column-major in "q" (strides [1, 8]); the source's
// rows land row-major in the staging area and the step copies them into
// the columns.
PlanRun relayout_step(std::vector<int64_t> strides = {1, 8}, std::vector<int64_t> size = {8, 16}) {
  auto c = std::make_shared<control::ConvertSpec>();
  c->tensor = "w";
  c->from_dtype = "BF16";
  c->to_dtype = "BF16";
  c->stage = 0;
  c->start = {0, 0};
  c->size = std::move(size);
  c->buffer = "q";
  c->offset = 0;
  c->strides = std::move(strides);
  PlanRun r;
  r.convert = std::move(c);
  return r;
}

TEST_F(PlanCompilerConvert, ARelayoutWritesItsColumnsAsOneRangeAndReleasesTheSends) {
  part_.runs = {staged_get(0, 0, 128), staged_get(128, 128, 128), relayout_step(), send_of("q", 0, 256)};
  auto c = compile_staged();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const CompiledPart& p = **c;
  ASSERT_EQ(p.converts.size(), 1u);
  EXPECT_TRUE(p.converts[0].relayout);
  EXPECT_FALSE(p.converts[0].device);
  EXPECT_EQ(p.converts[0].dst, q_.data());
  EXPECT_EQ(p.convert_deps, std::vector<uint32_t>{2});
  EXPECT_EQ(p.send_deps, std::vector<uint32_t>{1});
  EXPECT_EQ(p.dependents, (std::vector<std::vector<uint32_t>>{{}, {}, {0}}));
  // The 16 columns of 16 bytes follow each other: one range, not 128.
  EXPECT_EQ(p.written[1], (Ranges{{0, 256}}));
}

TEST_F(PlanCompilerConvert, ARelayoutOfAColumnBlockWritesOneRangePerColumn) {
  // Rows [0, 8) of columns [0, 4) of a column-major tensor of 16 rows:
  // strides [1, 16].
  part_.runs = {staged_get(0, 0, 64), relayout_step({1, 16}, {8, 4})};
  auto c = compile_staged();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  Ranges want;
  for (uint64_t col = 0; col < 4; ++col) want.emplace_back(col * 32, 16);
  EXPECT_EQ((*c)->written[1], want);
}

TEST_F(PlanCompilerConvert, ARelayoutBeyondTheStagingAreaIsRefusedNamingTheTensor) {
  part_.runs = {staged_get(0, 0, 128), relayout_step()};  // the box needs 256 staged bytes
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("relayouts tensor \"w\""), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("staging area"), std::string::npos) << c.status().message();
}

TEST_F(PlanCompilerConvert, ARelayoutOfAnEmptyOrOverflowingBoxIsRefused) {
  part_.runs = {staged_get(0, 0, 256), relayout_step({1, 0, 8}, {8, 0, 16})};
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("none of size 0"), std::string::npos) << c.status().message();
  const int64_t huge = int64_t{1} << 62;
  part_.runs = {staged_get(0, 0, 256), relayout_step({0, 0, 0}, {huge, huge, 4})};
  c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("too large"), std::string::npos) << c.status().message();
}

TEST_F(PlanCompilerConvert, ARelayoutPastTheBufferIsRefused) {
  part_.runs = {staged_get(0, 0, 256), relayout_step({1, 9})};  // the last element lands at 7 + 15 * 9
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("writes past the end of buffer \"q\""), std::string::npos)
      << c.status().message();
  part_.runs = {staged_get(0, 0, 256), relayout_step({1, int64_t{1} << 62})};  // the extent overflows
  c = compile_staged();
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("writes past the end"), std::string::npos) << c.status().message();
}

// "size" of a convert step counts from 1 on the wire: a 0 is refused by
// its name before any compiler sees it.
TEST(PlanMessages, AConvertStepWithASizeOfZeroIsRefusedByItsName) {
  PlanPart p;
  p.epoch = PlanEpoch{1, false};
  p.runs = {relayout_step()};
  Json j = control::to_json(p);
  ASSERT_TRUE(control::parse_plan_part(j).is_ok());
  j["runs"][0]["size"][1] = 0;
  j = Json::parse(j.dump());  // as it arrives: a literal 0 reads as an unsigned number
  Result<PlanPart> bad = control::parse_plan_part(j);
  ASSERT_FALSE(bad.is_ok()) << "a convert step of size [8, 0] was parsed";
  EXPECT_NE(bad.status().message().find("runs[0].size[1]"), std::string::npos) << bad.status().message();
}

// The CUDA relayout kernel stores whole elements: into GPU memory that is
// not aligned to the element size, a store would fault and leave the
// context unusable. Refused instead (a 2-byte element at an odd address).
TEST_F(PlanCompilerConvert, ARelayoutIntoMisalignedGpuMemoryIsRefused) {
  buffers_[1].data = q_.data() + 1;  // "q" starts at an odd address
  buffers_[1].bytes = q_.size() - 1;
  buffers_[1].device = true;
  part_.runs = {staged_get(0, 0, 64), relayout_step({1, 16}, {8, 4})};
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "a relayout of 2-byte elements to an odd GPU address was accepted";
#ifdef REFIT_HAVE_CONVERT_KERNEL
  EXPECT_NE(c.status().message().find("aligned"), std::string::npos) << c.status().message();
#else
  // A build without the kernel (the sanitizer builds: no CUDA) refuses any
  // relayout into GPU memory before looking at its alignment.
  EXPECT_NE(c.status().message().find("needs the CUDA relayout kernel"), std::string::npos) << c.status().message();
#endif
}

// Every byte has one writer: a GET and a relayout into the same bytes (or
// two GETs) would leave whichever lands last.
TEST_F(PlanCompilerConvert, TwoRunsWritingOneByteAreRefused) {
  const PlanRun direct{true, {Role::kSource, 5, "s", 0}, {Role::kReceiver, kMe, "q", 254}, 2};
  part_.runs = {staged_get(0, 0, 256), relayout_step(), direct};
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "a GET and a relayout writing byte 254 of \"q\" were accepted";
  EXPECT_NE(c.status().message().find("runs 1 and 2 both write byte 254 of buffer \"q\""), std::string::npos)
      << c.status().message();
  const PlanRun left{true, {Role::kSource, 5, "s", 0}, {Role::kReceiver, kMe, "q", 0}, 100};
  const PlanRun right{true, {Role::kSource, 5, "s", 0}, {Role::kReceiver, kMe, "q", 99}, 100};
  part_.runs = {left, right};
  c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "two GETs writing byte 99 of \"q\" were accepted";
  EXPECT_NE(c.status().message().find("both write byte 99"), std::string::npos) << c.status().message();
  // Side by side, and a relayout beside a GET: accepted.
  const PlanRun after{true, {Role::kSource, 5, "s", 0}, {Role::kReceiver, kMe, "q", 100}, 100};
  part_.runs = {left, after};
  ASSERT_TRUE(compile_staged().is_ok());
  part_.runs = {staged_get(0, 0, 64), relayout_step({1, 16}, {8, 4}),
                PlanRun{true, {Role::kSource, 5, "s", 0}, {Role::kReceiver, kMe, "q", 16}, 16}};
  auto beside = compile_staged();
  ASSERT_TRUE(beside.is_ok()) << beside.status().message();
}

// The block count of a quantized box adds its start, size and block, each
// up to 2^62 on the wire: refused before the sum can overflow.
TEST_F(PlanCompilerConvert, AQuantizedBoxWhoseBlockArithmeticOverflowsIsRefused) {
  auto c = std::make_shared<control::ConvertSpec>(*convert_step().convert);
  c->start = {0, int64_t{1} << 62};
  c->block = {8, int64_t{1} << 62};
  PlanRun step;
  step.convert = c;
  part_.runs = {staged_get(0, 0, 512), step};
  auto compiled = compile_staged();
  ASSERT_FALSE(compiled.is_ok());
  EXPECT_NE(compiled.status().message().find("start 4611686018427387904 in dim 1"), std::string::npos)
      << compiled.status().message();
}

// A step of a dim of size 0 converts nothing, but the cast walks a row of
// it: refused, as a relayout's is, before it reads past its staged box.
TEST_F(PlanCompilerConvert, AConversionOfABoxWithADimOfSizeZeroIsRefused) {
  auto c = std::make_shared<control::ConvertSpec>(*convert_step().convert);
  c->to_dtype = "F16";
  c->scale_buffer.clear();
  c->scale_strides.clear();
  c->size = {0, 16};
  c->strides = {0, 1};
  c->stage = 512;  // the end of the staging area: a row read there is past it
  PlanRun step;
  step.convert = c;
  part_.runs = {staged_get(0, 0, 512), step};
  auto compiled = compile_staged();
  ASSERT_FALSE(compiled.is_ok()) << "a cast of 0 x 16 elements staged at the end of the staging area was accepted";
  EXPECT_NE(compiled.status().message().find("size 0"), std::string::npos) << compiled.status().message();
}

// A step reads its whole staged box: a byte of it that no GET of the part
// brings would be whatever the staging area held, written into the weights.
TEST_F(PlanCompilerConvert, AStepReadingStagedBytesNoGetBringsIsRefused) {
  // The box is staged bytes [0, 256); the GETs bring [0, 128) and [192, 320).
  part_.runs = {staged_get(0, 0, 128), staged_get(192, 192, 128), relayout_step()};
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "a relayout of staged bytes [128, 192) that no GET brings was accepted";
  EXPECT_NE(c.status().message().find("relayouts tensor \"w\""), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("no GET"), std::string::npos) << c.status().message();
  // Nothing staged before it at all.
  part_.runs = {relayout_step(), staged_get(0, 512, 256)};
  c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "a relayout of staged bytes no GET brings was accepted";
}

// The wire has no negative stride, but a step's strides are checked where
// they are used: a negative one is refused by name, not left to the copy.
TEST_F(PlanCompilerConvert, ARelayoutWithANegativeStrideIsRefused) {
  part_.runs = {staged_get(0, 0, 256), relayout_step({-5, 1}, {1, 16})};
  auto c = compile_staged();
  ASSERT_FALSE(c.is_ok()) << "a relayout with stride -5 was accepted";
  EXPECT_NE(c.status().message().find("stride"), std::string::npos) << c.status().message();
}

// Two elements of the box at one place: the copy's result would depend on
// its order (and race on the GPU); the layout never has it (check_region).
TEST_F(PlanCompilerConvert, ARelayoutWhoseStridesMapTwoElementsToOnePlaceIsRefused) {
  for (const std::vector<int64_t>& strides : {std::vector<int64_t>{0, 1}, std::vector<int64_t>{1, 1},
                                              std::vector<int64_t>{8, 4}}) {
    part_.runs = {staged_get(0, 0, 256), relayout_step(strides, {8, 16})};
    auto c = compile_staged();
    ASSERT_FALSE(c.is_ok()) << "strides [" << strides[0] << ", " << strides[1] << "] were accepted";
    EXPECT_NE(c.status().message().find("same place"), std::string::npos) << c.status().message();
  }
  // Interleaved but one-to-one (elements 0, 2, 3, 5 of a [2, 2] box): kept.
  part_.runs = {staged_get(0, 0, 8), relayout_step({3, 2}, {2, 2})};
  auto c = compile_staged();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ((*c)->written[1], (Ranges{{0, 2}, {4, 4}, {10, 2}}));
}

// A cast's rows that overlap (rows 8 elements apart, 16 long) would be
// written twice: refused as a relayout's are, before anything runs.
TEST_F(PlanCompilerConvert, ACastWhoseRowsOverlapIsRefused) {
  auto c = std::make_shared<control::ConvertSpec>(*convert_step().convert);
  c->to_dtype = "F16";
  c->scale_buffer.clear();
  c->scale_strides.clear();
  c->size = {8, 16};
  c->strides = {8, 1};
  PlanRun step;
  step.convert = c;
  part_.runs = {staged_get(0, 0, 512), step};
  auto compiled = compile_staged();
  ASSERT_FALSE(compiled.is_ok()) << "a cast of rows 8 elements apart, 16 long, was accepted";
  EXPECT_NE(compiled.status().message().find("converts tensor \"w\""), std::string::npos) << compiled.status().message();
  EXPECT_NE(compiled.status().message().find("same place"), std::string::npos) << compiled.status().message();
  c->strides = {16, 1};
  auto kept = compile_staged();
  ASSERT_TRUE(kept.is_ok()) << kept.status().message();
}

// What a relayout records as written is every byte it writes and no other,
// for boxes of 1 to 3 dims in any memory order, padded or not: compared with
// the bytes relayout_box's walk reaches.
TEST_F(PlanCompilerConvert, ARelayoutRecordsExactlyTheBytesItWrites) {
  struct Case {
    std::vector<int64_t> size, strides;
    uint64_t offset;
  };
  const std::vector<Case> cases = {
      {{16}, {1}, 3},           {{16}, {3}, 0},           {{4, 4}, {1, 4}, 0},     {{4, 4}, {1, 5}, 2},
      {{4, 4}, {4, 1}, 1},      {{2, 3, 4}, {1, 2, 6}, 0}, {{2, 3, 4}, {12, 1, 3}, 0}, {{2, 3, 4}, {30, 1, 5}, 1},
      {{3, 1, 4}, {1, 99, 3}, 0}, {{2, 2, 2}, {1, 4, 2}, 0}};
  for (const Case& k : cases) {
    uint64_t numel = 1;
    for (int64_t s : k.size) numel *= static_cast<uint64_t>(s);
    PlanRun step = relayout_step(k.strides, k.size);
    std::const_pointer_cast<control::ConvertSpec>(step.convert)->offset = k.offset;
    part_.runs = {staged_get(0, 0, numel * 2), step};
    auto c = compile_staged();
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    std::vector<bool> hit(q_.size(), false);
    std::vector<int64_t> idx(k.size.size(), 0);
    for (uint64_t e = 0; e < numel; ++e) {
      uint64_t at = k.offset;
      for (size_t d = 0; d < idx.size(); ++d) at += static_cast<uint64_t>(idx[d] * k.strides[d]);
      hit[at * 2] = hit[at * 2 + 1] = true;
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < k.size[d]) break;
        idx[d] = 0;
      }
    }
    Ranges want;
    for (uint64_t b = 0; b < hit.size(); ++b) {
      if (!hit[b]) continue;
      if (!want.empty() && want.back().first + want.back().second == b) {
        ++want.back().second;
      } else {
        want.emplace_back(b, 1);
      }
    }
    EXPECT_EQ((*c)->written[1], want) << "box of " << k.size.size() << " dims, strides[0] " << k.strides[0];
  }
}

// Into GPU memory: the CUDA relayout kernel where the build has it, else
// refused naming the tensor.
TEST_F(PlanCompilerConvert, ARelayoutIntoGpuMemoryTakesTheCudaKernel) {
  buffers_[1].device = true;
  part_.runs = {staged_get(0, 0, 256), relayout_step()};
  expect_gpu_step(compile_staged(), /*relayout=*/true);
}

}  // namespace
}  // namespace refit::plugin::receiver
