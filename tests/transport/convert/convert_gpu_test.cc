// The CUDA block quantizer against the CPU kernel: the same E4M3 bytes and
// F32 scales, bit for bit, on random BF16 and F32 boxes with zeros,
// subnormals, huge values and partial edge blocks; and the same refusal of
// NaN with nothing written. Suite 'gpu' (scripts/gpu-check); skips with the
// reason on a machine without a usable GPU.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "transport/convert/convert.h"
#include "transport/convert/convert_cuda.h"
#include "transport/convert/element.h"
#include "transport/convert/relayout.h"
#include "transport/cuda/cuda_status.h"

namespace refit::convert {
namespace {

class ConvertGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const Status probe = cuda::probe_device();
    if (!probe.is_ok()) GTEST_SKIP() << "no usable GPU: " << probe.message();
  }
};

// Random bits of `esize` bytes per element, with blocks of every kind:
// normal values at a random magnitude, zeros and -0, subnormals, values at
// the type's top.
std::vector<uint8_t> random_box(DType t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-130, 120), kind(0, 5);
  std::vector<uint8_t> out(rows * cols * dtype_bytes(t));
  for (int64_t i = 0; i < rows * cols; ++i) {
    float x = 0.0f;
    switch (kind(rng)) {
      case 0: x = 0.0f; break;
      case 1: x = -0.0f; break;
      case 2: x = std::ldexp(nd(rng), -133); break;  // BF16/F32 subnormal
      case 3: x = std::ldexp(nd(rng), 120); break;    // past any E4M3 range
      default: x = std::ldexp(nd(rng), ex(rng)); break;
    }
    if (t == DType::kBF16) {
      const uint16_t b = bf16_from_f32(x);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &x, 4);
    }
  }
  return out;
}

struct Out {
  std::vector<uint8_t> values;
  std::vector<float> scales;
};

QuantizeArgs box_args(DType t, const void* src, int64_t rows, int64_t cols, BlockSize block, uint8_t* dst,
                      float* scales) {
  QuantizeArgs a;
  a.src_dtype = t;
  a.src = src;
  a.src_stride = cols;
  a.rows = rows;
  a.cols = cols;
  a.dst = dst;
  a.dst_stride = cols;
  a.scales = scales;
  a.scale_stride = (cols + block.cols - 1) / block.cols;
  a.block = block;
  a.tensor = "w";
  return a;
}

Status run_gpu(DType t, const std::vector<uint8_t>& src, int64_t rows, int64_t cols, BlockSize block, Out& out) {
  const size_t nscales = ((rows + block.rows - 1) / block.rows) * ((cols + block.cols - 1) / block.cols);
  out.values.assign(rows * cols, 0xAB);
  out.scales.assign(nscales, -1.0f);
  void *dsrc = nullptr, *ddst = nullptr, *dscales = nullptr;
  EXPECT_EQ(cudaMalloc(&dsrc, src.size()), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&ddst, out.values.size()), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dscales, nscales * 4), cudaSuccess);
  cudaMemcpy(dsrc, src.data(), src.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(ddst, out.values.data(), out.values.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dscales, out.scales.data(), nscales * 4, cudaMemcpyHostToDevice);
  const Status s = quantize_e4m3_blocks_cuda(
      box_args(t, dsrc, rows, cols, block, static_cast<uint8_t*>(ddst), static_cast<float*>(dscales)), nullptr);
  cudaMemcpy(out.values.data(), ddst, out.values.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(out.scales.data(), dscales, nscales * 4, cudaMemcpyDeviceToHost);
  cudaFree(dsrc);
  cudaFree(ddst);
  cudaFree(dscales);
  return s;
}

TEST_F(ConvertGpu, SameBytesAsTheCpuKernel) {
  struct Case {
    DType t;
    int64_t rows, cols;
    BlockSize block;
  };
  int64_t blocks = 0, differing = 0;
  for (const Case& c : {Case{DType::kBF16, 1024, 2048, {128, 128}}, Case{DType::kBF16, 576, 7168, {128, 128}},
                        Case{DType::kF32, 700, 300, {128, 128}}, Case{DType::kBF16, 4096, 4096, {1, 16}},
                        Case{DType::kF32, 333, 517, {8, 32}}}) {
    const std::vector<uint8_t> src = random_box(c.t, c.rows, c.cols, static_cast<uint32_t>(c.rows * 31 + c.cols));
    Out cpu, gpu;
    cpu.values.assign(c.rows * c.cols, 0);
    cpu.scales.assign(((c.rows + c.block.rows - 1) / c.block.rows) * ((c.cols + c.block.cols - 1) / c.block.cols), 0);
    ASSERT_TRUE(quantize_e4m3_blocks(box_args(c.t, src.data(), c.rows, c.cols, c.block, cpu.values.data(),
                                              cpu.scales.data()))
                    .is_ok());
    const Status s = run_gpu(c.t, src, c.rows, c.cols, c.block, gpu);
    ASSERT_TRUE(s.is_ok()) << s.message();
    for (size_t i = 0; i < cpu.values.size(); ++i) differing += cpu.values[i] != gpu.values[i];
    differing += std::memcmp(cpu.scales.data(), gpu.scales.data(), cpu.scales.size() * 4) != 0;
    blocks += static_cast<int64_t>(cpu.scales.size());
    EXPECT_EQ(cpu.values, gpu.values) << c.rows << "x" << c.cols;
    EXPECT_EQ(std::memcmp(cpu.scales.data(), gpu.scales.data(), cpu.scales.size() * 4), 0) << c.rows << "x" << c.cols;
  }
  std::cout << "GPU against CPU: " << blocks << " blocks, " << differing << " bytes differ\n";
}

TEST_F(ConvertGpu, NaNRefusedNothingWritten) {
  std::vector<uint8_t> src = random_box(DType::kBF16, 256, 384, 5);
  const uint16_t nan = 0x7FC0;
  std::memcpy(src.data() + 2 * (200 * 384 + 300), &nan, 2);  // block (1, 2)
  Out gpu;
  const Status s = run_gpu(DType::kBF16, src, 256, 384, {128, 128}, gpu);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("block (1, 2)"), std::string::npos) << s.message();
  for (uint8_t v : gpu.values) ASSERT_EQ(v, 0xAB);
  for (float f : gpu.scales) ASSERT_EQ(f, -1.0f);
}

