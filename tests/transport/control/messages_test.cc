#include "transport/control/messages.h"

#include <gtest/gtest.h>

#include <limits>
#include <memory>

namespace refit::control {
namespace {

// The hint the two "too many runs" messages end with (messages.cc).
const std::string kManyRunsHint =
    " (a receiver's \"max_plan_runs\" sets the limit, at most 2^26; a receiver that holds a tensor in another memory "
    "order than its source, column-major from a row-major trainer, gets a run per element: the coordinator's "
    "\"relayout_below_bytes\" pulls such tensors in large transfers, docs/refresh.md \"Column-major receivers\")";

RegisterSource a_source() {
  RegisterSource m;
  m.rank = 2;
  m.domain = 1;
  m.worker_address = {1, 2, 3};
  m.tensors.push_back(TensorDecl{"layers.0.w", "BF16", {4, 8}});
  m.buffers.push_back(MemberBuffer{"w", "BF16", 64, 0x1000, {9, 9}, {Segment{"layers.0.w", {0, 0}, {4, 8}, 0, {8, 1}}}});
  return m;
}

TEST(Messages, RegisterSourceRoundTrips) {
  auto r = parse_register_source(to_json(a_source()), MessageLimits{});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->rank, 2);
  ASSERT_EQ(r->tensors.size(), 1u);
  EXPECT_EQ(r->tensors[0].shape, (std::vector<int64_t>{4, 8}));
  ASSERT_EQ(r->buffers.size(), 1u);
  EXPECT_EQ(r->buffers[0].rkey, (std::vector<uint8_t>{9, 9}));
  EXPECT_EQ(r->buffers[0].segments[0].strides, (std::vector<int64_t>{8, 1}));
}

TEST(Messages, RegisterReceiverRoundTrips) {
  RegisterReceiver m;
  m.rank = 5;
  m.instance = 1;
  m.domain = 3;
  m.worker_address = {7};
  m.weight_block_size = {64, 32};
  m.buffers.push_back(MemberBuffer{"buf", "BF16", 128, 0, {}, {Segment{"w", {0, 0}, {4, 8}, 0, {8, 1}}}});
  auto r = parse_register_receiver(to_json(m), MessageLimits{});
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->buffers[0].segments[0].size, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(r->weight_block_size, (std::array<int64_t, 2>{64, 32}));
  Json bad = to_json(m);
  bad["buffers"][0]["segments"][0]["strides"] = Json::array({1});
  auto b = parse_register_receiver(bad, MessageLimits{});
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().message(),
            "register_receiver: buffers[0].segments[0] has 2 start, 2 size and 1 strides dims; they must agree");
}

TEST(Messages, NamesTheFieldAndTheProblem) {
  Json j = to_json(a_source());
  j["rank"] = -1;
  auto r = parse_register_source(j, MessageLimits{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "register_source: rank must be an integer in [0, 1048575], got -1");
  j = to_json(a_source());
  j["buffers"][0]["bytes"] = "x";
  r = parse_register_source(j, MessageLimits{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(),
            "register_source: buffers[0].bytes must be an integer in [0, 9223372036854775807], got \"x\"");
  j = to_json(a_source());
  j.erase("worker_address");
  r = parse_register_source(j, MessageLimits{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "register_source: worker_address is missing");
  r = parse_register_source(Json::array(), MessageLimits{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), "register_source: body must be a map");
}

TEST(Messages, BoundsCountsAndStrings) {
  MessageLimits lim;
  lim.max_tensors = 2;
  lim.max_name_bytes = 8;
  RegisterSource m = a_source();
  auto r = parse_register_source(to_json(m), lim);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("tensors[0].name must be 1 to 8 bytes, got 10"), std::string::npos)
      << r.status().message();
  m.tensors.assign(3, TensorDecl{"w", "BF16", {1}});
  r = parse_register_source(to_json(m), lim);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("has 3 entries, more than the limit of 2"), std::string::npos);
  m.tensors.assign(1, TensorDecl{"w", "BF16", std::vector<int64_t>(9, 1)});
  r = parse_register_source(to_json(m), MessageLimits{});
  ASSERT_FALSE(r.is_ok());
}

TEST(Messages, MemberRefAndPublish) {
  auto m = parse_member_ref(Json{{"role", "receiver"}, {"rank", 4}}, "heartbeat", MessageLimits{});
  ASSERT_TRUE(m.is_ok());
  EXPECT_EQ(m->role, Role::kReceiver);
  auto bad = parse_member_ref(Json{{"role", "trainer"}, {"rank", 4}}, "heartbeat", MessageLimits{});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "heartbeat: role must be \"source\" or \"receiver\", got \"trainer\"");
  EXPECT_FALSE(parse_publish_version(Json{{"version", 0}}).is_ok());
  EXPECT_TRUE(parse_publish_version(Json{{"version", 3}}).is_ok());
}

