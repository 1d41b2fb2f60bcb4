#pragma once
// What the coordinator knows: registered sources and receivers, the group
// version and who subscribed to it, the plan for the current
// membership, and each instance's commit barrier. Pure logic, no sockets:
// the coordinator calls it from its one I/O thread and sends the replies and
// the notices it queues; tests call it directly.
//
// Members are owned by the connection (session id) that registered them:
// only that connection may heartbeat, unregister or report for them. A
// connection that closes does not remove its members at once (it may be a
// network blip); a member silent for longer than the heartbeat timeout is
// declared dead by sweep() and its state removed. Counts are bounded by
// StateLimits and MessageLimits, so the state cannot grow without bound.
//
// The plan: registrations carry refit-layout/1 parts; plan_input() takes the
// document's head and shares the registrations (never the whole document:
// at a thousand ranks that is gigabytes of JSON), compute_plan() (a pure
// function, run on any thread) reads the layout from them one buffer at a
// time and plans it with make_plan, and install_plan() keeps the result
// until the membership changes (a register, an unregister or a death
// replans).
//
// Versions: a trainer group has several source ranks, each of which
// publishes version v once it has written its own shards. v is available to
// receivers only when every registered source has published it, so the
// group version is max(previous group version, min over the registered
// sources of the last version each published); it never goes back, and
// subscribers get a version_notify each time it advances (on a publish, or
// when the last source lagging behind leaves). A source that joins starts at
// 0 and so holds the group version until it has published a newer one.
//
// Commit barrier (docs/refresh.md, "Staged mode and the instance's
// commit"): each receiver rank of an instance
// reports "staged v"; when every rank of the instance has (all its declared
// "instance_ranks" registered, when it declares them), every one of them is
// sent commit v, and (instance, v) is committed: final. A failure report, or
// a rank of the instance leaving (or declared dead) while it or another rank
// staged v or held a lease on v, sends abort v to the others instead, unless
// v is already committed: the coordinator never sends abort for a committed
// version. A rank that reports staged v after an abort is sent abort v too;
// one that reports staged v, or withdraws (report_failed) from v, after v
// committed is told committed (committed()). A report of a newer version
// abandons an unfinished barrier of an older one (its ranks are sent abort).
// An instance that declares its size and lacks a rank is never committed:
// a rank missing aborts the version for that instance only.
//
// Leases (docs/refresh.md, "Leases"): a receiver rank leases the version it reads
// from the sources, at most one at a time, until it releases it, the lease
// expires (it is renewed while the refresh runs) or the rank leaves. A
// source asks wait_drained(v): it is told at once, or by a drained notice
// later, when no lease on v or older remains. From then on no lease on v or
// an older version is granted again (drained_through()): the sources may be
// overwriting its memory. One connection holds at most
// StateLimits::max_leases_per_connection leases.
//
// Thread safety: none; one thread (the coordinator's I/O thread) owns it.

#include <array>
#include <chrono>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <unordered_map>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/status.h"
#include "transport/control/frame_codec.h"
#include "transport/control/messages.h"

