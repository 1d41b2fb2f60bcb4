#include "plugin/receiver/refresh_session.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "planner/dtype.h"
#include "plugin/verify.h"

namespace refit::plugin::receiver {

using control::Json;
using control::MsgType;

namespace {

// Between tries of a lease while a rank of the instance has not joined.
constexpr std::chrono::milliseconds kRetryPause{200};
// How long past the deadline a failed refresh may take to release its
// lease (else the sources wait for the lease to expire before they may
// overwrite the version).
constexpr std::chrono::milliseconds kReleaseGrace{500};
// Staged mode: the slice of the wait for the instance's word, to notice at
// once when the coordinator declared this rank dead.
constexpr std::chrono::milliseconds kBarrierSlice{100};

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Renews a lease while the refresh that holds it runs (docs/refresh.md,
// "Leases"): three times per lease timeout, on a thread of its own, so that
// a refresh of any length keeps it. If a renewal is refused (the lease
// expired or was revoked: the sources may be overwriting the version), it
// stops and lost() says why; the refresh then fails. A renewal ends by the
// refresh's deadline, so that stop() waits for none past it (the library's
// bound on a failing refresh counts no renewal).
class LeaseKeeper {
 public:
  LeaseKeeper(CoordinatorLink& link, Json lease, std::chrono::milliseconds timeout, Clock::time_point deadline)
      : link_(link),
        lease_(std::move(lease)),
        period_(std::max(timeout / 3, std::chrono::milliseconds(10))),
        deadline_(deadline) {
    lease_["renew"] = true;
  }
  ~LeaseKeeper() { stop(); }
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  Status start(const ThreadFactory& threads) {
    // A renewal that throws loses the lease: the refresh fails.
    Result<std::thread> t = threads.start("lease renewal", [this] { run(); }, [this](const Status& why) {
      std::lock_guard<std::mutex> lock(mu_);
      lost_ = why;
    });
    if (!t.is_ok()) return t.status();
    thread_ = std::move(t).value();
    return Status::ok();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Why the lease was lost; ok while it holds. Call after stop().
  const Status& lost() const { return lost_; }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
      lock.unlock();
      Result<Json> r = link_.request(MsgType::kLease, lease_, deadline_);
      lock.lock();
      // A refusal is final; a connection that failed may recover before
      // the lease expires, and the release at the end tells either way.
      if (!r.is_ok() && r.status().code() == Code::kNotFound) {
        lost_ = r.status();
        return;
      }
    }
  }

  CoordinatorLink& link_;
  Json lease_;
  const std::chrono::milliseconds period_;
  const Clock::time_point deadline_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  Status lost_;        // written by the thread, read after stop()
  std::thread thread_;
};

}  // namespace

RefreshSession::RefreshSession(CoordinatorLink& link, const AgentConfig& config, const Log& log,
                               Resources& resources, const ThreadFactory& threads,
                               std::function<void(ReceiverState)> enter, Trace* trace, Progress* progress)
    : link_(link),
      config_(config),
      log_(log),
      resources_(resources),
      threads_(threads),
      enter_(std::move(enter)),
      trace_(trace),
      progress_(progress) {}

bool RefreshSession::retryable(const Status& st) {
  switch (st.reason()) {
    case Reason::kPeerLost:
    case Reason::kStaleMembership:
    case Reason::kNotRegistered: return true;  // the next attempt registers again first
    case Reason::kNone: return st.code() == Code::kIoError;  // the network or the coordinator connection
    default: return false;
  }
}

Status RefreshSession::attempt(int64_t requested, Clock::time_point deadline,
                               std::shared_ptr<const CompiledPart>* compiled, RefreshReport* report) {
  const Clock::time_point t0 = Clock::now();
  TraceSpan lease_span(trace_, "lease");
  Result<Lease> leased = lease(requested, deadline);
  lease_span.arg("ok", leased.is_ok());
  if (leased.is_ok()) lease_span.arg("version", leased->version);
  lease_span.end();
  if (!leased.is_ok()) return leased.status();
  const int64_t version = leased->version;
  log_.set_version(version);
  report->version = version;
  enter_(ReceiverState::kLeased);
  const Json body{{"rank", config_.rank}, {"version", version}};
  LeaseKeeper keeper(link_, body, leased->timeout, deadline);
  Status st = keeper.start(threads_);
  if (st.is_ok()) {
    TraceSpan span(trace_, "fetch_plan");
    st = fetch_plan(deadline, compiled);
    span.arg("ok", st.is_ok());
  }
  report->plan_s = seconds_between(t0, Clock::now());
  if (log_.enabled(LogLevel::kDebug)) {
    log_.debug("refresh to " + std::to_string(version) + ": plan after " + std::to_string(report->plan_s) + " s");
  }
  if (st.is_ok()) st = transfer(**compiled, version, deadline, report);
  if (st.is_ok()) enter_(ReceiverState::kLanded);
  if (st.is_ok() && config_.verify) {
    TraceSpan span(trace_, "verify");
    st = verify(version, deadline, report);
    span.arg("ok", st.is_ok());
  }
  keeper.stop();
  Result<Json> released =
      link_.request(MsgType::kRelease, body, std::max(deadline, Clock::now()) + kReleaseGrace);
  const bool lost = !keeper.lost().is_ok() || (!released.is_ok() && released.status().code() == Code::kNotFound);
  if (lost && st.is_ok()) {
    // The sources may have overwrote what this refresh read.
    const std::string why = keeper.lost().is_ok() ? released.status().message() : keeper.lost().message();
    return Status::io_error("the lease on version " + std::to_string(version) +
                            " was lost during the refresh, so what it read cannot be trusted: " + why)
        .with_reason(Reason::kLeaseLost);
  }
  if (st.is_ok() && !released.is_ok()) {
    return released.status().with_context("the lease on version " + std::to_string(version) +
                                          " could not be released");
  }
  return st;
}

// Waits until `want` (or a newer version) is published; `latest` is the
// newest known.
Status RefreshSession::wait_for_version(int64_t want, int64_t requested, const std::string& drained,
                                        Clock::time_point deadline, int64_t* latest) {
  while (*latest < want) {
    Result<std::optional<Json>> n = link_.wait_notice(MsgType::kVersionNotify, deadline);
    if (!n.is_ok()) return n.status();
    if (n->has_value()) {
      Result<control::VersionNotice> notice = control::parse_notice(MsgType::kVersionNotify, **n);
      if (!notice.is_ok()) return notice.status().with_context("from the coordinator");
      *latest = std::max(*latest, notice->version);
      continue;
    }
    if (!drained.empty()) {
      return Status::timeout("no version newer than " + std::to_string(*latest) +
                             " was published before the deadline, and that one can no longer be read: " + drained);
    }
    return Status::timeout(requested == -1 ? std::string("no version was published before the deadline")
                                           : "version " + std::to_string(requested) +
                                                 " was not published before the deadline (the latest is " +
                                                 std::to_string(*latest) + ")");
  }
  return Status::ok();
}

// The version: the group's latest (-1) or the one asked for, once it is
// published; then its lease.
Result<RefreshSession::Lease> RefreshSession::lease(int64_t requested, Clock::time_point deadline) {
  Result<Json> sub = link_.request(MsgType::kSubscribe, Json::object(), deadline);
  if (!sub.is_ok()) return sub.status();
  int64_t latest = sub->value("version", int64_t{0});
  int64_t want = requested == -1 ? 1 : requested;
  std::string drained;  // -1: why the latest known version was passed over
  while (true) {
    REFIT_RETURN_IF_ERROR(wait_for_version(want, requested, drained, deadline, &latest));
    const int64_t version = requested == -1 ? latest : requested;
    if (version < latest) {
      return Status::not_found("version " + std::to_string(version) + " is older than " + std::to_string(latest) +
                               ", the latest published: the sources hold only the latest");
    }
    enter_(ReceiverState::kVersionKnown);
    Result<Json> leased = link_.request(MsgType::kLease, Json{{"rank", config_.rank}, {"version", version}}, deadline);
    if (leased.is_ok()) {
      return Lease{version, std::chrono::milliseconds(leased->value("timeout_ms", int64_t{60000}))};
    }
    const Status& refused = leased.status();
    if (refused.code() == Code::kTimeout) {
      // The coordinator may have granted it after all: released, or the
      // sources would wait for it to expire.
      (void)link_.request(MsgType::kRelease, Json{{"rank", config_.rank}, {"version", version}},
                          std::max(deadline, Clock::now()) + kReleaseGrace);
      return refused;
    }
    if (requested == -1 && refused.reason() == Reason::kDrained) {
      // The sources are overwriting it: the latest is the next version.
      drained = refused.message();
      want = version + 1;
      continue;
    }
    if (refused.reason() != Reason::kInstanceIncomplete) return refused;
    // A rank of the instance has not joined (yet): wait for it.
    if (Clock::now() + kRetryPause >= deadline) return Status::timeout(refused.message() + ", until the deadline");
    std::this_thread::sleep_for(kRetryPause);
    Result<Json> again = link_.request(MsgType::kSubscribe, Json::object(), deadline);
    if (!again.is_ok()) return again.status();
    latest = std::max(latest, again->value("version", int64_t{0}));
  }
}

// The bounds a plan part from the coordinator is parsed within: the
// defaults, and this receiver's "max_plan_runs".
control::MessageLimits RefreshSession::part_limits() const {
  control::MessageLimits lim;
  lim.max_runs = config_.max_plan_runs;
  return lim;
}

// The plan part of the current membership, compiled; the coordinator
// answers "unchanged" when `compiled` holds it already.
Status RefreshSession::fetch_plan(Clock::time_point deadline, std::shared_ptr<const CompiledPart>* compiled) {
  Json fetch{{"rank", config_.rank}};
  if (*compiled) fetch["epoch"] = (*compiled)->epoch.wire();
  Result<Json> reply = link_.request(MsgType::kFetchPlan, fetch, deadline);
  if (!reply.is_ok()) return reply.status();
  Result<control::PlanPart> part = control::parse_plan_part(*reply, part_limits());
  if (!part.is_ok()) return part.status().with_context("from the coordinator");
  if (part->unchanged) {
    if (*compiled) return Status::ok();
    return Status::invalid("plan from the coordinator: \"unchanged\", but this rank holds no part");
  }
  const std::vector<LocalBuffer> buffers = resources_.local_buffers();
  Result<std::shared_ptr<const CompiledPart>> c = compile_plan(
      *part, config_.rank, buffers,
      [this](int32_t rank, const std::string& buffer, const std::vector<uint8_t>& rkey) {
        return resources_.rkey_id(rank, buffer, rkey);
      },
      [this](uint64_t bytes) { return resources_.conversion_staging(bytes); });
  if (!c.is_ok()) return c.status();
  *compiled = std::move(c).value();
  return Status::ok();
}

Status RefreshSession::transfer(const CompiledPart& part, int64_t version, Clock::time_point deadline,
                                RefreshReport* report) {
  report->epoch = part.epoch;
  report->minimum_network_bytes = part.minimum_network_bytes;
  report->solo = part.solo;
  report->local_bytes = part.local_bytes;
  report->touched = true;
  enter_(ReceiverState::kTransferring);
  Result<TransferSetup> setup = resources_.transfer_setup(part);
  if (setup.is_ok()) {
    setup->trace = trace_;
    setup->progress = progress_;
  }
  if (!setup.is_ok()) {
    fabric::Schedule schedule = part.schedule;
    schedule.version = version;
    TransferExecutor::fail_fast(resources_.fabric(), schedule, deadline);
    return setup.status();
  }
  TransferExecutor executor(*setup, part, version, deadline, watch(part, version, deadline), threads_);
  return executor.run(&report->transfer);
}

// Staged mode: an abort of the instance ends the wait for the peers. Either
// mode: so does a new membership (a peer of the domain died or left: the
// next attempt runs the new plan).
TransferWatch RefreshSession::watch(const CompiledPart& part, int64_t version, Clock::time_point deadline) {
  TransferWatch w;
  if (config_.staged) {
    w.listen = [this, version](Clock::time_point until) -> Status {
      Result<std::optional<control::Frame>> n = link_.wait_notice_of({MsgType::kAbort}, until);
      if (!n.is_ok() || !n->has_value()) return Status::ok();
      Result<control::VersionNotice> abort = control::parse_notice(MsgType::kAbort, (**n).body);
      if (!abort.is_ok() || abort->version != version) return Status::ok();
      return Status::io_error("instance " + std::to_string(config_.instance) + " aborted version " +
                              std::to_string(version) + ": " + abort->reason)
          .with_reason(Reason::kInstanceAborted);
    };
  }
  w.check = [this, &part, deadline, epoch = part.epoch](std::vector<int32_t>* gone) mutable -> Status {
    Result<Json> p = link_.request(MsgType::kFetchPlan, Json{{"rank", config_.rank}, {"epoch", epoch.wire()}}, deadline);
    if (!p.is_ok()) return Status::ok();
    // Its peers only: the runs of a new part are not needed to tell that
    // the membership changed and whom it reads from (nor parsed, millions
    // of them, while the transfer runs).
    Result<control::PlanPart> next = control::parse_plan_part(*p, part_limits(), /*with_runs=*/false);
    if (!next.is_ok() || next->unchanged) return Status::ok();
    epoch = next->epoch;
    // A source the new plan does not read from (or reads from at another
    // worker address: it came back as a new process) may be gone; the
    // executor gives it up once it answers nothing (TransferWatch::check).
    for (const auto& source : part.source_addresses) {
      const std::vector<control::PlanPeer>& now = next->peers.sources;
      const bool kept = std::any_of(now.begin(), now.end(), [&source](const control::PlanPeer& s) {
        return s.rank == source.first && s.worker_address == source.second;
      });
      if (!kept) gone->push_back(source.first);
    }
    return Status::io_error("the membership changed during the refresh (a peer died or left)")
        .with_reason(Reason::kPeerLost);
  };
  return w;
}

// Checks what landed against the sources' hashes (plugin/verify.h).
Status RefreshSession::verify(int64_t version, Clock::time_point deadline, RefreshReport* report) {
  const Clock::time_point t0 = Clock::now();
  Result<Json> r = link_.request(MsgType::kVersionHashes, Json{{"rank", config_.rank}, {"version", version}}, deadline);
  if (!r.is_ok()) return r.status().with_context("verify");
  const std::vector<Buffer>& buffers = resources_.buffers();
  for (const Json& h : (*r)["hashes"]) {
    const size_t bi = h.value("buffer", size_t{0}), si = h.value("segment", size_t{0});
    if (bi >= buffers.size() || si >= buffers[bi].part.segments.size()) {
      return Status::internal("version_hashes: the coordinator named buffer " + std::to_string(bi) + " segment " +
                              std::to_string(si) + ", which this receiver did not register");
    }
    const Buffer& b = buffers[bi];
    const control::Segment& seg = b.part.segments[si];
    const std::optional<DType> dt = parse_dtype(seg.dtype.empty() ? b.part.dtype : seg.dtype);
    const int elem = dt ? dtype_bytes(*dt) : 1;
    const std::vector<int64_t> start = h.value("start", std::vector<int64_t>());
    const std::vector<int64_t> size = h.value("size", std::vector<int64_t>());
    Result<uint64_t> mine = hash_box(b.data, b.bytes, seg, elem, start, size);
    if (!mine.is_ok()) return mine.status().with_context("verify");
    const uint64_t theirs = h.value("hash", uint64_t{0});
    if (*mine != theirs) {
      return Status::io_error("verify: version " + std::to_string(version) + " of tensor \"" + seg.tensor +
                              "\" start " + h["start"].dump() + " size " + h["size"].dump() + " in buffer \"" +
                              b.part.name + "\" hashes to " + std::to_string(*mine) + ", but source rank " +
                              std::to_string(h.value("rank", -1)) + " published " + std::to_string(theirs) +
                              " for it: the bytes that arrived are not the ones published")
          .with_reason(Reason::kVerifyMismatch);
    }
    uint64_t n = static_cast<uint64_t>(elem);
    for (int64_t v : size) n *= static_cast<uint64_t>(v);
    ++report->verified_boxes;
    report->verified_bytes += n;
  }
  report->unverified_bytes = r->value("unverified_bytes", uint64_t{0});
  if (report->unverified_bytes > 0) {
    const Json& first = r->value("unverified", Json::array());
    log_.warn("verify: " + std::to_string(report->unverified_bytes) + " bytes of version " + std::to_string(version) +
              " have no published hash (a source without \"verify\", or a layout registered after the publish)" +
              (first.empty() ? std::string() : ", e.g. " + first[0].dump()));
  }
  report->verified = true;
  report->verify_s = seconds_between(t0, Clock::now());
  enter_(ReceiverState::kVerified);
  return Status::ok();
}

// All or nothing for the instance: say how this rank did, then wait for the
// coordinator's word for the whole instance.
Status RefreshSession::barrier(const Status& st, int64_t version, Clock::time_point deadline) {
  const Json body{{"rank", config_.rank}, {"version", version}};
  if (!st.is_ok()) {
    Json failed = body;
    failed["reason"] = st.message().substr(0, 1000);
    Result<Json> r = link_.request(MsgType::kReportFailed, failed, std::max(deadline, Clock::now()) + kReleaseGrace);
    if (!r.is_ok()) log_.warn(r.status().message());
    return st;
  }
  // Not bounded by the deadline: once sent, the report may complete the
  // instance's commit, and commit is final; its answer must be read (the
  // refresh may return one coordinator round trip after its deadline).
  Result<Json> r = link_.request(MsgType::kReportStaged, body);
  if (!r.is_ok()) return r.status();
  while (true) {
    // In slices, to notice at once when the coordinator declared this rank
    // dead: it then aborts the instance's version and tells this rank nothing.
    const Clock::time_point until = std::min(deadline, Clock::now() + kBarrierSlice);
    Result<std::optional<control::Frame>> n = link_.wait_notice_of({MsgType::kCommit, MsgType::kAbort}, until);
    if (!n.is_ok()) return n.status();
    if (!n->has_value() && link_.dropped()) {
      return Status::io_error("staged version " + std::to_string(version) +
                              ", but the coordinator declared this receiver dead meanwhile (its heartbeats came "
                              "later than the coordinator's timeout), so its instance aborted the version")
          .with_reason(Reason::kInstanceAborted);
    }
    if (!n->has_value() && Clock::now() < deadline) continue;
    if (!n->has_value()) return withdraw(version);
    Result<control::VersionNotice> word = control::parse_notice((**n).type, (**n).body);
    if (!word.is_ok()) return word.status().with_context("from the coordinator");
    if (word->version != version) continue;  // an old barrier's word
    if (word->type == MsgType::kCommit) return Status::ok();
    return Status::io_error("instance " + std::to_string(config_.instance) + " aborted version " +
                            std::to_string(version) + ": " + word->reason)
        .with_reason(Reason::kInstanceAborted);
  }
}

// The deadline passed with every notice sent so far read: withdraw. The
// coordinator answers in order, so its reply is the decision for the whole
// instance: committed already (then this rank commits too; commit is
// final), or aborted by this withdrawal. Bounded by the link's own timeout,
// not the deadline: the answer decides (include/refit/refit.h).
Status RefreshSession::withdraw(int64_t version) {
  const Json failed{{"rank", config_.rank}, {"version", version}, {"reason", "no commit before its deadline"}};
  Result<Json> w = link_.request(MsgType::kReportFailed, failed);
  if (w.is_ok() && w->value("committed", false)) {
    log_.info("staged version " + std::to_string(version) + ": the deadline passed, but the instance had "
              "committed it; committing it too");
    return Status::ok();
  }
  if (!w.is_ok()) {
    return Status::timeout("staged version " + std::to_string(version) +
                           ", but the instance did not commit before the deadline, and the coordinator could "
                           "not be told (the instance may still commit it without this rank): " +
                           w.status().message());
  }
  return Status::timeout("staged version " + std::to_string(version) +
                         ", but the instance did not commit before the deadline; it aborted the version");
}

std::string report_json(const RefreshReport& r, const Status& status, const AgentConfig& config) {
  const TransferReport& t = r.transfer;
  Json j{{"version", r.version},
         {"mode", config.staged ? "staged" : "direct"},
         {"ok", status.is_ok()},
         {"error", status.message()},
         {"epoch", r.epoch.wire()},
         {"network_bytes", t.network_bytes},
         {"local_bytes", r.local_bytes},
         {"pulls", t.gets},
         {"pushes", t.sends},
         {"retries", r.retries},
         {"seconds", {{"plan", r.plan_s}, {"network", t.network_s}, {"local", t.local_s}, {"total", r.total_s}}},
         // Direct: the server pauses for the whole refresh. Staged: only for
         // commit(), whose report fills this in.
         {"pause_seconds", config.staged ? 0.0 : r.total_s}};
  if (config.staged) j["committed"] = false;
  if (r.minimum_network_bytes >= 0) j["minimum_network_bytes"] = r.minimum_network_bytes;
  if (r.solo) j["solo"] = true;  // the plan part pulled everything itself (docs/refresh.md, "Retries")
  if (config.verify) {
    j["verify"] = {{"boxes", r.verified_boxes}, {"bytes", r.verified_bytes},
                   {"unverified_bytes", r.unverified_bytes}, {"seconds", r.verify_s}};
  }
  if (t.gathers > 0 || t.gather_unpacked > 0) {
    j["gathers"] = {{"ops", t.gathers}, {"runs", t.gathered_runs}, {"unpacked", t.gather_unpacked},
                    {"busy", t.gather_busy}};
  }
  // Conversions on the way (docs/conversion.md): the units this rank
  // converted after landing them, and the seconds its kernels took.
  j["converts"] = {{"units", t.converts}, {"seconds", t.convert_s}};
  if (t.landing) {
    j["landing"] = {{"slots", t.landing_slots}, {"chunks", t.landing_chunks}, {"copies", t.landing_copies},
                    {"held", t.landing_held}};
  }
  return j.dump();
}

}  // namespace refit::plugin::receiver
