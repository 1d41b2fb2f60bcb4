// refit-plan: plans a weight refresh from a layout file or a scenario and a
// model, and prints what it would move: bytes over the network against the
// minimum, bytes over the local fabric, units, pulls, chunks, NIC loads and
// planning time. It writes the explicit layout (--layout-out), every byte run
// (--runs) and the summary (--json) for other tools. With --simulate it
// simulates the refresh on a hardware model instead (docs/simulator.md).
//
// Exit status: 0 on success, 2 on bad input (one line on stderr that names
// the file, the key or tensor, and the problem), 1 on an internal error.
// Quiet by default: nothing but the result (and, on a run longer than 2 s,
// progress lines on stderr), and nothing at all under --quiet.

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "planner/conversion.h"
#include "planner/get_stats.h"
#include "planner/hardware.h"
#include "planner/json_util.h"
#include "planner/layout.h"
#include "planner/layout_json.h"
#include "planner/manifest.h"
#include "planner/plan.h"
#include "planner/recipes/recipe.h"
#include "planner/scenario.h"
#include "planner/status.h"
#include "tools/sim/simulator.h"

namespace {

namespace fs = std::filesystem;
using refit::Code;
using refit::Layout;
using refit::Manifest;
using refit::Plan;
using refit::PlanOptions;
using refit::PlanSummary;
using refit::Result;
using refit::Status;
using refit::Strategy;
using ordered_json = nlohmann::ordered_json;

constexpr int kExitBadInput = 2;
constexpr int kExitInternal = 1;

// The safetensors limit on header size; parse_safetensors_header says so too.
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---------------------------------------------------------------- progress

// What a long run is doing, on stderr, once it has lasted `after` seconds
// (2 by default): on a terminal one line redrawn in place every 250 ms;
// otherwise a line when a step begins and every 5 s within it. The main
// thread names each step; the planner fills in `plan` (tensors planned,
// units placed). Never on stdout, never under --quiet.
class Ticker {
 public:
  Ticker(bool enabled, double after_seconds)
      : enabled_(enabled), tty_(::isatty(STDERR_FILENO) == 1), t0_(std::chrono::steady_clock::now()),
        shown_from_(t0_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(after_seconds))) {
    if (!enabled_) return;
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (const std::system_error&) {
      // No thread, no periodic lines; the run itself goes on.
    }
  }
  ~Ticker() { finish(); }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;

  // Ends the display (and clears its line), before the result is printed.
  void finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
      if (drawn_) std::fprintf(stderr, "\r\033[K");  // the result follows on a clean line
      drawn_ = false;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Starts a step; what the planner reports is shown while it runs.
  void step(std::string what, bool planning = false) {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = std::move(what);
    planning_ = planning;
    plan.set(refit::PlanProgress::kTensors, 0, 0);
    if (enabled_ && !stop_ && !tty_ && std::chrono::steady_clock::now() >= shown_from_) show_locked();
  }

  refit::PlanProgress plan;

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return stop_; })) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= shown_from_ && !what_.empty() && (tty_ || now >= last_line_ + std::chrono::seconds(5))) {
        show_locked();
      }
    }
  }

  void show_locked() {
    std::string line = "refit-plan: " + what_;
    const int64_t total = plan.total.load(std::memory_order_relaxed);
    const int64_t done = plan.done.load(std::memory_order_relaxed);
    const int step = plan.step.load(std::memory_order_relaxed);
    if (planning_ && step == refit::PlanProgress::kRuns && done > 0) {
      line += ": " + std::to_string(done) + " network runs";
    } else if (planning_ && total > 0) {
      line += step == refit::PlanProgress::kTensors ? ": tensors " : ": placing units ";
      line += std::to_string(done) + "/" + std::to_string(total) + " (" + std::to_string(done * 100 / total) + "%)";
    }
    line += ", " + std::to_string(static_cast<int64_t>(seconds_since(t0_))) + " s";
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      drawn_ = true;
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
    last_line_ = std::chrono::steady_clock::now();
  }

  const bool enabled_;
  const bool tty_;
  const std::chrono::steady_clock::time_point t0_;
  const std::chrono::steady_clock::time_point shown_from_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                                // mu_
  bool drawn_ = false;                               // mu_: a terminal line waits to be cleared
  std::string what_;                                 // mu_
  bool planning_ = false;                            // mu_
  std::chrono::steady_clock::time_point last_line_;  // mu_
  std::thread thread_;
};

// The run's ticker (main() owns it); null while none runs.
Ticker* g_ticker = nullptr;

void step(std::string what, bool planning = false) {
  if (g_ticker) g_ticker->step(std::move(what), planning);
}

refit::PlanProgress* plan_progress() { return g_ticker ? &g_ticker->plan : nullptr; }

void finish_progress() {
  if (g_ticker) g_ticker->finish();
}

// ---------------------------------------------------------------- files

Result<std::string> read_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return Status::io_error(path + ": is a folder, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error(path + ": cannot open: " + std::strerror(errno));
  std::string s;
  in.seekg(0, std::ios::end);
  const auto size = in.tellg();
  if (size > 0) {
    s.resize(static_cast<size_t>(size));
    in.seekg(0);
    in.read(s.data(), size);
  }
  if (!in) return Status::io_error(path + ": cannot read: " + std::strerror(errno));
  return s;
}

// "-" is standard output.
Status write_file(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text;
    std::cout.flush();
    return std::cout ? Status::ok() : Status::io_error("standard output: write failed");
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::io_error(path + ": cannot write: " + std::strerror(errno));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return Status::io_error(path + ": write failed: " + std::strerror(errno));
  return Status::ok();
}

// Writes what `produce` hands its sink, piece by piece: a cluster-scale
// runs file is larger than memory. "-" is standard output.
Status write_streamed(const std::string& path, const std::function<bool(const refit::TextSink&)>& produce) {
  std::ofstream file;
  std::ostream* out = &std::cout;
  if (path != "-") {
    file.open(path, std::ios::binary | std::ios::trunc);
    if (!file) return Status::io_error(path + ": cannot write: " + std::strerror(errno));
    out = &file;
  }
  const refit::TextSink sink = [out](std::string_view piece) {
    out->write(piece.data(), static_cast<std::streamsize>(piece.size()));
    return static_cast<bool>(*out);
  };
  const bool ok = produce(sink);
  out->flush();
  if (!ok || !*out)
    return Status::io_error((path == "-" ? "standard output" : path) + ": write failed: " + std::strerror(errno));
  return Status::ok();
}

// Reads only the header of a .safetensors file: a checkpoint shard is
// gigabytes, its header kilobytes.
Result<Manifest> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error(path + ": cannot open: " + std::strerror(errno));
  std::error_code ec;
  const uint64_t file_size = fs::file_size(path, ec);
  if (ec) return Status::io_error(path + ": cannot read its size: " + ec.message());
  std::string bytes(static_cast<size_t>(std::min<uint64_t>(8, file_size)), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (bytes.size() == 8) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    // A length the file cannot hold is reported by the parser; read only a
    // header that can be real.
    if (n <= kMaxSafetensorsHeader && n <= file_size - 8) {
      bytes.resize(8 + n);
      in.read(bytes.data() + 8, static_cast<std::streamsize>(n));
      bytes.resize(8 + static_cast<size_t>(in.gcount()));
    }
  }
  return refit::parse_safetensors_header(bytes, file_size, path);
}