namespace refit::control {

using Clock = std::chrono::steady_clock;

// A membership's layout document, to be planned off the I/O thread.
// refit-layout/1 numbers each side's ranks 0..N-1, but members come and go
// and leave gaps: the document numbers the live members of each side densely
// in rank order, and the two lists map those positions back to the
// registered ranks (source_ranks[i] is the rank of the document's source i).
//
// The document is handed to the planner piece by piece and never held whole
// (a thousand ranks register millions of buffers; as one JSON text and its
// parse that took many times the memory of the plan): `layout_head` is the
// document without its buffers, and `members` each member's buffers, in the
// document's order (sources, then receivers, each by position). A whole
// document as text in `layout_json` is read instead (tests).
struct PlanInput {
  uint64_t epoch = 0;
  bool solo = false;  // every receiver in a domain of its own (ControlState::wants_solo)
  Json layout_head;
  struct MemberBuffers {
    bool source = false;
    int32_t position = 0;  // its rank in the document
    std::shared_ptr<const std::vector<MemberBuffer>> buffers;  // the registration's, shared
    // (buffer, segment) indexes left out of the document, ascending: the
    // segments of tensors the document lacks, and stale converted copies.
    std::vector<std::pair<uint32_t, uint32_t>> left_out;
  };
  std::vector<MemberBuffers> members;
  std::string layout_json;
  std::vector<int32_t> source_ranks;
  std::vector<int32_t> receiver_ranks;
  // PlanOptions::relayout_below_bytes and relayout_staging_bytes
  // (docs/refresh.md, "Column-major receivers"): 0, never.
  int64_t relayout_below_bytes = 0;
  int64_t relayout_staging_bytes = int64_t{1} << 30;
};

// The plan of one membership epoch, split per receiver rank: the runs each
// receiver executes, as refit-runs/1 entries (its network GETs and the local
// runs it sends or receives, in for_each_run order), consecutive runs at
// constant strides grouped into one entry ("count", "stride": docs/refresh.md,
// "The plan part"). Ranks, in the keys and
// in the runs' "from" and "to", are the registered ranks, not the layout
// document's dense positions. Immutable once made.
//
// Each rank's part is kept compact until a reply is built from it
// (PlannedParts::part): an entry is a run group or a conversion step, not
// a JSON tree. A tree cost about a kilobyte an entry; DeepSeek-V3's plan
// at 128+128 ranks has millions of entries (docs/operations.md, "The
// coordinator at scale").
struct PartEntry {
  Run run;                  // the group's first run; its ranks are the registered ones
  int64_t count = 1;        // its runs
  std::array<int64_t, 2> stride{};  // [from, to], once it has two runs
  int32_t step = -1;        // >= 0: a conversion step (PlannedPart::steps), not a run group
};
struct PlannedPart {
  std::vector<PartEntry> entries;
  std::vector<ConvertStep> steps;  // rank: the registered one
};
struct PlannedParts {
  uint64_t epoch = 0;
  bool solo = false;
  Status status;  // why planning failed, if it did
  std::map<int32_t, PlannedPart> parts;
  // What the entries name by index: the layout's buffers and, for the
  // conversion steps, its tensors' names and dtypes and its block size.
  std::vector<std::string> buffer_names;
  struct StepTensor {
    std::string name;
    DType from, to;
  };
  std::vector<StepTensor> tensors;  // by Layout::tensors index, only where a step names one
  std::array<int64_t, 2> weight_block_size{};
  // Receiver `rank`'s part as the fetch_plan message carries it
  // (refit-runs/1 entries; docs/refresh.md, "The plan part"): an empty list
  // when it has none.
  Json part(int32_t rank) const;
  // The whole plan's totals (PlanSummary), for the receivers' reports.
  int64_t network_bytes = 0;
  int64_t minimum_network_bytes = 0;
  int64_t local_bytes = 0;
};

// The contacts of a membership's members as a plan part's peers name them
// (ControlState::peers_of), copied out of the state so that a reply can be
// built on another thread. Registrations change the epoch, so a directory
// holds for the epoch it was taken in. Immutable once made.
struct PeerDirectory {
  struct Member {
    std::vector<uint8_t> worker_address;
    int32_t domain = 0;
    std::vector<PeerBuffer> buffers;  // in registration order
  };
  uint64_t epoch = 0;
  std::map<int32_t, Member> sources, receivers;
};

// What receiver `rank` needs to execute `runs` (ControlState::peers_of);
// `solo`: the rank is a domain of its own. Thread-safe.
Json peers_from(const PeerDirectory& directory, int32_t rank, bool solo, const Json& runs);

// Parses and plans `input`. Thread-safe: what it shares with the state (the
// registrations in input.members) is immutable.
std::shared_ptr<const PlannedParts> compute_plan(const PlanInput& input);

// The layout `input` describes, as compute_plan reads it (one buffer's JSON
// at a time), unchecked beyond what parse_layout_json checks. Thread-safe.
Result<Layout> membership_layout(const PlanInput& input);

struct StateLimits {
  size_t max_sources = 4096;
  size_t max_receivers = 65536;
  size_t max_subscribers = 65536;
  // Leases one connection may hold at once, over all the receiver ranks it
  // registered (each rank holds at most one: a new lease replaces its old
  // one). An agent holds one; the bound keeps one token holder from
  // pinning versions for many ranks and stalling the trainers' drains.
  size_t max_leases_per_connection = 16;
};

// A message for a session, queued by the state, sent by the coordinator.
struct Notice {
  uint64_t session = 0;
  MsgType type = MsgType::kVersionNotify;
  Json body;
};

class ControlState {
 public:
  ControlState(StateLimits limits, Clock::duration heartbeat_timeout);
  ~ControlState();