TEST(Messages, PublishWithHashes) {
  const Json good = Json::parse(R"({"version": 2, "hashes": [{"rank": 1, "tensor": "w", "start": [0, 4],
                                    "size": [2, 4], "hash": 18446744073709551615}]})");
  auto m = parse_publish_version(good);
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  ASSERT_EQ(m->hashes.size(), 1u);
  EXPECT_EQ(m->hashes[0].hash, 18446744073709551615u);
  EXPECT_EQ(m->hashes[0].size, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(to_json(m->hashes[0]), good["hashes"][0]);
  Json no_hash = good;
  no_hash["hashes"][0].erase("hash");
  EXPECT_EQ(parse_publish_version(no_hash).status().message(), "publish_version: hashes[0].hash is missing");
  Json negative = good;
  negative["hashes"][0]["hash"] = -1;
  EXPECT_EQ(parse_publish_version(negative).status().message(),
            "publish_version: hashes[0].hash must be an unsigned integer, got -1");
  Json dims = good;
  dims["hashes"][0]["size"] = {2};
  EXPECT_EQ(parse_publish_version(dims).status().message(),
            "publish_version: hashes[0] has 2 start and 1 size dims; they must agree");
  MessageLimits lim;
  lim.max_segments = 0;
  EXPECT_EQ(parse_publish_version(good, "publish_version", lim).status().message(),
            "publish_version: hashes has 1 entries, more than the limit of 0");
  auto vh = parse_version_hashes(Json{{"rank", 3}, {"version", 0}}, MessageLimits{});
  EXPECT_EQ(vh.status().message(),
            "version_hashes: version must be an integer in [1, 9223372036854775807], got 0");
}

// A plan part with a tensor converted on the way (docs/conversion.md): a GET
// into the staging area and the conversion step survive the wire.
TEST(Messages, PlanRunsWithAConversionRoundTrip) {
  PlanRun get{true, {Role::kSource, 3, "w", 64}, {Role::kReceiver, 0, "", 128}, 512};
  get.to.stage = true;
  auto c = std::make_shared<ConvertSpec>();
  c->tensor = "w";
  c->from_dtype = "BF16";
  c->to_dtype = "F8_E4M3";
  c->block = {64, 32};
  c->stage = 128;
  c->size = {2, 128, 64};
  c->start = {1, 128, 64};
  c->buffer = "q";
  c->offset = 4096;
  c->strides = {16384, 128, 1};
  c->scale_buffer = "qs";
  c->scale_offset = 8;
  c->scale_strides = {8, 4, 1};
  PlanRun conv;
  conv.convert = c;
  Json runs = Json::array({to_json(get), to_json(conv)});
  auto parsed = parse_plan_runs(runs);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
  ASSERT_EQ(parsed->size(), 2u);
  EXPECT_TRUE((*parsed)[0].to.stage);
  EXPECT_EQ((*parsed)[0].to.offset, 128u);
  EXPECT_EQ((*parsed)[0].convert, nullptr);
  ASSERT_NE((*parsed)[1].convert, nullptr);
  const ConvertSpec& p = *(*parsed)[1].convert;
  EXPECT_EQ(p.tensor, "w");
  EXPECT_EQ(p.to_dtype, "F8_E4M3");
  EXPECT_EQ(p.block, (std::array<int64_t, 2>{64, 32}));
  EXPECT_EQ(p.start, c->start);
  EXPECT_EQ(p.size, c->size);
  EXPECT_EQ(p.strides, c->strides);
  EXPECT_EQ(p.scale_buffer, "qs");
  EXPECT_EQ(p.scale_offset, 8u);
  EXPECT_EQ(p.scale_strides, c->scale_strides);
  // A conversion without its box is refused, naming the field.
  Json bad = runs;
  bad[1].erase("size");
  auto refused = parse_plan_runs(bad);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("runs[1].size"), std::string::npos) << refused.status().message();
}


