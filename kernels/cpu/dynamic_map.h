// bitsandbytes' 8-bit dynamic quantisation maps (create_dynamic_map) and the blockwise quantiser
// its CPU library runs (csrc/cpu_ops.cpp, quantize_cpu_impl), bit for bit: the moments of the 8-bit
// AdamW (adamw8bit.h) and the double-quantised NF4 absmax (quantize.cpp). Invariant: a code is what
// the 65536-entry table gives, not always the nearest map value (Note [bitsandbytes' 8-bit
// quantiser]). Baseline code only: never include this from a per-ISA translation unit (simd.h).
//
//   const kernels::DynamicMap& map = kernels::dynamic_map_signed();
//   float absmax = kernels::quantize_dynamic_block(x, 256, map.bin_code, codes);  // 256 codes
//   float back = map.code[codes[0]] * absmax;  // what bitsandbytes reads back
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace rondo::kernels {

// One 8-bit map with the lookup table its quantiser uses.
struct DynamicMap {
  static constexpr int kCodes = 256;
  static constexpr int kBins = 65536;
  float code[kCodes];  // (256) f32, sorted ascending: code k means the value code[k] * absmax
  // (65536 + 3) the code of each bin of [-1, 1] (Note [bitsandbytes' 8-bit quantiser]); 3 bytes of
  // padding so that a SIMD path may read 4 bytes at any bin with one 32-bit gather.
  std::uint8_t bin_code[kBins + 3];

  // Builds the table from 256 sorted codes, as build_quantize_lut does.
  explicit DynamicMap(const float (&codes)[kCodes]);
};

// create_dynamic_map(signed=True): 7 decades of 1e-6..1 with 2^i + 1 linear steps each, both signs,
// 0 and 1.0. bitsandbytes' 8-bit optimizers quantise the first moment (state1) with it. Its
// smallest code is -0.99297, not -1: the map is not symmetric.
const DynamicMap& dynamic_map_signed();
// create_dynamic_map(signed=False): positive values only (2^(i+1) + 1 steps per decade), 0 and 1.0;
// the second moment (state2).
const DynamicMap& dynamic_map_unsigned();

// The bin of a value already scaled by 1 / absmax: clamped to [-1, 1] (a NaN counts as -1, which
// is where bitsandbytes' truncating conversion of a NaN lands too), then
// (int)fma((v + 1) * 0.5, 65535, 0.5). Compiled without contraction: the one fma is written out.
inline int dynamic_bin(float scaled) {
  float v = scaled > -1.0f ? scaled : -1.0f;
  v = v < 1.0f ? v : 1.0f;
  const float t = (v + 1.0f) * 0.5f;
  return static_cast<int>(std::fma(t, 65535.0f, 0.5f));
}

// max |x| over a block, ignoring NaN as bitsandbytes' std::max reduction does.
inline float dynamic_absmax(const float* x, std::size_t len) {
  float amax = 0.0f;
  for (std::size_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    amax = amax < a ? a : amax;
  }
  return amax;
}

// Quantises one block of `len` values (bitsandbytes' optimizers use blocks of 256) into codes
// through a map's bin_code table and returns the block's absmax, to be stored beside them. An
// all-zero block gets absmax 0 and code 0.
inline float quantize_dynamic_block(const float* x, std::size_t len, const std::uint8_t* bin_code,
                                    std::uint8_t* codes) {
  const float amax = dynamic_absmax(x, len);
  if (amax == 0.0f) {
    for (std::size_t i = 0; i < len; ++i)
      codes[i] = 0;
    return amax;
  }
  const float inv = 1.0f / amax;
  for (std::size_t i = 0; i < len; ++i)
    codes[i] = bin_code[dynamic_bin(x[i] * inv)];
  return amax;
}

}  // namespace rondo::kernels
