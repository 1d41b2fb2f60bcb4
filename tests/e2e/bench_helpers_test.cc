// The helpers the bench and the end-to-end tests stand on, checked without
// librefit: the planner's own runs (for_each_run), executed with memcpy on
// buffers the pattern filled, must leave every receiver buffer exactly as
// verify() expects; verify() must name the first wrong byte; and the
// baselines' derived layouts must deliver the same bytes.

#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "planner/layout_json.h"
#include "planner/plan.h"
#include "tools/bench/agent.h"
#include "tools/bench/pattern.h"
#include "tools/bench/predict.h"
#include "tools/bench/process_group.h"
#include "tools/bench/rank_buffers.h"
#include "tools/bench/resident_memory.h"
#include "tools/bench/strategy_layouts.h"

namespace {

using refit::Layout;
using refit::Side;
using namespace refit::bench;

constexpr const char* kLayout = R"json({"format": "refit-layout/1",
  "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}, {"rank": 2, "domain": 0}],
  "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0},
                {"rank": 2, "domain": 1, "instance": 1}, {"rank": 3, "domain": 1, "instance": 1}],
  "tensors": [
    {"name": "w", "dtype": "BF16", "shape": [10, 7],
     "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(0)"]},
     "receiver": {"mesh": [2, 2], "ranks": [0, 1, 2, 3], "placements": ["R", "S(1)"]}},
    {"name": "q", "dtype": "F32", "shape": [8, 4],
     "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["R"]}},
    {"name": "k", "dtype": "F32", "shape": [4, 4],
     "source":   {"mesh": [3], "ranks": [0, 1, 2], "placements": ["S(0)"]}}],
  "buffers": [
    {"side": "receiver", "rank": 0, "name": "qk", "dtype": "F32", "bytes": 200,
     "segments": [{"tensor": "q", "start": [0, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                  {"tensor": "k", "start": [0, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]},
    {"side": "receiver", "rank": 3, "name": "qk", "dtype": "F32", "bytes": 200,
     "segments": [{"tensor": "q", "start": [4, 0], "size": [4, 4], "offset": 0, "strides": [4, 1]},
                  {"tensor": "k", "start": [2, 0], "size": [2, 4], "offset": 24, "strides": [4, 1]}]}]})json";

// Every buffer of every rank of a layout, filled as the bench's processes fill them.
class Memory {
 public:
  explicit Memory(const Layout& layout) : layout_(layout) {
    for (Side side : {Side::kSource, Side::kReceiver}) {
      for (int32_t r = 0; r < layout.num_ranks(side); ++r) {
        auto bufs = rank_buffers(layout, side, r);
        EXPECT_TRUE(bufs.is_ok()) << bufs.status().message();
        if (!bufs.is_ok()) continue;
        for (RankBuffer& b : *bufs) {
          bytes_[{side, r, b.index}].assign(static_cast<size_t>(b.bytes), side == Side::kReceiver ? kGuardByte : 0);
          buffers_[{side, r}].push_back(std::move(b));
        }
      }
    }
  }
  void fill_sources(int64_t version) {
    for (auto& [key, bufs] : buffers_)
      if (key.first == Side::kSource)
        for (const RankBuffer& b : bufs) fill(layout_, b, at(Side::kSource, key.second, b.index), version);
  }
  refit::Status verify_receivers(int64_t version) {
    for (auto& [key, bufs] : buffers_)
      if (key.first == Side::kReceiver)
        for (const RankBuffer& b : bufs) REFIT_RETURN_IF_ERROR(verify(layout_, b, at(Side::kReceiver, key.second, b.index), version));
    return refit::Status::ok();
  }
  uint8_t* at(Side side, int32_t rank, uint32_t buffer) { return bytes_.at({side, rank, buffer}).data(); }
  const std::vector<RankBuffer>& buffers(Side side, int32_t rank) { return buffers_[{side, rank}]; }

 private:
  const Layout& layout_;
  std::map<std::tuple<Side, int32_t, uint32_t>, std::vector<uint8_t>> bytes_;
  std::map<std::pair<Side, int32_t>, std::vector<RankBuffer>> buffers_;
};

// Executes the plan's runs one after another with memcpy.
void execute(const refit::Plan& plan, Memory& mem) {
  refit::for_each_run(plan, [&](const refit::Run& r) {
    const uint8_t* from = mem.at(r.from.side, r.from.rank, r.from.buffer) + r.from.offset;
    std::memcpy(mem.at(Side::kReceiver, r.to.rank, r.to.buffer) + r.to.offset, from, static_cast<size_t>(r.bytes));
  });
}

Layout parse(const char* text) {
  auto layout = refit::parse_layout_json(text, "test layout");
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  return layout.is_ok() ? std::move(*layout) : Layout();
}

TEST(BenchHelpers, PlannedRunsOfPatternedSourcesVerify) {
  Layout layout = parse(kLayout);
  auto plan = refit::make_plan(layout);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  Memory mem(layout);
  for (int64_t v = 1; v <= 3; ++v) {
    mem.fill_sources(v);
    if (v > 1) {
      EXPECT_FALSE(mem.verify_receivers(v).is_ok()) << "version " << v << " should differ from " << v - 1;
    }
    execute(*plan, mem);
    refit::Status s = mem.verify_receivers(v);
    EXPECT_TRUE(s.is_ok()) << s.message();
  }
}

TEST(BenchHelpers, VerifyNamesTheFirstWrongByte) {
  Layout layout = parse(kLayout);
  auto plan = refit::make_plan(layout);
  ASSERT_TRUE(plan.is_ok());
  Memory mem(layout);
  mem.fill_sources(5);
  execute(*plan, mem);
  // "qk" of receiver 3: k rows 2..3 start at element 24, byte 96; element
  // [3, 1] of k is the 6th of the segment: byte 96 + 5 * 4 = 116.
  const RankBuffer* qk = nullptr;
  for (const RankBuffer& b : mem.buffers(Side::kReceiver, 3))
    if (b.name == "qk") qk = &b;
  ASSERT_NE(qk, nullptr);
  uint8_t* data = mem.at(Side::kReceiver, 3, qk->index);
  data[117] ^= 0x40;
  refit::Status s = verify(layout, *qk, data, 5);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("buffer \"qk\" byte offset 116"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tensor \"k\" element 13 [3, 1]"), std::string::npos) << s.message();
  data[117] ^= 0x40;
  EXPECT_TRUE(verify(layout, *qk, data, 5).is_ok());

  // A byte outside every segment: bytes 64..95 lie between q and k.
  data[70] = 0;
  s = verify(layout, *qk, data, 5);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("byte offset 70 lies outside every segment"), std::string::npos) << s.message();
}

