#include "transport/control/control_state.h"

#include <algorithm>
#include <deque>
#include <array>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "planner/conversion.h"
#include "planner/dtype.h"
#include "planner/layout_json.h"
#include "planner/plan.h"

namespace refit::control {

ControlState::ControlState(StateLimits limits, Clock::duration heartbeat_timeout)
    : limits_(limits), heartbeat_timeout_(heartbeat_timeout) {}
ControlState::~ControlState() = default;

namespace {
std::string dims(const std::vector<int64_t>& v) { return Json(v).dump(); }

const std::string kScaleSuffix = "_scale_inv";

// The intersection of two boxes of one tensor; false when it is empty or
// their ranks differ.
bool intersect_box(const Segment& a, const Segment& b, std::vector<int64_t>* start, std::vector<int64_t>* size) {
  if (a.start.size() != b.start.size()) return false;
  start->resize(a.start.size());
  size->resize(a.start.size());
  for (size_t d = 0; d < a.start.size(); ++d) {
    const int64_t lo = std::max(a.start[d], b.start[d]);
    const int64_t hi = std::min(a.start[d] + a.size[d], b.start[d] + b.size[d]);
    if (hi <= lo) return false;
    (*start)[d] = lo;
    (*size)[d] = hi - lo;
  }
  return true;
}

bool box_inside(const Segment& seg, const std::vector<int64_t>& start, const std::vector<int64_t>& size) {
  if (seg.start.size() != start.size() || size.size() != start.size()) return false;
  for (size_t d = 0; d < start.size(); ++d) {
    if (start[d] < seg.start[d] || start[d] + size[d] > seg.start[d] + seg.size[d] || size[d] <= 0) return false;
  }
  return true;
}

std::string box_key(const std::string& tensor, const std::vector<int64_t>& start, const std::vector<int64_t>& size) {
  std::string key = tensor;
  key.push_back('\0');
  for (int64_t v : start) key.append(reinterpret_cast<const char*>(&v), sizeof v);
  for (int64_t v : size) key.append(reinterpret_cast<const char*>(&v), sizeof v);
  return key;
}

// Whether the box covers whole blocks of `block` in the last two dims (a
// block at the tensor's edge may be partial).
bool whole_blocks(const std::vector<int64_t>& start, const std::vector<int64_t>& size,
                  const std::vector<int64_t>& shape, const std::array<int64_t, 2>& block) {
  const size_t n = start.size();
  if (n < 2 || shape.size() != n) return false;
  for (size_t k = 0; k < 2; ++k) {
    const size_t d = n - 2 + k;
    const int64_t end = start[d] + size[d];
    if (start[d] % block[k] != 0 || (end % block[k] != 0 && end != shape[d])) return false;
  }
  return true;
}

// W for a block scale tensor "<W>_scale_inv", else "".
std::string scale_weight(const std::string& tensor) {
  if (tensor.size() <= kScaleSuffix.size() ||
      tensor.compare(tensor.size() - kScaleSuffix.size(), kScaleSuffix.size(), kScaleSuffix) != 0) {
    return "";
  }
  return tensor.substr(0, tensor.size() - kScaleSuffix.size());
}

int64_t numel(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (int64_t v : size) n *= v;
  return n;
}
}  // namespace

bool ControlState::converted_copy(const MemberBuffer& b, const Segment& seg) const {
  auto it = tensors_.find(seg.tensor);
  return it == tensors_.end() || segment_dtype(b, seg) != it->second.decl.dtype;
}

namespace {

// What a receiver's checks read of its registration, hashed: its buffers'
// names, dtypes, sizes and segments (not their addresses and keys, which
// differ between replicas) and its weight block.
uint64_t declaration_fingerprint(const RegisterReceiver& m) {
  uint64_t h = 0x243f6a8885a308d3;
  auto mix = [&h](uint64_t v) {
    h = (h ^ v) * 0x9e3779b97f4a7c15;
    h ^= h >> 29;
  };
  auto text = [&mix](const std::string& s) { mix(std::hash<std::string_view>{}(s)); };
  auto dims = [&mix](const std::vector<int64_t>& v) {
    mix(v.size());
    for (int64_t x : v) mix(static_cast<uint64_t>(x));
  };
  mix(static_cast<uint64_t>(m.weight_block_size[0]));
  mix(static_cast<uint64_t>(m.weight_block_size[1]));
  mix(m.buffers.size());
  for (const MemberBuffer& b : m.buffers) {
    text(b.name);
    text(b.dtype);
    mix(static_cast<uint64_t>(b.bytes));
    mix(b.segments.size());
    for (const Segment& s : b.segments) {
      text(s.tensor);
      dims(s.start);
      dims(s.size);
      mix(static_cast<uint64_t>(s.offset));
      dims(s.strides);
      text(s.dtype);
    }
  }
  return h;
}

// Whether two registrations declare the same: what declaration_fingerprint
// hashes, compared.
bool same_declaration(const RegisterReceiver& a, const RegisterReceiver& b) {
  return a.weight_block_size == b.weight_block_size &&
         std::equal(a.buffers.begin(), a.buffers.end(), b.buffers.begin(), b.buffers.end(),
                    [](const MemberBuffer& x, const MemberBuffer& y) {
                      return x.name == y.name && x.dtype == y.dtype && x.bytes == y.bytes && x.segments == y.segments;
                    });
}

bool same_tensors(const std::vector<TensorDecl>& a, const std::vector<TensorDecl>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const TensorDecl& x, const TensorDecl& y) {
    return x.name == y.name && x.dtype == y.dtype && x.shape == y.shape;
  });
}

}  // namespace

Status ControlState::register_source(uint64_t session, RegisterSource m, Clock::time_point now) {
  if (auto it = sources_.find(m.rank); it != sources_.end()) {
    if (session != 0 && it->second.session == session && same_tensors(it->second.info->tensors, m.tensors) &&
        it->second.info->worker_address == m.worker_address && it->second.info->domain == m.domain &&
        to_json(*it->second.info) != to_json(m)) {
      // The same source on its own connection, the same tensors, other
      // buffers (its converted copies changed at a publish): replaced in
      // place. The very same registration again is refused below. Its tensors never lose their source, so no version moves.
      it->second.info = std::make_shared<const RegisterSource>(std::move(m));
      it->second.last_seen = now;
      membership_changed();
      return Status::ok();
    }
    if (it->second.session != 0 || to_json(*it->second.info) == to_json(m)) {
      return registered_again("register_source", sources_, Role::kSource, session, m, now);
    }
    remove_source(m.rank, "was replaced by a new registration");  // its connection closed (replaced())
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
    orphaned_.erase(t.name);
    Declared& entry = tensors_[t.name];
    if (entry.sources++ == 0) {
      entry.decl = t;
      entry.order = next_tensor_order_++;
      ++decls_generation_;
    }
  }
  const int32_t rank = m.rank;
  sources_.emplace(rank, Member<RegisterSource>{session, now, std::make_shared<const RegisterSource>(std::move(m))});
  membership_changed();
  return Status::ok();
}