Result<Manifest> read_safetensors_folder(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors" && e.is_regular_file()) files.push_back(e.path().string());
  }
  if (ec) return Status::io_error(dir + ": cannot list: " + ec.message());
  if (files.empty()) return Status::not_found(dir + ": the folder holds no .safetensors files");
  std::sort(files.begin(), files.end());
  Manifest all;
  for (const std::string& f : files) {
    auto m = read_safetensors(f);
    if (!m) return m.status();
    REFIT_RETURN_IF_ERROR(refit::merge_manifest(all, std::move(*m), f));
  }
  if (all.empty()) return Status::invalid(dir + ": the checkpoint holds no tensors");
  return all;
}

// A manifest .json, a .safetensors file, or a folder of them.
Result<Manifest> read_tensors(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return read_safetensors_folder(path);
  if (!fs::exists(path, ec)) return Status::not_found(path + ": no such file or folder");
  if (fs::path(path).extension() == ".safetensors") {
    auto m = read_safetensors(path);
    if (m && m->empty()) return Status::invalid(path + ": the checkpoint holds no tensors");
    return m;
  }
  auto text = read_file(path);
  if (!text) return text.status();
  return refit::parse_manifest_json(*text, path);
}

// The tensors and the Hugging Face config beside them (config.json in a
// folder, NAME.config.json beside NAME.json). A model without a config still
// reads: the recipes then refuse, naming the key they need.
Result<Manifest> read_model(const std::string& path) {
  auto m = read_tensors(path);
  if (!m) return m.status();
  std::error_code ec;
  const std::string config = refit::model_config_path(path, fs::is_directory(path, ec));
  if (!fs::exists(config, ec)) return m;
  auto text = read_file(config);
  if (!text) return text.status();
  auto c = refit::parse_model_config(*text, config);
  if (!c) return c.status();
  m->config = std::move(*c);
  return m;
}

// The manifest of `model` under `dir`: <model>.json, <model>.safetensors, or
// a folder <model>/ of .safetensors files, in that order.
Result<std::string> find_model(const std::string& dir, const std::string& model, const std::string& scenario) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::not_found(dir + ": no such folder (--models)");
  for (const std::string& candidate : {model + ".json", model + ".safetensors", model}) {
    const std::string p = (fs::path(dir) / candidate).string();
    if (fs::exists(p, ec)) return p;
  }
  return Status::not_found(dir + ": no manifest for model \"" + model + "\" of " + scenario + " (looked for " + model +
                           ".json, " + model + ".safetensors and the folder " + model + "/)");
}

// ---------------------------------------------------------------- sizes

// "4194304", "4M", "4MiB", "512k", "1G": binary multiples.
std::optional<int64_t> parse_size(const std::string& text) {
  size_t i = 0;
  int64_t v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, text[i] - '0', &v)) return std::nullopt;
    ++i;
  }
  if (i == 0) return std::nullopt;
  std::string suffix = text.substr(i);
  int shift = 0;
  if (!suffix.empty()) {
    const char c = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0])));
    shift = c == 'K' ? 10 : c == 'M' ? 20 : c == 'G' ? 30 : c == 'T' ? 40 : -1;
    const std::string rest = suffix.substr(1);
    if (shift < 0 || !(rest.empty() || rest == "iB")) return std::nullopt;
  }
  if (v > (INT64_MAX >> shift)) return std::nullopt;
  v <<= shift;
  if (v <= 0) return std::nullopt;
  return v;
}

std::string human_bytes(int64_t b) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  }
  return buf;
}

std::string ratio(int64_t a, int64_t b) {
  if (b == 0) return a == 0 ? "1.00x" : "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", static_cast<double>(a) / static_cast<double>(b));
  return buf;
}

double ratio_value(int64_t a, int64_t b) {
  return b == 0 ? (a == 0 ? 1.0 : 0.0) : static_cast<double>(a) / static_cast<double>(b);
}

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string stem(const std::string& path) { return fs::path(path).stem().string(); }

// ---------------------------------------------------------------- inputs

struct Options {
  std::string layout;
  std::vector<std::string> scenarios;
  std::string models_dir;
  std::string model;
  std::string layout_out;
  std::string runs_out;
  std::string json_out;
  std::string strategy;
  bool no_dedup = false;
  std::string chunk_bytes;
  std::string relayout_below;
  std::string relayout_staging;
  bool no_gather = false;
  std::string gather_below;
  std::string gather_bytes;
  std::optional<int64_t> gather_entries;
  bool compare = false;
  bool quiet = false;
  bool simulate = false;
  int threads = 0;
  std::string trace_out;
  std::string hardware_file;
  double progress_after = 2;
};

// One layout to plan, read from a layout file or made from a scenario. The
// Layout lives behind a pointer: a Plan refers to it.
struct Input {
  std::string name;    // the file's stem
  std::string origin;  // the file as given
  std::unique_ptr<Layout> layout;
  double layout_seconds = 0;
  std::optional<refit::Scenario> scenario;  // when made from a scenario
};

class Loader {
 public:
  explicit Loader(const Options& o) : o_(o) {}

  Result<Input> layout_file(const std::string& path) {
    const auto t0 = std::chrono::steady_clock::now();
    auto text = read_file(path);
    if (!text) return text.status();
    auto layout = refit::parse_layout_json(*text, path);
    if (!layout) return layout.status();
    Input in{stem(path), path, std::make_unique<Layout>(std::move(*layout)), 0, std::nullopt};
    in.layout_seconds = seconds_since(t0);
    return in;
  }

  Result<Input> scenario(const std::string& path) {
    const auto t0 = std::chrono::steady_clock::now();
    auto text = read_file(path);
    if (!text) return text.status();
    auto s = refit::parse_scenario(*text, path);
    if (!s) return s.status();
    if (s->train.model != s->infer.model) return two_models(*s, path, t0);
    std::string model_path = o_.model;
    if (model_path.empty()) {
      auto found = find_model(o_.models_dir, s->model, path);
      if (!found) return found.status();
      model_path = *found;
    }
    auto manifest = manifest_at(model_path);
    if (!manifest) return manifest.status();
    auto layout = refit::layout_from_scenario(*s, **manifest);
    if (!layout) return layout.status().with_context(path);
    // No validate() here: the recipes' tests check that they make valid
    // layouts, and at cluster scale (18M buffers for kimi-k2-384-h100) it
    // costs several times the plan. Layout files are validated as they are read.
    Input in{stem(path), path, std::make_unique<Layout>(std::move(*layout)), 0, std::move(*s)};
    in.layout_seconds = seconds_since(t0);
    return in;
  }

