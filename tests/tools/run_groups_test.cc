// The run walk in groups (RunGroup) against the walk one run at a time: the
// same GET statistics and the same simulated refresh, on the example
// scenarios (column slices, MoE with and without expert parallelism, FSDP
// row cuts, a dtype conversion) and on larger variants of them
// (docs/simulator.md, "What is simulated").

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "planner/conversion.h"
#include "planner/get_stats.h"
#include "planner/manifest.h"
#include "planner/scenario.h"
#include "tools/sim/simulator.h"

namespace refit {
namespace {

using nlohmann::json;

std::string read(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json scenario_json(const std::string& name) {
  return json::parse(read(std::string(REFIT_SOURCE_ROOT) + "/examples/scenarios/" + name + ".json"));
}

// The manifest of an example model with its config.
Manifest model(const std::string& name) {
  const std::string path = std::string(REFIT_SOURCE_ROOT) + "/examples/models/" + name;
  auto m = parse_manifest_json(read(path + ".json"), name);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  auto c = parse_model_config(read(path + ".config.json"), name);
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  m->config = std::move(*c);
  return std::move(*m);
}

Layout layout_of(const json& scenario) {
  auto s = parse_scenario(scenario.dump(), "scenario");
  EXPECT_TRUE(s.is_ok()) << s.status().message();
  auto layout = layout_from_scenario_models(*s, model(s->train.model), model(s->infer.model), {128, 128});
  EXPECT_TRUE(layout.is_ok()) << layout.status().message();
  return std::move(*layout);
}

// A scenario of the examples with its sides resized.
json resized(const std::string& name, const json& train, const json& infer) {
  json j = scenario_json(name);
  j["train"].update(train);
  j["infer"].update(infer);
  return j;
}

void expect_same(const GetStats& a, const GetStats& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.gets, b.gets);
  EXPECT_EQ(a.per_receiver, b.per_receiver);
  EXPECT_EQ(a.per_receiver_gathers, b.per_receiver_gathers);
  EXPECT_EQ(a.per_receiver_small_alone, b.per_receiver_small_alone);
  EXPECT_EQ(a.gets_per_receiver_max, b.gets_per_receiver_max);
  EXPECT_EQ(a.busiest_receiver, b.busiest_receiver);
  EXPECT_EQ(a.get_bytes_median, b.get_bytes_median);
  EXPECT_EQ(a.sizes, b.sizes);
  EXPECT_EQ(a.gathers, b.gathers);
  EXPECT_EQ(a.gathered_runs, b.gathered_runs);
  EXPECT_EQ(a.unpacked, b.unpacked);
  EXPECT_EQ(a.gather_reply_bytes_wanted, b.gather_reply_bytes_wanted);
  EXPECT_EQ(a.gather_reply_wanted_source, b.gather_reply_wanted_source);
}

void expect_same(const sim::SimResult& a, const sim::SimResult& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.predicted_seconds, b.predicted_seconds);  // the same events: bit for bit
  EXPECT_EQ(a.phases.network.end, b.phases.network.end);
  EXPECT_EQ(a.phases.fanout.end, b.phases.fanout.end);
  EXPECT_EQ(a.phases.convert.end, b.phases.convert.end);
  EXPECT_EQ(a.converts, b.converts);
  EXPECT_EQ(a.convert_bytes, b.convert_bytes);
  EXPECT_EQ(a.network_bytes, b.network_bytes);
  EXPECT_EQ(a.local_bytes, b.local_bytes);
  EXPECT_EQ(a.gets, b.gets);
  EXPECT_EQ(a.gathers, b.gathers);
  EXPECT_EQ(a.gets_per_receiver_max, b.gets_per_receiver_max);
  EXPECT_EQ(a.local_sends, b.local_sends);
  EXPECT_EQ(a.local_runs, b.local_runs);
  EXPECT_EQ(a.jobs, b.jobs);
  EXPECT_EQ(a.events, b.events);
  EXPECT_EQ(a.busiest_receiver_nic.rank, b.busiest_receiver_nic.rank);
  EXPECT_EQ(a.busiest_receiver_nic.busy_seconds, b.busiest_receiver_nic.busy_seconds);
  EXPECT_EQ(a.busiest_posting.bytes, b.busiest_posting.bytes);
  EXPECT_EQ(a.busiest_nvlink_out.busy_seconds, b.busiest_nvlink_out.busy_seconds);
  EXPECT_EQ(a.busiest_nvlink_in.busy_seconds, b.busiest_nvlink_in.busy_seconds);
  EXPECT_EQ(a.busiest_source_nic.rank, b.busiest_source_nic.rank);
  EXPECT_EQ(a.busiest_source_nic.busy_seconds, b.busiest_source_nic.busy_seconds);
  EXPECT_EQ(a.busiest_convert.busy_seconds, b.busiest_convert.busy_seconds);
  EXPECT_EQ(a.phases.network.start, b.phases.network.start);
  EXPECT_EQ(a.phases.fanout.start, b.phases.fanout.start);
  EXPECT_EQ(a.phases.h2d.start, b.phases.h2d.start);
  EXPECT_EQ(a.phases.h2d.end, b.phases.h2d.end);
  EXPECT_EQ(a.phases.convert.start, b.phases.convert.start);
  EXPECT_EQ(a.local_ops, b.local_ops);
  EXPECT_EQ(a.local_packed, b.local_packed);
  EXPECT_EQ(a.local_rounds, b.local_rounds);
}

// Grouping options: the agents' defaults, off, and bounds small enough that
// gathers close inside a group, by bytes and by entries.
std::vector<std::pair<std::string, GatherOptions>> gather_options() {
  GatherOptions off;
  off.enabled = false;
  GatherOptions by_bytes;
  by_bytes.max_bytes = 3000;
  GatherOptions by_entries;
  by_entries.max_entries = 3;
  GatherOptions unpacked;  // runs between max_bytes and below_bytes
  unpacked.max_bytes = 64;
  return {{"defaults", GatherOptions{}}, {"off", off}, {"bytes", by_bytes}, {"entries", by_entries},
          {"unpacked", unpacked}};
}

// Checks one layout under both strategies and every grouping; returns the
// runs that the groups held beyond their first (0: nothing was grouped).
int64_t check(const Layout& L, const std::string& name) {
  int64_t grouped = 0;
  for (Strategy st : {Strategy::kRefit, Strategy::kNoDedup}) {
    PlanOptions po;
    po.strategy = st;
    po.chunk_bytes = 8192;  // small chunks: jobs and chunks cut the groups
    auto plan = make_plan(L, po);
    EXPECT_TRUE(plan.is_ok()) << plan.status().message();
    if (!plan.is_ok()) return 0;
    // The walk: expanding the groups gives the runs one by one, and no run
    // continues the one before it (they would have merged).
    std::vector<Run> runs;
    for_each_run_group(*plan, [&](const RunGroup& g) {
      grouped += g.count - 1;
      for (int64_t k = 0; k < g.count; ++k) runs.push_back(g.at(k));
    });
    std::vector<Run> one_by_one;
    for_each_run(*plan, [&](const Run& r) { one_by_one.push_back(r); });
    EXPECT_EQ(runs.size(), one_by_one.size()) << name;
    for (size_t i = 1; i < runs.size(); ++i) {
      const Run& a = runs[i - 1];
      const Run& b = runs[i];
      const bool merges = a.local == b.local && a.from.rank == b.from.rank && a.from.buffer == b.from.buffer &&
                          a.to.rank == b.to.rank && a.to.buffer == b.to.buffer &&
                          a.from.offset + a.bytes == b.from.offset && a.to.offset + a.bytes == b.to.offset;
      EXPECT_FALSE(merges) << name << ": runs " << i - 1 << " and " << i << " continue each other";
      if (merges) break;
    }
    for (const auto& [gname, g] : gather_options()) {
      const std::string what = name + ", " + strategy_name(st) + ", gathers " + gname;
      expect_same(get_stats(*plan, 1024, &g, nullptr, 4096), get_stats(*plan, 1024, &g, nullptr, 4096, true), what);
      HardwareModel hw = default_hardware();
      hw.get_chunk_bytes = 2048;
      hw.window_bytes = 16384;
      sim::SimOptions so;
      so.gather = g;
      auto a = sim::simulate(*plan, hw, so);
      so.expanded = true;
      auto b = sim::simulate(*plan, hw, so);
      EXPECT_TRUE(a.is_ok() && b.is_ok());
      if (a.is_ok() && b.is_ok()) expect_same(*a, *b, what);
    }
  }
  return grouped;
}

// The network and the rounds simulated by several threads, each with a
// block of the receivers and of the sources (with few sources, some thread
// has none): the same result to the bit, with GETs landing in GPU or in
// host memory, with conversions (moe-bf16-to-fp8). Every window of the
// network costs each thread two barriers; a latency of 20 us keeps their
// number, and this test's time, small.
TEST(RunGroups, ExampleScenariosSimulateTheSameOnSeveralThreads) {
  for (const char* name : {"fsdp-to-tp", "moe-ep", "moe-bf16-to-fp8", "tp2-to-tp4", "local-3hosts-replica"}) {
    const Layout L = layout_of(scenario_json(name));  // the plan points into it
    auto plan = make_plan(L);
    ASSERT_TRUE(plan.is_ok()) << name << ": " << plan.status().message();
    HardwareModel hw = default_hardware();
    hw.get_chunk_bytes = 65536;
    hw.window_bytes = 262144;
    hw.latency_us = 20;
    sim::SimOptions so;
    for (bool host : {false, true}) {
      hw.gets_land_in_host = host;
      so.threads = 1;
      auto one = sim::simulate(*plan, hw, so);
      ASSERT_TRUE(one.is_ok()) << one.status().message();
      EXPECT_GT(one->events, 0) << name;
      for (int threads : {2, 3}) {
        so.threads = threads;
        auto c = sim::simulate(*plan, hw, so);
        ASSERT_TRUE(c.is_ok()) << c.status().message();
        expect_same(*one, *c,
                    std::string(name) + (host ? ", landing in host memory, " : ", ") + std::to_string(threads) +
                        " threads");
      }
    }
  }
}

// A simulation given the plan to own (it frees the plan once it has read it
// into jobs) simulates what one reading the caller's plan does; one it
// refuses leaves the plan as it was.
TEST(RunGroups, ASimulationThatOwnsThePlanGivesTheSameResult) {
  for (const char* name : {"moe-bf16-to-fp8", "local-3hosts-replica"}) {
    const Layout L = layout_of(scenario_json(name));
    auto plan = make_plan(L);
    ASSERT_TRUE(plan.is_ok()) << name << ": " << plan.status().message();
    HardwareModel hw = default_hardware();
    hw.get_chunk_bytes = 65536;
    hw.window_bytes = 262144;
    sim::SimOptions so;
    so.threads = 2;
    auto read = sim::simulate(*plan, hw, so);
    ASSERT_TRUE(read.is_ok()) << read.status().message();
    Plan copy = *plan;
    auto owned = sim::simulate(std::move(copy), hw, so);
    ASSERT_TRUE(owned.is_ok()) << owned.status().message();
    expect_same(*read, *owned, std::string(name) + ", owned");
  }
  const Layout L = layout_of(scenario_json("tp2-to-tp4"));
  PlanOptions po;
  po.strategy = Strategy::kBroadcast;
  auto plan = make_plan(L, po);
  ASSERT_TRUE(plan.is_ok());
  const int64_t total = plan->summary().total_bytes;
  auto r = sim::simulate(std::move(*plan), default_hardware());
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("estimate_broadcast"), std::string::npos) << r.status().message();
  EXPECT_EQ(plan->summary().total_bytes, total);
}

