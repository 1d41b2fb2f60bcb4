#include "transport/convert/convert_cuda.h"

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "transport/convert/convert_kernel.h"
#include "transport/convert/relayout_kernel.h"
#include "transport/cuda/cuda_status.h"
#include "transport/cuda/device_guard.h"
#include "transport/cuda/pointer_probe.h"

namespace refit::convert {
namespace {

// The GPU that holds `dst`: the calls below run there, whatever device the
// calling thread has current (a receiver's fan-out thread never set one;
// on a second GPU the scratch and the kernel would land on the first), and
// the thread's device is restored when they return.
Result<int> device_of(const void* dst, const std::string& where) {
  const ::refit::cuda::PointerKind kind = ::refit::cuda::probe_pointer(dst);
  if (!kind.device) return Status::invalid(where + ": the destination is not GPU memory");
  return kind.ordinal;
}

}  // namespace

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
  auto s = static_cast<cudaStream_t>(stream);

  const size_t scratch_bytes = 8 + 4 * static_cast<size_t>(nblocks);
  void* scratch = nullptr;
  REFIT_RETURN_IF_ERROR(::refit::cuda::from_cuda(cudaMalloc(&scratch, scratch_bytes),
                                        "cudaMalloc(" + std::to_string(scratch_bytes) + " bytes)")
                            .with_context(where));
  auto* bad = static_cast<unsigned long long*>(scratch);
  Status st = ::refit::cuda::from_cuda(cudaMemsetAsync(bad, 0xFF, 8, s), "cudaMemsetAsync(8 bytes)");
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
    st = ::refit::cuda::from_cuda(static_cast<cudaError_t>(convert::cuda::launch_quantize_e4m3(q, s)),
                         "launch of the quantize kernels (" + std::to_string(nblocks) + " blocks)");
  }
  unsigned long long bad_host = ~0ull;
  if (st.is_ok()) st = ::refit::cuda::from_cuda(cudaMemcpyAsync(&bad_host, bad, 8, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync(8 bytes to host)");
  if (st.is_ok()) st = ::refit::cuda::from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  const Status freed = ::refit::cuda::from_cuda(cudaFree(scratch), "cudaFree(scratch)");
  REFIT_RETURN_IF_ERROR(st.with_context(where));
  REFIT_RETURN_IF_ERROR(freed.with_context(where));
  if (bad_host != ~0ull) {
    const int64_t b = static_cast<int64_t>(bad_host);
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\" block (" +
                           std::to_string(a.block_row0 + b / bcols) + ", " + std::to_string(a.block_col0 + b % bcols) +
                           ") holds NaN or an infinity; refusing to quantize it (nothing written)");
  }
  return Status::ok();
}

Status quantize_e4m3_blocks_cuda_from_host(const QuantizeArgs& a, void* stream) {
  REFIT_RETURN_IF_ERROR(check_quantize_args(a));
  if (a.rows == 0 || a.cols == 0) return Status::ok();
  const std::string where = "quantize to F8_E4M3 on the GPU: tensor \"" + std::string(a.tensor) + "\"";
  Result<int> device = device_of(a.dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  const size_t bytes = static_cast<size_t>(((a.rows - 1) * a.src_stride + a.cols) * dtype_bytes(a.src_dtype));
  void* src = nullptr;
  REFIT_RETURN_IF_ERROR(::refit::cuda::from_cuda(cudaMalloc(&src, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)")
                            .with_context(where));
  auto s = static_cast<cudaStream_t>(stream);
  Status st = ::refit::cuda::from_cuda(cudaMemcpyAsync(src, a.src, bytes, cudaMemcpyHostToDevice, s),
                                       "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes to the device)")
                  .with_context(where);
  if (st.is_ok()) {
    QuantizeArgs d = a;
    d.src = src;
    st = quantize_e4m3_blocks_cuda(d, stream);  // waits for the stream, the copy included
  }
  const Status freed = ::refit::cuda::from_cuda(cudaFree(src), "cudaFree(source rows)");
  REFIT_RETURN_IF_ERROR(st);
  return freed.with_context(where);
}

Status relayout_box_cuda_from_host(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                                   std::span<const int64_t> strides, std::string_view tensor, void* stream) {
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
  void* staged = nullptr;
  REFIT_RETURN_IF_ERROR(::refit::cuda::from_cuda(cudaMalloc(&staged, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)")
                            .with_context(where));
  auto s = static_cast<cudaStream_t>(stream);
  Status st = ::refit::cuda::from_cuda(cudaMemcpyAsync(staged, src, bytes, cudaMemcpyHostToDevice, s),
                                       "cudaMemcpyAsync(" + std::to_string(bytes) + " bytes to the device)")
                  .with_context(where);
  if (st.is_ok()) {
    r.src = staged;
    r.dst = dst;
    st = ::refit::cuda::from_cuda(static_cast<cudaError_t>(::refit::convert::cuda::launch_relayout(r, stream)),
                                  "the relayout kernel's launch")
             .with_context(where);
  }
  if (st.is_ok()) st = ::refit::cuda::from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize").with_context(where);
  const Status freed = ::refit::cuda::from_cuda(cudaFree(staged), "cudaFree(staged box)");
  REFIT_RETURN_IF_ERROR(st);
  return freed.with_context(where);
}

Status cast_to_device(DType from, DType to, const void* src, void* dst, int64_t n, std::string_view tensor,
                      void* stream) {
  std::vector<uint8_t> host(static_cast<size_t>(n * dtype_bytes(to)));
  REFIT_RETURN_IF_ERROR(cast(from, to, src, host.data(), n, tensor));
  auto s = static_cast<cudaStream_t>(stream);
  const std::string where = "cast to " + std::string(dtype_name(to)) + " on the GPU: tensor \"" + std::string(tensor) + "\"";
  Result<int> device = device_of(dst, where);
  if (!device.is_ok()) return device.status();
  const ::refit::cuda::DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(guard.status().with_context(where));
  REFIT_RETURN_IF_ERROR(::refit::cuda::from_cuda(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, s),
                                                 "cudaMemcpyAsync(" + std::to_string(host.size()) + " bytes to the device)")
                            .with_context(where));
  return ::refit::cuda::from_cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize").with_context(where);
}

}  // namespace refit::convert
