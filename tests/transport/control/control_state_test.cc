#include "transport/control/control_state.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>

#include "planner/conversion.h"
#include "planner/layout_json.h"
#include "planner/plan.h"

namespace refit::control {
namespace {

using namespace std::chrono_literals;

RegisterSource source(int32_t rank) {
  RegisterSource m;
  m.rank = rank;
  m.worker_address = {1};
  return m;
}

// One source holding "w" whole in `from`; receivers 0 and 1 of one domain
// holding it whole in `to` (and, when `scales`, its block scales, block 2x2).
PlanInput conversion_input(const std::string& from, const std::string& to, bool scales) {
  PlanInput in;
  in.epoch = 1;
  in.source_ranks = {0};
  in.receiver_ranks = {0, 1};
  std::string buffers;
  for (int r = 0; r < 2; ++r) {
    buffers += std::string(r ? "," : "") + R"({"side": "receiver", "rank": )" + std::to_string(r) +
               R"(, "name": "w", "dtype": ")" + to + R"(", "bytes": 64,
                  "segments": [{"tensor": "w", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]}]})";
    if (scales) {
      buffers += R"(, {"side": "receiver", "rank": )" + std::to_string(r) + R"(, "name": "s", "dtype": "F32", "bytes": 16,
                  "segments": [{"tensor": "w_scale_inv", "start": [0, 0], "size": [2, 2], "offset": 0, "strides": [2, 1]}]})";
    }
  }
  in.layout_json = R"({"format": "refit-layout/1", "weight_block_size": [2, 2],
     "sources": [{"rank": 0, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 1}],
     "tensors": [{"name": "w", "dtype": ")" + from + R"(", "shape": [4, 4]})" +
                   std::string(scales ? R"(, {"name": "w_scale_inv", "dtype": "F32", "shape": [2, 2]})" : "") + R"(],
     "buffers": [{"side": "source", "rank": 0, "name": "w", "dtype": ")" + from + R"(", "bytes": 64,
                  "segments": [{"tensor": "w", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]}]}, )" +
                   buffers + "]}";
  return in;
}

// A tensor converted on the way (docs/conversion.md): the puller GETs the
// sources' dtype into its staging area, converts, and passes the converted
// bytes and the block scales to the other rank of its domain.
TEST(ComputePlan, QuantizesAtThePullerAndFansOutTheConvertedBytes) {
  auto parts = compute_plan(conversion_input("BF16", "F8_E4M3", true));
  ASSERT_TRUE(parts->status.is_ok()) << parts->status.message();
  int pullers = 0;
  for (const auto& [rank, compact] : parts->parts) {
    const Json runs = parts->part(rank);
    bool converts = false;
    uint64_t staged = 0, local_w = 0, local_s = 0;
    for (const Json& run : runs) {
      if (run["kind"] == "convert") {
        converts = true;
        EXPECT_EQ(run["from_dtype"], "BF16");
        EXPECT_EQ(run["to_dtype"], "F8_E4M3");
        EXPECT_EQ(run["scales"]["buffer"], "s");
      } else if (run["kind"] == "net") {
        EXPECT_TRUE(run["to"]["stage"].get<bool>()) << run.dump();
        staged += run["bytes"].get<uint64_t>();
      } else if (run["from"]["rank"] == rank) {
        (run["from"]["buffer"] == "w" ? local_w : local_s) += run["bytes"].get<uint64_t>();
      }
    }
    if (!converts) continue;
    ++pullers;
    EXPECT_EQ(staged, 32u);   // 16 BF16 elements
    EXPECT_EQ(local_w, 16u);  // 16 E4M3 bytes
    EXPECT_EQ(local_s, 16u);  // 4 F32 scales
  }
  EXPECT_EQ(pullers, 1);
}

TEST(ComputePlan, CastsWithoutScales) {
  auto parts = compute_plan(conversion_input("F32", "BF16", false));
  ASSERT_TRUE(parts->status.is_ok()) << parts->status.message();
  int converts = 0;
  for (const auto& [rank, compact] : parts->parts)
    for (const Json& run : parts->part(rank))
      if (run["kind"] == "convert") {
        ++converts;
        EXPECT_FALSE(run.contains("scales"));
      }
  EXPECT_EQ(converts, 1);
}

// The runs each rank's part must expand to, taken from for_each_run
// directly, one per run, in its order (registered ranks = the layout's
// positions): what parts carried before run groups.
std::map<int32_t, std::vector<PlanRun>> ungrouped_parts(const std::string& layout_json) {
  std::map<int32_t, std::vector<PlanRun>> out;
  Result<Layout> layout = parse_layout_json(layout_json, "test");
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  if (!layout.is_ok() || !resolve_conversions(*layout).is_ok()) return out;
  Result<Plan> plan = make_plan(*layout);
  EXPECT_TRUE(plan.is_ok()) << plan.status().message();
  if (!plan.is_ok()) return out;
  const Layout& L = *layout;
  auto on_run = [&](const Run& run) {
    PlanRun r{!run.local,
              {run.from.side == Side::kSource ? Role::kSource : Role::kReceiver, run.from.rank,
               L.buffers[run.from.buffer].name, static_cast<uint64_t>(run.from.offset)},
              {Role::kReceiver, run.to.rank, "", static_cast<uint64_t>(run.to.offset)},
              static_cast<uint64_t>(run.bytes)};
    r.to.stage = run.to.buffer == kStagingBuffer;
    if (!r.to.stage) r.to.buffer = L.buffers[run.to.buffer].name;
    if (run.local && run.from.rank != run.to.rank) out[run.from.rank].push_back(r);
    out[run.to.rank].push_back(r);
  };
  auto on_convert = [&](const ConvertStep& c) {
    PlanRun step;
    step.convert = std::make_shared<ConvertSpec>();
    out[c.rank].push_back(step);
  };
  EXPECT_TRUE(for_each_run(*plan, on_run, on_convert).is_ok());
  return out;
}

const PlanRun& last_or(const PlanRun* last, const PlanRun& r) { return last ? *last : r; }

bool same_end(const RunEnd& a, const RunEnd& b) {
  return a.side == b.side && a.rank == b.rank && a.buffer == b.buffer && a.offset == b.offset && a.stage == b.stage;
}