// Every call runs on the GPU that holds its destination, so a destination in
// host memory is refused before any CUDA call, naming the tensor (no GPU
// needed: the pointer probe answers "host" everywhere).
TEST(ConvertCuda, AHostDestinationIsRefusedNamingTheTensor) {
  std::vector<uint16_t> src(128 * 128, 0x3F80);  // BF16 1.0
  std::vector<uint8_t> dst(128 * 128);
  std::vector<float> scales(1);
  QuantizeArgs a;
  a.src = src.data();
  a.src_stride = 128;
  a.rows = a.cols = 128;
  a.dst = dst.data();
  a.dst_stride = 128;
  a.scales = scales.data();
  a.scale_stride = 1;
  a.tensor = "layers.0.w";
  GpuWork work;
  for (const Status& s : {quantize_e4m3_blocks_cuda(a, nullptr), quantize_e4m3_blocks_cuda_from_host(a, work)}) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("\"layers.0.w\": the destination is not GPU memory"), std::string::npos) << s.message();
  }
  const int64_t sizes[] = {128, 128}, strides[] = {1, 128};
  const Status r = relayout_box_cuda_from_host(dst.data(), dst.data(), 1, sizes, strides, "layers.1.w", work);
  EXPECT_NE(r.message().find("\"layers.1.w\": the destination is not GPU memory"), std::string::npos) << r.message();
  const Status c = cast_to_device(DType::kF32, DType::kBF16, scales.data(), dst.data(), 1, 1, 1, "layers.2.b", work);
  EXPECT_NE(c.message().find("\"layers.2.b\": the destination is not GPU memory"), std::string::npos) << c.message();
  // Rows that overlap their destination's stride are refused by name.
  const Status o = cast_to_device(DType::kF32, DType::kBF16, scales.data(), dst.data(), 2, 8, 4, "layers.3.b", work);
  EXPECT_EQ(o.code(), Code::kInvalidArgument);
  EXPECT_NE(o.message().find("\"layers.3.b\": 2 rows of 8 elements do not fit rows 4 elements apart"), std::string::npos)
      << o.message();
  // Refused before any CUDA call: no stream, no scratch.
  EXPECT_EQ(work.devices(), 0u);
}

