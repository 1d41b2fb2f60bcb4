#pragma once
// CopyOps on a CUDA stream of its own (cudaMemcpy{,2D,3D}Async with
// cudaMemcpyDefault, so any mix of device and pinned host pointers), and the
// RAII owners of the memory the GPU path allocates. Compiled only when CUDA
// is found.
//
// Threads: a CudaCopyOps is used by one thread at a time (device_ops.h); the
// device is made current on that thread by each call.

#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "transport/cuda/device_ops.h"

namespace refit::cuda {

class CudaCopyOps final : public CopyOps {
 public:
  static Result<std::unique_ptr<CudaCopyOps>> create(int device);
  ~CudaCopyOps() override;  // waits for the stream: copies always finish
  CudaCopyOps(const CudaCopyOps&) = delete;
  CudaCopyOps& operator=(const CudaCopyOps&) = delete;

  Status copy(const Copy& copy) override;
  // Runs of at least kScatterMin small 1-D copies between device-accessible
  // memory go in one kernel launch (scatter_kernel.h) where nvcc built it.
  Status copy_all(std::span<const Copy> copies) override;
  Result<uint64_t> record() override;

  static constexpr size_t kScatterMin = 16;
  static constexpr uint64_t kScatterMaxBytes = 64 << 10;  // per piece
  static constexpr size_t kTablePieces = 4096;
  static constexpr size_t kTables = 8;
  uint64_t kernel_launches() const { return launches_; }
  Result<bool> done(uint64_t ticket) override;

  void* stream() const { return stream_; }  // a cudaStream_t: the NCCL fabric's upstream
  int device() const { return device_; }

 private:
  explicit CudaCopyOps(int device) : device_(device) {}
  int device_ = 0;
  void* stream_ = nullptr;                         // cudaStream_t
  std::deque<std::pair<uint64_t, void*>> pending_;  // (ticket, cudaEvent_t), in stream order
  std::vector<void*> spare_;                        // cudaEvent_t
  uint64_t next_ticket_ = 1;
  uint64_t completed_ = 0;
  // The scatter kernel's piece tables: kTables tables of kTablePieces in
  // pinned memory the kernel reads; a table is reused once the ticket
  // recorded after its launch is done.
  void* tables_ = nullptr;
  std::vector<uint64_t> table_ticket_;
  size_t next_table_ = 0;
  uint64_t launches_ = 0;
  Status scatter(std::span<const Copy> run);
};

// Page-locked host memory (cudaHostAlloc, portable): staging slots.
class PinnedBuffer {
 public:
  static Result<PinnedBuffer> allocate(uint64_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  PinnedBuffer(uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Device memory (cudaMalloc) on the current device.
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> allocate(int device, uint64_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  DeviceBuffer(uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Whether `p` is device (or managed) memory; host and unknown pointers are
// not, nor is anything where there is no driver or no device. With choose_landing() (staging.h) this picks direct GETs or staging.
Result<bool> is_device_pointer(const void* p);

// The device current on this thread (cudaGetDevice): the default for a
// receiver whose config names none.
Result<int> current_device();

// Synchronous copies for tests and tools (cudaMemcpy, cudaMemcpyDefault).
Status copy_now(void* dst, const void* src, uint64_t bytes);

}  // namespace refit::cuda
