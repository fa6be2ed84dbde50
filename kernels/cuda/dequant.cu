// CUDA kernels of Stream::dequantize: every format of kernels/quant.h into F32, BF16 or F16, equal
// to the CPU's kernels::dequantize bit for bit. Both take their arithmetic from quant_blocks.h, and
// this file is compiled with --fmad=false (Note [No FMA in dequantisation] in cpu/quant.cpp), so
// every product is rounded before the add that follows it, as on the CPU.
//
// One thread per output element, grid-stride: the kernels are bound by memory traffic, and an
// element-wise decode keeps writes coalesced (a block's scale bytes are read by many threads and
// served from cache). INT8 walks rows in the y dimension so that no thread divides by cols.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/dequant.h"
#include "kernels/quant_blocks.h"

namespace rondo::kernels {
namespace {

__constant__ float kNf4CodeDevice[16] = RONDO_NF4_CODE;
__constant__ float kDynamicMapDevice[256] = RONDO_DYNAMIC_MAP_CODE;
__constant__ float kFp4Device[16] = RONDO_FP4_CODE;
__constant__ float kMxfp4GgufDevice[16] = RONDO_MXFP4_GGUF_CODE;

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 1 << 15;  // grid-stride beyond 8 Mi threads

template <FloatDType Out>
__device__ __forceinline__ void store(void* dst, std::int64_t i, float v) {
  if constexpr (Out == FloatDType::kF32) {
    static_cast<float*>(dst)[i] = v;
  } else if constexpr (Out == FloatDType::kBF16) {
    static_cast<std::uint16_t*>(dst)[i] = quant::bf16_of_f32(v);
  } else {
    // Round to nearest even, like F16C on the CPU.
    static_cast<std::uint16_t*>(dst)[i] = __half_as_ushort(__float2half_rn(v));
  }
}

template <QuantType T>
__device__ __forceinline__ float gguf_value(const std::uint8_t* src, std::int64_t i) {
  if constexpr (T == QuantType::kQ8_0) {
    const std::uint8_t* b = src + (i / quant::kQK) * quant::kQ8_0Bytes;
    const int j = static_cast<int>(i % quant::kQK);
    return quant::q8_0_apply(quant::q8_0_scale(b), quant::q8_0_quant(b, j));
  } else if constexpr (T == QuantType::kQ4_0) {
    const std::uint8_t* b = src + (i / quant::kQK) * quant::kQ4_0Bytes;
    const int j = static_cast<int>(i % quant::kQK);
    return quant::q4_0_apply(quant::q4_0_scale(b), quant::q4_0_quant(b, j));
  } else if constexpr (T == QuantType::kQ4_1) {
    const std::uint8_t* b = src + (i / quant::kQK) * quant::kQ4_1Bytes;
    const int j = static_cast<int>(i % quant::kQK);
    return quant::q4_1_apply(quant::q4_1_scale(b), quant::q4_1_min(b), quant::q4_1_quant(b, j));
  } else if constexpr (T == QuantType::kQ4_K) {
    const std::uint8_t* b = src + (i / quant::kQKK) * quant::kQ4_KBytes;
    const int j = static_cast<int>(i % quant::kQKK);
    float d_sub, m_sub;
    quant::q4_k_sub(b, j / 32, &d_sub, &m_sub);
    return quant::q4_k_apply(d_sub, m_sub, quant::q4_k_quant(b, j));
  } else if constexpr (T == QuantType::kGgufMXFP4) {
    const std::uint8_t* b = src + (i / quant::kQK) * quant::kMxfp4GgufBytes;
    const int j = static_cast<int>(i % quant::kQK);
    return quant::mxfp4_gguf_apply(kMxfp4GgufDevice, quant::mxfp4_gguf_scale(b),
                                   quant::mxfp4_gguf_quant(b, j));
  } else {
    static_assert(T == QuantType::kQ6_K, "a GGUF type");
    const std::uint8_t* b = src + (i / quant::kQKK) * quant::kQ6_KBytes;
    const int j = static_cast<int>(i % quant::kQKK);
    return quant::q6_k_apply(quant::q6_k_sub(b, quant::q6_k_sub_of(j)), quant::q6_k_quant(b, j));
  }
}

template <QuantType T, FloatDType Out>
__global__ void dequantize_gguf(const std::uint8_t* src, std::int64_t n, void* dst) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store<Out>(dst, i, gguf_value<T>(src, i));
}

// `block_shift`: log2 of the NF4 block size (a power of two).
template <bool Double, FloatDType Out>
__global__ void dequantize_nf4(const std::uint8_t* src, Nf4Layout layout, int block_shift,
                               void* dst) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const float offset = Double ? quant::load_f32(src + layout.offset) : 0.0f;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < layout.n; i += stride) {
    const std::int64_t block = i >> block_shift;
    const float absmax = Double
                             ? quant::nf4_absmax_double(src + layout.absmax, src + layout.absmax2,
                                                        offset, kDynamicMapDevice, block)
                             : quant::nf4_absmax_plain(src + layout.absmax, block);
    store<Out>(dst, i,
               quant::nf4_apply(kNf4CodeDevice, quant::nf4_quant(src + layout.codes, i), absmax));
  }
}

