#include "transport/convert/convert_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "transport/convert/convert_kernel.h"
#include "transport/convert/relayout_kernel.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/device_guard.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::convert {
namespace {

using ::refit::cuda::from_cuda;

// The GPU that holds `dst`: the calls below run there, whatever device the
// calling thread has current (a receiver's fan-out thread never set one;
// on a second GPU the scratch and the kernel would land on the first), and
// the thread's device is restored when they return.
Result<int> device_of(const void* dst, const std::string& where) {
  const ::refit::cuda::PointerKind kind = ::refit::cuda::probe_pointer(dst);
  if (!kind.device) return Status::invalid(where + ": the destination is not GPU memory");
  return kind.ordinal;
}

size_t quantize_scratch_bytes(int64_t nblocks) { return 8 + 4 * static_cast<size_t>(nblocks); }

// The quantize kernels over `a` (device pointers) on the current device and
// `s`, with `scratch` of quantize_scratch_bytes; waits for them. A block
// with NaN or infinity is named, and nothing is written.
Status quantize_on(const QuantizeArgs& a, cudaStream_t s, void* scratch, int64_t bcols, const std::string& where) {
  const int64_t nblocks = ((a.rows + a.block.rows - 1) / a.block.rows) * bcols;
  auto* bad = static_cast<unsigned long long*>(scratch);
  Status st = from_cuda(cudaMemsetAsync(bad, 0xFF, 8, s), "cudaMemsetAsync(8 bytes)");
  if (st.is_ok()) {
    convert::cuda::DeviceQuantize q;
    q.src = a.src;
    q.src_is_bf16 = a.src_dtype == DType::kBF16;
    q.src_stride = a.src_stride;
    q.rows = a.rows;
    q.cols = a.cols;
    q.dst = a.dst;
    q.dst_stride = a.dst_stride;
    q.scales = a.scales;
    q.scale_stride = a.scale_stride;
    q.block_rows = a.block.rows;
    q.block_cols = a.block.cols;
    q.amax_scratch = reinterpret_cast<uint32_t*>(static_cast<char*>(scratch) + 8);
    q.bad_block = bad;
    st = from_cuda(static_cast<cudaError_t>(convert::cuda::launch_quantize_e4m3(q, s)),
                   "launch of the quantize kernels (" + std::to_string(nblocks) + " blocks)");
  }
  unsigned long long bad_host = ~0ull;
  if (st.is_ok()) st = from_cuda(cudaMemcpyAsync(&bad_host, bad, 8, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync(8 bytes to host)");
  // Waited for whatever failed: a kernel already queued may still write the
  // weights or read the scratch that the next call reuses.
  const Status waited = from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  REFIT_RETURN_IF_ERROR(st.with_context(where));
  REFIT_RETURN_IF_ERROR(waited.with_context(where));
  if (bad_host != ~0ull) {
    const int64_t b = static_cast<int64_t>(bad_host);
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\" block (" +
                           std::to_string(a.block_row0 + b / bcols) + ", " + std::to_string(a.block_col0 + b % bcols) +
                           ") holds NaN or an infinity; refusing to quantize it (nothing written)");
  }
  return Status::ok();
}

// Frees a GpuWork area made for one call when the call returns.
class OnceScratch {
 public:
  OnceScratch(GpuWork& work, int device) : work_(work), device_(device) {}
  ~OnceScratch() { work_.release_scratch(device_); }
  OnceScratch(const OnceScratch&) = delete;
  OnceScratch& operator=(const OnceScratch&) = delete;

 private:
  GpuWork& work_;
  int device_;
};

}  // namespace

GpuWork::~GpuWork() {
  // At process exit the CUDA runtime may be gone already: errors are not
  // reported (there is no one to report them to).
  for (Device& d : devices_) {
    const ::refit::cuda::DeviceGuard guard(d.device);
    if (!guard.status().is_ok()) continue;
    release(d, d.once);
    release(d, d.kept);
    if (d.stream) {
      cudaStreamSynchronize(static_cast<cudaStream_t>(d.stream));
      cudaStreamDestroy(static_cast<cudaStream_t>(d.stream));
    }
  }
}

GpuWork::Device* GpuWork::find(int device) {
  for (Device& d : devices_) {
    if (d.device == device) return &d;
  }
  return nullptr;
}

size_t GpuWork::kept_scratch_bytes(int device) const {
  for (const Device& d : devices_) {
    if (d.device == device) return d.kept_bytes;
  }
  return 0;
}

Result<GpuWork::Device*> GpuWork::get(int device) {
  if (Device* d = find(device)) return d;
  cudaStream_t s = nullptr;
  REFIT_RETURN_IF_ERROR(from_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags(non-blocking) on device " + std::to_string(device)));
  Device d;
  d.device = device;
  d.stream = s;
  int pools = 0;
  d.pools = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) == cudaSuccess && pools != 0;
  devices_.push_back(d);
  return &devices_.back();
}

Result<void*> GpuWork::allocate(Device& d, size_t bytes) {
  void* p = nullptr;
  const std::string what = std::string(d.pools ? "cudaMallocAsync(" : "cudaMalloc(") + std::to_string(bytes) +
                           " bytes of scratch on device " + std::to_string(d.device) + ")";
  const cudaError_t e = d.pools ? cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(d.stream)) : cudaMalloc(&p, bytes);
  REFIT_RETURN_IF_ERROR(from_cuda(e, what));
  ++d.allocations;
  return p;
}

