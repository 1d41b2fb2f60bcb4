// The refresh simulator on plans small enough to check by hand
// (docs/simulator.md gives the model these figures follow).

#include "tools/sim/simulator.h"

#include "tools/sim/events.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <tuple>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "planner/get_stats.h"
#include "planner/layout_json.h"
#include "transport/fabric/pack.h"
#include "transport/ucx/chunking.h"

namespace refit::sim {
namespace {

using nlohmann::json;

// 1 byte per nanosecond on every link, no achievable-fraction discount, and
// round figures for the fixed costs: times come out in plain microseconds.
HardwareModel unit_hardware() {
  HardwareModel h = default_hardware();
  h.nic_gbit_per_gpu = 8;  // 1e9 bytes/s
  h.nic_achievable = 1;
  h.nvlink_gbyte_per_gpu = 4.096;  // 4096 bytes in 1 us
  h.nvlink_achievable = 1;
  h.latency_us = 2;
  h.get_op_us = 1;
  h.local_op_us = 5;
  h.h2d_gbyte_per_gpu = 2.048;  // 4096 bytes in 2 us
  h.d2h_gbyte_per_gpu = 1.024;  // 4096 bytes in 4 us
  h.fanout_pack_bytes = 0;      // one op per send (the packed fan-out has tests of its own)
  h.fanout_rounds = false;      // one after another per puller (the rounds have tests of their own)
  return h;
}

// A layout of one F32 tensor "w" of `elems` elements, held whole by every
// source rank and needed whole by every receiver rank; `receiver_domains`
// gives each receiver rank's domain.
Layout replicated(int sources, const std::vector<int>& receiver_domains, int64_t elems) {
  json l;
  l["format"] = "refit-layout/1";
  json src = json::array(), rcv = json::array(), sranks = json::array(), rranks = json::array();
  for (int s = 0; s < sources; ++s) {
    src.push_back({{"rank", s}, {"domain", 0}});
    sranks.push_back(s);
  }
  for (size_t r = 0; r < receiver_domains.size(); ++r) {
    rcv.push_back({{"rank", r}, {"domain", receiver_domains[r]}, {"instance", r}});
    rranks.push_back(r);
  }
  l["sources"] = src;
  l["receivers"] = rcv;
  l["tensors"] = json::array({{{"name", "w"},
                               {"dtype", "F32"},
                               {"shape", {elems}},
                               {"source", {{"mesh", {sources}}, {"ranks", sranks}, {"placements", {"R"}}}},
                               {"receiver",
                                {{"mesh", {static_cast<int>(receiver_domains.size())}},
                                 {"ranks", rranks},
                                 {"placements", {"R"}}}}}});
  auto layout = parse_layout_json(l.dump(), "test layout");
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  return std::move(*layout);
}

SimResult simulated(const Plan& plan, const HardwareModel& hw, bool trace = false, bool gather = true) {
  SimOptions o;
  o.trace = trace;
  o.gather.enabled = gather;
  auto r = simulate(plan, hw, o);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.is_ok() ? std::move(*r) : SimResult{};
}

constexpr double kUs = 1e-6;

TEST(Simulator, OneGetTakesLatencyPlusOpCostPlusBytesOverBandwidth) {
  const Layout L = replicated(1, {0}, 1024);  // 4096 bytes
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware());
  EXPECT_EQ(r.model, "event");
  EXPECT_EQ(r.gets, 1);
  EXPECT_EQ(r.network_bytes, 4096);
  // 2 us latency + 1 us per GET + 4096 bytes at 1 byte/ns.
  EXPECT_NEAR(r.predicted_seconds, (2 + 1 + 4.096) * kUs, 1e-12);
  EXPECT_NEAR(r.busiest_receiver_nic.busy_seconds, 4.096 * kUs, 1e-12);
  EXPECT_NEAR(r.busiest_posting.busy_seconds, 1 * kUs, 1e-12);
  EXPECT_EQ(r.busiest_posting.bytes, 1);  // GETs
  EXPECT_NEAR(r.busiest_source_nic.busy_seconds, 4.096 * kUs, 1e-12);
  EXPECT_EQ(r.busiest_source_nic.bytes, 4096);
  EXPECT_EQ(r.phases.fanout.end, 0);
}

TEST(Simulator, TwoGetsFromOneSourceTakeTurnsOnItsNic) {
  // Two receivers in two domains: each pulls the tensor itself, both from
  // the only source, whose NIC serves one GET after the other.
  const Layout L = replicated(1, {0, 1}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware());
  EXPECT_EQ(r.gets, 2);
  // The second starts once the first has left the source NIC (4.096 us).
  EXPECT_NEAR(r.predicted_seconds, (4.096 + 1 + 4.096 + 2) * kUs, 1e-12);
  EXPECT_NEAR(r.busiest_source_nic.busy_seconds, 2 * 4.096 * kUs, 1e-12);
  EXPECT_EQ(r.busiest_source_nic.bytes, 2 * 4096);
}

TEST(Simulator, TwoSourcesServeTwoReceiversAtOnce) {
  // Two replicas of the source: the planner puts one receiver on each.
  const Layout L = replicated(2, {0, 1}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware());
  EXPECT_NEAR(r.predicted_seconds, (2 + 1 + 4.096) * kUs, 1e-12);
}

TEST(Simulator, FanOutWaitsForTheGetItPassesOn) {
  // One domain of two receivers: one pulls, then sends it over NVLink.
  const Layout L = replicated(1, {0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware(), /*trace=*/true);
  EXPECT_EQ(r.gets, 1);
  EXPECT_EQ(r.local_sends, 1);
  EXPECT_EQ(r.local_bytes, 4096);
  const double landed = (2 + 1 + 4.096) * kUs;
  EXPECT_NEAR(r.phases.network.end, landed, 1e-12);
  EXPECT_NEAR(r.phases.fanout.start, landed, 1e-12);
  // 5 us to launch the send, 4096 bytes at 4096 bytes/us.
  EXPECT_NEAR(r.predicted_seconds, landed + (5 + 1) * kUs, 1e-12);
  EXPECT_EQ(r.busiest_nvlink_out.bytes, 4096);
  // The trace has the GET on both NICs and the send on both NVLink ends.
  int nic = 0, nvl = 0;
  for (const TraceSpan& t : r.trace) {
    nic += t.lane == Lane::kSourceNic || t.lane == Lane::kReceiverNic;
    nvl += t.lane == Lane::kNvlinkOut || t.lane == Lane::kNvlinkIn;
  }
  EXPECT_EQ(nic, 2);
  EXPECT_EQ(nvl, 2);
}

TEST(Simulator, TheWindowHoldsBackGetsBeyondIt) {
  // 3 MiB in GETs of 1 MiB.
  const Layout L = replicated(1, {0}, 3 << 18);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.get_chunk_bytes = 1 << 20;
  const double wire = (1 << 20) * 1e-9;
  // A window of all three: posted one after another, the next posted while
  // the one before crosses, so the wire is busy back to back.
  hw.window_bytes = 32 << 20;
  SimResult r = simulated(*plan, hw);
  EXPECT_EQ(r.gets, 3);
  EXPECT_NEAR(r.predicted_seconds, 1 * kUs + 3 * wire + 2 * kUs, 1e-12);
  // A window of one GET: each waits for the one before to land.
  hw.window_bytes = 1 << 20;
  r = simulated(*plan, hw);
  EXPECT_NEAR(r.predicted_seconds, 3 * (1 * kUs + wire + 2 * kUs), 1e-12);
}

// A 4-byte tensor makes the windows short (nine tenths of the latency
// and its 4 ns), and 48 receivers that each pull a megabyte from one
// source land their chunks up to 48 ms later: tens of thousands of windows
// ahead, where the queue of windows keeps them apart from its ring
// (tools/sim/simulator.cc, WindowQueue). The source's NIC is busy from the
// first post to the last byte, and the result is the same on one worker
// and on several.
TEST(Simulator, ChunksLandingThousandsOfWindowsAheadKeepTheirOrder) {
  constexpr int kReceivers = 48;
  json l;
  l["format"] = "refit-layout/1";
  json rcv = json::array(), rranks = json::array();
  for (int r = 0; r < kReceivers; ++r) {
    rcv.push_back({{"rank", r}, {"domain", r}, {"instance", r}});
    rranks.push_back(r);
  }
  l["sources"] = json::array({{{"rank", 0}, {"domain", 0}}, {{"rank", 1}, {"domain", 1}}});
  l["receivers"] = rcv;
  l["tensors"] = json::array();
  // Each from a source of its own, so that the small one is a GET of its own.
  for (auto [name, elems, source] : {std::tuple{"w", 250000, 0}, std::tuple{"b", 1, 1}}) {
    l["tensors"].push_back({{"name", name},
                            {"dtype", "F32"},
                            {"shape", {elems}},
                            {"source", {{"mesh", {1}}, {"ranks", {source}}, {"placements", {"R"}}}},
                            {"receiver", {{"mesh", {kReceivers}}, {"ranks", rranks}, {"placements", {"R"}}}}});
  }
  auto layout = parse_layout_json(l.dump(), "test layout");
  ASSERT_TRUE(layout.is_ok()) << layout.status().message();
  auto plan = make_plan(*layout);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.get_chunk_bytes = 1 << 20;
  // Copied on to the GPU in the order they land: the order shows.
  hw.gets_land_in_host = true;
  const SimResult one = simulated(*plan, hw);
  EXPECT_EQ(one.network_bytes, kReceivers * 1000004);
  // A receiver starts at its first_endpoint (transport/ucx/chunking.h):
  // one that starts at source 0 posts its megabyte at 1 us and its 4 bytes
  // at 2 us, one that starts at source 1 the other way round. The first
  // source's NIC sends the megabytes back to back from 1 us, those posted
  // at 2 us last. So the last megabyte is that of a receiver whose 4 bytes
  // landed long before: the network ends when it lands, 2 us after it
  // has left, and the refresh when it is copied to the GPU (4096 bytes in
  // 2 us). (Had every receiver started at source 0, the last one's 4 bytes
  // would land 4 ns after its megabyte, and be copied after it.)
  int start_at_1 = 0;
  for (int r = 0; r < kReceivers; ++r) start_at_1 += ucx::first_endpoint(static_cast<uint64_t>(r), 2) == 1;
  ASSERT_GT(start_at_1, 0);
  ASSERT_LT(start_at_1, kReceivers);
  const double landed = 1 * kUs + kReceivers * 1e6 * 1e-9 + 2 * kUs;
  EXPECT_NEAR(one.phases.network.end, landed, 1e-12);
  EXPECT_NEAR(one.predicted_seconds, landed + 1e6 / 2.048e9, 1e-12);
  // Each receiver starts where its own rank says: its NIC first takes in
  // the 4 bytes where that is source 1 (the megabyte comes much later, a
  // span of its own), else the megabyte and, right after it, the 4 bytes
  // (one span, the adjacent intervals joined).
  {
    const SimResult traced = simulated(*plan, hw, /*trace=*/true);
    std::vector<const TraceSpan*> first(kReceivers, nullptr);
    for (const TraceSpan& t : traced.trace) {
      if (t.lane != Lane::kReceiverNic) continue;
      const TraceSpan*& f = first[static_cast<size_t>(t.rank)];
      if (f == nullptr || t.start < f->start) f = &t;
    }
    for (int r = 0; r < kReceivers; ++r) {
      ASSERT_NE(first[r], nullptr) << "receiver " << r;
      EXPECT_EQ(first[r]->bytes, ucx::first_endpoint(static_cast<uint64_t>(r), 2) == 1 ? 4 : 1000004)
          << "receiver " << r;
    }
  }
  EXPECT_NEAR(one.busiest_source_nic.busy_seconds, kReceivers * 1e6 * 1e-9, 1e-12);
  hw.fanout_rounds = true;  // several workers simulate the network only with rounds
  for (int threads : {1, 2, 3}) {
    SimOptions o;
    o.threads = threads;
    auto r = simulate(*plan, hw, o);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r->predicted_seconds, one.predicted_seconds) << threads << " threads";
    EXPECT_EQ(r->events, one.events) << threads << " threads";
    EXPECT_EQ(r->busiest_receiver_nic.busy_seconds, one.busiest_receiver_nic.busy_seconds) << threads << " threads";
  }
}

Event event_at(double t, int32_t receiver, bool landed, uint64_t seq) {
  Event e{};
  e.t = t;
  e.receiver = receiver;
  e.landed = landed;
  e.seq = seq;
  return e;
}

// The queue by window (tools/sim/events.h): a receiver's events of one
// kind come out in the order they were pushed, ties in time included,
// whether they waited in the heap past the ring or went into it directly;
// it refuses an event before the current window, before its receiver's
// last of its kind, or too far ahead to count.
TEST(WindowQueue, GivesAReceiversEventsOfOneKindInTheOrderPushed) {
  WindowQueue q;
  q.reset(1.0, 4);  // windows of a second
  EXPECT_EQ(q.next_window(), WindowQueue::kNoWindow);
  // Past the ring (4096 windows): six landed chunks each of receivers 0
  // and 1 at one time, and six posts of receiver 2 a little earlier.
  for (uint64_t seq = 0; seq < 6; ++seq) {
    ASSERT_TRUE(q.push(event_at(5000.5, 0, true, seq)));
    ASSERT_TRUE(q.push(event_at(5000.5, 1, true, seq)));
    ASSERT_TRUE(q.push(event_at(5000.25, 2, false, seq)));
  }
  ASSERT_TRUE(q.push(event_at(3.5, 3, true, 0)));
  ASSERT_TRUE(q.push(event_at(3.5, 3, true, 1)));
  EXPECT_FALSE(q.push(event_at(3.25, 3, true, 2))) << "before its receiver's last landed chunk";
  EXPECT_FALSE(q.push(event_at(1e30, 3, true, 2))) << "more than 2^62 windows ahead";
  EXPECT_EQ(q.next_window(), 3u);
  std::vector<Event> out;
  q.take(3, out);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].seq, 0u);
  EXPECT_EQ(out[1].seq, 1u);
  EXPECT_FALSE(q.push(event_at(2.5, 2, false, 6))) << "before the current window";
  EXPECT_EQ(q.next_window(), 5000u);
  // An empty window within the ring's reach of 5000: the heap's events of
  // window 5000 go into the ring, and one pushed there now comes after them.
  q.take(1000, out);
  EXPECT_TRUE(out.empty());
  ASSERT_TRUE(q.push(event_at(5000.75, 0, true, 6)));
  EXPECT_EQ(q.next_window(), 5000u);
  q.take(5000, out);
  ASSERT_EQ(out.size(), 19u);
  uint64_t next[3] = {0, 0, 0};
  for (const Event& e : out) {
    ASSERT_LT(e.receiver, 3);
    EXPECT_EQ(e.seq, next[e.receiver]++) << "receiver " << e.receiver;
  }
  EXPECT_EQ(next[0], 7u);
  EXPECT_EQ(q.next_window(), WindowQueue::kNoWindow);
}

