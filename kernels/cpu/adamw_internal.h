// Internal to the CPU AdamW kernel: what adamw.cpp hands to the per-ISA loops in
// adamw_avx2.cpp and adamw_avx512.cpp. Plain data and declarations only (no inline functions), so
// that including it from a per-ISA translation unit cannot leak ISA-specific code into baseline
// code (Note [One ISA per translation unit] in adamw.cpp).
#pragma once

#include <cstddef>

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