struct PartSize {
  size_t entries = 0, runs = 0, cbor_bytes = 0, ungrouped_cbor_bytes = 0;
  double parse_seconds = 0, ungrouped_parse_seconds = 0;  // parse_plan_runs, as the receiver parses
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The entries `runs` make when each run joins the last entry if it
// continues it (same kind, ends and bytes, its offsets at the entry's
// strides from the run before) and a conversion step ends the entry: the
// grouping a part has, whatever groups the planner handed over.
size_t entries_one_by_one(const std::vector<PlanRun>& runs) {
  size_t entries = 0;
  const PlanRun* last = nullptr;
  int64_t count = 0;
  std::array<int64_t, 2> stride{};
  for (const PlanRun& r : runs) {
    if (r.convert) {
      ++entries;
      last = nullptr;
      continue;
    }
    bool extends = last && last->network == r.network && last->bytes == r.bytes && last->from.side == r.from.side &&
                   last->from.rank == r.from.rank && last->from.buffer == r.from.buffer &&
                   last->to.rank == r.to.rank && last->to.buffer == r.to.buffer && last->to.stage == r.to.stage;
    const std::array<int64_t, 2> step{static_cast<int64_t>(r.from.offset - last_or(last, r).from.offset),
                                      static_cast<int64_t>(r.to.offset - last_or(last, r).to.offset)};
    extends = extends && (count < 2 || step == stride);
    if (extends) {
      stride = step;
      ++count;
    } else {
      ++entries;
      count = 1;
    }
    last = &r;
  }
  return entries;
}

// Plans `layout_json` with compute_plan and checks that every rank's part,
// its groups expanded by the receiver's parser, is exactly the ungrouped
// runs in order. Returns each rank's part size.
std::map<int32_t, PartSize> expect_parts_expand_to_the_runs(const std::string& layout_json) {
  PlanInput in;
  in.epoch = 1;
  in.layout_json = layout_json;
  auto planned = compute_plan(in);
  EXPECT_TRUE(planned->status.is_ok()) << planned->status.message();
  const std::map<int32_t, std::vector<PlanRun>> want = ungrouped_parts(layout_json);
  EXPECT_EQ(planned->parts.size(), want.size());
  std::map<int32_t, PartSize> sizes;
  for (const auto& [rank, compact] : planned->parts) {
    const Json part = planned->part(rank);
    const auto t0 = std::chrono::steady_clock::now();
    Result<std::vector<PlanRun>> got = parse_plan_runs(part);
    const double parse_seconds = seconds_since(t0);
    EXPECT_TRUE(got.is_ok()) << got.status().message();
    auto it = want.find(rank);
    if (!got.is_ok() || it == want.end()) {
      ADD_FAILURE() << "rank " << rank << ": no part to compare";
      continue;
    }
    EXPECT_EQ(got->size(), it->second.size()) << "rank " << rank;
    for (size_t i = 0; i < std::min(got->size(), it->second.size()); ++i) {
      const PlanRun& g = (*got)[i];
      const PlanRun& w = it->second[i];
      const bool same = (g.convert != nullptr) == (w.convert != nullptr) &&
                        (g.convert || (g.network == w.network && g.bytes == w.bytes && same_end(g.from, w.from) &&
                                       same_end(g.to, w.to)));
      if (!same) {
        ADD_FAILURE() << "rank " << rank << ", run " << i << ": got " << to_json(g).dump() << ", want "
                      << to_json(w).dump();
        break;
      }
    }
    EXPECT_EQ(part.size(), entries_one_by_one(it->second)) << "rank " << rank;
    Json ungrouped = Json::array();
    for (const PlanRun& w : it->second) {
      if (!w.convert) ungrouped.push_back(to_json(w));
    }
    const auto t1 = std::chrono::steady_clock::now();
    EXPECT_TRUE(parse_plan_runs(ungrouped).is_ok());
    sizes[rank] = PartSize{part.size(),      got->size(),   Json::to_cbor(part).size(), Json::to_cbor(ungrouped).size(),
                           parse_seconds, seconds_since(t1)};
  }
  return sizes;
}

// Column slices of a row-major source (docs/refresh.md, "The plan part"):
// "w" [64, 128] BF16 whole at source 0; receiver 0 holds columns 0..63
// densely, receiver 1 (its domain) the same columns at a row stride of 128
// elements, receiver 2 (a domain of its own) columns 64..127 and "b" whole.
// Each row is a run of its own, at constant strides at both ends: each
// rank's part carries a few groups, expanding to exactly the plan's runs.
TEST(ComputePlan, ColumnSlicesTravelAsFewRunGroupsThatExpandToThePlansRuns) {
  const std::string seg = R"({"tensor": "w", "start": [0, %d], "size": [64, 64], "offset": 0, "strides": [%d, 1]})";
  auto segment = [&seg](int col, int stride) {
    char buf[160];
    std::snprintf(buf, sizeof buf, seg.c_str(), col, stride);
    return std::string(buf);
  };
  const std::string layout = R"({"format": "refit-layout/1",
     "sources": [{"rank": 0, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 1},
                   {"rank": 2, "domain": 1, "instance": 0}],
     "tensors": [{"name": "w", "dtype": "BF16", "shape": [64, 128]}, {"name": "b", "dtype": "BF16", "shape": [16]}],
     "buffers": [
       {"side": "source", "rank": 0, "name": "w", "dtype": "BF16", "bytes": 16416,
        "segments": [{"tensor": "w", "start": [0, 0], "size": [64, 128], "offset": 0, "strides": [128, 1]},
                     {"tensor": "b", "start": [0], "size": [16], "offset": 8192, "strides": [1]}]},
       {"side": "receiver", "rank": 0, "name": "w", "dtype": "BF16", "bytes": 8192, "segments": [)" +
                             segment(0, 64) + R"(]},
       {"side": "receiver", "rank": 1, "name": "w", "dtype": "BF16", "bytes": 16384, "segments": [)" +
                             segment(0, 128) + R"(]},
       {"side": "receiver", "rank": 2, "name": "w", "dtype": "BF16", "bytes": 8192, "segments": [)" +
                             segment(64, 64) + R"(]},
       {"side": "receiver", "rank": 2, "name": "b", "dtype": "BF16", "bytes": 32,
        "segments": [{"tensor": "b", "start": [0], "size": [16], "offset": 0, "strides": [1]}]}]})";
  const std::map<int32_t, PartSize> sizes = expect_parts_expand_to_the_runs(layout);
  ASSERT_EQ(sizes.size(), 3u);
  size_t runs = 0;
  for (const auto& [rank, size] : sizes) {
    std::printf("receiver %d: %zu entries for %zu runs, %zu CBOR bytes (%zu ungrouped)\n", rank, size.entries,
                size.runs, size.cbor_bytes, size.ungrouped_cbor_bytes);
    EXPECT_GE(size.runs, 64u) << "rank " << rank;
    EXPECT_LE(size.entries, 3u) << "rank " << rank;
    EXPECT_LT(size.cbor_bytes * 10, size.ungrouped_cbor_bytes) << "rank " << rank;
    runs += size.runs;
  }
  EXPECT_GE(runs, 64u * 4 + 1);  // a pull and a send of the domain's rows, both ends; a pull; "b"
}

// The same check on any refit-layout/1 file (`refit-plan --layout-out`),
// printing the largest part: how a scenario's parts measure on the wire.
TEST(ComputePlan, PartsOfALayoutFileExpandToThePlansRuns) {
  const char* path = std::getenv("REFIT_PART_LAYOUT");
  if (!path || !*path) GTEST_SKIP() << "set REFIT_PART_LAYOUT to a refit-layout/1 file to measure its parts";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << "cannot read " << path;
  const std::string layout((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::map<int32_t, PartSize> sizes = expect_parts_expand_to_the_runs(layout);
  ASSERT_FALSE(sizes.empty());
  for (const auto& [rank, size] : sizes) {
    std::printf("receiver %d: %zu entries on the wire for %zu runs, %zu CBOR bytes of runs (%zu with one entry per "
                "run); parsed in %.1f ms (%.1f ms)\n",
                rank, size.entries, size.runs, size.cbor_bytes, size.ungrouped_cbor_bytes, size.parse_seconds * 1e3,
                size.ungrouped_parse_seconds * 1e3);
  }
}

TEST(ComputePlan, RefusesAConversionRefitDoesNotDo) {
  auto parts = compute_plan(conversion_input("F32", "I32", false));
  ASSERT_FALSE(parts->status.is_ok());
  EXPECT_NE(parts->status.message().find("\"w\""), std::string::npos) << parts->status.message();
  EXPECT_NE(parts->status.message().find("I32"), std::string::npos) << parts->status.message();
}

TEST(ComputePlan, RefusesAQuantizedTensorWithoutItsScales) {
  auto parts = compute_plan(conversion_input("BF16", "F8_E4M3", false));
  ASSERT_FALSE(parts->status.is_ok());
  EXPECT_NE(parts->status.message().find("w_scale_inv"), std::string::npos) << parts->status.message();
}

TEST(ControlState, RefusesDuplicateRegistration) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  Status dup = s.register_source(2, source(0), now);
  ASSERT_FALSE(dup.is_ok());
  EXPECT_EQ(dup.message(), "register_source: source rank 0 is already registered; unregister it first");
  EXPECT_EQ(dup.reason(), Reason::kRankHeld);
}

TEST(ControlState, OnlyTheOwnerMayHeartbeatOrUnregister) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(3), now).is_ok());
  Status hb = s.heartbeat(2, MemberRef{Role::kSource, 3}, now);
  ASSERT_FALSE(hb.is_ok());
  EXPECT_EQ(hb.message(), "heartbeat: source rank 3 was registered by another connection");
  EXPECT_FALSE(s.unregister(1, MemberRef{Role::kReceiver, 3}).is_ok());
  EXPECT_TRUE(s.unregister(1, MemberRef{Role::kSource, 3}).is_ok());
  EXPECT_EQ(s.num_sources(), 0u);
}

TEST(ControlState, BoundsMembership) {
  StateLimits lim;
  lim.max_sources = 2;
  ControlState s(lim, 1s);
  auto now = Clock::now();
  EXPECT_TRUE(s.register_source(1, source(0), now).is_ok());
  EXPECT_TRUE(s.register_source(1, source(1), now).is_ok());
  EXPECT_FALSE(s.register_source(1, source(2), now).is_ok());
}

TEST(ControlState, SweepRemovesSilentMembersOnly) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_source(2, source(1), t0).is_ok());
  ASSERT_TRUE(s.heartbeat(2, MemberRef{Role::kSource, 1}, t0 + 80ms).is_ok());
  auto dead = s.sweep(t0 + 150ms);
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_NE(dead[0].find("source rank 0 declared dead after 150 ms"), std::string::npos) << dead[0];
  EXPECT_FALSE(s.has_source(0));
  EXPECT_TRUE(s.has_source(1));
}

TEST(ControlState, PublishNeedsASourceAndANewerVersion) {
  ControlState s(StateLimits{}, 1s);
  ASSERT_TRUE(s.subscribe(7).is_ok());
  EXPECT_FALSE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.register_source(1, source(0), Clock::now()).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].session, 7u);
  EXPECT_EQ(n[0].type, MsgType::kVersionNotify);
  Status old = s.publish(1, 1);
  ASSERT_FALSE(old.is_ok());
  EXPECT_EQ(old.message(), "publish_version: version 1 is not newer than version 1, which source rank 0 already published");
  s.session_closed(7);
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
}

// The versions of the notices in `n`, in order; fails on any other notice.
std::vector<int64_t> notified(const std::vector<Notice>& n) {
  std::vector<int64_t> out;
  for (const Notice& x : n) {
    EXPECT_EQ(x.type, MsgType::kVersionNotify);
    out.push_back(x.body["version"].get<int64_t>());
  }
  return out;
}

