// ggml tensor element types (as GGUF files store them) and their dequantisation to float32 and to
// bf16, Rondo's streaming dtype. Quantised types go through kernels::dequantize (kernels/quant.h),
// the implementation the devices share. Results equal gguf-py's `gguf.quants.dequantize` bit for
// bit in float32 (same operations in the same order; see Note [No FMA in dequantisation] in
// kernels/cpu/quant.cpp). Used by gguf.cpp (load_tensor) and by tests.
//
//   const GgmlTypeInfo* info = ggml_type_info(GgmlType::kQ4_K);   // 256 elements in 144 bytes
//   dequantize_to_f32(GgmlType::kQ4_K, src, dst, n);              // n a multiple of 256
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/quant.h"

namespace rondo::models {

// The numbers are ggml's `enum ggml_type`; GGUF tensor infos store them as uint32. Gaps are
// types ggml removed; files using them are rejected as unknown.
enum class GgmlType : std::uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
  kNVFP4 = 40,
  kQ1_0 = 41,
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;          // "Q4_K", as ggml and gguf-py name it
  std::uint32_t block_size;  // elements per block (1 for plain types)
  std::uint32_t type_size;   // bytes per block
  bool dequantizable;        // Rondo can turn it into floats
};

// nullptr for a number ggml does not define (an unknown type in a file).
const GgmlTypeInfo* ggml_type_info(std::uint32_t type);
const GgmlTypeInfo& ggml_type_info(GgmlType type);
// "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K": for error messages.
const char* ggml_dequantizable_types();
// The end of the error for a type Rondo cannot dequantise, after its subject ("<file>: tensor
// 'x'"): "has type Q5_K, which Rondo cannot dequantise (supported: ...); requantise ...".
std::string ggml_not_dequantizable(GgmlType type);

// The kernels' format of a quantised ggml type Rondo reads and writes (Q8_0, Q4_0, Q4_1, Q4_K,
// Q6_K; one implementation of their blocks, kernels/quant_blocks.h, shared with the device
// kernels); kNone for every other type.
kernels::QuantType ggml_quant_type(GgmlType type);

// Scalar conversions. f32_to_bf16 rounds to nearest, ties to even; a NaN stays a NaN (quiet, sign
// and top payload bits kept) instead of rounding into an infinity.
float f16_to_f32(std::uint16_t bits);
float bf16_to_f32(std::uint16_t bits);
std::uint16_t f32_to_bf16(float value);

// Dequantise `n` elements (a multiple of the type's block size) from `src`, which holds
// n / block_size * type_size bytes, into dst. The caller has checked sizes (RONDO_ASSERT here);
// a type that is not dequantizable throws Error. Quantised types spread over oneTBB threads.
void dequantize_to_f32(GgmlType type, const std::uint8_t* src, float* dst, std::int64_t n);
// To bf16 bits: BF16 is copied as is; every other type goes through float32 and f32_to_bf16.
void dequantize_to_bf16(GgmlType type, const std::uint8_t* src, std::uint16_t* dst, std::int64_t n);

}  // namespace rondo::models