Status ControlState::register_receiver(uint64_t session, RegisterReceiver m, Clock::time_point now) {
  if (auto it = receivers_.find(m.rank); it != receivers_.end()) {
    if (it->second.session != 0 || to_json(*it->second.info) == to_json(m)) {
      return registered_again("register_receiver", receivers_, Role::kReceiver, session, m, now);
    }
    // Its connection closed: a new process takes the rank.
    remove_receiver(m.rank, "was replaced by a new registration after its connection closed");
  }
  if (receivers_.size() >= limits_.max_receivers) {
    return Status::invalid("register_receiver: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_receivers) + " receivers");
  }
  // What cannot be planned is refused now, naming the buffer, rather than
  // found when planning, where it would fail every member's plan.
  // One hash lookup a segment. Not skipped for a replica of a registered
  // receiver: one_dtype compares a receiver with the others only, so a
  // receiver that registered before any source with one tensor in two
  // dtypes was let in, and its replicas are refused here.
  REFIT_RETURN_IF_ERROR(one_dtype(m.rank, m).with_context("register_receiver"));
  // The replicas of one shard declare the same buffers: what the checks
  // against the declared tensors find (a DeepSeek-V3 receiver's full check
  // takes about a second) is found once per declaration and generation of
  // those tensors.
  const uint64_t fingerprint = declaration_fingerprint(m);
  const Member<RegisterReceiver>* alike = declared_alike(m, fingerprint);
  uint64_t checked_at = 0;
  if (!sources_.empty()) {
    if (alike && passed_as(alike->declaration, /*full=*/true)) {
      REFIT_RETURN_IF_ERROR(same_block(m.rank, m).with_context("register_receiver"));
    } else {
      REFIT_RETURN_IF_ERROR(plannable(m.rank, m, /*full=*/true).with_context("register_receiver"));
    }
    checked_at = decls_generation_;
  }
  const std::vector<int32_t> peers = instance_ranks(m.instance);
  for (int32_t other : peers) {
    const int32_t declared = receivers_.at(other).info->instance_ranks;
    if (declared != m.instance_ranks) {
      return Status::invalid("register_receiver: receiver rank " + std::to_string(m.rank) + " declares instance " +
                             std::to_string(m.instance) + " to have " +
                             (m.instance_ranks ? std::to_string(m.instance_ranks) : std::string("undeclared")) +
                             " ranks (\"instance_ranks\"), its rank " + std::to_string(other) + " declared " +
                             (declared ? std::to_string(declared) : std::string("none")));
    }
  }
  if (m.instance_ranks > 0 && peers.size() >= static_cast<size_t>(m.instance_ranks)) {
    return Status::invalid("register_receiver: instance " + std::to_string(m.instance) + " declares " +
                           std::to_string(m.instance_ranks) + " ranks (\"instance_ranks\") and all of them are "
                           "registered; receiver rank " + std::to_string(m.rank) + " would be one too many");
  }
  const int32_t rank = m.rank;
  const uint64_t declaration = alike ? alike->declaration : next_declaration_++;
  if (declaration_members_[declaration]++ == 0) count_receiver_dtypes(m, /*add=*/true);
  Member<RegisterReceiver> member{session, now, std::make_shared<const RegisterReceiver>(std::move(m))};
  member.declaration = declaration;
  member.fingerprint = fingerprint;
  member.checked_at = checked_at;
  member.fully_checked_at = checked_at;
  receivers_.emplace(rank, std::move(member));
  membership_changed();
  return Status::ok();
}

std::optional<TensorDecl> ControlState::decl_of(const std::string& tensor, const std::array<int64_t, 2>& block) const {
  TensorDecl scratch;
  const TensorDecl* d = find_decl(tensor, block, &scratch);
  if (!d) return std::nullopt;
  return *d;
}

const TensorDecl* ControlState::find_decl(const std::string& tensor, const std::array<int64_t, 2>& block,
                                          TensorDecl* scratch) const {
  if (auto t = tensors_.find(tensor); t != tensors_.end()) return &t->second.decl;
  // A block scale tensor of a declared weight: derived by the receivers
  // that quantize it (docs/conversion.md).
  const std::string weight = scale_weight(tensor);
  if (weight.empty()) return nullptr;
  auto w = tensors_.find(weight);
  if (w == tensors_.end() || w->second.decl.shape.size() < 2) return nullptr;
  *scratch = TensorDecl{tensor, "F32", scale_shape(w->second.decl.shape, block)};
  return scratch;
}

namespace {
const std::string& dtype_of(const MemberBuffer& b, const Segment& s) { return s.dtype.empty() ? b.dtype : s.dtype; }

// Calls `fn` with each segment of `b` but those `left_out` names
// ((buffer, segment) pairs, ascending, of this buffer).
template <typename Fn>
void for_each_kept(const MemberBuffer& b, std::span<const std::pair<uint32_t, uint32_t>> left_out, const Fn& fn) {
  size_t skip = 0;
  for (size_t si = 0; si < b.segments.size(); ++si) {
    if (skip < left_out.size() && left_out[skip].second == si) {
      ++skip;
      continue;
    }
    fn(b.segments[si]);
  }
}

// Buffer `b` of the member at `position` as a refit-layout/1 document lists
// it, less the segments `left_out` names.
Json buffer_json(bool source, int32_t position, const MemberBuffer& b,
                 std::span<const std::pair<uint32_t, uint32_t>> left_out) {
  Json segs = Json::array();
  for_each_kept(b, left_out, [&segs](const Segment& s) {
    segs.push_back({{"tensor", s.tensor}, {"start", s.start}, {"size", s.size}, {"offset", s.offset},
                    {"strides", s.strides}});
    if (!s.dtype.empty()) segs.back()["dtype"] = s.dtype;
  });
  return Json{{"side", source ? "source" : "receiver"}, {"rank", position}, {"name", b.name},
              {"dtype", b.dtype}, {"bytes", b.bytes}, {"segments", std::move(segs)}};
}

// The same buffer handed to `builder` as values (LayoutBuilder::BufferView),
// without its JSON; `views` is scratch space kept between calls.
Status add_buffer(LayoutBuilder& builder, bool source, int32_t position, const MemberBuffer& b,
                  std::span<const std::pair<uint32_t, uint32_t>> left_out,
                  std::vector<LayoutBuilder::SegmentView>& views) {
  views.clear();
  views.reserve(b.segments.size());
  for_each_kept(b, left_out, [&views](const Segment& s) {
    views.push_back(LayoutBuilder::SegmentView{s.tensor, s.start, s.size, s.strides, s.offset, s.dtype});
  });
  return builder.buffer(LayoutBuilder::BufferView{source ? Side::kSource : Side::kReceiver, position, b.name,
                                                  b.dtype, b.bytes, views});
}
}  // namespace

void ControlState::count_receiver_dtypes(const RegisterReceiver& m, bool add) {
  for (const MemberBuffer& b : m.buffers) {
    for (const Segment& seg : b.segments) {
      if (add) {
        HeldDtype& h = receiver_dtypes_[seg.tensor];
        if (h.segments++ == 0) h.dtype = dtype_of(b, seg);
      } else if (auto h = receiver_dtypes_.find(seg.tensor); h != receiver_dtypes_.end() && --h->second.segments == 0) {
        receiver_dtypes_.erase(h);
      }
    }
  }
}

int32_t ControlState::holder(const std::string& tensor, const std::string& dtype) const {
  std::unordered_set<uint64_t> looked;  // declarations
  for (const auto& [rank, r] : receivers_) {
    if (!looked.insert(r.declaration).second) continue;
    for (const MemberBuffer& b : r.info->buffers) {
      for (const Segment& seg : b.segments) {
        if (seg.tensor == tensor && dtype_of(b, seg) == dtype) return rank;
      }
    }
  }
  return -1;
}

Status ControlState::one_dtype(int32_t rank, const RegisterReceiver& m) const {
  for (const MemberBuffer& b : m.buffers) {
    for (size_t i = 0; i < b.segments.size(); ++i) {
      const Segment& seg = b.segments[i];
      auto held = receiver_dtypes_.find(seg.tensor);
      if (held == receiver_dtypes_.end() || held->second.dtype == dtype_of(b, seg)) continue;
      return Status::invalid("receiver rank " + std::to_string(rank) + ", buffer \"" + b.name + "\" segments[" +
                             std::to_string(i) + "] (tensor \"" + seg.tensor + "\"): holds the tensor as " +
                             dtype_of(b, seg) + ", receiver rank " +
                             std::to_string(holder(seg.tensor, held->second.dtype)) + " holds it as " +
                             held->second.dtype + "; all of a tensor's receivers hold one dtype");
    }
  }
  return Status::ok();
}

Status ControlState::same_block(int32_t rank, const RegisterReceiver& m) const {
  for (const auto& [other, r] : receivers_) {
    if (other != rank && r.info->weight_block_size != m.weight_block_size) {
      return Status::invalid("receiver rank " + std::to_string(rank) + " declares \"weight_block_size\" " +
                             dims({m.weight_block_size[0], m.weight_block_size[1]}) + ", receiver rank " +
                             std::to_string(other) + " declared " +
                             dims({r.info->weight_block_size[0], r.info->weight_block_size[1]}));
    }
  }
  return Status::ok();
}

const ControlState::Member<RegisterReceiver>* ControlState::declared_alike(const RegisterReceiver& m,
                                                                           uint64_t fingerprint) const {
  for (const auto& [other, r] : receivers_) {
    if (r.fingerprint == fingerprint && same_declaration(*r.info, m)) return &r;
  }
  return nullptr;
}

bool ControlState::passed_as(uint64_t declaration, bool full) const {
  for (const auto& [other, r] : receivers_) {
    if (r.declaration == declaration && (full ? r.fully_checked_at : r.checked_at) == decls_generation_) return true;
  }
  return false;
}

Status ControlState::still_plannable(int32_t rank, const Member<RegisterReceiver>& r) const {
  if (r.checked_at == decls_generation_ || passed_as(r.declaration, /*full=*/false)) {
    r.checked_at = decls_generation_;
    return Status::ok();
  }
  Status st = plannable(rank, *r.info, /*full=*/false);
  if (st.is_ok()) r.checked_at = decls_generation_;
  return st;
}

Status ControlState::plannable(int32_t rank, const RegisterReceiver& m, bool full) const {
  ++receiver_checks_;
  if (full) REFIT_RETURN_IF_ERROR(same_block(rank, m));
  for (const MemberBuffer& b : m.buffers) {
    for (size_t i = 0; i < b.segments.size(); ++i) {
      const Segment& seg = b.segments[i];
      // Made only for a message: a receiver has tens of thousands of segments.
      auto where = [&] {
        return "receiver rank " + std::to_string(rank) + ", buffer \"" + b.name + "\" segments[" + std::to_string(i) +
               "] (tensor \"" + seg.tensor + "\")";
      };
      TensorDecl scratch;
      const TensorDecl* found = find_decl(seg.tensor, m.weight_block_size, &scratch);
      if (!found) {
        // Held once, and every source of it is gone: a peer lost, not a
        // mistake in the registration (a weight's scales: its weight's).
        auto o = orphaned_.find(seg.tensor);
        if (const std::string weight = scale_weight(seg.tensor); o == orphaned_.end() && !weight.empty()) {
          o = orphaned_.find(weight);
        }
        if (o != orphaned_.end()) {
          return Status::io_error(where() + ": no live source holds this tensor: " + o->second)
              .with_reason(Reason::kNoSource);
        }
        return Status::invalid(where() + ": no registered source declares this tensor");
      }
      const TensorDecl& decl = *found;
      if (seg.start.size() != decl.shape.size() || seg.size.size() != decl.shape.size()) {
        return Status::invalid(where() + ": start " + dims(seg.start) + " size " + dims(seg.size) + " do not have the " +
                               std::to_string(decl.shape.size()) + " dims of the tensor, " + decl.dtype +
                               dims(decl.shape));
      }
      for (size_t d = 0; d < decl.shape.size(); ++d) {
        if (seg.start[d] < 0 || seg.size[d] <= 0 || seg.size[d] > decl.shape[d] ||
            seg.start[d] > decl.shape[d] - seg.size[d]) {
          return Status::invalid(where() + ": the box start " + dims(seg.start) + " size " + dims(seg.size) +
                                 " is not inside the tensor, " + decl.dtype + dims(decl.shape));
        }
      }
      if (segment_dtype(b, seg) != decl.dtype) {
        // Another dtype is a conversion on the way, if refit does it.
        const std::optional<DType> from = parse_dtype(decl.dtype);
        const std::optional<DType> to = parse_dtype(segment_dtype(b, seg));
        Result<ConversionKind> kind = from && to ? conversion_for(seg.tensor, *from, *to)
                                                 : Result<ConversionKind>(Status::invalid("unknown dtype"));
        if (!kind.is_ok()) {
          return Status::invalid(where() + ": the " + (seg.dtype.empty() ? "buffer" : "segment") + "'s dtype is " +
                                 segment_dtype(b, seg) + ", the sources declare the tensor as " + decl.dtype +
                                 ": " + kind.status().message());
        }
      }
    }
  }
  if (!full) return Status::ok();
  // The rest of what the planner checks of a receiver (every element inside
  // its buffer, no two segments overlapping, whole blocks and their scales),
  // by the planner itself: a layout of this receiver alone, with the
  // tensors it names.
  // Handed over one buffer at a time (LayoutBuilder), as a plan's layout is.
  // Handed over as values (LayoutBuilder's views), with no JSON.
  std::vector<LayoutBuilder::TensorView> tensors;
  std::deque<TensorDecl> derived;  // the scale tensors the views name
  std::unordered_set<std::string_view> named;
  for (const MemberBuffer& b : m.buffers) {
    for (const Segment& seg : b.segments) {
      if (!named.insert(seg.tensor).second) continue;
      TensorDecl scratch;
      const TensorDecl* d = find_decl(seg.tensor, m.weight_block_size, &scratch);
      if (d == &scratch) d = &derived.emplace_back(std::move(scratch));
      tensors.push_back(LayoutBuilder::TensorView{d->name, d->dtype, d->shape});
    }
  }
  const LayoutBuilder::RankView one{};
  LayoutBuilder builder("receiver rank " + std::to_string(rank) + " alone");
  REFIT_RETURN_IF_ERROR(builder.head(LayoutBuilder::HeadView{{&one, 1}, {&one, 1}, tensors, m.weight_block_size}));
  std::vector<LayoutBuilder::SegmentView> views;
  for (const MemberBuffer& b : m.buffers) REFIT_RETURN_IF_ERROR(add_buffer(builder, false, 0, b, {}, views));
  Result<Layout> alone = builder.finish();
  if (!alone.is_ok()) return alone.status();
  return resolve_conversions(*alone);
}

std::vector<int32_t> ControlState::planned_receivers() const {
  std::vector<int32_t> out;
  out.reserve(receivers_.size());
  for (const auto& [rank, r] : receivers_) {
    if (still_plannable(rank, r).is_ok()) out.push_back(rank);
  }
  return out;
}

bool ControlState::instance_complete(int32_t instance) const { return instance_shortfall(instance).empty(); }

std::string ControlState::instance_shortfall(int32_t instance) const {
  const std::vector<int32_t> ranks = instance_ranks(instance);
  if (ranks.empty()) return "";
  const int32_t declared = receivers_.at(ranks.front()).info->instance_ranks;
  if (declared == 0 || ranks.size() >= static_cast<size_t>(declared)) return "";
  return "instance " + std::to_string(instance) + " has " + std::to_string(ranks.size()) + " of its " +
         std::to_string(declared) + " ranks (\"instance_ranks\") registered";
}

bool ControlState::committed(int32_t rank, int64_t version) const {
  auto r = receivers_.find(rank);
  if (r == receivers_.end()) return false;
  auto c = committed_.find(r->second.info->instance);
  return c != committed_.end() && c->second >= version;
}

void ControlState::touch_session(uint64_t session, Clock::time_point now) {
  for (auto& [rank, s] : sources_) {
    if (s.session == session) s.last_seen = now;
  }
  for (auto& [rank, r] : receivers_) {
    if (r.session != session) continue;
    r.last_seen = now;
    // Its lease renewals wait behind the plan too (they share the connection).
    if (auto l = leases_.find(rank); l != leases_.end()) l->second.expires = std::max(l->second.expires, now + lease_timeout_);
  }
}

template <typename T>
Status ControlState::registered_again(const char* message, std::map<int32_t, Member<T>>& members, Role role,
                                      uint64_t session, const T& m, Clock::time_point now) {
  Member<T>& held = members.at(m.rank);
  const std::string who = std::string(message) + ": " + role_name(role) + " rank " + std::to_string(m.rank);
  if (held.session != 0) {
    return Status::invalid(who + " is already registered; unregister it first").with_reason(Reason::kRankHeld);
  }
  // The same member on a new connection: its plan, leases and staged state
  // stay as they are.
  held.session = session;
  held.last_seen = now;
  return Status::ok();
}

template <typename T>
Status ControlState::owned(const char* message, const std::map<int32_t, Member<T>>& members,
                           Role role, int32_t rank, uint64_t session) const {
  auto it = members.find(rank);
  if (it == members.end()) {
    return Status::not_found(std::string(message) + ": " + role_name(role) + " rank " +
                             std::to_string(rank) + " is not registered")
        .with_reason(Reason::kNotRegistered);
  }
  if (it->second.session != session) {
    return Status::invalid(std::string(message) + ": " + role_name(role) + " rank " +
                           std::to_string(rank) + " was registered by another connection");
  }
  return Status::ok();
}

Result<int32_t> ControlState::receiver_instance(uint64_t session, int32_t rank, const char* message) const {
  REFIT_RETURN_IF_ERROR(owned(message, receivers_, Role::kReceiver, rank, session));
  return receivers_.at(rank).info->instance;
}

std::set<int32_t> ControlState::instances() const {
  std::set<int32_t> out;
  for (const auto& [rank, r] : receivers_) out.insert(r.info->instance);
  return out;
}

void ControlState::remove_source(int32_t rank, const std::string& why) {
  auto it = sources_.find(rank);
  if (it == sources_.end()) return;
  for (const TensorDecl& t : it->second.info->tensors) {
    auto d = tensors_.find(t.name);
    if (d != tensors_.end() && --d->second.sources == 0) {
      tensors_.erase(d);
      ++decls_generation_;
      if (orphaned_.size() < kMaxOrphans || orphaned_.count(t.name)) {
        orphaned_[t.name] = "source rank " + std::to_string(rank) + ", the last that held it, " + why;
      }
    }
  }
  sources_.erase(it);
  membership_changed();
  advance_version();  // it may have been the last source behind
}

std::vector<int32_t> ControlState::instance_ranks(int32_t instance) const {
  std::vector<int32_t> out;
  for (const auto& [rank, r] : receivers_) {
    if (r.info->instance == instance) out.push_back(rank);
  }
  return out;
}

void ControlState::abort_instance(int32_t instance, int64_t version, const std::string& reason) {
  // Commit is final: a version the instance committed (or one older than
  // it) is never aborted.
  if (auto c = committed_.find(instance); c != committed_.end() && c->second >= version) return;
  for (int32_t rank : instance_ranks(instance)) {
    notices_.push_back(Notice{receivers_[rank].session, MsgType::kAbort,
                              to_json(VersionNotice{MsgType::kAbort, instance, version, reason})});
  }
  barriers_.erase(instance);
  int64_t& last = aborted_[instance];
  last = std::max(last, version);
  // The instance's ranks stop refreshing `version`: whoever still refreshes
  // it goes on with solo parts (wants_solo).
  solo_version_ = std::max(solo_version_, version);
}

void ControlState::remove_receiver(int32_t rank, const std::string& why) {
  auto it = receivers_.find(rank);
  if (it == receivers_.end()) return;
  const int32_t instance = it->second.info->instance;
  if (auto d = declaration_members_.find(it->second.declaration); d != declaration_members_.end() && --d->second == 0) {
    declaration_members_.erase(d);
    count_receiver_dtypes(*it->second.info, /*add=*/false);
  }
  receivers_.erase(it);
  if (instance_ranks(instance).empty()) {
    aborted_.erase(instance);
    committed_.erase(instance);
  }
  membership_changed();
  // A rank that leaves in the middle of a refresh (it holds a lease) takes
  // that version down for its whole instance: the others keep their old
  // version instead of committing it without the rank.
  int64_t refreshing = 0;
  if (auto l = leases_.find(rank); l != leases_.end()) {
    refreshing = l->second.version;
    leases_.erase(l);
    notify_drained();
  }
  auto b = barriers_.find(instance);
  const int64_t version = std::max(refreshing, b != barriers_.end() ? b->second.version : int64_t{0});
  if (version > 0 && !instance_ranks(instance).empty()) {
    abort_instance(instance, version, "receiver rank " + std::to_string(rank) + " " + why);
  }
}

Status ControlState::unregister(uint64_t session, const MemberRef& m) {
  if (m.role == Role::kSource) {
    REFIT_RETURN_IF_ERROR(owned("unregister", sources_, m.role, m.rank, session));
    remove_source(m.rank, "unregistered");
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

Status ControlState::publish(uint64_t session, int64_t version, std::vector<BoxHash> hashes) {
  std::vector<std::pair<int32_t, Member<RegisterSource>*>> mine;
  for (auto& [rank, s] : sources_) {
    if (s.session == session) mine.emplace_back(rank, &s);
  }
  if (mine.empty()) {
    // A source declared dead has no registration left: it registers again.
    return Status::not_found("publish_version: only a connection that registered a source may publish, and this "
                             "one holds none (never registered, or declared dead)")
        .with_reason(Reason::kNotRegistered);
  }
  for (const auto& [rank, s] : mine) {
    if (version <= s->published) {
      return Status::invalid("publish_version: version " + std::to_string(version) +
                             " is not newer than version " + std::to_string(s->published) +
                             ", which source rank " + std::to_string(rank) + " already published");
    }
  }
  // Check every hash before anything changes.
  std::map<std::string, Hashed> incoming;
  static const std::map<std::string, Hashed> kNone;
  auto kv = hashes_.find(version);
  const std::map<std::string, Hashed>& known = kv == hashes_.end() ? kNone : kv->second;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const BoxHash& h = hashes[i];
    const std::string where = "publish_version: hashes[" + std::to_string(i) + "] (tensor \"" + h.tensor +
                              "\" start " + dims(h.start) + " size " + dims(h.size) + ")";
    auto src = std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.first == h.rank; });
    if (src == mine.end()) {
      return Status::invalid(where + " names source rank " + std::to_string(h.rank) +
                             ", which this connection did not register");
    }
    bool inside = false;
    for (const MemberBuffer& b : src->second->info->buffers) {
      for (const Segment& seg : b.segments) inside = inside || (seg.tensor == h.tensor && box_inside(seg, h.start, h.size));
    }
    // A box of a block scale tensor "<W>_scale_inv" (verify_boxes): the
    // scales of whole blocks of W the rank holds, in the receivers' block.
    // With no receiver left, no one checks it: it is not kept.
    const std::string weight = scale_weight(h.tensor);
    if (!inside && !weight.empty() && tensors_.count(weight) != 0 && h.dtype.empty()) {
      if (receivers_.empty()) continue;
      const std::array<int64_t, 2>& block = receivers_.begin()->second.info->weight_block_size;
      const std::vector<int64_t>& shape = tensors_.at(weight).decl.shape;
      std::vector<int64_t> wstart = h.start, wsize = h.size;
      const size_t n = wstart.size();
      if (n >= 2 && n == shape.size()) {
        for (size_t k = 0; k < 2; ++k) {
          const size_t d = n - 2 + k;
          wstart[d] = h.start[d] * block[k];
          wsize[d] = std::min((h.start[d] + h.size[d]) * block[k], shape[d]) - wstart[d];
        }
        for (const MemberBuffer& b : src->second->info->buffers) {
          for (const Segment& seg : b.segments) inside = inside || (seg.tensor == weight && box_inside(seg, wstart, wsize));
        }
      }
    }
    if (!inside) return Status::invalid(where + " is not inside a segment of source rank " + std::to_string(h.rank));
    const std::string key = box_key(h.tensor, h.start, h.size) + (h.dtype.empty() ? "" : "@" + h.dtype);
    using Seen = const std::map<std::string, Hashed>*;
    for (Seen seen : {Seen{&known}, Seen{&incoming}}) {
      auto it = seen->find(key);
      if (it != seen->end() && it->second.hash != h.hash) {
        return Status::invalid(where + ": source rank " + std::to_string(h.rank) + " hashed version " +
                               std::to_string(version) + " of it to " + std::to_string(h.hash) +
                               ", source rank " + std::to_string(it->second.rank) + " to " +
                               std::to_string(it->second.hash) +
                               ": the sources hold different contents for one version");
      }
    }
    incoming.emplace(key, Hashed{h.hash, h.rank});
  }
  for (auto& [rank, s] : mine) s->published = version;
  if (!incoming.empty()) hashes_[version].merge(incoming);
  advance_version();
  prune_hashes();
  return Status::ok();
}

