#pragma once
// GET and PUT over refit's own active messages, for peers to which UCX has
// no RMA lane (tcp in UCX 1.13; shared memory with PeerErrorHandling::kPeer).
//
// Why: without an RMA lane UCX 1.13 emulates GET/PUT with internal active
// messages, and the target answers them from inside its AM handler
// (rma_sw.c: ucp_get_req_handler -> ucp_progress_get_reply; PUTs take the
// same path through ucp_put_handler -> ucp_rma_sw_send_cmpl, read in the
// source, not reproduced). When the puller is gone (killed,
// or it force-closed the endpoint at a deadline) while its requests are
// still queued at the target, that reply's send() fails (EPIPE), UCX
// destroys the target's internal endpoint, and ucp_request_try_send() calls
// ucs_fatal("unexpected error: Endpoint timeout") (ucp_request.inl:346 in
// 1.13.1): the target aborts. Seen with UCX_LOG_LEVEL=debug in the target:
// "send(14) failed: Broken pipe", "tcp_ep ...: remote disconnected", "ep
// ...: destroy endpoint which is not exposed to a user due to peer
// failure", then the Fatal. No setting avoids it, because the failing send
// happens inside the handler, before UCX knows the peer is gone: tried
// UCP_ERR_HANDLING_MODE_NONE on the puller (worse: the target then aborts
// even when it keeps up) and UCX_PROTO_ENABLE=y (same abort); keepalive and
// UCX_TCP_* timeouts only act later. Reproduced by
// tests/transport/ucx/dead_puller_test.cc, and by a puller that cancels at
// its deadline (force-close) while the target is busy. User active messages
// (ucp_am_send_nbx) complete with an error status instead, so refit
// carries the data itself:
//
//   GET: puller --kGetRequest{token, address, length}--> target
//        target --kGetReply{token, status, offset} + bytes--> puller (copies)
//               one reply per piece of kReplyPieceBytes, or one reply
//               without bytes when the target refuses
//   GATHER: puller --kGatherRequest{token, count, total} + count x
//                    GatherEntry{address, length}--> target
//        target --kGetReply{token, status, offset} + bytes--> puller
//               the entries' bytes in order, as one stream of `total`
//               bytes cut into pieces as for a GET; the puller scatters
//               each piece to where its stream bytes go
//   PUT: puller --kPutRequest{token, address, length} + bytes--> target
//        target copies, --kPutReply{token, status, 0}----------> puller
//
// A gather serves many small ranges in one request: a column slice of a
// row-major tensor is one range per row, and one GET per row costs the
// per-request overhead hundreds of thousands of times (docs/refresh.md,
// "Gathers"). Its entry list is peer input: the server refuses it whole
// (UCS_ERR_INVALID_PARAM) unless it has between 1 and kMaxGatherEntries
// entries, each of at least one byte, totalling exactly `total` and at most
// kMaxGatherBytes (checked without overflow), and refuses it with
// UCS_ERR_INVALID_ADDR unless every entry lies in one exported region of bytes (not atomic words). The
// server copies the bytes into reply buffers of kReplyPieceBytes each, held
// only until that reply's send completes, and it bounds that memory: a
// gather is admitted only while the reply bytes of the gathers it serves,
// with this one, stay within `gather_reply_bytes` (create()). One that
// would pass it is answered UCS_ERR_BUSY, and the puller asks again a
// moment later (get_engine.h); one larger than the bound itself can never
// be served and is answered UCS_ERR_EXCEEDS_LIMIT, with the bound in the
// reply's offset. So a source's extra memory is at most
// `gather_reply_bytes`, never a copy of its shard, however many pullers
// gather from it. The pieces are kept for the next gathers once their sends
// complete (at most `gather_reply_bytes` of them, for the server's life):
// freed, their memory went back to the kernel and every later piece was
// fresh pages, zeroed on the copy's first touch: 16% of the CPU samples of
// a gather-heavy refresh (local-replicated)
// (docs/refresh.md, "Gathers").
//
// The puller side is part of the GetEngine (get_engine.h); the target side
// is the AmRmaServer below, which every process that exports memory over
// tcp must run on its worker. A PUT done this way completes when the target
// has copied it, so it is already visible when the engine reports it.
//
// Threads: create() and the destructor (un)register UCX handlers, so call
// them while nobody progresses the worker (as for registering memory). The
// handlers run inside ucp_worker_progress on whichever thread progresses the
// worker; export/unexport may be called from any thread at any time
// (mutex_). Regions must stay exported (and mapped) until the server
// is destroyed or no reply from them is in flight.

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "planner/status.h"
#include "transport/ucx/memory.h"
#include "transport/ucx/worker.h"

