#include "transport/convert/convert.h"

#include <algorithm>
#include <string>
#include <vector>

#include "transport/convert/element.h"

// The loops below are written so that the compiler vectorizes them (no
// branches in element.h's conversions, no aliasing between src and dst);
// on x86-64 each is also built for AVX2 and chosen at load time, since the
// baseline (SSE2) has no 8-lane integer max or blend. Not under a sanitizer:
// the clones' resolvers run while the dynamic loader relocates, before the
// sanitizer's runtime is up, and an instrumented resolver crashes there.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define REFIT_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define REFIT_VECTOR_CLONES
#endif

namespace refit::convert {
namespace {

// The largest |x| of a strided block, as the bits of |x|: for IEEE formats
// the order of the bits of non-negative values is the order of the values,
// and anything >= the infinity's bits is an infinity or a NaN.
REFIT_VECTOR_CLONES
uint32_t abs_max_bits_bf16(const uint16_t* __restrict p, int64_t stride, int64_t rows, int64_t cols) {
  uint16_t m = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = p + i * stride;
    for (int64_t j = 0; j < cols; ++j) {
      const uint16_t a = row[j] & 0x7FFFu;
      m = a > m ? a : m;
    }
  }
  return static_cast<uint32_t>(m) << 16;
}

REFIT_VECTOR_CLONES
uint32_t abs_max_bits_f32(const uint32_t* __restrict p, int64_t stride, int64_t rows, int64_t cols) {
  uint32_t m = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const uint32_t* row = p + i * stride;
    for (int64_t j = 0; j < cols; ++j) {
      const uint32_t a = row[j] & 0x7FFFFFFFu;
      m = a > m ? a : m;
    }
  }
  return m;
}

REFIT_VECTOR_CLONES
void quantize_block_bf16(const uint16_t* __restrict src, int64_t src_stride, int64_t rows, int64_t cols,
                         float inv_scale, uint8_t* __restrict dst, int64_t dst_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* s = src + i * src_stride;
    uint8_t* d = dst + i * dst_stride;
    for (int64_t j = 0; j < cols; ++j) d[j] = e4m3_from_f32(f32_from_bf16(s[j]) * inv_scale);
  }
}

REFIT_VECTOR_CLONES
void quantize_block_f32(const float* __restrict src, int64_t src_stride, int64_t rows, int64_t cols,
                        float inv_scale, uint8_t* __restrict dst, int64_t dst_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = src + i * src_stride;
    uint8_t* d = dst + i * dst_stride;
    for (int64_t j = 0; j < cols; ++j) d[j] = e4m3_from_f32(s[j] * inv_scale);
  }
}

REFIT_VECTOR_CLONES
void cast_f32_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_from_f32(src[i]);
}

REFIT_VECTOR_CLONES
void cast_f32_to_f16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_from_f32(src[i]);
}

REFIT_VECTOR_CLONES
void cast_bf16_to_f16(const uint16_t* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_from_f32(f32_from_bf16(src[i]));
}

std::string block_name(std::string_view tensor, int64_t bi, int64_t bj) {
  return "tensor \"" + std::string(tensor) + "\" block (" + std::to_string(bi) + ", " + std::to_string(bj) + ")";
}

}  // namespace

float e4m3_block_scale(float amax) {
  // torch: x.abs().float().amax(...).clamp(1e-4) / 448.0, in F32 (a true
  // division on the CPU).
  return std::max(amax, 1e-4f) / kE4M3Max;
}

Status check_quantize_args(const QuantizeArgs& a) {
  if (a.src_dtype != DType::kBF16 && a.src_dtype != DType::kF32) {
    return Status::unsupported("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\" is " +
                               std::string(dtype_name(a.src_dtype)) + "; only BF16 and F32 are quantized");
  }
  if (a.block.rows <= 0 || a.block.cols <= 0) {
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\": block size " +
                           std::to_string(a.block.rows) + "x" + std::to_string(a.block.cols) + " is not positive");
  }
  if (a.rows < 0 || a.cols < 0 || a.src_stride < a.cols || a.dst_stride < a.cols) {
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\": box " +
                           std::to_string(a.rows) + "x" + std::to_string(a.cols) +
                           " does not fit its row strides (source " + std::to_string(a.src_stride) +
                           ", destination " + std::to_string(a.dst_stride) + ")");
  }
  const int64_t bcols = (a.cols + a.block.cols - 1) / a.block.cols;
  if (a.rows > 0 && a.cols > 0 && (a.src == nullptr || a.dst == nullptr || a.scales == nullptr)) {
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) +
                           "\": null source, destination or scale buffer");
  }
  if (bcols > 0 && a.scale_stride < bcols) {
    return Status::invalid("quantize to F8_E4M3: tensor \"" + std::string(a.tensor) + "\": scale row stride " +
                           std::to_string(a.scale_stride) + " is below the " + std::to_string(bcols) +
                           " blocks of a row");
  }
  return Status::ok();
}