void ControlState::prune_hashes() {
  // A receiver reads the group version or, under a lease, an older one;
  // newer versions are still being published. At most kKeep versions are
  // kept, the newest.
  constexpr size_t kKeep = 8;
  int64_t oldest = version_;
  for (const auto& [rank, l] : leases_) oldest = std::min(oldest, l.version);
  while (!hashes_.empty() && (hashes_.begin()->first < oldest || hashes_.size() > kKeep)) {
    hashes_.erase(hashes_.begin());
  }
}

Result<Json> ControlState::verify_boxes(uint64_t session) const {
  Json boxes = Json::array();
  // The tensors of the connection's sources that receivers hold in another
  // dtype: what a source with "quantize": "source" converts at publish.
  std::map<std::string, Json> converts;
  bool is_source = false;
  std::vector<int64_t> start, size, sstart, ssize;
  // Each receiver's block scale segments by tensor, for a quantized box.
  std::map<std::pair<int32_t, std::string>, std::vector<const Segment*>> segments_of;
  for (const auto& [rr, r] : receivers_) {
    for (const MemberBuffer& rb : r.info->buffers) {
      for (const Segment& want : rb.segments) {
        if (!scale_weight(want.tensor).empty()) segments_of[{rr, want.tensor}].push_back(&want);
      }
    }
  }
  for (const auto& [rank, s] : sources_) {
    if (s.session != session) continue;
    is_source = true;
    // Box key -> its index in `boxes`, and the scale boxes it lists.
    std::map<std::string, std::pair<size_t, std::set<std::string>>> seen;
    for (const MemberBuffer& b : s.info->buffers) {
      for (const Segment& seg : b.segments) {
        if (converted_copy(b, seg)) continue;  // "quantize": "source": hashed as the segment it copies
        for (const auto& [rr, r] : receivers_) {
          for (const MemberBuffer& rb : r.info->buffers) {
            for (const Segment& want : rb.segments) {
              if (want.tensor != seg.tensor || !intersect_box(seg, want, &start, &size)) continue;
              // A receiver of another dtype checks the converted bytes: the
              // source converts the box before hashing it, which it can do
              // for a quantized tensor only when the box holds whole blocks.
              const std::string& to = segment_dtype(rb, want);
              const bool convert = to != tensors_.at(seg.tensor).decl.dtype;
              const bool quantize = convert && to == "F8_E4M3";
              if (convert) {
                converts[seg.tensor] = {{"tensor", seg.tensor}, {"dtype", to}, {"block", r.info->weight_block_size}};
              }
              if (quantize && !whole_blocks(start, size, tensors_.at(seg.tensor).decl.shape, r.info->weight_block_size)) {
                continue;
              }
              auto [it, added] = seen.try_emplace(box_key(seg.tensor, start, size) + (convert ? "@" + to : ""),
                                                  boxes.size(), std::set<std::string>());
              if (added) {
                boxes.push_back({{"rank", rank}, {"tensor", seg.tensor}, {"start", start}, {"size", size}});
                if (convert) {
                  boxes.back()["dtype"] = to;
                  boxes.back()["block"] = r.info->weight_block_size;
                }
              }
              if (!quantize) continue;
              // The scales of the box's blocks, as this receiver's scale
              // segments hold them: the source computes them too.
              const IndexBox blocks = scale_box_of(start, size, r.info->weight_block_size);
              const Segment grid{scale_tensor_name(seg.tensor), blocks.start, blocks.size, 0, {}};
              auto scale_segments = segments_of.find({rr, grid.tensor});
              if (scale_segments == segments_of.end()) continue;
              for (const Segment* held : scale_segments->second) {
                if (!intersect_box(grid, *held, &sstart, &ssize)) continue;
                if (!it->second.second.insert(box_key(grid.tensor, sstart, ssize)).second) continue;
                boxes[it->second.first]["scales"].push_back({{"start", sstart}, {"size", ssize}});
              }
            }
          }
        }
      }
    }
  }
  if (!is_source) {
    return Status::not_found("verify_boxes: only a connection that registered a source may ask, and this one holds "
                             "none (never registered, or declared dead)")
        .with_reason(Reason::kNotRegistered);
  }
  Json convert = Json::array();
  for (auto& [name, c] : converts) convert.push_back(std::move(c));
  return Json{{"boxes", std::move(boxes)}, {"convert", std::move(convert)}};
}

