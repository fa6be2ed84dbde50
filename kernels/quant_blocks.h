// The arithmetic and bit layout of dequantisation, shared by the CPU (cpu/quant.cpp) and the CUDA
// kernels (cuda/dequant.cu) so that both perform the same float32 operations in the same order and
// agree bit for bit. Per format: where a block's scale comes from (`*_scale`), where an element's
// quant comes from (`*_quant`), and how they combine (`*_apply`). Both translation units are
// compiled without multiply-add contraction (-ffp-contract=off, nvcc --fmad=false): see Note [No
// FMA in dequantisation] in cpu/quant.cpp. Internal to kernels/.
//
// Loads are byte by byte (little-endian, as GGUF and every host Rondo runs on), so a blob needs no
// alignment. Lookup tables are passed in, since a device function cannot read a host array: the
// CPU passes its arrays, the CUDA kernels copies in __constant__ memory, both from the lists below.
#pragma once

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#if defined(__CUDACC__)
#define RONDO_QUANT_FN __host__ __device__ __forceinline__
#else
#define RONDO_QUANT_FN inline
#endif

// bitsandbytes' NF4 code (get_4bit_type("nf4")): the float32 values of its table, as hex so that
// no decimal-to-binary rounding can differ. Sorted, so code k is the k-th smallest value.
#define RONDO_NF4_CODE                                                                           \
  {                                                                                              \
    -0x1p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f, -0x1.7a6a7ep-3f, \
        -0x1.74f0e2p-4f, 0.0f, 0x1.45f5fep-4f, 0x1.4995c6p-3f, 0x1.f809bap-3f, 0x1.5a0674p-2f,   \
        0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f, 0x1p+0f                                   \
  }

// bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True), 256 sorted float32
// values), the code of NF4's double-quantised absmax. tests/oracle/test_quant.py checks both tables
// against bitsandbytes.
#define RONDO_DYNAMIC_MAP_CODE                                                                     \
  {                                                                                                \
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f,               \
        -0x1.d86666p-1f, -0x1.d13334p-1f, -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f,           \
        -0x1.b46666p-1f, -0x1.ad3334p-1f, -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f,           \
        -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f, -0x1.7accccp-1f, -0x1.73999ap-1f,           \
        -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f, -0x1.4f999ap-1f,           \
        -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f, -0x1.32ccccp-1f, -0x1.2b999ap-1f,           \
        -0x1.246668p-1f, -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f,           \
        -0x1.006666p-1f, -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f,           \
        -0x1.b8ccccp-2f, -0x1.aa6666p-2f, -0x1.9cp-2f, -0x1.8d9998p-2f, -0x1.7f3334p-2f,           \
        -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f, -0x1.459998p-2f, -0x1.373334p-2f,           \
        -0x1.28ccccp-2f, -0x1.1a6668p-2f, -0x1.0cp-2f, -0x1.fb3332p-3f, -0x1.de6666p-3f,           \
        -0x1.c1999ap-3f, -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f,           \
        -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f, -0x1.93d70ap-4f,            \
        -0x1.8851eep-4f, -0x1.7ccccep-4f, -0x1.7147aep-4f, -0x1.65c29p-4f, -0x1.5a3d7p-4f,         \
        -0x1.4eb854p-4f, -0x1.433334p-4f, -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f,       \
        -0x1.151ebap-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f, -0x1.e51ebap-5f, -0x1.ce147ap-5f,       \
        -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f, -0x1.5ae146p-5f,            \
        -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f, -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f,        \
        -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451ebap-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f,       \
        -0x1.75c29p-7f, -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f,         \
        -0x1.e978d4p-8f, -0x1.c49ba6p-8f, -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.56041ap-8f,       \
        -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f, -0x1.851eb8p-9f, -0x1.3b645ap-9f,       \
        -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f, -0x1.78d5p-11f,    \
        -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,  \
        -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f,  \
        -0x1.b43528p-19f, -0x1.27476ep-21f, 0.0f, 0x1.27476ep-21f, 0x1.b43528p-19f,                \
        0x1.040bfep-17f, 0x1.64840cp-16f, 0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f,       \
        0x1.47ae16p-13f, 0x1.19ce0ap-12f, 0x1.8fc506p-12f, 0x1.02de02p-11f, 0x1.3dd982p-11f,       \
        0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f, 0x1.e353f8p-10f,         \
        0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f, 0x1.0c49bap-8f, 0x1.3126e8p-8f,            \
        0x1.56041ap-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f,            \
        0x1.072b02p-7f, 0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f,              \
        0x1.d1eb86p-7f, 0x1.170a3ep-6f, 0x1.451ebap-6f, 0x1.733334p-6f, 0x1.a147aep-6f,            \
        0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f, 0x1.2ccccep-5f, 0x1.43d70ap-5f,             \
        0x1.5ae146p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f, 0x1.b70a3ep-5f, 0x1.ce147ap-5f, \
        0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f, 0x1.20a3d6p-4f,            \
        0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f, 0x1.4eb854p-4f, 0x1.5a3d7p-4f,             \
        0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f,             \
        0x1.b66668p-4f, 0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, \
        0x1.88p-3f, 0x1.a4ccccp-3f, 0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f,    \
        0x1.1a6668p-2f, 0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f,                \
        0x1.626666p-2f, 0x1.70ccccp-2f, 0x1.7f3334p-2f, 0x1.8d9998p-2f, 0x1.9cp-2f,                \
        0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f, 0x1.d59998p-2f, 0x1.e4p-2f,                \
        0x1.f26664p-2f, 0x1.006666p-1f, 0x1.079998p-1f, 0x1.0eccccp-1f, 0x1.16p-1f,                \
        0x1.1d3334p-1f, 0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f,                \
        0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f,                \
        0x1.653334p-1f, 0x1.6c6668p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f,                \
        0x1.893334p-1f, 0x1.906666p-1f, 0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f,                \
        0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f, 0x1.c2ccccp-1f, 0x1.cap-1f,                \
        0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f, 0x1.eep-1f,                \
        0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1.0p+0f                                                  \
  }

