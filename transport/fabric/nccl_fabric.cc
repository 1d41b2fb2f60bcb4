#include "transport/fabric/nccl_fabric.h"

#include <algorithm>
#include <cstring>
#include <random>

namespace refit::fabric {
namespace {

constexpr char kMagic[4] = {'R', 'F', 'N', 'C'};
// 2: with the packing (pack_bytes, pack_threshold); 3: rounds name their
// sends by position (round_words.h), so a rank of format 2 cannot pair;
// 4: announcements of 128 words (62 ranges, cuda::kCountWordsPerPeer), so a
// rank of format 3 cannot pair.
constexpr uint32_t kFormat = 4;
constexpr size_t kHeader = 44;

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// A round's per-send sizes to one peer, folded into the count it announces:
// the ends of a pair compute it each over their own sizes (the sender's
// sends, the receiver's receives), so sizes that differ with an equal sum,
// which would cross unnoticed and be scattered into the wrong places,
// differ here. splitmix64's finalizer over a running state; order matters.
uint64_t sizes_digest(std::span<const uint64_t> sizes) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ sizes.size();
  for (uint64_t v : sizes) {
    h += v + 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}

}  // namespace

Result<std::unique_ptr<NcclFabric>> NcclFabric::create(const NcclFabricConfig& config,
                                                       std::unique_ptr<cuda::CommFactory> factory) {
  if (!factory) return Status::invalid("nccl fabric: no communicator factory");
  if (config.max_sends_per_round == 0) {
    return Status::invalid("nccl fabric: \"max_sends_per_round\" must be positive, got 0");
  }
  REFIT_RETURN_IF_ERROR(validate(config.pack));
  std::unique_ptr<NcclFabric> f(new NcclFabric(config, std::move(factory)));
  f->pack_ = config.pack;
  // Without a scatter (no kernel compiled in) the fan-out goes unpacked.
  if (!f->factory_->can_scatter()) f->pack_.pack_bytes = 0;
  std::random_device rd;
  f->instance_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  Result<std::vector<uint8_t>> id = f->factory_->unique_id();
  if (!id.is_ok()) return id.status().with_context("nccl fabric");
  f->id_ = std::move(id).value();
  return f;
}

NcclFabric::~NcclFabric() {
  end();
  comm_.reset();
}

Result<std::vector<uint8_t>> NcclFabric::register_buffer(const std::string& name, void* data, uint64_t bytes) {
  if (data == nullptr || bytes == 0) {
    return Status::invalid("nccl fabric: buffer \"" + name + "\": data is NULL or bytes is 0");
  }
  return std::vector<uint8_t>{};
}

std::vector<uint8_t> NcclFabric::contact() const {
  std::lock_guard<std::mutex> lock(mu_);
  contact_changed_ = false;
  std::vector<uint8_t> out(kMagic, kMagic + 4);
  put_u32(out, kFormat);
  put_u64(out, instance_);
  put_u64(out, comm_epoch_);
  put_u64(out, pack_.pack_bytes);
  put_u64(out, pack_.pack_threshold);
  put_u32(out, static_cast<uint32_t>(id_.size()));
  out.insert(out.end(), id_.begin(), id_.end());
  return out;
}

bool NcclFabric::contact_changed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return contact_changed_;
}

Result<NcclFabric::ContactInfo> NcclFabric::parse_contact(std::span<const uint8_t> b, int32_t rank) {
  auto bad = [rank](const std::string& why) {
    return Status::invalid("receiver rank " + std::to_string(rank) + " registered a contact that is not an NCCL " +
                           "fabric's (" + why + "): every rank of a domain must use the same \"local\" fabric");
  };
  auto u64 = [&b](size_t at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[at + i]) << (8 * i);
    return v;
  };
  auto u32 = [&b](size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(b[at + i]) << (8 * i);
    return v;
  };
  // Every read below is inside the bytes checked before it.
  if (b.size() < 8 || std::memcmp(b.data(), kMagic, 4) != 0) return bad("wrong magic");
  if (u32(4) != kFormat) return bad("format " + std::to_string(u32(4)) + ", this build reads " + std::to_string(kFormat));
  if (b.size() < kHeader) {
    return bad("truncated: " + std::to_string(b.size()) + " bytes, its header has " + std::to_string(kHeader));
  }
  ContactInfo c;
  c.instance = u64(8);
  c.comm_epoch = u64(16);
  c.pack_bytes = u64(24);
  c.pack_threshold = u64(32);
  const uint32_t n = u32(40);
  if (n == 0 || b.size() - kHeader != n) {
    return bad("a unique id of " + std::to_string(n) + " bytes announced, " + std::to_string(b.size() - kHeader) +
               " follow");
  }
  c.id.assign(b.begin() + kHeader, b.end());
  return c;
}