 private:
  // A trainer and a server holding the model in other dtypes (a BF16
  // trainer, an FP8 server): each side from its own manifest, the weight
  // block size from the server's <model>.config.json when it has one
  // (quantization_config.weight_block_size), else 128x128.
  Result<Input> two_models(const refit::Scenario& s, const std::string& path,
                           std::chrono::steady_clock::time_point t0) {
    if (o_.models_dir.empty())
      return Status::invalid(path + ": train.model (\"" + s.train.model + "\") and infer.model (\"" + s.infer.model +
                             "\") differ: give --models DIR, which holds both");
    auto train_path = find_model(o_.models_dir, s.train.model, path);
    if (!train_path) return train_path.status();
    auto infer_path = find_model(o_.models_dir, s.infer.model, path);
    if (!infer_path) return infer_path.status();
    auto train = manifest_at(*train_path);
    if (!train) return train.status();
    auto infer = manifest_at(*infer_path);
    if (!infer) return infer.status();
    auto block = weight_block_size(s.infer.model);
    if (!block) return block.status();
    auto layout = refit::layout_from_scenario_models(s, **train, **infer, *block);
    if (!layout) return layout.status().with_context(path);
    // The scenario goes with it: its hardware and reported figures.
    Input in{stem(path), path, std::make_unique<Layout>(std::move(*layout)), 0, s};
    in.layout_seconds = seconds_since(t0);
    return in;
  }

  Result<std::array<int64_t, 2>> weight_block_size(const std::string& model) {
    std::array<int64_t, 2> block{128, 128};
    const std::string config = (fs::path(o_.models_dir) / (model + ".config.json")).string();
    std::error_code ec;
    if (!fs::exists(config, ec)) return block;
    auto text = read_file(config);
    if (!text) return text.status();
    const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::invalid(config + ": not valid JSON");
    const auto q = j.find("quantization_config");
    if (q == j.end() || !q->is_object() || !q->contains("weight_block_size")) return block;
    const nlohmann::json& wb = (*q)["weight_block_size"];
    if (!wb.is_array() || wb.size() != 2 || !wb[0].is_number_integer() || !wb[1].is_number_integer() ||
        wb[0].get<int64_t>() <= 0 || wb[1].get<int64_t>() <= 0)
      return Status::invalid(config + ": \"quantization_config.weight_block_size\" must be two positive integers, got " +
                             wb.dump());
    return std::array<int64_t, 2>{wb[0].get<int64_t>(), wb[1].get<int64_t>()};
  }

  // Manifests are read once per run: --compare over many scenarios of one
  // model reads the model once.
  Result<const Manifest*> manifest_at(const std::string& path) {
    auto it = manifests_.find(path);
    if (it == manifests_.end()) {
      auto m = read_model(path);
      if (!m) return m.status();
      it = manifests_.emplace(path, std::move(*m)).first;
    }
    return &it->second;
  }

  const Options& o_;
  std::map<std::string, Manifest> manifests_;
};

// ---------------------------------------------------------------- output

struct Planned {
  PlanSummary summary;
  double plan_seconds = 0;
  // Layouts with dtype conversions: the bytes with each place of conversion.
  std::optional<refit::ConversionBytes> at_receiver, at_source;
  std::optional<refit::GetStats> gets;  // none for the broadcast baseline; after grouping
  std::optional<refit::GetStats> ungrouped_gets;  // every network run its own GET
};

// How the receiver agents group small runs into gathers (their defaults,
// or the command line's).
refit::GatherOptions g_gather;

// The receiver agent's default chunk_bytes (plugin/config.h): the largest
// GET it posts, so a longer network run is several GETs.
constexpr int64_t kAgentGetBytes = int64_t{1} << 20;
// Its default window_bytes: a source holds at most that much of each
// puller's gathers (gather_reply_bytes_wanted, get_stats.h).
constexpr int64_t kAgentWindowBytes = int64_t{64} << 20;
// The source agent's default "gather_reply_bytes" (plugin/config.h): the
// most it holds for gathers, whatever its pullers ask.
constexpr int64_t kSourceGatherReplyBytes = int64_t{256} << 20;

Result<Planned> plan_one(const Input& in, PlanOptions po, const std::string& runs_out) {
  step("planning " + in.name + " (" + refit::strategy_name(po.strategy) + ")", /*planning=*/true);
  po.progress = plan_progress();
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = refit::make_plan(*in.layout, po);
  const double secs = seconds_since(t0);
  if (!plan) return plan.status().with_context(in.origin);
  if (!runs_out.empty()) {
    step("writing the runs to " + runs_out);
    REFIT_RETURN_IF_ERROR(write_streamed(runs_out, [&](const refit::TextSink& sink) {
      return refit::write_runs_json(*plan, sink);
    }));
  }
  step("counting the GETs of " + in.name + " (" + refit::strategy_name(po.strategy) + ")", /*planning=*/true);
  Planned out{plan->summary(), secs, std::nullopt, std::nullopt, std::nullopt, std::nullopt};
  if (refit::has_conversions(*in.layout) && po.strategy != Strategy::kBroadcast) {
    out.at_receiver = refit::count_conversion_bytes(*plan, refit::ConvertAt::kReceiver);
    out.at_source = refit::count_conversion_bytes(*plan, refit::ConvertAt::kSource);
  }
  if (po.strategy != Strategy::kBroadcast) {
    out.gets = refit::get_stats(*plan, kAgentGetBytes, &g_gather, plan_progress(), kAgentWindowBytes);
    step("counting the GETs of " + in.name + " (" + refit::strategy_name(po.strategy) + ", without gathers)",
         /*planning=*/true);
    out.ungrouped_gets = refit::get_stats(*plan, kAgentGetBytes, nullptr, plan_progress());
  }
  return out;
}

