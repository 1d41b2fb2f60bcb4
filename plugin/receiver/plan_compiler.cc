#include "plugin/receiver/plan_compiler.h"

#include <algorithm>

namespace refit::plugin::receiver {

namespace {

using control::PlanPart;
using control::PlanRun;
using control::RunEnd;

Status bad(const std::string& why) { return Status::invalid("plan from the coordinator: " + why); }

// One compilation: the part's peers indexed, then each run in turn.
class Compiler {
 public:
  Compiler(const PlanPart& plan, int32_t rank, std::span<const LocalBuffer> buffers, const RkeyIds& rkey_ids)
      : plan_(plan), me_(rank), buffers_(buffers), rkey_ids_(rkey_ids), out_(std::make_shared<CompiledPart>()) {}

  Result<std::shared_ptr<const CompiledPart>> run() {
    out_->epoch = plan_.epoch;
    out_->schedule.epoch = plan_.epoch;
    out_->minimum_network_bytes = plan_.totals.minimum_network_bytes;
    out_->solo = plan_.totals.solo;
    out_->written.assign(buffers_.size(), {});
    for (size_t i = 0; i < buffers_.size(); ++i) mine_[buffers_[i].name] = i;
    index_peers();
    for (size_t i = 0; i < plan_.runs.size(); ++i) {
      const PlanRun& run = plan_.runs[i];
      const std::string what = "run " + std::to_string(i);
      REFIT_RETURN_IF_ERROR(run.network ? add_get(run, what) : add_local(run, what));
    }
    REFIT_RETURN_IF_ERROR(link_sends());
    for (Ranges& r : out_->written) r = merge_ranges(std::move(r));
    return std::shared_ptr<const CompiledPart>(std::move(out_));
  }

 private:
  struct SourceBuf {
    uint64_t address = 0;
    uint64_t rkey_id = 0;
  };
  struct Landed {  // a GET's bytes in this rank's memory
    const uint8_t* begin;
    const uint8_t* end;
    uint32_t get;
  };

  // Sources: address and rkey id for the GETs. Receivers of the domain: a
  // fabric peer with the buffers named.
  void index_peers() {
    for (const control::PlanPeer& p : plan_.peers.sources) {
      out_->source_addresses[p.rank] = p.worker_address;
      for (const control::PeerBuffer& b : p.buffers) {
        const uint64_t id = rkey_ids_(p.rank, b.name, b.rkey);
        out_->source_keys[p.rank].emplace_back(id, b.rkey);
        source_bufs_[{p.rank, b.name}] = SourceBuf{b.address, id};
      }
    }
    for (const control::DomainContact& m : plan_.peers.domain) {
      out_->schedule.domain.push_back(fabric::DomainMember{m.rank, m.worker_address});
    }
    for (const control::PlanPeer& p : plan_.peers.receivers) {
      fabric::Peer peer;
      peer.rank = p.rank;
      peer.contact = p.worker_address;
      for (const control::PeerBuffer& b : p.buffers) {
        fabric_buf_[{p.rank, b.name}] = static_cast<uint32_t>(peer.buffers.size());
        peer.buffers.push_back(fabric::RemoteBuffer{b.address, b.rkey});
      }
      fabric_peer_[p.rank] = static_cast<uint32_t>(out_->schedule.peers.size());
      out_->schedule.peers.push_back(std::move(peer));
    }
  }

  // Resolves a run's end in this rank's buffer; `writes` records the range
  // as written by the refresh.
  Result<uint8_t*> mine(const RunEnd& end, uint64_t bytes, const std::string& what, bool writes,
                        const LocalBuffer** which = nullptr) {
    auto it = mine_.find(end.buffer);
    if (it == mine_.end()) return bad(what + " names buffer \"" + end.buffer + "\", which this rank does not have");
    const LocalBuffer& b = buffers_[it->second];
    if (end.offset > b.bytes || bytes > b.bytes - end.offset) {
      return bad(what + " [" + std::to_string(end.offset) + ", +" + std::to_string(bytes) +
                 ") lies outside buffer \"" + end.buffer + "\" (" + std::to_string(b.bytes) + " bytes)");
    }
    if (writes) out_->written[it->second].emplace_back(end.offset, bytes);
    if (which) *which = &b;
    return b.data + end.offset;
  }

  Status add_get(const PlanRun& run, const std::string& what) {
    if (run.to.rank != me_) return bad(what + " is a network run for another rank");
    const LocalBuffer* target = nullptr;
    Result<uint8_t*> place = mine(run.to, run.bytes, what, /*writes=*/true, &target);
    if (!place.is_ok()) return place.status();
    auto sb = source_bufs_.find({run.from.rank, run.from.buffer});
    if (sb == source_bufs_.end()) {
      return bad(what + " reads buffer \"" + run.from.buffer + "\" of source rank " + std::to_string(run.from.rank) +
                 ", which is not among the peers");
    }
    if (run.from.offset > UINT64_MAX - sb->second.address) return bad(what + " reads past the end of memory");
    CompiledPart::Get g;
    g.source = run.from.rank;
    g.rkey_id = sb->second.rkey_id;
    g.remote = sb->second.address + run.from.offset;
    g.bytes = run.bytes;
    if (target->through_slot) {
      g.device = *place;
      out_->through_slots = true;
    } else {
      g.local = *place;
    }
    landed_.push_back({*place, *place + run.bytes, static_cast<uint32_t>(out_->gets.size())});
    out_->gets.push_back(g);
    out_->network_bytes += run.bytes;
    return Status::ok();
  }