namespace refit::ucx {

namespace am_rma {
// AM ids refit reserves on every worker. Small on purpose: UCX keeps its
// handlers in an array indexed by id. ActiveMessages uses 0x300..0x33f and
// 0x3e0 (active_message.h).
constexpr unsigned kGetRequest = 0x3F0;
constexpr unsigned kGetReply = 0x3F1;
constexpr unsigned kPutRequest = 0x3F2;
constexpr unsigned kPutReply = 0x3F3;
constexpr unsigned kGatherRequest = 0x3F4;  // answered with kGetReply
constexpr uint32_t kMagic = 0x52464d32;  // "RFM2": format version 2

struct RequestHeader {
  uint32_t magic = kMagic;
  uint32_t reserved = 0;
  uint64_t token = 0;    // the puller's; echoed in the reply
  uint64_t address = 0;  // in the target's exported memory
  uint64_t length = 0;
};

struct GatherHeader {
  uint32_t magic = kMagic;
  uint32_t count = 0;  // GatherEntry records in the message's data
  uint64_t token = 0;
  uint64_t total = 0;  // sum of the entries' lengths
};

struct GatherEntry {
  uint64_t address = 0;  // in the target's exported memory
  uint64_t length = 0;
};

// Bounds on one gather request (peer input, checked by the server).
constexpr uint32_t kMaxGatherEntries = 65536;
constexpr uint64_t kMaxGatherBytes = uint64_t{64} << 20;
// The reply memory a server holds for gathers by default (AmRmaServer).
constexpr uint64_t kDefaultGatherReplyBytes = uint64_t{256} << 20;

struct ReplyHeader {
  uint32_t magic = kMagic;
  int32_t status = 0;  // ucs_status_t: UCS_OK, or why the target refused
  uint64_t token = 0;
  uint64_t offset = 0;  // of this piece's bytes in the requested range
};

// A GET's bytes come back as replies of at most this many bytes each, each
// piece at its offset in the requested range. Why: UCX 1.13 hands a
// multi-fragment eager AM to the handler only after reassembling it in a
// buffer it allocates per message. For a large GET (64 MiB) that buffer is
// above glibc's largest mmap threshold (32 MiB), so every reply was a fresh
// mmap, a page fault per 4 KiB and a munmap, plus one more copy of the
// bytes. Measured over tcp on loopback with one 64 MiB GET in flight: 1.0 s
// of puller CPU per GB whole against 0.3-0.5 in pieces, 0.97 GB/s against
// 1.7-2.0. A piece this size goes as one eager zcopy fragment over tcp (its
// limit is UCX_TCP_RX_SEG_SIZE, 64 KiB by default, less the transport's and
// UCP's headers), so the puller's UCX passes it straight from its receive
// buffer and the engine copies it once, into place; pieces of exactly
// 64 KiB take two fragments and measured slower. Smaller pieces (8 KB) cost
// more per byte in per-message overhead.
constexpr uint64_t kReplyPieceBytes = (64u << 10) - 1024;
static_assert(kReplyPieceBytes % sizeof(uint64_t) == 0, "a piece of a region of atomic words holds whole words");

// The pieces of kReplyPieceBytes a server's gather replies are copied into,
// kept for reuse once their sends complete, at most `keep` of them. Any
// thread.
class ReplyPieces {
 public:
  using Piece = std::unique_ptr<uint8_t[]>;
  explicit ReplyPieces(uint64_t keep) : keep_(keep) {}
  // A kept piece, or a new one; null when memory ran out.
  Piece take();
  // Keeps `piece` for a later take(), or frees it when `keep` are kept.
  void give(Piece piece);
  uint64_t allocated() const { return allocated_.load(std::memory_order_relaxed); }
  uint64_t kept() const;