TEST(BenchHelpers, DescriptionsCarryEverySegment) {
  Layout layout = parse(kLayout);
  auto bufs = rank_buffers(layout, Side::kReceiver, 0);
  ASSERT_TRUE(bufs.is_ok());
  bool saw_qk = false;
  for (const RankBuffer& b : *bufs) {
    auto doc = nlohmann::json::parse(receiver_buffer_json(layout, b));
    EXPECT_EQ(doc["name"], b.name);
    EXPECT_EQ(doc["segments"].size(), b.placed.size());
    if (b.name == "qk") {
      saw_qk = true;
      EXPECT_EQ(doc["dtype"], "F32");
      EXPECT_EQ(doc["segments"][1]["tensor"], "k");
      EXPECT_EQ(doc["segments"][1]["offset"], 24);
      EXPECT_EQ(doc["segments"][1]["strides"], nlohmann::json({4, 1}));
    }
  }
  EXPECT_TRUE(saw_qk);
  auto src = rank_buffers(layout, Side::kSource, 2);
  ASSERT_TRUE(src.is_ok());
  for (const RankBuffer& b : *src) {
    for (const std::string& d : source_tensor_jsons(layout, b)) {
      auto doc = nlohmann::json::parse(d);
      EXPECT_EQ(doc["buffer"], b.name);
      EXPECT_TRUE(doc.contains("shape"));
    }
  }
}