  Status register_source(uint64_t session, RegisterSource m, Clock::time_point now);
  // Refused, naming the buffer and the problem, when its segments cannot be
  // planned against the tensors the registered sources declare (a tensor no
  // source declares, a box outside the tensor, a dtype or rank that differs)
  // or when the instance's declared size ("instance_ranks") disagrees with
  // its other ranks' or is already reached. A receiver registered while no
  // source is, and one that a later source makes unplannable, is left out
  // of the plan (its fetch_plan fails, naming the problem); the other
  // members are planned without it.
  Status register_receiver(uint64_t session, RegisterReceiver m, Clock::time_point now);
  Status unregister(uint64_t session, const MemberRef& m);
  Status heartbeat(uint64_t session, const MemberRef& m, Clock::time_point now);
  // Records `version` for every source rank the connection registered; it
  // must exceed each one's last published version (else nothing changes).
  // Advances the group version, and notifies the subscribers, when every
  // registered source has now published a newer version.
  // `hashes` (verification, optional) are the sources' hashes of their
  // boxes of `version`: each must name one of the connection's source ranks
  // and lie inside one of its segments, and must agree with what another
  // source published for the same box of the same version (else the whole
  // publish is refused: two sources hold different contents for one version).
  Status publish(uint64_t session, int64_t version, std::vector<BoxHash> hashes = {});
  // Verification. What the connection's source ranks hash when they publish:
  // {boxes: [{rank, tensor, start, size}]}, each of their segments cut by
  // every registered receiver segment of its tensor, distinct per rank.
  // Also {convert: [{tensor, dtype, block}]}: the connection's sources'
  // tensors that receivers hold in another dtype (and their block), which a
  // source with "quantize": "source" converts at publish (docs/conversion.md).
  Result<Json> verify_boxes(uint64_t session) const;
  // What receiver `m.rank` checks its copy of `m.version` against: for each
  // of its segments, cut by every live source's segments of the tensor,
  // {hashes: [{buffer, segment, start, size, hash, rank}], unverified_bytes,
  // unverified: [{tensor, start, size}] (the first few boxes no source
  // hashed)}. buffer and segment index the receiver's registration.
  Result<Json> version_hashes(uint64_t session, const VersionHashes& m) const;
  Status subscribe(uint64_t session);
  // fetch_plan in steps, so that planning can run off the I/O thread:
  // check the request, then, if the cached plan is not current, plan
  // plan_input() and install the result; then read the part from the cache.
  //
  // Two plans of a membership: the domains' (shared: a slice crosses the
  // network once per domain and is passed on inside it), and the solo one,
  // where every receiver pulls all it needs itself. A rank gets the solo
  // part for a version that was being refreshed when the membership changed
  // or an instance aborted it (wants_solo): its peers may have finished that
  // version under the old plan, or stopped, and would never pass it the
  // slices a new shared plan routes through them. Newer versions get the
  // shared plan again.
  Status check_fetch(uint64_t session, int32_t rank) const;
  bool wants_solo(int32_t rank) const;
  bool plan_current(int32_t rank) const { return variant_current(wants_solo(rank)); }
  bool variant_current(bool solo) const {
    const auto& p = solo ? solo_plan_ : plan_;
    return p && p->epoch == epoch_;
  }
  PlanInput plan_input(bool solo = false) const;
  // Keeps `plan` if it is of the current membership; returns whether it did.
  bool install_plan(std::shared_ptr<const PlannedParts> plan);
  // REQUIRES: plan_current(rank). Fails when the membership could not be planned.
  Result<Json> cached_part(int32_t rank) const;
  // Whether cached_part(rank) succeeds, without building the part (parts of
  // cluster scale are megabytes of JSON).
  Status cached_part_status(int32_t rank) const;
  // REQUIRES: plan_current(rank). The plan's totals, as a fetch_plan reply carries them.
  Json plan_totals(int32_t rank) const;
  // The epoch a fetch_plan reply names for `rank`'s part: the membership
  // epoch, with kSoloEpochBit set for a solo part.
  uint64_t plan_epoch(int32_t rank) const { return wants_solo(rank) ? epoch_ | kSoloEpochBit : epoch_; }
  static constexpr uint64_t kSoloEpochBit = PlanEpoch::kWireSoloBit;
  // What a receiver needs to execute `runs` (a cached_part): the worker
  // address of every other rank the runs name, and the address and packed
  // rkey of every buffer of theirs they name; and every receiver of its
  // domain with its worker address ("domain", in rank order). Only ever sent to an
  // authenticated connection that owns the receiver.
  Json peers_of(int32_t rank, const Json& runs) const;
  // The members' contacts in this epoch, for peers_from() on another thread.
  std::shared_ptr<const PeerDirectory> peer_directory() const;
  // REQUIRES: plan_current(rank). The plan `rank`'s part is cut from (the
  // shared or the solo one), to read on another thread: it is immutable.
  std::shared_ptr<const PlannedParts> plan_of(int32_t rank) const { return variant_plan(wants_solo(rank)); }
  // The shared or the solo plan installed last, of whatever epoch (null: none yet).
  std::shared_ptr<const PlannedParts> variant_plan(bool solo) const { return solo ? solo_plan_ : plan_; }
  // All of the above on the calling thread.
  Result<Json> plan_part(uint64_t session, int32_t rank);
  Status report_staged(uint64_t session, const StageReport& m);
  Status report_failed(uint64_t session, const StageReport& m);
  // `m.reason` is unused for leases. Refused (not_found) for a version that
  // was drained (drained_through()); refused while the rank's instance lacks
  // a declared rank (instance_complete()), and (invalid, naming the limit)
  // when the session already holds max_leases_per_connection leases for its
  // other ranks. renew: extends the lease the rank holds on m.version,
  // refused (not_found) when it holds none.
  Status lease(uint64_t session, const StageReport& m, Clock::time_point now, bool renew = false);
  Clock::duration lease_timeout() const { return lease_timeout_; }
  // The newest version a wait_drained answered drained: no lease on it or
  // an older one is granted again.
  int64_t drained_through() const { return drained_through_; }
  // Whether the instance of receiver `rank` committed `version` (or newer).
  bool committed(int32_t rank, int64_t version) const;
  // Whether every declared rank of the instance is registered (true when it
  // declares no size).
  bool instance_complete(int32_t instance) const;
  // Marks every member the session registered as seen now, and renews their
  // leases: the coordinator holds the session's requests (planning) and so
  // does not read its heartbeats or lease renewals.
  void touch_session(uint64_t session, Clock::time_point now);
  Status release(uint64_t session, const StageReport& m);
  // True when version v is drained now; otherwise the session gets a
  // drained notice when it is.
  Result<bool> wait_drained(uint64_t session, int64_t version);
  void set_lease_timeout(Clock::duration d) { lease_timeout_ = d; }
  // The relayout knobs every plan is made with (PlanInput).
  void set_relayout(int64_t below_bytes, int64_t staging_bytes) {
    relayout_below_bytes_ = below_bytes;
    relayout_staging_bytes_ = staging_bytes;
  }
  // Forgets the session's subscription. Its members stay, with their
  // leases, until they time out. Until then, the same registration of such
  // a rank on a new connection (the member, its connection made again)
  // takes it over: owned by that connection from then on, nothing else
  // changed. Another registration of the rank (a new process) replaces it
  // at once, as if it had timed out.
  void session_closed(uint64_t session);
  // Removes members silent for longer than the heartbeat timeout; returns one
  // line per member removed, naming it and its silence.
  std::vector<std::string> sweep(Clock::time_point now);
  // Notices queued since the last call.
  std::vector<Notice> take_notices() { return std::move(notices_); }

