// refit_convert_tool: runs refit's CPU conversion kernels on raw files, for
// the comparison with PyTorch (torch_reference_test.py). Test support, not
// installed.
//
//   refit_convert_tool quantize BF16|F32 ROWS COLS BLOCK_ROWS BLOCK_COLS IN VALUES_OUT SCALES_OUT
//   refit_convert_tool cast FROM TO COUNT IN OUT
//   refit_convert_tool e4m3 COUNT IN OUT      (F32 elements, no scaling)
//
// IN holds ROWS x COLS (or COUNT) little-endian elements, row-major. A
// refusal (NaN in a block) prints the Status and exits 2.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "transport/convert/convert.h"
#include "transport/convert/element.h"

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool write_file(const std::string& path, const void* p, size_t n) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
  return static_cast<bool>(out);
}

int usage() {
  std::cerr << "usage: refit_convert_tool quantize BF16|F32 ROWS COLS BLOCK_ROWS BLOCK_COLS IN VALUES_OUT SCALES_OUT\n"
               "       refit_convert_tool cast FROM TO COUNT IN OUT\n"
               "       refit_convert_tool e4m3 COUNT IN OUT\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace refit;
  if (argc < 2) return usage();
  const std::string cmd = argv[1];
  if (cmd == "quantize" && argc == 10) {
    const std::optional<DType> t = parse_dtype(argv[2]);
    const int64_t rows = std::atoll(argv[3]), cols = std::atoll(argv[4]);
    const convert::BlockSize block{std::atoll(argv[5]), std::atoll(argv[6])};
    if (!t || block.rows <= 0 || block.cols <= 0) return usage();
    const std::vector<char> in = read_file(argv[7]);
    if (static_cast<int64_t>(in.size()) != rows * cols * dtype_bytes(*t)) {
      std::cerr << argv[7] << ": " << in.size() << " bytes, expected " << rows * cols * dtype_bytes(*t) << "\n";
      return 1;
    }
    const int64_t bc = (cols + block.cols - 1) / block.cols, br = (rows + block.rows - 1) / block.rows;
    std::vector<uint8_t> values(rows * cols);
    std::vector<float> scales(br * bc);
    convert::QuantizeArgs a;
    a.src_dtype = *t;
    a.src = in.data();
    a.src_stride = cols;
    a.rows = rows;
    a.cols = cols;
    a.dst = values.data();
    a.dst_stride = cols;
    a.scales = scales.data();
    a.scale_stride = bc;
    a.block = block;
    a.tensor = argv[7];
    const Status s = convert::quantize_e4m3_blocks(a);
    if (!s.is_ok()) {
      std::cerr << s.message() << "\n";
      return 2;
    }
    return write_file(argv[8], values.data(), values.size()) &&
                   write_file(argv[9], scales.data(), scales.size() * sizeof(float))
               ? 0
               : 1;
  }
  if (cmd == "cast" && argc == 7) {
    const std::optional<DType> from = parse_dtype(argv[2]), to = parse_dtype(argv[3]);
    const int64_t n = std::atoll(argv[4]);
    if (!from || !to) return usage();
    const std::vector<char> in = read_file(argv[5]);
    if (static_cast<int64_t>(in.size()) != n * dtype_bytes(*from)) {
      std::cerr << argv[5] << ": " << in.size() << " bytes, expected " << n * dtype_bytes(*from) << "\n";
      return 1;
    }
    std::vector<char> out(n * dtype_bytes(*to));
    const Status s = convert::cast(*from, *to, in.data(), out.data(), n, argv[5]);
    if (!s.is_ok()) {
      std::cerr << s.message() << "\n";
      return 2;
    }
    return write_file(argv[6], out.data(), out.size()) ? 0 : 1;
  }
  if (cmd == "e4m3" && argc == 5) {
    const int64_t n = std::atoll(argv[2]);
    const std::vector<char> in = read_file(argv[3]);
    if (n < 0 || static_cast<int64_t>(in.size()) != n * 4) {
      std::cerr << argv[3] << ": " << in.size() << " bytes, expected " << n * 4 << "\n";
      return 1;
    }
    std::vector<uint8_t> out(n);
    for (int64_t i = 0; i < n; ++i) {
      float f;
      std::memcpy(&f, in.data() + 4 * i, 4);
      out[i] = convert::e4m3_from_f32(f);
    }
    return write_file(argv[4], out.data(), out.size()) ? 0 : 1;
  }
  return usage();
}
