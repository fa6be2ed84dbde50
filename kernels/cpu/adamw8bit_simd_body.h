// The SIMD loop of the 8-bit CPU AdamW kernel, written once against the ISA traits of
// adamw_simd_body.h and instantiated by adamw_avx2.cpp and adamw_avx512.cpp. Internal linkage
// only, like adamw_simd_body.h (Note [One ISA per translation unit] in adamw.cpp). The arithmetic
// is the scalar path's (adamw8bit.cpp, adamw8bit_block_scalar, and dynamic_map.h), operation for
// operation, so results are bit-identical (Note [Bit-identical paths]).
//
// On top of adamw_simd_body.h's traits, an ISA provides: max(a, b) and min(a, b) as MAXPS/MINPS
// (a > b ? a : b, a < b ? a : b: the second operand when either is NaN), abs; gather_code(table,
// codes) = table[codes[0..kWidth)]; store_bin_codes(bin_code, bin, out) writes the kWidth bytes
// bin_code[(int)bin] (truncation; 4-byte gathers, hence the table's 3 bytes of padding).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/adamw_simd_body.h"

namespace rondo::kernels::detail {
namespace {

// The largest lane (exact in any order: no lane is NaN, see block_loop).
template <class Isa>
float lanes_max(typename Isa::F x) {
  float lanes[Isa::kWidth];
  Isa::store_f32(lanes, x);
  float out = 0.0f;
  for (float lane : lanes)
    out = out < lane ? lane : out;
  return out;
}

// quantize_dynamic_block (dynamic_map.h) of one whole block whose absmax is known.
template <class Isa>
void quantize_block(const float* x, float absmax, const std::uint8_t* bin_code,
                    std::uint8_t* codes) {
  using F = typename Isa::F;
  if (absmax == 0.0f) {
    for (std::size_t j = 0; j < kBlock8bit; ++j)
      codes[j] = 0;
    return;
  }
  const F inv = Isa::set1(1.0f / absmax);
  const F minus_one = Isa::set1(-1.0f), one = Isa::set1(1.0f), half = Isa::set1(0.5f);
  const F bins = Isa::set1(65535.0f);
  for (std::size_t j = 0; j < kBlock8bit; j += Isa::kWidth) {
    // dynamic_bin: a NaN becomes -1 (max returns its second operand), then the clamp to 1.
    const F v = Isa::min(Isa::max(Isa::mul(Isa::load_f32(x + j), inv), minus_one), one);
    const F bin = Isa::fmadd(Isa::mul(Isa::add(v, one), half), bins, half);
    Isa::store_bin_codes(bin_code, bin, codes + j);
  }
}

// Whole blocks of [begin, end), begin a multiple of kBlock8bit; a Body for run_by_dtypes.
struct AdamW8bitBody {
  template <class Isa, FloatDType kGrad, bool kStream, FloatDType kStreamType>
  static std::size_t run(const AdamW8bitConstants& c, const AdamW8bitArrays& a, std::size_t begin,
                         std::size_t end) {
    using F = typename Isa::F;
    constexpr std::size_t kW = Isa::kWidth;
    static_assert(kBlock8bit % kW == 0, "a block holds whole vectors");
    const F grad_scale = Isa::set1(c.f32.grad_scale);
    const F decay = Isa::set1(c.f32.decay);
    const F beta1 = Isa::set1(c.beta1);
    const F one_minus_beta1 = Isa::set1(c.one_minus_beta1);
    const F beta2 = Isa::set1(c.f32.beta2);
    const F one_minus_beta2 = Isa::set1(c.f32.one_minus_beta2);
    const F bc2_sqrt = Isa::set1(c.f32.bc2_sqrt);
    const F eps = Isa::set1(c.f32.eps);
    const F neg_step = Isa::set1(c.f32.neg_step);
    float m1s[kBlock8bit], v1s[kBlock8bit];  // the block's updated moments, to requantise
    std::size_t i = begin;
    for (; i + kBlock8bit <= end; i += kBlock8bit) {
      const std::size_t block = i / kBlock8bit;
      const F m_absmax = Isa::set1(a.m_absmax[block]);
      const F v_absmax = Isa::set1(a.v_absmax[block]);
      F m_max = Isa::set1(0.0f), v_max = Isa::set1(0.0f);
      for (std::size_t j = 0; j < kBlock8bit; j += kW) {
        const std::size_t k = i + j;
        const F g = Isa::mul(load_lanes<Isa, kGrad>(a.grad, k), grad_scale);
        const F m = Isa::mul(Isa::gather_code(c.m_code, a.m_codes + k), m_absmax);
        const F v = Isa::mul(Isa::gather_code(c.v_code, a.v_codes + k), v_absmax);
        const F m1 = Isa::fmadd(one_minus_beta1, g, Isa::mul(m, beta1));
        const F v1 = Isa::fmadd(Isa::mul(one_minus_beta2, g), g, Isa::mul(v, beta2));
        const F p = Isa::mul(Isa::load_f32(a.master + k), decay);
        const F denom = Isa::add(Isa::div(Isa::sqrt(v1), bc2_sqrt), eps);
        const F p1 = Isa::add(p, Isa::div(Isa::mul(neg_step, m1), denom));
        Isa::store_f32(a.master + k, p1);
        if constexpr (kStream) store_lanes<Isa, kStreamType>(a.stream, k, p1);
        Isa::store_f32(m1s + j, m1);
        Isa::store_f32(v1s + j, v1);
        // dynamic_absmax: a NaN |m| leaves the running max as it was (max's second operand).
        m_max = Isa::max(Isa::abs(m1), m_max);
        v_max = Isa::max(Isa::abs(v1), v_max);
      }
      const float m_amax = lanes_max<Isa>(m_max), v_amax = lanes_max<Isa>(v_max);
      a.m_absmax[block] = m_amax;
      a.v_absmax[block] = v_amax;
      quantize_block<Isa>(m1s, m_amax, c.m_bin_code, a.m_codes + i);
      quantize_block<Isa>(v1s, v_amax, c.v_bin_code, a.v_codes + i);
    }
    return i;
  }
};

template <class Isa>
std::size_t adamw8bit_entry(const AdamW8bitConstants& c, const AdamW8bitArrays& a,
                            std::size_t begin, std::size_t end) {
  return run_by_dtypes<AdamW8bitBody, Isa>(c, a, begin, end);
}

}  // namespace
}  // namespace rondo::kernels::detail