  // The refit-layout/1 document of the current membership, each side's
  // ranks numbered densely in rank order (PlanInput says how), whole: for
  // tests and diagnostics; planning reads it piece by piece (layout_pieces).
  Json layout_document(bool solo = false) const;
  // The document's head, the members' buffers and the planned receivers
  // (receiver_ranks), into `in`.
  void layout_pieces(bool solo, PlanInput* in) const;
  // Whether a source's segment is a converted copy (or its scales) made for
  // what the planned receivers no longer hold: another dtype, or another
  // block than `block` ("quantize": "source", docs/conversion.md).
  using CopyFilter = std::function<bool(const MemberBuffer&, const Segment&)>;
  // `planned`: planned_receivers(), worked out once by the caller.
  CopyFilter stale_copies(const std::array<int64_t, 2>& block, const std::vector<int32_t>& planned) const;

  size_t num_sources() const { return sources_.size(); }
  size_t num_receivers() const { return receivers_.size(); }
  // The group version: the newest version every registered source published.
  int64_t version() const { return version_; }
  // The membership epoch: bumped by every register, unregister and death.
  uint64_t epoch() const { return epoch_; }
  uint64_t plans_made() const { return plans_made_; }
  // How many times a receiver's buffers were checked against the declared
  // tensors (in full at registration, or again before a plan or a fetch):
  // the receivers of one declaration share one check of each kind per
  // generation of the declared tensors.
  uint64_t receiver_checks() const { return receiver_checks_; }
  // Receiver ranks that hold a lease now.
  size_t num_leases() const { return leases_.size(); }
  bool has_source(int32_t rank) const { return sources_.count(rank) != 0; }
  bool has_receiver(int32_t rank) const { return receivers_.count(rank) != 0; }
  // The instance of receiver `rank`, which `session` must have registered
  // (refused otherwise, naming `message`).
  Result<int32_t> receiver_instance(uint64_t session, int32_t rank, const char* message) const;
  // The instances that have a registered receiver.
  std::set<int32_t> instances() const;