void GpuWork::release(Device& d, void*& p) {
  if (!p) return;
  if (d.pools) {
    cudaFreeAsync(p, static_cast<cudaStream_t>(d.stream));
  } else {
    cudaFree(p);
  }
  p = nullptr;
}

Result<void*> GpuWork::stream(int device) {
  Result<Device*> d = get(device);
  if (!d.is_ok()) return d.status();
  return (*d)->stream;
}

Result<void*> GpuWork::scratch(int device, size_t bytes) {
  Result<Device*> got = get(device);
  if (!got.is_ok()) return got.status();
  Device& d = **got;
  if (bytes <= d.kept_bytes) return d.kept;
  if (bytes > kKeepScratchBytes) {
    release(d, d.once);
    Result<void*> p = allocate(d, bytes);
    if (p.is_ok()) d.once = *p;
    return p;
  }
  // Grown to the next power of two from 1 MiB (at most the bound), so a
  // run of slightly larger units grows it a few times only.
  size_t grow = std::max<size_t>(d.kept_bytes, 1u << 20);
  while (grow < bytes) grow *= 2;
  grow = std::min(grow, kKeepScratchBytes);
  // Stream-ordered: the old area goes once the work queued on it is done.
  release(d, d.kept);
  d.kept_bytes = 0;
  Result<void*> p = allocate(d, grow);
  if (!p.is_ok()) return p;
  d.kept = *p;
  d.kept_bytes = grow;
  return p;
}

void GpuWork::release_scratch(int device) {
  if (Device* d = find(device)) release(*d, d->once);
}

size_t GpuWork::allocations(int device) const {
  for (const Device& d : devices_) {
    if (d.device == device) return d.allocations;
  }
  return 0;
}

bool GpuWork::holds_once_area(int device) const {
  for (const Device& d : devices_) {
    if (d.device == device) return d.once != nullptr;
  }
  return false;
}

