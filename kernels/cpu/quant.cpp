// Quantised formats (kernels/quant.h): names, shape checks, blob layouts, and the CPU
// dequantisation that the CUDA kernels (cuda/dequant.cu) equal bit for bit. The quantisers are in
// quantize.cpp.
//
// Note [No FMA in dequantisation]
// Q4_1 and Q4_K compute `d * q + m` / `d * q - m`, double-quantised NF4 `code * absmax2 + offset`;
// ggml's reference, gguf-py (numpy, one ufunc at a time) and bitsandbytes (a multiply in its C++
// kernel, then a torch add) round the product before the add. So do we: this file and quantize.cpp
// are compiled with -ffp-contract=off (kernels/CMakeLists.txt), and cuda/dequant.cu with nvcc's
// --fmad=false, which GCC's and nvcc's default contraction into fused multiply-adds would
// otherwise break. For GGUF types the products happen to be exact today (an f16 scale times a
// 6-bit sub-scale times a 4-bit quant needs at most 21 significant bits); NF4's are not.
#include "kernels/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/cpu/float_convert.h"
#include "kernels/cpu/parallel.h"
#include "kernels/error.h"
#include "kernels/quant_blocks.h"

namespace rondo::kernels {
namespace {

// Elements decoded per step into a buffer on the stack: 16 KiB of floats, which stays in L1. A
// multiple of every GGUF block, so GGUF chunks hold whole blocks.
constexpr std::int64_t kChunk = 4096;
// Below this many chunks (64 Ki elements) a call runs on the caller's thread: waking workers costs
// about as much as the work.
constexpr std::size_t kInlineChunks = 16;

static_assert(kChunk % quant::kQKK == 0 && kChunk % quant::kQK == 0);

constexpr float kNf4Code[16] = RONDO_NF4_CODE;
constexpr float kDynamicMap[256] = RONDO_DYNAMIC_MAP_CODE;
constexpr float kFp4[16] = RONDO_FP4_CODE;
constexpr float kMxfp4Gguf[16] = RONDO_MXFP4_GGUF_CODE;

struct GgufGeometry {
  int elements;  // per block
  int bytes;     // per block
};

bool is_gguf(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ8_0:
    case QuantType::kQ4_K:
    case QuantType::kQ6_K:
    case QuantType::kGgufMXFP4:
      return true;
    default:
      return false;
  }
}

GgufGeometry gguf_geometry(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0:
      return {quant::kQK, quant::kQ4_0Bytes};
    case QuantType::kQ4_1:
      return {quant::kQK, quant::kQ4_1Bytes};
    case QuantType::kQ8_0:
      return {quant::kQK, quant::kQ8_0Bytes};
    case QuantType::kQ4_K:
      return {quant::kQKK, quant::kQ4_KBytes};
    case QuantType::kQ6_K:
      return {quant::kQKK, quant::kQ6_KBytes};
    case QuantType::kGgufMXFP4:
      return {quant::kQK, quant::kMxfp4GgufBytes};
    default:
      RONDO_ASSERT_MSG(false, std::string("not a GGUF type: ") + to_string(type));
  }
  return {0, 0};
}