Status quantize_e4m3_matrices(QuantizeArgs a, int64_t count) {
  const int64_t brows = a.block.rows > 0 ? (a.rows + a.block.rows - 1) / a.block.rows : 0;
  const int64_t bcols = a.block.cols > 0 ? (a.cols + a.block.cols - 1) / a.block.cols : 0;
  const int64_t matrix = a.rows * a.cols;
  a.src_stride = a.cols;
  a.dst_stride = a.cols;
  a.scale_stride = bcols;
  const auto* src = static_cast<const uint8_t*>(a.src);
  for (int64_t l = 0; l < count; ++l) {
    QuantizeArgs m = a;
    m.src = src + l * matrix * dtype_bytes(a.src_dtype);
    m.dst = a.dst + l * matrix;
    m.scales = a.scales + l * brows * bcols;
    REFIT_RETURN_IF_ERROR(quantize_e4m3_blocks(m));
  }
  return Status::ok();
}

Status quantize_e4m3_blocks(const QuantizeArgs& a) {
  REFIT_RETURN_IF_ERROR(check_quantize_args(a));
  const int64_t brows = (a.rows + a.block.rows - 1) / a.block.rows;
  const int64_t bcols = (a.cols + a.block.cols - 1) / a.block.cols;
  const bool bf16 = a.src_dtype == DType::kBF16;
  const int64_t esize = bf16 ? 2 : 4;
  const auto* base = static_cast<const uint8_t*>(a.src);
  auto block_src = [&](int64_t bi, int64_t bj) {
    return base + (bi * a.block.rows * a.src_stride + bj * a.block.cols) * esize;
  };

  // Pass 1: every block's amax, refusing NaN and infinity before anything
  // is written.
  std::vector<uint32_t> amax(static_cast<size_t>(brows * bcols));
  for (int64_t bi = 0; bi < brows; ++bi) {
    const int64_t r = std::min(a.block.rows, a.rows - bi * a.block.rows);
    for (int64_t bj = 0; bj < bcols; ++bj) {
      const int64_t c = std::min(a.block.cols, a.cols - bj * a.block.cols);
      const uint8_t* p = block_src(bi, bj);
      const uint32_t m = bf16 ? abs_max_bits_bf16(reinterpret_cast<const uint16_t*>(p), a.src_stride, r, c)
                              : abs_max_bits_f32(reinterpret_cast<const uint32_t*>(p), a.src_stride, r, c);
      if (m >= 0x7F800000u) {
        return Status::invalid("quantize to F8_E4M3: " + block_name(a.tensor, a.block_row0 + bi, a.block_col0 + bj) +
                               " holds " + (m > 0x7F800000u ? "NaN" : "an infinity") +
                               "; refusing to quantize it (nothing written)");
      }
      amax[bi * bcols + bj] = m;
    }
  }

  // Pass 2: scale and values, block by block.
  for (int64_t bi = 0; bi < brows; ++bi) {
    const int64_t r = std::min(a.block.rows, a.rows - bi * a.block.rows);
    for (int64_t bj = 0; bj < bcols; ++bj) {
      const int64_t c = std::min(a.block.cols, a.cols - bj * a.block.cols);
      const float scale = e4m3_block_scale(f32_from_bits(amax[bi * bcols + bj]));
      // torch: x * (1.0 / scale), the reciprocal rounded to F32 first.
      const float inv = 1.0f / scale;
      const uint8_t* p = block_src(bi, bj);
      uint8_t* d = a.dst + bi * a.block.rows * a.dst_stride + bj * a.block.cols;
      if (bf16) {
        quantize_block_bf16(reinterpret_cast<const uint16_t*>(p), a.src_stride, r, c, inv, d, a.dst_stride);
      } else {
        quantize_block_f32(reinterpret_cast<const float*>(p), a.src_stride, r, c, inv, d, a.dst_stride);
      }
      a.scales[bi * a.scale_stride + bj] = scale;
    }
  }
  return Status::ok();
}

bool cast_supported(DType from, DType to) {
  return (from == DType::kF32 && (to == DType::kBF16 || to == DType::kF16)) ||
         (from == DType::kBF16 && to == DType::kF16);
}

Status cast(DType from, DType to, const void* src, void* dst, int64_t n, std::string_view tensor) {
  if (n < 0) return Status::invalid("cast: tensor \"" + std::string(tensor) + "\": negative element count");
  if (from == DType::kF32 && to == DType::kBF16) {
    cast_f32_to_bf16(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  } else if (from == DType::kF32 && to == DType::kF16) {
    cast_f32_to_f16(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  } else if (from == DType::kBF16 && to == DType::kF16) {
    cast_bf16_to_f16(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), n);
  } else {
    return Status::unsupported("cast: tensor \"" + std::string(tensor) + "\": " + std::string(dtype_name(from)) +
                               " to " + std::string(dtype_name(to)) +
                               " is not a conversion refit does (F32 to BF16 or F16, BF16 to F16)");
  }
  return Status::ok();
}

}  // namespace refit::convert
