#include "transport/fabric/cma_fabric.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <thread>

#include "transport/fabric/mailbox.h"

namespace refit::fabric {
namespace {

constexpr char kMagic[4] = {'R', 'F', 'C', 'M'};

int read_ptrace_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  if (in >> scope) return scope;
  return 0;  // no Yama: classic ptrace rules (same user)
}

// The parent of `pid`, from /proc/PID/stat ("pid (comm) state ppid ..."; the
// command may hold spaces and parentheses, so read after the last ')'), or
// 0 when it cannot be read.
int parent_of(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 1));
  std::string state;
  int ppid = 0;
  if (!(rest >> state >> ppid)) return 0;
  return ppid;
}

void put(std::vector<uint8_t>& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint64_t get(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

// The process that Yama must let attach to this one so that all of `peers`
// may: Yama keeps one exception per process (PR_SET_PTRACER), which admits
// the process it names and that process's descendants. One peer: the peer
// itself. Several: their nearest common ancestor, the launcher that started
// the domain's ranks (which admits its other children too). 0 when no peer
// is another process.
Result<int> cma_tracer_for(const std::vector<int>& peers) {
  if (peers.empty()) return 0;
  if (peers.size() == 1) return peers.front();
  std::vector<int> chain;  // peers[0] and its ancestors, nearest first
  for (int p = peers.front(); p > 0 && chain.size() < 4096; p = parent_of(p)) chain.push_back(p);
  size_t common = 0;  // index in chain of the nearest ancestor shared so far
  for (size_t i = 1; i < peers.size(); ++i) {
    size_t found = chain.size();
    for (int p = peers[i]; p > 0 && found == chain.size(); p = parent_of(p)) {
      for (size_t k = 0; k < chain.size(); ++k) {
        if (chain[k] == p) {
          found = k;
          break;
        }
      }
    }
    if (found == chain.size()) {
      return Status::unsupported("local fabric \"cma\": ranks of this domain (pids " + std::to_string(peers.front()) +
                                 " and " + std::to_string(peers[i]) + ") share no parent process that can be read here");
    }
    common = std::max(common, found);
  }
  if (chain[common] <= 1) {
    return Status::unsupported("local fabric \"cma\": the ranks of this domain share no launcher below init, so "
                               "kernel.yama.ptrace_scope 1 cannot admit them all; start them from one launcher, "
                               "or use \"local\": {\"fabric\": \"ucx\"}");
  }
  return chain[common];
}

Result<std::unique_ptr<CmaFabric>> CmaFabric::create(const CmaFabricConfig& config) {
  const int scope = read_ptrace_scope();
  if (scope >= 2) {
    return Status::unsupported("local fabric \"cma\": kernel.yama.ptrace_scope is " + std::to_string(scope) +
                               ", which forbids process_vm_writev between ranks; use \"local\": {\"fabric\": \"ucx\"}");
  }
  std::unique_ptr<CmaFabric> f(new CmaFabric(config));
  f->ptrace_scope_ = scope;
  f->pid_ = static_cast<int>(getpid());
  Result<uint64_t> start = mailbox::start_time_of(f->pid_);
  if (!start.is_ok()) return start.status();
  f->start_time_ = *start;
  f->mailbox_.reset(new uint64_t[mailbox::kWords]());
  return f;
}

Result<std::vector<uint8_t>> CmaFabric::register_buffer(const std::string& name, void* data, uint64_t bytes) {
  if (data == nullptr || bytes == 0) {
    return Status::invalid("local fabric: buffer \"" + name + "\" is empty or NULL");
  }
  std::vector<uint8_t> key;
  put(key, bytes, 8);  // peers check every write against it
  return key;
}

std::vector<uint8_t> CmaFabric::contact() const {
  std::vector<uint8_t> out(kMagic, kMagic + 4);
  put(out, static_cast<uint64_t>(pid_), 4);
  put(out, start_time_, 8);
  put(out, reinterpret_cast<uint64_t>(mailbox_.get()), 8);
  return out;
}

Result<CmaFabric::PeerProcess> CmaFabric::parse_contact(const std::vector<uint8_t>& b, int32_t rank) {
  if (b.size() != 24 || std::memcmp(b.data(), kMagic, 4) != 0) {
    return Status::invalid("receiver rank " + std::to_string(rank) +
                           " registered a contact that is not the cma fabric's (do all ranks of the domain use"
                           " the same \"local.fabric\"?)");
  }
  PeerProcess p;
  p.pid = static_cast<int>(get(b.data() + 4, 4));
  p.start_time = get(b.data() + 8, 8);
  p.mailbox = get(b.data() + 16, 8);
  if (p.pid <= 0 || p.mailbox == 0) return Status::invalid("receiver rank " + std::to_string(rank) + ": malformed contact");
  return p;
}

Status CmaFabric::begin(const Schedule& schedule, Clock::time_point deadline) {
  end();
  clear_cancel();
  schedule_ = &schedule;
  deadline_ = deadline;
  procs_.clear();
  for (const Peer& peer : schedule.peers) {
    Result<PeerProcess> p = parse_contact(peer.contact, peer.rank);
    if (!p.is_ok()) return p.status();
    Result<uint64_t> start = mailbox::start_time_of(p->pid);
    if (!start.is_ok() || *start != p->start_time) {
      return Status::io_error("local fabric: receiver rank " + std::to_string(peer.rank) + " (pid " +
                              std::to_string(p->pid) + ") is gone");
    }
    for (const RemoteBuffer& b : peer.buffers) {
      if (b.key.size() != 8) {
        return Status::invalid("local fabric: receiver rank " + std::to_string(peer.rank) +
                               " registered a buffer key that is not the cma fabric's");
      }
    }
    procs_.push_back(*p);
  }
  REFIT_RETURN_IF_ERROR(admit_peers());
  std::set<uint32_t> out;
  for (size_t i = 0; i < schedule.sends.size(); ++i) {
    const Send& s = schedule.sends[i];
    if (s.peer == kSelf) continue;
    if (s.peer >= schedule.peers.size() || s.buffer >= schedule.peers[s.peer].buffers.size()) {
      return Status::invalid("local fabric: send " + std::to_string(i) + " names a peer or buffer outside the schedule");
    }
    const uint64_t length = get(schedule.peers[s.peer].buffers[s.buffer].key.data(), 8);
    if (s.offset > length || s.bytes > length - s.offset) {
      return Status::invalid("local fabric: send " + std::to_string(i) + " [" + std::to_string(s.offset) + ", +" +
                             std::to_string(s.bytes) + ") lies outside the " + std::to_string(length) +
                             "-byte buffer of receiver rank " + std::to_string(schedule.peers[s.peer].rank));
    }
    out.insert(s.peer);
  }
  out_peers_.assign(out.begin(), out.end());
  std::set<uint32_t> in;
  for (const Recv& r : schedule.recvs) {
    if (r.peer >= schedule.peers.size()) return Status::invalid("local fabric: a receive names an unknown peer");
    in.insert(r.peer);
  }
  in_peers_.assign(in.begin(), in.end());
  in_ranks_.clear();
  for (uint32_t p : in_peers_) in_ranks_.push_back(schedule.peers[p].rank);
  // Before any byte of this version may land here: the senders of another
  // version that may still be writing must have stopped.
  REFIT_RETURN_IF_ERROR(fence_.wait(mailbox_.get(), schedule.version, deadline, &cancelled_));
  std::atomic_ref<uint64_t>(mailbox_[mailbox::kAcceptingWord])
      .store(mailbox::flag(schedule.version, schedule.epoch, false), std::memory_order_seq_cst);
  open_ = true;
  return Status::ok();
}

Status CmaFabric::admit_peers() {
  // Under scope 0 the kernel's own rule (same user, same or a parent user
  // namespace) already admits the domain's ranks, and nothing is declared.
  if (ptrace_scope_ != 1) return Status::ok();
  std::vector<int> pids;
  for (const PeerProcess& p : procs_) {
    if (p.pid != pid_ && std::find(pids.begin(), pids.end(), p.pid) == pids.end()) pids.push_back(p.pid);
  }
  std::sort(pids.begin(), pids.end());
  Result<int> tracer = cma_tracer_for(pids);
  if (!tracer.is_ok()) return tracer.status();
  if (*tracer == 0 || *tracer == tracer_) return Status::ok();
  if (prctl(PR_SET_PTRACER, static_cast<unsigned long>(*tracer), 0, 0, 0) != 0) {
    return Status::unsupported("local fabric \"cma\": prctl(PR_SET_PTRACER, " + std::to_string(*tracer) +
                               ") failed: " + std::strerror(errno) + "; use \"local\": {\"fabric\": \"ucx\"}");
  }
  tracer_ = *tracer;
  return Status::ok();
}

namespace {
// Reads the accepting word of the process (pid, mailbox) into *word.
Status read_accepting(int pid, uint64_t mailbox_address, uint64_t* word) {
  struct iovec l{word, sizeof *word};
  struct iovec r{reinterpret_cast<void*>(mailbox_address + mailbox::kAcceptingWord * sizeof(uint64_t)), sizeof *word};
  while (true) {
    const ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n == static_cast<ssize_t>(sizeof *word)) return Status::ok();
    if (n < 0 && errno == EINTR) continue;
    return Status::io_error(n < 0 ? std::strerror(errno) : "short read");
  }
}
}  // namespace

Status CmaFabric::await_accepting(uint32_t peer) {
  const PeerProcess proc = procs_[peer];
  // A peer admits this process (admit_peers) in its own begin(); until then
  // the kernel refuses the read (EPERM), which is the same as a peer that
  // has not opened this attempt yet: wait, up to the deadline.
  bool refused = false;
  Status st = mailbox::await_accepting(
      [&](uint64_t* word) {
        Status r = read_accepting(proc.pid, proc.mailbox, word);
        if (!r.is_ok() && r.message() == std::strerror(EPERM)) {
          refused = true;
          *word = 0;
          return Status::ok();
        }
        refused = false;
        return r;
      },
      schedule_->peers[peer].rank, schedule_->version, schedule_->epoch, deadline_, &cancelled_);
  if (!st.is_ok() && refused) {
    return st.with_context("the kernel refused to let this process read it (pid " + std::to_string(proc.pid) +
                           "; kernel.yama.ptrace_scope " + std::to_string(ptrace_scope_) +
                           ", see docs/security.md)");
  }
  return st;
}

void CmaFabric::close_attempt(bool ok) {
  if (!open_) return;
  open_ = false;
  std::vector<mailbox::Fence::Sender> senders;
  for (uint32_t p : in_peers_) {
    const PeerProcess proc = procs_[p];
    senders.push_back({schedule_->peers[p].rank, [proc](uint64_t open) {
                         if (mailbox::process_gone(proc.pid, proc.start_time)) return true;
                         uint64_t word = 0;
                         return !read_accepting(proc.pid, proc.mailbox, &word).is_ok() || word != open;
                       }});
  }
  fence_.close(mailbox_.get(), senders, schedule_->version, schedule_->epoch, ok);
  std::atomic_ref<uint64_t>(mailbox_[mailbox::kAcceptingWord])
      .store(mailbox::flag(schedule_->version, schedule_->epoch, true), std::memory_order_seq_cst);
}

Status CmaFabric::write(uint32_t peer, const struct iovec* local, const struct iovec* remote, size_t n) {
  const int pid = procs_[peer].pid;
  // process_vm_writev may stop short (at a page it cannot touch); go on
  // from where it stopped.
  std::vector<struct iovec> l(local, local + n), r(remote, remote + n);
  size_t li = 0, ri = 0;
  while (li < l.size()) {
    const ssize_t w = process_vm_writev(pid, l.data() + li, l.size() - li, r.data() + ri, r.size() - ri, 0);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      return Status::io_error("local fabric: writing to receiver rank " + std::to_string(schedule_->peers[peer].rank) +
                              " (pid " + std::to_string(pid) + "): " + std::strerror(err) +
                              (err == EPERM ? "; the kernel forbids cross-memory attach here, use \"local\": "
                                              "{\"fabric\": \"ucx\"}"
                                            : ""));
    }
    if (w == 0) return Status::io_error("local fabric: writing to receiver rank " +
                                        std::to_string(schedule_->peers[peer].rank) + " made no progress");
    size_t left = static_cast<size_t>(w);
    for (auto* v : {&l, &r}) {
      size_t& i = v == &l ? li : ri;
      size_t k = left;
      while (k > 0) {
        struct iovec& e = (*v)[i];
        const size_t take = std::min(k, e.iov_len);
        e.iov_base = static_cast<uint8_t*>(e.iov_base) + take;
        e.iov_len -= take;
        k -= take;
        if (e.iov_len == 0) ++i;
      }
    }
  }
  return Status::ok();
}

