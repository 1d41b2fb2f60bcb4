#include "transport/control/control_state.h"

#include <algorithm>

#include "planner/layout_json.h"
#include "planner/plan.h"

namespace refit::control {

ControlState::ControlState(StateLimits limits, Clock::duration heartbeat_timeout)
    : limits_(limits), heartbeat_timeout_(heartbeat_timeout) {}
ControlState::~ControlState() = default;

namespace {
std::string dims(const std::vector<int64_t>& v) { return Json(v).dump(); }
}  // namespace

Status ControlState::register_source(uint64_t session, RegisterSource m, Clock::time_point now) {
  if (sources_.count(m.rank)) {
    return Status::invalid("register_source: source rank " + std::to_string(m.rank) +
                           " is already registered; unregister it first");
  }
  if (sources_.size() >= limits_.max_sources) {
    return Status::invalid("register_source: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_sources) + " sources");
  }
  std::set<std::string> seen;
  for (const TensorDecl& t : m.tensors) {
    if (!seen.insert(t.name).second) {
      return Status::invalid("register_source: tensor \"" + t.name + "\" is declared twice");
    }
    auto it = tensors_.find(t.name);
    if (it != tensors_.end() && (it->second.decl.dtype != t.dtype || it->second.decl.shape != t.shape)) {
      return Status::invalid("register_source: tensor \"" + t.name + "\" declared as " + t.dtype + dims(t.shape) +
                             " but other sources declared it as " + it->second.decl.dtype +
                             dims(it->second.decl.shape));
    }
  }
  for (const TensorDecl& t : m.tensors) {
    Declared& entry = tensors_[t.name];
    if (entry.sources++ == 0) {
      entry.decl = t;
      entry.order = next_tensor_order_++;
    }
  }
  const int32_t rank = m.rank;
  sources_.emplace(rank, Member<RegisterSource>{session, now, std::move(m)});
  ++epoch_;
  return Status::ok();
}

Status ControlState::register_receiver(uint64_t session, RegisterReceiver m, Clock::time_point now) {
  if (receivers_.count(m.rank)) {
    return Status::invalid("register_receiver: receiver rank " + std::to_string(m.rank) +
                           " is already registered; unregister it first");
  }
  if (receivers_.size() >= limits_.max_receivers) {
    return Status::invalid("register_receiver: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_receivers) + " receivers");
  }
  const int32_t rank = m.rank;
  receivers_.emplace(rank, Member<RegisterReceiver>{session, now, std::move(m)});
  ++epoch_;
  return Status::ok();
}

template <typename T>
Status ControlState::owned(const char* message, const std::map<int32_t, Member<T>>& members,
                           Role role, int32_t rank, uint64_t session) const {
  auto it = members.find(rank);
  if (it == members.end()) {
    return Status::not_found(std::string(message) + ": " + role_name(role) + " rank " +
                             std::to_string(rank) + " is not registered");
  }
  if (it->second.session != session) {
    return Status::invalid(std::string(message) + ": " + role_name(role) + " rank " +
                           std::to_string(rank) + " was registered by another connection");
  }
  return Status::ok();
}

void ControlState::remove_source(int32_t rank) {
  auto it = sources_.find(rank);
  if (it == sources_.end()) return;
  for (const TensorDecl& t : it->second.info.tensors) {
    auto d = tensors_.find(t.name);
    if (d != tensors_.end() && --d->second.sources == 0) tensors_.erase(d);
  }
  sources_.erase(it);
  ++epoch_;
  advance_version();  // it may have been the last source behind
}

std::vector<int32_t> ControlState::instance_ranks(int32_t instance) const {
  std::vector<int32_t> out;
  for (const auto& [rank, r] : receivers_) {
    if (r.info.instance == instance) out.push_back(rank);
  }
  return out;
}

void ControlState::abort_instance(int32_t instance, int64_t version, const std::string& reason) {
  for (int32_t rank : instance_ranks(instance)) {
    notices_.push_back(Notice{receivers_[rank].session, MsgType::kAbort,
                              Json{{"instance", instance}, {"version", version}, {"reason", reason}}});
  }
  barriers_.erase(instance);
}

void ControlState::remove_receiver(int32_t rank, const std::string& why) {
  auto it = receivers_.find(rank);
  if (it == receivers_.end()) return;
  const int32_t instance = it->second.info.instance;
  receivers_.erase(it);
  ++epoch_;
  if (leases_.erase(rank)) notify_drained();
  auto b = barriers_.find(instance);
  if (b != barriers_.end()) {
    abort_instance(instance, b->second.version, "receiver rank " + std::to_string(rank) + " " + why);
  }
}

Status ControlState::unregister(uint64_t session, const MemberRef& m) {
  if (m.role == Role::kSource) {
    REFIT_RETURN_IF_ERROR(owned("unregister", sources_, m.role, m.rank, session));
    remove_source(m.rank);
  } else {
    REFIT_RETURN_IF_ERROR(owned("unregister", receivers_, m.role, m.rank, session));
    remove_receiver(m.rank, "unregistered");
  }
  return Status::ok();
}

Status ControlState::heartbeat(uint64_t session, const MemberRef& m, Clock::time_point now) {
  if (m.role == Role::kSource) {
    REFIT_RETURN_IF_ERROR(owned("heartbeat", sources_, m.role, m.rank, session));
    sources_[m.rank].last_seen = now;
  } else {
    REFIT_RETURN_IF_ERROR(owned("heartbeat", receivers_, m.role, m.rank, session));
    receivers_[m.rank].last_seen = now;
  }
  return Status::ok();
}

Status ControlState::publish(uint64_t session, int64_t version) {
  std::vector<std::pair<int32_t, Member<RegisterSource>*>> mine;
  for (auto& [rank, s] : sources_) {
    if (s.session == session) mine.emplace_back(rank, &s);
  }
  if (mine.empty()) {
    return Status::invalid("publish_version: only a connection that registered a source may publish");
  }
  for (const auto& [rank, s] : mine) {
    if (version <= s->published) {
      return Status::invalid("publish_version: version " + std::to_string(version) +
                             " is not newer than version " + std::to_string(s->published) +
                             ", which source rank " + std::to_string(rank) + " already published");
    }
  }
  for (auto& [rank, s] : mine) s->published = version;
  advance_version();
  return Status::ok();
}

void ControlState::advance_version() {
  if (sources_.empty()) return;  // no source: nothing newer is available
  int64_t low = sources_.begin()->second.published;
  for (const auto& [rank, s] : sources_) low = std::min(low, s.published);
  if (low <= version_) return;
  version_ = low;
  for (uint64_t s : subscribers_) notices_.push_back(Notice{s, MsgType::kVersionNotify, Json{{"version", low}}});
}

Status ControlState::subscribe(uint64_t session) {
  if (!subscribers_.count(session) && subscribers_.size() >= limits_.max_subscribers) {
    return Status::invalid("subscribe: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_subscribers) + " subscribers");
  }
  subscribers_.insert(session);
  return Status::ok();
}

Json ControlState::layout_document() const {
  Json sources = Json::array(), receivers = Json::array(), tensors = Json::array(), buffers = Json::array();
  auto add_buffers = [&buffers](const char* side, int32_t rank, const std::vector<MemberBuffer>& bs) {
    for (const MemberBuffer& b : bs) {
      Json segs = Json::array();
      for (const Segment& s : b.segments) {
        segs.push_back({{"tensor", s.tensor}, {"start", s.start}, {"size", s.size}, {"offset", s.offset},
                        {"strides", s.strides}});
      }
      buffers.push_back({{"side", side}, {"rank", rank}, {"name", b.name}, {"dtype", b.dtype},
                         {"bytes", b.bytes}, {"segments", std::move(segs)}});
    }
  };
  // The maps iterate in rank order, so position i is the i-th live rank.
  int32_t dense = 0;
  for (const auto& [rank, s] : sources_) {
    sources.push_back({{"rank", dense}, {"domain", s.info.domain}});
    add_buffers("source", dense++, s.info.buffers);
  }
  dense = 0;
  for (const auto& [rank, r] : receivers_) {
    receivers.push_back({{"rank", dense}, {"domain", r.info.domain}, {"instance", r.info.instance}});
    add_buffers("receiver", dense++, r.info.buffers);
  }
  std::vector<const Declared*> ordered;
  ordered.reserve(tensors_.size());
  for (const auto& [name, d] : tensors_) ordered.push_back(&d);
  std::sort(ordered.begin(), ordered.end(), [](const Declared* a, const Declared* b) { return a->order < b->order; });
  for (const Declared* d : ordered) {
    tensors.push_back({{"name", d->decl.name}, {"dtype", d->decl.dtype}, {"shape", d->decl.shape}});
  }
  return Json{{"format", "refit-layout/1"}, {"sources", std::move(sources)}, {"receivers", std::move(receivers)},
              {"tensors", std::move(tensors)}, {"buffers", std::move(buffers)}};
}

PlanInput ControlState::plan_input() const {
  PlanInput in{epoch_, layout_document().dump(), {}, {}};
  in.source_ranks.reserve(sources_.size());
  for (const auto& [rank, s] : sources_) in.source_ranks.push_back(rank);
  in.receiver_ranks.reserve(receivers_.size());
  for (const auto& [rank, r] : receivers_) in.receiver_ranks.push_back(rank);
  return in;
}

namespace {

// "receiver ranks 0, 2, 5 as 0..2" when the live ranks have gaps, else "":
// the planner's messages name dense positions, which an operator must map back.
std::string renumbering(const char* side, const std::vector<int32_t>& ranks) {
  bool gaps = false;
  for (size_t i = 0; i < ranks.size(); ++i) gaps = gaps || ranks[i] != static_cast<int32_t>(i);
  if (!gaps) return "";
  std::string out = std::string(side) + " ranks ";
  const size_t shown = std::min<size_t>(ranks.size(), 16);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (shown < ranks.size()) out += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return out + " as 0.." + std::to_string(ranks.size() - 1);
}

}  // namespace

std::shared_ptr<const PlannedParts> compute_plan(const PlanInput& input) {
  auto out = std::make_shared<PlannedParts>();
  out->epoch = input.epoch;
  std::string note = renumbering("source", input.source_ranks);
  const std::string receivers_note = renumbering("receiver", input.receiver_ranks);
  if (!receivers_note.empty()) note += (note.empty() ? "" : "; ") + receivers_note;
  auto failed = [&](const Status& st) {
    out->status = note.empty() ? st : st.with_context("the layout numbers the live " + note);
    return out;
  };
  Result<Layout> layout = parse_layout_json(input.layout_json, "membership");
  if (!layout.is_ok()) return failed(layout.status());
  const Layout& L = *layout;
  Result<Plan> plan = make_plan(L);
  if (!plan.is_ok()) return failed(plan.status());
  out->network_bytes = plan->summary().network_bytes;
  out->minimum_network_bytes = plan->summary().minimum_network_bytes;
  out->local_bytes = plan->summary().local_bytes;
  // The document's dense positions back to the registered ranks.
  auto real = [&input](bool source, int32_t position) {
    const std::vector<int32_t>& ranks = source ? input.source_ranks : input.receiver_ranks;
    return position >= 0 && static_cast<size_t>(position) < ranks.size() ? ranks[position] : position;
  };
  auto append = [&out](int32_t rank, const Json& run) {
    Json& list = out->parts[rank];
    if (list.is_null()) list = Json::array();
    list.push_back(run);
  };
  for_each_run(*plan, [&](const Run& run) {
    const int32_t from = real(run.from.side == Side::kSource, run.from.rank);
    const int32_t to = real(false, run.to.rank);
    Json j = {{"kind", run.local ? "local" : "net"},
              {"from", {{"side", side_name(run.from.side)}, {"rank", from},
                        {"buffer", L.buffers[run.from.buffer].name}, {"offset", run.from.offset}}},
              {"to", {{"rank", to}, {"buffer", L.buffers[run.to.buffer].name}, {"offset", run.to.offset}}},
              {"bytes", run.bytes}};
    if (run.local && from != to) append(from, j);
    append(to, j);
  });
  return out;
}

Status ControlState::check_fetch(uint64_t session, int32_t rank) const {
  return owned("fetch_plan", receivers_, Role::kReceiver, rank, session);
}

bool ControlState::install_plan(std::shared_ptr<const PlannedParts> plan) {
  if (!plan || plan->epoch != epoch_) return false;
  plan_ = std::move(plan);
  ++plans_made_;
  return true;
}

Result<Json> ControlState::cached_part(int32_t rank) const {
  if (!plan_current()) return Status::internal("fetch_plan: no plan of the current membership");
  if (!plan_->status.is_ok()) return plan_->status.with_context("fetch_plan: the membership cannot be planned");
  auto it = plan_->parts.find(rank);
  return it == plan_->parts.end() ? Json::array() : it->second;
}

Json ControlState::plan_totals() const {
  if (!plan_) return Json::object();
  return Json{{"network_bytes", plan_->network_bytes},
              {"minimum_network_bytes", plan_->minimum_network_bytes},
              {"local_bytes", plan_->local_bytes}};
}

Json ControlState::peers_of(int32_t rank, const Json& runs) const {
  // (side, rank) -> buffer names the runs use there.
  std::map<std::pair<bool, int32_t>, std::set<std::string>> used;
  for (const Json& run : runs) {
    const bool from_source = run["from"]["side"] == "source";
    const int32_t from = run["from"]["rank"].get<int32_t>();
    const int32_t to = run["to"]["rank"].get<int32_t>();
    if (from_source || from != rank) used[{from_source, from}].insert(run["from"]["buffer"].get<std::string>());
    if (to != rank) used[{false, to}].insert(run["to"]["buffer"].get<std::string>());
  }
  Json sources = Json::array(), receivers = Json::array();
  auto describe = [](int32_t r, const std::vector<uint8_t>& worker, const std::vector<MemberBuffer>& buffers,
                     const std::set<std::string>& names) {
    Json bs = Json::array();
    for (const MemberBuffer& b : buffers) {
      if (names.count(b.name)) bs.push_back({{"name", b.name}, {"address", b.address}, {"rkey", Json::binary(b.rkey)}});
    }
    return Json{{"rank", r}, {"worker_address", Json::binary(worker)}, {"buffers", std::move(bs)}};
  };
  for (const auto& [key, names] : used) {
    if (key.first) {
      auto it = sources_.find(key.second);
      if (it != sources_.end()) sources.push_back(describe(key.second, it->second.info.worker_address, it->second.info.buffers, names));
    } else {
      auto it = receivers_.find(key.second);
      if (it != receivers_.end()) receivers.push_back(describe(key.second, it->second.info.worker_address, it->second.info.buffers, names));
    }
  }
  // Every receiver of the rank's domain, with its contact: a fabric that
  // needs the whole domain (one NCCL communicator) builds it from this list.
  Json domain = Json::array();
  auto me = receivers_.find(rank);
  if (me != receivers_.end()) {
    for (const auto& [r, m] : receivers_) {
      if (m.info.domain == me->second.info.domain) {
        domain.push_back({{"rank", r}, {"worker_address", Json::binary(m.info.worker_address)}});
      }
    }
  }
  return Json{{"sources", std::move(sources)}, {"receivers", std::move(receivers)}, {"domain", std::move(domain)}};
}

Result<Json> ControlState::plan_part(uint64_t session, int32_t rank) {
  REFIT_RETURN_IF_ERROR(check_fetch(session, rank));
  if (!plan_current()) install_plan(compute_plan(plan_input()));
  return cached_part(rank);
}

Status ControlState::report_staged(uint64_t session, const StageReport& m) {
  REFIT_RETURN_IF_ERROR(owned("report_staged", receivers_, Role::kReceiver, m.rank, session));
  const int32_t instance = receivers_[m.rank].info.instance;
  Barrier& b = barriers_[instance];
  if (b.version != 0 && b.version != m.version) {
    return Status::invalid("report_staged: instance " + std::to_string(instance) + " is staging version " +
                           std::to_string(b.version) + ", not " + std::to_string(m.version));
  }
  b.version = m.version;
  b.staged.insert(m.rank);
  const std::vector<int32_t> ranks = instance_ranks(instance);
  for (int32_t r : ranks) {
    if (!b.staged.count(r)) return Status::ok();
  }
  for (int32_t r : ranks) {
    notices_.push_back(Notice{receivers_[r].session, MsgType::kCommit,
                              Json{{"instance", instance}, {"version", m.version}}});
  }
  barriers_.erase(instance);
  return Status::ok();
}

Status ControlState::report_failed(uint64_t session, const StageReport& m) {
  REFIT_RETURN_IF_ERROR(owned("report_failed", receivers_, Role::kReceiver, m.rank, session));
  abort_instance(receivers_[m.rank].info.instance, m.version,
                 "receiver rank " + std::to_string(m.rank) + " failed: " + m.reason);
  return Status::ok();
}

Status ControlState::lease(uint64_t session, const StageReport& m, Clock::time_point now) {
  REFIT_RETURN_IF_ERROR(owned("lease", receivers_, Role::kReceiver, m.rank, session));
  if (m.version > version_) {
    return Status::invalid("lease: version " + std::to_string(m.version) + " is not published (latest is " +
                           std::to_string(version_) + ")");
  }
  leases_[m.rank] = Lease{m.version, now + lease_timeout_};
  notify_drained();  // a rank moving to a newer version may drain an older one
  return Status::ok();
}

Status ControlState::release(uint64_t session, const StageReport& m) {
  REFIT_RETURN_IF_ERROR(owned("release", receivers_, Role::kReceiver, m.rank, session));
  auto it = leases_.find(m.rank);
  if (it == leases_.end() || it->second.version != m.version) {
    return Status::not_found("release: receiver rank " + std::to_string(m.rank) + " holds no lease on version " +
                             std::to_string(m.version));
  }
  leases_.erase(it);
  notify_drained();
  return Status::ok();
}

bool ControlState::drained(int64_t version) const {
  for (const auto& [rank, l] : leases_) {
    if (l.version <= version) return false;
  }
  return true;
}

Result<bool> ControlState::wait_drained(uint64_t session, int64_t version) {
  bool is_source = false;
  for (const auto& [rank, s] : sources_) is_source = is_source || s.session == session;
  if (!is_source) return Status::invalid("wait_drained: only a connection that registered a source may wait");
  if (drained(version)) return true;
  if (num_drain_waiters_ >= limits_.max_subscribers) {
    return Status::invalid("wait_drained: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_subscribers) + " waiters");
  }
  if (drain_waiters_[version].insert(session).second) ++num_drain_waiters_;
  return false;
}

void ControlState::notify_drained() {
  for (auto it = drain_waiters_.begin(); it != drain_waiters_.end();) {
    if (!drained(it->first)) {
      ++it;
      continue;
    }
    for (uint64_t s : it->second) notices_.push_back(Notice{s, MsgType::kDrained, Json{{"version", it->first}}});
    num_drain_waiters_ -= it->second.size();
    it = drain_waiters_.erase(it);
  }
}

void ControlState::session_closed(uint64_t session) {
  subscribers_.erase(session);
  for (auto it = drain_waiters_.begin(); it != drain_waiters_.end();) {
    num_drain_waiters_ -= it->second.erase(session);
    it = it->second.empty() ? drain_waiters_.erase(it) : std::next(it);
  }
}

std::vector<std::string> ControlState::sweep(Clock::time_point now) {
  std::vector<std::string> dead;
  auto line = [&](Role role, int32_t rank, Clock::duration silent) {
    dead.push_back(std::string(role_name(role)) + " rank " + std::to_string(rank) + " declared dead after " +
                   std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()) +
                   " ms without a heartbeat; its state is removed");
  };
  std::vector<int32_t> gone;
  for (const auto& [rank, s] : sources_) {
    if (now - s.last_seen > heartbeat_timeout_) {
      line(Role::kSource, rank, now - s.last_seen);
      gone.push_back(rank);
    }
  }
  for (int32_t r : gone) remove_source(r);
  gone.clear();
  for (const auto& [rank, s] : receivers_) {
    if (now - s.last_seen > heartbeat_timeout_) {
      line(Role::kReceiver, rank, now - s.last_seen);
      gone.push_back(rank);
    }
  }
  for (int32_t r : gone) remove_receiver(r, "was declared dead");
  bool expired = false;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (now >= it->second.expires) {
      dead.push_back("lease of version " + std::to_string(it->second.version) + " by receiver rank " +
                     std::to_string(it->first) + " expired");
      it = leases_.erase(it);
      expired = true;
    } else {
      ++it;
    }
  }
  if (expired) notify_drained();
  return dead;
}

}  // namespace refit::control
