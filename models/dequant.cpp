// Block layouts follow ggml's ggml-common.h (block_q4_0 etc.); the arithmetic mirrors ggml's
// reference dequantize_row_* so that float32 results are bit-identical to gguf-py's.
//
// Note [No FMA in dequant]
// Q4_1 and Q4_K compute `d * q + m` / `d * q - m`; ggml's reference and gguf-py round the product
// before the add. With the formats here the product is exact in float32 (an f16 scale, times a
// 6-bit sub-scale, times a 4-bit quant needs at most 21 significant bits), so GCC's contraction
// into a fused multiply-add (it does contract under -march=x86-64-v3) cannot change a result
// today. This file is still compiled with -ffp-contract=off (models/CMakeLists.txt) so that a
// format whose product rounds (wider quants, float grids) keeps ggml's rounding without anyone
// having to remember this.
#include "models/dequant.h"

#include <array>
#include <cstring>

#include "kernels/error.h"

namespace rondo::models {
namespace {

constexpr std::uint32_t kQK = 32;    // elements per block of the legacy quants
constexpr std::uint32_t kQKK = 256;  // elements per K-quant super-block

constexpr std::array<GgmlTypeInfo, 34> kTypes{{
    {GgmlType::kF32, "F32", 1, 4, true},
    {GgmlType::kF16, "F16", 1, 2, true},
    {GgmlType::kQ4_0, "Q4_0", kQK, 2 + 16, true},
    {GgmlType::kQ4_1, "Q4_1", kQK, 2 + 2 + 16, true},
    {GgmlType::kQ5_0, "Q5_0", kQK, 2 + 4 + 16, false},
    {GgmlType::kQ5_1, "Q5_1", kQK, 2 + 2 + 4 + 16, false},
    {GgmlType::kQ8_0, "Q8_0", kQK, 2 + 32, true},
    {GgmlType::kQ8_1, "Q8_1", kQK, 4 + 4 + 32, false},
    {GgmlType::kQ2_K, "Q2_K", kQKK, 2 + 2 + 16 + 64, false},
    {GgmlType::kQ3_K, "Q3_K", kQKK, 2 + 64 + 32 + 12, false},
    {GgmlType::kQ4_K, "Q4_K", kQKK, 2 + 2 + 12 + 128, true},
    {GgmlType::kQ5_K, "Q5_K", kQKK, 2 + 2 + 12 + 32 + 128, false},
    {GgmlType::kQ6_K, "Q6_K", kQKK, 128 + 64 + 16 + 2, true},
    {GgmlType::kQ8_K, "Q8_K", kQKK, 4 + 256 + 32, false},
    {GgmlType::kIQ2_XXS, "IQ2_XXS", kQKK, 2 + 64, false},
    {GgmlType::kIQ2_XS, "IQ2_XS", kQKK, 2 + 64 + 8, false},
    {GgmlType::kIQ3_XXS, "IQ3_XXS", kQKK, 2 + 64 + 32, false},
    {GgmlType::kIQ1_S, "IQ1_S", kQKK, 2 + 32 + 16, false},
    {GgmlType::kIQ4_NL, "IQ4_NL", kQK, 2 + 16, false},
    {GgmlType::kIQ3_S, "IQ3_S", kQKK, 2 + 64 + 32 + 8 + 4, false},
    {GgmlType::kIQ2_S, "IQ2_S", kQKK, 2 + 64 + 16, false},
    {GgmlType::kIQ4_XS, "IQ4_XS", kQKK, 2 + 2 + 128 + 4, false},
    {GgmlType::kI8, "I8", 1, 1, false},
    {GgmlType::kI16, "I16", 1, 2, false},
    {GgmlType::kI32, "I32", 1, 4, false},
    {GgmlType::kI64, "I64", 1, 8, false},
    {GgmlType::kF64, "F64", 1, 8, false},
    {GgmlType::kIQ1_M, "IQ1_M", kQKK, 32 + 16 + 8, false},
    {GgmlType::kBF16, "BF16", 1, 2, true},
    {GgmlType::kTQ1_0, "TQ1_0", kQKK, 2 + 52, false},
    {GgmlType::kTQ2_0, "TQ2_0", kQKK, 2 + 64, false},
    {GgmlType::kMXFP4, "MXFP4", kQK, 1 + 16, false},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32, false},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 16, false},
}};

std::uint16_t load_u16(const std::uint8_t* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);  // GGUF is little-endian, as is every host Rondo runs on
  return v;
}

// One block each: `src` points at the block, `y` receives block_size floats.