 private:
  const uint64_t keep_;
  mutable std::mutex mutex_;
  std::vector<Piece> free_;  // guarded by mutex_
  std::atomic<uint64_t> allocated_{0};
};

// Registers refit's fallback handlers for the five ids on a new worker (the
// Worker does this at create): requests are refused with
// UCS_ERR_UNSUPPORTED (no AmRmaServer here), stray replies are dropped.
// Without a handler, UCX 1.13 crashes in ucp_am_handler_reply on an AM sent
// with UCP_AM_SEND_FLAG_REPLY; with them a puller gets a clear error. The
// server and the engine put the fallback back when they go.
Status install_fallback_handlers(ucp_worker_h worker);
Status install_fallback_handler(ucp_worker_h worker, unsigned id);
}  // namespace am_rma

class AmRmaServer {
 public:
  // Whether the server serves PUTs at all. A source serves GETs only
  // (kRefused): a peer's PUT is refused with UCS_ERR_REJECTED whatever its
  // address, and the refusal counted (docs/security.md, "Data plane").
  enum class Puts { kServed, kRefused };

  // Registers the request handlers on `worker` (borrowed; must outlive the
  // server). One server per worker.
  // `gather_reply_bytes` (> 0) bounds the memory of gather replies in
  // flight (see the top).
  static Result<std::unique_ptr<AmRmaServer>> create(Worker& worker, Puts puts = Puts::kServed,
                                                     uint64_t gather_reply_bytes = am_rma::kDefaultGatherReplyBytes);
  ~AmRmaServer();
  AmRmaServer(const AmRmaServer&) = delete;
  AmRmaServer& operator=(const AmRmaServer&) = delete;

  // Peers may GET from [base, base + length) of `region` (borrowed), and PUT
  // to it when the server serves PUTs and the region was mapped with
  // Access::kRemoteReadWrite; a PUT into a region mapped kRemoteRead is
  // refused with UCS_ERR_REJECTED. Requests outside every exported region
  // are refused with UCS_ERR_INVALID_ADDR in the reply; requests into a
  // region of GPU memory (a CUDA-aware UCX maps it so, memory.h
  // cpu_can_copy) with UCS_ERR_NO_DEVICE: the server copies with the
  // CPU, and a peer that reaches it only so (tcp) must GET such memory
  // through a transport that reads it, or from a host copy.
  //
  // `words` says how the server touches the region's bytes. kBytes: with
  // memcpy, for memory its owner does not change while peers may read it
  // (a shard under its lease). kAtomicWords: for memory whose owner loads
  // and stores 8-byte words with atomics while peers read and write it (a
  // fabric's mailbox): a GET or PUT must cover whole aligned words, else it
  // is refused with UCS_ERR_INVALID_ADDR, and the server reads the words
  // with atomic loads into its reply and writes a PUT's words with atomic
  // stores, so that no word is ever read or written torn, and the owner's
  // atomics and the server's accesses are ordered for the memory model.
  enum class Words { kBytes, kAtomicWords };
  void export_region(const MemoryRegion& region, Words words = Words::kBytes);
  void unexport_region(const MemoryRegion& region);

  // Requests served and refused so far (for tests and logs).
  uint64_t served() const { return served_.load(std::memory_order_relaxed); }
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  // Reply messages (a GET's pieces count one each) whose send has not
  // completed yet.
  uint64_t replies_in_flight() const { return inflight_->load(std::memory_order_relaxed); }
  // Gathers answered UCS_ERR_BUSY (asked again later by their pullers).
  uint64_t busy() const { return busy_.load(std::memory_order_relaxed); }
  // Gather reply memory held now, and the most held at once so far; the
  // latter never exceeds the bound given to create().
  uint64_t gather_reply_bytes() const { return reply_bytes_->load(std::memory_order_relaxed); }
  uint64_t gather_reply_bytes_peak() const { return reply_bytes_peak_.load(std::memory_order_relaxed); }
  // Reply pieces allocated so far, and those kept for reuse now (see the
  // top): a server that gathers the same bytes again and again allocates
  // no more pieces than it once had in flight.
  uint64_t gather_pieces_allocated() const { return pieces_->allocated(); }
  uint64_t gather_pieces_kept() const { return pieces_->kept(); }

