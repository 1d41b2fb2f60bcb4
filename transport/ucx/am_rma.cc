#include "transport/ucx/am_rma.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <thread>

#include "planner/gather.h"
#include "transport/ucx/by_copy.h"
#include "transport/ucx/ucx_status.h"

namespace refit::ucx {
namespace {

// Lives until UCX completes the reply's send: holds the header (UCX 1.13
// has no UCP_AM_SEND_FLAG_COPY_HEADER) and the in-flight count.
struct PendingReply {
  am_rma::ReplyHeader header;
  std::shared_ptr<std::atomic<uint64_t>> inflight;  // may be null
  std::unique_ptr<uint8_t[]> bytes;  // a gather's piece, else null
  CopySource source;                 // the payload, for a send by copy (by_copy.h)
  // A gather's piece: the reply memory it holds, given back to `budget`
  // when the send completes.
  std::shared_ptr<std::atomic<uint64_t>> budget;
  uint64_t charged = 0;
  // Where a gather's piece goes back to for reuse; may be null.
  std::shared_ptr<am_rma::ReplyPieces> pieces;
};

void release(PendingReply* p) {
  if (p->pieces && p->bytes) p->pieces->give(std::move(p->bytes));
  if (p->budget) p->budget->fetch_sub(p->charged, std::memory_order_relaxed);
  // Release: AmRmaServer::quiesce() acquires it; the send is done reading.
  if (p->inflight) p->inflight->fetch_sub(1, std::memory_order_release);
  delete p;
}

void on_reply_sent(void* request, ucs_status_t /*status*/, void* user_data) {
  // A failed reply (the puller is gone) is dropped: the puller's own
  // deadline or error handling covers it.
  release(static_cast<PendingReply*>(user_data));
  ucp_request_free(request);
}

// Sends one reply message from inside an AM handler. Returns false when the
// send failed at once (the puller is gone). A send that fails later
// completes with an error status: no abort, unlike UCX's own RMA emulation.
// `owned`, if given, holds `data` until the send completes.
// `budget`, if given, gets `length` back then (a gather's piece), and
// `pieces`, if given, gets `owned` back for reuse.
bool send_reply(ucp_ep_h ep, bool by_copy, unsigned id, uint64_t token, ucs_status_t status,
                uint64_t offset, const void* data, size_t length,
                const std::shared_ptr<std::atomic<uint64_t>>& inflight,
                std::unique_ptr<uint8_t[]> owned = nullptr,
                const std::shared_ptr<std::atomic<uint64_t>>& budget = nullptr,
                const std::shared_ptr<am_rma::ReplyPieces>& pieces = nullptr) {
  auto* p = new PendingReply{};
  p->bytes = std::move(owned);
  p->budget = budget;
  p->pieces = pieces;
  p->charged = budget ? length : 0;
  p->header.token = token;
  p->header.status = status;
  p->header.offset = offset;
  p->inflight = inflight;
  if (p->inflight) p->inflight->fetch_add(1, std::memory_order_relaxed);
  ucp_request_param_t param = {};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // Eager only: UCX 1.13's rendezvous would make the puller fetch the data
  // with the very RMA emulation this file exists to avoid.
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = &on_reply_sent;
  param.user_data = p;
  p->source = CopySource{data, length};
  const void* buffer = payload_buffer(param, by_copy, &p->source);
  ucs_status_ptr_t req =
      ucp_am_send_nbx(ep, id, &p->header, sizeof(p->header), buffer, length, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    // Sent in place, or failed at once: either way no callback follows.
    release(p);
    return !UCS_PTR_IS_ERR(req);
  }
  return true;
}

ucs_status_t refuse_request(void* arg, const void* header, size_t header_length, void*, size_t,
                            const ucp_am_recv_param_t* param) {
  // A GET's or PUT's header, or a gather's (of another size): both carry
  // the token at the same offset.
  static_assert(offsetof(am_rma::RequestHeader, token) == offsetof(am_rma::GatherHeader, token));
  if ((header_length != sizeof(am_rma::RequestHeader) && header_length != sizeof(am_rma::GatherHeader)) ||
      !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;
  }
  uint64_t token = 0;
  std::memcpy(&token, static_cast<const uint8_t*>(header) + offsetof(am_rma::RequestHeader, token), sizeof(token));
  const unsigned reply_id = static_cast<unsigned>(reinterpret_cast<uintptr_t>(arg));
  (void)send_reply(param->reply_ep, false, reply_id, token, UCS_ERR_UNSUPPORTED, 0, nullptr, 0, nullptr);
  return UCS_OK;
}

ucs_status_t drop(void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
  return UCS_OK;
}

}  // namespace

namespace am_rma {

ReplyPieces::Piece ReplyPieces::take() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      Piece piece = std::move(free_.back());
      free_.pop_back();
      return piece;
    }
  }
  Piece piece(new (std::nothrow) uint8_t[kReplyPieceBytes]);
  if (piece) allocated_.fetch_add(1, std::memory_order_relaxed);
  return piece;
}