// Each puller's groups and conversion steps, in walk order, as text.
std::vector<std::string> walk_per_puller(const Plan& plan, int32_t R, PullerRange pullers, Status* status) {
  std::vector<std::string> out(static_cast<size_t>(R));
  *status = for_each_run_group(
      plan,
      [&](const RunGroup& g) {
        const Run& r = g.run;
        const int32_t p = r.local ? r.from.rank : r.to.rank;
        out[p] += "run " + std::to_string(r.local) + " " + std::to_string(r.from.rank) + ":" +
                  std::to_string(r.from.buffer) + "+" + std::to_string(r.from.offset) + " " +
                  std::to_string(r.to.rank) + ":" + std::to_string(r.to.buffer) + "+" + std::to_string(r.to.offset) +
                  " " + std::to_string(r.bytes) + " x" + std::to_string(g.count) + " " + std::to_string(g.from_stride) +
                  " " + std::to_string(g.to_stride) + "\n";
      },
      [&](const ConvertStep& c) {
        out[c.rank] += "step " + std::to_string(c.tensor) + " " + std::to_string(c.stage_offset) + " " +
                       std::to_string(c.box.numel()) + "\n";
      },
      pullers);
  return out;
}

// A walk of a block of pullers (PullerRange, as the simulator's threads
// walk the plan) gives each of them exactly what the whole walk gives it:
// the same groups, merged the same way, and the same steps, in order.
TEST(RunGroups, AWalkOfSomePullersGivesThemWhatTheWholeWalkGives) {
  int checked = 0;
  for (const char* name : {"fsdp-to-tp", "moe-ep", "moe-bf16-to-fp8", "pp2-to-tp2", "tp2-to-tp2x2", "tp2-to-tp4",
                           "local-3hosts-replica"}) {
    const Layout L = layout_of(scenario_json(name));
    const auto R = static_cast<int32_t>(L.receivers.size());
    for (int64_t relayout : {int64_t{0}, int64_t{1} << 20}) {
      for (Strategy st : {Strategy::kRefit, Strategy::kNoDedup}) {
        PlanOptions po;
        po.strategy = st;
        po.chunk_bytes = 8192;
        po.relayout_below_bytes = relayout;
        auto plan = make_plan(L, po);
        ASSERT_TRUE(plan.is_ok()) << name << ": " << plan.status().message();
        Status whole_status = Status::ok();
        const std::vector<std::string> whole = walk_per_puller(*plan, R, PullerRange{}, &whole_status);
        ASSERT_TRUE(whole_status.is_ok()) << whole_status.message();
        for (int32_t blocks : {2, 3, R}) {
          std::vector<std::string> joined(static_cast<size_t>(R));
          for (int32_t k = 0; k < blocks; ++k) {
            const PullerRange range{R * k / blocks, R * (k + 1) / blocks};
            Status s = Status::ok();
            const std::vector<std::string> part = walk_per_puller(*plan, R, range, &s);
            ASSERT_TRUE(s.is_ok()) << s.message();
            for (int32_t p = 0; p < R; ++p) {
              if (range.contains(p)) joined[p] = part[p];
              else EXPECT_EQ(part[p], "") << name << ": puller " << p << " is not in the block";
            }
          }
          for (int32_t p = 0; p < R; ++p)
            EXPECT_EQ(joined[p], whole[p]) << name << ", " << strategy_name(st) << ", relayout " << relayout << ", "
                                           << blocks << " blocks: puller " << p;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 7 * 2 * 2 * 3);
}

TEST(RunGroups, ExampleScenariosGiveTheSameStatsAndSimulationGroupedAndOneByOne) {
  int64_t grouped = 0;
  for (const char* name : {"fsdp-to-tp", "moe-ep", "moe-bf16-to-fp8", "pp2-to-tp2", "tp2-to-tp2x2", "tp2-to-tp4",
                           "local-3hosts-replica"}) {
    grouped += check(layout_of(scenario_json(name)), name);
  }
  EXPECT_GT(grouped, 0) << "no run was grouped: the test checks nothing";
}

TEST(RunGroups, LargerLayoutsGiveTheSameStatsAndSimulationGroupedAndOneByOne) {
  struct Case {
    std::string name;
    json train, infer;
  };
  const std::vector<Case> cases = {
      // FSDP row cuts over 16 ranks to TP4 in domains of 8.
      {"fsdp-to-tp", {{"gpus", 16}, {"dp", 16}, {"gpus_per_domain", 8}},
       {{"gpus", 16}, {"tp", 4}, {"dp", 4}, {"gpus_per_domain", 8}}},
      // MoE, expert parallel training to TP4 without expert parallelism:
      // column slices of every expert.
      {"moe-ep", {{"gpus", 16}, {"tp", 2}, {"dp", 8}, {"ep", 4}, {"gpus_per_domain", 8}},
       {{"gpus", 16}, {"tp", 4}, {"dp", 4}, {"expert_parallel", false}, {"gpus_per_domain", 4}}},
      // The same to expert parallel serving, domains of 8.
      {"moe-ep", {{"gpus", 16}, {"tp", 2}, {"dp", 8}, {"ep", 4}, {"gpus_per_domain", 8}},
       {{"gpus", 16}, {"tp", 4}, {"dp", 4}, {"expert_parallel", true}, {"gpus_per_domain", 8}}},
      // BF16 FSDP training over 8 ranks to FP8 servers, quantized on the way.
      {"moe-bf16-to-fp8", {{"gpus", 8}, {"tp", 1}, {"dp", 8}, {"ep", 1}, {"fsdp", true}, {"gpus_per_domain", 8}},
       {{"gpus", 8}, {"tp", 1}, {"dp", 8}, {"gpus_per_domain", 4}}},
  };
  int64_t grouped = 0;
  for (const Case& c : cases) {
    const json j = resized(c.name, c.train, c.infer);
    grouped += check(layout_of(j), c.name + " " + j["train"].dump() + " -> " + j["infer"].dump());
  }
  EXPECT_GT(grouped, 0);
}

}  // namespace
}  // namespace refit
