#pragma once
// The CPU conversion kernels: dtype casts (F32 -> BF16, F32 -> F16,
// BF16 -> F16, round to nearest even) and block quantization of BF16 or F32
// to F8_E4M3 with one F32 scale per block, bit for bit what vLLM's
// per_block_cast_to_fp8 computes with PyTorch on the CPU. Every convention
// (scale, all-zero block, rounding, saturation, NaN and infinity) is in
// docs/conversion.md.
//
// Host memory only; the CUDA kernel (convert_kernel.h) does the same on
// device buffers. Each call is independent: any thread, any number at once
// on disjoint outputs.

#include <cstdint>
#include <string_view>

#include "planner/dtype.h"
#include "planner/status.h"

namespace refit::convert {

// The quantization block, in elements of the last two dimensions (rows of
// the second-to-last, columns of the last): the model's
// quantization_config.weight_block_size, [128, 128] for DeepSeek-V3, Kimi-K2
// and Qwen3's FP8 checkpoints.
struct BlockSize {
  int64_t rows = 128;
  int64_t cols = 128;
};

// A box of a tensor's last two dimensions to quantize. `rows` x `cols`
// elements of `src` (row stride `src_stride` elements) land as E4M3 bytes in
// `dst` (row stride `dst_stride`), and one F32 scale per block in `scales`
// (block (i, j) at scales[i * scale_stride + j]). The box starts on a block
// boundary; its last block row and column may be partial (a tensor edge, as
// vLLM pads it: the absent elements count as zeros). `tensor` and
// (`block_row0`, `block_col0`), the index of the box's first block in the
// tensor's block grid, only name a block in an error.
struct QuantizeArgs {
  DType src_dtype = DType::kBF16;  // kBF16 or kF32
  const void* src = nullptr;
  int64_t src_stride = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  uint8_t* dst = nullptr;
  int64_t dst_stride = 0;
  float* scales = nullptr;
  int64_t scale_stride = 0;
  BlockSize block;
  std::string_view tensor;
  int64_t block_row0 = 0;
  int64_t block_col0 = 0;
};

// Quantizes the box. A source block holding NaN or an infinity is refused,
// naming the tensor and the block, before anything is written to `dst` or
// `scales`: on error both are as they were.
Status quantize_e4m3_blocks(const QuantizeArgs& args);

// Quantizes `count` matrices of `a.rows` x `a.cols` that follow one
// another densely (a box of a tensor with leading dimensions, row-major),
// each as quantize_e4m3_blocks quantizes a box. Matrix l is read at `a.src`
// + l * rows * cols elements and lands at `a.dst` + l * rows * cols, its
// scales at `a.scales` + l * brows * bcols (its block grid: rows and cols
// over the block, rounded up). The strides are set here (dense); the
// other fields are a's. Stops at the first refusal: the matrices before it
// are written.
Status quantize_e4m3_matrices(QuantizeArgs a, int64_t count);

// The checks quantize_e4m3_blocks makes of its arguments before reading
// anything (dtype, block size, strides), for the CUDA kernel's wrapper too.
Status check_quantize_args(const QuantizeArgs& args);

// The scale of a block whose largest magnitude is `amax` (finite, >= 0):
// max(amax, 1e-4) / 448 in F32, the dequantization factor that vLLM and
// DeepSeek store as `weight_scale_inv`.
float e4m3_block_scale(float amax);

// Casts `n` contiguous elements of `from` at `src` to `to` at `dst`
// (F32 -> BF16, F32 -> F16, BF16 -> F16; round to nearest even, overflow to
// infinity, NaN kept as NaN). Another pair is refused, naming `tensor`.
// `src` and `dst` must not overlap.
Status cast(DType from, DType to, const void* src, void* dst, int64_t n, std::string_view tensor);

// True when `cast` converts `from` to `to`.
bool cast_supported(DType from, DType to);

}  // namespace refit::convert
