#pragma once
// The agents' JSON configuration (the keys are documented in
// include/refit/refit.h). Parsing is strict: an unknown key, a wrong type or
// a value out of range is an error that names the key path, e.g.
// `config: "coordinator.timeout_ms" must be an integer >= 1, got "5s"`.

#include <algorithm>
#include <chrono>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "planner/gather.h"
#include "planner/status.h"
#include "transport/control/messages.h"
#include "transport/fabric/pack.h"

namespace refit::plugin {

enum class LogLevel { kError, kWarn, kInfo, kDebug };
enum class LogFormat { kText, kJson };

struct CoordinatorEndpoint {
  std::string host;
  uint16_t port = 0;
  std::string token_file;
  bool embedded = false;
  std::chrono::milliseconds timeout{10000};
  // The embedded coordinator's Prometheus endpoint ("coordinator.metrics",
  // docs/operations.md): empty metrics_host: none. metrics_port 0: any free port.
  std::string metrics_host;
  uint16_t metrics_port = 0;
  std::string metrics_token_file;  // empty: scrapes need no bearer token
  // The embedded coordinator's relayout knobs ("coordinator.relayout_below_bytes",
  // "coordinator.relayout_staging_bytes"; docs/refresh.md, "Column-major
  // receivers"): 0, the default, never relayouts.
  int64_t relayout_below_bytes = 0;
  int64_t relayout_staging_bytes = int64_t{1} << 30;
};

struct TransportConfig {
  std::vector<std::string> transports;
  std::vector<std::string> devices;
  // Whether one of `transports` has RDMA reads (UCX's rc and dc families,
  // or "ib"), which a CUDA-aware UCX points at GPU memory. tcp, shared
  // memory and ud (no RDMA read) have none: refit's own GETs over them copy
  // with the CPU (transport/ucx/am_rma.h), so GPU memory goes through host
  // memory there (a receiver's landing ring). "all" counts as none: it may
  // leave an endpoint with tcp only.
  bool has_rdma() const;
};

struct RecipeConfig {
  std::string model;  // manifest path
  std::string framework = "vllm";
  int64_t tp = 1, pp = 1, dp = 1;
  bool expert_parallel = false;
  int64_t gpus_per_domain = 0;  // 0: tp*pp*dp
};

// Test-only switches of an agent ("test" in its config): tests inject what
// the library cannot be made to do on demand. Never for production.
struct TestSwitches {
  bool force_landing_ring = false;    // receivers: host buffers take the GPU path's landing ring and copies
  int64_t refuse_threads_after = -1;  // >= 0: the agent starts that many threads, then is refused
};

struct AgentConfig {
  bool receiver = false;
  int32_t rank = 0;
  int32_t domain = 0;
  int32_t instance = 0;  // receivers
  int32_t instance_ranks = 0;  // receivers: the instance's declared size; 0: not declared
  // Receivers: the F8_E4M3 block of the model's quantization_config
  // (docs/conversion.md); every receiver of the membership must agree.
  std::array<int64_t, 2> weight_block_size{128, 128};
  CoordinatorEndpoint coordinator;
  TransportConfig network{{"tcp"}, {}};
  TransportConfig local{{"shm"}, {}};  // receivers: the UCX fabric's transports
  std::string local_fabric = "cma";    // receivers: "cma", "ucx" or "nccl"
  int local_device = -1;               // receivers, "nccl": the CUDA device; -1: the current one
  // Receivers, "nccl": the packed fan-out's two areas of device memory
  // (0: off) and the size from which a send goes unpacked
  // (transport/fabric/pack.h). Every rank of a domain the same.
  uint64_t local_pack_bytes = fabric::kDefaultPackBytes;
  uint64_t local_pack_threshold = fabric::kDefaultPackThreshold;
  // Receivers: GET bytes in flight, and the largest plain GET (a gather is
  // one request of up to its "gather_bytes"; docs/refresh.md, "Gathers").
  uint64_t window_bytes = 64ull << 20;
  uint64_t chunk_bytes = 1ull << 20;
  uint64_t landing_bytes = 64ull << 20;  // receivers: the landing ring (transport/cuda/staging.h)
  // Receivers: the most runs a plan part may expand to (MessageLimits::max_runs).
  uint64_t max_plan_runs = control::MessageLimits{}.max_runs;
  GatherOptions gather;                  // receivers: small runs in gathers (planner/gather.h)
  // Sources: the most memory held for the replies of the gathers served
  // (transport/ucx/am_rma.h); more waits, and a larger gather is refused.
  uint64_t gather_reply_bytes = 256ull << 20;
  // Sources: "quantize": "source" (docs/conversion.md, "At the source"):
  // at publish, quantize (or cast) the whole blocks of the segments whose
  // receivers hold another dtype, into copies of at most
  // quantize_source_bytes (copies and scales) that the network then carries.
  bool quantize_at_source = false;
  uint64_t quantize_source_bytes = 1ull << 30;
  std::chrono::milliseconds heartbeat{1000};
  LogLevel log_level = LogLevel::kWarn;
  LogFormat log_format = LogFormat::kText;
  std::optional<RecipeConfig> recipe;
  bool staged = false;    // receivers: "mode": "staged" (else "direct")
  bool snapshot = false;  // sources: copy the shards at publish
  bool verify = false;    // sources: hash at publish; receivers: check after each refresh (plugin/verify.h)
  TestSwitches test;      // receivers
  std::string trace;      // receivers: the Chrome trace file (plugin/trace.h); empty: none
};

// A landing slot of the ring (transport/cuda/staging.h) is one GET: a
// transfer chunk, but at most kMaxLandingSlotBytes, so that the default ring
// has 16 slots in which the copies to the GPU overlap the next GETs, with
// chunks as large as the network wants. A 4 MiB GET costs its per-request
// overhead (about a microsecond) on 4 MiB of wire time.
constexpr uint64_t kMaxLandingSlotBytes = 4ull << 20;
inline uint64_t landing_slot_bytes(const AgentConfig& c) { return std::min(c.chunk_bytes, kMaxLandingSlotBytes); }

// Parses a source's (receiver = false) or a receiver's config document.
Result<AgentConfig> parse_agent_config(std::string_view json_text, bool receiver);

// "HOST:PORT" (HOST may be a name, an IPv4 address or [IPv6]).
Status parse_host_port(const std::string& text, const std::string& key, std::string* host, uint16_t* port);

}  // namespace refit::plugin