template <FloatDType Out>
__global__ void dequantize_int8(const std::uint8_t* src, std::uint64_t scales, std::int64_t rows,
                                std::int64_t cols, void* dst) {
  const auto* q = reinterpret_cast<const std::int8_t*>(src);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float scale = quant::load_f32(src + scales + 4 * r);
    for (std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
         c < cols; c += stride)
      store<Out>(dst, r * cols + c, quant::int8_apply(q[r * cols + c], scale));
  }
}

template <FloatDType Out>
__global__ void dequantize_mxfp4(const std::uint8_t* src, Mxfp4Layout layout, std::int64_t n,
                                 void* dst) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    store<Out>(dst, i, quant::mxfp4_value(kFp4Device, src, layout.scales, layout.c, layout.r, i));
}

unsigned grid_for(std::int64_t n) {
  return static_cast<unsigned>(std::min(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

template <FloatDType Out>
void launch(const QuantFormat& format, const std::uint8_t* src, std::int64_t rows,
            std::int64_t cols, void* dst, cudaStream_t stream) {
  const std::int64_t n = rows * cols;
  switch (format.type) {
    case QuantType::kQ8_0:
      dequantize_gguf<QuantType::kQ8_0, Out><<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kQ4_0:
      dequantize_gguf<QuantType::kQ4_0, Out><<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kQ4_1:
      dequantize_gguf<QuantType::kQ4_1, Out><<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kQ4_K:
      dequantize_gguf<QuantType::kQ4_K, Out><<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kQ6_K:
      dequantize_gguf<QuantType::kQ6_K, Out><<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kNF4: {
      const Nf4Layout layout = nf4_layout(format, rows, cols);
      int shift = 0;
      while ((1 << shift) < format.block)
        ++shift;
      if (format.double_quant)
        dequantize_nf4<true, Out><<<grid_for(n), kThreads, 0, stream>>>(src, layout, shift, dst);
      else
        dequantize_nf4<false, Out><<<grid_for(n), kThreads, 0, stream>>>(src, layout, shift, dst);
      return;
    }
    case QuantType::kInt8: {
      const dim3 grid(static_cast<unsigned>(
                          std::min<std::int64_t>((cols + kThreads - 1) / kThreads, kMaxBlocks)),
                      static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)));
      dequantize_int8<Out>
          <<<grid, kThreads, 0, stream>>>(src, int8_layout(rows, cols).scales, rows, cols, dst);
      return;
    }
    case QuantType::kGgufMXFP4:
      dequantize_gguf<QuantType::kGgufMXFP4, Out>
          <<<grid_for(n), kThreads, 0, stream>>>(src, n, dst);
      return;
    case QuantType::kMXFP4:
      dequantize_mxfp4<Out>
          <<<grid_for(n), kThreads, 0, stream>>>(src, mxfp4_layout(format, rows, cols), n, dst);
      return;
    case QuantType::kNone:
      break;
  }
}

}  // namespace

cudaError_t launch_dequantize(const QuantFormat& format, const void* src, std::int64_t rows,
                              std::int64_t cols, FloatDType out, void* dst, cudaStream_t stream) {
  const auto* blob = static_cast<const std::uint8_t*>(src);
  switch (out) {
    case FloatDType::kF32:
      launch<FloatDType::kF32>(format, blob, rows, cols, dst, stream);
      break;
    case FloatDType::kBF16:
      launch<FloatDType::kBF16>(format, blob, rows, cols, dst, stream);
      break;
    case FloatDType::kF16:
      launch<FloatDType::kF16>(format, blob, rows, cols, dst, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace rondo::kernels