TEST(ControlState, GroupVersionAdvancesOnlyWhenEverySourcePublished) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_source(2, source(1), now).is_ok());
  ASSERT_TRUE(s.subscribe(7).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  EXPECT_EQ(s.version(), 0);
  EXPECT_TRUE(s.take_notices().empty()) << "source rank 1 has not published version 1";
  ASSERT_TRUE(s.publish(2, 1).is_ok());
  EXPECT_EQ(s.version(), 1);
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{1});
  // Rank 1 runs ahead: the group follows the slower source.
  ASSERT_TRUE(s.publish(2, 3).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{2});
  EXPECT_EQ(s.version(), 2);
  // The slower source leaves: the others' version becomes available.
  ASSERT_TRUE(s.unregister(1, MemberRef{Role::kSource, 0}).is_ok());
  EXPECT_EQ(s.version(), 3);
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{3});
  // A source that joins starts at 0 and holds the group until it catches up;
  // the group version never goes back.
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  EXPECT_EQ(s.version(), 3);
  ASSERT_TRUE(s.publish(2, 4).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
  ASSERT_TRUE(s.publish(1, 4).is_ok());
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{4});
}

TEST(ControlState, LeaseNeedsTheGroupVersion) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_source(2, source(1), now).is_ok());
  RegisterReceiver r;
  r.worker_address = {1};
  ASSERT_TRUE(s.register_receiver(10, r, now).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  Status early = s.lease(10, StageReport{0, 1, ""}, now);
  ASSERT_FALSE(early.is_ok());
  EXPECT_EQ(early.message(), "lease: version 1 is not published (latest is 0)");
  ASSERT_TRUE(s.publish(2, 1).is_ok());
  EXPECT_TRUE(s.lease(10, StageReport{0, 1, ""}, now).is_ok());
}

TEST(ControlState, OneConnectionPublishesForEverySourceItRegistered) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_source(1, source(1), now).is_ok());
  ASSERT_TRUE(s.subscribe(7).is_ok());
  ASSERT_TRUE(s.publish(1, 5).is_ok());
  EXPECT_EQ(s.version(), 5);
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{5});
}

TEST(ControlState, RefusesANonIncreasingPublish) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_source(2, source(1), now).is_ok());
  ASSERT_TRUE(s.subscribe(7).is_ok());
  ASSERT_TRUE(s.publish(1, 3).is_ok());
  for (int64_t v : {3, 2}) {
    Status st = s.publish(1, v);
    ASSERT_FALSE(st.is_ok());
    EXPECT_EQ(st.message(), "publish_version: version " + std::to_string(v) +
                                " is not newer than version 3, which source rank 0 already published");
  }
  // The refusals changed nothing: rank 1 publishing 3 makes 3 available.
  ASSERT_TRUE(s.publish(2, 3).is_ok());
  EXPECT_EQ(s.version(), 3);
  EXPECT_EQ(notified(s.take_notices()), std::vector<int64_t>{3});
  // A connection with two sources at different versions: refused as a whole
  // when either one would go back.
  ASSERT_TRUE(s.register_source(2, source(2), now).is_ok());
  Status st = s.publish(2, 3);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(), "publish_version: version 3 is not newer than version 3, which source rank 1 already published");
  ASSERT_TRUE(s.publish(1, 4).is_ok());
  EXPECT_EQ(s.version(), 3) << "source rank 2 has published nothing yet";
  ASSERT_TRUE(s.publish(2, 4).is_ok());
  EXPECT_EQ(s.version(), 4);
}

TEST(ControlState, RefusesConflictingTensorDeclarations) {
  ControlState s(StateLimits{}, 1s);
  RegisterSource a = source(0), b = source(1);
  a.tensors.push_back(TensorDecl{"w", "BF16", {4, 4}});
  b.tensors.push_back(TensorDecl{"w", "BF16", {4, 8}});
  ASSERT_TRUE(s.register_source(1, a, Clock::now()).is_ok());
  Status st = s.register_source(2, b, Clock::now());
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.message(),
            "register_source: tensor \"w\" declared as BF16[4,8] but other sources declared it as BF16[4,4]");
}

RegisterReceiver receiver(int32_t rank, int32_t instance) {
  RegisterReceiver m;
  m.rank = rank;
  m.instance = instance;
  m.worker_address = {1};
  return m;
}

// A member holding all of tensor "w" (1024 BF16) in one buffer; every
// receiver is in domain 0, so the plan has local runs between receivers.
RegisterSource whole_source(int32_t rank) {
  RegisterSource m = source(rank);
  m.tensors.push_back(TensorDecl{"w", "BF16", {1024}});
  m.buffers.push_back(MemberBuffer{"w", "BF16", 2048, 0x1000, {1}, {Segment{"w", {0}, {1024}, 0, {1}}}});
  return m;
}

RegisterReceiver whole_receiver(int32_t rank) {
  RegisterReceiver m = receiver(rank, 0);
  m.buffers.push_back(MemberBuffer{"model", "BF16", 2048, 0, {}, {Segment{"w", {0}, {1024}, 0, {1}}}});
  return m;
}

// `runs` with every rank replaced through `source_map` / `receiver_map`.
Json renamed(Json runs, const std::map<int, int>& source_map, const std::map<int, int>& receiver_map) {
  for (Json& run : runs) {
    Json& from = run["from"]["rank"];
    from = (run["from"]["side"] == "source" ? source_map : receiver_map).at(from.get<int>());
    run["to"]["rank"] = receiver_map.at(run["to"]["rank"].get<int>());
  }
  return runs;
}

TEST(ControlState, PlansAroundRankGapsAndNamesTheRegisteredRanks) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(s.register_source(1 + r, whole_source(r), now).is_ok());
    ASSERT_TRUE(s.register_receiver(10 + r, whole_receiver(r), now).is_ok());
  }
  ASSERT_TRUE(s.unregister(2, MemberRef{Role::kSource, 1}).is_ok());
  ASSERT_TRUE(s.unregister(11, MemberRef{Role::kReceiver, 1}).is_ok());
  Result<Json> p0 = s.plan_part(10, 0);
  ASSERT_TRUE(p0.is_ok()) << p0.status().message();
  Result<Json> p2 = s.plan_part(12, 2);
  ASSERT_TRUE(p2.is_ok()) << p2.status().message();
  EXPECT_FALSE(s.plan_part(11, 1).is_ok()) << "rank 1 left";
  // The plan of a membership of just those members, ranks 0 and 1 on each
  // side, is the same with 1 read as 2.
  ControlState dense(StateLimits{}, 1s);
  ASSERT_TRUE(dense.register_source(1, whole_source(0), now).is_ok());
  ASSERT_TRUE(dense.register_source(3, whole_source(1), now).is_ok());
  ASSERT_TRUE(dense.register_receiver(10, whole_receiver(0), now).is_ok());
  ASSERT_TRUE(dense.register_receiver(12, whole_receiver(1), now).is_ok());
  Result<Json> q0 = dense.plan_part(10, 0);
  Result<Json> q1 = dense.plan_part(12, 1);
  ASSERT_TRUE(q0.is_ok() && q1.is_ok());
  const std::map<int, int> back = {{0, 0}, {1, 2}};
  EXPECT_EQ(*p0, renamed(*q0, back, back));
  EXPECT_EQ(*p2, renamed(*q1, back, back));
  // Every run names live registered ranks only, and receiver 2 takes part.
  bool names_2 = false;
  for (const Json* part : {&*p0, &*p2}) {
    ASSERT_FALSE(part->empty());
    for (const Json& run : *part) {
      for (const Json& rank : {run["from"]["rank"], run["to"]["rank"]}) {
        EXPECT_TRUE(rank == 0 || rank == 2) << run.dump();
        names_2 = names_2 || rank == 2;
      }
    }
  }
  EXPECT_TRUE(names_2);
  // The peers are found under the registered ranks too.
  const Json peers = s.peers_of(2, *p2);
  for (const Json& side : {peers["sources"], peers["receivers"]}) {
    for (const Json& peer : side) EXPECT_TRUE(peer["rank"] == 0 || peer["rank"] == 2) << peers.dump();
  }
  std::printf("receiver 0: %zu runs, receiver 2: %zu runs; peers of 2: %s\n", p0->size(), p2->size(),
              peers.dump().c_str());
}

TEST(ControlState, APlanningFailureSaysHowRanksWereRenumbered) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  // Each receiver can be planned; together they cannot, as no source
  // holds what receiver 5 wants of tensor "v".
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), now).is_ok());
  RegisterSource v_decl = source(1);
  v_decl.tensors.push_back(TensorDecl{"v", "BF16", {1024}});
  ASSERT_TRUE(s.register_source(2, v_decl, now).is_ok());
  RegisterReceiver odd = whole_receiver(5);
  odd.buffers[0].segments[0].tensor = "v";
  ASSERT_TRUE(s.register_receiver(15, odd, now).is_ok());
  Result<Json> p = s.plan_part(15, 5);
  ASSERT_FALSE(p.is_ok());
  const std::string prefix =
      "fetch_plan: the membership cannot be planned: the layout numbers the live receiver ranks 0, 5 as 0..1: ";
  EXPECT_EQ(p.status().message().substr(0, prefix.size()), prefix) << p.status().message();
  std::printf("%s\n", p.status().message().c_str());
}

