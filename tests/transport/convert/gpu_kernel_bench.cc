// refit_gpu_kernel_bench: the device-side copy rates that the simulator
// charges (docs/simulator.md, "Hardware"), measured on the GPU at hand.
// Prints one JSON line per case:
//   - "d2d": cudaMemcpyAsync device to device of the whole buffer, the
//     reference for a copy kernel;
//   - "scatter": transport/cuda's scatter kernel (the packed fan-out's
//     gather and scatter, the landing ring's irregular runs) over the same
//     bytes cut into pieces of one size, 16-byte aligned, or with source and
//     destination at different offsets mod 16 (its byte path);
//   - "quantize": quantize_e4m3_blocks_cuda (BF16 to F8_E4M3, 128 x 128
//     blocks) on device buffers, the whole call as a receiver pays it
//     (its scratch allocation and wait included).
// Rates are bytes copied (or source bytes read) per second; a copy reads
// and writes each byte, so its memory traffic is twice that. Each figure is
// the median of REPS timed runs after one warm-up; every result is checked
// once against the host.
//
//   refit_gpu_kernel_bench [MIB [REPS]]     (defaults: 1024 MiB, 10)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "transport/convert/convert.h"
#include "transport/convert/convert_cuda.h"
#include "transport/convert/element.h"
#include "transport/cuda/scatter_kernel.h"

namespace {

[[noreturn]] void die(const std::string& what) {
  std::cerr << "refit_gpu_kernel_bench: " << what << "\n";
  std::exit(1);
}
void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(e));
}

template <typename F>
double median_seconds(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void print(const std::string& kind, const std::string& extra, uint64_t bytes, double s) {
  std::cout << "{\"case\": \"" << kind << "\"" << extra << ", \"bytes\": " << bytes << ", \"seconds\": " << s
            << ", \"GBps\": " << bytes / s / 1e9 << "}" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace refit;
  const uint64_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024) << 20;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 10;
  if (bytes == 0 || reps < 1) die("usage: refit_gpu_kernel_bench [MIB [REPS]] (both positive)");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) die("no usable GPU");
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::cout << "{\"device\": \"" << prop.name << "\", \"multiprocessors\": " << prop.multiProcessorCount << "}"
            << std::endl;

  std::vector<uint8_t> host(bytes);
  std::mt19937_64 rng(7);
  for (uint64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(host.data() + i, &v, 8);
  }
  uint8_t *src = nullptr, *dst = nullptr;
  ok(cudaMalloc(reinterpret_cast<void**>(&src), bytes + 64), "cudaMalloc(src)");
  ok(cudaMalloc(reinterpret_cast<void**>(&dst), bytes + 64), "cudaMalloc(dst)");
  ok(cudaMemcpy(src, host.data(), bytes, cudaMemcpyHostToDevice), "copy in");
  cudaStream_t stream = nullptr;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<uint8_t> back(bytes);

  const double d2d = median_seconds(reps, [&] {
    ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "d2d");
    ok(cudaStreamSynchronize(stream), "sync");
  });
  print("d2d", "", bytes, d2d);

  // Pieces of one size, laid end to end (aligned: both offsets multiples of
  // 16; unaligned: the destination 3 bytes further on, so the pair never
  // shares an alignment and the kernel moves bytes).
  for (uint64_t piece : {uint64_t{512}, uint64_t{4096}, uint64_t{65536}, uint64_t{1} << 20, uint64_t{16} << 20}) {
    for (bool aligned : {true, false}) {
      const uint64_t n = bytes / piece;
      if (n == 0) continue;
      cuda::ScatterPiece* table = nullptr;
      ok(cudaMallocHost(reinterpret_cast<void**>(&table), n * sizeof(cuda::ScatterPiece)), "cudaMallocHost(table)");
      for (uint64_t i = 0; i < n; ++i) {
        table[i] = cuda::ScatterPiece{dst + (aligned ? 0 : 3) + i * piece, src + i * piece, piece};
      }
      ok(cudaMemset(dst, 0, bytes + 64), "memset");
      const double s = median_seconds(reps, [&] {
        ok(static_cast<cudaError_t>(cuda::launch_scatter(table, static_cast<uint32_t>(n), piece, stream)), "scatter");
        ok(cudaStreamSynchronize(stream), "sync");
      });
      ok(cudaMemcpy(back.data(), dst + (aligned ? 0 : 3), n * piece, cudaMemcpyDeviceToHost), "copy out");
      if (std::memcmp(back.data(), host.data(), n * piece) != 0) die("scatter: bytes differ");
      print("scatter", ", \"piece_bytes\": " + std::to_string(piece) + ", \"aligned\": " + (aligned ? "true" : "false"),
            n * piece, s);
      cudaFreeHost(table);
    }
  }

  // BF16 to F8_E4M3 in 128 x 128 blocks: a Kimi-K2 expert (7168 x 2048) and
  // a square matrix of about the buffer's size; checked against the CPU
  // kernel byte for byte.
  const int64_t side = std::max<int64_t>(128, static_cast<int64_t>(std::sqrt(static_cast<double>(bytes / 2))) / 128 * 128);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{7168, 2048}, std::pair<int64_t, int64_t>{side, side}}) {
    const int64_t n = rows * cols;
    if (static_cast<uint64_t>(n) * 2 > bytes) continue;
    std::normal_distribution<float> nd(0.0f, 0.02f);
    std::vector<uint16_t> b(n);
    for (int64_t i = 0; i < n; ++i) b[i] = convert::bf16_from_f32(nd(rng));
    ok(cudaMemcpy(src, b.data(), n * 2, cudaMemcpyHostToDevice), "copy in");
    const int64_t scale_cols = (cols + 127) / 128, nscales = ((rows + 127) / 128) * scale_cols;
    float* scales = nullptr;
    ok(cudaMalloc(reinterpret_cast<void**>(&scales), nscales * 4), "cudaMalloc(scales)");
    convert::QuantizeArgs a;
    a.src_dtype = DType::kBF16;
    a.src = src;
    a.src_stride = cols;
    a.rows = rows;
    a.cols = cols;
    a.dst = dst;
    a.dst_stride = cols;
    a.scales = scales;
    a.scale_stride = scale_cols;
    a.tensor = "bench";
    const double s = median_seconds(reps, [&] {
      const Status st = convert::quantize_e4m3_blocks_cuda(a, stream);
      if (!st.is_ok()) die(st.message());
    });
    std::vector<uint8_t> q(n), want(n);
    std::vector<float> sc(nscales), want_sc(nscales);
    ok(cudaMemcpy(q.data(), dst, n, cudaMemcpyDeviceToHost), "copy out");
    ok(cudaMemcpy(sc.data(), scales, nscales * 4, cudaMemcpyDeviceToHost), "copy out");
    convert::QuantizeArgs h = a;
    h.src = b.data();
    h.dst = want.data();
    h.scales = want_sc.data();
    if (!convert::quantize_e4m3_blocks(h).is_ok()) die("CPU kernel refused the bench's data");
    if (q != want || std::memcmp(sc.data(), want_sc.data(), nscales * 4) != 0) die("quantize: differs from the CPU kernel");
    print("quantize", ", \"rows\": " + std::to_string(rows) + ", \"cols\": " + std::to_string(cols), n * 2, s);
    cudaFree(scales);
  }
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(dst);
  return 0;
}