Status quantize_e4m3_blocks_cuda(const QuantizeArgs& a, void* stream) {
  REFIT_RETURN_IF_ERROR(check_quantize_args(a));
  const int64_t brows = (a.rows + a.block.rows - 1) / a.block.rows;
  const int64_t bcols = (a.cols + a.block.cols - 1) / a.block.cols;
  const int64_t nblocks = brows * bcols;
  if (nblocks == 0) return Status::ok();
  const std::string where = "quantize to F8_E4M3 on the GPU: tensor \"" + std::string(a.tensor) + "\"";
  Result<int> device = device_of(a.dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  const size_t scratch_bytes = quantize_scratch_bytes(nblocks);
  void* scratch = nullptr;
  REFIT_RETURN_IF_ERROR(
      from_cuda(cudaMalloc(&scratch, scratch_bytes), "cudaMalloc(" + std::to_string(scratch_bytes) + " bytes)")
          .with_context(where));
  const Status st = quantize_on(a, static_cast<cudaStream_t>(stream), scratch, bcols, where);
  const Status freed = from_cuda(cudaFree(scratch), "cudaFree(scratch)");
  REFIT_RETURN_IF_ERROR(st);
  return freed.with_context(where);
}

Status quantize_e4m3_blocks_cuda_from_host(const QuantizeArgs& a, GpuWork& work) {
  REFIT_RETURN_IF_ERROR(check_quantize_args(a));
  if (a.rows == 0 || a.cols == 0) return Status::ok();
  const std::string where = "quantize to F8_E4M3 on the GPU: tensor \"" + std::string(a.tensor) + "\"";
  Result<int> device = device_of(a.dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  const int64_t bcols = (a.cols + a.block.cols - 1) / a.block.cols;
  const int64_t nblocks = ((a.rows + a.block.rows - 1) / a.block.rows) * bcols;
  // One area: the source rows, then (256-byte aligned) the kernel's scratch.
  const size_t bytes = static_cast<size_t>(((a.rows - 1) * a.src_stride + a.cols) * dtype_bytes(a.src_dtype));
  const size_t at = (bytes + 255) & ~size_t{255};
  Result<void*> stream = work.stream(*device);
  if (!stream.is_ok()) return stream.status().with_context(where);
  const OnceScratch once(work, *device);
  Result<void*> area = work.scratch(*device, at + quantize_scratch_bytes(nblocks));
  if (!area.is_ok()) return area.status().with_context(where);
  auto s = static_cast<cudaStream_t>(*stream);
  const Status copied = from_cuda(cudaMemcpyAsync(*area, a.src, bytes, cudaMemcpyHostToDevice, s),
                                  "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes to the device)");
  if (!copied.is_ok()) {
    cudaStreamSynchronize(s);
    return copied.with_context(where);
  }
  QuantizeArgs d = a;
  d.src = *area;
  return quantize_on(d, s, static_cast<char*>(*area) + at, bcols, where);  // waits, the copy included
}

Status relayout_box_cuda_from_host(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                                   std::span<const int64_t> strides, std::string_view tensor, GpuWork& work) {
  const std::string where = "relayout on the GPU: tensor \"" + std::string(tensor) + "\"";
  const size_t n = sizes.size();
  if (n == 0 || n > 8 || strides.size() != n || (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8))
    return Status::invalid(where + ": 1 to 8 dims, one stride per dim and elements of 1, 2, 4 or 8 bytes expected");
  ::refit::convert::cuda::DeviceRelayout r;
  r.elem_bytes = elem_bytes;
  r.ndim = static_cast<int>(n);
  size_t bytes = static_cast<size_t>(elem_bytes);
  for (size_t d = 0; d < n; ++d) {
    r.size[d] = sizes[d];
    r.stride[d] = strides[d];
    bytes *= static_cast<size_t>(sizes[d]);
  }
  if (bytes == 0) return Status::ok();
  Result<int> device = device_of(dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  Result<void*> stream = work.stream(*device);
  if (!stream.is_ok()) return stream.status().with_context(where);
  const OnceScratch once(work, *device);
  Result<void*> staged = work.scratch(*device, bytes);
  if (!staged.is_ok()) return staged.status().with_context(where);
  auto s = static_cast<cudaStream_t>(*stream);
  Status st = from_cuda(cudaMemcpyAsync(*staged, src, bytes, cudaMemcpyHostToDevice, s),
                        "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes to the device)")
                  .with_context(where);
  r.src = *staged;
  r.dst = dst;
  if (st.is_ok()) {
    st = from_cuda(static_cast<cudaError_t>(::refit::convert::cuda::launch_relayout(r, *stream)),
                   "the relayout kernel's launch")
             .with_context(where);
  }
  // Waited for even after a failed launch: the copy into the scratch may
  // still be running, and the next call reuses the scratch.
  const Status waited = from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize").with_context(where);
  REFIT_RETURN_IF_ERROR(st);
  return waited;
}

Status cast_to_device(DType from, DType to, const void* src, void* dst, int64_t rows, int64_t cols,
                      int64_t dst_stride, std::string_view tensor, GpuWork& work) {
  const std::string where = "cast to " + std::string(dtype_name(to)) + " on the GPU: tensor \"" + std::string(tensor) + "\"";
  if (rows < 0 || cols < 0 || (rows > 1 && dst_stride < cols)) {
    return Status::invalid(where + ": " + std::to_string(rows) + " rows of " + std::to_string(cols) +
                           " elements do not fit rows " + std::to_string(dst_stride) + " elements apart");
  }
  if (rows == 0 || cols == 0) return Status::ok();
  Result<int> device = device_of(dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  Result<void*> stream = work.stream(*device);
  if (!stream.is_ok()) return stream.status().with_context(where);
  auto s = static_cast<cudaStream_t>(*stream);
  const size_t in = static_cast<size_t>(dtype_bytes(from)), out = static_cast<size_t>(dtype_bytes(to));
  const size_t row = static_cast<size_t>(cols) * out;
  const size_t pitch = static_cast<size_t>(dst_stride) * out;
  // In pieces of at most GpuWork::kCastPieceBytes (one row at least), cast
  // into the work's host buffer, then one copy of the piece's rows; waited
  // for before the buffer takes the next piece.
  const int64_t per_piece = static_cast<int64_t>(std::max<size_t>(1, GpuWork::kCastPieceBytes / row));
  for (int64_t r0 = 0; r0 < rows; r0 += per_piece) {
    const int64_t n = std::min(per_piece, rows - r0);
    std::vector<uint8_t>& host = work.host_buffer(static_cast<size_t>(n) * row);
    REFIT_RETURN_IF_ERROR(cast(from, to, static_cast<const uint8_t*>(src) + static_cast<size_t>(r0 * cols) * in,
                               host.data(), n * cols, tensor));
    uint8_t* at = static_cast<uint8_t*>(dst) + static_cast<size_t>(r0) * pitch;
    Status st = from_cuda(cudaMemcpy2DAsync(at, n > 1 ? pitch : row, host.data(), row, row, static_cast<size_t>(n),
                                            cudaMemcpyHostToDevice, s),
                          "cudaMemcpy2DAsync(" + std::to_string(n) + " rows of " + std::to_string(row) +
                              " bytes to the device)");
    const Status waited = from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    REFIT_RETURN_IF_ERROR(st.with_context(where));
    REFIT_RETURN_IF_ERROR(waited.with_context(where));
  }
  return Status::ok();
}

}  // namespace refit::convert