void ReplyPieces::give(Piece piece) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.size() < keep_) free_.push_back(std::move(piece));
}

uint64_t ReplyPieces::kept() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_.size();
}

// The receivers' "gather_entries" (planner/gather.h) may go up to what a
// source serves.
static_assert(kMaxGatherEntries == refit::kGatherEntriesMax);

Status install_fallback_handler(ucp_worker_h worker, unsigned id) {
  switch (id) {
    case kGetRequest:
    case kGatherRequest:
      return set_am_handler(worker, id, &refuse_request,
                         reinterpret_cast<void*>(static_cast<uintptr_t>(kGetReply)));
    case kPutRequest:
      return set_am_handler(worker, id, &refuse_request,
                         reinterpret_cast<void*>(static_cast<uintptr_t>(kPutReply)));
    default:
      return set_am_handler(worker, id, &drop, nullptr);
  }
}

Status install_fallback_handlers(ucp_worker_h worker) {
  for (unsigned id : {kGetRequest, kGetReply, kPutRequest, kPutReply, kGatherRequest}) {
    REFIT_RETURN_IF_ERROR(install_fallback_handler(worker, id));
  }
  return Status::ok();
}

}  // namespace am_rma

Result<std::unique_ptr<AmRmaServer>> AmRmaServer::create(Worker& worker, Puts puts, uint64_t gather_reply_bytes) {
  if (worker.get() == nullptr) return Status::invalid("ucx am rma server: worker is empty");
  if (gather_reply_bytes == 0) {
    return Status::invalid("ucx am rma server: the gather reply memory (\"gather_reply_bytes\") must be positive");
  }
  std::unique_ptr<AmRmaServer> s(new AmRmaServer(worker, puts, gather_reply_bytes));
  REFIT_RETURN_IF_ERROR(s->set_handler(am_rma::kGetRequest, &AmRmaServer::on_get, s.get()));
  REFIT_RETURN_IF_ERROR(s->set_handler(am_rma::kPutRequest, &AmRmaServer::on_put, s.get()));
  REFIT_RETURN_IF_ERROR(s->set_handler(am_rma::kGatherRequest, &AmRmaServer::on_gather, s.get()));
  return s;
}

Status AmRmaServer::set_handler(unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  return set_am_handler(worker_.get(), id, cb, arg)
      .with_context("ucx am rma server");
}

AmRmaServer::~AmRmaServer() {
  (void)am_rma::install_fallback_handler(worker_.get(), am_rma::kGetRequest);
  (void)am_rma::install_fallback_handler(worker_.get(), am_rma::kPutRequest);
  (void)am_rma::install_fallback_handler(worker_.get(), am_rma::kGatherRequest);
  // Replies still in flight read exported memory: give them a moment.
  // Their callbacks do not touch the server, so any left are harmless to
  // the server's memory (not to the regions': see the header).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (inflight_->load() > 0 && std::chrono::steady_clock::now() < until) worker_.progress();
}

void AmRmaServer::export_region(const MemoryRegion& region, Words words) {
  std::lock_guard<std::mutex> lock(mutex_);
  regions_.push_back(Exported{&region, words, cpu_can_copy(region.type())});
}

void AmRmaServer::unexport_region(const MemoryRegion& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(regions_, [&](const Exported& e) { return e.region == &region; });
}