TEST(ControlState, CommitsAnInstanceOnlyWhenEveryRankStaged) {
  ControlState s(StateLimits{}, 1s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(12, receiver(2, 1), now).is_ok());
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  EXPECT_TRUE(s.take_notices().empty());
  EXPECT_FALSE(s.report_staged(10, StageReport{1, 3, ""}).is_ok()) << "not its rank";
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 3, ""}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
  EXPECT_EQ(n[0].body["version"], 3);
  EXPECT_EQ(n[1].session, 11u);
  // An older version than the one being staged is refused.
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 5, ""}).is_ok());
  Status old = s.report_staged(11, StageReport{1, 4, ""});
  EXPECT_EQ(old.message(), "report_staged: instance 0 is staging version 5, not 4");
}

TEST(ControlState, AbortsAnInstanceOnFailureOrDeath) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  ASSERT_TRUE(s.report_failed(11, StageReport{1, 3, "GET timed out"}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kAbort);
  EXPECT_EQ(n[0].body["reason"], "receiver rank 1 failed: GET timed out");
  // Staged again, then rank 1 dies: rank 0 is told to abort.
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 4, ""}).is_ok());
  ASSERT_TRUE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, t0 + 90ms).is_ok());
  s.sweep(t0 + 150ms);
  n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].session, 10u);
  EXPECT_EQ(n[0].body["reason"], "receiver rank 1 was declared dead");
}

// A rank that reports staged v after another rank's failure already aborted
// v is told to abort too, and the next version's barrier is not blocked by
// it; a barrier left unfinished is abandoned by a newer version's report.
TEST(ControlState, LateStagedReportOfAnAbortedVersionDoesNotBlockTheNext) {
  ControlState s(StateLimits{}, 1s);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  ASSERT_TRUE(s.report_failed(10, StageReport{0, 2, "verify: hash differs"}).is_ok());
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 2, ""}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 3u);  // the abort to both, then to the late rank again
  EXPECT_EQ(n[2].session, 11u);
  EXPECT_EQ(n[2].type, MsgType::kAbort);
  EXPECT_EQ(n[2].body["version"], 2);
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 3, ""}).is_ok());
  n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
  EXPECT_EQ(n[1].type, MsgType::kCommit);
  // Rank 0 staged 4, rank 1 never did and went on to 5: 4 is abandoned.
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 4, ""}).is_ok());
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 5, ""}).is_ok());
  n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kAbort);
  EXPECT_EQ(n[0].body["version"], 4);
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 5, ""}).is_ok());
  n = s.take_notices();
  ASSERT_EQ(n.size(), 2u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
  EXPECT_EQ(n[0].body["version"], 5);
}

// A rank that dies while it refreshes (it holds a lease) takes the version
// down for its instance: the survivor is told to abort it, and its own
// "staged" report of it afterwards commits nothing.
TEST(ControlState, ARankDyingInARefreshAbortsThatVersionForItsInstance) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), t0).is_ok());
  ASSERT_TRUE(s.publish(1, 5).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(12, receiver(2, 1), t0).is_ok());  // another instance
  ASSERT_TRUE(s.lease(11, StageReport{1, 5, ""}, t0).is_ok());
  s.take_notices();
  ASSERT_TRUE(s.heartbeat(1, MemberRef{Role::kSource, 0}, t0 + 90ms).is_ok());
  ASSERT_TRUE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, t0 + 90ms).is_ok());
  ASSERT_TRUE(s.heartbeat(12, MemberRef{Role::kReceiver, 2}, t0 + 90ms).is_ok());
  s.sweep(t0 + 150ms);  // rank 1 is declared dead
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].session, 10u);
  EXPECT_EQ(n[0].type, MsgType::kAbort);
  EXPECT_EQ(n[0].body["version"], 5);
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 5, ""}).is_ok());
  n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kAbort) << "rank 0 alone does not commit version 5";
  // The other instance is not affected.
  ASSERT_TRUE(s.report_staged(12, StageReport{2, 5, ""}).is_ok());
  n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
}

// Whether `runs` has a local run (one receiver passing bytes to another).
bool has_local_run(const Json& runs) {
  for (const Json& run : runs)
    if (run["kind"] == "local") return true;
  return false;
}

// A version that was being refreshed when the membership changed, or that
// an instance aborted, goes on with solo parts: each rank pulls all it needs
// itself, since its peers may have finished that version under the old plan
// or stopped, and would never pass on what a new shared plan routes through
// them. The next version is planned per domain again.
TEST(ControlState, AVersionCaughtByAMembershipChangeGoesOnWithSoloParts) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  for (int r = 0; r < 4; ++r) {
    RegisterReceiver m = whole_receiver(r);
    m.instance = r / 2;
    ASSERT_TRUE(s.register_receiver(10 + r, m, now).is_ok());
  }
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  for (int r = 0; r < 4; ++r) ASSERT_TRUE(s.lease(10 + r, StageReport{r, 1, ""}, now).is_ok());
  Result<Json> p = s.plan_part(12, 2);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_TRUE(has_local_run(*p)) << p->dump();
  EXPECT_EQ(s.plan_epoch(2), s.epoch());

  // Receiver 0 leaves while version 1 is being refreshed.
  ASSERT_TRUE(s.unregister(10, MemberRef{Role::kReceiver, 0}).is_ok());
  p = s.plan_part(12, 2);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  ASSERT_FALSE(p->empty());
  EXPECT_FALSE(has_local_run(*p)) << p->dump();
  EXPECT_EQ(s.plan_epoch(2), s.epoch() | ControlState::kSoloEpochBit);
  EXPECT_EQ(s.plan_totals(2).value("solo", false), true);
  const Json peers = s.peers_of(2, *p);
  ASSERT_EQ(peers["domain"].size(), 1u) << peers.dump();
  EXPECT_EQ(peers["domain"][0]["rank"], 2);

  // Version 2 is planned per domain again.
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  for (int r = 1; r < 4; ++r) ASSERT_TRUE(s.lease(10 + r, StageReport{r, 2, ""}, now).is_ok());
  p = s.plan_part(12, 2);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_TRUE(has_local_run(*p)) << p->dump();
  EXPECT_EQ(s.plan_epoch(2), s.epoch());
  EXPECT_FALSE(s.plan_totals(2).contains("solo"));

  // Instance 0 (rank 1) aborts version 2: the others finish it solo.
  const uint64_t epoch = s.epoch();
  ASSERT_TRUE(s.report_failed(11, StageReport{1, 2, "GET timed out"}).is_ok());
  EXPECT_EQ(s.epoch(), epoch) << "the membership did not change";
  p = s.plan_part(13, 3);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_FALSE(has_local_run(*p)) << p->dump();
  EXPECT_EQ(s.plan_epoch(3), epoch | ControlState::kSoloEpochBit);
}

TEST(ControlState, DrainsAVersionWhenItsLeasesEnd) {
  ControlState s(StateLimits{}, 10s);
  s.set_lease_timeout(100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  EXPECT_FALSE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok()) << "not published yet";
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok());
  ASSERT_TRUE(s.lease(11, StageReport{1, 1, ""}, t0).is_ok());
  EXPECT_FALSE(s.wait_drained(10, 1).is_ok()) << "only a source waits";
  auto d = s.wait_drained(1, 1);
  ASSERT_TRUE(d.is_ok());
  EXPECT_FALSE(*d);
  ASSERT_TRUE(s.release(10, StageReport{0, 1, ""}).is_ok());
  EXPECT_TRUE(s.take_notices().empty()) << "rank 1 still holds version 1";
  EXPECT_FALSE(s.release(10, StageReport{0, 1, ""}).is_ok()) << "released twice";
  auto lines = s.sweep(t0 + 150ms);  // rank 1's lease expires
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "lease of version 1 by receiver rank 1 expired");
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kDrained);
  EXPECT_EQ(n[0].session, 1u);
  EXPECT_TRUE(*s.wait_drained(1, 1));
}

