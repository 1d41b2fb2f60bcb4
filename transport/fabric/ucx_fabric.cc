#include "transport/fabric/ucx_fabric.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "transport/common/sanitizers.h"
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

// Names this boot of this host: a pid and start time count only here.
std::string read_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
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
  f->mailbox_.reset(new uint64_t[mailbox::kWords]());
  expect_one_sided_access(f->mailbox_.get(), mailbox::kWords * sizeof(uint64_t), "a fabric's mailbox");
  f->pid_ = static_cast<int>(getpid());
  Result<uint64_t> start = mailbox::start_time_of(f->pid_);
  if (start.is_ok()) f->start_time_ = *start;  // else 0: peers then rely on the endpoint and the deadline
  f->boot_id_ = read_boot_id();
  Result<ucx::MemoryRegion> mr =
      ucx::MemoryRegion::map(*f->context_, f->mailbox_.get(), mailbox::kWords * sizeof(uint64_t), "mailbox");
  if (!mr.is_ok()) return mr.status();
  f->mailbox_region_.emplace(std::move(mr).value());
  f->flags_.reset(new uint64_t[8]());
  Result<ucx::MemoryRegion> fr = ucx::MemoryRegion::map(*f->context_, f->flags_.get(), 8 * sizeof(uint64_t), "flags");
  if (!fr.is_ok()) return fr.status();
  f->flags_region_.emplace(std::move(fr).value());
  Result<std::unique_ptr<ucx::AmRmaServer>> server = ucx::AmRmaServer::create(*f->worker_);
  if (!server.is_ok()) return server.status();
  f->rma_server_ = std::move(server).value();
  // Peers read the accepting word and write the flags while this rank's
  // threads load and store them with atomics: the server touches them as
  // words too (am_rma.h, AmRmaServer::Words).
  f->rma_server_->export_region(*f->mailbox_region_, ucx::AmRmaServer::Words::kAtomicWords);
  UcxFabric* p = f.get();
  Result<std::thread> idle = config.threads.start("local fabric idle progress", [p] { p->idle_loop(); },
                                                  [p](const Status& why) {
                                                    std::lock_guard<std::mutex> lock(p->idle_mutex_);
                                                    p->idle_error_ = why;
                                                  });
  if (!idle.is_ok()) return idle.status().with_context("local fabric");
  f->idle_thread_ = std::move(idle).value();
  return f;
}

void UcxFabric::idle_loop() {
  Result<int> fd = worker_->event_fd();
  while (true) {
    enum { kEngine, kPending, kArmed, kNoFd } next = kEngine;
    {
      std::lock_guard<std::mutex> lock(idle_mutex_);
      if (idle_stop_) return;
      if (!engine_) {
        while (worker_->progress() != 0) {
        }
        Result<bool> a = worker_->arm();
        next = !a.is_ok() || !fd.is_ok() ? kNoFd : *a ? kArmed : kPending;
      }
    }
    if (next == kPending) continue;  // events came in meanwhile: progress again
    if (next == kArmed) {
      pollfd p = {*fd, POLLIN, 0};
      (void)::poll(&p, 1, 20);  // until an event, or 20 ms to notice idle_stop_
    } else {
      // The engine owns the worker (its thread progresses it), or no fd to
      // sleep on.
      std::this_thread::sleep_for(std::chrono::milliseconds(next == kEngine ? 5 : 1));
    }
  }
}

UcxFabric::~UcxFabric() {
  if (idle_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(idle_mutex_);
      idle_stop_ = true;
    }
    idle_thread_.join();
  }
  end();
  peers_.clear();  // endpoints before the worker
  rma_server_.reset();
  regions_.clear();
  mailbox_region_.reset();
  flags_region_.reset();
  worker_.reset();
  for (std::unique_ptr<ucx::GetEngine>& e : retired_) (void)e.release();  // see retired_
  context_.reset();
  // Under ThreadSanitizer the mailbox stays allocated: its mark must not
  // pass to whatever the process puts at its address next (sanitizers.h).
  if (kThreadSanitizer) (void)mailbox_.release();
}

