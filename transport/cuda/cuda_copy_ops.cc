#include "transport/cuda/cuda_copy_ops.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "transport/cuda/cuda_status.h"
#include "transport/cuda/device_guard.h"
#include "transport/cuda/scatter_kernel.h"

namespace refit::cuda {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

}  // namespace

Result<std::unique_ptr<CudaCopyOps>> CudaCopyOps::create(int device) {
  REFIT_RETURN_IF_ERROR(probe_device());
  DeviceGuard guard(device);
  REFIT_RETURN_IF_ERROR(guard.status());
  std::unique_ptr<CudaCopyOps> ops(new CudaCopyOps(device));
  cudaStream_t stream = nullptr;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  ops->stream_ = stream;
  return ops;
}

CudaCopyOps::~CudaCopyOps() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaStreamSynchronize(as_stream(stream_));
  for (auto& [ticket, e] : pending_) cudaEventDestroy(as_event(e));
  for (void* e : spare_) cudaEventDestroy(as_event(e));
  cudaStreamDestroy(as_stream(stream_));
  if (tables_) cudaFreeHost(tables_);
}

namespace {

bool small_1d(const Copy& c) {
  return c.height == 1 && c.depth == 1 && c.width <= CudaCopyOps::kScatterMaxBytes;
}

// Whether the kernel may touch p: device memory, or host memory CUDA has
// pinned (mapped under unified addressing). Plain pageable memory is not.
bool kernel_reaches(const void* p) {
  cudaPointerAttributes a = {};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ||
         (a.type == cudaMemoryTypeHost && a.devicePointer == p);
}

}  // namespace

Status CudaCopyOps::copy_all(std::span<const Copy> copies) {
#ifdef REFIT_HAVE_SCATTER_KERNEL
  size_t i = 0;
  while (i < copies.size()) {
    size_t j = i;
    while (j < copies.size() && small_1d(copies[j])) ++j;
    if (j - i >= kScatterMin && kernel_reaches(copies[i].dst) && kernel_reaches(copies[i].src)) {
      REFIT_RETURN_IF_ERROR(scatter(copies.subspan(i, j - i)));
      i = j;
      continue;
    }
    for (size_t k = i; k < std::max(j, i + 1) && k < copies.size(); ++k) REFIT_RETURN_IF_ERROR(copy(copies[k]));
    i = std::max(j, i + 1);
  }
  return Status::ok();
#else
  return CopyOps::copy_all(copies);
#endif
}

Status CudaCopyOps::scatter(std::span<const Copy> run) {
#ifdef REFIT_HAVE_SCATTER_KERNEL
  DeviceGuard guard(device_);
  REFIT_RETURN_IF_ERROR(guard.status());
  if (tables_ == nullptr) {
    REFIT_RETURN_IF_ERROR(from_cuda(cudaHostAlloc(&tables_, kTables * kTablePieces * sizeof(ScatterPiece),
                                                  cudaHostAllocPortable | cudaHostAllocMapped),
                                    "cudaHostAlloc(scatter tables)"));
    table_ticket_.assign(kTables, 0);
  }
  for (size_t at = 0; at < run.size(); at += kTablePieces) {
    const size_t n = std::min(kTablePieces, run.size() - at);
    const size_t t = next_table_;
    next_table_ = (next_table_ + 1) % kTables;
    // The table's last kernel must have read it before it is rewritten.
    while (true) {
      Result<bool> d = done(table_ticket_[t]);
      if (!d.is_ok()) return d.status();
      if (*d) break;
    }
    ScatterPiece* table = static_cast<ScatterPiece*>(tables_) + t * kTablePieces;
    uint64_t max_bytes = 0;
    for (size_t k = 0; k < n; ++k) {
      table[k] = ScatterPiece{run[at + k].dst, run[at + k].src, run[at + k].width};
      max_bytes = std::max(max_bytes, run[at + k].width);
    }
    REFIT_RETURN_IF_ERROR(
        from_cuda(static_cast<cudaError_t>(launch_scatter(table, static_cast<uint32_t>(n), max_bytes, stream_)),
                  "scatter kernel (" + std::to_string(n) + " pieces)"));
    ++launches_;
    Result<uint64_t> ticket = record();
    if (!ticket.is_ok()) return ticket.status();
    table_ticket_[t] = *ticket;
  }
  return Status::ok();
#else
  return CopyOps::copy_all(run);
#endif
}

