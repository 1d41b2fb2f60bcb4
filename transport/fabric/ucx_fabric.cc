#include "transport/fabric/ucx_fabric.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include "transport/fabric/mailbox.h"

namespace refit::fabric {
namespace {

constexpr char kContactMagic[4] = {'R', 'F', 'C', 'T'};

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

}  // namespace


Result<std::unique_ptr<UcxFabric>> UcxFabric::create(const UcxFabricConfig& config) {
  REFIT_RETURN_IF_ERROR(ucx::validate(config.limits));
  std::unique_ptr<UcxFabric> f(new UcxFabric(config));
  ucx::ContextConfig cc;
  cc.name = "local";
  cc.transports = config.transports;
  Result<ucx::Context> context = ucx::Context::create(cc);
  if (!context.is_ok()) return context.status();
  f->context_.emplace(std::move(context).value());
  if (config.transports == std::vector<std::string>{"shm"}) f->mode_ = ucx::PeerErrorHandling::kNone;
  Result<ucx::Worker> worker = ucx::Worker::create(*f->context_, ucx::ThreadMode::kSerialized);
  if (!worker.is_ok()) return worker.status();
  f->worker_.emplace(std::move(worker).value());
  Result<std::vector<uint8_t>> address = f->worker_->address();
  if (!address.is_ok()) return address.status();
  f->address_ = std::move(address).value();
  f->mailbox_.reset(new uint64_t[mailbox::kSlots]());
  Result<ucx::MemoryRegion> mr =
      ucx::MemoryRegion::map(*f->context_, f->mailbox_.get(), mailbox::kSlots * sizeof(uint64_t), "mailbox");
  if (!mr.is_ok()) return mr.status();
  f->mailbox_region_.emplace(std::move(mr).value());
  f->flags_.reset(new uint64_t[8]());
  Result<ucx::MemoryRegion> fr = ucx::MemoryRegion::map(*f->context_, f->flags_.get(), 8 * sizeof(uint64_t), "flags");
  if (!fr.is_ok()) return fr.status();
  f->flags_region_.emplace(std::move(fr).value());
  Result<std::unique_ptr<ucx::AmRmaServer>> server = ucx::AmRmaServer::create(*f->worker_);
  if (!server.is_ok()) return server.status();
  f->rma_server_ = std::move(server).value();
  f->rma_server_->export_region(*f->mailbox_region_);
  return f;
}

UcxFabric::~UcxFabric() {
  end();
  peers_.clear();  // endpoints before the worker
  rma_server_.reset();
  regions_.clear();
  mailbox_region_.reset();
  flags_region_.reset();
  worker_.reset();
  context_.reset();
}

Result<std::vector<uint8_t>> UcxFabric::register_buffer(const std::string& name, void* data, uint64_t bytes) {
  Result<ucx::MemoryRegion> region = ucx::MemoryRegion::map(*context_, data, bytes, name);
  if (!region.is_ok()) return region.status();
  regions_.push_back(std::move(region).value());
  rma_server_->export_region(regions_.back());
  return regions_.back().packed_rkey();
}

std::vector<uint8_t> UcxFabric::contact() const {
  std::vector<uint8_t> out(kContactMagic, kContactMagic + 4);
  put_u32(out, static_cast<uint32_t>(address_.size()));
  out.insert(out.end(), address_.begin(), address_.end());
  put_u64(out, reinterpret_cast<uint64_t>(mailbox_.get()));
  const std::vector<uint8_t>& key = mailbox_region_->packed_rkey();
  put_u32(out, static_cast<uint32_t>(key.size()));
  out.insert(out.end(), key.begin(), key.end());
  return out;
}

Result<UcxFabric::Contact> UcxFabric::parse_contact(const std::vector<uint8_t>& b, int32_t rank) {
  auto bad = [rank](const char* why) {
    return Status::invalid("receiver rank " + std::to_string(rank) + " registered a malformed contact: " + why);
  };
  size_t at = 0;
  auto u32 = [&](uint32_t* v) {
    if (b.size() - at < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= static_cast<uint32_t>(b[at + i]) << (8 * i);
    at += 4;
    return true;
  };
  if (b.size() < 4 || std::memcmp(b.data(), kContactMagic, 4) != 0) return bad("wrong magic");
  at = 4;
  Contact c;
  uint32_t n = 0;
  if (!u32(&n) || b.size() - at < n) return bad("truncated worker address");
  c.address.assign(b.begin() + at, b.begin() + at + n);
  at += n;
  if (b.size() - at < 8) return bad("truncated mailbox address");
  for (int i = 0; i < 8; ++i) c.mailbox |= static_cast<uint64_t>(b[at + i]) << (8 * i);
  at += 8;
  if (!u32(&n) || b.size() - at != n) return bad("truncated mailbox key");
  c.mailbox_rkey.assign(b.begin() + at, b.end());
  return c;
}

Result<uint64_t> UcxFabric::import(PeerState& p, const std::vector<uint8_t>& rkey) {
  auto [it, inserted] = p.rkey_ids.emplace(rkey, 0);
  if (inserted) {
    it->second = next_rkey_id_++;
    Status st = p.ep->import_rkey(it->second, rkey);
    if (!st.is_ok()) {
      p.rkey_ids.erase(it);
      return st;
    }
  }
  return it->second;
}

Status UcxFabric::begin(const Schedule& schedule, Clock::time_point deadline) {
  end();
  clear_cancel();
  schedule_ = &schedule;
  deadline_ = deadline;
  const size_t n = schedule.peers.size();
  eps_.assign(n, nullptr);
  buffer_ids_.assign(n, {});
  mailboxes_.assign(n, 0);
  mailbox_ids_.assign(n, 0);
  // Endpoints and keys before the engine's progress thread owns the worker.
  for (size_t i = 0; i < n; ++i) {
    const Peer& peer = schedule.peers[i];
    Result<Contact> c = parse_contact(peer.contact, peer.rank);
    if (!c.is_ok()) return c.status();
    PeerState& p = peers_[peer.rank];
    if (p.ep && (p.ep->failed() || p.address != c->address)) {
      p.ep.reset();
      p.rkey_ids.clear();
    }
    if (!p.ep) {
      Result<ucx::Endpoint> ep =
          ucx::Endpoint::create(*worker_, c->address, "receiver " + std::to_string(peer.rank), mode_);
      if (!ep.is_ok()) return ep.status();
      p.ep.emplace(std::move(ep).value());
      p.address = c->address;
    }
    eps_[i] = &*p.ep;
    for (const RemoteBuffer& b : peer.buffers) {
      Result<uint64_t> id = import(p, b.key);
      if (!id.is_ok()) return id.status();
      buffer_ids_[i].push_back(*id);
    }
    Result<uint64_t> id = import(p, c->mailbox_rkey);
    if (!id.is_ok()) return id.status();
    mailbox_ids_[i] = *id;
    mailboxes_[i] = c->mailbox + mailbox::slot_of(config_.rank) * sizeof(uint64_t);
  }
  std::set<uint32_t> out;
  for (const Send& s : schedule.sends) {
    if (s.peer == kSelf) continue;
    if (s.peer >= n || s.buffer >= schedule.peers[s.peer].buffers.size()) {
      return Status::invalid("local fabric: a send names peer " + std::to_string(s.peer) + " buffer " +
                             std::to_string(s.buffer) + ", outside the schedule");
    }
    out.insert(s.peer);
  }
  out_peers_.assign(out.begin(), out.end());
  std::set<int32_t> in;
  for (const Recv& r : schedule.recvs) {
    if (r.peer >= n) return Status::invalid("local fabric: a receive names peer " + std::to_string(r.peer));
    in.insert(schedule.peers[r.peer].rank);
  }
  in_ranks_.assign(in.begin(), in.end());
  ucx::GetEngineOptions options;
  options.progress_thread = true;
  options.limits = config_.limits;
  Result<std::unique_ptr<ucx::GetEngine>> engine = ucx::GetEngine::create(*worker_, options);
  if (!engine.is_ok()) return engine.status();
  engine_ = std::move(engine).value();
  for (const ucx::MemoryRegion& r : regions_) engine_->add_local_region(r);
  engine_->add_local_region(*flags_region_);
  return Status::ok();
}

Status UcxFabric::send(std::span<const uint32_t> ready) {
  if (!engine_) return Status::internal("local fabric: send() outside begin()/end()");
  std::vector<ucx::GetRun> puts;
  puts.reserve(ready.size());
  for (uint32_t i : ready) {
    const Send& s = schedule_->sends[i];
    if (s.peer == kSelf) {
      std::memcpy(s.self_dst, s.src, s.bytes);
      continue;
    }
    const RemoteBuffer& b = schedule_->peers[s.peer].buffers[s.buffer];
    puts.push_back(ucx::GetRun{eps_[s.peer], buffer_ids_[s.peer][s.buffer], b.address + s.offset,
                               const_cast<uint8_t*>(s.src), s.bytes, ucx::Op::kPut});
  }
  if (puts.empty()) return Status::ok();
  ucx::BatchReport r = engine_->run_batch(puts, deadline_);
  return r.status.with_context("local fabric");
}

Status UcxFabric::finish(bool failed) {
  if (!engine_) return Status::internal("local fabric: finish() outside begin()/end()");
  Status status;
  if (!out_peers_.empty()) {
    std::vector<ucx::Endpoint*> out;
    for (uint32_t p : out_peers_) out.push_back(eps_[p]);
    if (!failed) {
      status = engine_->flush(out, deadline_).with_context("local fabric");
      failed = !status.is_ok();
    }
    flags_[0] = mailbox::flag(schedule_->version, schedule_->epoch, failed);
    std::vector<ucx::GetRun> flags;
    std::vector<ucx::Endpoint*> alive;
    for (uint32_t p : out_peers_) {
      if (eps_[p]->failed()) continue;
      flags.push_back(ucx::GetRun{eps_[p], mailbox_ids_[p], mailboxes_[p], flags_.get(), sizeof(uint64_t),
                                  ucx::Op::kPut});
      alive.push_back(eps_[p]);
    }
    if (!flags.empty()) {
      ucx::BatchReport r = engine_->run_batch(flags, deadline_);
      Status st = r.status.is_ok() ? engine_->flush(alive, deadline_) : r.status;
      if (!st.is_ok() && status.is_ok()) status = st.with_context("local fabric: signalling the peers");
    }
  }
  // Wait for every peer that sends here.
  if (status.is_ok() && !failed) {
    status = mailbox::wait(mailbox_.get(), in_ranks_, schedule_->version, schedule_->epoch, deadline_, &cancelled_);
  }
  if (status.is_ok() && !failed) {
    mailbox::clear(mailbox_.get(), in_ranks_);
  } else {  // a retry of this version and membership keeps what peers finished
    mailbox::clear_except(mailbox_.get(), in_ranks_, mailbox::flag(schedule_->version, schedule_->epoch, false));
  }
  return status;
}

void UcxFabric::end() {
  engine_.reset();
  schedule_ = nullptr;
  eps_.clear();
}

}  // namespace refit::fabric