// Both ends of a pair must lay out a round's pack alike (pack.h). Where
// neither packs, the threshold is unused and need not agree.
Status NcclFabric::check_packing(const ContactInfo& c, int32_t rank) const {
  const bool same = c.pack_bytes == pack_.pack_bytes &&
                    (pack_.pack_bytes == 0 || c.pack_threshold == pack_.pack_threshold);
  if (same) return Status::ok();
  auto show = [](int32_t r, uint64_t bytes, uint64_t threshold) {
    const std::string who = "receiver rank " + std::to_string(r);
    if (bytes == 0) return who + " does not pack (\"pack_bytes\" 0, or no scatter kernel)";
    return who + " packs with \"pack_bytes\" " + std::to_string(bytes) + " and \"pack_threshold\" " +
           std::to_string(threshold);
  };
  return Status::invalid("nccl fabric: the fan-out of one domain must pack alike: " +
                         show(rank, c.pack_bytes, c.pack_threshold) + ", " +
                         show(config_.rank, pack_.pack_bytes, pack_.pack_threshold) +
                         "; set the same \"pack_bytes\" and \"pack_threshold\" on every rank of the domain " +
                         "(a build without the scatter kernel packs nothing: \"pack_bytes\" 0 on every rank)");
}

Status NcclFabric::begin(const Schedule& schedule, Clock::time_point deadline) {
  end();
  clear_cancel();
  // The domain: rank order, this rank in it exactly once.
  const size_t n = schedule.domain.size();
  key_.clear();
  ranks_.clear();
  me_ = -1;
  for (size_t i = 0; i < n; ++i) {
    const DomainMember& m = schedule.domain[i];
    if (i > 0 && m.rank <= schedule.domain[i - 1].rank) {
      return Status::invalid("nccl fabric: the domain must list its receivers in increasing rank order, got rank " +
                             std::to_string(m.rank) + " after " + std::to_string(schedule.domain[i - 1].rank));
    }
    Result<ContactInfo> c = parse_contact(m.contact, m.rank);
    if (!c.is_ok()) return c.status();
    REFIT_RETURN_IF_ERROR(check_packing(*c, m.rank));
    if (i == 0) root_id_ = c->id;
    key_.emplace_back(m.rank, c->instance, c->comm_epoch);
    ranks_.push_back(m.rank);
    if (m.rank == config_.rank) me_ = static_cast<int32_t>(i);
  }
  const bool traffic = !schedule.sends.empty() || !schedule.recvs.empty();
  if (me_ < 0 && (traffic || n > 0)) {
    return Status::invalid("nccl fabric: receiver rank " + std::to_string(config_.rank) +
                           " is not in its own domain's member list");
  }
  std::vector<int32_t> comm_rank(schedule.peers.size());
  for (size_t p = 0; p < schedule.peers.size(); ++p) {
    auto it = std::lower_bound(ranks_.begin(), ranks_.end(), schedule.peers[p].rank);
    if (it == ranks_.end() || *it != schedule.peers[p].rank || *it == config_.rank) {
      return Status::invalid("nccl fabric: peer receiver rank " + std::to_string(schedule.peers[p].rank) +
                             " is not another member of this rank's domain");
    }
    comm_rank[p] = static_cast<int32_t>(it - ranks_.begin());
  }
  out_.assign(n, {});
  in_.assign(n, {});
  self_.clear();
  send_peer_.assign(schedule.sends.size(), -1);
  send_pos_.assign(schedule.sends.size(), 0);
  for (uint32_t i = 0; i < schedule.sends.size(); ++i) {
    const Send& s = schedule.sends[i];
    if (s.bytes == 0) return Status::invalid("nccl fabric: send " + std::to_string(i) + " has no bytes");
    if (s.peer == kSelf) {
      if (s.self_dst == nullptr) return Status::invalid("nccl fabric: send " + std::to_string(i) + " to itself has no destination");
      send_pos_[i] = static_cast<uint32_t>(self_.size());
      self_.push_back(i);
      continue;
    }
    if (s.peer >= schedule.peers.size()) {
      return Status::invalid("nccl fabric: send " + std::to_string(i) + " names peer " + std::to_string(s.peer) +
                             ", outside the schedule");
    }
    send_peer_[i] = comm_rank[s.peer];
    send_pos_[i] = static_cast<uint32_t>(out_[comm_rank[s.peer]].size());
    out_[comm_rank[s.peer]].push_back(i);
  }
  for (uint32_t i = 0; i < schedule.recvs.size(); ++i) {
    const Recv& r = schedule.recvs[i];
    if (r.peer >= schedule.peers.size() || r.bytes == 0) {
      return Status::invalid("nccl fabric: receive " + std::to_string(i) + " names peer " + std::to_string(r.peer) +
                             " or has no bytes");
    }
    in_[comm_rank[r.peer]].push_back(i);
  }
  out_next_.assign(n, 0);
  in_count_.assign(n, 0);
  in_got_.assign(n, {});
  for (size_t p = 0; p < n; ++p) in_got_[p].assign(in_[p].size(), 0);
  take_.assign(n, {});
  self_next_ = 0;
  out_closed_.assign(n, 0);
  in_failed_.assign(n, 0);
  share_ = pack_share(pack_, n);
  out_pack_.assign(n, {});
  schedule_ = &schedule;
  deadline_ = deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.assign(schedule.sends.size(), 0);
    ready_pos_.assign(n, {});
    for (size_t p = 0; p < n; ++p) ready_pos_[p].reserve(out_[p].size());
    self_ready_pos_.clear();
    self_ready_pos_.reserve(self_.size());
    passed_all_ = false;
    failing_ = false;
  }
  result_ = Status::ok();
  // Building the communicator runs on the round thread, overlapped with the
  // network GETs the agent issues after begin().
  // A round thread that throws fails this refresh's fabric: finish() joins
  // it and returns result_.
  Result<std::thread> t =
      config_.threads.start("nccl fabric rounds", [this] { rounds(); }, [this](const Status& why) { result_ = why; });
  if (!t.is_ok()) {
    schedule_ = nullptr;
    return t.status().with_context("nccl fabric");
  }
  thread_ = std::move(t).value();
  return Status::ok();
}