 private:
  template <typename T>
  struct Member {
    uint64_t session = 0;  // 0: its connection closed (session_closed)
    Clock::time_point last_seen;
    // Immutable once registered (a new registration replaces it): a plan
    // being made off the I/O thread reads the members' buffers through it.
    std::shared_ptr<const T> info;
    int64_t published = 0;  // sources only: the last version it published
    // Receivers only. The replicas of one shard register the same buffers
    // and segments: `declaration` numbers what a registration declares
    // (receivers with one number declare the same, compared whole at
    // registration), and `fingerprint` is its hash
    // (declaration_fingerprint). The checks of a registration read nothing
    // else but the declared tensors, so a pass holds for every receiver of
    // the declaration until the tensors change (decls_generation_):
    // `checked_at` is the generation at which plannable(..., false) last
    // passed, `fully_checked_at` the one at which the registration's full
    // check passed (0: never).
    uint64_t declaration = 0;
    uint64_t fingerprint = 0;
    mutable uint64_t checked_at = 0;
    uint64_t fully_checked_at = 0;
  };
  struct Barrier {
    int64_t version = 0;
    std::set<int32_t> staged;
  };

  // The same registration of a rank already held: taken over when its
  // connection closed, refused while it is open. OK when `session` now owns
  // the member.
  template <typename T>
  Status registered_again(const char* message, std::map<int32_t, Member<T>>& members, Role role, uint64_t session,
                          const T& m, Clock::time_point now);
  template <typename T>
  Status owned(const char* message, const std::map<int32_t, Member<T>>& members, Role role,
               int32_t rank, uint64_t session) const;
  // `why` completes "source rank R ..." (e.g. "was declared dead"): what a
  // receiver that needs a tensor no live source holds any more is told.
  void remove_source(int32_t rank, const std::string& why);
  void remove_receiver(int32_t rank, const std::string& why);
  void abort_instance(int32_t instance, int64_t version, const std::string& reason);
  std::vector<int32_t> instance_ranks(int32_t instance) const;
  bool drained(int64_t version) const;
  void notify_drained();
  // Whether receiver `rank` can be planned against the declared tensors;
  // `full` adds the planner's own checks of its buffers (at registration).
  Status plannable(int32_t rank, const RegisterReceiver& m, bool full) const;
  // plannable(rank, *r.info, false), skipped where it passed at this
  // generation of the declared tensors, for this receiver or for one
  // registered with the same declaration (passed_as).
  Status still_plannable(int32_t rank, const Member<RegisterReceiver>& r) const;
  // Whether a registered receiver of `declaration` passed its checks at
  // this generation: the full check of a registration when `full`, else
  // plannable(..., false).
  bool passed_as(uint64_t declaration, bool full) const;
  // A registered receiver that declares what `m` declares (its
  // declaration_fingerprint `fingerprint`, then compared whole), or nullptr.
  const Member<RegisterReceiver>* declared_alike(const RegisterReceiver& m, uint64_t fingerprint) const;
  // Refuses a receiver whose "weight_block_size" differs from another
  // registered receiver's.
  Status same_block(int32_t rank, const RegisterReceiver& m) const;
  // The declaration of `tensor`: a source's, or a block scale tensor
  // "<W>_scale_inv" of a declared weight W, F32 with one value per block.
  std::optional<TensorDecl> decl_of(const std::string& tensor, const std::array<int64_t, 2>& block) const;
  // The same without a copy: the declaration, or a derived one made in
  // *scratch; nullptr when none.
  const TensorDecl* find_decl(const std::string& tensor, const std::array<int64_t, 2>& block,
                              TensorDecl* scratch) const;
  // Whether a source's segment is a copy it converted ("quantize": "source",
  // docs/conversion.md): a tensor the sources did not declare (block scales)
  // or of another dtype than declared. Planned from, never hashed.
  bool converted_copy(const MemberBuffer& b, const Segment& seg) const;
  // The receivers the plan includes: the plannable ones, in rank order.
  std::vector<int32_t> planned_receivers() const;
  std::string instance_shortfall(int32_t instance) const;
  // Raises version_ to the lowest version the sources published, if higher,
  // and queues a version_notify for every subscriber when it does.
  void advance_version();