TEST(Simulator, HostLandingAndPublishCopiesAddTheirTime) {
  const Layout L = replicated(1, {0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.gets_land_in_host = true;
  hw.source_host_mirror = true;
  const SimResult r = simulated(*plan, hw);
  // 4 us publish copy (the GET is posted meanwhile), then the GET crosses
  // (4.096 us) and lands (2 us), then 2 us to the GPU.
  EXPECT_NEAR(r.phases.publish.end, 4 * kUs, 1e-12);
  EXPECT_NEAR(r.phases.network.end, (4 + 4.096 + 2) * kUs, 1e-12);
  EXPECT_NEAR(r.predicted_seconds, (4 + 4.096 + 2 + 2) * kUs, 1e-12);
}

// A column slice of a row-major source: every row is its own run, of half
// a row of `cols` F32 for each of the two receivers.
Layout column_slices(int64_t rows = 64, int64_t cols = 8) {
  json l = json::parse(R"J({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 1, "instance": 1}],
    "tensors": [{"name": "w", "dtype": "F32", "shape": [64, 8],
      "source": {"mesh": [1], "ranks": [0], "placements": ["R"]},
      "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["S(1)"]}}]})J");
  l["tensors"][0]["shape"] = {rows, cols};
  auto L = parse_layout_json(l.dump(), "t");
  EXPECT_TRUE(L.is_ok()) << L.status().message();
  return L.is_ok() ? std::move(*L) : Layout{};
}

TEST(Simulator, WithoutGathersSmallRunsCostOneGetEach) {
  const Layout L = column_slices();  // the plan refers to it
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware(), false, /*gather=*/false);
  EXPECT_EQ(r.gathers, 0);
  EXPECT_EQ(r.gets, 128);  // 64 rows of 16 bytes, each receiver
  EXPECT_EQ(r.gets_per_receiver_max, 64);
  const GetStats g = get_stats(*plan, 1 << 20);
  EXPECT_EQ(g.gets, 128);
  EXPECT_EQ(g.gets_per_receiver_max, 64);
  EXPECT_EQ(g.get_bytes_median, 16);
  // Each receiver's 64 GETs cost 64 us of posting: the source NIC (2 x 1024
  // bytes) is not what takes the time.
  EXPECT_GT(r.predicted_seconds, 64 * kUs);
}

// With the agents' gathers, each receiver's 64 rows travel as one gather:
// one GET each, as refit-plan counts them (get_stats), and the per-GET cost
// no longer takes the time.
TEST(Simulator, GathersCountAsOneGetAsTheAgentsGroupThem) {
  const Layout L = column_slices();  // the plan refers to it
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware());
  const GatherOptions agents;
  const GetStats g = get_stats(*plan, 1 << 20, &agents);
  EXPECT_EQ(r.gathers, 2);
  EXPECT_EQ(r.gets, 2);
  EXPECT_EQ(r.gets, g.gets);
  EXPECT_EQ(r.gets_per_receiver_max, g.gets_per_receiver_max);
  EXPECT_EQ(r.network_bytes, 2 * 64 * 16);
  const SimResult plain = simulated(*plan, unit_hardware(), false, /*gather=*/false);
  EXPECT_LT(r.predicted_seconds, plain.predicted_seconds);
  EXPECT_LT(r.predicted_seconds, 8 * kUs);
}

// One shared machine (refit-bench): the CPU time of every transfer over its
// cores is a bound the prediction does not go below. Here the two gathers
// of 64 rows of 16 bytes (2048 bytes at 100 ns each) and their two GETs (1
// us each) are 206.8 us of CPU; on 2 cores 103.4 us, far above the
// event model's few microseconds.
TEST(Simulator, ASharedHostBoundsThePredictionByItsTransfersCpuTime) {
  const Layout L = column_slices();  // the plan refers to it
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult own = simulated(*plan, unit_hardware());
  EXPECT_EQ(own.host_cpu_seconds, 0);
  EXPECT_FALSE(own.host_bound);
  HardwareModel h = unit_hardware();
  h.host_cores = 2;
  h.get_cpu_ns = 1;
  h.gather_cpu_ns = 100;
  h.local_cpu_ns = 1;
  const SimResult shared = simulated(*plan, h);
  EXPECT_EQ(shared.gathered_bytes, 2 * 64 * 16);
  EXPECT_EQ(shared.local_bytes, 0);
  EXPECT_NEAR(shared.host_cpu_seconds, 2048 * 100e-9 + 2 * kUs, 1e-12);
  EXPECT_NEAR(shared.host_bound_seconds, shared.host_cpu_seconds / 2, 1e-12);
  EXPECT_TRUE(shared.host_bound);
  EXPECT_DOUBLE_EQ(shared.predicted_seconds, shared.host_bound_seconds);
  // Plain GETs are charged get_cpu_ns: without gathers the same bytes cost
  // 1 ns each, 128 GETs 1 us each; 130.048 us on 2 cores.
  const SimResult plain = simulated(*plan, h, false, /*gather=*/false);
  EXPECT_EQ(plain.gathered_bytes, 0);
  EXPECT_NEAR(plain.host_cpu_seconds, 2048 * 1e-9 + 128 * kUs, 1e-12);
  // A host with many cores binds no more: the event model's time stands.
  h.host_cores = 4096;
  const SimResult wide = simulated(*plan, h);
  EXPECT_FALSE(wide.host_bound);
  EXPECT_DOUBLE_EQ(wide.predicted_seconds, own.predicted_seconds);
}

// The shape behind dsv3-bf16-512-h100's busiest receiver (docs/simulator.md,
// "GETs in refit-plan --json"): a column slice of a row-major source, each
// receiver's rows a few hundred bytes or less, so the gathers fill up by
// their count of runs long before their 16 MiB. Here 40,000 rows of 128
// bytes for each of two receivers: with the agents' default of 8192 runs a
// gather, five GETs each (with 4096, ten).
TEST(GetStats, SmallRowsFillGathersOfTheAgentsDefaultEntries) {
  const Layout L = column_slices(40000, 64);  // the plan refers to it
  ASSERT_EQ(L.tensors.size(), 1u);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const GatherOptions agents;
  const GetStats g = get_stats(*plan, 1 << 20, &agents);
  EXPECT_EQ(g.gathered_runs, 2 * 40000);
  EXPECT_EQ(g.gathers, 2 * 5);
  EXPECT_EQ(g.gets_per_receiver_max, 5);
  // Four gathers of 8192 rows (1 MiB) and one of the other 7,232 each.
  EXPECT_EQ(g.sizes, (std::map<int64_t, int64_t>{{7232 * 128, 2}, {8192 * 128, 8}}));
  EXPECT_EQ(g.get_bytes_median, 8192 * 128);
  EXPECT_EQ(g.per_receiver_gathers, (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(g.per_receiver_small_alone, (std::vector<int64_t>{0, 0}));
  const SimResult r = simulated(*plan, unit_hardware());
  EXPECT_EQ(r.gets, g.gets);
  EXPECT_EQ(r.gets_per_receiver_max, g.gets_per_receiver_max);
  // Gathers too small for a row: every row travels alone.
  GatherOptions tiny;
  tiny.max_bytes = 64;
  const GetStats alone = get_stats(*plan, 1 << 20, &tiny);
  EXPECT_EQ(alone.per_receiver_small_alone, (std::vector<int64_t>{40000, 40000}));
  EXPECT_EQ(alone.per_receiver_gathers, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(alone.gets_per_receiver_max, 40000);
}

// One source; two receivers in domains of their own, each pulling for itself:
// a column slice of "rows" (64 rows of 128 bytes each), "mid" whole (one
// run of 3 MiB) and "big" whole (8 MiB).
Layout rows_mid_big() {
  json l = json::parse(R"J({"format": "refit-layout/1",
    "sources": [{"rank": 0, "domain": 0}],
    "receivers": [{"rank": 0, "domain": 1, "instance": 0}, {"rank": 1, "domain": 2, "instance": 1}],
    "tensors": [
      {"name": "rows", "dtype": "F32", "shape": [64, 64],
       "source": {"mesh": [1], "ranks": [0], "placements": ["R"]},
       "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["S(1)"]}},
      {"name": "mid", "dtype": "F32", "shape": [786432],
       "source": {"mesh": [1], "ranks": [0], "placements": ["R"]},
       "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}},
      {"name": "big", "dtype": "F32", "shape": [2097152],
       "source": {"mesh": [1], "ranks": [0], "placements": ["R"]},
       "receiver": {"mesh": [2], "ranks": [0, 1], "placements": ["R"]}}]})J");
  auto L = parse_layout_json(l.dump(), "t");
  EXPECT_TRUE(L.is_ok()) << L.status().message();
  return L.is_ok() ? std::move(*L) : Layout{};
}

// A receiver's GETs are its gathers, its GETs of small runs that travel
// alone, and the 1 MiB chunks of the runs of at least "gather_below_bytes"
// (get_stats.h): the three add up to its GETs, a small run of several
// chunks counting each.
TEST(GetStats, GathersSmallRunsAloneAndLargeRunsAddUpToTheGets) {
  const Layout L = rows_mid_big();  // the plan refers to it
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  // Runs below 4 MiB are grouped, but a gather holds at most 2 MiB: the
  // 3 MiB run of "mid" travels alone (unpacked), three GETs of 1 MiB.
  GatherOptions o;
  o.below_bytes = int64_t{4} << 20;
  o.max_bytes = int64_t{2} << 20;
  const GetStats g = get_stats(*plan, 1 << 20, &o);
  const int64_t big_chunks = 8;
  EXPECT_EQ(g.unpacked, 2);
  EXPECT_EQ(g.per_receiver_gathers, (std::vector<int64_t>{1, 1}));  // the 64 rows
  EXPECT_EQ(g.per_receiver_small_alone, (std::vector<int64_t>{3, 3}));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(g.per_receiver_gathers[r] + g.per_receiver_small_alone[r] + big_chunks, g.per_receiver[r]) << r;
  }
  EXPECT_EQ(g.per_receiver, (std::vector<int64_t>{12, 12}));
  // Grouping off (refit-plan --no-gather): every run below the threshold
  // travels alone, the 64 rows one GET each and "mid" three.
  o.enabled = false;
  const GetStats off = get_stats(*plan, 1 << 20, &o);
  EXPECT_EQ(off.per_receiver_gathers, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(off.per_receiver_small_alone, (std::vector<int64_t>{64 + 3, 64 + 3}));
  EXPECT_EQ(off.per_receiver, (std::vector<int64_t>{64 + 3 + big_chunks, 64 + 3 + big_chunks}));
  // No gather options at all: no threshold, so nothing counts as small.
  const GetStats none = get_stats(*plan, 1 << 20);
  EXPECT_EQ(none.per_receiver_small_alone, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(none.per_receiver, off.per_receiver);
}

// What the one source may be asked to hold for the two receivers' gathers
// (1024 bytes each): all of it, or each receiver's window where that is less.
TEST(GetStats, GatherReplyMemoryWantedIsTheSourcesPullersWindowsAtMost) {
  const Layout L = column_slices();  // the plan refers to it
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const GatherOptions agents;
  GetStats g = get_stats(*plan, 1 << 20, &agents, nullptr, 1 << 20);
  EXPECT_EQ(g.gather_reply_bytes_wanted, 2048);
  EXPECT_EQ(g.gather_reply_wanted_source, 0);
  g = get_stats(*plan, 1 << 20, &agents, nullptr, 512);
  EXPECT_EQ(g.gather_reply_bytes_wanted, 1024);
  g = get_stats(*plan, 1 << 20, &agents);  // no window: not computed
  EXPECT_EQ(g.gather_reply_bytes_wanted, 0);
  EXPECT_EQ(g.gather_reply_wanted_source, -1);
}

TEST(LowerBound, IsTheLargestOfTheThreeTerms) {
  // Two receivers in one domain, one source: the domain needs 4096 bytes,
  // through two NICs; all sources (one NIC) must serve 4096.
  const Layout L = replicated(1, {0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  auto lb = lower_bound(*plan, unit_hardware());
  ASSERT_TRUE(lb.is_ok());
  EXPECT_NEAR(lb->domain_nic_seconds, 4096 / 2e9, 1e-15);
  EXPECT_NEAR(lb->source_nics_seconds, 4096 / 1e9, 1e-15);
  // Each GPU needs 4096 bytes through its NIC (1e9) and NVLink (4.096e9).
  EXPECT_NEAR(lb->gpu_ingress_seconds, 4096 / 5.096e9, 1e-15);
  EXPECT_NEAR(lb->source_exclusive_seconds, 4096 / 1e9, 1e-15);
  EXPECT_NEAR(lb->seconds, 4096 / 1e9, 1e-15);
  EXPECT_EQ(lb->binding, "all source NICs");
}

TEST(Simulator, RefusesBadHardwareNamingTheKey) {
  const Layout L = replicated(1, {0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.get_op_us = 0;
  auto r = simulate(*plan, hw);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("get_op_us"), std::string::npos) << r.status().message();
  hw = unit_hardware();
  hw.nic_gbit_per_gpu = 8 * 100 * 4.096 * 2;  // 200x NVLink
  r = simulate(*plan, hw);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("nic_gbit_per_gpu"), std::string::npos) << r.status().message();
  // A fraction of a byte would be cut into chunks of 0 bytes.
  hw = unit_hardware();
  hw.get_chunk_bytes = 0.5;
  r = simulate(*plan, hw);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("\"get_chunk_bytes\" must be a whole number of bytes"), std::string::npos)
      << r.status().message();
  hw = unit_hardware();
  hw.window_bytes = 1e30;
  r = simulate(*plan, hw);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("\"window_bytes\" must be a whole number of bytes"), std::string::npos)
      << r.status().message();
}

TEST(Simulator, BroadcastIsEstimatedNotSimulated) {
  const Layout L = replicated(1, {0, 1}, 1024);
  PlanOptions o;
  o.strategy = Strategy::kBroadcast;
  auto plan = make_plan(L, o);
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(simulate(*plan, unit_hardware()).is_ok());
  const SimResult r = estimate_broadcast(*plan, unit_hardware());
  EXPECT_EQ(r.model, "fluid");
  // No gather (the source holds it whole); the source NIC serves 2 x 4096.
  EXPECT_NEAR(r.predicted_seconds, 2 * 4.096 * kUs + 2 * kUs, 1e-12);
  // On one shared core: both receivers' 4096 bytes by GET (10 ns a byte)
  // and their copies out (5 ns a byte), and two GETs of 1 us.
  HardwareModel h = unit_hardware();
  h.host_cores = 1;
  h.get_cpu_ns = 10;
  h.local_cpu_ns = 5;
  const SimResult shared = estimate_broadcast(*plan, h);
  EXPECT_NEAR(shared.host_cpu_seconds, 2 * 4096 * 15e-9 + 2 * kUs, 1e-12);
  EXPECT_TRUE(shared.host_bound);
  EXPECT_DOUBLE_EQ(shared.predicted_seconds, shared.host_cpu_seconds);
}

TEST(Simulator, TraceIsChromeTraceEventJson) {
  const Layout L = replicated(1, {0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  const SimResult r = simulated(*plan, unit_hardware(), /*trace=*/true);
  std::string text;
  ASSERT_TRUE(write_trace_json(r, "t \"1\"", [&](std::string_view s) {
    text.append(s);
    return true;
  }));
  const json j = json::parse(text);
  ASSERT_TRUE(j["traceEvents"].is_array());
  int spans = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] != "X") continue;
    ++spans;
    EXPECT_GE(e["dur"].get<double>(), 0);
  }
  EXPECT_EQ(spans, 5);  // posting, both NICs, both NVLink ends
  EXPECT_EQ(j["otherData"]["title"], "t \"1\"");
}


// One BF16 weight [128, 128] (32768 bytes) on one source, held in F8_E4M3
// with its one block scale by two receivers of one domain (`dtype` the
// receivers'; a cast to BF16 from F32 has no scales).
Layout converted(const std::string& from, const std::string& to) {
  const int64_t rb = to == "F8_E4M3" ? 1 : 2;
  json l = json::parse(R"J({"format": "refit-layout/1", "weight_block_size": [128, 128],
     "sources": [{"rank": 0, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0}],
     "tensors": [{"name": "w.weight", "shape": [128, 128], "source": {"mesh": [1], "ranks": [0], "placements": ["R"]}}],
     "buffers": []})J");
  l["tensors"][0]["dtype"] = from;
  if (to == "F8_E4M3") l["tensors"].push_back({{"name", "w.weight_scale_inv"}, {"dtype", "F32"}, {"shape", {1, 1}}});
  for (int r = 0; r < 2; ++r) {
    l["buffers"].push_back({{"side", "receiver"}, {"rank", r}, {"name", "w"}, {"dtype", to}, {"bytes", 16384 * rb},
                            {"segments", {{{"tensor", "w.weight"}, {"start", {0, 0}}, {"size", {128, 128}},
                                           {"offset", 0}, {"strides", {128, 1}}}}}});
    if (to != "F8_E4M3") continue;
    l["buffers"].push_back({{"side", "receiver"}, {"rank", r}, {"name", "s"}, {"dtype", "F32"}, {"bytes", 4},
                            {"segments", {{{"tensor", "w.weight_scale_inv"}, {"start", {0, 0}}, {"size", {1, 1}},
                                           {"offset", 0}, {"strides", {1, 1}}}}}});
  }
  auto layout = parse_layout_json(l.dump(), "converted layout");
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  return std::move(*layout);
}

TEST(Simulator, ConversionStagesConvertsAndFansOutTheReceiversDtype) {
  const Layout L = converted("BF16", "F8_E4M3");
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareModel hw = unit_hardware();
  hw.convert_gbyte_per_gpu = 4.096;  // 32768 bytes in 8 us
  const SimResult r = simulated(*plan, hw, /*trace=*/true);
  EXPECT_EQ(r.network_bytes, 32768);      // BF16 over the network
  EXPECT_EQ(r.local_bytes, 16384 + 4);    // E4M3 and the block's scale to the peer
  EXPECT_EQ(r.local_sends, 1);
  EXPECT_EQ(r.local_runs, 2);  // the FP8 box and its scale: two sends of the fabric
  EXPECT_EQ(r.converts, 1);
  EXPECT_EQ(r.convert_bytes, 32768);
  const double landed = (1 + 32.768 + 2) * kUs;
  EXPECT_NEAR(r.phases.network.end, landed, 1e-12);
  // The staged box to the GPU (16 us at 2048 bytes/us), the kernel (8 us).
  EXPECT_NEAR(r.phases.convert.start, landed, 1e-12);
  EXPECT_NEAR(r.phases.convert.end, landed + (16 + 8) * kUs, 1e-12);
  EXPECT_NEAR(r.phases.h2d.seconds(), 16 * kUs, 1e-12);
  EXPECT_EQ(r.busiest_convert.rank, 0);
  EXPECT_EQ(r.busiest_convert.bytes, 32768);
  // Then the send: 5 us and 16388 bytes at 4096 bytes/us.
  EXPECT_NEAR(r.phases.fanout.start, landed + 24 * kUs, 1e-12);
  EXPECT_NEAR(r.predicted_seconds, landed + (24 + 5 + 16388.0 / 4096) * kUs, 1e-12);
  bool lane = false;
  for (const TraceSpan& t : r.trace) lane |= t.lane == Lane::kConvert && t.rank == 0 && t.bytes == 32768;
  EXPECT_TRUE(lane);
  // The bound: the domain's BF16 over its two NICs; a GPU's FP8 (no
  // scales: a puller computes them) over its NIC and NVLink.
  auto lb = lower_bound(*plan, hw);
  ASSERT_TRUE(lb.is_ok());
  EXPECT_NEAR(lb->domain_nic_seconds, 32768 / 2e9, 1e-15);
  EXPECT_NEAR(lb->gpu_ingress_seconds, 16384 / (1e9 + 4.096e9), 1e-15);

  // GETs that land in host memory: the staging area is host memory, only
  // the conversion's copy goes to the GPU.
  hw.gets_land_in_host = true;
  const SimResult h = simulated(*plan, hw);
  EXPECT_NEAR(h.phases.h2d.seconds(), 16 * kUs, 1e-12);
  EXPECT_NEAR(h.predicted_seconds, r.predicted_seconds, 1e-12);

  // Receivers in host memory: the CPU kernel alone (32768 bytes in 16 us).
  hw.gets_land_in_host = false;
  hw.convert_on_host = true;
  hw.host_convert_gbyte = 2.048;
  const SimResult c = simulated(*plan, hw);
  EXPECT_EQ(c.phases.h2d.end, 0);
  EXPECT_NEAR(c.phases.convert.end, landed + 16 * kUs, 1e-12);
  EXPECT_NEAR(c.predicted_seconds, landed + (16 + 5 + 16388.0 / 4096) * kUs, 1e-12);
}

TEST(Simulator, CastIntoGpuMemoryRunsOnTheHostThenCopiesItsOutput) {
  const Layout L = converted("F32", "BF16");
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareModel hw = unit_hardware();
  hw.host_convert_gbyte = 8.192;  // 65536 bytes of F32 in 8 us
  const SimResult r = simulated(*plan, hw);
  EXPECT_EQ(r.network_bytes, 65536);
  EXPECT_EQ(r.local_bytes, 32768);
  const double landed = (1 + 65.536 + 2) * kUs;
  // The cast (8 us), then its 32768 BF16 bytes to the GPU (16 us), then the
  // send (5 us + 8 us).
  EXPECT_NEAR(r.phases.convert.end, landed + (8 + 16) * kUs, 1e-12);
  EXPECT_NEAR(r.predicted_seconds, landed + (8 + 16 + 5 + 8) * kUs, 1e-12);
}

// A relayout (docs/refresh.md, "Column-major receivers"): BF16 [128, 128]
// row-major on one source, column-major on two receivers of one domain.
// It is costed as a copy: into GPU memory the staged box to the GPU, then a
// device copy; on the host the one-thread CPU rate. No quantization.
TEST(Simulator, RelayoutCostsACopy) {
  json l = json::parse(R"J({"format": "refit-layout/1",
     "sources": [{"rank": 0, "domain": 0}],
     "receivers": [{"rank": 0, "domain": 0, "instance": 0}, {"rank": 1, "domain": 0, "instance": 0}],
     "tensors": [{"name": "w", "dtype": "BF16", "shape": [128, 128],
                  "source": {"mesh": [1], "ranks": [0], "placements": ["R"]}}],
     "buffers": []})J");
  for (int r = 0; r < 2; ++r) {
    l["buffers"].push_back({{"side", "receiver"}, {"rank", r}, {"name", "w"}, {"dtype", "BF16"}, {"bytes", 32768},
                            {"segments", {{{"tensor", "w"}, {"start", {0, 0}}, {"size", {128, 128}},
                                           {"offset", 0}, {"strides", {1, 128}}}}}});
  }
  auto L = parse_layout_json(l.dump(), "column-major layout");
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  PlanOptions po;
  po.relayout_below_bytes = 4096;
  auto plan = make_plan(*L, po);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareModel hw = unit_hardware();
  hw.gpu_memory_gbyte_per_gpu = 8.192;  // a copy reads and writes: 32768 bytes in 8 us
  hw.gpu_memory_achievable = 1;
  hw.convert_gbyte_per_gpu = 0.001;     // a quantization would take 32 ms
  const SimResult r = simulated(*plan, hw, /*trace=*/false, /*gather=*/false);
  EXPECT_EQ(r.converts, 1);
  EXPECT_EQ(r.convert_bytes, 32768);
  EXPECT_EQ(r.gets, 1);  // one staged run of 32768 bytes, not 16384 of 2
  EXPECT_EQ(r.local_sends, 1);
  const double landed = (1 + 32.768 + 2) * kUs;
  EXPECT_NEAR(r.phases.network.end, landed, 1e-12);
  // The staged box to the GPU (16 us), the device copy (8 us).
  EXPECT_NEAR(r.phases.convert.end, landed + (16 + 8) * kUs, 1e-12);
  EXPECT_NEAR(r.phases.h2d.seconds(), 16 * kUs, 1e-12);
  // Receivers in host memory: 32768 bytes at the CPU rate (16 us).
  hw.convert_on_host = true;
  hw.host_convert_gbyte = 2.048;
  const SimResult h = simulated(*plan, hw, /*trace=*/false, /*gather=*/false);
  EXPECT_EQ(h.phases.h2d.end, 0);
  EXPECT_NEAR(h.phases.convert.end, landed + 16 * kUs, 1e-12);
}

TEST(Simulator, SourcesQuantizeTheirCopiesAtPublishAndServeThemAsTheyAre) {
  // The BF16 weight on explicit source buffers, with an F8_E4M3 copy and its
  // scale ("quantize": "source", docs/conversion.md).
  json l = json::parse(write_layout_json(converted("BF16", "F8_E4M3")));
  json& t = l["tensors"][0];
  t.erase("source");
  l["buffers"].push_back({{"side", "source"}, {"rank", 0}, {"name", "w"}, {"dtype", "BF16"}, {"bytes", 32768},
                          {"segments", {{{"tensor", "w.weight"}, {"start", {0, 0}}, {"size", {128, 128}},
                                         {"offset", 0}, {"strides", {128, 1}}}}}});
  l["buffers"].push_back(
      {{"side", "source"}, {"rank", 0}, {"name", "refit.converted"}, {"dtype", "U8"}, {"bytes", 16384 + 64},
       {"segments",
        {{{"tensor", "w.weight"}, {"dtype", "F8_E4M3"}, {"start", {0, 0}}, {"size", {128, 128}}, {"offset", 0},
          {"strides", {128, 1}}},
         {{"tensor", "w.weight_scale_inv"}, {"dtype", "F32"}, {"start", {0, 0}}, {"size", {1, 1}},
          {"offset", 16384 / 4}, {"strides", {1, 1}}}}}});
  auto L = parse_layout_json(l.dump(), "source-quantized layout");
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  HardwareModel hw = unit_hardware();
  hw.host_convert_gbyte = 2.048;  // the source's 32768 BF16 bytes in 16 us
  const SimResult r = simulated(*plan, hw);
  EXPECT_EQ(r.source_convert_bytes, 32768);
  EXPECT_NEAR(r.phases.publish.end, 16 * kUs, 1e-12);
  EXPECT_EQ(r.converts, 0);               // nothing left to the puller
  EXPECT_EQ(r.network_bytes, 16384 + 4);  // E4M3 and the scale over the network
  EXPECT_EQ(r.local_bytes, 16384 + 4);
  // Nothing is served before the copy is made.
  EXPECT_GE(r.phases.network.end, (16 + 16.388 + 2) * kUs);
  EXPECT_GE(r.busiest_source_nic.busy_seconds, 16.388 * kUs - 1e-12);
}

// `n` copies of the replicated tensor ("w0", "w1", ...): many small sends
// from each puller to its peers.
Layout many_replicated(int n, const std::vector<int>& receiver_domains, int64_t elems) {
  json l = json::parse(R"({"format": "refit-layout/1"})");
  json src = json::array({{{"rank", 0}, {"domain", 0}}});
  json rcv = json::array(), rranks = json::array();
  for (size_t r = 0; r < receiver_domains.size(); ++r) {
    rcv.push_back({{"rank", r}, {"domain", receiver_domains[r]}, {"instance", r}});
    rranks.push_back(r);
  }
  l["sources"] = src;
  l["receivers"] = rcv;
  l["tensors"] = json::array();
  for (int i = 0; i < n; ++i) {
    l["tensors"].push_back({{"name", "w" + std::to_string(i)},
                            {"dtype", "F32"},
                            {"shape", {elems}},
                            {"source", {{"mesh", {1}}, {"ranks", {0}}, {"placements", {"R"}}}},
                            {"receiver",
                             {{"mesh", {static_cast<int>(receiver_domains.size())}},
                              {"ranks", rranks},
                              {"placements", {"R"}}}}});
  }
  auto layout = parse_layout_json(l.dump(), "test layout");
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  return std::move(*layout);
}

TEST(Simulator, PackedFanOutMergesSendsReadyWhileTheLinkIsBusy) {
  // 200 tensors of 4 KiB, one domain of 4: every puller passes many small
  // sends to each peer, faster than one launch each can go.
  const Layout L = many_replicated(200, {0, 0, 0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel off = unit_hardware();
  HardwareModel on = off;
  on.fanout_pack_bytes = 64 << 20;
  const SimResult a = simulated(*plan, off);
  const SimResult b = simulated(*plan, on);
  EXPECT_EQ(a.local_ops, a.local_sends);
  EXPECT_EQ(a.local_packed, 0);
  EXPECT_EQ(b.local_sends, a.local_sends);
  EXPECT_EQ(b.local_bytes, a.local_bytes);
  EXPECT_EQ(b.local_ops + b.local_packed, b.local_sends);
  EXPECT_GT(b.local_packed, 0);
  EXPECT_LT(b.predicted_seconds, a.predicted_seconds);
  // The link's busy time: one launch per op, every byte over NVLink, and
  // each small send copied twice in GPU memory (gather and scatter).
  const double busy = b.busiest_nvlink_out.busy_seconds;
  const double per_byte = 1 / on.nvlink_bytes_per_s() + 2 / on.gpu_copy_bytes_per_s();
  EXPECT_GT(busy, static_cast<double>(b.busiest_nvlink_out.bytes) * per_byte);

  // Sends at or above the threshold go as they are: the unpacked model.
  HardwareModel large = on;
  large.fanout_pack_threshold = 4096;
  const SimResult c = simulated(*plan, large);
  EXPECT_EQ(c.local_packed, 0);
  EXPECT_EQ(c.local_ops, a.local_ops);
  EXPECT_DOUBLE_EQ(c.predicted_seconds, a.predicted_seconds);
}

// The nccl fabric's rounds (docs/simulator.md, "The fan-out in rounds").
TEST(Simulator, ARoundIsTwoLaunchesAndItsBusiestRanksSends) {
  // One domain of two receivers: one pulls, then passes it on in one round:
  // the count exchange and the group's launch (5 us each), then one send of
  // 4096 bytes at 4096 bytes/us and its 1 us as an operation in the group.
  const Layout L = replicated(1, {0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.fanout_rounds = true;
  hw.local_send_us = 1;
  const SimResult r = simulated(*plan, hw, /*trace=*/true);
  const double landed = (2 + 1 + 4.096) * kUs;
  EXPECT_NEAR(r.phases.network.end, landed, 1e-12);
  EXPECT_NEAR(r.phases.fanout.start, landed, 1e-12);
  EXPECT_NEAR(r.predicted_seconds, landed + (2 * 5 + 1 + 1) * kUs, 1e-12);
  EXPECT_EQ(r.local_rounds, 1);
  EXPECT_EQ(r.local_ops, 1);
  EXPECT_EQ(r.busiest_nvlink_out.bytes, 4096);
  EXPECT_NEAR(r.busiest_nvlink_out.busy_seconds, 2 * kUs, 1e-12);
  int nvl = 0;
  for (const TraceSpan& t : r.trace) nvl += t.lane == Lane::kNvlinkOut || t.lane == Lane::kNvlinkIn;
  EXPECT_EQ(nvl, 2);
}

TEST(Simulator, RoundsCarryWhatBecameReadyWithinTheFabricsLimits) {
  // 600 tensors of 4 KiB, one domain of 4: each puller passes hundreds of
  // small sends to each peer. A round takes at most 256 of them per peer,
  // and packed, at most the peer's share of the pack area.
  const Layout L = many_replicated(600, {0, 0, 0, 0}, 1024);
  auto plan = make_plan(L);
  ASSERT_TRUE(plan.is_ok());
  HardwareModel hw = unit_hardware();
  hw.fanout_rounds = true;
  const SimResult a = simulated(*plan, hw);
  EXPECT_EQ(a.local_runs, a.local_sends);  // one run each here
  EXPECT_EQ(a.local_ops, a.local_runs);    // unpacked: one operation each
  EXPECT_EQ(a.local_packed, 0);
  EXPECT_GT(a.local_rounds, 0);
  EXPECT_LT(a.local_rounds, a.local_runs);  // sends share rounds
  EXPECT_GE(a.predicted_seconds, a.phases.network.end);
  EXPECT_GE(a.phases.fanout.end, a.busiest_nvlink_out.busy_seconds);

  HardwareModel packed = hw;
  packed.fanout_pack_bytes = 64 << 10;  // a peer's share: 21,840 bytes, five 4 KiB sends
  const SimResult b = simulated(*plan, packed);
  EXPECT_EQ(b.local_bytes, a.local_bytes);
  EXPECT_EQ(b.local_ops + b.local_packed, b.local_runs);
  EXPECT_GT(b.local_packed, 0);
  // A round packs at most five runs to one peer: the busiest of the 12
  // ordered pairs, at least their mean, needs a round per five of its runs.
  EXPECT_GE(b.local_rounds, (a.local_runs / 12 + 4) / 5);
  EXPECT_LT(b.predicted_seconds, a.predicted_seconds);  // fewer operations
}

// Whatever the layout and packing, with rounds every local byte crosses
// NVLink once out and once in (the trace's spans carry them), every run is
// one operation or joins a pack (local_ops + local_packed == local_runs),
// and the prediction is finite; walking the runs one by one gives the same.
TEST(Simulator, RoundsCarryEveryLocalByteAndRunOnce) {
  const std::vector<std::pair<const char*, Layout>> layouts = {
      {"replicated", replicated(1, {0, 0, 0}, 1024)},
      {"many", many_replicated(300, {0, 0, 0, 0}, 256)},
  };
  for (const auto& [name, L] : layouts) {
    auto plan = make_plan(L);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    for (int64_t pack : {int64_t{0}, int64_t{64} << 10}) {
      for (int64_t threshold : {int64_t{1} << 20, int64_t{64}}) {
        for (bool expanded : {false, true}) {
          SCOPED_TRACE(std::string(name) + " pack " + std::to_string(pack) + " threshold " +
                       std::to_string(threshold) + (expanded ? " expanded" : ""));
          HardwareModel hw = unit_hardware();
          hw.fanout_rounds = true;
          hw.local_send_us = 1;
          hw.fanout_pack_bytes = pack;
          hw.fanout_pack_threshold = threshold;
          SimOptions o;
          o.trace = true;
          o.expanded = expanded;
          auto r = simulate(*plan, hw, o);
          ASSERT_TRUE(r.is_ok()) << r.status().message();
          ASSERT_GT(r->local_bytes, 0);
          EXPECT_EQ(r->local_ops + r->local_packed, r->local_runs);
          EXPECT_TRUE(std::isfinite(r->predicted_seconds));
          EXPECT_GT(r->local_rounds, 0);
          int64_t out = 0, in = 0;
          for (const TraceSpan& t : r->trace) {
            if (t.lane == Lane::kNvlinkOut) out += t.bytes;
            if (t.lane == Lane::kNvlinkIn) in += t.bytes;
          }
          EXPECT_EQ(out, r->local_bytes);
          EXPECT_EQ(in, r->local_bytes);
        }
      }
    }
  }
}

// Layouts for the alike-peers test: 12 receivers in two domains, each
// domain the ranks of one parity, and two sources.
constexpr int kAlikeReceivers = 12;

json alike_layout_base() {
  json l;
  l["format"] = "refit-layout/1";
  json rcv = json::array();
  for (int r = 0; r < kAlikeReceivers; ++r) rcv.push_back({{"rank", r}, {"domain", r % 2}, {"instance", r}});
  l["sources"] = json::array({{{"rank", 0}, {"domain", 0}}, {{"rank", 1}, {"domain", 1}}});
  l["receivers"] = rcv;
  l["tensors"] = json::array();
  return l;
}

json one_source(int rank) { return {{"mesh", {1}}, {"ranks", {rank}}, {"placements", {"R"}}}; }

void add_tensor(json& l, const std::string& name, const json& shape, const json& source, const json& receiver) {
  l["tensors"].push_back(
      {{"name", name}, {"dtype", "F32"}, {"shape", shape}, {"source", source}, {"receiver", receiver}});
}

// A puller sends the same sequence to every peer in its domain for the
// tensors replicated or split in two, and more to one of them for the
// tensors split in six (r and r + 6 hold the same sixth). So a puller's
// five peers make two sequences: four alike, and one apart.
json alike_shards() {
  json l = alike_layout_base();
  json ranks = json::array();
  for (int r = 0; r < kAlikeReceivers; ++r) ranks.push_back(r);
  std::mt19937 rng(7);
  for (int i = 0; i < 120; ++i) {
    // Replicas x shards over the 12 ranks; shard j is the ranks j mod shards.
    const int shards = std::array{1, 1, 2, 2, 2, 6}[rng() % 6];
    const json receiver = shards == 1 ? json{{"mesh", {kAlikeReceivers}}, {"ranks", ranks}, {"placements", {"R"}}}
                                      : json{{"mesh", {kAlikeReceivers / shards, shards}},
                                             {"ranks", ranks},
                                             {"placements", {"R", "S(0)"}}};
    const json source =
        i % 3 == 0 ? json{{"mesh", {2}}, {"ranks", {0, 1}}, {"placements", {"S(0)"}}} : one_source(i % 2);
    const json shape = {12 * (1 + static_cast<int64_t>(rng() % 40)), 1 + static_cast<int64_t>(rng() % 300)};
    add_tensor(l, "w" + std::to_string(i), shape, source, receiver);
  }
  return l;
}

// Small tensors each held by rank 0 and one of 2, 4, 6 and 8; rank 0 pulls
// them all (the others hold a large tensor each alone). It sends each peer
// a sequence of one length, but none the same: 8 the bytes of 2, in other
// jobs (other ready times); 4 more bytes at times; 6 some from the other
// source.
json alike_pairs() {
  json l = alike_layout_base();
  for (int to : {2, 4, 6, 8})
    add_tensor(l, "big" + std::to_string(to), {100000}, one_source(0),
               {{"mesh", {1}}, {"ranks", {to}}, {"placements", {"R"}}});
  std::mt19937 rng(7);
  for (int k = 0; k < 60; ++k) {
    const int64_t elems = 1 + static_cast<int64_t>(rng() % 64);
    for (int to : {2, 4, 6, 8}) {
      const int64_t n = to == 4 && k % 3 == 0 ? 2 * elems : elems;
      add_tensor(l, "w" + std::to_string(k) + "-" + std::to_string(to), {n},
                 one_source(to == 6 && k % 4 == 1 ? 1 : 0), {{"mesh", {2}}, {"ranks", {0, to}}, {"placements", {"R"}}});
    }
  }
  return l;
}

// Rank 0 sends 4 and 6 the same; rank 2 sends 6 what lands while 0's round
// goes on. 0 and 2 share a peer only through the alike one, and so go in
// lockstep. Rank 2 pulls b (the larger, placed first), rank 0 a.
json alike_joined() {
  json l = alike_layout_base();
  add_tensor(l, "b", {11500}, one_source(1), {{"mesh", {2}}, {"ranks", {2, 6}}, {"placements", {"R"}}});
  add_tensor(l, "a", {10000}, one_source(0), {{"mesh", {3}}, {"ranks", {0, 4, 6}}, {"placements", {"R"}}});
  return l;
}

// The rounds walk alike peers' sequence once (SimOptions::fold_alike_peers)
// and give what walking each peer's gives: the prediction, the counts, the
// busiest links and every span, packed or not, on 1 to 3 threads.
TEST(Simulator, RoundsWalkAlikePeersOnceAndGiveWhatEachPeerAloneGives) {
  struct Case {
    const char* name;
    json layout;
    int64_t pairs, sequences;
    bool packs;  // has runs below the pack threshold
  };
  const std::vector<Case> cases = {
      {"shards", alike_shards(), kAlikeReceivers * 5, kAlikeReceivers * 2, true},
      {"pairs", alike_pairs(), 4, 4, true},
      {"joined", alike_joined(), 3, 2, false},
  };
  auto spans = [](const SimResult& r) {
    std::vector<std::tuple<int, int32_t, double, double, int64_t>> v;
    for (const TraceSpan& t : r.trace) v.emplace_back(static_cast<int>(t.lane), t.rank, t.start, t.end, t.bytes);
    std::sort(v.begin(), v.end());
    return v;
  };
  for (const Case& c : cases) {
    auto layout = parse_layout_json(c.layout.dump(), "test layout");
    ASSERT_TRUE(layout.is_ok()) << c.name << ": " << layout.status().message();
    auto plan = make_plan(*layout);
    ASSERT_TRUE(plan.is_ok()) << c.name << ": " << plan.status().message();
    for (int64_t pack : {int64_t{0}, int64_t{64} << 10}) {
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(std::string(c.name) + ", pack " + std::to_string(pack) + ", " + std::to_string(threads) +
                     " threads");
        HardwareModel hw = unit_hardware();
        hw.fanout_rounds = true;
        hw.local_send_us = 1;
        hw.fanout_pack_bytes = pack;
        hw.fanout_pack_threshold = 4096;
        hw.get_chunk_bytes = 8192;
        SimOptions o;
        o.threads = threads;
        o.trace = threads == 1;
        auto folded = simulate(*plan, hw, o);
        o.fold_alike_peers = false;
        auto each = simulate(*plan, hw, o);
        ASSERT_TRUE(folded.is_ok() && each.is_ok());
        const SimResult& a = *folded;
        const SimResult& b = *each;
        // Alike peers were walked once, and others apart.
        EXPECT_EQ(a.local_pairs, c.pairs);
        EXPECT_EQ(a.local_pair_sequences, c.sequences);
        EXPECT_EQ(b.local_pairs, c.pairs);
        EXPECT_EQ(b.local_pair_sequences, c.pairs);
        if (pack > 0 && c.packs) {
          EXPECT_GT(a.local_packed, 0);
        }
        EXPECT_EQ(a.predicted_seconds, b.predicted_seconds);
        EXPECT_EQ(a.phases.fanout.start, b.phases.fanout.start);
        EXPECT_EQ(a.phases.fanout.end, b.phases.fanout.end);
        EXPECT_EQ(a.local_rounds, b.local_rounds);
        EXPECT_EQ(a.local_ops, b.local_ops);
        EXPECT_EQ(a.local_packed, b.local_packed);
        for (auto [x, y] : {std::pair{&a.busiest_nvlink_out, &b.busiest_nvlink_out},
                            std::pair{&a.busiest_nvlink_in, &b.busiest_nvlink_in}}) {
          EXPECT_EQ(x->rank, y->rank);
          EXPECT_EQ(x->bytes, y->bytes);
          EXPECT_EQ(x->busy_seconds, y->busy_seconds);
        }
        if (o.trace) {
          EXPECT_FALSE(a.trace.empty());
          EXPECT_EQ(spans(a), spans(b));
        }
      }
    }
  }
}

TEST(Simulator, RoundsKeyAndSendCostAreCheckedNamingTheKey) {
  HardwareModel hw = unit_hardware();
  hw.local_send_us = 2e6;
  Status st = check_hardware(hw, "h.json", "hardware");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("\"hardware.local_send_us\""), std::string::npos) << st.message();
  HardwareModel m = default_hardware();
  EXPECT_TRUE(m.fanout_rounds);  // the nccl fabric's rounds by default
  const Status bad = apply_hardware(nlohmann::json::parse(R"({"fanout_rounds": 1})"), "h.json", "hardware",
                                    /*require_link_rates=*/false, &m);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.message().find("\"hardware.fanout_rounds\" must be true or false"), std::string::npos) << bad.message();
  ASSERT_TRUE(apply_hardware(nlohmann::json::parse(R"({"fanout_rounds": false})"), "h.json", "hardware",
                             /*require_link_rates=*/false, &m)
                  .is_ok());
  EXPECT_FALSE(m.fanout_rounds);
}

TEST(LowerBound, ReportsTheGroupOfSourcesThatAloneHoldTheMostPerNic) {
  // Two sources each hold their own tensor whole: "a" (4096 bytes) only on
  // source 0, "b" (1024 bytes) only on source 1; one receiver needs both.
  json l = json::parse(R"({"format": "refit-layout/1"})");
  l["sources"] = json::array({{{"rank", 0}, {"domain", 0}}, {{"rank", 1}, {"domain", 0}}});
  l["receivers"] = json::array({{{"rank", 0}, {"domain", 0}, {"instance", 0}}});
  l["tensors"] = json::array();
  for (const auto& [name, elems, src] : {std::tuple{"a", 1024, 0}, std::tuple{"b", 256, 1}}) {
    l["tensors"].push_back({{"name", name},
                            {"dtype", "F32"},
                            {"shape", {elems}},
                            {"source", {{"mesh", {1}}, {"ranks", {src}}, {"placements", {"R"}}}},
                            {"receiver", {{"mesh", {1}}, {"ranks", {0}}, {"placements", {"R"}}}}});
  }
  auto L = parse_layout_json(l.dump(), "two sources");
  ASSERT_TRUE(L.is_ok()) << L.status().message();
  auto plan = make_plan(*L);
  ASSERT_TRUE(plan.is_ok());
  auto lb = lower_bound(*plan, unit_hardware());
  ASSERT_TRUE(lb.is_ok());
  EXPECT_NEAR(lb->source_nics_seconds, 5120 / 2e9, 1e-15);  // spread over both: 2.56 us
  EXPECT_NEAR(lb->source_group_seconds, 4096 / 1e9, 1e-15);  // source 0 alone: 4.096 us
  EXPECT_EQ(lb->source_group_first, 0);
  EXPECT_EQ(lb->source_group_size, 1);
  EXPECT_NEAR(lb->seconds, 5120 / 1e9, 1e-15);  // the receiver's one NIC binds
}

TEST(Simulator, PackKeysAreCheckedNamingTheKey) {
  HardwareModel hw = unit_hardware();
  hw.fanout_pack_bytes = 1000;
  Status st = check_hardware(hw, "h.json", "hardware");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("\"hardware.fanout_pack_bytes\""), std::string::npos) << st.message();
  hw = unit_hardware();
  hw.gpu_memory_achievable = 1.5;
  st = check_hardware(hw, "h.json", "hardware");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("\"hardware.gpu_memory_achievable\""), std::string::npos) << st.message();
  hw = unit_hardware();
  hw.fanout_pack_bytes = 0;  // off
  EXPECT_TRUE(check_hardware(hw, "h.json", "hardware").is_ok());
  // The simulator's defaults are the fabric's (transport/fabric/pack.h).
  EXPECT_EQ(default_hardware().fanout_pack_bytes, static_cast<double>(fabric::kDefaultPackBytes));
  EXPECT_EQ(default_hardware().fanout_pack_threshold, static_cast<double>(fabric::kDefaultPackThreshold));
}

// The rounds' sort gives what std::sort gives: ready times of few distinct
// values (many ties, kept in place order), of every exponent, around the
// size where the radix sort takes over.
TEST(Simulator, SortByReadyOrdersAsStdSort) {
  std::mt19937_64 rng(7);
  std::vector<uint64_t> keys, want, spare;
  for (size_t n : {0, 1, 2, 255, 256, 257, 1000, 5000, 70000}) {
    for (int spread : {1, 3, 1000, 0}) {
      keys.clear();
      for (size_t k = 0; k < n; ++k) {
        float ready = 0;
        if (spread == 0) ready = std::ldexp(static_cast<float>(rng() % 1000 + 1), static_cast<int>(rng() % 60) - 40);
        else ready = static_cast<float>(rng() % static_cast<uint64_t>(spread)) * 1e-3f;
        keys.push_back(static_cast<uint64_t>(std::bit_cast<uint32_t>(ready)) << 32 | k);
      }
      want = keys;
      std::sort(want.begin(), want.end());
      sort_by_ready(keys, spare);
      EXPECT_EQ(keys, want) << n << " keys, spread " << spread;
    }
  }
}

}  // namespace
}  // namespace refit::sim
