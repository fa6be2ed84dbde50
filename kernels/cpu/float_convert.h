// Scalar conversions between f32 and the 16-bit storage types, bit-exact with the SIMD paths of
// the CPU kernels (adamw.h): round to nearest even; NaN stays a (quiet) NaN with its sign; ±Inf
// stays ±Inf; finite values too large for the target round to ±Inf, as torch's .to() does.
// Baseline code only: never include this from a per-ISA translation unit (see simd.h).
//
//   std::uint16_t b = kernels::bf16_from_f32(1.00390625f);  // a tie: rounds to even, 0x3F80
//   float back = kernels::f32_from_bf16(b);                 // 1.0f
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace rondo::kernels {

inline float f32_from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline std::uint32_t bits_from_f32(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float f32_from_bf16(std::uint16_t b) {
  return f32_from_bits(std::uint32_t{b} << 16);
}

// Round to nearest even by adding 0x7FFF plus the lowest kept bit, then truncating. A NaN takes
// the other branch: truncating alone could clear every remaining mantissa bit of a signalling NaN
// and turn it into Inf, so the quiet bit is set instead.
inline std::uint16_t bf16_from_f32(float f) {
  const std::uint32_t bits = bits_from_f32(f);
  if (f != f) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  const std::uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<std::uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

// F16C is part of the x86-64-v3 baseline; the hardware conversion is correctly rounded and keeps
// NaN and Inf, and the SIMD paths use the same instruction on 8 or 16 lanes.
inline float f32_from_f16(std::uint16_t h) {
  return _cvtsh_ss(h);
}
inline std::uint16_t f16_from_f32(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace rondo::kernels