// Broadcast, executed in memory: the gather plan, then the spread plan from
// the gatherer's buffers, then each receiver's slices copied out of its
// scratch buffers (as the agent's "unpack" does) verify against the pattern.
TEST(BenchHelpers, BroadcastStagesDeliverTheSameBytes) {
  Layout layout = parse(kLayout);
  Layout g = gather_layout(layout);
  Layout p = spread_layout(layout);
  auto gplan = refit::make_plan(g);
  ASSERT_TRUE(gplan.is_ok()) << gplan.status().message();
  auto pplan = refit::make_plan(p);
  ASSERT_TRUE(pplan.is_ok()) << pplan.status().message();
  EXPECT_EQ(pplan->summary().network_bytes, pplan->summary().minimum_network_bytes);

  Memory orig(layout), gm(g), pm(p);
  gm.fill_sources(2);
  execute(*gplan, gm);
  // The gatherer's receiver buffers become stage 2's source buffers (same names).
  for (const RankBuffer& gb : gm.buffers(Side::kReceiver, 0))
    for (const RankBuffer& pb : pm.buffers(Side::kSource, 0))
      if (gb.name == pb.name) std::memcpy(pm.at(Side::kSource, 0, pb.index), gm.at(Side::kReceiver, 0, gb.index), gb.bytes);
  execute(*pplan, pm);
  for (int32_t r = 0; r < layout.num_ranks(Side::kReceiver); ++r) {
    for (const RankBuffer& b : orig.buffers(Side::kReceiver, r)) {
      for (const Placed& pl : b.placed) {
        const auto& st = p.tensors[pl.tensor];
        ASSERT_FALSE(st.receivers.empty());
        const uint8_t* from = pm.at(Side::kReceiver, r, st.buffer_of(Side::kReceiver, st.receivers[0]));
        uint8_t* to = orig.at(Side::kReceiver, r, b.index);
        refit::for_each_copy(pl.region->box, st.receivers[0], *pl.region, refit::dtype_bytes(st.dtype),
                             [&](int64_t fo, int64_t too, int64_t n) { std::memcpy(to + too, from + fo, n); });
      }
    }
  }
  refit::Status s = orig.verify_receivers(2);
  EXPECT_TRUE(s.is_ok()) << s.message();
}