Status CmaFabric::send(std::span<const uint32_t> ready) {
  if (!schedule_) return Status::internal("local fabric: send() outside begin()/end()");
  std::vector<struct iovec> local, remote;
  uint32_t batch_peer = kSelf;
  auto flush = [&]() -> Status {
    if (local.empty()) return Status::ok();
    Status st = await_accepting(batch_peer);
    if (st.is_ok()) st = write(batch_peer, local.data(), remote.data(), local.size());
    local.clear();
    remote.clear();
    return st;
  };
  for (uint32_t i : ready) {
    const Send& s = schedule_->sends[i];
    if (s.peer == kSelf) {
      std::memcpy(s.self_dst, s.src, s.bytes);
      continue;
    }
    if (s.peer != batch_peer || local.size() >= config_.max_iov) {
      REFIT_RETURN_IF_ERROR(flush());
      batch_peer = s.peer;
    }
    const RemoteBuffer& b = schedule_->peers[s.peer].buffers[s.buffer];
    local.push_back({const_cast<uint8_t*>(s.src), s.bytes});
    remote.push_back({reinterpret_cast<void*>(b.address + s.offset), s.bytes});
  }
  REFIT_RETURN_IF_ERROR(flush());
  if (Clock::now() > deadline_) return Status::timeout("local fabric: the deadline passed while passing on slices");
  return Status::ok();
}

