#include "plugin/receiver/plan_compiler.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "planner/conversion.h"

namespace refit::plugin::receiver {

namespace {

using control::PlanPart;
using control::PlanRun;
using control::RunEnd;

Status bad(const std::string& why) { return Status::invalid("plan from the coordinator: " + why); }

// Whether the box `sizes` with `strides` (none negative) puts each element
// in a place of its own, by the rule a refit-layout/1 segment's strides
// follow (planner/layout_json.cc): taking the dims of more than one index
// by growing stride, each stride passes the span of those before it. Every
// dense or sliced layout, in any memory order, passes; a stride of 0 or
// strides that interleave do not.
bool nested(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (size_t d = 0; d < sizes.size(); ++d)
    if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
  std::sort(dims.begin(), dims.end());
  uint64_t span = 0;  // the furthest element the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (static_cast<uint64_t>(stride) <= span) return false;
    uint64_t step = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(stride), static_cast<uint64_t>(size - 1), &step) ||
        __builtin_add_overflow(span, step, &span))
      return false;
  }
  return true;
}

// One compilation: the part's peers indexed, then each run in turn.
class Compiler {
 public:
  Compiler(const PlanPart& plan, int32_t rank, std::span<const LocalBuffer> buffers, const RkeyIds& rkey_ids,
           const StagingArea& staging)
      : plan_(plan), me_(rank), buffers_(buffers), rkey_ids_(rkey_ids), staging_(staging),
        out_(std::make_shared<CompiledPart>()) {}

  Result<std::shared_ptr<const CompiledPart>> run() {
    out_->epoch = plan_.epoch;
    out_->schedule.epoch = plan_.epoch;
    out_->minimum_network_bytes = plan_.totals.minimum_network_bytes;
    out_->solo = plan_.totals.solo;
    out_->written.assign(buffers_.size(), {});
    for (size_t i = 0; i < buffers_.size(); ++i) mine_[buffers_[i].name] = i;
    index_peers();
    REFIT_RETURN_IF_ERROR(make_staging());
    for (size_t i = 0; i < plan_.runs.size(); ++i) {
      const PlanRun& run = plan_.runs[i];
      const std::string what = "run " + std::to_string(i);
      run_ = i;
      if (run.convert) {
        REFIT_RETURN_IF_ERROR(add_convert(*run.convert, what));
        continue;
      }
      REFIT_RETURN_IF_ERROR(run.network ? add_get(run, what) : add_local(run, what));
    }
    REFIT_RETURN_IF_ERROR(link_converts());
    REFIT_RETURN_IF_ERROR(link_sends());
    REFIT_RETURN_IF_ERROR(check_writers());
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
    if (writes) record(it->second, end.offset, bytes);
    if (which) *which = &b;
    return b.data + end.offset;
  }

