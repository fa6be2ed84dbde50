// Internal to the CPU AdamW kernels: what adamw.cpp and adamw8bit.cpp hand to the per-ISA loops in
// adamw_avx2.cpp and adamw_avx512.cpp. Plain data and declarations only (no inline functions), so
// that including it from a per-ISA translation unit cannot leak ISA-specific code into baseline
// code (Note [One ISA per translation unit] in adamw.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/simd.h"

namespace rondo::kernels::detail {

// The f32 constants of one step, each rounded once from its double value as torch rounds the
// Python scalars it passes to its f32 kernels.
struct AdamWConstants {
  float grad_scale;       // float(grad_scale)
  float decay;            // float(1 - lr*wd)
  float m_coeff;          // lerp coefficient: float(1 - β1), or float(1 - β1) - 1 (see m_from_m)
  bool m_from_m;          // true: m += m_coeff*(g - m); false: m = g + m_coeff*(g - m) (torch's
                          // lerp switches form at weight 0.5 to stay exact at weight 1)
  float beta2;            // float(β2)
  float one_minus_beta2;  // float(1 - β2)
  float bc2_sqrt;         // float((1 - β2^t)^0.5)
  float eps;              // float(eps)
  float neg_step;         // float(-lr / (1 - β1^t))
};

// The arrays of one call (see AdamWTensor); indices are absolute.
struct AdamWArrays {
  const void* grad;
  FloatDType grad_dtype;
  float* master;
  float* m;
  float* v;
  void* stream;  // null: no streaming copy
  FloatDType stream_dtype;
};

// Each loop handles [begin, end) in whole vectors and returns where it stopped; the caller runs
// the scalar path from there to `end`.
std::size_t adamw_avx2(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                       std::size_t end);
std::size_t adamw_avx512(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                         std::size_t end);

// The 8-bit step (adamw8bit.cpp). Block of the 8-bit moments: kAdamW8bitBlock, repeated here so
// that the per-ISA files need not include a header with inline functions (a static_assert in
// adamw8bit.cpp keeps the two equal).
constexpr std::size_t kBlock8bit = 256;

struct AdamW8bitConstants {
  // grad_scale, decay, beta2, one_minus_beta2, eps and neg_step as the f32 kernel rounds them;
  // bc2_sqrt = float(sqrt(1 - β2^t)) (bitsandbytes' math.sqrt, not pow); m_coeff and m_from_m
  // unused (bitsandbytes does not lerp).
  AdamWConstants f32;
  float beta1;                     // float(β1)
  float one_minus_beta1;           // float(1 - β1)
  const float* m_code;             // (256) the signed map
  const std::uint8_t* m_bin_code;  // (65536 + 3) its quantiser's table
  const float* v_code;             // (256) the unsigned map
  const std::uint8_t* v_bin_code;  // (65536 + 3)
};

// The arrays of one call (see AdamW8bitTensor); element indices are absolute, block b's absmax is
// m_absmax[b] with b = index / kBlock8bit.
struct AdamW8bitArrays {
  const void* grad;
  FloatDType grad_dtype;
  float* master;
  std::uint8_t* m_codes;
  float* m_absmax;
  std::uint8_t* v_codes;
  float* v_absmax;
  void* stream;  // null: no streaming copy
  FloatDType stream_dtype;
};

// Each loop handles whole blocks from `begin` (a multiple of kBlock8bit) while they end at or
// before `end`, and returns where it stopped; the caller runs the scalar path from there.
std::size_t adamw8bit_avx2(const AdamW8bitConstants& c, const AdamW8bitArrays& a, std::size_t begin,
                           std::size_t end);
std::size_t adamw8bit_avx512(const AdamW8bitConstants& c, const AdamW8bitArrays& a,
                             std::size_t begin, std::size_t end);

// Stores Σ g_i² over [begin, stop) into *sum (f64 lanes, added in a fixed order); returns stop.
std::size_t sum_squares_avx2(const void* grad, FloatDType dtype, std::size_t begin, std::size_t end,
                             double* sum);
std::size_t sum_squares_avx512(const void* grad, FloatDType dtype, std::size_t begin,
                               std::size_t end, double* sum);

std::size_t cast_avx2(const float* src, void* dst, FloatDType dtype, std::size_t begin,
                      std::size_t end);
std::size_t cast_avx512(const float* src, void* dst, FloatDType dtype, std::size_t begin,
                        std::size_t end);

}  // namespace rondo::kernels::detail