bool AmRmaServer::exported(uint64_t address, uint64_t length, bool for_write, Words* words, bool* gpu) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Exported& e : regions_) {
    if (!e.region->contains(reinterpret_cast<const void*>(address), length)) continue;
    if (!e.cpu) {  // a CPU copy of GPU memory would fault
      if (gpu != nullptr) *gpu = true;
      continue;
    }
    if (for_write && e.region->access() != Access::kRemoteReadWrite) continue;
    if (e.words == Words::kAtomicWords && (address % sizeof(uint64_t) != 0 || length % sizeof(uint64_t) != 0)) {
      continue;
    }
    if (words != nullptr) *words = e.words;
    return true;
  }
  return false;
}

bool AmRmaServer::quiesce(std::chrono::steady_clock::time_point deadline) {
  { std::unique_lock<std::shared_mutex> barrier(serving_); }
  // The progress thread completes the sends; their completions release
  // inflight_, which these loads acquire.
  while (inflight_->load(std::memory_order_acquire) > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void AmRmaServer::reply(ucp_ep_h ep, unsigned id, uint64_t token, ucs_status_t status) {
  (void)send_reply(ep, false, id, token, status, 0, nullptr, 0, inflight_);
}

void AmRmaServer::reply_data(ucp_ep_h ep, uint64_t token, const uint8_t* data, uint64_t length, Words words) {
  for (uint64_t offset = 0; offset < length; offset += am_rma::kReplyPieceBytes) {
    const uint64_t n = std::min<uint64_t>(am_rma::kReplyPieceBytes, length - offset);
    std::unique_ptr<uint8_t[]> snapshot;
    const uint8_t* from = data + offset;
    if (words == Words::kAtomicWords) {  // exported() checked the alignment
      // kReplyPieceBytes is a multiple of 8: no piece splits a word.
      snapshot.reset(new uint8_t[n]);
      for (uint64_t i = 0; i < n; i += sizeof(uint64_t)) {
        // atomic_ref takes a non-const object; a load does not write it.
        auto* word = reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(from + i));
        const uint64_t v = std::atomic_ref<uint64_t>(*word).load(std::memory_order_acquire);
        std::memcpy(snapshot.get() + i, &v, sizeof(v));
      }
      from = snapshot.get();
    }
    if (!send_reply(ep, worker_.am_by_copy(), am_rma::kGetReply, token, UCS_OK, offset, from, n, inflight_,
                    std::move(snapshot))) {
      return;  // the puller is gone; its deadline covers the rest
    }
  }
}

ucs_status_t AmRmaServer::on_get(void* arg, const void* header, size_t header_length,
                                 void* /*data*/, size_t /*length*/,
                                 const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmRmaServer*>(arg);
  std::shared_lock<std::shared_mutex> serving(self->serving_);
  am_rma::RequestHeader h;
  if (header_length != sizeof(h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;  // malformed, and no way to answer
  }
  std::memcpy(&h, header, sizeof(h));
  Words words = Words::kBytes;
  bool gpu = false;
  if (h.magic != am_rma::kMagic) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    self->reply(param->reply_ep, am_rma::kGetReply, h.token, UCS_ERR_UNSUPPORTED);
  } else if (h.length == 0 || !self->exported(h.address, h.length, false, &words, &gpu)) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    self->reply(param->reply_ep, am_rma::kGetReply, h.token, gpu ? UCS_ERR_NO_DEVICE : UCS_ERR_INVALID_ADDR);
  } else {
    self->served_.fetch_add(1, std::memory_order_relaxed);
    self->reply_data(param->reply_ep, h.token, reinterpret_cast<const uint8_t*>(h.address), h.length, words);
  }
  return UCS_OK;
}

