#pragma once
// One element at a time: the bit-level conversions every dtype conversion
// kernel is built from, shared by the CPU kernels (convert.cc) and the CUDA
// kernel (convert_kernel.cu) so that both give the same bits. Every
// convention is in docs/conversion.md; in short, each function gives the
// bits that PyTorch's CPU `.to(dtype)` gives for the same input (NaN
// payloads aside).
//
// Pure functions of their argument; no state, any thread.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define REFIT_HD __host__ __device__ __forceinline__
#else
#define REFIT_HD inline
#endif

namespace refit::convert {

// E4M3 (OCP "fn" variant: no infinities, one NaN pattern per sign, 0x7F and
// 0xFF): largest finite value 448 = 0x7E.
inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3MaxBits = 0x7E;

REFIT_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

REFIT_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

REFIT_HD float f32_from_bf16(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// cond ? x : y, as a mask: GCC does not vectorize a loop whose selects
// stay ternaries here ("control flow in loop").
REFIT_HD uint32_t select(bool cond, uint32_t x, uint32_t y) {
  const uint32_t m = 0u - static_cast<uint32_t>(cond);
  return (x & m) | (y & ~m);
}

// F32 -> BF16, round to nearest even, overflow -> infinity; every NaN ->
// 0x7FC0 (torch's scalar conversion; its vectorized one gives 0xFFFF).
REFIT_HD uint16_t bf16_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(select((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, r));
}

// F32 -> F16 (IEEE binary16), round to nearest even, subnormals kept,
// overflow -> infinity, NaN -> 0x7E00 with the input's sign (as torch).
REFIT_HD uint16_t f16_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Below F16's smallest normal (2^-14): one F32 addition of 0.5, whose ulp
  // (2^-24) is F16's subnormal step, rounds to nearest even; the low bits
  // of the sum are the result (0x400 = the smallest normal, rounding up).
  const uint32_t sub = f32_bits(f32_from_bits(a) + 0.5f) - 0x3F000000u;
  // Normal: drop 13 mantissa bits with round to nearest even and rebias the
  // exponent from 127 to 15; a carry bumps the exponent, up to infinity.
  const uint32_t nrm = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
  uint32_t r = select(a < 0x38800000u, sub, nrm);
  r = select(a >= 0x47800000u, 0x7C00u, r);  // >= 65536 and infinity
  r = select(a > 0x7F800000u, 0x7E00u, r);
  return static_cast<uint16_t>(sign | r);
}

// F32 -> E4M3 (fn), round to nearest even, saturating: whatever rounds
// past 448 (|x| > 464, infinity included) gives +-448; NaN gives 0x7F with
// the input's sign. The bits of torch's CPU .to(torch.float8_e4m3fn).
REFIT_HD uint8_t e4m3_from_f32(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Below E4M3's smallest normal (2^-6): one F32 addition of 2^14, whose
  // ulp is E4M3's subnormal step (2^-9), rounds to nearest even; the low
  // bits of the sum are then the subnormal's mantissa (8 = the smallest
  // normal, when it rounds up).
  constexpr uint32_t kDenormMagic = 141u << 23;  // 2^14
  const uint32_t sub = f32_bits(f32_from_bits(a) + f32_from_bits(kDenormMagic)) - kDenormMagic;
  // Normal: drop 20 mantissa bits with round to nearest even and rebias the
  // exponent from 127 to 7; a carry out of the mantissa bumps the exponent.
  const uint32_t nrm = (a + ((7u - 127u) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  uint32_t r = select(a < (121u << 23), sub, nrm > kE4M3MaxBits ? kE4M3MaxBits : nrm);
  r = select(a > 0x7F800000u, 0x7Fu, r);
  return static_cast<uint8_t>(sign | r);
}

// E4M3 (fn) -> F32, exact.
REFIT_HD float f32_from_e4m3(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xFu;
  const uint32_t m = b & 0x7u;
  if (e == 0xF && m == 0x7) return f32_from_bits(sign | 0x7FC00000u);
  if (e == 0) {
    // Subnormal: m * 2^-9.
    return f32_from_bits(sign | f32_bits(static_cast<float>(m) * (1.0f / 512.0f)));
  }
  return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

}  // namespace refit::convert