  Status add_get(const PlanRun& run, const std::string& what) {
    if (run.to.rank != me_) return bad(what + " is a network run for another rank");
    const LocalBuffer* target = nullptr;
    Result<uint8_t*> place = run.to.stage ? staged(run.to.offset, run.bytes, what)
                                          : mine(run.to, run.bytes, what, /*writes=*/true, &target);
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
    if (run.to.stage) {
      staged_gets_.push_back({*place, *place + run.bytes, static_cast<uint32_t>(out_->gets.size())});
      g.local = *place;
    } else if (target->through_slot) {
      g.device = *place;
      out_->through_slots = true;
    } else {
      g.local = *place;
      g.local_on_gpu = target->device;
    }
    if (!run.to.stage) landed_.push_back({*place, *place + run.bytes, static_cast<uint32_t>(out_->gets.size())});
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

  // The staging area: as large as the furthest staged byte of the part.
  Status make_staging() {
    uint64_t need = 0;
    for (size_t i = 0; i < plan_.runs.size(); ++i) {
      const PlanRun& run = plan_.runs[i];
      if (run.network && run.to.stage) {
        if (run.to.offset > UINT64_MAX - run.bytes) return bad("run " + std::to_string(i) + " stages past the end of memory");
        need = std::max(need, run.to.offset + run.bytes);
      }
    }
    if (need == 0) return Status::ok();
    if (!staging_) return Status::unsupported("this receiver has no staging area for tensors converted on the way");
    Result<uint8_t*> area = staging_(need);
    if (!area.is_ok()) return area.status().with_context("the staging area for conversions");
    staging_base_ = *area;
    out_->staging_bytes = need;
    return Status::ok();
  }

  Result<uint8_t*> staged(uint64_t offset, uint64_t bytes, const std::string& what) const {
    if (offset > out_->staging_bytes || bytes > out_->staging_bytes - offset) {
      return bad(what + " lies outside the staging area");
    }
    return staging_base_ + offset;
  }

  // A conversion step: the box's pointers, checked against the buffers; the
  // bytes it writes count as written, and as landed for the sends that read
  // them (range by range in memory order: a box of a strided region is not
  // contiguous). One dtype on both sides is a relayout: the box copied into
  // the region's strides, whatever their order.
  Status add_convert(const control::ConvertSpec& c, const std::string& what) {
    const std::optional<DType> from = parse_dtype(c.from_dtype);
    const std::optional<DType> to = parse_dtype(c.to_dtype);
    if (!from || !to) return bad(what + " (converts tensor \"" + c.tensor + "\") names an unknown dtype");
    Result<ConversionKind> kind = conversion_for(c.tensor, *from, *to);
    if (!kind.is_ok()) return kind.status();
    const bool quantize = *kind == ConversionKind::kQuantizeE4M3;
    const bool relayout = *kind == ConversionKind::kNone;
    const std::string name = what + (relayout ? " (relayouts tensor \"" : " (converts tensor \"") + c.tensor + "\")";
    const size_t n = c.size.size();
    // The wire has neither (messages.cc); the walks below and the
    // executor's rely on it: a dim of size 0 would still be walked once.
    for (size_t d = 0; d < n; ++d) {
      if (c.size[d] < 1 || c.strides[d] < 0) {
        return bad(name + ": dim " + std::to_string(d) + " of its box has size " + std::to_string(c.size[d]) +
                   " and stride " + std::to_string(c.strides[d]) +
                   " (a step's box has none of size 0 and no negative stride)");
      }
    }
    if (relayout) {
      if (n == 0 || !c.scale_buffer.empty()) {
        return bad(name + ": a relayout needs a box of 1 or more dims, none of size 0, and no scale buffer");
      }
    } else if (n == 0 || c.strides.back() != 1 ||
               (quantize && (n < 2 || c.scale_buffer.empty() || c.scale_strides.back() != 1))) {
      return bad(name + ": the box needs contiguous rows" + std::string(quantize ? ", 2 dims and a scale buffer" : ""));
    }
    CompiledPart::Convert cv;
    cv.tensor = c.tensor;
    cv.from = *from;
    cv.to = *to;
    cv.block = convert::BlockSize{c.block[0], c.block[1]};
    cv.start = c.start;
    cv.size = c.size;
    cv.strides = c.strides;
    cv.relayout = relayout;
    uint64_t numel = 1;
    for (int64_t s : c.size) {
      if (__builtin_mul_overflow(numel, static_cast<uint64_t>(s), &numel)) return bad(name + ": its box is too large");
    }
    uint64_t staged_bytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_bytes(*from)), &staged_bytes)) {
      return bad(name + ": its box is too large");
    }
    Result<uint8_t*> src = staged(c.stage, staged_bytes, name);
    if (!src.is_ok()) return src.status();
    cv.staged = *src;
    const uint32_t index = static_cast<uint32_t>(out_->converts.size());  // gets.size() is added once all are in
    bool device = false;
    // The rows it writes.
    const std::vector<int64_t> sizes = c.size;
    const int eb = dtype_bytes(*to);
    Result<uint8_t*> dst = rows(c.buffer, c.offset, c.strides, sizes, eb, name, index, &device);
    if (!dst.is_ok()) return dst.status();
    cv.dst = *dst;
    // A cast or a quantization writes rows too: rows that overlap would be
    // written twice (on the GPU, by one strided copy that refuses them).
    if (!nested(c.size, c.strides)) {
      return bad(name + ": its strides are not proven one-to-one, so two elements of the box may land in the "
                 "same place (taking the dims of more than one index by growing stride, each stride must pass "
                 "the span of those before it, as in every refit-layout/1 segment)");
    }
    if (quantize) {
      // The wire bounds start, size and block by 2^62 each: their sum below
      // could pass INT64_MAX.
      for (size_t d = n - 2; d < n; ++d) {
        const int64_t block = c.block[d - (n - 2)];
        int64_t end = 0;
        if (__builtin_add_overflow(c.start[d], c.size[d], &end) || __builtin_add_overflow(end, block - 1, &end)) {
          return bad(name + ": its box's start " + std::to_string(c.start[d]) + " in dim " + std::to_string(d) +
                     " with block " + std::to_string(block) + " is too large");
        }
      }
      std::vector<int64_t> blocks = c.size;
      blocks[n - 2] = (c.start[n - 2] + c.size[n - 2] + c.block[0] - 1) / c.block[0] - c.start[n - 2] / c.block[0];
      blocks[n - 1] = (c.start[n - 1] + c.size[n - 1] + c.block[1] - 1) / c.block[1] - c.start[n - 1] / c.block[1];
      bool scale_device = false;
      Result<uint8_t*> sc = rows(c.scale_buffer, c.scale_offset, c.scale_strides, blocks, 4, name, index, &scale_device);
      if (!sc.is_ok()) return sc.status();
      if (reinterpret_cast<uintptr_t>(*sc) % alignof(float) != 0) return bad(name + ": its scales are not 4-byte aligned");
      cv.scales = reinterpret_cast<float*>(*sc);
      cv.scale_strides = c.scale_strides;
      device = device || scale_device;
    }