void block_q8_0(const std::uint8_t* src, float* y) {
  // d: f16 scale, then 32 int8 quants. y = q * d.
  const float d = f16_to_f32(load_u16(src));
  const auto* q = reinterpret_cast<const std::int8_t*>(src + 2);
  for (std::uint32_t j = 0; j < kQK; ++j)
    y[j] = static_cast<float>(q[j]) * d;
}

void block_q4_0(const std::uint8_t* src, float* y) {
  // d: f16, then 16 bytes: low nibbles are elements 0..15, high nibbles 16..31, offset by 8.
  const float d = f16_to_f32(load_u16(src));
  const std::uint8_t* qs = src + 2;
  for (std::uint32_t j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(static_cast<int>(qs[j] & 0x0F) - 8) * d;
    y[j + kQK / 2] = static_cast<float>(static_cast<int>(qs[j] >> 4) - 8) * d;
  }
}

void block_q4_1(const std::uint8_t* src, float* y) {
  // d, m: f16 scale and minimum, then nibbles as in Q4_0 (unsigned). y = d * q + m.
  const float d = f16_to_f32(load_u16(src));
  const float m = f16_to_f32(load_u16(src + 2));
  const std::uint8_t* qs = src + 4;
  for (std::uint32_t j = 0; j < kQK / 2; ++j) {
    y[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
    y[j + kQK / 2] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

// Q4_K's 12 scale bytes hold eight 6-bit scales and eight 6-bit minimums: sub-blocks 0..3 in the
// low 6 bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 take their low 4 bits from
// bytes 8..11 (scale low nibble, min high nibble) and their top 2 bits from the spare top bits of
// bytes 0..3 (scales) and 4..7 (mins).
void q4_k_scale_min(int j, const std::uint8_t* s, std::uint8_t* sc, std::uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = static_cast<std::uint8_t>((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
    *mn = static_cast<std::uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

void block_q4_k(const std::uint8_t* src, float* y) {
  // d, dmin: f16; scales[12]; qs[128]: 8 sub-blocks of 32. Sub-blocks 2k and 2k+1 share 32
  // bytes of qs (low and high nibbles). y = (d * sc) * q - (dmin * m).
  const float d = f16_to_f32(load_u16(src));
  const float dmin = f16_to_f32(load_u16(src + 2));
  const std::uint8_t* scales = src + 4;
  const std::uint8_t* qs = src + 16;
  for (int pair = 0; pair < 4; ++pair) {
    std::uint8_t sc0, m0, sc1, m1;
    q4_k_scale_min(2 * pair, scales, &sc0, &m0);
    q4_k_scale_min(2 * pair + 1, scales, &sc1, &m1);
    const float d0 = d * static_cast<float>(sc0), dm0 = dmin * static_cast<float>(m0);
    const float d1 = d * static_cast<float>(sc1), dm1 = dmin * static_cast<float>(m1);
    const std::uint8_t* q = qs + 32 * pair;
    float* out = y + 64 * pair;
    for (int l = 0; l < 32; ++l) {
      out[l] = d0 * static_cast<float>(q[l] & 0x0F) - dm0;
      out[l + 32] = d1 * static_cast<float>(q[l] >> 4) - dm1;
    }
  }
}

void block_q6_k(const std::uint8_t* src, float* y) {
  // ql[128]: low 4 bits; qh[64]: high 2 bits; scales[16]: int8 per 16 elements; d: f16 (last).
  // Each half of 128 elements uses 64 bytes of ql and 32 of qh: element groups of 32 take
  // ql[0:32] low, ql[32:64] low, ql[0:32] high, ql[32:64] high nibbles, with qh bits 0-1, 2-3,
  // 4-5, 6-7 on top. y = (d * scale) * (q - 32).
  const std::uint8_t* ql = src;
  const std::uint8_t* qh = src + 128;
  const auto* sc = reinterpret_cast<const std::int8_t*>(src + 192);
  const float d = f16_to_f32(load_u16(src + 208));
  for (int half = 0; half < 2; ++half) {
    const std::uint8_t* l4 = ql + 64 * half;
    const std::uint8_t* h2 = qh + 32 * half;
    const std::int8_t* s = sc + 8 * half;
    float* out = y + 128 * half;
    for (int l = 0; l < 32; ++l) {
      const int q1 = ((l4[l] & 0x0F) | (((h2[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
      const int is = l / 16;  // 16 elements per scale
      out[l] = (d * static_cast<float>(s[is + 0])) * static_cast<float>(q1);
      out[l + 32] = (d * static_cast<float>(s[is + 2])) * static_cast<float>(q2);
      out[l + 64] = (d * static_cast<float>(s[is + 4])) * static_cast<float>(q3);
      out[l + 96] = (d * static_cast<float>(s[is + 6])) * static_cast<float>(q4);
    }
  }
}

using BlockFn = void (*)(const std::uint8_t*, float*);

BlockFn block_fn(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0:
      return block_q8_0;
    case GgmlType::kQ4_0:
      return block_q4_0;
    case GgmlType::kQ4_1:
      return block_q4_1;
    case GgmlType::kQ4_K:
      return block_q4_k;
    case GgmlType::kQ6_K:
      return block_q6_k;
    default:
      return nullptr;
  }
}

[[noreturn]] void not_dequantizable(GgmlType type) {
  throw Error("ggml tensor data " + ggml_not_dequantizable(type));
}

}  // namespace

const GgmlTypeInfo* ggml_type_info(std::uint32_t type) {
  for (const GgmlTypeInfo& t : kTypes)
    if (static_cast<std::uint32_t>(t.type) == type) return &t;
  return nullptr;
}

const GgmlTypeInfo& ggml_type_info(GgmlType type) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<std::uint32_t>(type));
  RONDO_ASSERT(info != nullptr);
  return *info;
}

const char* ggml_dequantizable_types() {
  return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K";
}

std::string ggml_not_dequantizable(GgmlType type) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<std::uint32_t>(type));
  const std::string name =
      info ? info->name : "#" + std::to_string(static_cast<std::uint32_t>(type));
  return "has type " + name +
         ", which Rondo cannot dequantise (supported: " + ggml_dequantizable_types() +
         "); requantise the model to one of those types, e.g. with llama-quantize";
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1F;
  const std::uint32_t mant = h & 0x3FF;
  std::uint32_t bits;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float32.
    float v = static_cast<float>(mant) * 0x1p-24f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, or NaN with its payload
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

float bf16_to_f32(std::uint16_t bits) {
  const std::uint32_t wide = static_cast<std::uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, 4);
  return out;
}

std::uint16_t f32_to_bf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u)  // NaN: truncating could clear every payload bit
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040);
  // Round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate. Overflow turns
  // into infinity, as it should.
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

void dequantize_to_f32(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n) {
  const GgmlTypeInfo& info = ggml_type_info(type);
  RONDO_ASSERT(n >= 0 && n % info.block_size == 0);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<std::size_t>(n) * 4);
      return;
    case GgmlType::kF16:
      for (std::int64_t i = 0; i < n; ++i)
        dst[i] = f16_to_f32(load_u16(src + 2 * i));
      return;
    case GgmlType::kBF16:
      for (std::int64_t i = 0; i < n; ++i)
        dst[i] = bf16_to_f32(load_u16(src + 2 * i));
      return;
    default:
      break;
  }
  BlockFn fn = block_fn(type);
  if (fn == nullptr) not_dequantizable(type);
  const std::int64_t blocks = n / info.block_size;
  for (std::int64_t b = 0; b < blocks; ++b)
    fn(src + b * info.type_size, dst + b * info.block_size);
}

void dequantize_to_bf16(GgmlType type, const std::uint8_t* src, std::uint16_t* dst,
                        std::int64_t n) {
  const GgmlTypeInfo& info = ggml_type_info(type);
  RONDO_ASSERT(n >= 0 && n % info.block_size == 0);
  switch (type) {
    case GgmlType::kBF16:
      std::memcpy(dst, src, static_cast<std::size_t>(n) * 2);
      return;
    case GgmlType::kF32:
      for (std::int64_t i = 0; i < n; ++i) {
        float v;
        std::memcpy(&v, src + 4 * i, 4);
        dst[i] = f32_to_bf16(v);
      }
      return;
    case GgmlType::kF16:
      for (std::int64_t i = 0; i < n; ++i)
        dst[i] = f32_to_bf16(f16_to_f32(load_u16(src + 2 * i)));
      return;
    default:
      break;
  }
  BlockFn fn = block_fn(type);
  if (fn == nullptr) not_dequantizable(type);
  float tmp[kQKK];
  RONDO_ASSERT(info.block_size <= kQKK);
  const std::int64_t blocks = n / info.block_size;
  for (std::int64_t b = 0; b < blocks; ++b) {
    fn(src + b * info.type_size, tmp);
    std::uint16_t* out = dst + b * info.block_size;
    for (std::uint32_t j = 0; j < info.block_size; ++j)
      out[j] = f32_to_bf16(tmp[j]);
  }
}

}  // namespace rondo::models