ordered_json summary_json(const Input& in, const Planned& p, Strategy strategy) {
  const PlanSummary& s = p.summary;
  ordered_json j;
  j["name"] = in.name;
  j["strategy"] = refit::strategy_name(strategy);
  j["sources"] = in.layout->sources.size();
  j["receivers"] = in.layout->receivers.size();
  j["tensors"] = s.tensors;
  j["total_bytes"] = s.total_bytes;
  j["network_bytes"] = s.network_bytes;
  j["minimum_network_bytes"] = s.minimum_network_bytes;
  j["local_bytes"] = s.local_bytes;
  j["gather_bytes"] = s.gather_bytes;
  j["units"] = s.units;
  j["pulls"] = s.pulls;
  j["chunks"] = s.chunks;
  j["max_source_nic_bytes"] = s.max_source_nic_bytes;
  j["max_receiver_nic_bytes"] = s.max_receiver_nic_bytes;
  if (p.at_receiver) {
    // network_bytes above counts every tensor in its sources' dtype.
    j["converted_tensors"] = p.at_receiver->converted_tensors;
    j["derived_scale_tensors"] = p.at_receiver->derived_tensors;
    j["convert_at_receiver_network_bytes"] = p.at_receiver->network_bytes;
    j["convert_at_receiver_local_bytes"] = p.at_receiver->local_bytes;
    j["convert_at_source_network_bytes"] = p.at_source->network_bytes;
    j["convert_at_source_local_bytes"] = p.at_source->local_bytes;
    j["convert_at_source_scale_bytes"] = p.at_source->network_scale_bytes;
    j["quantized_at_source_bytes"] = p.at_source->quantized_at_source_bytes;
    j["quantized_at_receiver_bytes"] = p.at_source->quantized_at_receiver_bytes;
  }
  if (p.gets) {
    // GETs as the receiver agents post them (get_stats.h).
    j["gets"] = p.gets->gets;
    j["gets_per_receiver_max"] = p.gets->gets_per_receiver_max;
    j["gets_busiest_receiver"] = p.gets->busiest_receiver;
    if (p.gets->busiest_receiver >= 0) {
      // Its GETs: gathers, small runs alone, and the chunks of larger runs.
      const auto b = static_cast<size_t>(p.gets->busiest_receiver);
      j["gets_busiest_receiver_gathers"] = p.gets->per_receiver_gathers[b];
      j["gets_busiest_receiver_small_alone"] = p.gets->per_receiver_small_alone[b];
    }
    j["get_bytes_median"] = p.gets->get_bytes_median;
    j["get_bytes_min"] = p.gets->get_bytes_min;
    j["get_bytes_max"] = p.gets->get_bytes_max;
    // How many GETs of each power-of-two size class, keyed by the class's
    // upper bound in bytes ("1048576": 524,289 to 1,048,576 bytes).
    ordered_json classes = ordered_json::object();
    for (const auto& [bound, count] : refit::size_classes(*p.gets)) classes[std::to_string(bound)] = count;
    j["get_size_classes"] = std::move(classes);
    // Small runs grouped into gathers (planner/gather.h); the figures
    // without grouping beside them.
    j["gather"] = g_gather.enabled;
    j["gathers"] = p.gets->gathers;
    j["gathered_runs"] = p.gets->gathered_runs;
    j["gather_unpacked"] = p.gets->unpacked;
    // The gather reply memory a source's pullers may ask of it (the
    // busiest source), and what it holds at most: its default bound.
    j["gather_reply_bytes_wanted"] = p.gets->gather_reply_bytes_wanted;
    j["gather_reply_wanted_source"] = p.gets->gather_reply_wanted_source;
    j["gather_reply_bytes_bound"] = std::min(p.gets->gather_reply_bytes_wanted, kSourceGatherReplyBytes);
    j["ungrouped_gets"] = p.ungrouped_gets->gets;
    j["ungrouped_gets_per_receiver_max"] = p.ungrouped_gets->gets_per_receiver_max;
    j["ungrouped_get_bytes_median"] = p.ungrouped_gets->get_bytes_median;
  }
  j["layout_seconds"] = in.layout_seconds;
  j["plan_seconds"] = p.plan_seconds;
  j["plan_threads"] = p.summary.threads;
  return j;
}

std::string summary_table(const ordered_json& j) {
  static const char* kByteKeys[] = {"total_bytes",
                                    "network_bytes",
                                    "minimum_network_bytes",
                                    "local_bytes",
                                    "gather_bytes",
                                    "max_source_nic_bytes",
                                    "max_receiver_nic_bytes",
                                    "get_bytes_median",
                                    "ungrouped_get_bytes_median",
                                    "get_bytes_min",
                                    "get_bytes_max",
                                    "convert_at_receiver_network_bytes",
                                    "convert_at_receiver_local_bytes",
                                    "convert_at_source_network_bytes",
                                    "convert_at_source_local_bytes",
                                    "convert_at_source_scale_bytes",
                                    "quantized_at_source_bytes",
                                    "quantized_at_receiver_bytes"};
  size_t width = 0;
  for (auto it = j.begin(); it != j.end(); ++it) width = std::max(width, it.key().size());
  std::string out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string value;
    if (it->is_string()) {
      value = it->get<std::string>();
    } else if (it->is_boolean()) {
      value = it->get<bool>() ? "yes" : "no";
    } else if (it->is_number_float()) {
      value = fixed(it->get<double>(), 6);
    } else if (it->is_object()) {  // get_size_classes: "up to SIZE: COUNT" each
      for (auto c = it->begin(); c != it->end(); ++c) {
        value += std::string(value.empty() ? "" : ", ") + "<=" + human_bytes(std::stoll(c.key())) + ": " +
                 std::to_string(c->get<int64_t>());
      }
    } else {
      value = std::to_string(it->get<int64_t>());
      for (const char* k : kByteKeys)
        if (it.key() == k) value = human_bytes(it->get<int64_t>()) + "  (" + value + ")";
    }
    out += it.key() + std::string(width + 2 - it.key().size(), ' ') + value + "\n";
  }
  return out;
}

struct CompareRow {
  std::string name;
  PlanSummary refit, no_dedup, broadcast;
  std::optional<refit::GetStats> refit_gets;
  std::optional<refit::GetStats> refit_ungrouped_gets;
  double plan_seconds = 0;
  double layout_seconds = 0;
};

// What the conventional refit moves over the network: the gather to one
// source per tensor, then every receiver's full copy.
int64_t broadcast_total(const PlanSummary& s) { return s.network_bytes + s.gather_bytes; }

ordered_json compare_json(const std::vector<CompareRow>& rows) {
  ordered_json list = ordered_json::array();
  for (const CompareRow& r : rows) {
    ordered_json j;
    j["name"] = r.name;
    j["network_bytes"] = r.refit.network_bytes;
    j["minimum_network_bytes"] = r.refit.minimum_network_bytes;
    j["ratio"] = ratio_value(r.refit.network_bytes, r.refit.minimum_network_bytes);
    j["local_bytes"] = r.refit.local_bytes;
    if (r.refit_gets) {
      j["gets_per_receiver_max"] = r.refit_gets->gets_per_receiver_max;
      j["get_bytes_median"] = r.refit_gets->get_bytes_median;
      j["ungrouped_gets_per_receiver_max"] = r.refit_ungrouped_gets->gets_per_receiver_max;
      j["ungrouped_get_bytes_median"] = r.refit_ungrouped_gets->get_bytes_median;
    }
    j["no_dedup_bytes"] = r.no_dedup.network_bytes;
    j["no_dedup_ratio"] = ratio_value(r.no_dedup.network_bytes, r.refit.network_bytes);
    j["broadcast_bytes"] = broadcast_total(r.broadcast);
    j["broadcast_gather_bytes"] = r.broadcast.gather_bytes;
    j["broadcast_ratio"] = ratio_value(broadcast_total(r.broadcast), r.refit.network_bytes);
    j["layout_seconds"] = r.layout_seconds;
    j["plan_seconds"] = r.plan_seconds;
    list.push_back(std::move(j));
  }
  ordered_json top;
  top["rows"] = std::move(list);
  return top;
}