#ifndef REFIT_HAVE_CONVERT_KERNEL
    if (relayout && device) {
      return Status::unsupported(name + ": relayouting into GPU memory needs the CUDA relayout kernel, which this "
                                 "build does not have; plan without relayouts (\"relayout_below_bytes\": 0, "
                                 "docs/refresh.md) for GPU receivers");
    }
    if (device) {
      return Status::unsupported(name + ": converting into GPU memory needs the CUDA conversion kernel, which "
                                 "this build does not have (docs/conversion.md)");
    }
#endif
    // The CUDA relayout kernel stores whole elements (relayout_kernel.h): a
    // misaligned store would fault and leave the CUDA context unusable.
    if (relayout && device && reinterpret_cast<uintptr_t>(*dst) % static_cast<uintptr_t>(eb) != 0) {
      return bad(name + ": its first element in GPU buffer \"" + c.buffer + "\" (element " +
                 std::to_string(c.offset) + ") is not aligned to its " + std::to_string(eb) +
                 "-byte elements, which the CUDA relayout kernel stores whole");
    }
    cv.device = device;
    convert_names_.push_back(name);
    out_->converts.push_back(std::move(cv));
    return Status::ok();
  }

  // The bytes of the box `sizes` at element `offset` of `buffer` with
  // `strides`, recorded as written and as landed by conversion `index`: one
  // range per index of the dims outside the box's longest stretch that is
  // contiguous in memory, walked in memory order (a column-major box is a
  // range per column, or one), adjacent ranges merged. Returns the box's
  // first byte.
  Result<uint8_t*> rows(const std::string& buffer, uint64_t offset, const std::vector<int64_t>& strides,
                        const std::vector<int64_t>& sizes, int eb, const std::string& what, uint32_t index,
                        bool* device) {
    auto it = mine_.find(buffer);
    if (it == mine_.end()) return bad(what + " names buffer \"" + buffer + "\", which this rank does not have");
    const LocalBuffer& b = buffers_[it->second];
    *device = b.device;  // a host buffer through the landing ring (a test's switch) converts on the host
    const size_t n = sizes.size();
    const std::string past = what + " writes past the end of buffer \"" + buffer + "\" (" + std::to_string(b.bytes) +
                             " bytes)";
    uint64_t last = offset;  // the last element the box touches
    for (size_t d = 0; d < n; ++d) {
      uint64_t step = 0;
      if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[d] - 1), static_cast<uint64_t>(strides[d]), &step) ||
          __builtin_add_overflow(last, step, &last)) {
        return bad(past);
      }
    }
    if (last >= b.bytes / eb) return bad(past);
    // The dims of more than one index, outermost (largest stride) first; the
    // innermost ones whose strides continue each other make one range.
    std::vector<size_t> dims;
    for (size_t d = 0; d < n; ++d)
      if (sizes[d] > 1) dims.push_back(d);
    std::stable_sort(dims.begin(), dims.end(), [&](size_t x, size_t y) { return strides[x] > strides[y]; });
    uint64_t run = 1;
    size_t outer = dims.size();
    while (outer > 0 && static_cast<uint64_t>(strides[dims[outer - 1]]) == run) {
      run *= static_cast<uint64_t>(sizes[dims[outer - 1]]);
      --outer;
    }
    const uint64_t range = run * eb;
    std::vector<int64_t> idx(outer, 0);
    uint64_t run_begin = 0, run_end = 0;
    bool have = false;
    auto flush = [&] {
      if (!have) return;
      record(it->second, run_begin, run_end - run_begin);
      converted_.push_back({b.data + run_begin, b.data + run_end, index});
    };
    for (;;) {
      uint64_t e = offset;
      for (size_t k = 0; k < outer; ++k) e += static_cast<uint64_t>(idx[k]) * static_cast<uint64_t>(strides[dims[k]]);
      const uint64_t begin = e * eb;
      if (have && begin == run_end) {
        run_end += range;
      } else {
        flush();
        run_begin = begin;
        run_end = begin + range;
        have = true;
      }
      size_t k = outer;
      while (k > 0) {
        if (++idx[k - 1] < sizes[dims[k - 1]]) break;
        idx[k - 1] = 0;
        --k;
      }
      if (k == 0) break;
    }
    flush();
    return b.data + offset * eb;
  }

  // Each conversion waits for the GETs that stage its box, which must bring
  // every byte of it: one they do not would be whatever the staging area
  // held, written into the weights.
  Status link_converts() {
    out_->get_converts.assign(out_->gets.size(), {});
    out_->convert_deps.assign(out_->converts.size(), 0);
    std::vector<Landed> by_begin = staged_gets_;
    std::sort(by_begin.begin(), by_begin.end(), [](const Landed& a, const Landed& b) { return a.begin < b.begin; });
    for (uint32_t k = 0; k < out_->converts.size(); ++k) {
      const CompiledPart::Convert& c = out_->converts[k];
      uint64_t numel = 1;
      for (int64_t s : c.size) numel *= static_cast<uint64_t>(s);
      const uint8_t* begin = c.staged;
      const uint8_t* end = begin + numel * dtype_bytes(c.from);
      const uint8_t* covered = begin;
      for (const Landed& g : by_begin) {
        if (g.begin < end && begin < g.end) {
          out_->get_converts[g.get].push_back(k);
          ++out_->convert_deps[k];
          if (g.begin <= covered) covered = std::max(covered, g.end);
        }
      }
      if (covered < end) {
        return bad(convert_names_[k] + " reads staged bytes [" + std::to_string(begin - staging_base_) + ", " +
                   std::to_string(end - staging_base_) + "), but no GET of this part brings its byte " +
                   std::to_string(covered - staging_base_) + " of the staging area");
      }
    }
    // A conversion's outputs are landed bytes for the sends, as conversion
    // gets.size() + k.
    const uint32_t base = static_cast<uint32_t>(out_->gets.size());
    for (Landed l : converted_) {
      l.get += base;
      landed_.push_back(l);
    }
    return Status::ok();
  }

  // `bytes` at `offset` of buffer `buffer` written by the run being added.
  void record(size_t buffer, uint64_t offset, uint64_t bytes) {
    out_->written[buffer].emplace_back(offset, bytes);
    writes_.push_back({buffer, offset, offset + bytes, run_});
  }

  // No byte has two writers: which one lands last would depend on timing
  // (a GET against a conversion, two GETs). One run may write a byte more
  // than once (a cast's rows of a box with a stride of 0).
  Status check_writers() {
    std::sort(writes_.begin(), writes_.end(), [](const Write& a, const Write& b) {
      return std::tie(a.buffer, a.begin) < std::tie(b.buffer, b.begin);
    });
    // Per buffer: the furthest end reached and its run, and the furthest
    // end any other run reached.
    size_t buffer = SIZE_MAX;
    uint64_t end1 = 0, end2 = 0;
    size_t run1 = 0, run2 = 0;
    for (const Write& w : writes_) {
      if (w.buffer != buffer) {
        buffer = w.buffer;
        end1 = end2 = 0;
      }
      const bool clash = (w.run != run1 && w.begin < end1) || (w.run == run1 && w.begin < end2);
      if (clash) {
        const size_t other = w.run != run1 ? run1 : run2;
        return bad("runs " + std::to_string(other) + " and " + std::to_string(w.run) + " both write byte " +
                   std::to_string(w.begin) + " of buffer \"" + buffers_[buffer].name + "\"");
      }
      if (w.run == run1) {
        end1 = std::max(end1, w.end);
      } else if (w.end > end1) {
        end2 = end1;
        run2 = run1;
        end1 = w.end;
        run1 = w.run;
      } else if (w.end > end2) {
        end2 = w.end;
        run2 = w.run;
      }
    }
    return Status::ok();
  }

  // Each send waits for the GETs that bring the bytes it reads.
  Status link_sends() {
    std::sort(landed_.begin(), landed_.end(), [](const Landed& a, const Landed& b) { return a.begin < b.begin; });
    out_->dependents.assign(out_->gets.size() + out_->converts.size(), {});
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
  const StagingArea& staging_;
  std::shared_ptr<CompiledPart> out_;
  uint8_t* staging_base_ = nullptr;
  std::vector<Landed> staged_gets_;  // GETs into the staging area
  std::vector<Landed> converted_;    // the rows conversions write; `get` is the conversion's index
  std::vector<std::string> convert_names_;  // per conversion, for its errors
  struct Write {
    size_t buffer;
    uint64_t begin, end;
    size_t run;
  };
  std::vector<Write> writes_;  // every range a run writes, for check_writers
  size_t run_ = 0;             // the run being added
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
                                                         const RkeyIds& rkey_ids, const StagingArea& staging) {
  if (part.unchanged) return Status::internal("compile_plan: an \"unchanged\" reply carries no part to compile");
  return Compiler(part, rank, buffers, rkey_ids, staging).run();
}

}  // namespace refit::plugin::receiver