Status CudaCopyOps::copy(const Copy& c) {
  DeviceGuard guard(device_);
  REFIT_RETURN_IF_ERROR(guard.status());
  if (c.height == 1 && c.depth == 1) {
    return from_cuda(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, as_stream(stream_)),
                     "cudaMemcpyAsync(" + std::to_string(c.width) + " bytes)");
  }
  if (c.depth == 1) {
    return from_cuda(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.height, cudaMemcpyDefault,
                                       as_stream(stream_)),
                     "cudaMemcpy2DAsync(" + std::to_string(c.height) + " rows of " + std::to_string(c.width) +
                         " bytes, pitches " + std::to_string(c.dst_pitch) + "/" + std::to_string(c.src_pitch) + ")");
  }
  cudaMemcpy3DParms p = {};
  p.srcPtr = make_cudaPitchedPtr(const_cast<uint8_t*>(c.src), c.src_pitch, c.width, c.src_plane / c.src_pitch);
  p.dstPtr = make_cudaPitchedPtr(c.dst, c.dst_pitch, c.width, c.dst_plane / c.dst_pitch);
  p.extent = make_cudaExtent(c.width, c.height, c.depth);
  p.kind = cudaMemcpyDefault;
  return from_cuda(cudaMemcpy3DAsync(&p, as_stream(stream_)),
                   "cudaMemcpy3DAsync(" + std::to_string(c.depth) + " planes of " + std::to_string(c.height) +
                       " rows of " + std::to_string(c.width) + " bytes)");
}

Result<uint64_t> CudaCopyOps::record() {
  DeviceGuard guard(device_);
  REFIT_RETURN_IF_ERROR(guard.status());
  void* e = nullptr;
  if (!spare_.empty()) {
    e = spare_.back();
    spare_.pop_back();
  } else {
    cudaEvent_t ev = nullptr;
    REFIT_RETURN_IF_ERROR(from_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"));
    e = ev;
  }
  Status st = from_cuda(cudaEventRecord(as_event(e), as_stream(stream_)), "cudaEventRecord");
  if (!st.is_ok()) {
    spare_.push_back(e);
    return st;
  }
  pending_.emplace_back(next_ticket_, e);
  return next_ticket_++;
}

Result<bool> CudaCopyOps::done(uint64_t ticket) {
  while (!pending_.empty() && ticket > completed_) {
    const cudaError_t q = cudaEventQuery(as_event(pending_.front().second));
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess) return from_cuda(q, "cudaEventQuery (a staging copy)");
    completed_ = pending_.front().first;
    spare_.push_back(pending_.front().second);
    pending_.pop_front();
  }
  return ticket <= completed_;
}

Result<PinnedBuffer> PinnedBuffer::allocate(uint64_t bytes) {
  void* p = nullptr;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                                  "cudaHostAlloc(" + std::to_string(bytes) + " bytes of staging)"));
  return PinnedBuffer(static_cast<uint8_t*>(p), bytes);
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

Result<DeviceBuffer> DeviceBuffer::allocate(int device, uint64_t bytes) {
  DeviceGuard guard(device);
  REFIT_RETURN_IF_ERROR(guard.status());
  void* p = nullptr;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaMalloc(&p, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)"));
  return DeviceBuffer(static_cast<uint8_t*>(p), bytes);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFree(data_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}

Result<bool> is_device_pointer(const void* p) {
  cudaPointerAttributes a = {};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error: an unknown pointer is host memory
    if (e == cudaErrorInvalidValue) return false;
    // Without a driver or a device no pointer is device memory.
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInitializationError) return false;
    return from_cuda(e, "cudaPointerGetAttributes");
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

Result<int> current_device() {
  int device = 0;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaGetDevice(&device), "cudaGetDevice"));
  return device;
}

Status copy_now(void* dst, const void* src, uint64_t bytes) {
  return from_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy(" + std::to_string(bytes) + " bytes)");
}

}  // namespace refit::cuda