Result<Json> ControlState::version_hashes(uint64_t session, const VersionHashes& m) const {
  REFIT_RETURN_IF_ERROR(owned("version_hashes", receivers_, Role::kReceiver, m.rank, session));
  const Member<RegisterReceiver>& r = receivers_.at(m.rank);
  static const std::map<std::string, Hashed> kNone;
  auto v = hashes_.find(m.version);
  const auto& known = v == hashes_.end() ? kNone : v->second;
  // The sources' segments by tensor.
  std::map<std::string, std::vector<const Segment*>> held;
  for (const auto& [rank, s] : sources_) {
    for (const MemberBuffer& b : s.info->buffers) {
      for (const Segment& seg : b.segments)
        if (!converted_copy(b, seg)) held[seg.tensor].push_back(&seg);
    }
  }
  // The receiver's F8_E4M3 segments by tensor, for its scale segments.
  std::map<std::string, std::vector<const Segment*>> quantized;
  for (const MemberBuffer& b : r.info->buffers) {
    for (const Segment& seg : b.segments) {
      if (segment_dtype(b, seg) == "F8_E4M3") quantized[seg.tensor].push_back(&seg);
    }
  }
  Json hashes = Json::array(), unverified = Json::array();
  int64_t unverified_bytes = 0;
  std::vector<int64_t> start, size;
  for (size_t bi = 0; bi < r.info->buffers.size(); ++bi) {
    const MemberBuffer& b = r.info->buffers[bi];
    for (size_t si = 0; si < b.segments.size(); ++si) {
      const Segment& want = b.segments[si];
      const std::optional<DType> dt = parse_dtype(segment_dtype(b, want));
      const int64_t elem = dt ? dtype_bytes(*dt) : 1;
      auto h = held.find(want.tensor);
      if (h == held.end()) {
        scale_hashes(want, bi, si, r.info->weight_block_size, quantized, held, known, &hashes, &unverified_bytes,
                     &unverified);
        continue;
      }
      // A box converted on the way has the hash of its converted bytes
      // (verify_boxes), under its dtype.
      auto decl = tensors_.find(want.tensor);
      const bool converted = decl != tensors_.end() && decl->second.decl.dtype != segment_dtype(b, want);
      const std::string suffix = converted ? "@" + segment_dtype(b, want) : "";
      std::set<std::string> seen;
      for (const Segment* seg : h->second) {
        if (!intersect_box(want, *seg, &start, &size)) continue;
        const std::string key = box_key(want.tensor, start, size);
        if (!seen.insert(key).second) continue;
        auto it = known.find(key + suffix);
        if (it != known.end()) {
          hashes.push_back({{"buffer", bi}, {"segment", si}, {"start", start}, {"size", size},
                            {"hash", it->second.hash}, {"rank", it->second.rank}});
        } else {
          unverified_bytes += numel(size) * elem;
          if (unverified.size() < 8) unverified.push_back({{"tensor", want.tensor}, {"start", start}, {"size", size}});
        }
      }
    }
  }
  return Json{{"hashes", std::move(hashes)}, {"unverified_bytes", unverified_bytes},
              {"unverified", std::move(unverified)}};
}