std::string compare_table(const std::vector<CompareRow>& rows) {
  std::vector<std::vector<std::string>> cells = {{"name", "network", "minimum", "net/min", "no-dedup", "/refit",
                                                  "broadcast", "/refit", "layout_s", "plan_s"}};
  for (const CompareRow& r : rows) {
    cells.push_back({r.name, human_bytes(r.refit.network_bytes), human_bytes(r.refit.minimum_network_bytes),
                     ratio(r.refit.network_bytes, r.refit.minimum_network_bytes), human_bytes(r.no_dedup.network_bytes),
                     ratio(r.no_dedup.network_bytes, r.refit.network_bytes), human_bytes(broadcast_total(r.broadcast)),
                     ratio(broadcast_total(r.broadcast), r.refit.network_bytes), fixed(r.layout_seconds, 4),
                     fixed(r.plan_seconds, 4)});
  }
  std::vector<size_t> w(cells[0].size(), 0);
  for (const auto& row : cells)
    for (size_t c = 0; c < row.size(); ++c) w[c] = std::max(w[c], row[c].size());
  std::string out;
  for (const auto& row : cells) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string pad(w[c] - row[c].size(), ' ');
      // Names left-aligned, figures right-aligned.
      line += c == 0 ? row[c] + pad : "  " + pad + row[c];
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  out += "broadcast counts the gather to one source per tensor and every receiver's full copy\n";
  return out;
}

// ---------------------------------------------------------------- simulate

int fail(const Status& s);

// The hardware a simulation runs on: the documented defaults, then the
// scenario's `hardware` object, then --hardware FILE. `from` says which of
// them gave figures.
struct HardwareChoice {
  refit::HardwareModel model;
  std::vector<std::string> given;
  std::string from;
};

Result<HardwareChoice> choose_hardware(const Input& in, const std::string& file) {
  HardwareChoice h{refit::default_hardware(), {}, "defaults"};
  if (in.scenario && !in.scenario->hardware_given.empty()) {
    h.model = in.scenario->hardware_model;
    h.given = in.scenario->hardware_given;
    h.from = "scenario";
  }
  if (!file.empty()) {
    auto text = read_file(file);
    if (!text) return text.status();
    const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Status::invalid(file + ": not valid JSON: " + refit::json_util::syntax_error(*text));
    std::vector<std::string> given;
    REFIT_RETURN_IF_ERROR(refit::apply_hardware(j, file, "", /*require_link_rates=*/false, &h.model, &given));
    h.given.insert(h.given.end(), given.begin(), given.end());
    h.from = h.from == "defaults" ? file : h.from + " and " + file;
  }
  return h;
}

ordered_json hardware_json(const HardwareChoice& h) {
  ordered_json j;
  j["from"] = h.from;
  // Every figure, each with whether it was given or is the default.
  ordered_json values;
  for (const refit::HardwareKey& k : refit::hardware_keys()) {
    const double v = refit::hardware_value(h.model, k.key).value_or(0);
    if (refit::is_boolean_hardware_key(k.key)) values[k.key] = v != 0;
    else values[k.key] = v;
  }
  j["values"] = std::move(values);
  j["given"] = h.given;
  return j;
}

ordered_json link_json(const refit::sim::LinkLoad& l) {
  ordered_json j;
  j["rank"] = l.rank;
  j["bytes"] = l.bytes;
  j["busy_seconds"] = l.busy_seconds;
  return j;
}

ordered_json span_json(const refit::sim::Span& s) {
  ordered_json j;
  j["start"] = s.start;
  j["end"] = s.end;
  j["seconds"] = s.seconds();
  return j;
}

ordered_json simulation_json(const Input& in, Strategy strategy, const refit::sim::SimResult& r,
                             const refit::sim::LowerBound& lb, const HardwareChoice& hw, double plan_seconds,
                             int plan_threads, double sim_seconds) {
  ordered_json j;
  j["name"] = in.name;
  j["strategy"] = refit::strategy_name(strategy);
  j["simulated"] = true;
  j["model"] = r.model;
  j["predicted_seconds"] = r.predicted_seconds;
  j["lower_bound_seconds"] = lb.seconds;
  j["predicted_over_bound"] = lb.seconds > 0 ? r.predicted_seconds / lb.seconds : 0.0;
  if (hw.model.host_cores > 0) {  // one shared machine (docs/simulator.md, "Calibration")
    j["host_cpu_seconds"] = r.host_cpu_seconds;
    j["host_bound_seconds"] = r.host_bound_seconds;
    j["host_bound"] = r.host_bound;
  }
  j["gathered_bytes"] = r.gathered_bytes;
  ordered_json b;
  b["binding"] = lb.binding;
  b["domain_nic_seconds"] = lb.domain_nic_seconds;
  b["domain"] = lb.domain;
  b["source_nics_seconds"] = lb.source_nics_seconds;
  b["gpu_ingress_seconds"] = lb.gpu_ingress_seconds;
  b["gpu"] = lb.gpu;
  b["source_exclusive_seconds"] = lb.source_exclusive_seconds;
  b["exclusive_source"] = lb.exclusive_source;
  b["source_group_seconds"] = lb.source_group_seconds;
  b["source_group_first"] = lb.source_group_first;
  b["source_group_size"] = lb.source_group_size;
  j["lower_bound"] = std::move(b);
  ordered_json ph;
  ph["publish"] = span_json(r.phases.publish);
  ph["network"] = span_json(r.phases.network);
  ph["h2d"] = span_json(r.phases.h2d);
  ph["fanout"] = span_json(r.phases.fanout);
  ph["convert"] = span_json(r.phases.convert);
  j["phases"] = std::move(ph);
  ordered_json busiest;
  busiest["source_nic"] = link_json(r.busiest_source_nic);
  busiest["receiver_nic"] = link_json(r.busiest_receiver_nic);
  ordered_json posting;  // the per-GET cost a receiver pays
  posting["rank"] = r.busiest_posting.rank;
  posting["gets"] = r.busiest_posting.bytes;
  posting["busy_seconds"] = r.busiest_posting.busy_seconds;
  busiest["get_posting"] = std::move(posting);
  busiest["nvlink_out"] = link_json(r.busiest_nvlink_out);
  busiest["nvlink_in"] = link_json(r.busiest_nvlink_in);
  busiest["convert"] = link_json(r.busiest_convert);
  j["busiest"] = std::move(busiest);
  j["network_bytes"] = r.network_bytes;
  j["local_bytes"] = r.local_bytes;
  j["gets"] = r.gets;
  j["gather"] = g_gather.enabled;
  j["gathers"] = r.gathers;
  j["gets_per_receiver_max"] = r.gets_per_receiver_max;
  j["local_sends"] = r.local_sends;
  j["local_runs"] = r.local_runs;
  j["local_ops"] = r.local_ops;
  j["local_packed"] = r.local_packed;
  j["local_rounds"] = r.local_rounds;
  j["local_pairs"] = r.local_pairs;
  j["local_pair_sequences"] = r.local_pair_sequences;
  j["jobs"] = r.jobs;
  j["events"] = r.events;
  j["converts"] = r.converts;
  j["convert_bytes"] = r.convert_bytes;
  j["source_convert_bytes"] = r.source_convert_bytes;
  ordered_json rep = ordered_json::array();
  if (in.scenario) {
    for (const refit::Reported& x : in.scenario->reported) {
      ordered_json e;
      e["system"] = x.system;
      e["seconds"] = x.seconds;
      if (x.seconds_max > 0) e["seconds_max"] = x.seconds_max;
      e["source"] = x.source;
      rep.push_back(std::move(e));
    }
  }
  j["reported"] = std::move(rep);
  j["hardware"] = hardware_json(hw);
  j["layout_seconds"] = in.layout_seconds;
  j["plan_seconds"] = plan_seconds;
  j["plan_threads"] = plan_threads;
  j["simulate_seconds"] = sim_seconds;
  if (r.model == "event") {
    j["simulate_stage_seconds"] = {{"jobs", r.stage_seconds.jobs},
                                   {"network", r.stage_seconds.network},
                                   {"rounds", r.stage_seconds.rounds},
                                   {"finish", r.stage_seconds.finish}};
    j["simulate_stage_threads"] = {{"jobs", r.stage_threads.jobs},
                                   {"network", r.stage_threads.network},
                                   {"rounds", r.stage_threads.rounds}};
  }
  return j;
}