  StateLimits limits_;
  Clock::duration heartbeat_timeout_;
  std::map<int32_t, Member<RegisterSource>> sources_;
  std::map<int32_t, Member<RegisterReceiver>> receivers_;
  // Hashes a tensor name, for the maps below that a registration looks up
  // once per segment.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  // The dtype the registered receivers hold each tensor in (the first
  // one's), and how many segments of their declarations name it (each
  // declaration counted once, however many receivers make it): a receiver
  // holding a tensor in another dtype is refused at registration
  // (docs/conversion.md, "What converts"), not found when planning, where
  // it would fail every member's plan. By name, hashed.
  struct HeldDtype {
    std::string dtype;
    size_t segments = 0;
  };
  std::unordered_map<std::string, HeldDtype, NameHash, std::equal_to<>> receiver_dtypes_;
  // Adds (or takes away) the segments of `m`'s declaration, the first of
  // its receivers to register (or the last to go), to receiver_dtypes_.
  void count_receiver_dtypes(const RegisterReceiver& m, bool add);
  // A registered receiver that holds `tensor` as `dtype` (for messages),
  // or -1.
  int32_t holder(const std::string& tensor, const std::string& dtype) const;
  // The registered receivers of each declaration (Member::declaration).
  std::unordered_map<uint64_t, size_t> declaration_members_;
  uint64_t next_declaration_ = 1;
  // Refuses a receiver that holds a tensor in another dtype than the
  // registered receivers, naming both ranks.
  Status one_dtype(int32_t rank, const RegisterReceiver& m) const;
  // Tensors declared by sources: the declaration, how many sources made it,
  // and the order of first declaration (the layout lists tensors in it, and
  // the plan's run order follows the layout's tensor order).
  struct Declared {
    TensorDecl decl;
    int sources = 0;
    uint64_t order = 0;
  };
  // By name, hashed: a registration looks up each of its segments'
  // tensors (millions at cluster scale); ordered where it matters by
  // `order`.
  std::unordered_map<std::string, Declared, NameHash, std::equal_to<>> tensors_;
  // Bumped whenever a tensor is declared for the first time or loses its
  // last source: a receiver's checks that passed at one generation pass at
  // it again (Member::checked_at). Starts at 1 (0 is "never checked").
  uint64_t decls_generation_ = 1;
  // Tensors whose every source is gone, each with the last one to go and
  // why, until a source declares them again; at most kMaxOrphans (the
  // oldest names are not kept past it).
  static constexpr size_t kMaxOrphans = 1 << 16;
  std::map<std::string, std::string> orphaned_;
  uint64_t next_tensor_order_ = 0;
  std::set<uint64_t> subscribers_;
  std::map<int32_t, Barrier> barriers_;  // by instance
  // The last version each instance aborted: a rank that reports it staged
  // afterwards (it had not heard yet) gets the abort, not a new barrier.
  std::map<int32_t, int64_t> aborted_;
  // The last version each instance committed: final, never aborted.
  std::map<int32_t, int64_t> committed_;
  int64_t drained_through_ = 0;
  std::vector<Notice> notices_;
  struct Lease {
    int64_t version = 0;
    Clock::time_point expires;
  };
  std::map<int32_t, Lease> leases_;  // by receiver rank
  std::map<int64_t, std::set<uint64_t>> drain_waiters_;  // by version
  size_t num_drain_waiters_ = 0;
  Clock::duration lease_timeout_ = std::chrono::seconds(60);
  int64_t relayout_below_bytes_ = 0;
  int64_t relayout_staging_bytes_ = int64_t{1} << 30;
  int64_t version_ = 0;  // the group version
  uint64_t epoch_ = 0;  // bumped on every membership change
  std::shared_ptr<const PlannedParts> plan_;
  std::shared_ptr<const PlannedParts> solo_plan_;
  // Leases of versions up to this one get solo parts (wants_solo): the
  // newest version leased when the membership last changed, or the newest
  // an instance aborted.
  int64_t solo_version_ = 0;
  int64_t leased_version_ = 0;  // the newest version any receiver leased
  void membership_changed() {
    ++epoch_;
    solo_version_ = std::max(solo_version_, leased_version_);
  }
  uint64_t plans_made_ = 0;
  mutable uint64_t receiver_checks_ = 0;  // plannable()'s runs
  // Verification: per version, box key (box_key()) -> its hash and the
  // source rank that published it. Versions no receiver can still read are
  // dropped (prune_hashes()).
  struct Hashed {
    uint64_t hash = 0;
    int32_t rank = 0;
  };
  std::map<int64_t, std::map<std::string, Hashed>> hashes_;
  void prune_hashes();
  // version_hashes for `want`, segment `si` of buffer `bi` of a receiver,
  // of a block scale tensor "<W>_scale_inv": the scales of each box of W
  // the receiver checks (its F8_E4M3 segments of W, `quantized`, cut by
  // the sources' segments, `held`), cut by `want`; a box of whole blocks
  // has the hashes its source published in `known` (verify_boxes), the
  // rest are unverified.
  void scale_hashes(const Segment& want, size_t bi, size_t si, const std::array<int64_t, 2>& block,
                    const std::map<std::string, std::vector<const Segment*>>& quantized,
                    const std::map<std::string, std::vector<const Segment*>>& held,
                    const std::map<std::string, Hashed>& known, Json* hashes, int64_t* unverified_bytes,
                    Json* unverified) const;
};

}  // namespace refit::control
