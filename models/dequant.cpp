// ggml's type table, and the conversions of the plain float types. The quantised types' blocks
// are decoded by kernels::dequantize (kernels/quant.h), the one implementation Rondo has, which
// the device kernels share; it follows ggml's reference dequantize_row_* so that float32 results
// are bit-identical to gguf-py's (see Note [No FMA in dequantisation] in kernels/cpu/quant.cpp).
#include "models/dequant.h"

#include <array>
#include <cstring>

#include "kernels/error.h"
#include "kernels/quant.h"

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
    {GgmlType::kMXFP4, "MXFP4", kQK, 1 + 16, true},
    {GgmlType::kNVFP4, "NVFP4", 64, 4 + 32, false},
    {GgmlType::kQ1_0, "Q1_0", 128, 2 + 16, false},
}};

std::uint16_t load_u16(const std::uint8_t* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);  // GGUF is little-endian, as is every host Rondo runs on
  return v;
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
  return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, MXFP4";
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
  const kernels::QuantType q = ggml_quant_type(type);
  if (q == kernels::QuantType::kNone) not_dequantizable(type);
  if (n > 0) kernels::dequantize({.type = q}, src, 1, n, kernels::FloatDType::kF32, dst);
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
  const kernels::QuantType q = ggml_quant_type(type);
  if (q == kernels::QuantType::kNone) not_dequantizable(type);
  if (n > 0) kernels::dequantize({.type = q}, src, 1, n, kernels::FloatDType::kBF16, dst);
}

// The quantised types Rondo reads are kernels' formats: one implementation of their blocks
// (kernels/quant_blocks.h), shared with the device kernels. kNone for every other type.
kernels::QuantType ggml_quant_type(GgmlType type) {
  switch (type) {
    case GgmlType::kQ8_0:
      return kernels::QuantType::kQ8_0;
    case GgmlType::kQ4_0:
      return kernels::QuantType::kQ4_0;
    case GgmlType::kQ4_1:
      return kernels::QuantType::kQ4_1;
    case GgmlType::kQ4_K:
      return kernels::QuantType::kQ4_K;
    case GgmlType::kQ6_K:
      return kernels::QuantType::kQ6_K;
    case GgmlType::kMXFP4:
      return kernels::QuantType::kGgufMXFP4;
    default:
      return kernels::QuantType::kNone;
  }
}

}  // namespace rondo::models