std::uint64_t align16(std::uint64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

std::string shape_text(std::int64_t rows, std::int64_t cols) {
  return "(" + std::to_string(rows) + ", " + std::to_string(cols) + ")";
}

// --- Decoding [begin, end) of the flattened tensor into floats --------------------------------

// GGUF: begin and end are multiples of the block size.
void decode_gguf(QuantType type, const std::uint8_t* src, std::int64_t begin, std::int64_t end,
                 float* y) {
  const GgufGeometry g = gguf_geometry(type);
  for (std::int64_t block = begin / g.elements; block < end / g.elements; ++block) {
    const std::uint8_t* b = src + block * g.bytes;
    float* out = y + (block * g.elements - begin);
    switch (type) {
      case QuantType::kQ8_0: {
        const float d = quant::q8_0_scale(b);
        for (int j = 0; j < quant::kQK; ++j)
          out[j] = quant::q8_0_apply(d, quant::q8_0_quant(b, j));
        break;
      }
      case QuantType::kQ4_0: {
        const float d = quant::q4_0_scale(b);
        for (int j = 0; j < quant::kQK; ++j)
          out[j] = quant::q4_0_apply(d, quant::q4_0_quant(b, j));
        break;
      }
      case QuantType::kQ4_1: {
        const float d = quant::q4_1_scale(b), m = quant::q4_1_min(b);
        for (int j = 0; j < quant::kQK; ++j)
          out[j] = quant::q4_1_apply(d, m, quant::q4_1_quant(b, j));
        break;
      }
      case QuantType::kQ4_K:
        for (int sub = 0; sub < 8; ++sub) {
          float d_sub, m_sub;
          quant::q4_k_sub(b, sub, &d_sub, &m_sub);
          for (int j = 32 * sub; j < 32 * sub + 32; ++j)
            out[j] = quant::q4_k_apply(d_sub, m_sub, quant::q4_k_quant(b, j));
        }
        break;
      case QuantType::kGgufMXFP4: {
        const float d = quant::mxfp4_gguf_scale(b);
        for (int j = 0; j < quant::kQK; ++j)
          out[j] = quant::mxfp4_gguf_apply(kMxfp4Gguf, d, quant::mxfp4_gguf_quant(b, j));
        break;
      }
      case QuantType::kQ6_K: {
        float d_sub[16];
        for (int sub = 0; sub < 16; ++sub)
          d_sub[sub] = quant::q6_k_sub(b, sub);
        for (int j = 0; j < quant::kQKK; ++j)
          out[j] = quant::q6_k_apply(d_sub[quant::q6_k_sub_of(j)], quant::q6_k_quant(b, j));
        break;
      }
      default:
        RONDO_ASSERT(false);
    }
  }
}

void decode_nf4(const QuantFormat& format, const Nf4Layout& layout, const std::uint8_t* src,
                std::int64_t begin, std::int64_t end, float* y) {
  const std::uint8_t* codes = src + layout.codes;
  const float offset = format.double_quant ? quant::load_f32(src + layout.offset) : 0.0f;
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t block = i / format.block;
    const std::int64_t stop = std::min(end, (block + 1) * format.block);
    const float absmax = format.double_quant
                             ? quant::nf4_absmax_double(src + layout.absmax, src + layout.absmax2,
                                                        offset, kDynamicMap, block)
                             : quant::nf4_absmax_plain(src + layout.absmax, block);
    for (; i < stop; ++i)
      y[i - begin] = quant::nf4_apply(kNf4Code, quant::nf4_quant(codes, i), absmax);
  }
}

void decode_int8(const Int8Layout& layout, std::int64_t cols, const std::uint8_t* src,
                 std::int64_t begin, std::int64_t end, float* y) {
  const auto* q = reinterpret_cast<const std::int8_t*>(src);
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t row = i / cols;
    const std::int64_t stop = std::min(end, (row + 1) * cols);
    const float scale = quant::load_f32(src + layout.scales + 4 * row);
    for (; i < stop; ++i)
      y[i - begin] = quant::int8_apply(q[i], scale);
  }
}

void decode_mxfp4(const Mxfp4Layout& layout, const std::uint8_t* src, std::int64_t begin,
                  std::int64_t end, float* y) {
  for (std::int64_t i = begin; i < end; ++i)
    y[i - begin] = quant::mxfp4_value(kFp4, src, layout.scales, layout.c, layout.r, i);
}

void store_rounded(const float* y, std::int64_t count, FloatDType out, std::uint16_t* dst) {
  if (out == FloatDType::kBF16) {
    for (std::int64_t i = 0; i < count; ++i)
      dst[i] = quant::bf16_of_f32(y[i]);
    return;
  }
  // F16C (x86-64-v3): round to nearest even, like the scalar tail and CUDA's __float2half_rn.
  std::int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(y + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < count; ++i)
    dst[i] = f16_from_f32(y[i]);
}

}  // namespace

