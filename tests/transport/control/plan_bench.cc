// refit_coordinator_plan_bench: what the coordinator spends to plan a
// scenario's whole membership, in time and memory. Every rank of the
// scenario's layout registers with a ControlState, as its agent would (its
// buffers and their segments, the tensors it holds), then the plan is made
// from the registrations as the coordinator makes it.
//
//   refit_coordinator_plan_bench --scenario S.json --manifest M.json [--whole-text | --layout-only | --parse-largest]
//                                [--from-wire]
//
// --whole-text builds the layout the way the coordinator did before it read
// the membership piece by piece: the whole document as one JSON value, its
// text, that text parsed into a DOM, then the layout from the DOM. It stops
// there (the plan from a layout is the same either way); without it the
// layout is built as the coordinator builds it now, then the whole plan
// (compute_plan, the layout again, the plan and every receiver's part),
// then every receiver's reply, one after another (the part's message JSON,
// checked as the receiver parses it, its peers, and the CBOR of both, as a
// reply thread makes them);
// --layout-only stops after the layout, as --whole-text does;
// --parse-largest then parses the largest part as its receiver does (groups
// expanded) and prints the memory that took per run;
// --from-wire makes each receiver's registration its message (CBOR) and
// parses it back just before it registers, the message made from the
// registration built from the layout, which is freed first: the
// coordinator receives registrations one at a time, so what it holds
// afterwards (members_rss_mib) lies as it would there, not among the
// freed registrations of all ranks (the layout gives every rank's
// registration at once). The encoding (the agents' part) and the decoding
// and parse (the coordinator's) are in register_s, and printed apart.
// Peak resident
// memory is measured from after the registrations (/proc/self/clear_refs),
// so it is what planning adds to the members the coordinator holds anyway.
// Prints one JSON line.

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "planner/layout_json.h"
#include "planner/manifest.h"
#include "planner/model_config.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "transport/control/control_state.h"

namespace {

using namespace refit;
using namespace refit::control;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "VmRSS" or "VmHWM" of this process, in KiB.
long status_kib(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stol(line.substr(k.size()));
  }
  return -1;
}

bool reset_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int64_t> dims(const Box& b, int n, bool start) {
  std::vector<int64_t> out(n);
  for (int d = 0; d < n; ++d) out[d] = start ? b.start[d] : b.size[d];
  return out;
}

// Each rank's registration, from the layout.
void registrations(const Layout& L, std::vector<RegisterSource>* sources, std::vector<RegisterReceiver>* receivers) {
  std::vector<std::map<uint32_t, MemberBuffer>> held[2];
  held[0].resize(L.sources.size());
  held[1].resize(L.receivers.size());
  std::vector<std::set<uint32_t>> declares(L.sources.size());
  for (uint32_t ti = 0; ti < L.tensors.size(); ++ti) {
    const Tensor& t = L.tensors[ti];
    for (Side side : {Side::kSource, Side::kReceiver}) {
      const int k = side == Side::kSource ? 0 : 1;
      for (const Region& r : L.regions(ti, side)) {
        const uint32_t bi = t.buffer_of(side, r);
        const Buffer& b = L.buffers[bi];
        const int n = r.box.ndim;
        Segment s{t.name, dims(r.box, n, true), dims(r.box, n, false), r.offset,
                  std::vector<int64_t>(r.strides.begin(), r.strides.begin() + n), ""};
        if (t.dtype_on(side) != b.dtype) s.dtype = std::string(dtype_name(t.dtype_on(side)));
        for (int32_t rank : L.sets(side).get(r.ranks)) {
          MemberBuffer& m = held[k][rank][bi];
          if (m.name.empty()) {
            m.name = b.name;
            m.dtype = std::string(dtype_name(b.dtype));
            m.bytes = b.bytes;
          }
          m.segments.push_back(s);
          if (side == Side::kSource) declares[rank].insert(ti);
        }
      }
    }
  }
  for (size_t r = 0; r < L.sources.size(); ++r) {
    RegisterSource m;
    m.rank = static_cast<int32_t>(r);
    m.domain = L.sources[r].domain;
    m.worker_address = {1};
    for (uint32_t ti : declares[r]) {
      const Tensor& t = L.tensors[ti];
      m.tensors.push_back(TensorDecl{t.name, std::string(dtype_name(t.dtype)), t.shape});
    }
    for (auto& [bi, b] : held[0][r]) m.buffers.push_back(std::move(b));
    sources->push_back(std::move(m));
  }
  for (size_t r = 0; r < L.receivers.size(); ++r) {
    RegisterReceiver m;
    m.rank = static_cast<int32_t>(r);
    m.instance = L.receivers[r].instance;
    m.domain = L.receivers[r].domain;
    m.worker_address = {1};
    for (auto& [bi, b] : held[1][r]) m.buffers.push_back(std::move(b));
    receivers->push_back(std::move(m));
  }
}