Result<std::vector<uint8_t>> UcxFabric::register_buffer(const std::string& name, void* data, uint64_t bytes) {
  std::lock_guard<std::mutex> idle(idle_mutex_);  // registers while nobody progresses the worker
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
  put_u32(out, static_cast<uint32_t>(pid_));
  put_u64(out, start_time_);
  put_u32(out, static_cast<uint32_t>(boot_id_.size()));
  out.insert(out.end(), boot_id_.begin(), boot_id_.end());
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
  if (!u32(&n) || b.size() - at < n) return bad("truncated mailbox key");
  c.mailbox_rkey.assign(b.begin() + at, b.begin() + at + n);
  at += n;
  uint32_t pid = 0;
  if (!u32(&pid) || b.size() - at < 8) return bad("truncated process id");
  c.pid = static_cast<int>(pid);
  for (int i = 0; i < 8; ++i) c.start_time |= static_cast<uint64_t>(b[at + i]) << (8 * i);
  at += 8;
  if (!u32(&n) || b.size() - at != n || n > 64) return bad("truncated or overlong boot id");
  c.boot_id.assign(b.begin() + at, b.end());
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
  // The idle thread stays out of the worker until end().
  std::unique_lock<std::mutex> idle(idle_mutex_);
  if (!idle_error_.is_ok()) return idle_error_.with_context("local fabric");
  schedule_ = &schedule;
  deadline_ = deadline;
  const size_t n = schedule.peers.size();
  eps_.assign(n, nullptr);
  buffer_ids_.assign(n, {});
  mailboxes_.assign(n, 0);
  mailbox_ids_.assign(n, 0);
  accepting_words_.assign(n, 0);
  contacts_.clear();
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
    accepting_words_[i] = c->mailbox + mailbox::kAcceptingWord * sizeof(uint64_t);
    p.mailbox_id = *id;
    p.accepting_word = accepting_words_[i];
    contacts_.push_back(std::move(c).value());
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
  std::set<uint32_t> in;
  for (const Recv& r : schedule.recvs) {
    if (r.peer >= n) return Status::invalid("local fabric: a receive names peer " + std::to_string(r.peer));
    in.insert(r.peer);
  }
  in_peers_.assign(in.begin(), in.end());
  in_ranks_.clear();
  for (uint32_t p : in_peers_) in_ranks_.push_back(schedule.peers[p].rank);
  ucx::GetEngineOptions options;
  options.progress_thread = true;
  options.threads = config_.threads;
  options.limits = config_.limits;
  // Its PUTs name their peers in the schedule's order, the same at every
  // rank of the domain: each starts at a peer of its own (chunking.h).
  options.rank = static_cast<uint64_t>(config_.rank);
  Result<std::unique_ptr<ucx::GetEngine>> engine = ucx::GetEngine::create(*worker_, options);
  if (!engine.is_ok()) return engine.status();
  engine_ = std::move(engine).value();
  for (const ucx::MemoryRegion& r : regions_) engine_->add_local_region(r);
  engine_->add_local_region(*flags_region_);
  idle.unlock();  // the engine's progress thread owns the worker now
  // Before any byte of this version may land here: the senders of another
  // version that may still be writing must have stopped.
  REFIT_RETURN_IF_ERROR(fence_.wait(mailbox_.get(), schedule.version, deadline, &cancelled_));
  std::atomic_ref<uint64_t>(mailbox_[mailbox::kAcceptingWord])
      .store(mailbox::flag(schedule.version, schedule.epoch, false), std::memory_order_seq_cst);
  open_ = true;
  return Status::ok();
}

Status UcxFabric::await_accepting(uint32_t peer) {
  auto read = [&](uint64_t* word) {
    std::atomic_ref<uint64_t>(flags_[1]).store(0, std::memory_order_relaxed);
    const ucx::GetRun get{eps_[peer], mailbox_ids_[peer], accepting_words_[peer],
                          reinterpret_cast<uint8_t*>(&flags_[1]), sizeof(uint64_t), ucx::Op::kGet};
    ucx::BatchReport r = engine_->run_batch(std::span<const ucx::GetRun>(&get, 1), deadline_);
    *word = std::atomic_ref<uint64_t>(flags_[1]).load(std::memory_order_acquire);
    return r.status;
  };
  return mailbox::await_accepting(read, schedule_->peers[peer].rank, schedule_->version, schedule_->epoch,
                                  deadline_, &cancelled_);
}

void UcxFabric::close_attempt(bool ok) {
  if (!open_) return;
  open_ = false;
  std::vector<mailbox::Fence::Sender> senders;
  for (uint32_t p : in_peers_) {
    const Contact& c = contacts_[p];
    const bool here = c.pid > 0 && c.start_time != 0 && !c.boot_id.empty() && c.boot_id == boot_id_;
    const int32_t rank = schedule_->peers[p].rank;
    const int pid = c.pid;
    const uint64_t start = c.start_time;
    senders.push_back({rank, [this, rank, here, pid, start](uint64_t open) {
                         return sender_over(rank, open, here, pid, start);
                       }});
  }
  fence_.close(mailbox_.get(), senders, schedule_->version, schedule_->epoch, ok);
  std::atomic_ref<uint64_t>(mailbox_[mailbox::kAcceptingWord])
      .store(mailbox::flag(schedule_->version, schedule_->epoch, true), std::memory_order_seq_cst);
}

bool UcxFabric::sender_over(int32_t rank, uint64_t open, bool here, int pid, uint64_t start_time) {
  if (here && mailbox::process_gone(pid, start_time)) return true;
  auto it = peers_.find(rank);
  if (it == peers_.end() || !it->second.ep || it->second.mailbox_id == 0 || !engine_) {
    return false;  // no way to look: its flag or the deadline ends the wait
  }
  if (it->second.ep->failed()) return true;
  std::atomic_ref<uint64_t>(flags_[2]).store(0, std::memory_order_relaxed);
  const ucx::GetRun read{&*it->second.ep, it->second.mailbox_id, it->second.accepting_word,
                         reinterpret_cast<uint8_t*>(&flags_[2]), sizeof(uint64_t), ucx::Op::kGet};
  ucx::BatchReport r = engine_->run_batch(std::span<const ucx::GetRun>(&read, 1),
                                          std::min(deadline_, Clock::now() + std::chrono::seconds(1)));
  if (!r.status.is_ok()) return false;
  return std::atomic_ref<uint64_t>(flags_[2]).load(std::memory_order_acquire) != open;
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
  std::set<uint32_t> to;
  for (uint32_t i : ready) {
    if (schedule_->sends[i].peer != kSelf) to.insert(schedule_->sends[i].peer);
  }
  for (uint32_t p : to) REFIT_RETURN_IF_ERROR(await_accepting(p));
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
    flags_[0] = mailbox::flag(schedule_->version, schedule_->epoch, failed);  // flags_[1], [2]: accepting words read
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
  // Clears the slots (a retry of this version and membership keeps what
  // peers finished) and remembers the senders that may still write.
  close_attempt(status.is_ok() && !failed);
  return status;
}

void UcxFabric::end() {
  if (schedule_) close_attempt(false);
  std::lock_guard<std::mutex> idle(idle_mutex_);
  if (engine_ && engine_->outstanding_requests() > 0) {
    engine_->retire();
    retired_.push_back(std::move(engine_));
  }
  engine_.reset();
  schedule_ = nullptr;
  eps_.clear();
}

}  // namespace refit::fabric