std::string simulation_table(const ordered_json& j) {
  auto secs = [](double v) { return fixed(v, 4) + " s"; };
  auto link = [&](const ordered_json& l) {
    return "rank " + std::to_string(l["rank"].get<int64_t>()) + ", " + human_bytes(l["bytes"].get<int64_t>()) +
           ", busy " + secs(l["busy_seconds"].get<double>());
  };
  auto span = [&](const ordered_json& s) {
    if (s["end"].get<double>() == 0) return std::string("-");
    return fixed(s["start"].get<double>(), 4) + " to " + fixed(s["end"].get<double>(), 4) + " s";
  };
  std::vector<std::pair<std::string, std::string>> rows = {
      {"name", j["name"].get<std::string>()},
      {"strategy", j["strategy"].get<std::string>() + " (" + j["model"].get<std::string>() + " model)"},
      {"predicted (simulated)", secs(j["predicted_seconds"].get<double>())},
      {"lower bound", secs(j["lower_bound_seconds"].get<double>()) + " (" +
                          j["lower_bound"]["binding"].get<std::string>() + ")"},
      {"predicted / bound", fixed(j["predicted_over_bound"].get<double>(), 2)},
      {"publish copy", span(j["phases"]["publish"])},
      {"network", span(j["phases"]["network"])},
      {"host to GPU", span(j["phases"]["h2d"])},
      {"fan-out", span(j["phases"]["fanout"])},
      {"conversion", span(j["phases"]["convert"])},
      {"busiest source NIC", link(j["busiest"]["source_nic"])},
      {"busiest receiver NIC", link(j["busiest"]["receiver_nic"])},
      {"busiest GET posting", "rank " + std::to_string(j["busiest"]["get_posting"]["rank"].get<int64_t>()) + ", " +
                                  std::to_string(j["busiest"]["get_posting"]["gets"].get<int64_t>()) + " GETs, busy " +
                                  secs(j["busiest"]["get_posting"]["busy_seconds"].get<double>())},
      {"busiest NVLink out", link(j["busiest"]["nvlink_out"])},
      {"busiest NVLink in", link(j["busiest"]["nvlink_in"])},
      {"busiest conversion", j["converts"].get<int64_t>() == 0 ? std::string("-") : link(j["busiest"]["convert"])},
      {"GETs", std::to_string(j["gets"].get<int64_t>()) + " (at most " +
                   std::to_string(j["gets_per_receiver_max"].get<int64_t>()) + " per receiver; " +
                   (j["gather"].get<bool>() ? std::to_string(j["gathers"].get<int64_t>()) + " of them gathers)"
                                            : std::string("gathers off)"))},
      {"hardware from", j["hardware"]["from"].get<std::string>()},
  };
  for (const auto& r : j["reported"]) {
    std::string v = fixed(r["seconds"].get<double>(), 3);
    if (r.contains("seconds_max")) v += "-" + fixed(r["seconds_max"].get<double>(), 3);
    rows.push_back({"reported", v + " s: " + r["system"].get<std::string>()});
  }
  size_t w = 0;
  for (const auto& [k, v] : rows) w = std::max(w, k.size());
  std::string out;
  for (const auto& [k, v] : rows) out += k + std::string(w + 2 - k.size(), ' ') + v + "\n";
  return out;
}

int simulate_one(const Options& o, const Input& in, const PlanOptions& po) {
  auto hw = choose_hardware(in, o.hardware_file);
  if (!hw) return fail(hw.status());
  if (hw->from == "defaults" && !o.quiet)
    std::cerr << "refit-plan: " << in.origin
              << " gives no hardware figures; simulating with the defaults (docs/simulator.md)\n";
  auto t0 = std::chrono::steady_clock::now();
  step("planning " + in.name + " (" + refit::strategy_name(po.strategy) + ")", /*planning=*/true);
  PlanOptions traced = po;
  traced.progress = plan_progress();
  auto plan = refit::make_plan(*in.layout, traced);
  if (!plan) return fail(plan.status().with_context(in.origin));
  const int plan_threads = plan->summary().threads;
  // The lower bound needs the refit plan's domains, whatever is simulated.
  std::optional<Plan> refit_plan;
  if (po.strategy != Strategy::kRefit) {
    step("planning " + in.name + " (refit, for the lower bound)", /*planning=*/true);
    PlanOptions r = traced;
    r.strategy = Strategy::kRefit;
    auto p = refit::make_plan(*in.layout, r);
    if (!p) return fail(p.status().with_context(in.origin));
    refit_plan.emplace(std::move(*p));
  }
  const double plan_seconds = seconds_since(t0);
  step("simulating " + in.name + " (" + refit::strategy_name(po.strategy) + ")");
  t0 = std::chrono::steady_clock::now();
  auto lb = refit::sim::lower_bound(refit_plan ? *refit_plan : *plan, hw->model);
  if (!lb) return fail(lb.status());
  refit::sim::SimResult result;
  if (po.strategy == Strategy::kBroadcast) {
    result = refit::sim::estimate_broadcast(*plan, hw->model);
  } else {
    refit::sim::SimOptions so;
    so.trace = !o.trace_out.empty();
    so.gather = g_gather;
    so.threads = o.threads;
    // Nothing below reads the plan: the simulation gives its memory back
    // once it has read it.
    auto r = refit::sim::simulate(std::move(*plan), hw->model, so);
    if (!r) return fail(r.status().with_context(in.origin));
    result = std::move(*r);
  }
  const double sim_seconds = seconds_since(t0);
  if (!o.trace_out.empty()) {
    step("writing the trace to " + o.trace_out);
    const std::string title = in.name + ", " + refit::strategy_name(po.strategy) + ", simulated";
    Status s = write_streamed(o.trace_out, [&](const refit::TextSink& sink) {
      return refit::sim::write_trace_json(result, title, sink);
    });
    if (!s) return fail(s);
  }
  const ordered_json j =
      simulation_json(in, po.strategy, result, *lb, *hw, plan_seconds, plan_threads, sim_seconds);
  finish_progress();
  if (!o.json_out.empty()) {
    Status s = write_file(o.json_out, j.dump(2) + "\n");
    if (!s) return fail(s);
  } else if (!o.quiet) {
    std::cout << simulation_table(j);
  }
  return 0;
}