Status NcclFabric::send(std::span<const uint32_t> ready) {
  if (!thread_.joinable()) return Status::internal("nccl fabric: send() outside begin()/finish()");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint32_t i : ready) {
      if (i >= ready_.size() || ready_[i]) {
        return Status::internal("nccl fabric: send " + std::to_string(i) + " passed twice or outside the schedule");
      }
      ready_[i] = 1;
      if (send_peer_[i] < 0) {
        self_ready_pos_.push_back(send_pos_[i]);
      } else {
        ready_pos_[send_peer_[i]].push_back(send_pos_[i]);
      }
    }
    ++ready_generation_;
  }
  cv_.notify_one();
  return Status::ok();
}

Status NcclFabric::finish(bool failed) {
  if (!thread_.joinable()) return Status::internal("nccl fabric: finish() outside begin()/end()");
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed && std::find(ready_.begin(), ready_.end(), 0) != ready_.end()) {
      status = Status::internal("nccl fabric: finish() before every send was passed");
      failed = true;
    }
    passed_all_ = true;
    failing_ = failed;
  }
  cv_.notify_one();
  thread_.join();
  return status.is_ok() ? result_ : status;
}

void NcclFabric::end() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      passed_all_ = true;
      failing_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  schedule_ = nullptr;
}

void NcclFabric::drop_comm() {
  if (comm_) comm_->abort();
  comm_.reset();
  comm_key_.clear();
  // This rank's id may be half used and the others must rebuild too: a new
  // id, and a new comm epoch so that every member's key changes.
  Result<std::vector<uint8_t>> id = factory_->unique_id();
  std::lock_guard<std::mutex> lock(mu_);
  if (id.is_ok()) id_ = std::move(id).value();
  ++comm_epoch_;
  contact_changed_ = true;
}

