// The AVX2 loops of the CPU AdamW kernel (8 f32 lanes, with FMA and F16C). These instructions are
// in the x86-64-v3 baseline, but the file still names them (-mavx2 -mfma -mf16c) so that it keeps
// meaning AVX2 if the baseline is ever lowered, and it follows the same one-ISA-per-file rule as
// adamw_avx512.cpp (Note [One ISA per translation unit] in adamw.cpp). Entered through adamw.cpp.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw8bit_simd_body.h"
#include "kernels/cpu/adamw_internal.h"
#include "kernels/cpu/adamw_simd_body.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "adamw_avx2.cpp must be compiled with -mavx2 -mfma -mf16c (see kernels/CMakeLists.txt)"
#endif

namespace rondo::kernels::detail {
namespace {

struct Avx2 {
  static constexpr std::size_t kWidth = 8;
  using F = __m256;
  using D = __m256d;

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }

  static F load_bf16(const std::uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  // As Avx512::store_bf16. The rounded lanes are below 0x10000, so the unsigned-saturating pack
  // to 16 bits is exact.
  static void store_bf16(std::uint16_t* p, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i upper = _mm256_srli_epi32(bits, 16);
    const __m256i lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i result = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }

  static F load_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(std::uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }

  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static F gather_code(const float* table, const std::uint8_t* codes) {
    const __m256i index =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return _mm256_i32gather_ps(table, index, 4);
  }
  // Gathers 4 bytes per lane, keeps the first of each (the byte shuffle gathers them into the low
  // dword of each 128-bit half; the permute puts those two dwords side by side).
  static void store_bin_codes(const std::uint8_t* bin_code, F bin, std::uint8_t* out) {
    const __m256i words =
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(bin_code), _mm256_cvttps_epi32(bin), 1);
    const __m256i low_bytes = _mm256_shuffle_epi8(
        words, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4,
                                8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i packed =
        _mm256_permutevar8x32_epi32(low_bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }

  static D dzero() { return _mm256_setzero_pd(); }
  static D lo_pd(F x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
  static D hi_pd(F x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
  static D dfmadd(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
  static void dstore(double* p, D x) { _mm256_storeu_pd(p, x); }
};

}  // namespace

std::size_t adamw_avx2(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                       std::size_t end) {
  return adamw_entry<Avx2>(c, a, begin, end);
}

std::size_t adamw8bit_avx2(const AdamW8bitConstants& c, const AdamW8bitArrays& a, std::size_t begin,
                           std::size_t end) {
  return adamw8bit_entry<Avx2>(c, a, begin, end);
}

std::size_t sum_squares_avx2(const void* grad, FloatDType dtype, std::size_t begin, std::size_t end,
                             double* sum) {
  return sum_squares_entry<Avx2>(grad, dtype, begin, end, sum);
}

std::size_t cast_avx2(const float* src, void* dst, FloatDType dtype, std::size_t begin,
                      std::size_t end) {
  return cast_entry<Avx2>(src, dst, dtype, begin, end);
}

}  // namespace rondo::kernels::detail