Status CmaFabric::finish(bool failed) {
  if (!schedule_) return Status::internal("local fabric: finish() outside begin()/end()");
  Status status;
  // The data writes above returned before this point, and the fence keeps
  // the flag's write after them, as the peer's acquire load expects.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  uint64_t value = mailbox::flag(schedule_->version, schedule_->epoch, failed);
  for (uint32_t p : out_peers_) {
    struct iovec l{&value, sizeof value};
    struct iovec r{reinterpret_cast<void*>(procs_[p].mailbox + mailbox::slot_of(config_.rank) * sizeof(uint64_t)),
                   sizeof value};
    Status st = write(p, &l, &r, 1);
    if (!st.is_ok() && status.is_ok()) status = st.with_context("signalling the peers");
  }
  if (status.is_ok() && !failed) {
    status = mailbox::wait(mailbox_.get(), in_ranks_, schedule_->version, schedule_->epoch, deadline_, &cancelled_);
  }
  // Clears the slots (a retry of this version and membership keeps what
  // peers finished) and remembers the senders that may still write.
  close_attempt(status.is_ok() && !failed);
  return status;
}

void CmaFabric::end() {
  if (schedule_) close_attempt(false);
  schedule_ = nullptr;
  procs_.clear();
}

}  // namespace refit::fabric