// Verification: a source holding w[0, 512) and one holding w[512, 1024) for
// a receiver that wants w[256, 768): each source hashes its half of the
// receiver's box, and the receiver is told both, under its own buffer and
// segment indices.
TEST(ControlState, ListsTheBoxesToHashAndServesTheirHashes) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  for (int r = 0; r < 2; ++r) {
    RegisterSource m = source(r);
    m.tensors.push_back(TensorDecl{"w", "BF16", {1024}});
    m.buffers.push_back(MemberBuffer{"w", "BF16", 1024, 0x1000, {1}, {Segment{"w", {512 * r}, {512}, 0, {1}}}});
    ASSERT_TRUE(s.register_source(1 + r, m, now).is_ok());
  }
  RegisterReceiver rc = receiver(0, 0);
  rc.buffers.push_back(MemberBuffer{"other", "BF16", 2, 0, {}, {}});
  rc.buffers.push_back(MemberBuffer{"w", "BF16", 1024, 0, {}, {Segment{"w", {256}, {512}, 0, {1}}}});
  ASSERT_TRUE(s.register_receiver(9, rc, now).is_ok());

  Result<Json> boxes = s.verify_boxes(2);
  ASSERT_TRUE(boxes.is_ok()) << boxes.status().message();
  EXPECT_EQ((*boxes)["boxes"], Json::parse(R"([{"rank": 1, "tensor": "w", "start": [512], "size": [256]}])"));
  EXPECT_FALSE(s.verify_boxes(9).is_ok()) << "a receiver's connection has nothing to hash";

  // Source 0 publishes with its hash, source 1 without: half is unverified.
  ASSERT_TRUE(s.publish(1, 1, {BoxHash{0, "w", {256}, {256}, 42}}).is_ok());
  ASSERT_TRUE(s.publish(2, 1).is_ok());
  Result<Json> h = s.version_hashes(9, VersionHashes{0, 1});
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ((*h)["hashes"], Json::parse(R"([{"buffer": 1, "segment": 0, "start": [256], "size": [256],
                                             "hash": 42, "rank": 0}])"));
  EXPECT_EQ((*h)["unverified_bytes"], 512);
  EXPECT_EQ((*h)["unverified"], Json::parse(R"([{"tensor": "w", "start": [512], "size": [256]}])"));
  EXPECT_FALSE(s.version_hashes(1, VersionHashes{0, 1}).is_ok()) << "not the receiver's connection";

  // A hash of a box the rank does not hold, or of another connection's rank.
  Status outside = s.publish(1, 2, {BoxHash{0, "w", {500}, {20}, 7}});
  EXPECT_EQ(outside.message(),
            "publish_version: hashes[0] (tensor \"w\" start [500] size [20]) is not inside a segment of source rank 0");
  Status foreign = s.publish(1, 2, {BoxHash{1, "w", {512}, {20}, 7}});
  EXPECT_NE(foreign.message().find("names source rank 1, which this connection did not register"), std::string::npos)
      << foreign.message();
  EXPECT_EQ(s.version_hashes(9, VersionHashes{0, 2}).value()["hashes"].size(), 0u) << "nothing stored";
}

// Verification of block scales (docs/conversion.md, "At the receiver"): a
// receiver holds "w" [4, 6] as F8_E4M3 with blocks of 2 x 2, in two
// segments (columns [0, 4) and [4, 6)), and its scales [2, 3] in two
// (block columns [0, 2) and [2, 3)). Source 0 holds rows [0, 2): whole
// blocks, so it hashes their scales too, as the receiver's segments cut
// them. Sources 1, 2 and 3 cut block row 1 between them (rows [2, 3); row 3
// in two halves): no one source can quantize it, so its scales are
// unverified, each counted once though several boxes reach it.
TEST(ControlState, ListsAndServesTheHashesOfBlockScales) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> held = {
      {{0, 0}, {2, 6}}, {{2, 0}, {1, 6}}, {{3, 0}, {1, 3}}, {{3, 3}, {1, 3}}};
  for (int r = 0; r < 4; ++r) {
    RegisterSource m = source(r);
    m.tensors.push_back(TensorDecl{"w", "BF16", {4, 6}});
    const auto& [start, size] = held[r];
    m.buffers.push_back(MemberBuffer{"w", "BF16", 48, 0x1000, {1}, {Segment{"w", start, size, 0, {size[1], 1}}}});
    ASSERT_TRUE(s.register_source(1 + r, m, now).is_ok());
  }
  RegisterReceiver rc = receiver(0, 0);
  rc.weight_block_size = {2, 2};
  rc.buffers.push_back(MemberBuffer{"w", "F8_E4M3", 24, 0, {},
                                    {Segment{"w", {0, 0}, {4, 4}, 0, {6, 1}}, Segment{"w", {0, 4}, {4, 2}, 4, {6, 1}}}});
  rc.buffers.push_back(MemberBuffer{"s", "F32", 24, 0, {},
                                    {Segment{"w_scale_inv", {0, 0}, {2, 2}, 0, {3, 1}},
                                     Segment{"w_scale_inv", {0, 2}, {2, 1}, 2, {3, 1}}}});
  Status reg = s.register_receiver(9, rc, now);
  ASSERT_TRUE(reg.is_ok()) << reg.message();

  Result<Json> boxes = s.verify_boxes(1);
  ASSERT_TRUE(boxes.is_ok()) << boxes.status().message();
  EXPECT_EQ((*boxes)["boxes"], Json::parse(R"([
      {"rank": 0, "tensor": "w", "start": [0, 0], "size": [2, 4], "dtype": "F8_E4M3", "block": [2, 2],
       "scales": [{"start": [0, 0], "size": [1, 2]}]},
      {"rank": 0, "tensor": "w", "start": [0, 4], "size": [2, 2], "dtype": "F8_E4M3", "block": [2, 2],
       "scales": [{"start": [0, 2], "size": [1, 1]}]}])"));
  EXPECT_EQ(s.verify_boxes(2).value()["boxes"], Json::array()) << "rows [2, 3) cut block row 1";

  // The scales of blocks source 0 does not hold are refused.
  Status outside = s.publish(1, 1, {BoxHash{0, "w_scale_inv", {1, 0}, {1, 2}, 7}});
  EXPECT_EQ(outside.message(), "publish_version: hashes[0] (tensor \"w_scale_inv\" start [1,0] size [1,2]) is not "
                               "inside a segment of source rank 0");
  ASSERT_TRUE(s.publish(1, 1,
                        {BoxHash{0, "w", {0, 0}, {2, 4}, 11, "F8_E4M3"}, BoxHash{0, "w", {0, 4}, {2, 2}, 14, "F8_E4M3"},
                         BoxHash{0, "w_scale_inv", {0, 0}, {1, 2}, 12}, BoxHash{0, "w_scale_inv", {0, 2}, {1, 1}, 13}})
                  .is_ok());
  for (uint64_t session : {2, 3, 4}) ASSERT_TRUE(s.publish(session, 1).is_ok());

  Result<Json> h = s.version_hashes(9, VersionHashes{0, 1});
  ASSERT_TRUE(h.is_ok()) << h.status().message();
  EXPECT_EQ((*h)["hashes"], Json::parse(R"([
      {"buffer": 0, "segment": 0, "start": [0, 0], "size": [2, 4], "hash": 11, "rank": 0},
      {"buffer": 0, "segment": 1, "start": [0, 4], "size": [2, 2], "hash": 14, "rank": 0},
      {"buffer": 1, "segment": 0, "start": [0, 0], "size": [1, 2], "hash": 12, "rank": 0},
      {"buffer": 1, "segment": 1, "start": [0, 2], "size": [1, 1], "hash": 13, "rank": 0}])"));
  // Rows [2, 4) of "w": 12 FP8 bytes; block row 1's 3 scales: 12 bytes,
  // though sources 1, 2 and 3 each reach block (1, 1).
  EXPECT_EQ((*h)["unverified_bytes"], 12 + 12) << h->dump();
}

// "quantize": "source" (docs/conversion.md, "At the source"): "w" [4, 6]
// BF16, rows [0, 2) at source 0, which also serves them as F8_E4M3 with
// their 2 x 2 blocks' scales in buffer "refit.converted", rows [2, 4) at
// source 1. verify_boxes lists what each source converts and never hashes
// a copy; the plan pulls the copy and its scales as they are and leaves
// rows [2, 4) to the receiver's conversion. Without a receiver holding the
// scales, the membership document leaves the copy's scales out.
TEST(ControlState, ListsWhatSourcesConvertAndPlansTheirCopies) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  for (int r = 0; r < 2; ++r) {
    RegisterSource m = source(r);
    m.tensors.push_back(TensorDecl{"w", "BF16", {4, 6}});
    m.buffers.push_back(MemberBuffer{"w", "BF16", 24, 0x1000, {1}, {Segment{"w", {2 * r, 0}, {2, 6}, 0, {6, 1}}}});
    if (r == 0) {
      m.buffers.push_back(MemberBuffer{"refit.converted", "U8", 64, 0x2000, {2},
                                       {Segment{"w", {0, 0}, {2, 6}, 0, {6, 1}, "F8_E4M3"},
                                        Segment{"w_scale_inv", {0, 0}, {1, 3}, 4, {3, 1}, "F32"}}});
    }
    ASSERT_TRUE(s.register_source(1 + r, m, now).is_ok());
  }
  EXPECT_EQ(s.layout_document().dump().find("w_scale_inv"), std::string::npos) << s.layout_document().dump();
  RegisterReceiver rc = receiver(0, 0);
  rc.weight_block_size = {2, 2};
  rc.buffers.push_back(MemberBuffer{"w", "F8_E4M3", 24, 0, {}, {Segment{"w", {0, 0}, {4, 6}, 0, {6, 1}}}});
  rc.buffers.push_back(MemberBuffer{"s", "F32", 24, 0, {}, {Segment{"w_scale_inv", {0, 0}, {2, 3}, 0, {3, 1}}}});
  Status reg = s.register_receiver(9, rc, now);
  ASSERT_TRUE(reg.is_ok()) << reg.message();

  Result<Json> boxes = s.verify_boxes(1);
  ASSERT_TRUE(boxes.is_ok()) << boxes.status().message();
  EXPECT_EQ((*boxes)["convert"], Json::parse(R"([{"tensor": "w", "dtype": "F8_E4M3", "block": [2, 2]}])"));
  EXPECT_EQ((*boxes)["boxes"].size(), 1u) << boxes->dump();  // the BF16 segment's box, not the copy's

  auto parts = compute_plan(s.plan_input());
  ASSERT_TRUE(parts->status.is_ok()) << parts->status.message();
  const Json part = parts->part(0);
  int64_t from_copy = 0, staged = 0, converts = 0;
  for (const Json& e : part) {
    if (e["kind"] == "convert") {
      ++converts;
      EXPECT_EQ(e["start"], Json::parse("[2, 0]")) << e.dump();
      continue;
    }
    const int64_t bytes = e["bytes"].get<int64_t>() * e.value("count", int64_t{1});
    if (e["from"]["buffer"] == "refit.converted") from_copy += bytes;
    if (e["to"].value("stage", false)) staged += bytes;
  }
  EXPECT_EQ(converts, 1) << part.dump();
  EXPECT_EQ(from_copy, 12 + 3 * 4) << part.dump();  // 12 FP8 bytes, 3 scales
  EXPECT_EQ(staged, 12 * 2) << part.dump();         // rows [2, 4) in BF16
}