  // Waits until no request handler runs and every reply sent so far has
  // completed, or until `deadline`. The owner of exported memory calls it
  // before overwriting that memory once no peer may read it any more (a
  // source, once drained): a reply still being copied or sent from it would
  // otherwise carry bytes of the next version, and without this step nothing
  // orders the server's reads before the owner's writes in this process.
  // Returns false when replies were still in flight at the deadline: their
  // pullers gave up (a puller whose lease is released has all its bytes).
  // Any thread but the worker's progress thread.
  bool quiesce(std::chrono::steady_clock::time_point deadline);

 private:
  AmRmaServer(Worker& worker, Puts puts, uint64_t gather_reply_bytes)
      : worker_(worker),
        puts_(puts),
        gather_reply_limit_(gather_reply_bytes),
        // Kept pieces stay within the bound on reply memory (see the top).
        pieces_(std::make_shared<am_rma::ReplyPieces>(gather_reply_bytes / am_rma::kReplyPieceBytes)) {}
  static ucs_status_t on_get(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t on_gather(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  // Why a gather's entry list is refused (UCS_ERR_INVALID_PARAM: malformed
  // or out of bounds; UCS_ERR_INVALID_ADDR: an entry outside every
  // exported region), or UCS_OK.
  ucs_status_t check_gather(const am_rma::GatherHeader& h, const void* data, size_t length) const;
  // Charges `total` bytes of reply memory: UCS_OK, UCS_ERR_BUSY (not now)
  // or UCS_ERR_EXCEEDS_LIMIT (never).
  ucs_status_t admit_gather(uint64_t total);
  // The entries' bytes (`total`, admitted), in order, in pieces of at most
  // kReplyPieceBytes.
  void reply_gather(ucp_ep_h ep, uint64_t token, const void* entries, uint32_t count, uint64_t total);
  static ucs_status_t on_put(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  // Whether [address, +length) lies in one exported region (and, with
  // `for_write`, one mapped Access::kRemoteReadWrite), and a region of
  // atomic words only in whole aligned words. *words, if given, is how
  // that region is touched. *gpu (optional) is set when the range lies in
  // a region of GPU memory, which is never served.
  bool exported(uint64_t address, uint64_t length, bool for_write = false, Words* words = nullptr,
                bool* gpu = nullptr) const;
  // A reply without bytes: a PUT's, or a refusal.
  void reply(ucp_ep_h ep, unsigned id, uint64_t token, ucs_status_t status);
  // A GET's bytes, in pieces of at most am_rma::kReplyPieceBytes; from a
  // snapshot loaded word by word for a region of atomic words.
  void reply_data(ucp_ep_h ep, uint64_t token, const uint8_t* data, uint64_t length, Words words);
  Status set_handler(unsigned id, ucp_am_recv_callback_t cb, void* arg);

  Worker& worker_;
  const Puts puts_;
  // Held shared by every request handler while it runs, and exclusively by
  // quiesce() for a moment: a barrier between the handlers and the owner.
  mutable std::shared_mutex serving_;
  mutable std::mutex mutex_;
  struct Exported {
    const MemoryRegion* region;
    Words words;
    bool cpu;  // cpu_can_copy(region->type()): served; else refused
  };
  std::vector<Exported> regions_;  // guarded by mutex_
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> busy_{0};
  const uint64_t gather_reply_limit_;
  // Gather reply bytes held; shared with the send callbacks, like inflight_.
  std::shared_ptr<std::atomic<uint64_t>> reply_bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<uint64_t> reply_bytes_peak_{0};
  // Shared with the send callbacks, which may run after the server is gone.
  std::shared_ptr<std::atomic<uint64_t>> inflight_ = std::make_shared<std::atomic<uint64_t>>(0);
  // Gather reply pieces whose sends completed, for the next gathers; shared
  // with the send callbacks, like inflight_.
  const std::shared_ptr<am_rma::ReplyPieces> pieces_;
};

}  // namespace refit::ucx
