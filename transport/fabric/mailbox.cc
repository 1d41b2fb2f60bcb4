#include "transport/fabric/mailbox.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

namespace refit::fabric::mailbox {

Status wait(uint64_t* slots, std::span<const int32_t> from, int64_t version, PlanEpoch epoch,
            std::chrono::steady_clock::time_point deadline, const std::atomic<bool>* cancel) {
  const uint64_t want = flag(version, epoch, false);
  std::vector<int32_t> waiting(from.begin(), from.end());
  while (!waiting.empty()) {
    for (size_t i = 0; i < waiting.size();) {
      const uint64_t v = std::atomic_ref<uint64_t>(slots[slot_of(waiting[i])]).load(std::memory_order_acquire);
      if (v == want) {
        waiting.erase(waiting.begin() + static_cast<long>(i));
        continue;
      }
      if ((v >> (kEpochBits + 1)) == static_cast<uint64_t>(version)) {
        if (v & 1) {
          return Status::io_error("local fabric: receiver rank " + std::to_string(waiting[i]) +
                                  " of this domain failed to pass on its slices")
              .with_reason(Reason::kPeerLost);
        }
        return Status::invalid("local fabric: receiver rank " + std::to_string(waiting[i]) +
                               " executed the plan of another membership; retry the refresh")
            .with_reason(Reason::kStaleMembership);
      }
      ++i;
    }
    if (waiting.empty()) break;
    if (cancel && cancel->load(std::memory_order_acquire)) {
      return Status::io_error("local fabric: the wait for the peers was cancelled");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string names;
      for (int32_t r : waiting) names += (names.empty() ? "" : ", ") + std::to_string(r);
      return Status::timeout("local fabric: receiver rank(s) " + names +
                             " of this domain did not pass on their slices before the deadline");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return Status::ok();
}

Status await_accepting(const std::function<Status(uint64_t* word)>& read, int32_t rank, int64_t version,
                       PlanEpoch epoch, std::chrono::steady_clock::time_point deadline,
                       const std::atomic<bool>* cancel) {
  while (true) {
    uint64_t word = 0;
    Status st = read(&word);
    if (!st.is_ok()) {
      return Status::io_error("local fabric: reading the mailbox of receiver rank " + std::to_string(rank) + ": " +
                              st.message());
    }
    switch (accepting(word, version, epoch)) {
      case Accepting::kWrite:
        return Status::ok();
      case Accepting::kStop:
        return Status::io_error("local fabric: receiver rank " + std::to_string(rank) +
                                " is no longer in this attempt (version " + std::to_string(version) +
                                "); its slices were not passed on");
      case Accepting::kWait:
        break;
    }
    if (cancel && cancel->load(std::memory_order_acquire)) {
      return Status::io_error("local fabric: cancelled while waiting for receiver rank " + std::to_string(rank) +
                              " to begin this refresh");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::timeout("local fabric: receiver rank " + std::to_string(rank) + " did not begin version " +
                             std::to_string(version) + " before the deadline");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Fence::close(uint64_t* slots, std::span<const Sender> senders, int64_t version, PlanEpoch epoch, bool ok) {
  const uint64_t keep = flag(version, epoch, false);
  for (const Sender& s : senders) {
    std::atomic_ref<uint64_t> slot(slots[slot_of(s.rank)]);
    uint64_t v = slot.load(std::memory_order_acquire);
    while (true) {
      const uint64_t after = (ok || v != keep) ? 0 : v;
      if (after == v || slot.compare_exchange_weak(v, after, std::memory_order_acq_rel)) break;
    }
    auto it = std::find_if(open_.begin(), open_.end(), [&](const Open& o) { return o.sender.rank == s.rank; });
    if (ended(v, version, epoch)) {
      if (it != open_.end()) open_.erase(it);
    } else if (it != open_.end()) {
      *it = Open{s, version, epoch};  // this attempt ends after the remembered one
    } else {
      open_.push_back(Open{s, version, epoch});
    }
  }
}

Status Fence::wait(uint64_t* slots, int64_t version, std::chrono::steady_clock::time_point deadline,
                   const std::atomic<bool>* cancel) {
  while (true) {
    for (size_t i = 0; i < open_.size();) {
      const Open& o = open_[i];
      if (o.version == version) {  // same bytes: nothing to fence
        ++i;
        continue;
      }
      std::atomic_ref<uint64_t> slot(slots[slot_of(o.sender.rank)]);
      uint64_t v = slot.load(std::memory_order_acquire);
      if (ended(v, o.version, o.epoch)) {
        // Consumed: a flag of an ended attempt must not confuse a later wait.
        if (version_of(v) == o.version) slot.compare_exchange_strong(v, 0);
        open_.erase(open_.begin() + static_cast<long>(i));
      } else if (o.sender.over && o.sender.over(flag(o.version, o.epoch, false))) {
        open_.erase(open_.begin() + static_cast<long>(i));
      } else {
        ++i;
      }
    }
    const auto pending = std::find_if(open_.begin(), open_.end(), [&](const Open& o) { return o.version != version; });
    if (pending == open_.end()) return Status::ok();
    if (cancel && cancel->load(std::memory_order_acquire)) {
      return Status::io_error("local fabric: the wait for receiver rank " + std::to_string(pending->sender.rank) +
                              " to stop writing version " + std::to_string(pending->version) + " was cancelled");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::timeout("local fabric: receiver rank " + std::to_string(pending->sender.rank) +
                             " may still be writing version " + std::to_string(pending->version) +
                             " into this rank's buffers (its attempt under membership epoch " +
                             std::to_string(pending->epoch.counter) + (pending->epoch.solo ? " (solo)" : "") +
                             " has not ended), so this rank cannot take version " + std::to_string(version) +
                             " yet; retry the refresh");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

namespace {
// Fields 3 (state) and 22 (start time) of /proc/PID/stat.
struct ProcStat {
  char state = '?';
  uint64_t start_time = 0;
};
Result<ProcStat> proc_stat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return Status::not_found("process " + std::to_string(pid) + " is gone");
  const size_t paren = text.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos || paren + 2 >= text.size()) {
    return Status::io_error("cannot read /proc/" + std::to_string(pid) + "/stat");
  }
  std::istringstream fields(text.substr(paren + 2));
  ProcStat st;
  std::string f;
  for (int i = 3; i <= 22 && fields >> f; ++i) {
    if (i == 3) st.state = f.empty() ? '?' : f[0];
    if (i == 22) {
      st.start_time = static_cast<uint64_t>(std::strtoull(f.c_str(), nullptr, 10));
      return st;
    }
  }
  return Status::io_error("cannot read the start time in /proc/" + std::to_string(pid) + "/stat");
}
}  // namespace

Result<uint64_t> start_time_of(int pid) {
  Result<ProcStat> st = proc_stat(pid);
  if (!st.is_ok()) return st.status();
  return st->start_time;
}

bool process_gone(int pid, uint64_t start_time) {
  Result<ProcStat> st = proc_stat(pid);
  // A zombie (Z) or dying (X) process writes nothing more, though its parent
  // has not reaped it yet.
  return !st.is_ok() || st->start_time != start_time || st->state == 'Z' || st->state == 'X';
}

}  // namespace refit::fabric::mailbox