TEST(BenchHelpers, NoDedupGivesEveryReceiverItsOwnDomain) {
  // Two replicas in one domain: refit pulls each byte once for both.
  Layout layout = parse(R"json({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}, {"rank": 1, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 1}],
    "tensors": [{"name": "w", "dtype": "BF16", "shape": [10, 6],
                 "source":   {"mesh": [2], "ranks": [0, 1], "placements": ["S(0)"]},
                 "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}]})json");
  Layout n = no_dedup_layout(layout);
  for (size_t r = 0; r < n.receivers.size(); ++r) EXPECT_EQ(n.receivers[r].domain, static_cast<int32_t>(r));
  auto a = refit::make_plan(layout);
  auto b = refit::make_plan(n);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  refit::PlanOptions nd;
  nd.strategy = refit::Strategy::kNoDedup;
  auto c = refit::make_plan(layout, nd);
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(b->summary().network_bytes, c->summary().network_bytes);
  EXPECT_GT(b->summary().network_bytes, a->summary().network_bytes);
}

// refit-bench --hardware predicts with the gathers its receivers are
// configured with: --no-gather, then --receiver-config's keys, which the
// bench sets last.
TEST(BenchHelpers, PredictionGathersAsTheReceiversAreConfigured) {
  using nlohmann::json;
  const refit::GatherOptions defaults;
  refit::GatherOptions g = receiver_gathers(json::object(), true);
  EXPECT_TRUE(g.enabled);
  EXPECT_EQ(g.below_bytes, defaults.below_bytes);
  EXPECT_EQ(g.max_bytes, defaults.max_bytes);
  EXPECT_EQ(g.max_entries, defaults.max_entries);
  EXPECT_FALSE(receiver_gathers(json::object(), false).enabled);
  g = receiver_gathers(json{{"gather_below_bytes", 4096}, {"gather_bytes", 65536}, {"gather_entries", 2}}, true);
  EXPECT_TRUE(g.enabled);
  EXPECT_EQ(g.below_bytes, 4096);
  EXPECT_EQ(g.max_bytes, 65536);
  EXPECT_EQ(g.max_entries, 2);
  EXPECT_TRUE(receiver_gathers(json{{"gather_below_bytes", 4096}}, false).enabled);  // the config wins
  EXPECT_FALSE(receiver_gathers(json{{"gather_below_bytes", 0}}, true).enabled);
  // "gather_bytes" unset is at most the window, as the agents take it.
  EXPECT_EQ(receiver_gathers(json{{"window_bytes", 8 << 20}}, true).max_bytes, 8 << 20);
  EXPECT_EQ(receiver_gathers(json{{"window_bytes", 8 << 20}, {"gather_bytes", 4096}}, true).max_bytes, 4096);

  // The prediction takes them: on kLayout, whose receivers pull rows of a
  // few bytes, gathers of at most 2 runs are more GETs than the defaults'.
  const Layout layout = parse(kLayout);
  const refit::HardwareModel hw = refit::default_hardware();
  auto a = predict(layout, refit::Strategy::kRefit, hw, defaults);
  refit::GatherOptions two = defaults;
  two.max_entries = 2;
  auto c = predict(layout, refit::Strategy::kRefit, hw, two);
  ASSERT_TRUE(a.is_ok() && c.is_ok());
  EXPECT_GT(c->seconds, a->seconds);
  two.max_entries = 1;
  auto bad = predict(layout, refit::Strategy::kRefit, hw, two);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("gather_entries"), std::string::npos) << bad.status().message();
}

// Nothing hangs: a child that stays silent misses its deadline and is
// killed, a child that dies is named with its exit status, and a refusal
// carries the child's reason.
TEST(ProcessGroupTest, SilentChildMissesItsDeadline) {
  ProcessGroup group;
  auto c = group.spawn("sleeper", [](Channel&) {
    ::sleep(600);
    return 0;
  });
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const auto t0 = Clock::now();
  auto r = group.request(*c, Json{{"cmd", "ping"}}, Clock::now() + std::chrono::milliseconds(300));
  ASSERT_FALSE(r.is_ok());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  EXPECT_NE(r.status().message().find("no answer to \"ping\" from sleeper before the deadline"), std::string::npos)
      << r.status().message();
  // The group killed it: asking again fails at once.
  auto again = group.request(*c, Json{{"cmd", "ping"}}, Clock::now() + std::chrono::seconds(5));
  ASSERT_FALSE(again.is_ok());
  EXPECT_NE(again.status().message().find("not running"), std::string::npos) << again.status().message();
}

TEST(ProcessGroupTest, DeadChildIsNamedWithItsStatus) {
  ProcessGroup group;
  auto c = group.spawn("quitter", [](Channel&) { return 7; });
  ASSERT_TRUE(c.is_ok());
  auto r = group.request(*c, Json{{"cmd", "ping"}}, Clock::now() + std::chrono::seconds(10));
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("quitter"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("exited with status 7"), std::string::npos) << r.status().message();
}

TEST(ProcessGroupTest, RefusalCarriesTheChildsReason) {
  ProcessGroup group;
  std::vector<size_t> kids;
  for (int i = 0; i < 3; ++i) {
    auto c = group.spawn("child " + std::to_string(i), [i](Channel& ch) {
      for (;;) {
        auto cmd = ch.receive(Clock::now() + std::chrono::seconds(30));
        if (!cmd.is_ok() || cmd->value("cmd", "") == "exit") return 0;
        ch.send(i == 1 ? Json{{"ok", false}, {"error", "boom"}} : Json{{"ok", true}, {"i", i}});
      }
    });
    ASSERT_TRUE(c.is_ok());
    kids.push_back(*c);
  }
  auto ok = group.request(std::vector<size_t>{kids[0], kids[2]}, Json{{"cmd", "ping"}}, Clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ((*ok)[1]["i"], 2);
  auto bad = group.request(kids, Json{{"cmd", "ping"}}, Clock::now() + std::chrono::seconds(10));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("child 1 failed to ping: boom"), std::string::npos) << bad.status().message();
}

TEST(ProcessGroupTest, ShutDownReapsEveryChild) {
  ProcessGroup group;
  for (int i = 0; i < 4; ++i) {
    auto c = group.spawn("child " + std::to_string(i), [](Channel& ch) {
      auto cmd = ch.receive(Clock::now() + std::chrono::seconds(30));
      return cmd.is_ok() ? 0 : 3;
    });
    ASSERT_TRUE(c.is_ok());
  }
  refit::Status s = group.shut_down(Clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(s.is_ok()) << s.message();
}

// A victim of request_tolerating is killed at its time, its killing is
// stamped, the others' answers still come back, and shut_down does not count
// its death as a failure (it was meant to die).
TEST(ProcessGroupTest, VictimIsKilledOnTimeAndNotCountedAtShutDown) {
  ProcessGroup group;
  auto echo = group.spawn("echo", [](Channel& ch) {
    for (;;) {
      auto cmd = ch.receive(Clock::now() + std::chrono::seconds(30));
      if (!cmd.is_ok() || cmd->value("cmd", "") == "exit") return cmd.is_ok() ? 0 : 3;
      ::usleep(300000);  // answers after the victim is dead
      ch.send(Json{{"ok", true}});
    }
  });
  auto victim = group.spawn("victim", [](Channel&) {
    ::sleep(600);
    return 0;
  });
  ASSERT_TRUE(echo.is_ok() && victim.is_ok());
  const int64_t t0 = monotonic_ns();
  int64_t killed_ns = 0;
  auto answers = group.request_tolerating({*echo, *victim}, Json{{"cmd", "work"}}, Clock::now() + std::chrono::seconds(10),
                                          *victim, Clock::now() + std::chrono::milliseconds(100), &killed_ns);
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_TRUE(answers[0].ok) << answers[0].error;
  EXPECT_FALSE(answers[1].ok);
  EXPECT_NE(answers[1].error.find("victim was killed (SIGKILL) while it ran \"work\""), std::string::npos)
      << answers[1].error;
  EXPECT_GE(killed_ns - t0, 100'000'000);
  EXPECT_LT(killed_ns - t0, 2'000'000'000);
  EXPECT_FALSE(group.running(*victim));
  EXPECT_TRUE(group.running(*echo));
  refit::Status s = group.shut_down(Clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(s.is_ok()) << s.message();
}

// A standby answers pings until told to become its rank, and only then
// runs the agent's command loop.
TEST(ProcessGroupTest, StandbyBecomesItsRankOnlyWhenTold) {
  const Layout layout = parse(kLayout);
  AgentSpec spec;
  spec.receiver_layout = &layout;
  spec.receiver_rank = 0;
  ProcessGroup group;
  auto c = group.spawn("standby", [&spec](Channel& ch) { return run_standby(spec, ch); });
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(10); };
  auto ping = group.request(*c, Json{{"cmd", "ping"}}, deadline());
  ASSERT_TRUE(ping.is_ok()) << ping.status().message();
  auto early = group.request(*c, Json{{"cmd", "verify"}, {"version", 1}}, deadline());
  ASSERT_FALSE(early.is_ok());
  EXPECT_NE(early.status().message().find("a standby answers only ping, become and exit"), std::string::npos)
      << early.status().message();
  // The refusal killed the group's children: a new standby becomes the rank.
  ProcessGroup again;
  auto d = again.spawn("standby", [&spec](Channel& ch) { return run_standby(spec, ch); });
  ASSERT_TRUE(d.is_ok());
  auto became = again.request(*d, Json{{"cmd", "become"}}, deadline());
  ASSERT_TRUE(became.is_ok()) << became.status().message();
  EXPECT_EQ(became->value("pid", int64_t{0}), static_cast<int64_t>(again.pid(*d)));
  // The agent's loop now: it knows "ping", and refuses a rejoin before a receiver exists.
  ASSERT_TRUE(again.request(*d, Json{{"cmd", "ping"}}, deadline()).is_ok());
  auto rejoin = again.request(*d, Json{{"cmd", "rejoin"}}, deadline());
  ASSERT_FALSE(rejoin.is_ok());
  EXPECT_NE(rejoin.status().message().find("rejoin before \"receiver\""), std::string::npos)
      << rejoin.status().message();
}

TEST(ResidentMemory, CountsThePagesThisProcessTouches) {
  auto before = resident_kib();
  ASSERT_TRUE(before.is_ok()) << before.status().message();
  EXPECT_GT(*before, 0);
  constexpr size_t kBytes = 64u << 20;
  std::vector<uint8_t> touched(kBytes, 1);
  auto after = resident_kib();
  ASSERT_TRUE(after.is_ok()) << after.status().message();
  EXPECT_GE(*after - *before, static_cast<int64_t>(kBytes / 1024) * 9 / 10) << *before << " -> " << *after << " KiB";
  EXPECT_EQ(touched[kBytes - 1], 1);
  auto self = resident_kib(::getpid());
  ASSERT_TRUE(self.is_ok());
  EXPECT_GT(*self, 0);
  auto gone = resident_kib(2147483647);
  ASSERT_FALSE(gone.is_ok());
  EXPECT_NE(gone.status().message().find("/proc/2147483647/status"), std::string::npos) << gone.status().message();
}

}  // namespace