// A run group (docs/refresh.md, "The plan part"): one entry on the wire,
// its runs expanded in order, each a plain run at its offsets.
Json a_group(int64_t count, int64_t from_stride, int64_t to_stride) {
  Json g = to_json(PlanRun{true, {Role::kSource, 3, "w", 4096}, {Role::kReceiver, 0, "q", 512}, 256});
  g["count"] = count;
  g["stride"] = {from_stride, to_stride};
  return g;
}

// Why parse_plan_runs refuses `runs` ("accepted" if it does not); the
// coordinator's check without the runs (check_plan_runs) must say the same,
// and count what the parse expands.
std::string refusal(const Json& runs, const MessageLimits& lim = MessageLimits{}) {
  auto parsed = parse_plan_runs(runs, lim);
  auto checked = check_plan_runs(runs, lim);
  EXPECT_EQ(checked.status().message(), parsed.status().message());
  if (parsed.is_ok() && checked.is_ok()) EXPECT_EQ(*checked, parsed->size());
  return parsed.is_ok() ? "accepted" : parsed.status().message();
}

TEST(Messages, ARunGroupExpandsToItsRunsInOrder) {
  const PlanRun local{false, {Role::kReceiver, 0, "q", 0}, {Role::kReceiver, 1, "q", 64}, 16};
  Json runs = Json::array({a_group(3, 1024, 256), to_json(local), a_group(2, -512, 0)});
  EXPECT_EQ(refusal(runs), "accepted");  // and counted as 6 without them (check_plan_runs)
  auto parsed = parse_plan_runs(runs);
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().message();
  ASSERT_EQ(parsed->size(), 6u);
  const uint64_t from[] = {4096, 5120, 6144, 0, 4096, 3584};
  const uint64_t to[] = {512, 768, 1024, 64, 512, 512};
  for (size_t i = 0; i < 6; ++i) {
    const PlanRun& r = (*parsed)[i];
    EXPECT_EQ(r.from.offset, from[i]) << "run " << i;
    EXPECT_EQ(r.to.offset, to[i]) << "run " << i;
    EXPECT_EQ(r.network, i != 3) << "run " << i;
    EXPECT_EQ(r.bytes, i == 3 ? 16u : 256u) << "run " << i;
    EXPECT_EQ(r.from.buffer, i == 3 ? "q" : "w") << "run " << i;
    EXPECT_EQ(r.to.buffer, "q");
  }
  EXPECT_EQ((*parsed)[4].from.rank, 3);
  // An entry without "count" is one run, as parts without groups always were.
  Json plain = Json::array({to_json(local)});
  ASSERT_TRUE(parse_plan_runs(plain).is_ok());
  EXPECT_EQ(parse_plan_runs(plain)->size(), 1u);
  // A group into the staging area keeps "stage" in every run.
  Json staged = a_group(2, 256, 256);
  staged["to"] = {{"rank", 0}, {"stage", true}, {"offset", 0}};
  auto s = parse_plan_runs(Json::array({staged}));
  ASSERT_TRUE(s.is_ok()) << s.status().message();
  EXPECT_TRUE((*s)[1].to.stage);
  EXPECT_EQ((*s)[1].to.offset, 256u);
}

