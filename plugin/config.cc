#include "plugin/config.h"

#include <algorithm>
#include <cstdlib>

#include "plugin/json_reader.h"

namespace refit::plugin {

Status parse_host_port(const std::string& text, const std::string& key, std::string* host, uint16_t* port) {
  const size_t colon = text.rfind(':');
  auto bad = [&] {
    return Status::invalid("config: \"" + key + "\" must be \"HOST:PORT\" with a port in 0..65535, got \"" +
                           text + "\"");
  };
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return bad();
  std::string h = text.substr(0, colon);
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const std::string p = text.substr(colon + 1);
  if (p.size() > 5 || p.find_first_not_of("0123456789") != std::string::npos) return bad();
  const long value = std::strtol(p.c_str(), nullptr, 10);
  if (value > 65535) return bad();
  *host = h;
  *port = static_cast<uint16_t>(value);
  return Status::ok();
}

namespace {

LogLevel level_from(JsonReader& r, const std::string& text, const std::string& path) {
  if (text == "error") return LogLevel::kError;
  if (text == "warn") return LogLevel::kWarn;
  if (text == "info") return LogLevel::kInfo;
  if (text == "debug") return LogLevel::kDebug;
  r.fail(path, "must be one of \"error\", \"warn\", \"info\", \"debug\", got \"" + text + "\"");
  return LogLevel::kWarn;
}

void read_transport(JsonReader& r, const Json& doc, const char* key, bool with_devices, TransportConfig* out,
                    std::string* fabric = nullptr, int* device = nullptr) {
  const Json* t = r.member(doc, "", key, false);
  if (!t) return;
  if (with_devices) {
    r.object(*t, key, {"transports", "devices"});
  } else {
    r.object(*t, key, {"fabric", "transports", "device", "pack_bytes", "pack_threshold"});
    *fabric = r.string(*t, key, "fabric", *fabric);
    if (r.ok() && *fabric != "cma" && *fabric != "ucx" && *fabric != "nccl") {
      r.fail(JsonReader::join(key, "fabric"), "must be \"cma\", \"ucx\" or \"nccl\", got \"" + *fabric + "\"");
    }
    *device = static_cast<int>(r.integer(*t, key, "device", -1, -1, 1024));
  }
  out->transports = r.strings(*t, key, "transports", out->transports);
  if (with_devices) out->devices = r.strings(*t, key, "devices", out->devices);
  if (r.ok() && out->transports.empty()) r.fail(JsonReader::join(key, "transports"), "must not be empty");
}

// The nccl fabric's packed fan-out (docs/refresh.md, "Packed fan-out"):
// "local": {"pack_bytes", "pack_threshold"}.
void read_pack(JsonReader& r, const Json& doc, AgentConfig* c) {
  const Json* t = r.member(doc, "", "local", false);
  if (!t || !r.ok()) return;
  c->local_pack_bytes = static_cast<uint64_t>(
      r.integer(*t, "local", "pack_bytes", static_cast<int64_t>(c->local_pack_bytes), 0, int64_t{1} << 40));
  c->local_pack_threshold = static_cast<uint64_t>(
      r.integer(*t, "local", "pack_threshold", static_cast<int64_t>(c->local_pack_threshold), 1, int64_t{1} << 40));
  if (r.ok() && c->local_pack_bytes != 0 && c->local_pack_bytes < fabric::kMinPackBytes) {
    r.fail("local.pack_bytes", "must be 0 (packing off) or at least " + std::to_string(fabric::kMinPackBytes) +
                                   ", got " + std::to_string(c->local_pack_bytes));
  }
}

// A source's "quantize" and "quantize_source_bytes": where a tensor
// quantized on the way is quantized (docs/conversion.md, "At the source"),
// and the memory the source's copies may hold.
void parse_quantize(const Json& doc, JsonReader& r, AgentConfig* c) {
  const std::string quantize = r.string(doc, "", "quantize", std::string("receiver"));
  if (r.ok() && quantize != "receiver" && quantize != "source") {
    r.fail("quantize", "must be \"receiver\" or \"source\", got \"" + quantize + "\"");
  }
  c->quantize_at_source = quantize == "source";
  c->quantize_source_bytes = static_cast<uint64_t>(
      r.integer(doc, "", "quantize_source_bytes", static_cast<int64_t>(c->quantize_source_bytes), 0, int64_t{1} << 40));
}

}  // namespace

Result<AgentConfig> parse_agent_config(std::string_view json_text, bool receiver) {
  Result<Json> parsed = parse_object(json_text, "config");
  if (!parsed.is_ok()) return parsed.status();
  const Json& doc = *parsed;
  JsonReader r("config");
  AgentConfig c;
  c.receiver = receiver;
  if (receiver) {
    r.object(doc, "", {"rank", "domain", "instance", "instance_ranks", "coordinator", "network", "local",
                       "window_bytes", "chunk_bytes", "landing_bytes", "gather_below_bytes", "gather_bytes",
                       "gather_entries", "max_plan_runs", "heartbeat_ms", "log_level", "log_format", "recipe", "mode", "verify",
                       "weight_block_size", "test", "trace"});
    c.trace = r.string(doc, "", "trace", std::string());
    const std::string mode = r.string(doc, "", "mode", std::string("direct"));
    if (r.ok() && mode != "direct" && mode != "staged") {
      r.fail("mode", "must be \"direct\" or \"staged\", got \"" + mode + "\"");
    }
    c.staged = mode == "staged";
  } else {
    r.object(doc, "", {"rank", "domain", "coordinator", "network", "heartbeat_ms", "log_level", "log_format",
                       "snapshot", "verify", "gather_reply_bytes", "quantize", "quantize_source_bytes", "test"});
    c.snapshot = r.boolean(doc, "", "snapshot", false);
    parse_quantize(doc, r, &c);
    // The memory a source holds for the gathers it serves (docs/refresh.md,
    // "Gathers"): at least 1 MiB.
    c.gather_reply_bytes = static_cast<uint64_t>(r.integer(doc, "", "gather_reply_bytes",
                                                           static_cast<int64_t>(c.gather_reply_bytes),
                                                           int64_t{1} << 20, int64_t{1} << 40));
  }
  c.verify = r.boolean(doc, "", "verify", false);
  constexpr int64_t kMaxRank = (1 << 20) - 1;  // the coordinator's limit
  c.rank = static_cast<int32_t>(r.integer(doc, "", "rank", std::nullopt, 0, kMaxRank));
  c.domain = static_cast<int32_t>(r.integer(doc, "", "domain", 0, 0, kMaxRank));
  if (receiver) c.instance = static_cast<int32_t>(r.integer(doc, "", "instance", 0, 0, kMaxRank));
  if (receiver) c.instance_ranks = static_cast<int32_t>(r.integer(doc, "", "instance_ranks", 0, 1, kMaxRank + 1));
  if (const Json* wb = receiver ? r.member(doc, "", "weight_block_size", false) : nullptr) {
    if (wb->is_array() && wb->size() == 2 && (*wb)[0].is_number_integer() && (*wb)[1].is_number_integer() &&
        (*wb)[0].get<int64_t>() >= 1 && (*wb)[1].get<int64_t>() >= 1 && (*wb)[0].get<int64_t>() <= (1 << 20) &&
        (*wb)[1].get<int64_t>() <= (1 << 20)) {
      c.weight_block_size = {(*wb)[0].get<int64_t>(), (*wb)[1].get<int64_t>()};
    } else {
      r.fail("weight_block_size", "must be [rows, cols], two integers from 1 to 1048576, got " + wb->dump());
    }
  }

  if (const Json* co = r.member(doc, "", "coordinator", true)) {
    r.object(*co, "coordinator", {"address", "token_file", "embedded", "timeout_ms", "metrics",
                                  "relayout_below_bytes", "relayout_staging_bytes"});
    const std::string address = r.string(*co, "coordinator", "address", std::nullopt);
    c.coordinator.token_file = r.string(*co, "coordinator", "token_file", std::nullopt);
    c.coordinator.embedded = r.boolean(*co, "coordinator", "embedded", false);
    c.coordinator.timeout =
        std::chrono::milliseconds(r.integer(*co, "coordinator", "timeout_ms", 10000, 1, 24ll * 3600 * 1000));
    c.coordinator.relayout_below_bytes =
        r.integer(*co, "coordinator", "relayout_below_bytes", 0, 0, int64_t{1} << 40);
    c.coordinator.relayout_staging_bytes =
        r.integer(*co, "coordinator", "relayout_staging_bytes", int64_t{1} << 30, 0, int64_t{1} << 50);
    if (r.ok() && !c.coordinator.embedded &&
        (co->contains("relayout_below_bytes") || co->contains("relayout_staging_bytes"))) {
      return Status::invalid(
          "config: \"coordinator.relayout_below_bytes\" and \"relayout_staging_bytes\" set the embedded "
          "coordinator's plans; they need \"coordinator.embedded\": true (a standalone coordinator takes "
          "refit-coordinator --relayout-below-bytes)");
    }
    if (r.ok()) {
      REFIT_RETURN_IF_ERROR(
          parse_host_port(address, "coordinator.address", &c.coordinator.host, &c.coordinator.port));
      if (c.coordinator.port == 0 && !c.coordinator.embedded) {
        return Status::invalid("config: \"coordinator.address\" needs a port other than 0 to connect to");
      }
    }
    if (const Json* m = r.member(*co, "coordinator", "metrics", false)) {
      r.object(*m, "coordinator.metrics", {"address", "token_file"});
      const std::string address = r.string(*m, "coordinator.metrics", "address", std::nullopt);
      c.coordinator.metrics_token_file = r.string(*m, "coordinator.metrics", "token_file", "");
      if (r.ok()) {
        if (!c.coordinator.embedded) {
          return Status::invalid(
              "config: \"coordinator.metrics\" serves the embedded coordinator's metrics; it needs "
              "\"coordinator.embedded\": true (a standalone coordinator takes refit-coordinator --metrics)");
        }
        REFIT_RETURN_IF_ERROR(parse_host_port(address, "coordinator.metrics.address", &c.coordinator.metrics_host,
                                              &c.coordinator.metrics_port));
      }
    }
  }
  read_transport(r, doc, "network", true, &c.network);
  if (receiver) {
    read_transport(r, doc, "local", false, &c.local, &c.local_fabric, &c.local_device);
    read_pack(r, doc, &c);
    if (r.ok() && c.verify && c.local_fabric == "nccl") {
      r.fail("verify", "hashes host memory; the \"nccl\" local fabric's buffers are GPU memory");
    }
    c.window_bytes = static_cast<uint64_t>(r.integer(doc, "", "window_bytes", static_cast<int64_t>(c.window_bytes), 4096));
    // Unset, the chunk is the default's, or the whole window if that is smaller.
    c.chunk_bytes = static_cast<uint64_t>(
        r.integer(doc, "", "chunk_bytes", static_cast<int64_t>(std::min(c.chunk_bytes, c.window_bytes)), 4096));
    if (r.ok() && c.chunk_bytes > c.window_bytes) {
      r.fail("chunk_bytes", "must not exceed \"window_bytes\" (" + std::to_string(c.window_bytes) + ")");
    }
    // By default 64 MiB, and at least two landing slots (config.h).
    const uint64_t slot = landing_slot_bytes(c);
    const int64_t landing_default = std::max<int64_t>(static_cast<int64_t>(c.landing_bytes), 2 * static_cast<int64_t>(slot));
    c.landing_bytes = static_cast<uint64_t>(r.integer(doc, "", "landing_bytes", landing_default, 8192, int64_t{1} << 40));
    if (r.ok() && c.landing_bytes < 2 * slot) {
      r.fail("landing_bytes", "must hold at least two landing slots (2 x " + std::to_string(slot) +
                                  ": \"chunk_bytes\", at most 4 MiB), got " + std::to_string(c.landing_bytes));
    }
    // Gathers (docs/refresh.md, "Gathers"); "gather_below_bytes": 0 turns them off.
    c.gather.below_bytes = r.integer(doc, "", "gather_below_bytes", c.gather.below_bytes, 0, int64_t{64} << 20);
    c.gather.enabled = c.gather.below_bytes > 0;
    // Unset, the default, or the whole window if that is smaller.
    c.gather.max_bytes = r.integer(doc, "", "gather_bytes",
                                   std::min<int64_t>(c.gather.max_bytes, static_cast<int64_t>(c.window_bytes)), 1,
                                   int64_t{64} << 20);
    c.gather.max_entries = r.integer(doc, "", "gather_entries", c.gather.max_entries, 2, kGatherEntriesMax);
    c.max_plan_runs = static_cast<uint64_t>(r.integer(doc, "", "max_plan_runs", static_cast<int64_t>(c.max_plan_runs),
                                                      1, static_cast<int64_t>(control::kMaxPlanRunsCeiling)));
    // A gather is one request, in flight as a whole.
    if (r.ok() && c.gather.enabled && static_cast<uint64_t>(c.gather.max_bytes) > c.window_bytes) {
      r.fail("gather_bytes", "must not exceed \"window_bytes\" (" + std::to_string(c.window_bytes) + "), got " +
                                 std::to_string(c.gather.max_bytes));
    }
    if (const Json* rc = r.member(doc, "", "recipe", false)) {
      r.object(*rc, "recipe", {"model", "framework", "tp", "pp", "dp", "expert_parallel", "gpus_per_domain"});
      RecipeConfig recipe;
      recipe.model = r.string(*rc, "recipe", "model", std::nullopt);
      recipe.framework = r.string(*rc, "recipe", "framework", std::string("vllm"));
      if (r.ok() && recipe.framework != "vllm") {
        r.fail("recipe.framework", "must be \"vllm\" (the only inference layout refit knows), got \"" +
                                       recipe.framework + "\"");
      }
      recipe.tp = r.integer(*rc, "recipe", "tp", 1, 1, 1 << 16);
      recipe.pp = r.integer(*rc, "recipe", "pp", 1, 1, 1 << 16);
      recipe.dp = r.integer(*rc, "recipe", "dp", 1, 1, 1 << 16);
      recipe.expert_parallel = r.boolean(*rc, "recipe", "expert_parallel", false);
      recipe.gpus_per_domain = r.integer(*rc, "recipe", "gpus_per_domain", 0, 1, 1 << 20);
      c.recipe = recipe;
    }
  }
  // Test-only switches (include/refit/refit.h, "test"): never for production.
  if (const Json* t = r.member(doc, "", "test", false)) {
    if (receiver) {
      r.object(*t, "test", {"force_landing_ring", "refuse_threads_after"});
      c.test.force_landing_ring = r.boolean(*t, "test", "force_landing_ring", false);
    } else {
      r.object(*t, "test", {"refuse_threads_after"});
    }
    c.test.refuse_threads_after = r.integer(*t, "test", "refuse_threads_after", -1, 0, 1 << 20);
  }
  c.heartbeat = std::chrono::milliseconds(r.integer(doc, "", "heartbeat_ms", 1000, 10, 3600 * 1000));
  const std::string log_format = r.string(doc, "", "log_format", std::string("text"));
  if (r.ok() && log_format != "text" && log_format != "json") {
    r.fail("log_format", "must be \"text\" or \"json\", got \"" + log_format + "\"");
  }
  c.log_format = log_format == "json" ? LogFormat::kJson : LogFormat::kText;
  if (r.member(doc, "", "log_level", false)) {
    c.log_level = level_from(r, r.string(doc, "", "log_level", std::nullopt), "log_level");
  }
  if (!r.ok()) return r.status();
  return c;
}

bool TransportConfig::has_rdma() const {
  for (const std::string& t : transports) {
    if (t == "ib" || t.starts_with("rc") || t.starts_with("dc")) return true;
  }
  return false;
}

}  // namespace refit::plugin
