#pragma once
// The request bodies a client sends after authenticating, parsed from their
// decoded CBOR into typed structs. Everything is untrusted: every field is
// type-checked, every integer range-checked, every string, list and blob
// bounded by MessageLimits. A refusal names the message, the key path and
// the problem: `register_source: tensors[2].size must be a non-negative
// integer, got "x"`. Nesting depth is bounded earlier, by the frame decoder.

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "planner/plan_epoch.h"
#include "planner/status.h"
#include "transport/control/frame_codec.h"

namespace refit::control {

struct MessageLimits {
  int32_t max_rank = 1 << 20;            // ranks, domains and instances lie in [0, max_rank)
  size_t max_name_bytes = 1024;          // tensor and buffer names
  size_t max_address_bytes = 4096;       // UCX worker addresses
  size_t max_rkey_bytes = 4096;          // packed rkeys
  size_t max_tensors = size_t{1} << 20;  // per source
  size_t max_buffers = size_t{1} << 16;  // per member
  size_t max_segments = size_t{1} << 20; // per member, all buffers
  size_t max_dims = 8;
  // Per plan part, its run groups expanded. An expanded run takes about 270
  // bytes of the receiver's memory once parsed (measured on Qwen3-235B's
  // largest part, refit_coordinator_plan_bench --parse-largest), and more
  // while it is compiled; its two buffer names are strings of their own, so
  // names near max_name_bytes make it about 2 KiB. A part of a few KiB can
  // ask for N times that. A receiver of Qwen3-235B at TP 8 in a 64-GPU domain
  // needs 6.4 million (docs/refresh.md, "The plan part"); receivers set their
  // own bound ("max_plan_runs"), up to kMaxPlanRunsCeiling. (Before run
  // groups the 64 MiB frame bound held a part to about 350,000 runs.)
  size_t max_runs = size_t{1} << 24;
  size_t max_peers = size_t{1} << 20;    // per plan part, each list
  size_t max_reason_bytes = 4096;        // an abort's reason
};

// The most a receiver's "max_plan_runs" may allow, and what the coordinator
// checks the parts it serves against: a receiver that allows fewer refuses
// a larger part itself, naming its setting.
inline constexpr size_t kMaxPlanRunsCeiling = size_t{1} << 26;

enum class Role : uint8_t { kSource, kReceiver };
const char* role_name(Role r);

// Registrations carry the member's part of a refit-layout/1 document
// (docs/formats.md, "Layout file", explicit form): the coordinator assembles the members' parts
// into one layout and plans it with the planner.

// A tensor as a source declares it: its global name, dtype and shape.
struct TensorDecl {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};

// One box of a tensor inside a buffer (refit-layout/1 segment). A buffer is
// bytes: the segment's elements are of its own dtype, "" for the buffer's.
struct Segment {
  std::string tensor;
  std::vector<int64_t> start;
  std::vector<int64_t> size;
  int64_t offset = 0;  // elements of the segment's dtype into the buffer
  std::vector<int64_t> strides;
  std::string dtype;  // "": the buffer's
  bool operator==(const Segment&) const = default;
};

// A registered buffer of the member's rank: what the planner needs, plus the
// address and packed rkey that peers need to GET from it.
struct MemberBuffer {
  std::string name;
  std::string dtype;
  int64_t bytes = 0;
  uint64_t address = 0;
  std::vector<uint8_t> rkey;
  std::vector<Segment> segments;
};

// The dtype of segment `s` of buffer `b`.
inline const std::string& segment_dtype(const MemberBuffer& b, const Segment& s) {
  return s.dtype.empty() ? b.dtype : s.dtype;
}

struct RegisterSource {
  int32_t rank = 0;
  int32_t domain = 0;
  std::vector<uint8_t> worker_address;
  std::vector<TensorDecl> tensors;
  std::vector<MemberBuffer> buffers;
};

struct RegisterReceiver {
  int32_t rank = 0;
  int32_t instance = 0;
  int32_t domain = 0;
  std::vector<uint8_t> worker_address;
  std::vector<MemberBuffer> buffers;
  // The declared number of ranks of the instance ("instance_ranks"); 0: not
  // declared (the registered ranks are the instance).
  int32_t instance_ranks = 0;
  // The F8_E4M3 quantization block (rows, cols) of the receiver's model
  // ("weight_block_size", docs/conversion.md); every receiver must agree.
  std::array<int64_t, 2> weight_block_size{128, 128};
};

struct MemberRef {  // unregister and heartbeat
  Role role = Role::kSource;
  int32_t rank = 0;
};

// Verification (docs/refresh.md, "Verification"): the XXH3-64 of one box of a tensor at
// a version, over the box's elements in row-major order, as the source rank
// that holds it computed it at publish.
struct BoxHash {
  int32_t rank = 0;  // the source rank that hashed it
  std::string tensor;
  std::vector<int64_t> start;
  std::vector<int64_t> size;
  uint64_t hash = 0;
  // "": the box as the sources hold it; else the dtype it was converted to
  // before hashing, as receivers of that dtype hold it (docs/conversion.md).
  std::string dtype;
};

struct PublishVersion {
  int64_t version = 0;
  std::vector<BoxHash> hashes;  // optional: the sources' hashes of version
};

// version_hashes: {rank, version}: what receiver `rank` checks its copy of
// `version` against.
struct VersionHashes {
  int32_t rank = 0;
  int64_t version = 0;
};

Result<RegisterSource> parse_register_source(const Json& body, const MessageLimits& limits);
Result<RegisterReceiver> parse_register_receiver(const Json& body, const MessageLimits& limits);
Result<MemberRef> parse_member_ref(const Json& body, const char* message, const MessageLimits& limits);
// publish_version {version, hashes?} and wait_drained {version}; `message`
// names which. hashes: [{rank, tensor, start, size, hash}], at most
// lim.max_segments of them.
Result<PublishVersion> parse_publish_version(const Json& body, const char* message = "publish_version",
                                             const MessageLimits& lim = MessageLimits{});
Result<VersionHashes> parse_version_hashes(const Json& body, const MessageLimits& lim);
struct StageReport {  // report_staged, report_failed, lease and release
  int32_t rank = 0;    // receiver rank
  int64_t version = 0;
  std::string reason;  // report_failed only
};
Result<StageReport> parse_stage_report(const Json& body, bool failed, const MessageLimits& limits,
                                       const char* message = nullptr);

// fetch_plan: {rank, epoch?} of a receiver. `epoch` is the membership epoch
// whose part the receiver already holds (0 or absent: none); when it is the
// current one the reply carries no runs and no peers, only {unchanged: true}.
struct FetchPlan {
  int32_t rank = 0;
  uint64_t have_epoch = 0;
};
Result<FetchPlan> parse_fetch_plan(const Json& body, const MessageLimits& limits);

// auth_response: {role: "source"|"receiver"|"any", nonce: 32 bytes, mac: 32
// bytes} (auth.h).
struct AuthResponse {
  AuthRole role = AuthRole::kAny;
  Nonce nonce{};
  Mac mac{};
};
Result<AuthResponse> parse_auth_response(const Json& body);

// The bodies, for clients and tests.
Json to_json(const RegisterSource& m);
Json to_json(const RegisterReceiver& m);
Json to_json(const MemberRef& m);
Json to_json(const BoxHash& h);

// ---- A receiver's refresh, for the coordinator's metrics -----------------
// refresh_summary {rank, version, event, mode, outcome, reason, seconds,
// network_bytes, local_bytes, retries}: what one refresh (or one staged
// commit) of receiver `rank` did, sent after it ended. The coordinator only
// counts it (fleet_metrics.h); it changes nothing of the membership.
// Every number is bounded and every name one of a fixed set, so that a
// peer cannot grow the metrics' label sets or poison their sums.
struct RefreshSummary {
  enum class Event : uint8_t { kRefresh, kCommit };
  enum class Outcome : uint8_t { kOk, kFailed, kAborted };
  int32_t rank = 0;
  int64_t version = 0;  // 0: it failed before a version was chosen
  Event event = Event::kRefresh;
  bool staged = false;  // "mode": "staged" (else "direct"); a commit is staged
  Outcome outcome = Outcome::kOk;  // a commit is ok or failed
  Reason reason = Reason::kNone;   // a failure's (planner/status.h); kNone otherwise
  double seconds = 0;  // refresh: the whole refresh; commit: the pause it took
  uint64_t network_bytes = 0, local_bytes = 0;
  uint32_t retries = 0;
};
inline constexpr double kMaxSummarySeconds = 1e7;  // 115 days
inline constexpr uint64_t kMaxSummaryBytes = uint64_t{1} << 60;
inline constexpr uint32_t kMaxSummaryRetries = 1000000;
const char* event_name(RefreshSummary::Event e);
const char* outcome_name(RefreshSummary::Outcome o);
Result<RefreshSummary> parse_refresh_summary(const Json& body, const MessageLimits& limits);
Json to_json(const RefreshSummary& m);

// ---- Leases that live as long as the refresh holding them ----------------
// lease {rank, version, renew?}: renew (bool, default false) extends the
// lease the rank already holds on `version` and is refused when it holds
// none (it expired or was revoked): the refresh holding it must then fail.
struct LeaseRequest {
  StageReport report;
  bool renew = false;
};
Result<LeaseRequest> parse_lease(const Json& body, const MessageLimits& limits);

// ---- The plan part a receiver executes (fetch_plan's reply) --------------
// The coordinator serializes it with to_json(), the receiver parses it with
// parse_plan_part(): one definition both ways. The receiver trusts the
// coordinator no more than any peer: every field is checked, and a
// refusal names the field (`plan: runs[3].from.side must be "source" or
// "receiver", got "x"`).

// One end of a run: a byte offset into a named buffer of a rank.
struct RunEnd {
  Role side = Role::kReceiver;  // "to" is always a receiver
  int32_t rank = 0;
  std::string buffer;
  uint64_t offset = 0;
  // "to" only: the receiver's conversion staging area instead of a buffer
  // ("stage": true, no "buffer"); `offset` is a byte offset there.
  bool stage = false;
};

// A conversion step of a receiver's part ("kind": "convert",
// docs/conversion.md): the box of `tensor` staged row-major in `from_dtype`
// at byte `stage` of the staging area is converted to `to_dtype` into
// `buffer` (element `offset` of box.start, element `strides` per dim) and,
// to F8_E4M3, its block scales go to `scale_buffer` (element
// `scale_offset` of the box's first block, `scale_strides`).
struct ConvertSpec {
  std::string tensor;
  std::string from_dtype;
  std::string to_dtype;
  std::array<int64_t, 2> block{128, 128};
  uint64_t stage = 0;
  std::vector<int64_t> start;
  std::vector<int64_t> size;
  std::string buffer;
  uint64_t offset = 0;
  std::vector<int64_t> strides;
  std::string scale_buffer;  // "": no scales (a cast)
  uint64_t scale_offset = 0;
  std::vector<int64_t> scale_strides;
};

// One run of the plan (refit-runs/1): a network GET of `bytes` from a
// source's buffer into this receiver's ("kind": "net"), or a local run
// between two receivers of a domain ("kind": "local"). On the wire an entry
// may stand for a group of runs ("count": n >= 2, "stride": [from_stride,
// to_stride], docs/refresh.md "The plan part"); the parser expands it, so
// a PlanRun is always one run.
struct PlanRun {
  bool network = false;
  RunEnd from;
  RunEnd to;
  uint64_t bytes = 0;
  // "kind": "convert": a conversion step; network, from, to and bytes are
  // unused.
  std::shared_ptr<const ConvertSpec> convert;
};

// A buffer of a peer that the runs name: where it is and its packed rkey
// (sources: for GETs; receivers: the local fabric's key).
struct PeerBuffer {
  std::string name;
  uint64_t address = 0;
  std::vector<uint8_t> rkey;
};

struct PlanPeer {
  int32_t rank = 0;
  std::vector<uint8_t> worker_address;
  std::vector<PeerBuffer> buffers;
};

// A receiver of the domain and its contact (a fabric that needs the whole
// domain, one NCCL communicator, builds it from these).
struct DomainContact {
  int32_t rank = 0;
  std::vector<uint8_t> worker_address;
};

struct PlanPeers {
  std::vector<PlanPeer> sources;
  std::vector<PlanPeer> receivers;
  std::vector<DomainContact> domain;  // in rank order, this rank included
};

// The whole plan's totals, for the receiver's report ("plan").
struct PlanTotals {
  int64_t network_bytes = 0;
  int64_t minimum_network_bytes = -1;  // -1: not given
  int64_t local_bytes = 0;
  bool solo = false;
};

struct PlanPart {
  int64_t version = 0;  // the latest published when the coordinator answered
  PlanEpoch epoch;
  // The receiver holds this epoch's part already: no runs, no peers.
  bool unchanged = false;
  PlanTotals totals;
  std::vector<PlanRun> runs;
  PlanPeers peers;
};

// fetch_plan's reply body ("ok": true and the part). At most lim.max_runs
// entries on the wire and lim.max_runs runs once its groups are expanded;
// a group's every run's offsets lie in [0, 2^63), computed without overflow.
// At most lim.max_buffers buffers per peer.
// `with_runs` false: the runs are neither parsed nor checked (their key
// must be there), for a receiver that only asks whether the part changed
// and whom it reads from.
Result<PlanPart> parse_plan_part(const Json& body, const MessageLimits& limits = MessageLimits{},
                                 bool with_runs = true);
// A list of runs alone (the coordinator's cached part), groups expanded.
Result<std::vector<PlanRun>> parse_plan_runs(const Json& runs, const MessageLimits& limits = MessageLimits{});
// The same checks and messages without the runs: how many there are once
// expanded (a receiver's part can have millions).
Result<size_t> check_plan_runs(const Json& runs, const MessageLimits& limits = MessageLimits{});
Result<PlanPeers> parse_plan_peers(const Json& peers, const MessageLimits& limits = MessageLimits{});
Result<PlanTotals> parse_plan_totals(const Json& totals);
// One entry per run: no groups (the receiver accepts either form).
Json to_json(const PlanPart& part);
Json to_json(const PlanRun& run);
Json to_json(const PlanPeers& peers);
Json to_json(const PlanTotals& totals);

// ---- Notices the coordinator sends a receiver ----------------------------
// version_notify {version}; commit {instance, version}; abort {instance,
// version, reason}.
struct VersionNotice {
  MsgType type = MsgType::kVersionNotify;
  int32_t instance = 0;  // commit, abort
  int64_t version = 0;
  std::string reason;    // abort
};
Result<VersionNotice> parse_notice(MsgType type, const Json& body, const MessageLimits& limits = MessageLimits{});
Json to_json(const VersionNotice& n);

}  // namespace refit::control
