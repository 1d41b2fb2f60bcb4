// refit_convert_bench: the CPU conversion kernels' speed, one thread, on a
// Kimi-K2 expert's shape (7168 x 2048, 128 x 128 blocks) and on casts of
// the same element count. Prints one JSON line per kernel: GB/s of source
// bytes read, best of the repetitions.
//
//   refit_convert_bench [ROWS COLS [REPS]]

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "transport/convert/convert.h"
#include "transport/convert/element.h"

namespace {

template <typename F>
double best_seconds(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void print(const std::string& kernel, int64_t rows, int64_t cols, int64_t src_bytes, double s) {
  std::cout << "{\"kernel\": \"" << kernel << "\", \"rows\": " << rows << ", \"cols\": " << cols
            << ", \"source_bytes\": " << src_bytes << ", \"seconds\": " << s
            << ", \"source_GBps\": " << src_bytes / s / 1e9 << "}" << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace refit;
  const int64_t rows = argc > 2 ? std::atoll(argv[1]) : 7168;
  const int64_t cols = argc > 2 ? std::atoll(argv[2]) : 2048;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const int64_t n = rows * cols;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> f(n);
  std::vector<uint16_t> b(n);
  for (int64_t i = 0; i < n; ++i) {
    f[i] = nd(rng);
    b[i] = convert::bf16_from_f32(f[i]);
  }
  std::vector<uint8_t> q(n);
  std::vector<float> scales(((rows + 127) / 128) * ((cols + 127) / 128));
  std::vector<uint16_t> h(n);

  for (DType t : {DType::kBF16, DType::kF32}) {
    convert::QuantizeArgs a;
    a.src_dtype = t;
    a.src = t == DType::kBF16 ? static_cast<const void*>(b.data()) : f.data();
    a.src_stride = cols;
    a.rows = rows;
    a.cols = cols;
    a.dst = q.data();
    a.dst_stride = cols;
    a.scales = scales.data();
    a.scale_stride = (cols + 127) / 128;
    a.tensor = "bench";
    Status st;
    const double s = best_seconds(reps, [&] { st = convert::quantize_e4m3_blocks(a); });
    if (!st.is_ok()) {
      std::cerr << st.message() << "\n";
      return 1;
    }
    print(std::string("quantize_e4m3_128x128_from_") + std::string(dtype_name(t)), rows, cols, n * dtype_bytes(t), s);
  }
  struct CastCase {
    DType from, to;
    const void* src;
  };
  for (const CastCase& c : {CastCase{DType::kF32, DType::kBF16, f.data()}, CastCase{DType::kF32, DType::kF16, f.data()},
                            CastCase{DType::kBF16, DType::kF16, b.data()}}) {
    Status st;
    const double s = best_seconds(reps, [&] { st = convert::cast(c.from, c.to, c.src, h.data(), n, "bench"); });
    if (!st.is_ok()) return 1;
    print("cast_" + std::string(dtype_name(c.from)) + "_to_" + std::string(dtype_name(c.to)), rows, cols,
          n * dtype_bytes(c.from), s);
  }
  return 0;
}