Status NcclFabric::ensure_comm() {
  if (comm_ && comm_key_ == key_) return Status::ok();
  if (comm_) {
    comm_.reset();  // membership changed: a clean destroy, the old comm is idle
    comm_key_.clear();
  }
  Result<std::unique_ptr<cuda::DomainComm>> comm =
      factory_->connect(root_id_, static_cast<int32_t>(ranks_.size()), me_, deadline_);
  if (!comm.is_ok()) {
    drop_comm();
    return comm.status().with_context("nccl fabric: building the communicator of the domain (ranks " +
                                      std::to_string(ranks_.front()) + ".." + std::to_string(ranks_.back()) + ")");
  }
  comm_ = std::move(comm).value();
  comm_key_ = key_;
  ++built_;
  if (me_ == 0) {
    // The root's id is spent: the next communicator needs a fresh one.
    Result<std::vector<uint8_t>> id = factory_->unique_id();
    std::lock_guard<std::mutex> lock(mu_);
    if (id.is_ok()) id_ = std::move(id).value();
    contact_changed_ = true;
  }
  return Status::ok();
}

std::string NcclFabric::owed_ranks() const {
  std::string names;
  for (size_t p = 0; p < ranks_.size(); ++p) {
    const bool owed = in_count_[p] < in_[p].size() && !in_failed_[p];
    const bool owing = out_next_[p] < out_[p].size() && !out_closed_[p];
    if (static_cast<int32_t>(p) != me_ && (owed || owing)) names += (names.empty() ? "" : ", ") + std::to_string(ranks_[p]);
  }
  return names.empty() ? "none" : names;
}

Status NcclFabric::wait_idle(const char* what) {
  while (true) {
    Result<bool> idle = comm_->idle();
    if (!idle.is_ok()) {
      const std::string owed = owed_ranks();
      drop_comm();
      return idle.status().with_context(std::string("nccl fabric: ") + what + " (peers " + owed + ")");
    }
    if (*idle) return Status::ok();
    if (cancelled()) {
      drop_comm();
      return Status::io_error(std::string("nccl fabric: the wait for the peers was cancelled (") + what +
                              "); the communicator was aborted");
    }
    if (Clock::now() >= deadline_) {
      const std::string owed = owed_ranks();
      drop_comm();
      return Status::timeout("nccl fabric: receiver rank(s) " + owed + " of this domain did not pass on or take " +
                             "their slices before the deadline (" + what + "); the communicator was aborted");
    }
    std::this_thread::yield();
  }
}