void ControlState::scale_hashes(const Segment& want, size_t bi, size_t si, const std::array<int64_t, 2>& block,
                                const std::map<std::string, std::vector<const Segment*>>& quantized,
                                const std::map<std::string, std::vector<const Segment*>>& held,
                                const std::map<std::string, Hashed>& known, Json* hashes, int64_t* unverified_bytes,
                                Json* unverified) const {
  const std::string weight = scale_weight(want.tensor);
  auto sources = held.find(weight);
  auto mine = quantized.find(weight);
  if (weight.empty() || sources == held.end() || mine == quantized.end()) return;
  const std::vector<int64_t>& shape = tensors_.at(weight).decl.shape;
  // Each element of `want` some box reaches: 1 unverified, 2 verified. A
  // block that several boxes reach (sources that cut it) counts once.
  std::vector<uint8_t> state(static_cast<size_t>(numel(want.size)), 0);
  auto mark = [&](const std::vector<int64_t>& start, const std::vector<int64_t>& size, uint8_t v) {
    std::vector<int64_t> idx(start.size(), 0);
    while (true) {
      int64_t flat = 0;
      for (size_t d = 0; d < idx.size(); ++d) flat = flat * want.size[d] + (start[d] + idx[d] - want.start[d]);
      state[static_cast<size_t>(flat)] = std::max(state[static_cast<size_t>(flat)], v);
      size_t d = idx.size();
      while (d > 0 && ++idx[d - 1] == size[d - 1]) idx[--d] = 0;
      if (d == 0) break;
    }
  };
  std::set<std::string> seen;
  std::vector<int64_t> start, size, sstart, ssize;
  for (const Segment* ws : mine->second) {
    for (const Segment* seg : sources->second) {
      // A box of the weight this receiver checks (version_hashes), and the
      // part of this scale segment that holds its blocks' scales.
      if (!intersect_box(*ws, *seg, &start, &size)) continue;
      const IndexBox blocks = scale_box_of(start, size, block);
      const Segment grid{want.tensor, blocks.start, blocks.size, 0, {}};
      if (!intersect_box(grid, want, &sstart, &ssize)) continue;
      const std::string key = box_key(want.tensor, sstart, ssize);
      if (!seen.insert(key).second) continue;
      auto it = whole_blocks(start, size, shape, block) ? known.find(key) : known.end();
      if (it != known.end()) {
        hashes->push_back({{"buffer", bi}, {"segment", si}, {"start", sstart}, {"size", ssize},
                           {"hash", it->second.hash}, {"rank", it->second.rank}});
        mark(sstart, ssize, 2);
      } else {
        mark(sstart, ssize, 1);
        if (unverified->size() < 8) unverified->push_back({{"tensor", want.tensor}, {"start", sstart}, {"size", ssize}});
      }
    }
  }
  *unverified_bytes += static_cast<int64_t>(std::count(state.begin(), state.end(), uint8_t{1})) * 4;
}

void ControlState::advance_version() {
  if (sources_.empty()) return;  // no source: nothing newer is available
  int64_t low = sources_.begin()->second.published;
  for (const auto& [rank, s] : sources_) low = std::min(low, s.published);
  if (low <= version_) return;
  version_ = low;
  for (uint64_t s : subscribers_) {
    notices_.push_back(Notice{s, MsgType::kVersionNotify, to_json(VersionNotice{MsgType::kVersionNotify, 0, low, ""})});
  }
}

Status ControlState::subscribe(uint64_t session) {
  if (!subscribers_.count(session) && subscribers_.size() >= limits_.max_subscribers) {
    return Status::invalid("subscribe: the coordinator already holds the limit of " +
                           std::to_string(limits_.max_subscribers) + " subscribers");
  }
  subscribers_.insert(session);
  return Status::ok();
}

ControlState::CopyFilter ControlState::stale_copies(const std::array<int64_t, 2>& block,
                                                    const std::vector<int32_t>& planned) const {
  // What the planned receivers hold each converted tensor as (the
  // receivers of one declaration hold the same: one of them is read).
  std::map<std::string, std::string> held_as;
  std::unordered_set<uint64_t> read;  // declarations
  for (int32_t rank : planned) {
    const Member<RegisterReceiver>& r = receivers_.at(rank);
    if (!read.insert(r.declaration).second) continue;
    for (const MemberBuffer& b : r.info->buffers) {
      for (const Segment& s : b.segments) held_as.emplace(s.tensor, segment_dtype(b, s));
    }
  }
  return [this, block, held_as = std::move(held_as)](const MemberBuffer& b, const Segment& s) {
    auto t = tensors_.find(s.tensor);
    if (t == tensors_.end()) {  // a copy's scales: inside the scale tensor of today's block
      const std::optional<TensorDecl> d = decl_of(s.tensor, block);
      if (!d || d->shape.size() != s.start.size() || s.size.size() != s.start.size()) return true;
      for (size_t i = 0; i < s.start.size(); ++i) {
        if (s.start[i] < 0 || s.size[i] < 0 || s.start[i] > d->shape[i] || s.size[i] > d->shape[i] - s.start[i]) return true;
      }
      return false;
    }
    const std::string dtype = segment_dtype(b, s);
    if (dtype == t->second.decl.dtype) return false;  // the tensor itself
    auto h = held_as.find(s.tensor);
    return h == held_as.end() || h->second != dtype;
  };
}