  Status add_local(const PlanRun& run, const std::string& what) {
    if (run.from.rank != me_) {
      if (run.to.rank != me_) return bad(what + " is a local run between two other ranks");
      auto fp = fabric_peer_.find(run.from.rank);
      if (fp == fabric_peer_.end()) {
        return bad(what + " comes from receiver rank " + std::to_string(run.from.rank) + ", not among the peers");
      }
      Result<uint8_t*> dst = mine(run.to, run.bytes, what, /*writes=*/true);
      if (!dst.is_ok()) return dst.status();
      out_->schedule.recvs.push_back(fabric::Recv{fp->second, *dst, run.bytes});
      return Status::ok();
    }
    Result<uint8_t*> src = mine(run.from, run.bytes, what, /*writes=*/false);
    if (!src.is_ok()) return src.status();
    fabric::Send s;
    s.src = *src;
    s.bytes = run.bytes;
    if (run.to.rank == me_) {
      Result<uint8_t*> dst = mine(run.to, run.bytes, what, /*writes=*/true);
      if (!dst.is_ok()) return dst.status();
      s.self_dst = *dst;
    } else {
      auto fp = fabric_peer_.find(run.to.rank);
      auto fb = fabric_buf_.find({run.to.rank, run.to.buffer});
      if (fp == fabric_peer_.end() || fb == fabric_buf_.end()) {
        return bad(what + " writes buffer \"" + run.to.buffer + "\" of receiver rank " + std::to_string(run.to.rank) +
                   ", which is not among the peers");
      }
      s.peer = fp->second;
      s.buffer = fb->second;
      s.offset = run.to.offset;
      out_->local_bytes += run.bytes;
    }
    reads_.push_back({*src, *src + run.bytes});
    out_->schedule.sends.push_back(s);
    return Status::ok();
  }

  // Each send waits for the GETs that bring the bytes it reads.
  Status link_sends() {
    std::sort(landed_.begin(), landed_.end(), [](const Landed& a, const Landed& b) { return a.begin < b.begin; });
    out_->dependents.assign(out_->gets.size(), {});
    out_->send_deps.assign(reads_.size(), 0);
    for (uint32_t op = 0; op < reads_.size(); ++op) {
      const auto [begin, end] = reads_[op];
      auto it = std::upper_bound(landed_.begin(), landed_.end(), begin,
                                 [](const uint8_t* p, const Landed& l) { return p < l.begin; });
      if (it != landed_.begin()) --it;
      const uint8_t* covered = begin;
      for (; it != landed_.end() && it->begin < end; ++it) {
        if (it->end <= covered) continue;
        if (it->begin > covered) break;
        out_->dependents[it->get].push_back(op);
        ++out_->send_deps[op];
        covered = it->end;
      }
      if (covered < end) return bad("local run " + std::to_string(op) + " passes on bytes that this rank does not pull");
    }
    return Status::ok();
  }

  const PlanPart& plan_;
  const int32_t me_;
  std::span<const LocalBuffer> buffers_;
  const RkeyIds& rkey_ids_;
  std::shared_ptr<CompiledPart> out_;
  std::map<std::string, size_t> mine_;
  std::map<std::pair<int32_t, std::string>, SourceBuf> source_bufs_;
  std::map<int32_t, uint32_t> fabric_peer_;                         // receiver rank -> schedule peer
  std::map<std::pair<int32_t, std::string>, uint32_t> fabric_buf_;  // (rank, buffer) -> index in its peer
  std::vector<Landed> landed_;
  std::vector<std::pair<const uint8_t*, const uint8_t*>> reads_;  // per send
};

}  // namespace

Ranges merge_ranges(Ranges ranges) {
  std::sort(ranges.begin(), ranges.end());
  Ranges merged;
  for (const auto& [off, n] : ranges) {
    if (!merged.empty() && merged.back().first + merged.back().second >= off) {
      merged.back().second = std::max(merged.back().first + merged.back().second, off + n) - merged.back().first;
    } else {
      merged.emplace_back(off, n);
    }
  }
  return merged;
}

Result<std::shared_ptr<const CompiledPart>> compile_plan(const control::PlanPart& part, int32_t rank,
                                                         std::span<const LocalBuffer> buffers,
                                                         const RkeyIds& rkey_ids) {
  if (part.unchanged) return Status::internal("compile_plan: an \"unchanged\" reply carries no part to compile");
  return Compiler(part, rank, buffers, rkey_ids).run();
}

}  // namespace refit::plugin::receiver