void NcclFabric::rounds() {
  const Schedule& s = *schedule_;
  const size_t n = ranks_.size();
  const bool need_comm = n > 1 || !self_.empty();
  if (need_comm) {
    Status st = start_rounds();
    if (!st.is_ok()) {
      result_ = st;
      return;
    }
  }
  Status peer_failed;
  std::vector<int32_t> act_out, act_in;
  std::vector<uint64_t> out_bytes(n, 0), out_digest(n, 0);
  std::vector<uint8_t> out_failed(n, 0);
  std::vector<cuda::P2p> group;
  bool failing = false;
  while (true) {
    act_out.clear();
    act_in.clear();
    for (size_t p = 0; p < n; ++p) {
      if (static_cast<int32_t>(p) == me_) continue;
      if (out_next_[p] < out_[p].size() && !out_closed_[p]) act_out.push_back(static_cast<int32_t>(p));
      if (in_count_[p] < in_[p].size() && !in_failed_[p]) act_in.push_back(static_cast<int32_t>(p));
    }
    // What this round passes on: per peer the sends that became ready since
    // the last round, in that order (capped), and the copies to itself.
    bool passed_all = false;
    uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation = ready_generation_;
      passed_all = passed_all_;
      failing = failing_;
      for (int32_t p : act_out) {
        take_[p].clear();
        out_failed[p] = failing;
        if (failing) continue;
        const std::vector<uint32_t>& r = ready_pos_[p];
        const size_t k = std::min<size_t>(r.size() - out_next_[p], config_.max_sends_per_round);
        take_[p].assign(r.begin() + static_cast<std::ptrdiff_t>(out_next_[p]),
                        r.begin() + static_cast<std::ptrdiff_t>(out_next_[p] + k));
      }
      self_take_.clear();
      if (!failing) self_take_.assign(self_ready_pos_.begin() + static_cast<std::ptrdiff_t>(self_next_), self_ready_pos_.end());
    }
    send_used_ = recv_used_ = 0;
    gather_.clear();
    scatter_.clear();
    for (int32_t p : act_out) {
      if (out_failed[p]) continue;
      take_[p].resize(ranges_prefix(take_[p]));
      if (share_ > 0) pack_round(p);
      sizes_.clear();
      for (uint32_t k : take_[p]) sizes_.push_back(s.sends[out_[p][k]].bytes);
      out_bytes[p] = 0;
      for (uint64_t b : sizes_) out_bytes[p] += b;
      out_digest[p] = sizes_digest(sizes_);
    }
    const bool self_left = self_next_ < self_.size() && !failing;
    if (act_out.empty() && act_in.empty() && !self_left) break;

    uint64_t* host = need_comm ? comm_->host_words() : nullptr;
    if (!act_out.empty() || !act_in.empty()) {
      for (int32_t p : act_out) {
        uint64_t* w = host + kRoundWordsPerPeer * p;
        if (out_failed[p]) {
          std::fill(w, w + kRoundWordsPerPeer, 0);
          w[0] = kFailedMarker;
        } else {
          write_announcement(w, out_bytes[p], out_digest[p], take_[p]);
        }
      }
      Status st = exchange_counts(act_out, act_in, group);
      if (!st.is_ok()) {
        if (comm_) drop_comm();
        result_ = st;
        return;
      }
    }

    // Data.
    group.clear();
    bool moved = false;
    bool sends = false;
    for (uint32_t k : self_take_) {
      const Send& x = s.sends[self_[k]];
      group.push_back(cuda::P2p{cuda::P2p::Kind::kSend, me_, const_cast<uint8_t*>(x.src), x.bytes});
      group.push_back(cuda::P2p{cuda::P2p::Kind::kRecv, me_, x.self_dst, x.bytes});
      sends = true;
    }
    self_next_ += self_take_.size();
    for (int32_t p : act_out) {
      if (out_failed[p]) {
        out_closed_[p] = 1;
        moved = true;
        continue;
      }
      sends |= !take_[p].empty();
      add_sends(p, group);
    }
    for (int32_t p : act_in) {
      const uint64_t* w = host + kRoundWordsPerPeer * (n + p);
      if (w[0] == kFailedMarker) {
        in_failed_[p] = 1;
        moved = true;
        if (peer_failed.is_ok()) {
          peer_failed = Status::io_error("nccl fabric: receiver rank " + std::to_string(ranks_[p]) +
                                         " of this domain failed to pass on its slices")
                            .with_reason(Reason::kPeerLost);
        }
        continue;
      }
      Status st = add_recvs(p, w, group);
      if (!st.is_ok()) {
        drop_comm();
        result_ = st;
        return;
      }
    }
    if (!group.empty()) {
      moved = true;
      // The gather reads what the upstream copies land; the scatter of the
      // packs received follows their group.
      Status st = sends ? comm_->order_after_upstream() : Status::ok();
      if (st.is_ok() && !gather_.empty()) st = comm_->scatter(gather_);
      if (st.is_ok()) st = comm_->issue(group);
      if (st.is_ok() && !scatter_.empty()) st = comm_->scatter(scatter_);
      if (!st.is_ok()) {
        drop_comm();
        result_ = st.with_context("nccl fabric");
        return;
      }
    }
    if (!moved) {
      if (cancelled()) {
        if (comm_) drop_comm();
        result_ = Status::io_error("nccl fabric: the wait for the peers was cancelled; the communicator was aborted");
        return;
      }
      if (Clock::now() >= deadline_) {
        result_ = Status::timeout("nccl fabric: sends for receiver rank(s) " + owed_ranks() +
                                  " never became ready before the deadline");
        if (comm_) drop_comm();
        return;
      }
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, config_.idle_wait, [&] {
        return failing_ != failing || passed_all_ != passed_all || ready_generation_ != generation;
      });
    }
  }
  if (comm_) {
    Status st = wait_idle("the last round");
    if (!st.is_ok()) {
      result_ = st;
      return;
    }
  }
  result_ = peer_failed;
}

}  // namespace refit::fabric

