// bitsandbytes' two 8-bit dynamic maps, computed as its Python computes them, and the lookup table
// of its CPU quantiser (dynamic_map.h). Compiled with -ffp-contract=off: the fused multiply-adds
// below are the ones torch's linspace performs, written out.
//
// Note [bitsandbytes' 8-bit quantiser]
// bitsandbytes 0.50.x quantises blockwise on the CPU in its C++ library (csrc/cpu_ops.cpp,
// quantize_cpu_impl; the Python side is backends/cpu/ops.py, quantize_blockwise), per block of
// `blocksize` values, in float32:
//  - absmax = max |x| over the block (std::max, so a NaN element is skipped); stored as is.
//  - absmax == 0: every code of the block is 0 (and the block reads back as code[0] * 0).
//  - Otherwise each x is scaled by the reciprocal, x * (1 / absmax), clamped to [-1, 1], and its
//    bin is (int)((v + 1) * 0.5 * 65535 + 0.5), which the x86-64 wheel computes as
//    fma((v + 1) * 0.5, 65535, 0.5) (GCC contracted it; visible in the machine code), truncated.
//  - The code is table[bin], where table[i] is the number of midpoints 0.5 * (code[k] + code[k+1])
//    strictly below the grid point -1 + 2i / 65535 (build_quantize_lut): the code nearest to the
//    grid point the value rounds to, not always the one nearest to the value. Grid points are
//    3.05e-5 apart, so a value within 1.5e-5 of a midpoint can take the neighbouring code, and
//    every |v| < 1.5e-5 lands on the grid point +-1.5e-5 (0 itself on +1.5e-5): codes finer than
//    that near zero are never used (bitsandbytes' CUDA quantiser, a search for the nearest code,
//    does use them). We reproduce the CPU's table: its states must equal ours bit for bit.
// Dequantisation is code[c] * absmax, one f32 multiply (dequantizeBlockwise8bitCpu).
// tests/oracle/test_adamw.py checks the maps and the codes against bitsandbytes itself.
#include "kernels/cpu/dynamic_map.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace rondo::kernels {
namespace {

// torch.linspace(start, end, steps, dtype=torch.float32) on the CPU: the step in f32, the first
// half counted up from start and the second half down from end, each value one fused multiply-add
// (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp; checked against torch 2.15 for every size
// the maps use).
std::vector<float> linspace_f32(float start, float end, int steps) {
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int halfway = steps / 2;
  std::vector<float> out(static_cast<std::size_t>(steps));
  for (int i = 0; i < steps; ++i)
    out[static_cast<std::size_t>(i)] =
        i < halfway ? std::fma(step, static_cast<float>(i), start)
                    : std::fma(-step, static_cast<float>(steps - 1 - i), end);
  return out;
}

// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) in bitsandbytes/functional.py:
// for each decade 10^(i-6), i = 0..6, the midpoints of a float32 linspace(0.1, 1) of 2^i + 1
// points (signed) or 2^(i+1) + 1 points (unsigned), multiplied in float32 by float(10^(i-6)),
// with their negatives when signed; then 0 and 1.0; sorted. 254 + 2 = 256 values either way.
std::vector<float> dynamic_codes(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    const std::vector<float> bounds = linspace_f32(0.1f, 1.0f, items);
    const float scale = static_cast<float>(std::pow(10.0, i - 6));  // Python's 10 ** (i - 6)
    for (int k = 0; k + 1 < items; ++k) {
      const float mean =
          (bounds[static_cast<std::size_t>(k)] + bounds[static_cast<std::size_t>(k) + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return data;
}

DynamicMap make_map(bool is_signed) {
  const std::vector<float> codes = dynamic_codes(is_signed);
  float table[DynamicMap::kCodes];
  std::copy(codes.begin(), codes.end(), table);
  return DynamicMap(table);
}

}  // namespace

DynamicMap::DynamicMap(const float (&codes)[kCodes]) {
  std::copy(codes, codes + kCodes, code);
  float mid[kCodes - 1];
  for (int k = 0; k + 1 < kCodes; ++k)
    mid[k] = 0.5f * (code[k] + code[k + 1]);
  int k = 0;
  for (int i = 0; i < kBins; ++i) {
    const float left = -1.0f + (2.0f * static_cast<float>(i)) / 65535.0f;
    while (k < kCodes - 1 && mid[k] < left)
      ++k;
    bin_code[i] = static_cast<std::uint8_t>(k);
  }
  std::fill(bin_code + kBins, bin_code + kBins + 3, std::uint8_t{0});
}

const DynamicMap& dynamic_map_signed() {
  static const DynamicMap map = make_map(true);
  return map;
}

const DynamicMap& dynamic_map_unsigned() {
  static const DynamicMap map = make_map(false);
  return map;
}

}  // namespace rondo::kernels