void ControlState::layout_pieces(bool solo, PlanInput* in) const {
  Json sources = Json::array(), receivers = Json::array(), tensors = Json::array();
  std::vector<const Declared*> ordered;
  ordered.reserve(tensors_.size());
  for (const auto& [name, d] : tensors_) ordered.push_back(&d);
  std::sort(ordered.begin(), ordered.end(), [](const Declared* a, const Declared* b) { return a->order < b->order; });
  for (const Declared* d : ordered) {
    tensors.push_back({{"name", d->decl.name}, {"dtype", d->decl.dtype}, {"shape", d->decl.shape}});
  }
  // The block scale tensors the planned receivers hold: derived, not declared.
  std::array<int64_t, 2> block{128, 128};
  std::set<std::string> derived, described;
  // Which receivers can be planned is worked out once: each asks of every
  // segment it registered.
  const std::vector<int32_t> planned = planned_receivers();
  std::unordered_set<uint64_t> read;  // declarations: their receivers name the same tensors
  for (int32_t rank : planned) {
    const Member<RegisterReceiver>& member = receivers_.at(rank);
    const RegisterReceiver& r = *member.info;
    block = r.weight_block_size;
    if (!read.insert(member.declaration).second) continue;
    for (const MemberBuffer& b : r.buffers) {
      for (const Segment& s : b.segments) {
        if (tensors_.count(s.tensor) || !derived.insert(s.tensor).second) continue;
        if (std::optional<TensorDecl> d = decl_of(s.tensor, block)) {
          tensors.push_back({{"name", d->name}, {"dtype", d->dtype}, {"shape", d->shape}});
          described.insert(d->name);
        }
      }
    }
  }
  // A source's segment of a tensor the document lacks (the scales of a copy
  // it quantized, "quantize": "source", that no planned receiver holds) is
  // left out, and so is a copy made for what the receivers held before
  // (another dtype or block) until the source's next publish replaces it.
  const CopyFilter stale = stale_copies(block, planned);
  // Each tensor the document lists, by name: its declared dtype, or none
  // for a derived scale tensor. Hashed: a membership has millions of
  // segments, each looked up once.
  std::unordered_map<std::string_view, const std::string*> listed;
  listed.reserve(tensors_.size() + described.size());
  for (const auto& [name, d] : tensors_) listed.emplace(name, &d.decl.dtype);
  for (const std::string& name : described) listed.emplace(name, nullptr);
  // A receiver's segments left out depend on its declaration alone: found
  // once for each.
  std::unordered_map<uint64_t, std::vector<std::pair<uint32_t, uint32_t>>> receivers_left_out;
  auto add_member = [&](bool source, int32_t position, const auto& info, uint64_t declaration) {
    PlanInput::MemberBuffers m;
    m.source = source;
    m.position = position;
    m.buffers = std::shared_ptr<const std::vector<MemberBuffer>>(info, &info->buffers);
    if (!source) {
      if (auto known = receivers_left_out.find(declaration); known != receivers_left_out.end()) {
        m.left_out = known->second;
        in->members.push_back(std::move(m));
        return;
      }
    }
    for (size_t bi = 0; bi < info->buffers.size(); ++bi) {
      const MemberBuffer& b = info->buffers[bi];
      for (size_t si = 0; si < b.segments.size(); ++si) {
        const Segment& s = b.segments[si];
        const auto t = listed.find(s.tensor);
        bool out = t == listed.end();
        // A source's segment of the declared tensor itself is never stale:
        // only its copies in other dtypes and their scales are looked at.
        if (!out && source && !(t->second && segment_dtype(b, s) == *t->second)) out = stale(b, s);
        if (out) m.left_out.emplace_back(static_cast<uint32_t>(bi), static_cast<uint32_t>(si));
      }
    }
    if (!source) receivers_left_out.emplace(declaration, m.left_out);
    in->members.push_back(std::move(m));
  };
  // The maps iterate in rank order, so position i is the i-th live rank.
  int32_t dense = 0;
  for (const auto& [rank, s] : sources_) {
    sources.push_back({{"rank", dense}, {"domain", s.info->domain}});
    add_member(true, dense++, s.info, 0);
  }
  dense = 0;
  for (int32_t rank : planned) {
    const Member<RegisterReceiver>& r = receivers_.at(rank);
    receivers.push_back({{"rank", dense}, {"domain", solo ? dense : r.info->domain}, {"instance", r.info->instance}});
    add_member(false, dense++, r.info, r.declaration);
  }
  in->receiver_ranks = planned;
  in->layout_head = Json{{"format", "refit-layout/1"}, {"sources", std::move(sources)},
                         {"receivers", std::move(receivers)}, {"tensors", std::move(tensors)},
                         {"weight_block_size", block}};
}

namespace {

// Member `m`'s buffer `bi` as the document lists it; `skip` walks m.left_out.
Json buffer_entry(const PlanInput::MemberBuffers& m, size_t bi, size_t* skip) {
  const size_t from = *skip;
  while (*skip < m.left_out.size() && m.left_out[*skip].first == bi) ++*skip;
  return buffer_json(m.source, m.position, (*m.buffers)[bi],
                     std::span<const std::pair<uint32_t, uint32_t>>(m.left_out.data() + from, *skip - from));
}

}  // namespace

Result<Layout> membership_layout(const PlanInput& input) {
  if (!input.layout_json.empty()) return parse_layout_json(input.layout_json, "membership");
  LayoutBuilder builder("membership");
  REFIT_RETURN_IF_ERROR(builder.head(input.layout_head));
  std::vector<LayoutBuilder::SegmentView> views;
  for (const PlanInput::MemberBuffers& m : input.members) {
    size_t skip = 0;
    for (size_t bi = 0; bi < m.buffers->size(); ++bi) {
      const size_t from = skip;
      while (skip < m.left_out.size() && m.left_out[skip].first == bi) ++skip;
      REFIT_RETURN_IF_ERROR(add_buffer(builder, m.source, m.position, (*m.buffers)[bi],
                                       std::span<const std::pair<uint32_t, uint32_t>>(m.left_out.data() + from,
                                                                                      skip - from),
                                       views));
    }
  }
  return builder.finish(input.layout_head);
}

Json ControlState::layout_document(bool solo) const {
  PlanInput in;
  layout_pieces(solo, &in);
  Json buffers = Json::array();
  for (const PlanInput::MemberBuffers& m : in.members) {
    size_t skip = 0;
    for (size_t bi = 0; bi < m.buffers->size(); ++bi) buffers.push_back(buffer_entry(m, bi, &skip));
  }
  Json doc = std::move(in.layout_head);
  doc["buffers"] = std::move(buffers);
  return doc;
}

PlanInput ControlState::plan_input(bool solo) const {
  PlanInput in;
  in.epoch = epoch_;
  in.solo = solo;
  layout_pieces(solo, &in);  // and in.receiver_ranks
  in.source_ranks.reserve(sources_.size());
  for (const auto& [rank, s] : sources_) in.source_ranks.push_back(rank);
  in.relayout_below_bytes = relayout_below_bytes_;
  in.relayout_staging_bytes = relayout_staging_bytes_;
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

// One rank's list of entries in its part, grouping as it goes (the message's
// run groups, docs/refresh.md "The plan part"): a run that continues the last
// entry (same kind, ends and bytes, its offsets at the group's strides from
// the previous run) extends that entry's count instead of adding one, so a
// column slice of a row-major source costs one entry, not one per row. Only
// consecutive runs merge, so the list expands to exactly the runs added, in
// their order; a convert step ends the open group. The planner's run groups
// are added whole, with the result of adding their runs one by one.
class PartList {
 public:
  void add(const RunGroup& g) {
    if (!extends(g.run)) {
      part_.entries.push_back(PartEntry{g.run});
      open_ = true;
    }
    if (g.count == 1) return;
    // The group's second run continues the entry if the entry's stride is
    // the group's (or the entry has one run); then so do all the others.
    // Otherwise the second run starts an entry that the rest continue.
    PartEntry& e = part_.entries.back();
    const std::array<int64_t, 2> step{g.from_stride, g.to_stride};
    if (e.count == 1 || e.stride == step) {
      e.stride = step;
      e.count += g.count - 1;
      return;
    }
    PartEntry next{g.at(1), g.count - 1};
    if (next.count >= 2) next.stride = step;
    part_.entries.push_back(next);
  }
  void add_step(const ConvertStep& c) {
    part_.entries.push_back(PartEntry{Run{}, 1, {}, static_cast<int32_t>(part_.steps.size())});
    part_.steps.push_back(c);
    open_ = false;
  }
  PlannedPart take() {
    part_.entries.shrink_to_fit();
    part_.steps.shrink_to_fit();
    return std::move(part_);
  }

 private:
  // Whether `run` continues the open entry, counting it in if so.
  bool extends(const Run& run) {
    if (!open_) return false;
    PartEntry& e = part_.entries.back();
    const Run& f = e.run;
    if (run.local != f.local || run.bytes != f.bytes || run.from.side != f.from.side ||
        run.from.rank != f.from.rank || run.from.buffer != f.from.buffer || run.to.rank != f.to.rank ||
        run.to.buffer != f.to.buffer) {
      return false;
    }
    // From the entry's last run.
    int64_t last_from = 0, last_to = 0;
    if (__builtin_mul_overflow(e.count - 1, e.stride[0], &last_from) ||
        __builtin_add_overflow(f.from.offset, last_from, &last_from) ||
        __builtin_mul_overflow(e.count - 1, e.stride[1], &last_to) ||
        __builtin_add_overflow(f.to.offset, last_to, &last_to)) {
      return false;
    }
    std::array<int64_t, 2> step{};
    if (__builtin_sub_overflow(run.from.offset, last_from, &step[0]) ||
        __builtin_sub_overflow(run.to.offset, last_to, &step[1]) || (e.count >= 2 && step != e.stride)) {
      return false;
    }
    e.stride = step;
    ++e.count;
    return true;
  }

  PlannedPart part_;
  bool open_ = false;  // the last entry is a run group that may go on
};

}  // namespace

