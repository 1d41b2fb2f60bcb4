#include "transport/cuda/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "transport/cuda/cuda_status.h"
#include "transport/cuda/nccl_status.h"

namespace refit::cuda {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Polls a non-blocking communicator until it is no longer in progress.
Status settle(ncclComm_t comm, Clock::time_point deadline, const std::string& what) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    REFIT_RETURN_IF_ERROR(from_nccl(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError"));
    if (state != ncclInProgress) return from_nccl(state, what);
    if (Clock::now() >= deadline) {
      return Status::timeout(what + ": still in progress at the deadline (a rank of the domain did not join)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Owns the communicator, its stream, the count words (device) and their
// pinned mirror. Move-free: held by unique_ptr. Threads: one at a time.
class NcclDomainComm final : public DomainComm {
 public:
  NcclDomainComm(int device, void* upstream, ncclComm_t comm, int32_t rank, int32_t size)
      : device_(device), upstream_(upstream), comm_(comm), rank_(rank), size_(size) {}
  ~NcclDomainComm() override {
    cudaSetDevice(device_);
    if (comm_) {
      // A comm with work still in flight (a peer gone) is aborted. An idle
      // one is finalized (non-blocking: polled, for a bounded time) and
      // destroyed; if finalizing does not settle, it is aborted too.
      Result<bool> idle = pending_ || launching_ ? this->idle() : Result<bool>(true);
      bool clean = idle.is_ok() && *idle && from_nccl(ncclCommFinalize(comm_), "ncclCommFinalize").is_ok();
      clean = clean && settle(comm_, Clock::now() + std::chrono::seconds(2), "ncclCommFinalize").is_ok();
      if (clean) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (done_) cudaEventDestroy(done_);
    if (upstream_event_) cudaEventDestroy(upstream_event_);
    if (stream_) cudaStreamDestroy(as_stream(stream_));
    if (words_) cudaFree(words_);
    if (host_words_) cudaFreeHost(host_words_);
    free_packs();
  }

  Status init() {
    REFIT_RETURN_IF_ERROR(from_cuda(cudaSetDevice(device_), "cudaSetDevice"));
    cudaStream_t s = nullptr;
    REFIT_RETURN_IF_ERROR(from_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"));
    stream_ = s;
    REFIT_RETURN_IF_ERROR(from_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate"));
    REFIT_RETURN_IF_ERROR(
        from_cuda(cudaEventCreateWithFlags(&upstream_event_, cudaEventDisableTiming), "cudaEventCreate"));
    word_count_ = 2 * kCountWordsPerPeer * static_cast<size_t>(size_);  // a round's announcements, both ways
    void* w = nullptr;
    REFIT_RETURN_IF_ERROR(from_cuda(cudaMalloc(&w, word_count_ * 8), "cudaMalloc(count words)"));
    words_ = static_cast<uint64_t*>(w);
    REFIT_RETURN_IF_ERROR(from_cuda(cudaHostAlloc(&w, word_count_ * 8, cudaHostAllocPortable), "cudaHostAlloc(count words)"));
    host_words_ = static_cast<uint64_t*>(w);
    std::memset(host_words_, 0, word_count_ * 8);
    return Status::ok();
  }
  ncclComm_t release() { return std::exchange(comm_, nullptr); }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  void set_deadline(Clock::time_point deadline) override { deadline_ = deadline; }
  uint64_t* words() override { return words_; }
  uint64_t* host_words() override { return host_words_; }
  size_t word_count() const override { return word_count_; }

  Status put_words(size_t n) override {
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    return stream_op(cudaMemcpyAsync(words_, host_words_, n * 8, cudaMemcpyHostToDevice, as_stream(stream_)),
                     "cudaMemcpyAsync(count words to the device)");
  }
  Status get_words(size_t from, size_t n) override {
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    return stream_op(
        cudaMemcpyAsync(host_words_ + from, words_ + from, n * 8, cudaMemcpyDeviceToHost, as_stream(stream_)),
        "cudaMemcpyAsync(count words to the host)");
  }
  Status order_after_upstream() override {
    if (upstream_ == nullptr) return Status::ok();
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    REFIT_RETURN_IF_ERROR(from_cuda(cudaEventRecord(upstream_event_, as_stream(upstream_)), "cudaEventRecord(upstream)"));
    return from_cuda(cudaStreamWaitEvent(as_stream(stream_), upstream_event_, 0), "cudaStreamWaitEvent(upstream)");
  }
  Status issue(std::span<const P2p> group) override {
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    Status st = from_nccl(ncclGroupStart(), "ncclGroupStart");
    if (!st.is_ok()) return st;
    for (const P2p& op : group) {
      if (!st.is_ok()) break;
      st = op.kind == P2p::Kind::kSend
               ? from_nccl(ncclSend(op.data, op.bytes, ncclUint8, op.peer, comm_, as_stream(stream_)),
                           "ncclSend(" + std::to_string(op.bytes) + " bytes to rank " + std::to_string(op.peer) + ")")
               : from_nccl(ncclRecv(op.data, op.bytes, ncclUint8, op.peer, comm_, as_stream(stream_)),
                           "ncclRecv(" + std::to_string(op.bytes) + " bytes from rank " + std::to_string(op.peer) + ")");
    }
    const Status end = from_nccl(ncclGroupEnd(), "ncclGroupEnd");
    REFIT_RETURN_IF_ERROR(st);
    REFIT_RETURN_IF_ERROR(end);
    launching_ = true;  // on the stream once the communicator settles
    pending_ = true;
    return Status::ok();
  }
  Result<bool> idle() override {
    if (!comm_) return Status::internal("nccl: the communicator was aborted");
    REFIT_RETURN_IF_ERROR(current());
    if (launching_) {
      ncclResult_t state = ncclSuccess;
      REFIT_RETURN_IF_ERROR(from_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError"));
      if (state == ncclInProgress) return false;
      REFIT_RETURN_IF_ERROR(from_nccl(state, "a group of sends and receives"));
      launching_ = false;
      REFIT_RETURN_IF_ERROR(from_cuda(cudaEventRecord(done_, as_stream(stream_)), "cudaEventRecord"));
    }
    if (!pending_) return true;
    ncclResult_t state = ncclSuccess;
    REFIT_RETURN_IF_ERROR(from_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError"));
    REFIT_RETURN_IF_ERROR(from_nccl(state, "the communicator"));
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaErrorNotReady) return false;
    REFIT_RETURN_IF_ERROR(from_cuda(q, "cudaEventQuery(fabric stream)"));
    pending_ = false;
    return true;
  }
  void abort() override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    launching_ = pending_ = false;
  }

#ifdef REFIT_HAVE_SCATTER_KERNEL
  Result<PackAreas> pack_areas(uint64_t bytes, size_t max_pieces) override {
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    if (max_pieces == 0 || max_pieces > UINT32_MAX) {
      return Status::invalid("nccl: a scatter of " + std::to_string(max_pieces) + " pieces at most");
    }
    bool tables_fit = true;
    for (const Table& t : tables_) tables_fit = tables_fit && t.data != nullptr && t.capacity >= max_pieces;
    if (areas_.send != nullptr && area_bytes_ == bytes && tables_fit) return areas_;
    // New sizes: the old areas and tables are idle once the stream is (the
    // fabric asks before its first round, after the last refresh's final
    // wait). Nothing allocates after this: cudaFree/cudaFreeHost would wait
    // for the device, also behind an NCCL kernel whose peer is gone.
    REFIT_RETURN_IF_ERROR(from_cuda(cudaStreamSynchronize(as_stream(stream_)), "cudaStreamSynchronize(pack areas)"));
    if (!tables_fit) {
      for (Table& t : tables_) {
        if (t.data) cudaFreeHost(t.data);
        t.data = nullptr;
        t.capacity = 0;
        void* h = nullptr;
        REFIT_RETURN_IF_ERROR(from_cuda(cudaHostAlloc(&h, max_pieces * sizeof(ScatterPiece),
                                                      cudaHostAllocPortable | cudaHostAllocMapped),
                                        "cudaHostAlloc(scatter table of " + std::to_string(max_pieces) + " pieces)"));
        t.data = static_cast<ScatterPiece*>(h);
        t.capacity = max_pieces;
        if (t.event == nullptr) {
          REFIT_RETURN_IF_ERROR(
              from_cuda(cudaEventCreateWithFlags(&t.event, cudaEventDisableTiming), "cudaEventCreate"));
        }
      }
    }
    if (areas_.send != nullptr && area_bytes_ == bytes) return areas_;
    free_areas();
    void* a = nullptr;
    REFIT_RETURN_IF_ERROR(from_cuda(cudaMalloc(&a, bytes), "cudaMalloc(send pack area, " + std::to_string(bytes) + " bytes)"));
    areas_.send = static_cast<uint8_t*>(a);
    Status st = from_cuda(cudaMalloc(&a, bytes), "cudaMalloc(receive pack area, " + std::to_string(bytes) + " bytes)");
    if (!st.is_ok()) {
      free_areas();
      return st;
    }
    areas_.recv = static_cast<uint8_t*>(a);
    area_bytes_ = bytes;
    return areas_;
  }

  // The pieces go to a pinned, mapped table the kernel reads; two tables
  // alternate (a round's gather and scatter), each rewritten only once the
  // stream has passed its last kernel (a wait bounded by the deadline). The
  // tables are pack_areas()'s: nothing is allocated here.
  Status scatter(std::span<const ScatterPiece> pieces) override {
    if (pieces.empty()) return Status::ok();
    Table& t = tables_[next_table_];
    if (t.data == nullptr) return Status::internal("nccl: scatter() before pack_areas()");
    if (pieces.size() > t.capacity) {
      return Status::invalid("nccl: a scatter of " + std::to_string(pieces.size()) + " pieces, the tables hold " +
                             std::to_string(t.capacity) + " (pack_areas())");
    }
    REFIT_RETURN_IF_ERROR(launched());
    REFIT_RETURN_IF_ERROR(current());
    REFIT_RETURN_IF_ERROR(wait_event(t.event, "a scatter table's last kernel"));
    next_table_ ^= 1;
    std::memcpy(t.data, pieces.data(), pieces.size() * sizeof(ScatterPiece));
    uint64_t max_bytes = 0;
    for (const ScatterPiece& pc : pieces) max_bytes = std::max(max_bytes, pc.bytes);
    const auto n = static_cast<uint32_t>(pieces.size());
    REFIT_RETURN_IF_ERROR(from_cuda(static_cast<cudaError_t>(launch_scatter(t.data, n, max_bytes, stream_)),
                                    "scatter kernel (" + std::to_string(n) + " pieces of the packed fan-out)"));
    REFIT_RETURN_IF_ERROR(from_cuda(cudaEventRecord(t.event, as_stream(stream_)), "cudaEventRecord(scatter table)"));
    return stream_op(cudaSuccess, "scatter kernel");
  }
#endif

 private:
  // Waits (to the deadline) until the last group is on the stream: nothing
  // may be issued behind a group NCCL is still launching.
  // The round thread is new for every refresh: make the device current on it.
  Status current() { return from_cuda(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")"); }
  Status launched() {
    if (!comm_) return Status::internal("nccl: the communicator was aborted");
    if (!launching_) return Status::ok();
    REFIT_RETURN_IF_ERROR(current());
    REFIT_RETURN_IF_ERROR(settle(comm_, deadline_, "launching a group of sends and receives"));
    launching_ = false;
    return from_cuda(cudaEventRecord(done_, as_stream(stream_)), "cudaEventRecord");
  }
  // Polls `event` until the stream passed it, to the deadline.
  Status wait_event(cudaEvent_t event, const char* what) {
    while (true) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return Status::ok();
      if (q != cudaErrorNotReady) return from_cuda(q, std::string("cudaEventQuery(") + what + ")");
      if (Clock::now() >= deadline_) return Status::timeout(std::string("nccl: waiting for ") + what + " at the deadline");
      std::this_thread::yield();
    }
  }
  void free_areas() {
    if (areas_.send) cudaFree(areas_.send);
    if (areas_.recv) cudaFree(areas_.recv);
    areas_ = PackAreas{};
    area_bytes_ = 0;
  }
  void free_packs() {
    free_areas();
    for (Table& t : tables_) {
      if (t.event) cudaEventDestroy(t.event);
      if (t.data) cudaFreeHost(t.data);
      t = Table{};
    }
  }
  Status stream_op(cudaError_t e, const std::string& what) {
    REFIT_RETURN_IF_ERROR(from_cuda(e, what));
    pending_ = true;
    return from_cuda(cudaEventRecord(done_, as_stream(stream_)), "cudaEventRecord");
  }

  int device_ = 0;
  void* upstream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int32_t rank_ = 0;
  int32_t size_ = 0;
  void* stream_ = nullptr;
  cudaEvent_t done_ = nullptr;            // after the last thing issued
  cudaEvent_t upstream_event_ = nullptr;
  uint64_t* words_ = nullptr;
  uint64_t* host_words_ = nullptr;
  size_t word_count_ = 0;
  // The packed fan-out's areas (device memory) and scatter tables.
  struct Table {
    ScatterPiece* data = nullptr;  // pinned, mapped
    size_t capacity = 0;
    cudaEvent_t event = nullptr;   // after its last kernel
  };
  PackAreas areas_;
  uint64_t area_bytes_ = 0;
  Table tables_[2];
  int next_table_ = 0;
  bool launching_ = false;  // a group NCCL has not yet put on the stream
  bool pending_ = false;    // something issued since the stream was last idle
  Clock::time_point deadline_ = Clock::time_point::max();
};

class NcclCommFactory final : public CommFactory {
 public:
  NcclCommFactory(int device, void* upstream) : device_(device), upstream_(upstream) {}
#ifdef REFIT_HAVE_SCATTER_KERNEL
  bool can_scatter() const override { return true; }
#endif

  Result<std::vector<uint8_t>> unique_id() override {
    ncclUniqueId id;
    REFIT_RETURN_IF_ERROR(from_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    return std::vector<uint8_t>(id.internal, id.internal + NCCL_UNIQUE_ID_BYTES);
  }

  Result<std::unique_ptr<DomainComm>> connect(const std::vector<uint8_t>& id, int32_t size, int32_t rank,
                                              Clock::time_point deadline) override {
    if (id.size() != NCCL_UNIQUE_ID_BYTES) {
      return Status::invalid("nccl: a unique id has " + std::to_string(NCCL_UNIQUE_ID_BYTES) + " bytes, got " +
                             std::to_string(id.size()));
    }
    REFIT_RETURN_IF_ERROR(from_cuda(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")"));
    ncclUniqueId uid;
    std::memcpy(uid.internal, id.data(), NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const std::string what =
        "ncclCommInitRankConfig(rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
    Status st = from_nccl(ncclCommInitRankConfig(&comm, size, uid, rank, &config), what);
    if (st.is_ok() && comm != nullptr) st = settle(comm, deadline, what);
    if (!st.is_ok() || comm == nullptr) {
      if (comm != nullptr) ncclCommAbort(comm);
      return st.is_ok() ? Status::internal(what + " returned no communicator") : st;
    }
    auto c = std::make_unique<NcclDomainComm>(device_, upstream_, comm, rank, size);
    c->set_deadline(deadline);
    Status init = c->init();
    if (!init.is_ok()) {
      ncclCommAbort(c->release());
      return init;
    }
    return std::unique_ptr<DomainComm>(std::move(c));
  }

 private:
  int device_;
  void* upstream_;
};

}  // namespace

Result<std::unique_ptr<CommFactory>> nccl_comm_factory(int device, void* upstream) {
  REFIT_RETURN_IF_ERROR(probe_device());
  int count = 0;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"));
  if (device < 0 || device >= count) {
    return Status::invalid("nccl: device " + std::to_string(device) + " does not exist (this machine has " +
                           std::to_string(count) + ")");
  }
  return std::unique_ptr<CommFactory>(new NcclCommFactory(device, upstream));
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // Since 2.9: major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

}  // namespace refit::cuda