// ---------------------------------------------------------------- main

int fail(const Status& s) {
  finish_progress();
  std::cerr << "refit-plan: " << (s.code() == Code::kInternal ? "internal error: " : "") << s.message() << "\n";
  return s.code() == Code::kInternal ? kExitInternal : kExitBadInput;
}

int usage_error(const std::string& msg) {
  finish_progress();
  std::cerr << "refit-plan: " << msg << " (see --help)\n";
  return kExitBadInput;
}

int run(const Options& o) {
  // Combinations that make no sense are refused before any work.
  if (o.layout.empty() && o.scenarios.empty()) return usage_error("give --layout FILE or --scenario FILE");
  if (!o.layout.empty() && !o.scenarios.empty()) return usage_error("--layout and --scenario exclude each other");
  if (!o.scenarios.empty() && o.models_dir.empty() && o.model.empty())
    return usage_error("--scenario needs --models DIR or --model PATH");
  if (!o.models_dir.empty() && !o.model.empty()) return usage_error("--models and --model exclude each other");
  if (!o.layout.empty() && (!o.models_dir.empty() || !o.model.empty()))
    return usage_error("--models and --model go with --scenario, not --layout");
  if (o.scenarios.size() > 1 && !o.compare) return usage_error("several --scenario files need --compare");
  if (o.compare && (!o.runs_out.empty() || !o.layout_out.empty()))
    return usage_error("--compare writes no --runs or --layout-out; plan one input for those");
  if (o.compare && (o.no_dedup || !o.strategy.empty()))
    return usage_error("--compare plans every strategy; drop --strategy and --no-dedup");

  PlanOptions po;
  if (!o.chunk_bytes.empty()) {
    auto n = parse_size(o.chunk_bytes);
    if (!n) return usage_error("--chunk-bytes must be a positive byte count like 4194304, 4M or 4MiB, got \"" +
                               o.chunk_bytes + "\"");
    po.chunk_bytes = *n;
  }
  for (const auto& [flag, text, field] :
       {std::tuple{"--relayout-below", &o.relayout_below, &po.relayout_below_bytes},
        std::tuple{"--relayout-staging-bytes", &o.relayout_staging, &po.relayout_staging_bytes}}) {
    if (text->empty()) continue;
    auto n = parse_size(*text);
    if (!n) return usage_error(std::string(flag) + " must be a positive byte count like 4096 or 4KiB, got \"" +
                               *text + "\"");
    *field = *n;
  }
  g_gather.enabled = !o.no_gather;
  for (const auto& [flag, text, field] : {std::tuple{"--gather-below", &o.gather_below, &g_gather.below_bytes},
                                          std::tuple{"--gather-bytes", &o.gather_bytes, &g_gather.max_bytes}}) {
    if (text->empty()) continue;
    auto n = parse_size(*text);
    if (!n) return usage_error(std::string(flag) + " must be a positive byte count like 65536 or 64KiB, got \"" +
                               *text + "\"");
    *field = *n;
  }
  if (o.gather_entries) g_gather.max_entries = *o.gather_entries;
  if (Status st = refit::validate(g_gather); !st.is_ok()) {
    // The message names the agents' key; say which flag set it.
    for (const auto& [key, flag] : {std::pair{"\"gather_below_bytes\"", "--gather-below"},
                                    std::pair{"\"gather_bytes\"", "--gather-bytes"},
                                    std::pair{"\"gather_entries\"", "--gather-entries"}}) {
      if (st.message().rfind(key, 0) == 0) return usage_error(std::string(flag) + ": " + st.message());
    }
    return usage_error(st.message());
  }
  if (o.strategy == "no-dedup") po.strategy = Strategy::kNoDedup;
  if (o.strategy == "broadcast") po.strategy = Strategy::kBroadcast;
  if (o.no_dedup) {
    if (!o.strategy.empty() && o.strategy != "no-dedup")
      return usage_error("--no-dedup contradicts --strategy " + o.strategy);
    po.strategy = Strategy::kNoDedup;
  }
  if (po.strategy == Strategy::kBroadcast && !o.runs_out.empty())
    return usage_error("--runs needs a plan of units; the broadcast baseline has only a summary");
  if (!o.simulate && (!o.trace_out.empty() || !o.hardware_file.empty()))
    return usage_error("--trace and --hardware go with --simulate");
  po.threads = o.threads;
  if (o.simulate && o.compare) return usage_error("--simulate takes one input; drop --compare");
  if (o.simulate && (!o.runs_out.empty() || !o.layout_out.empty()))
    return usage_error("--simulate writes no --runs or --layout-out; plan without it for those");
  if (o.simulate && po.strategy == Strategy::kBroadcast && !o.trace_out.empty())
    return usage_error("--trace needs --strategy refit or no-dedup: the broadcast estimate has no timeline");

  Loader loader(o);
  auto load = [&](const std::string& path) {
    step("reading " + path);
    return o.layout.empty() ? loader.scenario(path) : loader.layout_file(path);
  };
  std::vector<std::string> inputs = o.layout.empty() ? o.scenarios : std::vector<std::string>{o.layout};

  if (o.compare) {
    std::vector<CompareRow> rows;
    for (const std::string& path : inputs) {
      auto in = load(path);
      if (!in) return fail(in.status());
      CompareRow row;
      row.name = in->name;
      row.layout_seconds = in->layout_seconds;
      for (Strategy st : {Strategy::kRefit, Strategy::kNoDedup, Strategy::kBroadcast}) {
        PlanOptions p = po;
        p.strategy = st;
        auto planned = plan_one(*in, p, "");
        if (!planned) return fail(planned.status());
        (st == Strategy::kRefit ? row.refit : st == Strategy::kNoDedup ? row.no_dedup : row.broadcast) =
            planned->summary;
        if (st == Strategy::kRefit) {
          row.plan_seconds = planned->plan_seconds;
          row.refit_gets = planned->gets;
          row.refit_ungrouped_gets = planned->ungrouped_gets;
        }
      }
      rows.push_back(std::move(row));
    }
    finish_progress();
    if (!o.json_out.empty()) {
      Status s = write_file(o.json_out, compare_json(rows).dump(2) + "\n");
      if (!s) return fail(s);
    } else if (!o.quiet) {
      std::cout << compare_table(rows);
    }
    return 0;
  }

  auto in = load(inputs.front());
  if (!in) return fail(in.status());
  if (o.simulate) return simulate_one(o, *in, po);
  if (!o.layout_out.empty()) {
    step("writing the layout to " + o.layout_out);
    Status s = write_streamed(o.layout_out, [&](const refit::TextSink& sink) {
      return refit::write_layout_json(*in->layout, sink);
    });
    if (!s) return fail(s);
  }
  auto planned = plan_one(*in, po, o.runs_out);
  if (!planned) return fail(planned.status());
  const ordered_json j = summary_json(*in, *planned, po.strategy);
  finish_progress();
  if (!o.json_out.empty()) {
    Status s = write_file(o.json_out, j.dump(2) + "\n");
    if (!s) return fail(s);
  } else if (!o.quiet) {
    std::cout << summary_table(j);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "Plans a refit weight refresh: which bytes cross the network once per receiving NVLink domain and which are "
      "fanned out inside it.",
      "refit-plan"};
  app.get_formatter()->column_width(34);
  app.add_option("--layout", o.layout, "a refit-layout/1 file to plan")->type_name("FILE");
  app.add_option("--scenario", o.scenarios, "a scenario file to plan (repeatable with --compare)")
      ->type_name("FILE")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--models", o.models_dir,
                 "folder with the scenario's model: <model>.json, <model>.safetensors or <model>/")
      ->type_name("DIR");
  app.add_option("--model", o.model, "the model: a manifest .json, a .safetensors file or a folder of them")
      ->type_name("PATH");
  app.add_option("--layout-out", o.layout_out, "write the explicit refit-layout/1 to FILE")->type_name("FILE");
  app.add_option("--runs", o.runs_out, "write every byte run (refit-runs/1) to FILE")->type_name("FILE");
  app.add_option("--json", o.json_out, "write the summary as JSON to FILE instead of printing a table ('-': stdout)")
      ->type_name("FILE");
  app.add_option("--strategy", o.strategy, "refit (default), no-dedup or broadcast")
      ->type_name("NAME")
      ->check(CLI::IsMember({"refit", "no-dedup", "broadcast"}));
  app.add_flag("--no-dedup", o.no_dedup, "same as --strategy no-dedup: every receiver rank pulls for itself");
  app.add_option("--chunk-bytes", o.chunk_bytes, "pipelining grain, e.g. 4M, 4MiB, 1048576 (default 4MiB)")
      ->type_name("SIZE");
  app.add_option("--relayout-below", o.relayout_below,
                 "pull a unit whose network runs would average under SIZE (a column-major receiver of a row-major "
                 "source) row-major into the puller's staging area and relayout it there (PlanOptions "
                 "relayout_below_bytes; default: never; docs/refresh.md, \"Column-major receivers\")")
      ->type_name("SIZE");
  app.add_option("--relayout-staging-bytes", o.relayout_staging,
                 "the most staging bytes one puller's relayouts may take (default 1GiB)")
      ->type_name("SIZE");
  app.add_flag("--no-gather", o.no_gather,
               "count every network run as its own GET, as receivers with \"gather_below_bytes\": 0 post them");
  app.add_option("--gather-below", o.gather_below,
                 "group network runs smaller than SIZE into gathers (the agents' \"gather_below_bytes\", default "
                 "1MiB)")
      ->type_name("SIZE");
  app.add_option("--gather-bytes", o.gather_bytes, "bytes of one gather (the agents' \"gather_bytes\", default 16MiB)")
      ->type_name("SIZE");
  app.add_option("--gather-entries", o.gather_entries,
                 "runs of one gather (the agents' \"gather_entries\", default " +
                     std::to_string(refit::GatherOptions{}.max_entries) + ", at most " +
                     std::to_string(refit::kGatherEntriesMax) + ")")
      ->type_name("N");
  app.add_flag("--compare", o.compare,
               "plan refit, no-dedup and broadcast for every input; print one row each");
  app.add_flag("--quiet", o.quiet, "print nothing; write only the files asked for");
  app.add_flag("--simulate", o.simulate,
               "simulate the refresh on the scenario's hardware (docs/simulator.md): predicted seconds beside the "
               "lower bound and the reported figures");
  app.add_option("--trace", o.trace_out, "with --simulate: write the timeline as Chrome/Perfetto trace JSON")
      ->type_name("FILE");
  app.add_option("--threads", o.threads,
                 "threads that plan the units (default 0: one per core the process may use, by its CPU affinity "
                 "and cgroup quota, at most one per 1024 tensors) and, with --simulate, read the plan into jobs "
                 "and simulate the network (default 0: one per usable core, at most one per 256 receivers; the "
                 "network on one with --trace or without fan-out rounds); the result does not depend on it")
      ->type_name("N")
      ->check(CLI::Range(0, 1024));
  app.add_option("--hardware", o.hardware_file,
                 "with --simulate: a JSON object of hardware figures that override the scenario's")
      ->type_name("FILE");
  app.add_option("--progress-after", o.progress_after,
                 "show progress on stderr once the run has lasted SECONDS (default 2; 0: from the start)")
      ->type_name("SECONDS")
      ->check(CLI::Range(0.0, 1e6));
  app.footer(
      "Examples:\n"
      "  refit-plan --scenario examples/scenarios/tp2-to-tp4.json --models examples/models\n"
      "  refit-plan --layout examples/layouts/cross-dim.json --runs runs.json\n"
      "  refit-plan --compare --models examples/models --scenario a.json --scenario b.json\n"
      "  refit-plan --simulate --scenario examples/scenarios/moe-ep.json --models examples/models --trace t.json\n"
      "A scenario whose train.model and infer.model differ (a BF16 trainer, an FP8 server) converts on the way\n"
      "(docs/conversion.md): the summary then adds the bytes with conversion at the receiver and at the source,\n"
      "and --simulate runs the conversion as the agents do (the pullers convert, the fan-out carries FP8).\n"
      "A run longer than 2 s (--progress-after) shows its progress on stderr (the step, tensors planned,\n"
      "seconds): a line redrawn in place on a terminal, else a line every 5 s; --quiet shows none.\n"
      "Exit status: 0 success, 2 bad input (one line on stderr), 1 internal error.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::cerr << "refit-plan: " << e.what() << " (see --help)\n";
    return kExitBadInput;
  }
  try {
    Ticker ticker(!o.quiet, o.progress_after);
    g_ticker = &ticker;
    const int rc = run(o);
    ticker.finish();  // before the error line, if any, is printed below
    g_ticker = nullptr;
    return rc;
  } catch (const std::bad_alloc&) {
    std::cerr << "refit-plan: out of memory\n";
  } catch (const std::exception& e) {
    std::cerr << "refit-plan: internal error: " << e.what() << "\n";
  }
  return kExitInternal;
}