std::shared_ptr<const PlannedParts> compute_plan(const PlanInput& input) {
  auto out = std::make_shared<PlannedParts>();
  out->epoch = input.epoch;
  out->solo = input.solo;
  std::string note = renumbering("source", input.source_ranks);
  const std::string receivers_note = renumbering("receiver", input.receiver_ranks);
  if (!receivers_note.empty()) note += (note.empty() ? "" : "; ") + receivers_note;
  auto failed = [&](const Status& st) {
    out->status = note.empty() ? st : st.with_context("the layout numbers the live " + note);
    return out;
  };
  Result<Layout> layout = membership_layout(input);
  if (!layout.is_ok()) return failed(layout.status());
  Layout& L = *layout;
  if (Status st = resolve_conversions(L); !st.is_ok()) return failed(st);
  PlanOptions options;
  options.relayout_below_bytes = input.relayout_below_bytes;
  options.relayout_staging_bytes = input.relayout_staging_bytes;
  Result<Plan> plan = make_plan(L, options);
  if (!plan.is_ok()) return failed(plan.status());
  out->network_bytes = plan->summary().network_bytes;
  out->minimum_network_bytes = plan->summary().minimum_network_bytes;
  out->local_bytes = plan->summary().local_bytes;
  // The document's dense positions back to the registered ranks.
  auto real = [&input](bool source, int32_t position) {
    const std::vector<int32_t>& ranks = source ? input.source_ranks : input.receiver_ranks;
    return position >= 0 && static_cast<size_t>(position) < ranks.size() ? ranks[position] : position;
  };
  out->buffer_names.reserve(L.buffers.size());
  for (const Buffer& b : L.buffers) out->buffer_names.push_back(b.name);
  out->weight_block_size = L.weight_block_size;
  std::map<int32_t, PartList> lists;
  auto on_group = [&](const RunGroup& g) {
    RunGroup named = g;
    named.run.from.rank = real(g.run.from.side == Side::kSource, g.run.from.rank);
    named.run.to.rank = real(false, g.run.to.rank);
    if (g.run.local && named.run.from.rank != named.run.to.rank) lists[named.run.from.rank].add(named);
    lists[named.run.to.rank].add(named);
  };
  // A converted tensor's puller converts what it pulled before the fan-out
  // (docs/conversion.md, "At the receiver"); a relayouted unit's puller
  // copies it into its layout (one dtype, docs/refresh.md "Column-major
  // receivers").
  auto on_convert = [&](const ConvertStep& c) {
    if (out->tensors.size() <= c.tensor) out->tensors.resize(L.tensors.size());
    PlannedParts::StepTensor& t = out->tensors[c.tensor];
    if (t.name.empty()) {
      t = PlannedParts::StepTensor{L.tensors[c.tensor].name, L.tensors[c.tensor].dtype,
                                   L.tensors[c.tensor].dtype_on(Side::kReceiver)};
    }
    ConvertStep named = c;
    named.rank = real(false, c.rank);
    lists[named.rank].add_step(named);
  };
  if (Status st = for_each_run_group(*plan, on_group, on_convert); !st.is_ok()) return failed(st);
  for (auto& [rank, list] : lists) out->parts[rank] = list.take();
  return out;
}

Json PlannedParts::part(int32_t rank) const {
  Json list = Json::array();
  auto it = parts.find(rank);
  if (it == parts.end()) return list;
  const PlannedPart& p = it->second;
  for (const PartEntry& e : p.entries) {
    if (e.step >= 0) {
      const ConvertStep& c = p.steps[e.step];
      const StepTensor& t = tensors[c.tensor];
      auto dims = [&c](const Index& v) { return std::vector<int64_t>(v.begin(), v.begin() + c.box.ndim); };
      Json j = {{"kind", "convert"}, {"tensor", t.name}, {"from_dtype", dtype_name(t.from)},
                {"to_dtype", dtype_name(t.to)}, {"block", weight_block_size},
                {"stage", c.stage_offset}, {"start", dims(c.box.start)}, {"size", dims(c.box.size)},
                {"dst", {{"buffer", buffer_names[c.buffer]}, {"offset", c.offset}, {"strides", dims(c.strides)}}}};
      if (c.scale_tensor >= 0) {
        j["scales"] = {{"buffer", buffer_names[c.scale_buffer]}, {"offset", c.scale_offset},
                       {"strides", dims(c.scale_strides)}};
      }
      list.push_back(std::move(j));
      continue;
    }
    const Run& run = e.run;
    Json j = {{"kind", run.local ? "local" : "net"},
              {"from", {{"side", side_name(run.from.side)}, {"rank", run.from.rank},
                        {"buffer", buffer_names[run.from.buffer]}, {"offset", run.from.offset}}},
              {"bytes", run.bytes}};
    if (run.to.buffer == kStagingBuffer) {
      j["to"] = {{"rank", run.to.rank}, {"stage", true}, {"offset", run.to.offset}};
    } else {
      j["to"] = {{"rank", run.to.rank}, {"buffer", buffer_names[run.to.buffer]}, {"offset", run.to.offset}};
    }
    if (e.count >= 2) {
      j["count"] = e.count;
      j["stride"] = {e.stride[0], e.stride[1]};
    }
    list.push_back(std::move(j));
  }
  return list;
}

Status ControlState::check_fetch(uint64_t session, int32_t rank) const {
  return owned("fetch_plan", receivers_, Role::kReceiver, rank, session);
}

bool ControlState::wants_solo(int32_t rank) const {
  auto l = leases_.find(rank);
  return l != leases_.end() && l->second.version <= solo_version_;
}

bool ControlState::install_plan(std::shared_ptr<const PlannedParts> plan) {
  if (!plan || plan->epoch != epoch_) return false;
  (plan->solo ? solo_plan_ : plan_) = std::move(plan);
  ++plans_made_;
  return true;
}

Result<Json> ControlState::cached_part(int32_t rank) const {
  REFIT_RETURN_IF_ERROR(cached_part_status(rank));
  return (wants_solo(rank) ? solo_plan_ : plan_)->part(rank);
}

Status ControlState::cached_part_status(int32_t rank) const {
  if (auto r = receivers_.find(rank); r != receivers_.end()) {
    // Left out of the plan: the others are planned without it.
    REFIT_RETURN_IF_ERROR(
        still_plannable(rank, r->second).with_context("fetch_plan: this receiver cannot be planned"));
  }
  const bool solo = wants_solo(rank);
  if (!variant_current(solo)) return Status::internal("fetch_plan: no plan of the current membership");
  const PlannedParts& plan = *(solo ? solo_plan_ : plan_);
  if (!plan.status.is_ok()) return plan.status.with_context("fetch_plan: the membership cannot be planned");
  return Status::ok();
}

Json ControlState::plan_totals(int32_t rank) const {
  const auto& plan = wants_solo(rank) ? solo_plan_ : plan_;
  if (!plan) return Json::object();
  Json totals{{"network_bytes", plan->network_bytes},
              {"minimum_network_bytes", plan->minimum_network_bytes},
              {"local_bytes", plan->local_bytes}};
  if (plan->solo) totals["solo"] = true;
  return totals;
}