// Copies a source made for a smaller block than the receivers now hold (its
// scale segment lies outside today's scale tensor) or for another dtype are
// left out of the membership: the plan does not fail, the tensor travels
// unconverted until the source's next publish replaces them.
TEST(ControlState, CopiesMadeForWhatReceiversHeldBeforeAreLeftOut) {
  for (const char* copy_dtype : {"F8_E4M3", "F16"}) {
    ControlState s(StateLimits{}, 1s);
    const auto now = Clock::now();
    RegisterSource m = source(0);
    m.tensors.push_back(TensorDecl{"w", "BF16", {4, 6}});
    m.buffers.push_back(MemberBuffer{"w", "BF16", 48, 0x1000, {1}, {Segment{"w", {0, 0}, {4, 6}, 0, {6, 1}}}});
    m.buffers.push_back(MemberBuffer{"refit.converted", "U8", 128, 0x2000, {2},
                                     {Segment{"w", {0, 0}, {4, 6}, 0, {6, 1}, copy_dtype},
                                      Segment{"w_scale_inv", {0, 0}, {2, 3}, 8, {3, 1}, "F32"}}});
    ASSERT_TRUE(s.register_source(1, m, now).is_ok());
    RegisterReceiver rc = receiver(0, 0);
    rc.weight_block_size = {4, 6};  // the copies' scales were for [2, 2]: 2 x 3 of them, today 1 x 1
    rc.buffers.push_back(MemberBuffer{"w", "F8_E4M3", 24, 0, {}, {Segment{"w", {0, 0}, {4, 6}, 0, {6, 1}}}});
    rc.buffers.push_back(MemberBuffer{"s", "F32", 4, 0, {}, {Segment{"w_scale_inv", {0, 0}, {1, 1}, 0, {1, 1}}}});
    ASSERT_TRUE(s.register_receiver(9, rc, now).is_ok());
    const std::string doc = s.layout_document().dump();
    EXPECT_EQ(doc.find("\"size\":[2,3]"), std::string::npos) << doc;
    if (std::string(copy_dtype) == "F16") {
      EXPECT_EQ(doc.find("\"dtype\":\"F16\""), std::string::npos) << doc;
    }
    auto parts = compute_plan(s.plan_input());
    ASSERT_TRUE(parts->status.is_ok()) << copy_dtype << ": " << parts->status.message();
    int64_t from_copy = 0;
    const Json part = parts->part(0);
    for (const Json& e : part) {
      if (e.contains("from") && e["from"]["buffer"] == "refit.converted") ++from_copy;
    }
    EXPECT_EQ(from_copy, 0) << copy_dtype << ": " << part.dump();
  }
}

// A source that registers again on its own connection with the same tensors
// (its converted copies changed) has its buffers replaced in place: its
// tensors never lack a source, the version does not move. Another
// connection, or other tensors, is refused as before.
TEST(ControlState, ASourceReregisteringItsBuffersIsReplacedInPlace) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  RegisterSource a = source(0), b = source(1);
  ASSERT_TRUE(s.register_source(1, a, now).is_ok());
  ASSERT_TRUE(s.register_source(2, b, now).is_ok());
  ASSERT_TRUE(s.publish(2, 1).is_ok());
  EXPECT_EQ(s.version(), 0) << "source 0 has not published 1";
  RegisterSource again = a;
  again.buffers.push_back(MemberBuffer{"refit.converted", "U8", 64, 0x9000, {7}, {}});
  Status st = s.register_source(1, again, now);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(s.version(), 0) << "the version moved while source 0 re-registered";
  EXPECT_NE(s.layout_document().dump().find("refit.converted"), std::string::npos);
  EXPECT_FALSE(s.register_source(3, again, now).is_ok()) << "another connection while it is held";
  EXPECT_EQ(s.register_source(1, again, now).reason(), Reason::kRankHeld) << "the very same registration again";
  RegisterSource more = again;
  more.tensors.push_back(TensorDecl{"extra", "F32", {2}});
  EXPECT_FALSE(s.register_source(1, more, now).is_ok()) << "other tensors need an unregister first";
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  EXPECT_EQ(s.version(), 1);
}

// Two replicas that publish one version with different contents: the second
// publish is refused, naming both ranks, and changes nothing.
TEST(ControlState, RefusesReplicasThatDisagreeOnAVersion) {
  ControlState s(StateLimits{}, 1s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  ASSERT_TRUE(s.register_source(2, whole_source(1), now).is_ok());
  ASSERT_TRUE(s.publish(1, 1, {BoxHash{0, "w", {0}, {1024}, 5}}).is_ok());
  Status st = s.publish(2, 1, {BoxHash{1, "w", {0}, {1024}, 6}});
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("source rank 1 hashed version 1 of it to 6, source rank 0 to 5: the sources hold "
                              "different contents for one version"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(s.version(), 0) << "the refused publish changed nothing";
  EXPECT_TRUE(s.publish(2, 1, {BoxHash{1, "w", {0}, {1024}, 5}}).is_ok());
  EXPECT_EQ(s.version(), 1);
}

// Once a source was told v drained, no lease on v or older is granted again.
TEST(ControlState, ADrainedVersionIsNeverLeasedAgain) {
  ControlState s(StateLimits{}, 10s);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  auto d = s.wait_drained(1, 1);
  ASSERT_TRUE(d.is_ok() && *d);
  EXPECT_EQ(s.drained_through(), 1);
  Status st = s.lease(10, StageReport{0, 1, ""}, t0);
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_NE(st.message().find("version 1 was drained"), std::string::npos) << st.message();
  ASSERT_TRUE(s.lease(10, StageReport{0, 2, ""}, t0).is_ok());
  // Drained through a notice: the fence moves when the notice is sent.
  ASSERT_TRUE(s.publish(1, 3).is_ok());
  d = s.wait_drained(1, 2);
  ASSERT_TRUE(d.is_ok());
  EXPECT_FALSE(*d);
  ASSERT_TRUE(s.release(10, StageReport{0, 2, ""}).is_ok());
  EXPECT_EQ(s.drained_through(), 2);
  EXPECT_FALSE(s.lease(10, StageReport{0, 2, ""}, t0).is_ok());
}

// A renewal keeps a lease past its timeout; one that expired cannot be renewed.
TEST(ControlState, ALeaseIsRenewedUntilItExpires) {
  ControlState s(StateLimits{}, 10s);
  s.set_lease_timeout(100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  EXPECT_EQ(s.lease(10, StageReport{0, 1, ""}, t0, /*renew=*/true).code(), Code::kNotFound) << "none to renew";
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, t0 + 80ms, true).is_ok());
  EXPECT_TRUE(s.sweep(t0 + 150ms).empty()) << "renewed at 80 ms";
  EXPECT_EQ(s.sweep(t0 + 200ms).size(), 1u);
  EXPECT_EQ(s.lease(10, StageReport{0, 1, ""}, t0 + 210ms, true).code(), Code::kNotFound);
  EXPECT_EQ(s.release(10, StageReport{0, 1, ""}).code(), Code::kNotFound);
}

// Commit is final: after commit v, a rank's failure, withdrawal or death
// sends no abort of v, and a rank that withdraws learns it committed.
TEST(ControlState, ACommittedVersionIsNeverAborted) {
  ControlState s(StateLimits{}, 100ms);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(1, 0), t0).is_ok());
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  ASSERT_TRUE(s.report_staged(11, StageReport{1, 3, ""}).is_ok());
  ASSERT_EQ(s.take_notices().size(), 2u);
  EXPECT_TRUE(s.committed(0, 3));
  ASSERT_TRUE(s.report_failed(10, StageReport{0, 3, "no commit before its deadline"}).is_ok());
  EXPECT_TRUE(s.take_notices().empty()) << "no abort after commit";
  EXPECT_TRUE(s.committed(0, 3));
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 3, ""}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kCommit);
  ASSERT_TRUE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, t0 + 90ms).is_ok());
  s.sweep(t0 + 150ms);  // rank 1 dies
  EXPECT_TRUE(s.take_notices().empty());
}