ucs_status_t AmRmaServer::check_gather(const am_rma::GatherHeader& h, const void* data,
                                       size_t length) const {
  if (h.count == 0 || h.count > am_rma::kMaxGatherEntries ||
      length != uint64_t{h.count} * sizeof(am_rma::GatherEntry) || h.total == 0 ||
      h.total > am_rma::kMaxGatherBytes) {
    return UCS_ERR_INVALID_PARAM;
  }
  uint64_t sum = 0;
  for (uint32_t i = 0; i < h.count; ++i) {
    am_rma::GatherEntry e;
    std::memcpy(&e, static_cast<const uint8_t*>(data) + i * sizeof(e), sizeof(e));
    // Each length is at most the bound before it is added: no overflow.
    if (e.length == 0 || e.length > am_rma::kMaxGatherBytes - sum) return UCS_ERR_INVALID_PARAM;
    sum += e.length;
  }
  if (sum != h.total) return UCS_ERR_INVALID_PARAM;
  std::lock_guard<std::mutex> lock(mutex_);
  const MemoryRegion* last = nullptr;  // consecutive entries mostly share a region
  for (uint32_t i = 0; i < h.count; ++i) {
    am_rma::GatherEntry e;
    std::memcpy(&e, static_cast<const uint8_t*>(data) + i * sizeof(e), sizeof(e));
    const void* a = reinterpret_cast<const void*>(e.address);
    if (last != nullptr && last->contains(a, e.length)) continue;
    // A region of atomic words is read word by word (a GET), never gathered.
    auto it = std::find_if(regions_.begin(), regions_.end(), [&](const Exported& r) {
      return r.words == Words::kBytes && r.region->contains(a, e.length);
    });
    if (it == regions_.end()) return UCS_ERR_INVALID_ADDR;
    if (!it->cpu) return UCS_ERR_NO_DEVICE;  // GPU memory: a CPU copy would fault
    last = it->region;
  }
  return UCS_OK;
}

void AmRmaServer::reply_gather(ucp_ep_h ep, uint64_t token, const void* entries, uint32_t count,
                               uint64_t total) {
  std::unique_ptr<uint8_t[]> piece;
  uint64_t filled = 0;  // bytes in `piece`
  uint64_t offset = 0;  // of `piece` in the stream
  // The admission charged `total`; each piece gives its share back when its
  // send completes, and the pieces never sent give theirs back here.
  struct Unsent {
    std::atomic<uint64_t>& budget;
    uint64_t bytes;
    ~Unsent() { budget.fetch_sub(bytes, std::memory_order_relaxed); }
  } unsent{*reply_bytes_, total};
  for (uint32_t i = 0; i < count; ++i) {
    am_rma::GatherEntry e;
    std::memcpy(&e, static_cast<const uint8_t*>(entries) + i * sizeof(e), sizeof(e));
    const auto* from = reinterpret_cast<const uint8_t*>(e.address);
    uint64_t left = e.length;
    while (left > 0) {
      if (!piece) piece = pieces_->take();
      if (!piece) {
        // Out of memory: the puller's gather fails with this status (the
        // pieces sent before it count for nothing) and its refresh reports
        // it, naming the run and the source; this process goes on.
        reply(ep, am_rma::kGetReply, token, UCS_ERR_NO_MEMORY);
        return;
      }
      const uint64_t n = std::min(left, am_rma::kReplyPieceBytes - filled);
      std::memcpy(piece.get() + filled, from, n);
      from += n;
      left -= n;
      filled += n;
      if (filled == am_rma::kReplyPieceBytes) {
        const uint8_t* p = piece.get();
        unsent.bytes -= filled;
        if (!send_reply(ep, worker_.am_by_copy(), am_rma::kGetReply, token, UCS_OK, offset, p, filled,
                        inflight_, std::move(piece), reply_bytes_, pieces_)) {
          return;  // the puller is gone
        }
        offset += filled;
        filled = 0;
      }
    }
  }
  if (filled > 0) {
    const uint8_t* p = piece.get();
    unsent.bytes -= filled;
    (void)send_reply(ep, worker_.am_by_copy(), am_rma::kGetReply, token, UCS_OK, offset, p, filled, inflight_,
                     std::move(piece), reply_bytes_, pieces_);
  }
}

