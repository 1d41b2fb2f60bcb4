#pragma once
// Block quantization on device buffers: quantize_e4m3_blocks (convert.h)
// with every pointer of QuantizeArgs in device memory, same bits, same
// refusals (NaN or infinity in a block: nothing written). Built when CUDA,
// NCCL and nvcc are found (REFIT_HAVE_CONVERT_KERNEL).
//
// Each call runs on the GPU that holds its destination: that device is made
// current for the call (its scratch, copies and kernels go there) and the
// calling thread's device is restored before it returns. A destination that
// is not GPU memory is refused. A stream passed in must belong to that
// device; a GpuWork keeps one per device.

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "planner/status.h"
#include "transport/convert/convert.h"

namespace refit::convert {

// What the conversions into GPU memory reuse from one call to the next,
// per device:
// - a stream of refit's own, created non-blocking: its copies and kernels
//   neither wait for nor hold up the work the server queues on that GPU (the
//   legacy default stream waits for every blocking stream and they for it);
// - a device scratch area (the staged box copied over, the kernel's
//   per-block maxima), kept while it is at most kKeepScratchBytes. A call
//   that needs more gets an area of its own, freed when it returns.
//   Allocated and freed in stream order (cudaMallocAsync, cudaFreeAsync)
//   where the device has memory pools, so that neither waits for the rest
//   of the device; cudaMalloc and cudaFree (which waits for the whole
//   device, the server's kernels included) where it has none;
// - a host buffer for casts, at most kCastPieceBytes (or one row).
// Released by the destructor. Not thread-safe: used by one thread at a
// time (a receiver's fan-out threads, one attempt after another).
class GpuWork {
 public:
  static constexpr size_t kKeepScratchBytes = 64u << 20;
  static constexpr size_t kCastPieceBytes = 8u << 20;

  GpuWork() = default;
  ~GpuWork();
  GpuWork(const GpuWork&) = delete;
  GpuWork& operator=(const GpuWork&) = delete;

  // For the tests: the devices it holds a stream for; on `device`, the
  // scratch bytes it keeps (0: none), the areas it has allocated so far,
  // and whether it holds an area made for one call.
  size_t devices() const { return devices_.size(); }
  size_t kept_scratch_bytes(int device) const;
  size_t allocations(int device) const;
  bool holds_once_area(int device) const;

  // REQUIRES `device` is current on the calling thread. Its stream (made on
  // first use).
  Result<void*> stream(int device);
  // REQUIRES `device` is current. At least `bytes` of device memory, for
  // work on the device's stream, until the next call for that device or
  // release_scratch: the kept area, grown when it is too small and the size
  // is within kKeepScratchBytes; otherwise an area of its own, which
  // release_scratch frees.
  Result<void*> scratch(int device, size_t bytes);
  // Frees an area scratch() made for one call (the kept one stays).
  void release_scratch(int device);
  // At least `bytes` of host memory, until the next call.
  std::vector<uint8_t>& host_buffer(size_t bytes) {
    if (host_.size() < bytes) host_.resize(bytes);
    return host_;
  }

 private:
  struct Device {
    int device = -1;
    void* stream = nullptr;
    bool pools = false;  // cudaDevAttrMemoryPoolsSupported
    void* kept = nullptr;
    size_t kept_bytes = 0;
    void* once = nullptr;  // an area over kKeepScratchBytes, for one call
    size_t allocations = 0;
  };
  Device* find(int device);
  Result<Device*> get(int device);
  Result<void*> allocate(Device& d, size_t bytes);
  void release(Device& d, void*& p);
  std::vector<Device> devices_;
  std::vector<uint8_t> host_;
};

// Enqueues the kernels on `stream` (a cudaStream_t; null: the legacy
// default stream) and waits for them. Uses a scratch allocation of 8 bytes
// plus 4 per block, freed before it returns.
Status quantize_e4m3_blocks_cuda(const QuantizeArgs& args, void* stream);

// quantize_e4m3_blocks_cuda with `args.src` in host memory (a receiver's
// conversion staging area, docs/conversion.md) and `dst` and `scales` on the
// device: the source rows (rows x src_stride elements) are copied to the
// work's scratch first; the copy and the kernels go on the work's stream,
// and it waits for them.
Status quantize_e4m3_blocks_cuda_from_host(const QuantizeArgs& args, GpuWork& work);

// relayout_box (relayout.h) of a box staged in host memory into device
// memory at `dst`: the box is copied to the work's scratch, then the CUDA
// relayout kernel writes it into `strides`, on the work's stream; waits.
Status relayout_box_cuda_from_host(const uint8_t* src, uint8_t* dst, int elem_bytes, std::span<const int64_t> sizes,
                                   std::span<const int64_t> strides, std::string_view tensor, GpuWork& work);

// cast() of `rows` x `cols` host elements at `src` (rows one after
// another) into device memory at `dst`, whose rows start `dst_stride`
// elements apart: cast on the host, then one copy of the rows on the work's
// stream, in pieces of at most GpuWork::kCastPieceBytes; waits.
Status cast_to_device(DType from, DType to, const void* src, void* dst, int64_t rows, int64_t cols,
                      int64_t dst_stride, std::string_view tensor, GpuWork& work);

}  // namespace refit::convert