namespace refit::fabric {

// The communicator, its count words, and the pack areas where packing is on.
Status NcclFabric::start_rounds() {
  REFIT_RETURN_IF_ERROR(ensure_comm());
  comm_->set_deadline(deadline_);
  const size_t n = ranks_.size();
  if (comm_->word_count() < 2 * kRoundWordsPerPeer * n) {
    return Status::internal("nccl fabric: the communicator has " + std::to_string(comm_->word_count()) +
                            " count words, a round needs " + std::to_string(2 * kRoundWordsPerPeer * n));
  }
  return share_ > 0 ? prepare_packs() : Status::ok();
}

// A round's announcements (round_words.h), written into the host words
// [0, W n) by the caller, W = kRoundWordsPerPeer: W words to every peer it
// sends to; theirs from every peer it receives from, into [W n, 2 W n).
Status NcclFabric::exchange_counts(const std::vector<int32_t>& act_out, const std::vector<int32_t>& act_in,
                                   std::vector<cuda::P2p>& group) {
  const size_t n = ranks_.size();
  constexpr size_t W = kRoundWordsPerPeer;
  group.clear();
  for (int32_t p : act_out) {
    group.push_back(cuda::P2p{cuda::P2p::Kind::kSend, p, comm_->words() + W * p, W * 8});
  }
  for (int32_t p : act_in) {
    group.push_back(cuda::P2p{cuda::P2p::Kind::kRecv, p, comm_->words() + W * (n + p), W * 8});
  }
  REFIT_RETURN_IF_ERROR(comm_->put_words(W * n));
  REFIT_RETURN_IF_ERROR(comm_->issue(group));
  REFIT_RETURN_IF_ERROR(comm_->get_words(W * n, W * n));
  return wait_idle("exchanging the counts of a round");
}

// A round's gather has at most max_sends_per_round pieces per peer (its
// count is capped there), and so has its scatter (add_recvs refuses a peer
// that packs more): the communicator's scatter tables are sized for that
// once, here, before any work is in flight.
Status NcclFabric::prepare_packs() {
  const size_t max_pieces = static_cast<size_t>(config_.max_sends_per_round) * (ranks_.size() - 1);
  Result<cuda::DomainComm::PackAreas> a = comm_->pack_areas(pack_.pack_bytes, max_pieces);
  if (!a.is_ok()) {
    return a.status().with_context("nccl fabric: allocating the two pack areas of \"pack_bytes\" (" +
                                   std::to_string(pack_.pack_bytes) + " bytes each); \"pack_bytes\" 0 turns " +
                                   "packing off, and must then be set on every rank of the domain");
  }
  areas_ = *a;
  return Status::ok();
}

// Caps this round's sends to peer p where its pack would pass the share.
void NcclFabric::pack_round(int32_t p) {
  const Schedule& s = *schedule_;
  sizes_.clear();
  for (uint32_t k : take_[p]) sizes_.push_back(s.sends[out_[p][k]].bytes);
  out_pack_[p] = plan_pack(sizes_, share_, pack_.pack_threshold);
  if (out_pack_[p].taken == take_[p].size()) return;
  ++packs_full_;
  take_[p].resize(out_pack_[p].taken);
}

// The round's sends to peer p (take_[p]): the pack first (its pieces
// gathered into the send area), then the unpacked ones in order.
void NcclFabric::add_sends(int32_t p, std::vector<cuda::P2p>& group) {
  const Schedule& s = *schedule_;
  const PackLayout* l = share_ > 0 ? &out_pack_[p] : nullptr;
  uint8_t* pack = nullptr;
  if (l && l->bytes > 0) {
    pack = areas_.send + send_used_;
    send_used_ += (l->bytes + kPackAlign - 1) / kPackAlign * kPackAlign;
    group.push_back(cuda::P2p{cuda::P2p::Kind::kSend, p, pack, l->bytes});
    ++packs_sent_;
    packed_sends_ += l->packed;
  }
  for (size_t k = 0; k < take_[p].size(); ++k) {
    const Send& x = s.sends[out_[p][take_[p][k]]];
    const uint64_t at = l ? l->offset[k] : kUnpacked;
    if (at == kUnpacked) {
      group.push_back(cuda::P2p{cuda::P2p::Kind::kSend, p, const_cast<uint8_t*>(x.src), x.bytes});
    } else {
      gather_.push_back(cuda::ScatterPiece{pack + at, x.src, x.bytes});
    }
  }
  out_next_[p] += take_[p].size();
}

// The receives from peer p that its announcement `w` names (round_words.h),
// checked against this rank's plan (count, bytes, sizes' digest) and laid
// out as the peer laid out its sends: the pack first (scattered into place
// after the group), then the unpacked ones.
Status NcclFabric::add_recvs(int32_t p, const uint64_t* w, std::vector<cuda::P2p>& group) {
  const Schedule& s = *schedule_;
  const std::string peer = "nccl fabric: receiver rank " + std::to_string(ranks_[p]);
  Status named = read_positions(w, in_[p].size(), in_got_[p], &recv_pos_);
  if (!named.is_ok()) {
    // The peer's plan is not this rank's, or its words are not a round's:
    // receiving would write the wrong bytes, or wait for bytes that never come.
    return Status::invalid(peer + " announced slices this rank's plan does not expect from it (" +
                           named.message() + "); the ranks ran different plans, retry the refresh");
  }
  const uint64_t count = w[0], bytes = w[1], digest = w[2];
  sizes_.clear();
  uint64_t sum = 0;
  for (uint32_t k : recv_pos_) {
    sizes_.push_back(s.recvs[in_[p][k]].bytes);
    sum += sizes_.back();
  }
  if (sum != bytes) {
    return Status::invalid(peer + " announced " + std::to_string(count) + " slices of " + std::to_string(bytes) +
                           " bytes, this rank's plan expects other sizes from it; the ranks ran " +
                           "different plans, retry the refresh");
  }
  if (sizes_digest(sizes_) != digest) {
    // The same count and sum, other sizes: packed, they would be scattered
    // into the wrong places without an error anywhere.
    return Status::invalid(peer + " announced " + std::to_string(count) + " slices of " + std::to_string(bytes) +
                           " bytes whose sizes (digest) differ from this rank's plan's; the ranks ran " +
                           "different plans, retry the refresh");
  }
  PackLayout l;
  if (share_ > 0) {
    l = plan_pack(sizes_, share_, pack_.pack_threshold);
    if (l.taken != count) {
      return Status::invalid(peer + " announced " + std::to_string(count) +
                             " slices in one round, this rank's pack layout takes " + std::to_string(l.taken) +
                             ": the ranks pack differently, retry the refresh");
    }
    if (l.packed > config_.max_sends_per_round) {
      // More pieces than the scatter tables were sized for (prepare_packs).
      return Status::invalid(peer + " packed " + std::to_string(l.packed) +
                             " slices in one round, this rank takes at most " +
                             std::to_string(config_.max_sends_per_round) +
                             " (max_sends_per_round): every rank of a domain must use the same");
    }
  }
  uint8_t* pack = nullptr;
  if (l.bytes > 0) {
    pack = areas_.recv + recv_used_;
    recv_used_ += (l.bytes + kPackAlign - 1) / kPackAlign * kPackAlign;
    group.push_back(cuda::P2p{cuda::P2p::Kind::kRecv, p, pack, l.bytes});
  }
  for (size_t k = 0; k < recv_pos_.size(); ++k) {
    const Recv& r = s.recvs[in_[p][recv_pos_[k]]];
    const uint64_t at = share_ > 0 ? l.offset[k] : kUnpacked;
    if (at == kUnpacked) {
      group.push_back(cuda::P2p{cuda::P2p::Kind::kRecv, p, r.dst, r.bytes});
    } else {
      scatter_.push_back(cuda::ScatterPiece{r.dst, pack + at, r.bytes});
    }
  }
  in_count_[p] += count;
  slices_received_ += count;
  return Status::ok();
}

}  // namespace refit::fabric