// "instance_ranks": a lease and a commit need every declared rank; the
// declared size must agree and bounds the instance.
TEST(ControlState, AnInstanceMissingADeclaredRankNeverCommits) {
  ControlState s(StateLimits{}, 10s);
  auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), t0).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  RegisterReceiver a = receiver(0, 0), b = receiver(1, 0), c = receiver(2, 0), odd = receiver(3, 0);
  a.instance_ranks = b.instance_ranks = c.instance_ranks = 2;
  odd.instance_ranks = 3;
  ASSERT_TRUE(s.register_receiver(10, a, t0).is_ok());
  EXPECT_FALSE(s.register_receiver(13, odd, t0).is_ok()) << "another declared size";
  Status st = s.lease(10, StageReport{0, 1, ""}, t0);
  EXPECT_NE(st.message().find("instance 0 has 1 of its 2 ranks"), std::string::npos) << st.message();
  ASSERT_TRUE(s.report_staged(10, StageReport{0, 1, ""}).is_ok());
  auto n = s.take_notices();
  ASSERT_EQ(n.size(), 1u);
  EXPECT_EQ(n[0].type, MsgType::kAbort);
  ASSERT_TRUE(s.register_receiver(11, b, t0).is_ok());
  EXPECT_FALSE(s.register_receiver(12, c, t0).is_ok()) << "one too many";
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, t0).is_ok());
}

// A receiver that cannot be planned is refused at registration, naming the
// buffer; one registered before any source is left out of the plan, and the
// others are planned.
TEST(ControlState, AnUnplannableReceiverIsRefusedAndDoesNotStallTheOthers) {
  ControlState s(StateLimits{}, 10s);
  auto now = Clock::now();
  RegisterReceiver early = whole_receiver(1);
  early.buffers[0].segments[0].tensor = "nope";
  ASSERT_TRUE(s.register_receiver(11, early, now).is_ok()) << "no source to check against yet";
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  RegisterReceiver unknown = whole_receiver(2), outside = whole_receiver(3), overlap = whole_receiver(4);
  unknown.buffers[0].segments[0].tensor = "nope";
  outside.buffers[0].segments[0].start = {1};
  overlap.buffers[0].segments.push_back(overlap.buffers[0].segments[0]);
  Status st = s.register_receiver(12, unknown, now);
  EXPECT_NE(st.message().find("buffer \"model\" segments[0] (tensor \"nope\"): no registered source declares"),
            std::string::npos) << st.message();
  st = s.register_receiver(13, outside, now);
  EXPECT_NE(st.message().find("is not inside the tensor, BF16[1024]"), std::string::npos) << st.message();
  st = s.register_receiver(14, overlap, now);
  EXPECT_FALSE(st.is_ok());
  std::printf("%s\n", st.message().c_str());
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), now).is_ok());
  Result<Json> good = s.plan_part(10, 0);
  ASSERT_TRUE(good.is_ok()) << good.status().message();
  EXPECT_FALSE(good->empty());
  Result<Json> bad = s.plan_part(11, 1);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("no registered source declares"), std::string::npos)
      << bad.status().message();
}


// What receiver `rank`, holding "w" as F16 in buffer "model", is told
// where receiver `holder` holds it as BF16.
std::string f16_refusal(int32_t rank, int32_t holder) {
  return "register_receiver: receiver rank " + std::to_string(rank) +
         ", buffer \"model\" segments[0] (tensor \"w\"): holds the tensor as F16, receiver rank " +
         std::to_string(holder) + " holds it as BF16; all of a tensor's receivers hold one dtype";
}

// A tensor's receivers hold it in one dtype (docs/conversion.md, "What
// converts"): a receiver holding it in another is refused at registration,
// naming both ranks, whether or not a source has registered yet, and the
// plan of the others stays whole. Once the last holder of the first dtype
// leaves, another dtype may come.
TEST(ControlState, AReceiverHoldingATensorInAnotherDtypeIsRefusedNamingBothRanks) {
  ControlState s(StateLimits{}, 10s);
  auto now = Clock::now();
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), now).is_ok());
  RegisterReceiver f16 = whole_receiver(1);
  f16.buffers[0].dtype = "F16";
  Status st = s.register_receiver(11, f16, now);
  EXPECT_EQ(st.message(), f16_refusal(1, 0));
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  RegisterReceiver seg_f16 = whole_receiver(1);
  seg_f16.buffers[0].segments[0].dtype = "F16";  // the segment's own dtype counts too
  EXPECT_FALSE(s.register_receiver(11, seg_f16, now).is_ok());
  ASSERT_TRUE(s.register_receiver(12, whole_receiver(2), now).is_ok()) << "the same dtype joins";
  Result<Json> plan = s.plan_part(10, 0);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  ASSERT_TRUE(s.unregister(10, MemberRef{Role::kReceiver, 0}).is_ok());
  ASSERT_TRUE(s.unregister(12, MemberRef{Role::kReceiver, 2}).is_ok());
  EXPECT_TRUE(s.register_receiver(11, f16, now).is_ok()) << st.message();
}

// A tensor every source of which is gone is a peer lost, not a mistake:
// the receiver that needs it is told which source held it last and why it
// went, with reason kNoSource (not retried; REFIT_PEER_LOST), and a source
// that declares it again makes the receiver plannable.
TEST(ControlState, ATensorWhoseSourcesAreGoneNamesTheLastOneAndWhy) {
  ControlState s(StateLimits{}, 1s);
  const auto t0 = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), t0).is_ok());
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), t0).is_ok());
  ASSERT_TRUE(s.plan_part(10, 0).is_ok());
  // Declared dead: its heartbeats stopped, the receiver's did not.
  ASSERT_TRUE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, t0 + 900ms).is_ok());
  const std::vector<std::string> dead = s.sweep(t0 + 1500ms);
  ASSERT_EQ(dead.size(), 1u);
  Result<Json> part = s.plan_part(10, 0);
  ASSERT_FALSE(part.is_ok());
  EXPECT_EQ(part.status().reason(), Reason::kNoSource);
  EXPECT_NE(part.status().message().find("(tensor \"w\"): no live source holds this tensor: source rank 0, "
                                         "the last that held it, was declared dead (no heartbeat)"),
            std::string::npos)
      << part.status().message();
  // A source declares it again: planned.
  ASSERT_TRUE(s.register_source(2, whole_source(0), t0 + 1600ms).is_ok());
  ASSERT_TRUE(s.plan_part(10, 0).is_ok());
  // One that unregisters says so.
  ASSERT_TRUE(s.unregister(2, MemberRef{Role::kSource, 0}).is_ok());
  part = s.plan_part(10, 0);
  ASSERT_FALSE(part.is_ok());
  EXPECT_NE(part.status().message().find("source rank 0, the last that held it, unregistered"), std::string::npos)
      << part.status().message();
}