ucs_status_t AmRmaServer::admit_gather(uint64_t total) {
  if (total > gather_reply_limit_) return UCS_ERR_EXCEEDS_LIMIT;
  uint64_t used = reply_bytes_->load(std::memory_order_relaxed);
  do {
    if (used + total > gather_reply_limit_) return UCS_ERR_BUSY;
  } while (!reply_bytes_->compare_exchange_weak(used, used + total, std::memory_order_relaxed));
  uint64_t peak = reply_bytes_peak_.load(std::memory_order_relaxed);
  while (used + total > peak &&
         !reply_bytes_peak_.compare_exchange_weak(peak, used + total, std::memory_order_relaxed)) {
  }
  return UCS_OK;
}

ucs_status_t AmRmaServer::on_gather(void* arg, const void* header, size_t header_length, void* data,
                                    size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmRmaServer*>(arg);
  std::shared_lock<std::shared_mutex> serving(self->serving_);
  am_rma::GatherHeader h;
  if (header_length != sizeof(h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;  // malformed, and no way to answer
  }
  std::memcpy(&h, header, sizeof(h));
  ucs_status_t st = UCS_OK;
  if (h.magic != am_rma::kMagic || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    st = UCS_ERR_UNSUPPORTED;  // the engine always sends eager
  } else {
    st = self->check_gather(h, data, length);
  }
  if (st != UCS_OK) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    self->reply(param->reply_ep, am_rma::kGetReply, h.token, st);
    return UCS_OK;
  }
  st = self->admit_gather(h.total);
  if (st == UCS_ERR_BUSY) {
    // Its bytes would take the reply memory past the bound: the puller asks
    // again once it has waited a moment (get_engine.h).
    self->busy_.fetch_add(1, std::memory_order_relaxed);
    self->reply(param->reply_ep, am_rma::kGetReply, h.token, st);
    return UCS_OK;
  }
  if (st != UCS_OK) {
    // Larger than the bound: never servable. The reply's offset carries the
    // bound, so that the puller's error can name it.
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    (void)send_reply(param->reply_ep, false, am_rma::kGetReply, h.token, st, self->gather_reply_limit_, nullptr,
                     0, self->inflight_);
    return UCS_OK;
  }
  self->served_.fetch_add(1, std::memory_order_relaxed);
  self->reply_gather(param->reply_ep, h.token, data, h.count, h.total);
  return UCS_OK;
}

ucs_status_t AmRmaServer::on_put(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmRmaServer*>(arg);
  std::shared_lock<std::shared_mutex> serving(self->serving_);
  am_rma::RequestHeader h;
  if (header_length != sizeof(h) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;
  }
  std::memcpy(&h, header, sizeof(h));
  ucs_status_t st = UCS_OK;
  Words words = Words::kBytes;
  bool gpu = false;
  if (h.magic != am_rma::kMagic) {
    st = UCS_ERR_UNSUPPORTED;
  } else if (self->puts_ == Puts::kRefused) {
    st = UCS_ERR_REJECTED;  // nothing here may be written by a peer
  } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    st = UCS_ERR_UNSUPPORTED;  // the engine always sends eager
  } else if (h.length != length || length == 0 || !self->exported(h.address, h.length, false, nullptr, &gpu)) {
    st = gpu ? UCS_ERR_NO_DEVICE : UCS_ERR_INVALID_ADDR;
  } else if (!self->exported(h.address, h.length, /*for_write=*/true, &words)) {
    st = UCS_ERR_REJECTED;  // a region mapped remote-read-only
  }
  if (st == UCS_OK && words == Words::kAtomicWords) {  // exported() checked the alignment
    for (uint64_t i = 0; i < length; i += sizeof(uint64_t)) {
      uint64_t v;
      std::memcpy(&v, static_cast<const uint8_t*>(data) + i, sizeof(v));
      std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(h.address + i)).store(v, std::memory_order_release);
    }
    self->served_.fetch_add(1, std::memory_order_relaxed);
  } else if (st == UCS_OK) {
    std::memcpy(reinterpret_cast<void*>(h.address), data, length);
    self->served_.fetch_add(1, std::memory_order_relaxed);
  } else {
    self->refused_.fetch_add(1, std::memory_order_relaxed);
  }
  self->reply(param->reply_ep, am_rma::kPutReply, h.token, st);
  return UCS_OK;
}

}  // namespace refit::ucx