namespace rondo::kernels::quant {

// Block geometry of the GGUF types: ggml-common.h's block_q4_0 etc.
constexpr int kQK = 32;    // elements per block of Q4_0, Q4_1, Q8_0
constexpr int kQKK = 256;  // elements per super-block of Q4_K, Q6_K
constexpr int kQ4_0Bytes = 2 + 16;
constexpr int kQ4_1Bytes = 2 + 2 + 16;
constexpr int kQ8_0Bytes = 2 + 32;
constexpr int kQ4_KBytes = 2 + 2 + 12 + 128;
constexpr int kQ6_KBytes = 128 + 64 + 16 + 2;
constexpr int kNf4Block2 = 256;  // absmax values per second-level block (bitsandbytes' fixed 256)
constexpr int kNf4Zero = 7;      // the NF4 code of 0.0: what bitsandbytes pads an odd tensor with

// --- Bits ----------------------------------------------------------------------------------------

RONDO_QUANT_FN float f32_of_bits(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

RONDO_QUANT_FN std::uint32_t bits_of_f32(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

RONDO_QUANT_FN std::uint16_t load_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

RONDO_QUANT_FN float load_f32(const std::uint8_t* p) {
  return f32_of_bits(std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) |
                     (std::uint32_t{p[2]} << 16) | (std::uint32_t{p[3]} << 24));
}

// IEEE binary16 to float32, exact (ggml's GGML_FP16_TO_FP32, numpy's astype): subnormals are
// mant * 2^-24, infinities and NaN payloads carry over.
RONDO_QUANT_FN float f32_of_f16(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t mant = h & 0x3FFu;
  if (exp == 0) return f32_of_bits(bits_of_f32(static_cast<float>(mant) * 0x1p-24f) | sign);
  if (exp == 31) return f32_of_bits(sign | 0x7F800000u | (mant << 13));
  return f32_of_bits(sign | ((exp + (127 - 15)) << 23) | (mant << 13));
}

// float32 to bfloat16 bits, round to nearest even; a NaN stays a (quiet) NaN with its sign instead
// of rounding into an infinity. The same rule as float_convert.h's bf16_from_f32.
RONDO_QUANT_FN std::uint16_t bf16_of_f32(float f) {
  const std::uint32_t bits = bits_of_f32(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// --- MXFP4 (kernels::Mxfp4Layout)
// -----------------------------------------------------------------

// The 16 FP4 (e2m1) values, by code.
#define RONDO_FP4_CODE                                                                        \
  {                                                                                           \
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, \
        -4.0f, -6.0f                                                                          \
  }

// 2^(scale - 127) as float32, exactly as torch's pow(2.0, e) gives it: 2^-127 is a subnormal,
// 2^128 an infinity.
RONDO_QUANT_FN float mxfp4_scale(std::uint8_t scale) {
  return scale == 0 ? f32_of_bits(1u << 22) : f32_of_bits(std::uint32_t{scale} << 23);
}

// Element i of the (E * C, R) tensor an MXFP4 blob stands for (i = (e * C + c) * R + r).
RONDO_QUANT_FN float mxfp4_value(const float* code, const std::uint8_t* blob, std::uint64_t scales,
                                 std::int64_t c_size, std::int64_t r_size, std::int64_t i) {
  const std::int64_t r = i % r_size, ec = i / r_size;
  const std::int64_t c = ec % c_size, e = ec / c_size;
  const std::int64_t group = (e * r_size + r) * (c_size / 32) + c / 32;
  const int j = static_cast<int>(c % 32);
  const std::uint8_t byte = blob[group * 16 + j / 2];
  return code[(j & 1) ? byte >> 4 : byte & 15] * mxfp4_scale(blob[scales + group]);
}

// --- GGUF blocks: `b` points at a block, j is the element's index in it --------------------------

// MXFP4 as ggml stores it (block_mxfp4): byte 0 the E8M0 scale e, then 16 bytes, element j in the
// low nibble of byte 1 + j and element j + 16 in the high one. y = kvalues[q] * 2^(e - 128), with
// ggml's kvalues_mxfp4 (twice the e2m1 values, code 8 a plain 0) and GGML_E8M0_TO_FP32_HALF.
constexpr int kMxfp4GgufBytes = 1 + 16;
#define RONDO_MXFP4_GGUF_CODE                                                                 \
  {                                                                                           \
    0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, \
        -8.0f, -12.0f                                                                         \
  }
RONDO_QUANT_FN float mxfp4_gguf_scale(const std::uint8_t* b) {
  const std::uint32_t e = b[0];
  return f32_of_bits(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}
RONDO_QUANT_FN int mxfp4_gguf_quant(const std::uint8_t* b, int j) {
  return j < 16 ? b[1 + j] & 15 : b[1 + j - 16] >> 4;
}
RONDO_QUANT_FN float mxfp4_gguf_apply(const float* code, float d, int q) {
  return code[q] * d;
}

// Q8_0: f16 d, then 32 int8 quants. y = q * d.
RONDO_QUANT_FN float q8_0_scale(const std::uint8_t* b) {
  return f32_of_f16(load_u16(b));
}
RONDO_QUANT_FN int q8_0_quant(const std::uint8_t* b, int j) {
  return static_cast<std::int8_t>(b[2 + j]);
}
RONDO_QUANT_FN float q8_0_apply(float d, int q) {
  return static_cast<float>(q) * d;
}

// Q4_0: f16 d, then 16 bytes: low nibbles are elements 0..15, high nibbles 16..31, offset by 8.
// y = (q - 8) * d.
RONDO_QUANT_FN float q4_0_scale(const std::uint8_t* b) {
  return f32_of_f16(load_u16(b));
}
RONDO_QUANT_FN int q4_0_quant(const std::uint8_t* b, int j) {
  const std::uint8_t byte = b[2 + (j & 15)];
  return j < 16 ? (byte & 0x0F) : (byte >> 4);
}
RONDO_QUANT_FN float q4_0_apply(float d, int q) {
  return static_cast<float>(q - 8) * d;
}

// Q4_1: f16 d and m, then nibbles laid out as in Q4_0 (unsigned). y = d * q + m.
RONDO_QUANT_FN float q4_1_scale(const std::uint8_t* b) {
  return f32_of_f16(load_u16(b));
}
RONDO_QUANT_FN float q4_1_min(const std::uint8_t* b) {
  return f32_of_f16(load_u16(b + 2));
}
RONDO_QUANT_FN int q4_1_quant(const std::uint8_t* b, int j) {
  const std::uint8_t byte = b[4 + (j & 15)];
  return j < 16 ? (byte & 0x0F) : (byte >> 4);
}
RONDO_QUANT_FN float q4_1_apply(float d, float m, int q) {
  return d * static_cast<float>(q) + m;
}

// Q4_K: f16 d and dmin, 12 bytes holding eight 6-bit scales and eight 6-bit minimums, 128 bytes of
// nibbles: 8 sub-blocks of 32; sub-blocks 2k and 2k+1 share bytes 32k..32k+31 (low, high nibble).
// The 12 bytes: sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (minimums);
// sub-blocks 4..7 take their low 4 bits from bytes 8..11 (scale in the low nibble, minimum in the
// high one) and their top 2 bits from the spare top bits of bytes 0..3 and 4..7.
// y = (d * sc) * q - (dmin * m).
RONDO_QUANT_FN void q4_k_scale_min(int sub, const std::uint8_t* s, int* sc, int* m) {
  if (sub < 4) {
    *sc = s[sub] & 63;
    *m = s[sub + 4] & 63;
  } else {
    *sc = (s[sub + 4] & 0x0F) | ((s[sub - 4] >> 6) << 4);
    *m = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
  }
}
// The sub-block's scale d * sc and offset dmin * m, each rounded to float32 once.
RONDO_QUANT_FN void q4_k_sub(const std::uint8_t* b, int sub, float* d_sub, float* m_sub) {
  int sc, m;
  q4_k_scale_min(sub, b + 4, &sc, &m);
  *d_sub = f32_of_f16(load_u16(b)) * static_cast<float>(sc);
  *m_sub = f32_of_f16(load_u16(b + 2)) * static_cast<float>(m);
}
RONDO_QUANT_FN int q4_k_quant(const std::uint8_t* b, int j) {
  const int sub = j >> 5;
  const std::uint8_t byte = b[16 + 32 * (sub >> 1) + (j & 31)];
  return (sub & 1) ? (byte >> 4) : (byte & 0x0F);
}
RONDO_QUANT_FN float q4_k_apply(float d_sub, float m_sub, int q) {
  return d_sub * static_cast<float>(q) - m_sub;
}

// Q6_K: ql[128] low 4 bits, qh[64] high 2 bits, int8 scales[16] (one per 16 elements), f16 d last.
// Each half of 128 elements uses 64 bytes of ql and 32 of qh; its groups of 32 take ql[0:32] low,
// ql[32:64] low, ql[0:32] high, ql[32:64] high nibbles, with qh bits 0-1, 2-3, 4-5, 6-7 on top.
// y = (d * scale) * (q - 32).
RONDO_QUANT_FN float q6_k_sub(const std::uint8_t* b, int sub) {
  return f32_of_f16(load_u16(b + 208)) * static_cast<float>(static_cast<std::int8_t>(b[192 + sub]));
}
// The scale index of element j (sub-blocks are not contiguous runs of 16 in the layout above).
RONDO_QUANT_FN int q6_k_sub_of(int j) {
  const int half = j >> 7, group = (j >> 5) & 3, l = j & 31;
  return 8 * half + (l >> 4) + 2 * group;
}
RONDO_QUANT_FN int q6_k_quant(const std::uint8_t* b, int j) {
  const int half = j >> 7, group = (j >> 5) & 3, l = j & 31;
  const std::uint8_t low = b[64 * half + l + 32 * (group & 1)];
  const int lo4 = group < 2 ? (low & 0x0F) : (low >> 4);
  const int hi2 = (b[128 + 32 * half + l] >> (2 * group)) & 3;
  return (lo4 | (hi2 << 4)) - 32;
}
RONDO_QUANT_FN float q6_k_apply(float d_sub, int q) {
  return d_sub * static_cast<float>(q);
}

// --- NF4 and INT8 -----------------------------------------------------------------------------

// The 4-bit code of element i (element 2k in the high nibble of byte k, as bitsandbytes packs).
RONDO_QUANT_FN int nf4_quant(const std::uint8_t* codes, std::int64_t i) {
  const std::uint8_t byte = codes[i >> 1];
  return (i & 1) ? (byte & 0x0F) : (byte >> 4);
}
// A block's absmax, plain or double-quantised: code2[q] * absmax2 + offset, the multiply and the
// add rounded separately, as bitsandbytes' dequantize_blockwise and then `absmax += offset`.
RONDO_QUANT_FN float nf4_absmax_plain(const std::uint8_t* absmax, std::int64_t block) {
  return load_f32(absmax + 4 * block);
}
RONDO_QUANT_FN float nf4_absmax_double(const std::uint8_t* codes2, const std::uint8_t* absmax2,
                                       float offset, const float* dynamic_map, std::int64_t block) {
  return dynamic_map[codes2[block]] * load_f32(absmax2 + 4 * (block / kNf4Block2)) + offset;
}
RONDO_QUANT_FN float nf4_apply(const float* nf4_code, int q, float absmax) {
  return nf4_code[q] * absmax;
}

RONDO_QUANT_FN float int8_apply(std::int8_t q, float scale) {
  return static_cast<float>(q) * scale;
}

}  // namespace rondo::kernels::quant