const char* to_string(QuantType type) {
  switch (type) {
    case QuantType::kNone:
      return "none";
    case QuantType::kQ4_0:
      return "Q4_0";
    case QuantType::kQ4_1:
      return "Q4_1";
    case QuantType::kQ8_0:
      return "Q8_0";
    case QuantType::kQ4_K:
      return "Q4_K";
    case QuantType::kQ6_K:
      return "Q6_K";
    case QuantType::kNF4:
      return "NF4";
    case QuantType::kInt8:
      return "INT8";
    case QuantType::kMXFP4:
      return "MXFP4";
    case QuantType::kGgufMXFP4:
      return "MXFP4 (ggml)";
  }
  return "?";
}

std::string to_string(const QuantFormat& format) {
  if (format.type != QuantType::kNF4) return to_string(format.type);
  return "NF4 (block " + std::to_string(format.block) +
         (format.double_quant ? ", double quant)" : ")");
}

void check_quant_shape(const QuantFormat& format, std::int64_t rows, std::int64_t cols) {
  const std::string what = to_string(format) + " tensor of shape " + shape_text(rows, cols);
  if (format.type == QuantType::kNone)
    throw Error("a quantised tensor of shape " + shape_text(rows, cols) +
                " has no quantisation type (QuantType::kNone)");
  if (rows < 1 || cols < 1) throw Error(what + ": rows and cols must be at least 1");
  if (rows > std::numeric_limits<std::int64_t>::max() / 4 / cols)
    throw Error(what + ": too many elements");
  if (is_gguf(format.type)) {
    const GgufGeometry g = gguf_geometry(format.type);
    if (cols % g.elements != 0)
      throw Error(what + ": cols must be a multiple of the " + to_string(format.type) +
                  " block size " + std::to_string(g.elements) +
                  " (blocks do not cross rows); choose " +
                  (g.elements == quant::kQK ? "NF4 or INT8" : "Q4_0, Q4_1, Q8_0, NF4 or INT8") +
                  " for this tensor");
    return;
  }
  if (format.type == QuantType::kMXFP4) {
    if (format.experts < 1 || rows % format.experts != 0 || (rows / format.experts) % 32 != 0)
      throw Error(what + " of " + std::to_string(format.experts) +
                  " experts: rows must be the experts times a multiple of 32 (the groups run "
                  "along each expert's rows)");
    return;
  }
  if (format.type == QuantType::kNF4) {
    const int b = format.block;
    if (b < 32 || b > 4096 || (b & (b - 1)) != 0)
      throw Error(what + ": block size " + std::to_string(b) +
                  " is not one bitsandbytes supports (32, 64, 128, 256, 512, 1024, 2048, 4096)");
  }
}

Nf4Layout nf4_layout(const QuantFormat& format, std::int64_t rows, std::int64_t cols) {
  check_quant_shape(format, rows, cols);
  RONDO_ASSERT(format.type == QuantType::kNF4);
  Nf4Layout l;
  l.n = rows * cols;
  l.blocks = (l.n + format.block - 1) / format.block;
  l.codes = 0;
  l.absmax = align16(static_cast<std::uint64_t>((l.n + 1) / 2));
  if (!format.double_quant) {
    l.bytes = l.absmax + 4 * static_cast<std::uint64_t>(l.blocks);
    return l;
  }
  l.blocks2 = (l.blocks + quant::kNf4Block2 - 1) / quant::kNf4Block2;
  l.absmax2 = align16(l.absmax + static_cast<std::uint64_t>(l.blocks));
  l.offset = align16(l.absmax2 + 4 * static_cast<std::uint64_t>(l.blocks2));
  l.bytes = l.offset + 4;
  return l;
}

