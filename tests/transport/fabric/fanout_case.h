#pragma once
// One fan-out schedule for a domain of ranks, built the way the receiver
// agent builds it from a plan (plugin/receiver_agent.cc), and a driver that
// runs it through any LocalFabric the way the agent does: begin, send(ready)
// from one thread in the order the network happens to land the bytes,
// finish, end. The same case runs through the UCX fabric and through the
// NCCL fabric's logic (over the host communicator), and the same bytes must
// land.
//
// Each rank's buffer holds one tensor in [0, H) and a mirror in [H, 2H).
// The tensor is cut into units; a unit has a puller (which "pulled" it: the
// bytes are there before begin) and consumers; its chunks go from the puller
// to every consumer in plan order, and for some units also to the puller's
// own mirror (a kSelf send).

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "transport/fabric/local_fabric.h"

namespace refit::fabric::testing {

struct Transfer {
  int32_t from = 0;
  int32_t to = 0;  // == from: a copy to the mirror
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct FanoutCase {
  int32_t ranks = 0;
  uint64_t half = 0;  // H
  std::vector<std::vector<uint8_t>> start;     // per rank, before
  std::vector<std::vector<uint8_t>> expected;  // per rank, after
  std::vector<Transfer> plan;                  // plan order
};

inline FanoutCase make_case(int32_t ranks, uint64_t half, uint64_t chunk, uint32_t seed) {
  std::mt19937 rng(seed);
  FanoutCase c;
  c.ranks = ranks;
  c.half = half;
  c.start.assign(ranks, std::vector<uint8_t>(2 * half, 0));
  c.expected = c.start;
  uint64_t at = 0;
  while (at < half) {
    const uint64_t len = std::min<uint64_t>(half - at, 1 + rng() % (3 * chunk));
    const int32_t puller = static_cast<int32_t>(rng() % ranks);
    std::vector<int32_t> consumers;
    for (int32_t r = 0; r < ranks; ++r) {
      if (r != puller && rng() % 2) consumers.push_back(r);
    }
    const bool mirror = rng() % 3 == 0;
    for (uint64_t i = 0; i < len; ++i) {
      const uint8_t v = static_cast<uint8_t>(rng() | 1);
      c.start[puller][at + i] = v;
      c.expected[puller][at + i] = v;
      for (int32_t r : consumers) c.expected[r][at + i] = v;
      if (mirror) c.expected[puller][half + at + i] = v;
    }
    for (uint64_t o = 0; o < len; o += chunk) {
      const uint64_t n = std::min(chunk, len - o);
      for (int32_t r : consumers) c.plan.push_back(Transfer{puller, r, at + o, n});
      if (mirror) c.plan.push_back(Transfer{puller, puller, at + o, n});
    }
    at += len;
  }
  return c;
}

// The fabric of one rank, made by the test: registers `buffer` and returns
// the fabric, its key for the buffer and its contact.
struct RankFabric {
  std::unique_ptr<LocalFabric> fabric;
  std::vector<uint8_t> key;
  std::vector<uint8_t> contact;
};
using MakeFabric = std::function<Result<RankFabric>(int32_t rank, std::vector<uint8_t>& buffer)>;

// The schedule of `rank`: peers are the other ranks (in rank order).
// `bases` are the ranks' buffers (host or device memory).
inline Schedule schedule_of(const FanoutCase& c, int32_t rank, const std::vector<uint8_t*>& bases,
                            const std::vector<RankFabric>& fabrics, int64_t version) {
  Schedule s;
  s.version = version;
  s.epoch = PlanEpoch{1, false};
  std::vector<uint32_t> peer_of(c.ranks, kSelf);
  for (int32_t r = 0; r < c.ranks; ++r) {
    s.domain.push_back(DomainMember{r, fabrics[r].contact});
    if (r == rank) continue;
    peer_of[r] = static_cast<uint32_t>(s.peers.size());
    Peer p;
    p.rank = r;
    p.contact = fabrics[r].contact;
    p.buffers.push_back(RemoteBuffer{reinterpret_cast<uint64_t>(bases[r]), fabrics[r].key});
    s.peers.push_back(std::move(p));
  }
  uint8_t* mine = bases[rank];
  for (const Transfer& t : c.plan) {
    if (t.from == rank) {
      Send x;
      x.src = mine + t.offset;
      x.bytes = t.bytes;
      if (t.to == rank) {
        x.self_dst = mine + c.half + t.offset;
      } else {
        x.peer = peer_of[t.to];
        x.buffer = 0;
        x.offset = t.offset;
      }
      s.sends.push_back(x);
    } else if (t.to == rank) {
      s.recvs.push_back(Recv{peer_of[t.from], mine + t.offset, t.bytes});
    }
  }
  return s;
}

inline Schedule schedule_of(const FanoutCase& c, int32_t rank, std::vector<std::vector<uint8_t>>& buffers,
                            const std::vector<RankFabric>& fabrics, int64_t version) {
  std::vector<uint8_t*> bases;
  for (std::vector<uint8_t>& b : buffers) bases.push_back(b.data());
  return schedule_of(c, rank, bases, fabrics, version);
}

// Runs one refresh of `schedules` on `fabrics`, one thread per rank, each
// passing its sends on in a random order and random batches, or with
// `at_once` all in one send() call (so that which sends a round finds ready
// does not depend on timing: none or all). `skip` ranks do not take part;
// `fail` ranks finish(true) after passing half of their sends.
inline std::vector<Status> run_refresh(std::vector<RankFabric>& fabrics, const std::vector<Schedule>& schedules,
                                       Clock::time_point deadline, uint32_t seed,
                                       const std::vector<int32_t>& skip = {},
                                       const std::vector<int32_t>& fail = {}, bool at_once = false) {
  const size_t n = fabrics.size();
  std::vector<Status> out(n);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    if (std::find(skip.begin(), skip.end(), static_cast<int32_t>(r)) != skip.end()) continue;
    threads.emplace_back([&, r] {
      LocalFabric& f = *fabrics[r].fabric;
      const Schedule& s = schedules[r];
      Status st = f.begin(s, deadline);
      if (!st.is_ok()) {
        f.end();
        out[r] = st;
        return;
      }
      std::vector<uint32_t> order(s.sends.size());
      for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
      std::mt19937 rng(seed + static_cast<uint32_t>(r));
      std::shuffle(order.begin(), order.end(), rng);
      const bool failing = std::find(fail.begin(), fail.end(), static_cast<int32_t>(r)) != fail.end();
      if (failing) order.resize(order.size() / 2);
      for (size_t i = 0; i < order.size() && st.is_ok();) {
        const size_t k = at_once ? order.size() - i : std::min<size_t>(order.size() - i, 1 + rng() % 8);
        st = f.send(std::span<const uint32_t>(order.data() + i, k));
        i += k;
      }
      const Status fin = f.finish(failing || !st.is_ok());
      f.end();
      out[r] = st.is_ok() ? fin : st;
      if (failing && out[r].is_ok()) out[r] = Status::io_error("failed as the test asked");
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

}  // namespace refit::fabric::testing