TEST(Messages, ARunGroupIsRefusedNamingTheRunAndTheField) {
  Json g = a_group(2, 1, 1);
  g["count"] = 1;
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].count must be an integer in [2, 16777216], got 1");
  g["count"] = "2";
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].count must be an integer in [2, 16777216], got \"2\"");
  g = a_group(2, 1, 1);
  g.erase("stride");
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].stride is missing");
  g = a_group(2, 1, 1);
  g.erase("count");
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].stride is given without \"count\"");
  g = a_group(2, 1, 1);
  g["stride"] = {1};
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].stride must be [from_stride, to_stride], got [1]");
  g["stride"] = {1, 0.5};
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].stride[1] must be an integer in [-2^63, 2^63), got 0.5");
  g["stride"] = {uint64_t{1} << 63, 0};
  EXPECT_EQ(refusal(Json::array({g})),
            "plan: runs[0].stride[0] must be an integer in [-2^63, 2^63), got 9223372036854775808");
  // Every run's offsets, computed without overflow.
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(refusal(Json::array({a_group(40, max / 20, 0)})),
            "plan: runs[0].stride takes from.offset of run 20 of 40 past 2^63 - 1");
  EXPECT_EQ(refusal(Json::array({a_group(40, max, 0)})),
            "plan: runs[0].stride takes from.offset of run 1 of 40 past 2^63 - 1");
  EXPECT_EQ(refusal(Json::array({a_group(40, 1, -100)})),
            "plan: runs[0].stride takes to.offset of run 6 of 40 below 0");
  EXPECT_EQ(refusal(Json::array({a_group(3, std::numeric_limits<int64_t>::min(), 0)})),
            "plan: runs[0].stride takes from.offset of run 1 of 3 below 0");
  g = a_group(2, 1, 1);
  g["from"]["offset"] = uint64_t{1} << 63;
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].stride takes from.offset of run 0 of 2 past 2^63 - 1");
  // Each run as a plain run is checked: the group's first.
  g = a_group(2, 1, 1);
  g["bytes"] = 0;
  EXPECT_EQ(refusal(Json::array({g})), "plan: runs[0].bytes must be positive, got 0");
  // A conversion step is never a group.
  PlanRun conv;
  auto c = std::make_shared<ConvertSpec>();
  c->tensor = "w";
  c->from_dtype = "BF16";
  c->to_dtype = "F32";
  c->buffer = "q";
  conv.convert = c;
  Json step = to_json(conv);
  step["count"] = 2;
  EXPECT_EQ(refusal(Json::array({step})), "plan: runs[0].count is given on a \"convert\" step, which is never grouped");
}

// A small frame cannot expand into more runs than the limit: the expanded
// total is bounded, not only the entries.
TEST(Messages, ARunGroupCannotExpandPastTheRunLimit) {
  MessageLimits lim;
  lim.max_runs = 100;
  EXPECT_EQ(refusal(Json::array({a_group(101, 1, 1)}), lim),
            "plan: runs[0].count asks for 101 runs, more than the limit of 100" + kManyRunsHint);
  EXPECT_EQ(refusal(Json::array({a_group(60, 256, 256), a_group(41, 256, 256)}), lim),
            std::string("plan: runs[1].count expands the part to 101 runs, more than the limit of 100") + kManyRunsHint);
  const Json plain = to_json(PlanRun{true, {Role::kSource, 3, "w", 0}, {Role::kReceiver, 0, "q", 0}, 8});
  EXPECT_EQ(refusal(Json::array({a_group(99, 256, 256), plain, plain}), lim),
            "plan: runs[2] expands the part past the limit of 100 runs" + kManyRunsHint);
  auto at_limit = parse_plan_runs(Json::array({a_group(60, 256, 256), a_group(40, 256, 256)}), lim);
  ASSERT_TRUE(at_limit.is_ok()) << at_limit.status().message();
  EXPECT_EQ(at_limit->size(), 100u);
  // The default limit: a group of more than 2^24 runs is refused.
  EXPECT_EQ(refusal(Json::array({a_group(int64_t{1} << 40, 1, 1)})),
            "plan: runs[0].count asks for 1099511627776 runs, more than the limit of 16777216" + kManyRunsHint);
  // Counted without expanding: a part of 2^24 runs in two groups.
  auto counted = check_plan_runs(Json::array({a_group(int64_t{1} << 23, 1, 1), a_group(int64_t{1} << 23, 1, 1)}));
  ASSERT_TRUE(counted.is_ok()) << counted.status().message();
  EXPECT_EQ(*counted, size_t{1} << 24);
  // The same through the whole reply; a receiver asking only whom the part
  // reads from does not parse its runs.
  Json part = to_json(PlanPart{});
  part["runs"] = Json::array({a_group(60, 256, 256), a_group(41, 256, 256)});
  auto peers_only = parse_plan_part(part, lim, /*with_runs=*/false);
  ASSERT_TRUE(peers_only.is_ok()) << peers_only.status().message();
  EXPECT_TRUE(peers_only->runs.empty());
  auto whole = parse_plan_part(part, lim);
  ASSERT_FALSE(whole.is_ok());
  EXPECT_EQ(whole.status().message(),
            std::string("plan: runs[1].count expands the part to 101 runs, more than the limit of 100") + kManyRunsHint);
}

}  // namespace
}  // namespace refit::control