Mxfp4Layout mxfp4_layout(const QuantFormat& format, std::int64_t rows, std::int64_t cols) {
  check_quant_shape(format, rows, cols);
  RONDO_ASSERT(format.type == QuantType::kMXFP4);
  Mxfp4Layout l;
  l.experts = format.experts;
  l.c = rows / format.experts;
  l.r = cols;
  const auto groups = static_cast<std::uint64_t>(rows / 32 * cols);
  l.scales = groups * 16;
  l.bytes = groups * 17;
  return l;
}

Int8Layout int8_layout(std::int64_t rows, std::int64_t cols) {
  check_quant_shape({.type = QuantType::kInt8}, rows, cols);
  Int8Layout l;
  l.scales = align16(static_cast<std::uint64_t>(rows * cols));
  l.bytes = l.scales + 4 * static_cast<std::uint64_t>(rows);
  return l;
}

std::uint64_t quant_bytes(const QuantFormat& format, std::int64_t rows, std::int64_t cols) {
  check_quant_shape(format, rows, cols);
  if (is_gguf(format.type)) {
    const GgufGeometry g = gguf_geometry(format.type);
    return static_cast<std::uint64_t>(rows) * static_cast<std::uint64_t>(cols / g.elements) *
           static_cast<std::uint64_t>(g.bytes);
  }
  if (format.type == QuantType::kNF4) return nf4_layout(format, rows, cols).bytes;
  if (format.type == QuantType::kMXFP4) return mxfp4_layout(format, rows, cols).bytes;
  return int8_layout(rows, cols).bytes;
}

void check_dequantize(const QuantFormat& format, std::int64_t rows, std::int64_t cols,
                      FloatDType out, const void* dst) {
  check_quant_shape(format, rows, cols);
  if (reinterpret_cast<std::uintptr_t>(dst) % dtype_size(out) != 0)
    throw Error("dequantising a " + to_string(format) + " tensor of shape " +
                shape_text(rows, cols) + ": the destination is not aligned to " +
                std::to_string(dtype_size(out)) + " bytes, the size of a " + to_string(out) +
                " element");
}

void dequantize(const QuantFormat& format, const void* src, std::int64_t rows, std::int64_t cols,
                FloatDType out, void* dst) {
  check_quant_shape(format, rows, cols);
  const auto* blob = static_cast<const std::uint8_t*>(src);
  const std::int64_t n = rows * cols;
  const Nf4Layout nf4 =
      format.type == QuantType::kNF4 ? nf4_layout(format, rows, cols) : Nf4Layout{};
  const Int8Layout int8 = format.type == QuantType::kInt8 ? int8_layout(rows, cols) : Int8Layout{};
  const Mxfp4Layout mxfp4 =
      format.type == QuantType::kMXFP4 ? mxfp4_layout(format, rows, cols) : Mxfp4Layout{};
  auto decode = [&](std::int64_t begin, std::int64_t end, float* y) {
    if (format.type == QuantType::kNF4)
      decode_nf4(format, nf4, blob, begin, end, y);
    else if (format.type == QuantType::kMXFP4)
      decode_mxfp4(mxfp4, blob, begin, end, y);
    else if (format.type == QuantType::kInt8)
      decode_int8(int8, cols, blob, begin, end, y);
    else
      decode_gguf(format.type, blob, begin, end, y);
  };
  auto body = [&](std::size_t first, std::size_t last) {
    alignas(64) float buffer[kChunk];
    for (std::size_t c = first; c < last; ++c) {
      const std::int64_t begin = static_cast<std::int64_t>(c) * kChunk;
      const std::int64_t end = std::min(n, begin + kChunk);
      if (out == FloatDType::kF32) {
        decode(begin, end, static_cast<float*>(dst) + begin);
      } else {
        decode(begin, end, buffer);
        store_rounded(buffer, end - begin, out, static_cast<std::uint16_t*>(dst) + begin);
      }
    }
  };
  const auto chunks = static_cast<std::size_t>((n + kChunk - 1) / kChunk);
  if (chunks < kInlineChunks)
    body(0, chunks);
  else
    detail::parallel_for_tiles(chunks, body);
}

}  // namespace rondo::kernels