// The CUDA relayout (docs/refresh.md, "Column-major receivers") against
// the host's relayout_box: column-major, a 3-dim permutation, padding, every
// element size.
TEST_F(ConvertGpu, RelayoutWritesWhatTheHostRelayoutWrites) {
  std::mt19937_64 g(0x7e1a'0001);
  struct Case {
    std::vector<int64_t> sizes, strides;
  };
  const std::vector<Case> cases = {{{300, 257}, {1, 300}},           // column-major
                                   {{5, 40, 33}, {1, 5 * 33, 5}},    // a permutation
                                   {{64, 96}, {1, 70}},              // padded columns
                                   {{1000}, {3}}};                   // one strided dim
  GpuWork work;
  for (const Case& c : cases) {
    for (int eb : {1, 2, 4, 8}) {
      int64_t numel = 1, extent = 1;
      for (size_t d = 0; d < c.sizes.size(); ++d) {
        numel *= c.sizes[d];
        extent += (c.sizes[d] - 1) * c.strides[d];
      }
      std::vector<uint8_t> src(numel * eb), want(extent * eb, 0xee), got(extent * eb, 0);
      for (uint8_t& b : src) b = static_cast<uint8_t>(g());
      ASSERT_TRUE(relayout_box(src.data(), want.data(), eb, c.sizes, c.strides).is_ok());
      void* ddst = nullptr;
      ASSERT_EQ(cudaMalloc(&ddst, got.size()), cudaSuccess);
      ASSERT_EQ(cudaMemset(ddst, 0xee, got.size()), cudaSuccess);
      const Status st = relayout_box_cuda_from_host(src.data(), static_cast<uint8_t*>(ddst), eb, c.sizes, c.strides,
                                                    "w", work);
      EXPECT_TRUE(st.is_ok()) << st.message();
      EXPECT_EQ(cudaMemcpy(got.data(), ddst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaFree(ddst), cudaSuccess);
      EXPECT_EQ(got, want) << c.sizes.size() << " dims, " << eb << "-byte elements";
    }
  }
}

// What the receivers' conversions reuse (GpuWork): one non-blocking stream
// per device, a scratch kept across calls while it is within the bound, and
// an area of its own, freed on return, for a call that needs more. The
// quantizer from host memory writes what the CPU kernel writes through it.
TEST_F(ConvertGpu, GpuWorkKeepsItsStreamAndScratchWithinTheBound) {
  int device = -1;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  GpuWork work;
  const int64_t rows = 300, cols = 700;
  const BlockSize block{128, 128};
  const std::vector<uint8_t> src = random_box(DType::kBF16, rows, cols, 77);
  const size_t nscales = 3 * 6;
  Out cpu;
  cpu.values.assign(rows * cols, 0);
  cpu.scales.assign(nscales, 0);
  ASSERT_TRUE(quantize_e4m3_blocks(box_args(DType::kBF16, src.data(), rows, cols, block, cpu.values.data(),
                                            cpu.scales.data()))
                  .is_ok());
  void *ddst = nullptr, *dscales = nullptr;
  ASSERT_EQ(cudaMalloc(&ddst, rows * cols), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dscales, nscales * 4), cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(cudaMemset(ddst, 0, rows * cols), cudaSuccess);
    const Status st = quantize_e4m3_blocks_cuda_from_host(
        box_args(DType::kBF16, src.data(), rows, cols, block, static_cast<uint8_t*>(ddst), static_cast<float*>(dscales)),
        work);
    ASSERT_TRUE(st.is_ok()) << st.message();
    Out gpu;
    gpu.values.resize(rows * cols);
    gpu.scales.resize(nscales);
    ASSERT_EQ(cudaMemcpy(gpu.values.data(), ddst, gpu.values.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gpu.scales.data(), dscales, nscales * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(gpu.values, cpu.values) << "round " << round;
    EXPECT_EQ(std::memcmp(gpu.scales.data(), cpu.scales.data(), nscales * 4), 0) << "round " << round;
    EXPECT_EQ(work.devices(), 1u);
    EXPECT_EQ(work.kept_scratch_bytes(device), size_t{1} << 20);  // 420,000 bytes, rounded up to 1 MiB
    EXPECT_EQ(work.allocations(device), 1u) << "round " << round << ": the kept scratch was allocated again";
  }
  // Its stream is its own and does not synchronize with blocking streams.
  Result<void*> stream = work.stream(device);
  ASSERT_TRUE(stream.is_ok()) << stream.status().message();
  unsigned int flags = 0;
  ASSERT_EQ(cudaStreamGetFlags(static_cast<cudaStream_t>(*stream), &flags), cudaSuccess);
  EXPECT_EQ(flags, static_cast<unsigned int>(cudaStreamNonBlocking));
  // A relayout of a box over the bound gets an area of its own, and the
  // kept scratch stays as it was.
  const int64_t big_rows = 4, big_cols = static_cast<int64_t>(GpuWork::kKeepScratchBytes / 4) / big_rows + 1;
  std::vector<uint8_t> box(static_cast<size_t>(big_rows * big_cols) * 4);
  for (size_t i = 0; i < box.size(); ++i) box[i] = static_cast<uint8_t>(i * 131 + 7);
  void* dbig = nullptr;
  ASSERT_EQ(cudaMalloc(&dbig, box.size()), cudaSuccess);
  const int64_t sizes[] = {big_rows, big_cols}, strides[] = {1, big_rows};  // column-major
  const Status r = relayout_box_cuda_from_host(box.data(), static_cast<uint8_t*>(dbig), 4, sizes, strides, "big", work);
  ASSERT_TRUE(r.is_ok()) << r.message();
  std::vector<uint8_t> want(box.size()), got(box.size());
  ASSERT_TRUE(relayout_box(box.data(), want.data(), 4, sizes, strides).is_ok());
  ASSERT_EQ(cudaMemcpy(got.data(), dbig, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want);
  EXPECT_EQ(work.kept_scratch_bytes(device), size_t{1} << 20);
  EXPECT_EQ(work.allocations(device), 2u);  // the kept scratch, then the relayout's own area
  EXPECT_FALSE(work.holds_once_area(device)) << "the relayout's own area outlived its call";
  // A box between the kept size and the bound grows the kept scratch.
  std::vector<uint8_t> mid(3u << 20, 0x5A);
  void* dmid = nullptr;
  ASSERT_EQ(cudaMalloc(&dmid, mid.size()), cudaSuccess);
  const int64_t mid_sizes[] = {static_cast<int64_t>(mid.size())}, mid_strides[] = {1};
  const Status m = relayout_box_cuda_from_host(mid.data(), static_cast<uint8_t*>(dmid), 1, mid_sizes, mid_strides, "mid",
                                               work);
  ASSERT_TRUE(m.is_ok()) << m.message();
  std::vector<uint8_t> mid_back(mid.size());
  ASSERT_EQ(cudaMemcpy(mid_back.data(), dmid, mid.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(mid_back, mid);
  EXPECT_EQ(work.kept_scratch_bytes(device), size_t{4} << 20);
  EXPECT_EQ(work.allocations(device), 3u);
  cudaFree(dmid);
  cudaFree(dbig);
  cudaFree(ddst);
  cudaFree(dscales);
}

// A cast into GPU memory is a cast on the host and one copy of the rows,
// into rows `dst_stride` elements apart (the bytes between them are not
// touched), in pieces of at most GpuWork::kCastPieceBytes: a few short rows,
// and rows of 2 MiB, four to a piece, in three pieces.
TEST_F(ConvertGpu, CastToDeviceWritesStridedRows) {
  struct Case {
    int64_t rows, cols, stride;
  };
  for (const Case& k : {Case{5, 300, 320}, Case{9, int64_t{1} << 20, (int64_t{1} << 20) + 64}}) {
    GpuWork work;
    std::vector<float> src(k.rows * k.cols);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i % 100003) * 0.25f - 100.0f;
    std::vector<uint16_t> want(k.rows * k.stride, 0xEEEE);
    for (int64_t r = 0; r < k.rows; ++r) {
      ASSERT_TRUE(cast(DType::kF32, DType::kBF16, src.data() + r * k.cols, want.data() + r * k.stride, k.cols, "b").is_ok());
    }
    void* ddst = nullptr;
    ASSERT_EQ(cudaMalloc(&ddst, want.size() * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(ddst, 0xEE, want.size() * 2), cudaSuccess);
    const Status st = cast_to_device(DType::kF32, DType::kBF16, src.data(), ddst, k.rows, k.cols, k.stride, "b", work);
    ASSERT_TRUE(st.is_ok()) << st.message();
    std::vector<uint16_t> got(want.size());
    ASSERT_EQ(cudaMemcpy(got.data(), ddst, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, want) << k.rows << " rows of " << k.cols;
    cudaFree(ddst);
  }
}

}  // namespace
}  // namespace refit::convert
