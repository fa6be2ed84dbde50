// The AVX-512 loops of the CPU AdamW kernel (16 f32 lanes). Compiled with -mavx512f on top of the
// x86-64-v3 baseline and entered only after simd_path_resolve() found AVX-512F on this CPU; it
// includes nothing with external inline functions (Note [One ISA per translation unit] in
// adamw.cpp). Entered through adamw.cpp, never directly.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw8bit_simd_body.h"
#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/adamw_simd_body.h"

#if !defined(__AVX512F__)
#error "adamw_avx512.cpp must be compiled with -mavx512f (see kernels/CMakeLists.txt)"
#endif

namespace rondo::kernels::detail {
namespace {

struct Avx512 {
  static constexpr std::size_t kWidth = 16;
  using F = __m512;
  using D = __m512d;

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm512_storeu_ps(p, x); }

  // bf16 -> f32 is exact: the 16 bits become the upper half.
  static F load_bf16(const std::uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  // Round to nearest even in integer arithmetic, NaN made quiet: float_convert.h's bf16_from_f32
  // on 16 lanes. (Not VCVTNEPS2BF16: it needs AVX512_BF16 and flushes subnormal inputs to zero.)
  static void store_bf16(std::uint16_t* p, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i upper = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(upper, _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i result = _mm512_mask_blend_epi32(nan, rounded, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(result));
  }

  static F load_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(std::uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }

  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F abs(F x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
  }
  static F gather_code(const float* table, const std::uint8_t* codes) {
    const __m512i index =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return _mm512_i32gather_ps(index, table, 4);
  }
  // Gathers 4 bytes per lane and keeps the first of each (VPMOVDB truncates).
  static void store_bin_codes(const std::uint8_t* bin_code, F bin, std::uint8_t* out) {
    const __m512i words = _mm512_i32gather_epi32(_mm512_cvttps_epi32(bin), bin_code, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(words));
  }

  static D dzero() { return _mm512_setzero_pd(); }
  static D lo_pd(F x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
  static D hi_pd(F x) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  static D dfmadd(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
  static void dstore(double* p, D x) { _mm512_storeu_pd(p, x); }
};

}  // namespace

std::size_t adamw_avx512(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                         std::size_t end) {
  return adamw_entry<Avx512>(c, a, begin, end);
}

std::size_t adamw8bit_avx512(const AdamW8bitConstants& c, const AdamW8bitArrays& a,
                             std::size_t begin, std::size_t end) {
  return adamw8bit_entry<Avx512>(c, a, begin, end);
}

std::size_t sum_squares_avx512(const void* grad, FloatDType dtype, std::size_t begin,
                               std::size_t end, double* sum) {
  return sum_squares_entry<Avx512>(grad, dtype, begin, end, sum);
}

std::size_t cast_avx512(const float* src, void* dst, FloatDType dtype, std::size_t begin,
                        std::size_t end) {
  return cast_entry<Avx512>(src, dst, dtype, begin, end);
}

}  // namespace rondo::kernels::detail
