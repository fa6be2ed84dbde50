// The fused CPU AdamW step with 8-bit moments, bitsandbytes' AdamW8bit on the CPU bit for bit: one
// pass over a parameter tensor dequantises m and v from blockwise 8-bit codes, reads the
// low-precision gradient, updates the f32 master weights, requantises m and v, and writes the
// streaming copy the devices upload. 2 bytes of moments per parameter plus 8 bytes per block of
// 256, against 8 bytes for adamw_step's f32 moments. Used by the engine's optimizer driver.
// Invariants: the SIMD paths give the scalar path's bits; the result depends neither on the
// number of threads nor on how a tensor is cut into block-aligned ranges (see AdamW8bitTensor).
//
//   // A fresh tensor: codes and absmax all zero (m = v = 0), as bitsandbytes initialises them.
//   std::vector<std::uint8_t> m_codes(n), v_codes(n);
//   const std::size_t blocks = kernels::adamw8bit_blocks(n);
//   std::vector<float> m_absmax(blocks), v_absmax(blocks);
//   kernels::adamw8bit_step({.n = n, .grad = grad_bf16, .grad_dtype = kernels::FloatDType::kBF16,
//                            .master = master, .m_codes = m_codes.data(),
//                            .m_absmax = m_absmax.data(), .v_codes = v_codes.data(),
//                            .v_absmax = v_absmax.data(), .stream = weights_bf16},
//                           {.lr = 2e-5, .weight_decay = 0.1, .step = step});
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/simd.h"

namespace rondo::kernels {

// Elements per absmax block of both moments: bitsandbytes' fixed blocksize for its blockwise 8-bit
// optimizers. Block b covers elements [256 b, 256 b + 256) of the tensor.
inline constexpr std::size_t kAdamW8bitBlock = 256;

// Blocks (absmax entries per moment) of a tensor of n elements: ceil(n / 256).
constexpr std::size_t adamw8bit_blocks(std::size_t n) {
  return (n + kAdamW8bitBlock - 1) / kAdamW8bitBlock;
}

// One parameter tensor, or one range of it. All arrays are host memory owned by the caller; none
// may overlap another. Moment state, as bitsandbytes names it:
//   m = dynamic_map_signed().code[m_codes[i]] * m_absmax[i / 256]     (state1, qmap1, absmax1)
//   v = dynamic_map_unsigned().code[v_codes[i]] * v_absmax[i / 256]   (state2, qmap2, absmax2)
// (maps in dynamic_map.h). All-zero codes and absmax are the fresh state m = v = 0.
//
// Ranges: elements [b, e) of a tensor of N elements may be stepped as a tensor of their own
// (every pointer advanced to element b, the absmax pointers to block b / 256) when b is a
// multiple of 256 and e is a multiple of 256 or N; the bits are then those of the whole-tensor
// step, so state can be streamed in chunks of any multiple of 256 elements.
struct AdamW8bitTensor {
  std::size_t n = 0;                         // elements of grad, master, codes and stream
  const void* grad = nullptr;                // (n) grad_dtype, read only
  FloatDType grad_dtype = FloatDType::kF32;  // as the device wrote it
  float* master = nullptr;                   // (n) f32 master weights, updated in place
  std::uint8_t* m_codes = nullptr;           // (n) u8 first-moment codes, updated in place
  float* m_absmax = nullptr;                 // (adamw8bit_blocks(n)) f32, updated in place
  std::uint8_t* v_codes = nullptr;           // (n) u8 second-moment codes, updated in place
  float* v_absmax = nullptr;                 // (adamw8bit_blocks(n)) f32, updated in place
  void* stream = nullptr;                    // (n) stream_dtype, written: the updated master
                                             // rounded for the devices; null = none
  FloatDType stream_dtype = FloatDType::kBF16;
};

// One step of bitsandbytes' AdamW8bit (optimizer "adam" with weight decay, blockwise, on the
// CPU), in its order of f32 operations (Note [bitsandbytes' AdamW8bit on the CPU] in
// adamw8bit.cpp):
//   m = code1[m_codes] * m_absmax,  v = code2[v_codes] * v_absmax      (dequantise)
//   g = float(grad) * float(grad_scale)
//   m = fma(float(1 - β1), g, m * float(β1))
//   v = fma(float(1 - β2) * g, g, v * float(β2))
//   p = p * float(1 - lr*wd)
//   p = p + float(-lr / (1 - β1^t)) * m / (sqrt(v) / float(sqrt(1 - β2^t)) + float(eps))
//   stream = round(p)
//   per block of 256: m_absmax = max |m|, m_codes = the codes of m / m_absmax; v likewise
// params are adamw_step's and validated the same way. The moments of the update are the f32
// values before requantisation, as in bitsandbytes. A NaN moment (from a NaN gradient) is left out
// of its block's absmax and stored as code 0, as bitsandbytes does: the state silently loses it,
// the master does not. Check the gradient norm first (grad_sum_squares) and skip such steps.
// Large tensors are cut into tiles of whole blocks spread over oneTBB threads (in the caller's
// task arena); small ones run on the caller's thread. Throws rondo::Error for invalid
// hyper-parameters, null arrays or a path the CPU lacks.
void adamw8bit_step(const AdamW8bitTensor& tensor, const AdamWParams& params,
                    SimdPath path = SimdPath::kAuto);

// The moments as f32 values, and back: for converting f32 AdamW state (a checkpoint of
// adamw_step's m and v) to 8-bit and for reading 8-bit state. quantize is bitsandbytes'
// quantize_blockwise with blocksize 256 (the 8-bit state adamw8bit_step would write for those
// values); dequantize is its dequantize_blockwise. Same range rules as AdamW8bitTensor.
enum class Moment {
  kFirst,   // m: the signed map
  kSecond,  // v: the unsigned map (values must be >= 0)
};
void quantize_moment(Moment moment, const float* values, std::size_t n, std::uint8_t* codes,
                     float* absmax);
void dequantize_moment(Moment moment, const std::uint8_t* codes, const float* absmax, std::size_t n,
                       float* values);

}  // namespace rondo::kernels