// The replicas of one shard register the same buffers and segments: their
// checks against the declared tensors are made once per declaration and
// generation of those tensors, and shared. What differs in anything the
// checks read is checked in full; a tensor that loses its last source (or a
// new one declared) makes every declaration be checked again.
TEST(ControlState, ReplicasOfOneDeclarationShareItsChecksUntilTheTensorsChange) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), now).is_ok());
  const uint64_t first = s.receiver_checks();
  EXPECT_EQ(first, 1u);
  // Another replica (its own address and key, which the checks do not read).
  RegisterReceiver replica = whole_receiver(1);
  replica.buffers[0].address = 0x9000;
  replica.buffers[0].rkey = {7, 7};
  ASSERT_TRUE(s.register_receiver(11, replica, now).is_ok());
  EXPECT_EQ(s.receiver_checks(), first) << "the replica shares the check";
  // One element off, one buffer byte short, another block: each checked, each refused.
  RegisterReceiver outside = whole_receiver(2), short_buffer = whole_receiver(2), block = whole_receiver(2);
  outside.buffers[0].segments[0].start = {1};
  short_buffer.buffers[0].bytes = 2046;
  block.weight_block_size = {64, 64};
  Status st = s.register_receiver(12, outside, now);
  EXPECT_NE(st.message().find("is not inside the tensor, BF16[1024]"), std::string::npos) << st.message();
  st = s.register_receiver(12, short_buffer, now);
  EXPECT_FALSE(st.is_ok());
  st = s.register_receiver(12, block, now);
  EXPECT_NE(st.message().find("declares \"weight_block_size\" [64,64], receiver rank 0 declared [128,128]"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(s.receiver_checks(), first + 3);
  // Planning and fetching check the registrations again, once a declaration.
  const uint64_t before_plans = s.receiver_checks();
  ASSERT_TRUE(s.plan_part(10, 0).is_ok());
  ASSERT_TRUE(s.plan_part(11, 1).is_ok());
  ASSERT_TRUE(s.plan_part(10, 0).is_ok());
  EXPECT_EQ(s.receiver_checks(), before_plans) << "passed at registration, at this generation";
  // The tensor's last source goes: checked again, and refused, the
  // registered replicas and a new one alike.
  ASSERT_TRUE(s.unregister(1, MemberRef{Role::kSource, 0}).is_ok());
  Result<Json> part = s.plan_part(11, 1);
  ASSERT_FALSE(part.is_ok());
  EXPECT_EQ(part.status().reason(), Reason::kNoSource) << part.status().message();
  ASSERT_TRUE(s.register_source(2, whole_source(3), now).is_ok());
  // A source with no tensors: with none registered, registrations are not checked.
  ASSERT_TRUE(s.register_source(3, source(4), now).is_ok());
  ASSERT_TRUE(s.unregister(2, MemberRef{Role::kSource, 3}).is_ok());
  st = s.register_receiver(13, whole_receiver(5), now);
  EXPECT_NE(st.message().find("(tensor \"w\"): no live source holds this tensor: source rank 3"), std::string::npos)
      << st.message();
  // Declared again: the replicas are planned, after one check between them.
  ASSERT_TRUE(s.register_source(4, whole_source(0), now).is_ok());
  const uint64_t before_again = s.receiver_checks();
  ASSERT_TRUE(s.plan_part(10, 0).is_ok());
  ASSERT_TRUE(s.plan_part(11, 1).is_ok());
  EXPECT_EQ(s.receiver_checks(), before_again + 1);
  ASSERT_TRUE(s.register_receiver(13, whole_receiver(5), now).is_ok());
  EXPECT_EQ(s.receiver_checks(), before_again + 2) << "a registration at a new generation is checked in full";
}

// A receiver that holds one tensor in two dtypes, registered while no
// source is (so nothing but one_dtype checks it): a replica of it is
// refused by one_dtype, as before the checks were shared per declaration.
TEST(ControlState, AReplicaOfAReceiverHoldingATensorInTwoDtypesIsRefusedAsBefore) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  auto mixed = [](int32_t rank, uint64_t address) {
    RegisterReceiver m = receiver(rank, 0);
    m.buffers.push_back(MemberBuffer{"model", "BF16", 2048, address, {},
                                     {Segment{"w", {0}, {512}, 0, {1}, ""}, Segment{"w", {512}, {512}, 512, {1}, "F16"}}});
    return m;
  };
  ASSERT_TRUE(s.register_receiver(10, mixed(0, 0x1000), now).is_ok());
  Status st = s.register_receiver(11, mixed(1, 0x9000), now);
  EXPECT_EQ(st.message(),
            "register_receiver: receiver rank 1, buffer \"model\" segments[1] (tensor \"w\"): holds the tensor as F16, "
            "receiver rank 0 holds it as BF16; all of a tensor's receivers hold one dtype");
  // With a source, the same replica is refused by the same check, first.
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  st = s.register_receiver(12, mixed(2, 0xa000), now);
  EXPECT_EQ(st.message(),
            "register_receiver: receiver rank 2, buffer \"model\" segments[1] (tensor \"w\"): holds the tensor as F16, "
            "receiver rank 0 holds it as BF16; all of a tensor's receivers hold one dtype");
}

// A receiver holding a tensor in another dtype is told a registered rank
// that holds it in the first one: not the first holder, once that one has
// gone. A dtype counts while any receiver of its declaration is registered.
TEST(ControlState, AnotherDtypeIsRefusedNamingAHolderThatIsStillRegistered) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, whole_source(0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(10, whole_receiver(0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(11, whole_receiver(1), now).is_ok());
  ASSERT_TRUE(s.unregister(10, MemberRef{Role::kReceiver, 0}).is_ok());
  RegisterReceiver f16 = whole_receiver(2);
  f16.buffers[0].dtype = "F16";
  Status st = s.register_receiver(12, f16, now);
  EXPECT_EQ(st.message(), f16_refusal(2, 1));
  ASSERT_TRUE(s.unregister(11, MemberRef{Role::kReceiver, 1}).is_ok());
  EXPECT_TRUE(s.register_receiver(12, f16, now).is_ok()) << "no receiver holds it as BF16 any more";
  RegisterReceiver bf16 = whole_receiver(3);
  st = s.register_receiver(13, bf16, now);
  EXPECT_NE(st.message().find("receiver rank 2 holds it as F16"), std::string::npos) << st.message();
}

}  // namespace
// One connection that registered many receiver ranks holds leases for at
// most max_leases_per_connection of them: the next lease is refused, naming
// the limit, until it releases one. Another connection is not affected, and
// a rank that holds a lease may lease again (it replaces its own).
TEST(ControlState, LeasesPerConnectionAreBounded) {
  StateLimits lim;
  lim.max_leases_per_connection = 2;
  ControlState s(lim, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  for (int32_t r = 0; r < 3; ++r) ASSERT_TRUE(s.register_receiver(10, receiver(r, r), now).is_ok());
  ASSERT_TRUE(s.register_receiver(11, receiver(3, 3), now).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.publish(1, 2).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 2, ""}, now).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{1, 2, ""}, now).is_ok());
  Status excess = s.lease(10, StageReport{2, 2, ""}, now);
  ASSERT_FALSE(excess.is_ok());
  EXPECT_EQ(excess.message(),
            "lease: receiver rank 2: this connection already holds 2 leases, the limit of "
            "max_leases_per_connection (2); release one first");
  EXPECT_TRUE(s.lease(10, StageReport{1, 2, ""}, now).is_ok());  // rank 1 again: still two
  EXPECT_TRUE(s.lease(11, StageReport{3, 2, ""}, now).is_ok());  // another connection
  ASSERT_TRUE(s.release(10, StageReport{0, 2, ""}).is_ok());
  EXPECT_TRUE(s.lease(10, StageReport{2, 2, ""}, now).is_ok());
}

}  // namespace refit::control

namespace refit::control {

// A member whose connection broke registers again, the same, on a new
// connection: it is taken over at once, its lease kept, with no new plan.
// Another registration of that rank waits for the heartbeat timeout, and a
// rank whose connection is open is never taken.
TEST(ControlState, TheSameRegistrationTakesOverARankWhoseConnectionClosed) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), now).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, now).is_ok());
  const uint64_t epoch = s.epoch();

  Status open = s.register_receiver(11, receiver(0, 0), now);
  ASSERT_FALSE(open.is_ok());
  EXPECT_NE(open.message().find("is already registered"), std::string::npos) << open.message();

  s.session_closed(10);
  ASSERT_TRUE(s.register_receiver(12, receiver(0, 0), now).is_ok());
  EXPECT_EQ(s.epoch(), epoch) << "a member taken over is not a new membership";
  EXPECT_TRUE(s.heartbeat(12, MemberRef{Role::kReceiver, 0}, now).is_ok());
  EXPECT_FALSE(s.heartbeat(10, MemberRef{Role::kReceiver, 0}, now).is_ok()) << "the closed connection owns nothing";
  EXPECT_TRUE(s.lease(12, StageReport{0, 1, ""}, now).is_ok()) << "the lease is renewed by the new connection";
  EXPECT_TRUE(s.release(12, StageReport{0, 1, ""}).is_ok());

  s.session_closed(1);
  EXPECT_TRUE(s.register_source(2, source(0), now).is_ok());
}

// A new process registers a rank whose connection closed, with another
// registration (its own worker address): it replaces the old member at once,
// which a member whose connection is open never is.
TEST(ControlState, AnotherRegistrationReplacesARankWhoseConnectionClosed) {
  ControlState s(StateLimits{}, 10s);
  const auto now = Clock::now();
  ASSERT_TRUE(s.register_source(1, source(0), now).is_ok());
  ASSERT_TRUE(s.register_receiver(10, receiver(0, 0), now).is_ok());
  ASSERT_TRUE(s.publish(1, 1).is_ok());
  ASSERT_TRUE(s.lease(10, StageReport{0, 1, ""}, now).is_ok());
  const uint64_t epoch = s.epoch();
  RegisterReceiver other = receiver(0, 0);
  other.worker_address = {9, 9, 9};
  EXPECT_FALSE(s.register_receiver(11, other, now).is_ok()) << "its connection is open";
  s.session_closed(10);
  ASSERT_TRUE(s.register_receiver(11, other, now).is_ok());
  EXPECT_NE(s.epoch(), epoch) << "a new member is a new membership";
  EXPECT_FALSE(s.release(11, StageReport{0, 1, ""}).is_ok()) << "the old member's lease went with it";
  RegisterSource src = source(0);
  src.worker_address = {7, 7};
  s.session_closed(1);
  EXPECT_TRUE(s.register_source(2, src, now).is_ok());
  EXPECT_TRUE(s.heartbeat(2, MemberRef{Role::kSource, 0}, now).is_ok());
}

}  // namespace refit::control