Json peers_from(const PeerDirectory& directory, int32_t rank, bool solo, const Json& runs) {
  // (side, rank) -> buffer names the runs use there.
  std::map<std::pair<bool, int32_t>, std::set<std::string>> used;
  for (const Json& run : runs) {
    if (run["kind"] == "convert") continue;  // names this rank's own buffers only
    const bool from_source = run["from"]["side"] == "source";
    const int32_t from = run["from"]["rank"].get<int32_t>();
    const int32_t to = run["to"]["rank"].get<int32_t>();
    if (from_source || from != rank) used[{from_source, from}].insert(run["from"]["buffer"].get<std::string>());
    if (to != rank && run["to"].contains("buffer")) used[{false, to}].insert(run["to"]["buffer"].get<std::string>());
  }
  Json sources = Json::array(), receivers = Json::array();
  auto describe = [](int32_t r, const PeerDirectory::Member& m, const std::set<std::string>& names) {
    Json bs = Json::array();
    for (const PeerBuffer& b : m.buffers) {
      if (names.count(b.name)) bs.push_back({{"name", b.name}, {"address", b.address}, {"rkey", Json::binary(b.rkey)}});
    }
    return Json{{"rank", r}, {"worker_address", Json::binary(m.worker_address)}, {"buffers", std::move(bs)}};
  };
  for (const auto& [key, names] : used) {
    const auto& side = key.first ? directory.sources : directory.receivers;
    auto it = side.find(key.second);
    if (it != side.end()) (key.first ? sources : receivers).push_back(describe(key.second, it->second, names));
  }
  // Every receiver of the rank's domain, with its contact: a fabric that
  // needs the whole domain (one NCCL communicator) builds it from this list.
  Json domain = Json::array();
  auto me = directory.receivers.find(rank);
  if (me != directory.receivers.end()) {
    for (const auto& [r, m] : directory.receivers) {
      if (solo ? r == rank : m.domain == me->second.domain) {
        domain.push_back({{"rank", r}, {"worker_address", Json::binary(m.worker_address)}});
      }
    }
  }
  return Json{{"sources", std::move(sources)}, {"receivers", std::move(receivers)}, {"domain", std::move(domain)}};
}

Json ControlState::peers_of(int32_t rank, const Json& runs) const {
  return peers_from(*peer_directory(), rank, wants_solo(rank), runs);
}

std::shared_ptr<const PeerDirectory> ControlState::peer_directory() const {
  auto out = std::make_shared<PeerDirectory>();
  out->epoch = epoch_;
  auto copy = [](const auto& info) {
    PeerDirectory::Member m;
    m.worker_address = info.worker_address;
    m.domain = info.domain;
    m.buffers.reserve(info.buffers.size());
    for (const MemberBuffer& b : info.buffers) m.buffers.push_back(PeerBuffer{b.name, b.address, b.rkey});
    return m;
  };
  for (const auto& [rank, s] : sources_) out->sources.emplace(rank, copy(*s.info));
  for (const auto& [rank, r] : receivers_) out->receivers.emplace(rank, copy(*r.info));
  return out;
}

Result<Json> ControlState::plan_part(uint64_t session, int32_t rank) {
  REFIT_RETURN_IF_ERROR(check_fetch(session, rank));
  const bool solo = wants_solo(rank);
  if (!variant_current(solo)) install_plan(compute_plan(plan_input(solo)));
  return cached_part(rank);
}

Status ControlState::report_staged(uint64_t session, const StageReport& m) {
  REFIT_RETURN_IF_ERROR(owned("report_staged", receivers_, Role::kReceiver, m.rank, session));
  const int32_t instance = receivers_[m.rank].info->instance;
  if (committed(m.rank, m.version)) {
    // It reports again what the instance already committed (it had not
    // heard yet): it is told commit, as the others were.
    auto c = committed_.find(instance);
    const MsgType word = c->second == m.version ? MsgType::kCommit : MsgType::kAbort;
    notices_.push_back(Notice{session, word,
                              to_json(VersionNotice{word, instance, m.version,
                                                    "the instance already committed version " +
                                                        std::to_string(c->second)})});
    return Status::ok();
  }
  auto aborted = aborted_.find(instance);
  if (aborted != aborted_.end() && aborted->second >= m.version) {
    // A rank that staged after another had already failed: the version
    // stays aborted, and this rank is told so (again).
    notices_.push_back(Notice{session, MsgType::kAbort,
                              to_json(VersionNotice{MsgType::kAbort, instance, m.version,
                                                    "the instance already aborted version " +
                                                        std::to_string(m.version)})});
    return Status::ok();
  }
  Barrier& b = barriers_[instance];
  if (b.version > m.version) {
    return Status::invalid("report_staged: instance " + std::to_string(instance) + " is staging version " +
                           std::to_string(b.version) + ", not " + std::to_string(m.version));
  }
  if (b.version != 0 && b.version < m.version) {
    // The instance moved on without finishing the older barrier: it will
    // never commit, and the ranks that staged it are told so.
    const int64_t old = b.version;
    abort_instance(instance, old, "receiver rank " + std::to_string(m.rank) + " staged version " +
                                      std::to_string(m.version) + " before version " + std::to_string(old) +
                                      " was committed");
  }
  Barrier& barrier = barriers_[instance];
  barrier.version = m.version;
  barrier.staged.insert(m.rank);
  if (const std::string missing = instance_shortfall(instance); !missing.empty()) {
    // A rank missing: the version is never committed for this instance.
    abort_instance(instance, m.version, missing);
    return Status::ok();
  }
  const std::vector<int32_t> ranks = instance_ranks(instance);
  for (int32_t r : ranks) {
    if (!barrier.staged.count(r)) return Status::ok();
  }
  for (int32_t r : ranks) {
    notices_.push_back(Notice{receivers_[r].session, MsgType::kCommit,
                              to_json(VersionNotice{MsgType::kCommit, instance, m.version, ""})});
  }
  barriers_.erase(instance);
  int64_t& last = committed_[instance];
  last = std::max(last, m.version);
  return Status::ok();
}

Status ControlState::report_failed(uint64_t session, const StageReport& m) {
  REFIT_RETURN_IF_ERROR(owned("report_failed", receivers_, Role::kReceiver, m.rank, session));
  abort_instance(receivers_[m.rank].info->instance, m.version,
                 "receiver rank " + std::to_string(m.rank) + " failed: " + m.reason);
  return Status::ok();
}

Status ControlState::lease(uint64_t session, const StageReport& m, Clock::time_point now, bool renew) {
  REFIT_RETURN_IF_ERROR(owned("lease", receivers_, Role::kReceiver, m.rank, session));
  if (renew) {
    auto it = leases_.find(m.rank);
    if (it == leases_.end() || it->second.version != m.version) {
      return Status::not_found("lease: receiver rank " + std::to_string(m.rank) + " holds no lease on version " +
                               std::to_string(m.version) + " to renew: it expired or was revoked, and the sources " +
                               "may be overwriting that version")
          .with_reason(Reason::kLeaseLost);
    }
    it->second.expires = now + lease_timeout_;
    return Status::ok();
  }
  if (m.version <= drained_through_) {
    return Status::not_found("lease: version " + std::to_string(m.version) + " was drained (the sources were told " +
                             "no receiver reads version " + std::to_string(drained_through_) +
                             " or older, and may be overwriting it); the latest is " + std::to_string(version_))
        .with_reason(Reason::kDrained);
  }
  if (const std::string missing = instance_shortfall(receivers_.at(m.rank).info->instance); !missing.empty()) {
    return Status::unsupported("lease: " + missing + "; a version is refreshed only with all of them")
        .with_reason(Reason::kInstanceIncomplete);
  }
  if (m.version > version_) {
    return Status::invalid("lease: version " + std::to_string(m.version) + " is not published (latest is " +
                           std::to_string(version_) + ")");
  }
  if (!leases_.count(m.rank)) {
    size_t held = 0;
    for (const auto& [rank, l] : leases_) {
      auto r = receivers_.find(rank);
      held += r != receivers_.end() && r->second.session == session;
    }
    if (held >= limits_.max_leases_per_connection) {
      return Status::invalid("lease: receiver rank " + std::to_string(m.rank) + ": this connection already holds " +
                             std::to_string(held) + " leases, the limit of max_leases_per_connection (" +
                             std::to_string(limits_.max_leases_per_connection) + "); release one first");
    }
  }
  leases_[m.rank] = Lease{m.version, now + lease_timeout_};
  leased_version_ = std::max(leased_version_, m.version);
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
  prune_hashes();
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
  if (!is_source) {
    return Status::not_found("wait_drained: only a connection that registered a source may wait, and this one "
                             "holds none (never registered, or declared dead)")
        .with_reason(Reason::kNotRegistered);
  }
  if (drained(version)) {
    drained_through_ = std::max(drained_through_, version);
    return true;
  }
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
    drained_through_ = std::max(drained_through_, it->first);
    for (uint64_t s : it->second) notices_.push_back(Notice{s, MsgType::kDrained, Json{{"version", it->first}}});
    num_drain_waiters_ -= it->second.size();
    it = drain_waiters_.erase(it);
  }
}

void ControlState::session_closed(uint64_t session) {
  for (auto& [rank, m] : sources_) {
    if (m.session == session) m.session = 0;
  }
  for (auto& [rank, m] : receivers_) {
    if (m.session == session) m.session = 0;
  }
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
  for (int32_t r : gone) remove_source(r, "was declared dead (no heartbeat)");
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