int run(int argc, char** argv) {
  std::string scenario_path, manifest_path;
  bool whole_text = false, layout_only = false, parse_largest = false, from_wire = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--scenario" && i + 1 < argc) {
      scenario_path = argv[++i];
    } else if (a == "--manifest" && i + 1 < argc) {
      manifest_path = argv[++i];
    } else if (a == "--whole-text") {
      whole_text = true;
    } else if (a == "--layout-only") {
      layout_only = true;
    } else if (a == "--parse-largest") {
      parse_largest = true;
    } else if (a == "--from-wire") {
      from_wire = true;
    } else {
      std::cerr << "usage: refit_coordinator_plan_bench --scenario S.json --manifest M.json [--whole-text | --layout-only | --parse-largest] [--from-wire]\n";
      return 2;
    }
  }
  if (scenario_path.empty() || manifest_path.empty()) {
    std::cerr << "usage: refit_coordinator_plan_bench --scenario S.json --manifest M.json [--whole-text | --layout-only | --parse-largest] [--from-wire]\n";
    return 2;
  }
  auto scenario = parse_scenario(read(scenario_path), scenario_path);
  if (!scenario) throw std::runtime_error(scenario.status().message());
  auto manifest = parse_manifest_json(read(manifest_path), manifest_path);
  if (!manifest) throw std::runtime_error(manifest.status().message());
  // Its Hugging Face config beside it (NAME.config.json), as refit-plan reads it.
  const std::string config_path = model_config_path(manifest_path, false);
  if (std::ifstream(config_path)) {
    auto config = parse_model_config(read(config_path), config_path);
    if (!config) throw std::runtime_error(config.status().message());
    manifest->config = std::move(*config);
  }
  std::vector<RegisterSource> sources;
  std::vector<RegisterReceiver> receivers;
  {
    auto layout = layout_from_scenario(*scenario, *manifest);
    if (!layout) throw std::runtime_error(layout.status().message());
    registrations(*layout, &sources, &receivers);
  }
  ControlState state(StateLimits{}, std::chrono::hours(1));
  const auto now = Clock::now();
  const auto t_reg = Clock::now();
  uint64_t session = 1;
  for (RegisterSource& m : sources) {
    const int32_t rank = m.rank;
    Status st = state.register_source(session++, std::move(m), now);
    if (!st.is_ok()) throw std::runtime_error("source " + std::to_string(rank) + ": " + st.message());
  }
  const double register_sources_s = since(t_reg);
  double encode_s = 0, parse_s = 0;  // --from-wire: the agents' part, the coordinator's
  size_t wire_bytes = 0;              // the largest registration message
  for (RegisterReceiver& built : receivers) {
    const int32_t rank = built.rank;
    RegisterReceiver m = std::move(built);
    if (from_wire) {
      const auto t_encode = Clock::now();
      std::vector<uint8_t> wire = Json::to_cbor(to_json(m));
      m = RegisterReceiver{};
      encode_s += since(t_encode);
      const auto t_parse = Clock::now();
      Result<RegisterReceiver> parsed = parse_register_receiver(Json::from_cbor(wire), MessageLimits{});
      if (!parsed) throw std::runtime_error("receiver " + std::to_string(rank) + ": " + parsed.status().message());
      m = std::move(*parsed);
      parse_s += since(t_parse);
      wire_bytes = std::max(wire_bytes, wire.size());
    }
    Status st = state.register_receiver(session++, std::move(m), now);
    if (!st.is_ok()) throw std::runtime_error("receiver " + std::to_string(rank) + ": " + st.message());
  }
  sources.clear();
  sources.shrink_to_fit();
  receivers.clear();
  receivers.shrink_to_fit();
  const double register_s = since(t_reg);
  // The scenario's layout and the registrations' checks are freed: given
  // back, so that planning cannot reuse them without raising the peak.
  malloc_trim(0);
  const long members_kib = status_kib("VmRSS");
  if (!reset_peak()) throw std::runtime_error("cannot reset the peak through /proc/self/clear_refs");

  std::printf("{\"scenario\": \"%s\", \"mode\": \"%s\", \"sources\": %zu, \"receivers\": %zu, \"register_s\": %.2f, \"of_sources_s\": %.2f, "
              "\"members_rss_mib\": %.0f",
              scenario_path.c_str(), whole_text ? "whole-text" : from_wire ? "pieces-from-wire" : "pieces", state.num_sources(),
              state.num_receivers(), register_s, register_sources_s, members_kib / 1024.0);
  if (from_wire) {
    std::printf(", \"of_receivers_encode_s\": %.2f, \"of_receivers_decode_parse_s\": %.2f, \"largest_message_bytes\": %zu",
                encode_s, parse_s, wire_bytes);
  }
  if (whole_text) {
    const auto t0 = Clock::now();
    std::string text = state.layout_document().dump();
    const double dump_s = since(t0);
    const auto t1 = Clock::now();
    Json doc = Json::parse(text);
    text.clear();
    text.shrink_to_fit();
    Json buffers = std::move(doc["buffers"]);
    doc.erase("buffers");
    LayoutBuilder builder("membership");
    Status st = builder.head(doc);
    for (size_t i = 0; st.is_ok() && i < buffers.size(); ++i) st = builder.buffer(buffers[i]);
    auto layout = st.is_ok() ? builder.finish(doc) : Result<Layout>(st);
    if (!layout) throw std::runtime_error(layout.status().message());
    std::printf(", \"document_s\": %.2f, \"layout_s\": %.2f, \"tensors\": %zu", dump_s, since(t1),
                layout->tensors.size());
  } else {
    const auto t0 = Clock::now();
    PlanInput in = state.plan_input();
    const double input_s = since(t0);
    const auto t1 = Clock::now();
    size_t tensors = 0;
    {
      auto layout = membership_layout(in);
      if (!layout) throw std::runtime_error(layout.status().message());
      tensors = layout->tensors.size();
    }
    const double layout_s = since(t1);
    const long layout_peak_kib = status_kib("VmHWM");
    if (layout_only) {
      std::printf(", \"document_s\": %.2f, \"layout_s\": %.2f, \"tensors\": %zu, \"peak_over_members_mib\": %.0f}\n",
                  input_s, layout_s, tensors, (layout_peak_kib - members_kib) / 1024.0);
      return 0;
    }
    const auto t2 = Clock::now();
    std::shared_ptr<const PlannedParts> parts = compute_plan(in);
    if (!parts->status.is_ok()) throw std::runtime_error(parts->status.message());
    const double plan_s = since(t2);
    const long plan_peak_kib = status_kib("VmHWM");
    // Each receiver's reply, one after another, as a reply thread builds
    // it (build_part_reply): the part's message JSON, checked as the
    // receiver parses it, its peers, then the CBOR of both.
    const std::shared_ptr<const PeerDirectory> directory = state.peer_directory();
    const auto t3 = Clock::now();
    size_t entries = 0, cbor_bytes = 0, largest = 0, most_runs = 0, refused = 0, over_default = 0;
    MessageLimits lim;
    lim.max_runs = kMaxPlanRunsCeiling;  // as the coordinator checks them
    std::string first_refusal;
    int32_t most_runs_rank = -1;
    for (const auto& [rank, compact] : parts->parts) {
      size_t expanded = 0;
      for (const PartEntry& e : compact.entries) expanded += static_cast<size_t>(e.count);
      if (expanded > most_runs) most_runs_rank = rank;
      most_runs = std::max(most_runs, expanded);
      const Json part = parts->part(rank);
      entries += part.size();
      // A part the coordinator refuses to serve is counted, and its reply
      // not made: the coordinator answers its fetches with why. Parts over
      // a receiver's default "max_plan_runs" are counted too.
      Result<size_t> runs = check_plan_runs(part, lim);
      if (!runs) {
        if (refused++ == 0) first_refusal = "rank " + std::to_string(rank) + ": " + runs.status().message();
        continue;
      }
      if (*runs > MessageLimits{}.max_runs) ++over_default;
      Result<PlanPeers> peers = parse_plan_peers(peers_from(*directory, rank, false, part));
      if (!peers) throw std::runtime_error("rank " + std::to_string(rank) + ": " + peers.status().message());
      const size_t n = Json::to_cbor(part).size();
      cbor_bytes += n + Json::to_cbor(to_json(*peers)).size();
      largest = std::max(largest, n);
    }
    std::printf(", \"document_s\": %.2f, \"layout_s\": %.2f, \"tensors\": %zu, \"layout_peak_over_members_mib\": %.0f, "
                "\"compute_plan_s\": %.2f, \"plan_peak_over_members_mib\": %.0f, \"network_bytes\": %lld, "
                "\"parts\": %zu, \"entries\": %zu, \"replies_s\": %.2f, \"reply_cbor_bytes\": %zu, "
                "\"largest_runs_cbor_bytes\": %zu, \"most_runs_per_receiver\": %zu, \"refused_replies\": %zu, \"over_receiver_default\": %zu, "
                "\"first_refusal\": %s",
                input_s, layout_s, tensors, (layout_peak_kib - members_kib) / 1024.0, plan_s,
                (plan_peak_kib - members_kib) / 1024.0, static_cast<long long>(parts->network_bytes),
                parts->parts.size(), entries, since(t3), cbor_bytes, largest, most_runs, refused, over_default,
                Json(first_refusal).dump().c_str());
    if (parse_largest && most_runs_rank >= 0) {
      // The largest part as its receiver parses it (groups expanded): the
      // memory that takes, per run.
      const Json part = parts->part(most_runs_rank);
      malloc_trim(0);
      const long before_kib = status_kib("VmRSS");
      const auto t4 = Clock::now();
      Result<std::vector<PlanRun>> runs = parse_plan_runs(part, lim);
      if (!runs) throw std::runtime_error(runs.status().message());
      const double parse_s = since(t4);
      const long after_kib = status_kib("VmRSS");
      std::printf(", \"receiver_parse_s\": %.2f, \"receiver_parsed_runs\": %zu, \"receiver_bytes_per_run\": %.0f",
                  parse_s, runs->size(), (after_kib - before_kib) * 1024.0 / static_cast<double>(runs->size()));
    }
  }
  std::printf(", \"peak_over_members_mib\": %.0f}\n", (status_kib("VmHWM") - members_kib) / 1024.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "refit_coordinator_plan_bench: " << e.what() << "\n";
    return 1;
  }
}
