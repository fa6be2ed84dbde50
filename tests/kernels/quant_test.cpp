// Quantised formats (kernels/quant.h) against references written here, torch-free (this binary
// also runs under ThreadSanitizer):
//  - layouts and sizes as docs/quantisation.md states them; shape errors;
//  - dequantize() to F32, BF16 and F16 equals a scalar decoder written here from the documented
//    layouts, which computes each value exactly in float64, rounds it to float32 where the format
//    defines a float32 result, then to BF16/F16 by its own nearest-by-distance rule;
//  - every quantiser round-trips within its format's bound, element by element, against the
//    float64 input; and keeps its RMS error under the figure docs/quantisation.md states;
//  - SimDevice's Stream::dequantize gives what the CPU function gives, in stream order.
// Bit-equality with bitsandbytes and gguf-py is tests/oracle/test_quant.py; the CUDA kernels are
// tests/kernels/quant_cuda_test.cpp.
//
// Inputs are fresh random numbers each run; the seed is printed and RONDO_TEST_SEED=<n> repeats it.
#include "kernels/quant.h"

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../support/test_seed.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/error.h"
#include "quant_formats.h"

namespace rondo::kernels {
namespace {

// --- Seeds -----------------------------------------------------------------------------------

using rondo::test::rng_for_test;
using rondo::test::test_seed;

// --- The test's own number formats ---------------------------------------------------------------

float float_of(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

double f16_value(std::uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  double mag;
  if (exponent == 0x1F)
    mag = mantissa ? std::numeric_limits<double>::quiet_NaN()
                   : std::numeric_limits<double>::infinity();
  else if (exponent == 0)
    mag = std::ldexp(mantissa, -24);
  else
    mag = std::ldexp(1024 + mantissa, exponent - 25);
  return (h & 0x8000) ? -mag : mag;
}

double bf16_value(std::uint16_t b) {
  return float_of(std::uint32_t{b} << 16);
}

// The f16 or bf16 pattern nearest to a finite float, ties to the even pattern, found by bisection
// over the ordered positive patterns (independent of any bit trick).
std::uint16_t nearest_half(float x, bool bf16) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double mag = std::fabs(static_cast<double>(x));
  const std::uint16_t top = bf16 ? 0x7F80 : 0x7C00;  // +infinity, above every finite pattern
  auto value = [&](std::uint16_t p) { return bf16 ? bf16_value(p) : f16_value(p); };
  std::uint16_t lo = 0, hi = top;  // value(lo) <= mag < value(hi)
  if (mag >= value(top - 1)) {
    lo = top - 1;
  } else {
    while (hi - lo > 1) {
      const auto mid = static_cast<std::uint16_t>((lo + hi) / 2);
      (value(mid) <= mag ? lo : hi) = mid;
    }
  }
  // Past the largest finite value the next one would be 2^16 (f16) or 2^128 (bf16).
  const double vhi = lo + 1 == top ? (bf16 ? std::ldexp(1.0, 128) : 65536.0) : value(lo + 1);
  const double below = mag - value(lo), above = vhi - mag;
  const std::uint16_t pick = below < above || (below == above && lo % 2 == 0) ? lo : lo + 1;
  return static_cast<std::uint16_t>(sign | pick);
}

// --- Random weights ------------------------------------------------------------------------------

// (rows, cols) values like a layer's weights: normal, a scale per row, a few outliers, some exact
// zeros; or with `plain`, independent N(0, 1) values (what error figures are quoted for). Stored
// in `dtype`; `values` receives what was stored, exactly.
std::vector<std::uint8_t> random_weights(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols,
                                         FloatDType dtype, std::vector<double>* values,
                                         bool plain = false) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const auto n = static_cast<std::size_t>(rows * cols);
  std::vector<std::uint8_t> bytes(n * dtype_size(dtype));
  values->resize(n);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double scale = plain ? 1.0 : 0.02 * std::pow(10.0, 2 * uniform(rng) - 1);
    for (std::int64_t c = 0; c < cols; ++c) {
      const auto i = static_cast<std::size_t>(r * cols + c);
      const double u = uniform(rng);
      const double x = plain      ? normal(rng)
                       : u < 0.01 ? 0.0
                                  : normal(rng) * scale * (u > 0.995 ? 20.0 : 1.0);
      const float f = static_cast<float>(x);
      if (dtype == FloatDType::kF32) {
        std::memcpy(&bytes[4 * i], &f, 4);
        (*values)[i] = f;
      } else {
        const std::uint16_t h = nearest_half(f, dtype == FloatDType::kBF16);
        std::memcpy(&bytes[2 * i], &h, 2);
        (*values)[i] = dtype == FloatDType::kBF16 ? bf16_value(h) : f16_value(h);
      }
    }
  }
  return bytes;
}

// --- The reference decoder: the documented layouts, each value exact in float64 then rounded to
// float32 where the format defines a float32 result --------------------------------------------

std::uint16_t u16_at(const std::vector<std::uint8_t>& blob, std::uint64_t at) {
  return static_cast<std::uint16_t>(blob[at] | (blob[at + 1] << 8));
}
float f32_at(const std::vector<std::uint8_t>& blob, std::uint64_t at) {
  std::uint32_t bits = 0;
  for (int k = 3; k >= 0; --k)
    bits = (bits << 8) | blob[at + k];
  return float_of(bits);
}

const double kNf4[16] = {-1.0,
                         -0.6961928009986877,
                         -0.5250730514526367,
                         -0.39491748809814453,
                         -0.28444138169288635,
                         -0.18477343022823334,
                         -0.09105003625154495,
                         0.0,
                         0.07958029955625534,
                         0.16093020141124725,
                         0.24611230194568634,
                         0.33791524171829224,
                         0.44070982933044434,
                         0.5626170039176941,
                         0.7229568362236023,
                         1.0};

// bitsandbytes' create_dynamic_map(signed=True) as it prints it (9 significant digits give each
// float32 back exactly). Rebuilding it from its definition is not exact: torch.linspace rounds
// differently in its vectorised and scalar parts. tests/oracle/test_quant.py checks the kernels'
// own copy against bitsandbytes itself.
const std::vector<float>& dynamic_map() {
  static const std::vector<float> map = {
      -0.992968738,    -0.978906274,    -0.96484375,     -0.950781226,
      -0.936718762,    -0.922656238,    -0.908593774,    -0.89453125,
      -0.880468726,    -0.866406262,    -0.852343738,    -0.838281274,
      -0.82421875,     -0.810156226,    -0.796093762,    -0.782031238,
      -0.767968774,    -0.75390625,     -0.739843726,    -0.725781262,
      -0.711718798,    -0.697656274,    -0.68359375,     -0.669531226,
      -0.655468762,    -0.641406298,    -0.627343774,    -0.61328125,
      -0.599218726,    -0.585156262,    -0.571093798,    -0.557031274,
      -0.54296875,     -0.528906226,    -0.514843702,    -0.500781238,
      -0.486718714,    -0.47265625,     -0.458593726,    -0.444531262,
      -0.430468738,    -0.416406244,    -0.40234375,     -0.388281226,
      -0.374218762,    -0.360156238,    -0.346093744,    -0.33203125,
      -0.317968726,    -0.303906262,    -0.289843738,    -0.275781274,
      -0.26171875,     -0.247656241,    -0.233593747,    -0.219531253,
      -0.205468744,    -0.19140625,     -0.177343756,    -0.163281247,
      -0.149218753,    -0.135156244,    -0.12109375,     -0.107031256,
      -0.0985937491,   -0.0957812592,   -0.0929687545,   -0.0901562497,
      -0.0873437524,   -0.0845312476,   -0.0817187577,   -0.078906253,
      -0.0760937482,   -0.0732812509,   -0.0704687461,   -0.0676562563,
      -0.0648437515,   -0.0620312504,   -0.0592187531,   -0.0564062484,
      -0.053593751,    -0.05078125,     -0.047968749,    -0.0451562516,
      -0.0423437469,   -0.0395312496,   -0.0367187522,   -0.0339062512,
      -0.0310937501,   -0.028281251,    -0.0254687499,   -0.0226562507,
      -0.0198437516,   -0.0170312505,   -0.0142187504,   -0.0114062503,
      -0.00971874967,  -0.00915624946,  -0.00859375019,  -0.00803124998,
      -0.00746874977,  -0.00690625003,  -0.00634374982,  -0.00578125007,
      -0.00521875033,  -0.00465624966,  -0.00409374991,  -0.00353124971,
      -0.00296874996,  -0.00240624999,  -0.00184375001,  -0.00128124992,
      -0.000943750085, -0.000831249985, -0.00071875006,  -0.000606250076,
      -0.000493750034, -0.000381250022, -0.000268750038, -0.000156250011,
      -8.87499991e-05, -6.62500024e-05, -4.37499984e-05, -2.12499981e-05,
      -7.7499999e-06,  -3.25000019e-06, -5.50000038e-07, 0,
      5.50000038e-07,  3.25000019e-06,  7.7499999e-06,   2.12499981e-05,
      4.37499984e-05,  6.62500024e-05,  8.87499991e-05,  0.000156250011,
      0.000268750038,  0.000381250022,  0.000493750034,  0.000606250076,
      0.00071875006,   0.000831249985,  0.000943750085,  0.00128124992,
      0.00184375001,   0.00240624999,   0.00296874996,   0.00353124971,
      0.00409374991,   0.00465624966,   0.00521875033,   0.00578125007,
      0.00634374982,   0.00690625003,   0.00746874977,   0.00803124998,
      0.00859375019,   0.00915624946,   0.00971874967,   0.0114062503,
      0.0142187504,    0.0170312505,    0.0198437516,    0.0226562507,
      0.0254687499,    0.028281251,     0.0310937501,    0.0339062512,
      0.0367187522,    0.0395312496,    0.0423437469,    0.0451562516,
      0.047968749,     0.05078125,      0.053593751,     0.0564062484,
      0.0592187531,    0.0620312504,    0.0648437515,    0.0676562563,
      0.0704687461,    0.0732812509,    0.0760937482,    0.078906253,
      0.0817187577,    0.0845312476,    0.0873437524,    0.0901562497,
      0.0929687545,    0.0957812592,    0.0985937491,    0.107031256,
      0.12109375,      0.135156244,     0.149218753,     0.163281247,
      0.177343756,     0.19140625,      0.205468744,     0.219531253,
      0.233593747,     0.247656241,     0.26171875,      0.275781274,
      0.289843738,     0.303906262,     0.317968726,     0.33203125,
      0.346093744,     0.360156238,     0.374218762,     0.388281226,
      0.40234375,      0.416406244,     0.430468738,     0.444531262,
      0.458593726,     0.47265625,      0.486718714,     0.500781238,
      0.514843702,     0.528906226,     0.54296875,      0.557031274,
      0.571093798,     0.585156262,     0.599218726,     0.61328125,
      0.627343774,     0.641406298,     0.655468762,     0.669531226,
      0.68359375,      0.697656274,     0.711718798,     0.725781262,
      0.739843726,     0.75390625,      0.767968774,     0.782031238,
      0.796093762,     0.810156226,     0.82421875,      0.838281274,
      0.852343738,     0.866406262,     0.880468726,     0.89453125,
      0.908593774,     0.922656238,     0.936718762,     0.950781226,
      0.96484375,      0.978906274,     0.992968738,     1};
  return map;
}

std::uint64_t align16(std::uint64_t x) {
  return (x + 15) / 16 * 16;
}

// The absmax an NF4 blob stores for block b: plain, or code2 * absmax2 rounded to float32, plus
// the offset rounded to float32 (the format defines both as float32 operations).
float reference_absmax(const QuantFormat& f, const std::vector<std::uint8_t>& blob, std::int64_t n,
                       std::int64_t b) {
  const std::int64_t blocks = (n + f.block - 1) / f.block;
  const std::uint64_t absmax_at = align16(static_cast<std::uint64_t>((n + 1) / 2));
  if (!f.double_quant) return f32_at(blob, absmax_at + 4 * b);
  const std::uint64_t absmax2_at = align16(absmax_at + blocks);
  const std::uint64_t offset_at = align16(absmax2_at + 4 * ((blocks + 255) / 256));
  const float scaled = static_cast<float>(static_cast<double>(dynamic_map()[blob[absmax_at + b]]) *
                                          f32_at(blob, absmax2_at + 4 * (b / 256)));
  return static_cast<float>(static_cast<double>(scaled) + f32_at(blob, offset_at));
}

// The exact float32 results of a blob, one per element.
std::vector<float> reference_decode(const QuantFormat& f, const std::vector<std::uint8_t>& blob,
                                    std::int64_t rows, std::int64_t cols) {
  const std::int64_t n = rows * cols;
  std::vector<float> y(static_cast<std::size_t>(n));
  switch (f.type) {
    case QuantType::kQ8_0:
      for (std::int64_t b = 0; b < n / 32; ++b) {
        const double d = f16_value(u16_at(blob, 34 * b));
        for (int j = 0; j < 32; ++j)
          y[32 * b + j] = static_cast<float>(static_cast<std::int8_t>(blob[34 * b + 2 + j]) * d);
      }
      break;
    case QuantType::kQ4_0:
      for (std::int64_t b = 0; b < n / 32; ++b) {
        const double d = f16_value(u16_at(blob, 18 * b));
        for (int j = 0; j < 16; ++j) {
          const std::uint8_t byte = blob[18 * b + 2 + j];
          y[32 * b + j] = static_cast<float>(((byte & 15) - 8) * d);
          y[32 * b + 16 + j] = static_cast<float>(((byte >> 4) - 8) * d);
        }
      }
      break;
    case QuantType::kQ4_1:
      for (std::int64_t b = 0; b < n / 32; ++b) {
        const double d = f16_value(u16_at(blob, 20 * b)), m = f16_value(u16_at(blob, 20 * b + 2));
        for (int j = 0; j < 16; ++j) {
          const std::uint8_t byte = blob[20 * b + 4 + j];
          y[32 * b + j] = static_cast<float>(d * (byte & 15) + m);
          y[32 * b + 16 + j] = static_cast<float>(d * (byte >> 4) + m);
        }
      }
      break;
    case QuantType::kQ4_K:
      for (std::int64_t b = 0; b < n / 256; ++b) {
        const std::uint64_t at = 144 * b;
        const double d = f16_value(u16_at(blob, at)), dmin = f16_value(u16_at(blob, at + 2));
        const std::uint8_t* s = &blob[at + 4];
        for (int sub = 0; sub < 8; ++sub) {
          // 6-bit fields: sub-blocks 0..3 whole in bytes 0..7; 4..7 split over bytes 8..11 (low
          // 4 bits) and the top 2 bits of bytes 0..7.
          const int sc = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
          const int m = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
          const float d_sub = static_cast<float>(d * sc), m_sub = static_cast<float>(dmin * m);
          for (int l = 0; l < 32; ++l) {
            const std::uint8_t byte = blob[at + 16 + 32 * (sub / 2) + l];
            const int q = sub % 2 ? byte >> 4 : byte & 15;
            y[256 * b + 32 * sub + l] =
                static_cast<float>(static_cast<double>(d_sub) * q - static_cast<double>(m_sub));
          }
        }
      }
      break;
    case QuantType::kQ6_K:
      for (std::int64_t b = 0; b < n / 256; ++b) {
        const std::uint64_t at = 210 * b;
        const double d = f16_value(u16_at(blob, at + 208));
        for (int half = 0; half < 2; ++half) {
          const std::uint8_t* ql = &blob[at + 64 * half];
          const std::uint8_t* qh = &blob[at + 128 + 32 * half];
          const auto* sc = reinterpret_cast<const std::int8_t*>(&blob[at + 192 + 8 * half]);
          for (int l = 0; l < 32; ++l) {
            const int q[4] = {(ql[l] & 15) | ((qh[l] & 3) << 4),
                              (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4),
                              (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                              (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
            for (int g = 0; g < 4; ++g) {
              const float d_sub = static_cast<float>(d * sc[l / 16 + 2 * g]);
              y[256 * b + 128 * half + 32 * g + l] =
                  static_cast<float>(static_cast<double>(d_sub) * (q[g] - 32));
            }
          }
        }
      }
      break;
    case QuantType::kNF4:
      for (std::int64_t i = 0; i < n; ++i) {
        const std::uint8_t byte = blob[i / 2];
        const int q = i % 2 ? byte & 15 : byte >> 4;
        const float absmax = reference_absmax(f, blob, n, i / f.block);
        y[i] = static_cast<float>(static_cast<double>(static_cast<float>(kNf4[q])) * absmax);
      }
      break;
    case QuantType::kInt8: {
      const std::uint64_t scales_at = align16(static_cast<std::uint64_t>(n));
      for (std::int64_t i = 0; i < n; ++i)
        y[i] = static_cast<float>(static_cast<std::int8_t>(blob[i]) *
                                  static_cast<double>(f32_at(blob, scales_at + 4 * (i / cols))));
      break;
    }
    case QuantType::kMXFP4: {
      // The format's definition (OCP MX, as transformers decodes it): e2m1 = sign, 2 exponent
      // bits (bias 1; 0 = subnormal), 1 mantissa bit; times 2^(scale - 127), which torch's
      // pow(2.0, 128) makes an infinity (so 0 times it is NaN).
      const std::int64_t E = f.experts, C = rows / E, R = cols, G = C / 32;
      for (std::int64_t e = 0; e < E; ++e)
        for (std::int64_t c = 0; c < C; ++c)
          for (std::int64_t r = 0; r < R; ++r) {
            const std::int64_t group = (e * R + r) * G + c / 32;
            const std::uint8_t byte = blob[static_cast<std::size_t>(group * 16 + (c % 32) / 2)];
            const int code = c % 2 ? byte >> 4 : byte & 15;
            const int exp = (code >> 1) & 3, mant = code & 1;
            const double magnitude = exp == 0 ? 0.5 * mant : std::ldexp(1.0 + 0.5 * mant, exp - 1);
            const double value = code & 8 ? -magnitude : magnitude;
            const int scale = blob[static_cast<std::size_t>(E * R * G * 16 + group)];
            y[static_cast<std::size_t>((e * C + c) * R + r)] =
                scale == 255 ? static_cast<float>(value) * std::numeric_limits<float>::infinity()
                             : static_cast<float>(std::ldexp(value, scale - 127));
          }
      break;
    }
    case QuantType::kGgufMXFP4:
      // ggml's block_mxfp4: e, then element j in the low nibble of byte j, j + 16 in the high
      // one; kvalues_mxfp4 (twice e2m1, code 8 a plain 0) times GGML_E8M0_TO_FP32_HALF(e).
      for (std::int64_t b = 0; b < n / 32; ++b) {
        const int e = blob[static_cast<std::size_t>(17 * b)];
        const double d = std::ldexp(1.0, e - 128);
        for (int j = 0; j < 32; ++j) {
          const std::uint8_t byte = blob[static_cast<std::size_t>(17 * b + 1 + j % 16)];
          const int code = j < 16 ? byte & 15 : byte >> 4;
          const int kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
          y[static_cast<std::size_t>(32 * b + j)] = static_cast<float>(kvalues[code] * d);
        }
      }
      break;
    case QuantType::kNone:
      break;
  }
  return y;
}

// --- Comparisons ---------------------------------------------------------------------------------

// dequantize() into `out` must equal the reference's float32 values rounded to `out`, bit for bit
// (a NaN matching any NaN).
void expect_dequantize_equals_reference(const QuantFormat& f, const std::vector<std::uint8_t>& blob,
                                        std::int64_t rows, std::int64_t cols, FloatDType out) {
  const std::vector<float> want = reference_decode(f, blob, rows, cols);
  const auto n = static_cast<std::size_t>(rows * cols);
  std::vector<std::uint8_t> got(n * dtype_size(out));
  dequantize(f, blob.data(), rows, cols, out, got.data());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bool same;
    if (out == FloatDType::kF32) {
      float g;
      std::memcpy(&g, &got[4 * i], 4);
      same = bits_of(g) == bits_of(want[i]) || (std::isnan(g) && std::isnan(want[i]));
    } else {
      std::uint16_t g;
      std::memcpy(&g, &got[2 * i], 2);
      if (std::isnan(want[i])) {
        same = std::isnan(out == FloatDType::kBF16 ? bf16_value(g) : f16_value(g));
      } else {
        same = g == nearest_half(want[i], out == FloatDType::kBF16);
      }
    }
    if (!same && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << to_string(f) << " (" << rows << ", " << cols << ") to " << to_string(out)
                     << ": " << bad << " of " << n << " elements differ from the reference; first "
                     << "at " << first << " (row " << first / cols << ", column " << first % cols
                     << "), reference " << want[first];
}

struct Shape {
  std::int64_t rows, cols;
};

std::vector<Shape> shapes_for(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ8_0:
      return {{1, 32}, {3, 96}, {67, 288}, {5, 4128}};
    case QuantType::kQ4_K:
    case QuantType::kQ6_K:
      return {{1, 256}, {3, 768}, {67, 512}};
    default:  // NF4 and INT8: no constraint on cols, n rarely a multiple of a block
      return {{1, 1}, {1, 7}, {3, 5}, {3, 100}, {67, 33}, {67, 333}, {2, 4096 + 22}};
  }
}

// --- Layouts and checks
// ---------------------------------------------------------------------------

TEST(QuantFormat, NamesAndBytesAreTheDocumentedOnes) {
  EXPECT_STREQ(to_string(QuantType::kQ4_K), "Q4_K");
  EXPECT_STREQ(to_string(QuantType::kNF4), "NF4");
  EXPECT_STREQ(to_string(QuantType::kInt8), "INT8");
  EXPECT_EQ(to_string(QuantFormat{.type = QuantType::kNF4, .double_quant = true}),
            "NF4 (block 64, double quant)");
  // GGUF: blocks of (elements, bytes) = Q8_0 (32, 34), Q4_0 (32, 18), Q4_1 (32, 20), Q4_K (256,
  // 144), Q6_K (256, 210).
  EXPECT_EQ(quant_bytes({.type = QuantType::kQ8_0}, 3, 96), 3u * 3 * 34);
  EXPECT_EQ(quant_bytes({.type = QuantType::kQ4_0}, 1, 32), 18u);
  EXPECT_EQ(quant_bytes({.type = QuantType::kQ4_1}, 2, 64), 2u * 2 * 20);
  EXPECT_EQ(quant_bytes({.type = QuantType::kQ4_K}, 5, 512), 5u * 2 * 144);
  EXPECT_EQ(quant_bytes({.type = QuantType::kQ6_K}, 1, 256), 210u);
  // NF4 (3, 5), block 64: 8 bytes of codes, absmax at 16.
  const QuantFormat nf4{.type = QuantType::kNF4};
  Nf4Layout l = nf4_layout(nf4, 3, 5);
  EXPECT_EQ(l.n, 15);
  EXPECT_EQ(l.blocks, 1);
  EXPECT_EQ(l.absmax, 16u);
  EXPECT_EQ(l.bytes, 20u);
  // (67, 333) double-quantised: 22311 elements, 349 blocks of 64, 2 second-level blocks.
  l = nf4_layout({.type = QuantType::kNF4, .double_quant = true}, 67, 333);
  EXPECT_EQ(l.blocks, 349);
  EXPECT_EQ(l.blocks2, 2);
  EXPECT_EQ(l.absmax, 11168u);   // 11156 bytes of codes, rounded up to 16
  EXPECT_EQ(l.absmax2, 11520u);  // + 349 code bytes, rounded up
  EXPECT_EQ(l.offset, 11536u);   // + 2 floats, rounded up
  EXPECT_EQ(l.bytes, 11540u);
  EXPECT_EQ(quant_bytes({.type = QuantType::kNF4, .double_quant = true}, 67, 333), 11540u);
  // INT8 (3, 5): 15 int8, scales at 16.
  EXPECT_EQ(int8_layout(3, 5).scales, 16u);
  EXPECT_EQ(quant_bytes({.type = QuantType::kInt8}, 3, 5), 28u);
}

TEST(QuantFormat, ShapesAFormatCannotHoldAreRejectedWithTheReason) {
  auto message = [](const QuantFormat& f, std::int64_t rows, std::int64_t cols) {
    try {
      quant_bytes(f, rows, cols);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({.type = QuantType::kQ4_K}, 2, 96).find("multiple of the Q4_K block size 256"),
            std::string::npos);
  EXPECT_NE(message({.type = QuantType::kQ8_0}, 2, 33).find("multiple of the Q8_0 block size 32"),
            std::string::npos);
  EXPECT_NE(message({.type = QuantType::kNF4, .block = 48}, 2, 96).find("block size 48"),
            std::string::npos);
  EXPECT_NE(message({.type = QuantType::kNF4, .block = 8192}, 2, 96).find("block size 8192"),
            std::string::npos);
  EXPECT_NE(message({}, 2, 96).find("no quantisation type"), std::string::npos);
  EXPECT_NE(message({.type = QuantType::kInt8}, 0, 96).find("at least 1"), std::string::npos);
  std::vector<float> x(96, 1.0f), y(96);
  std::vector<std::uint8_t> blob(1024);
  EXPECT_THROW(quantize({.type = QuantType::kQ4_K}, x.data(), FloatDType::kF32, 1, 96, blob.data()),
               Error);
  EXPECT_THROW(
      dequantize({.type = QuantType::kQ4_K}, blob.data(), 1, 96, FloatDType::kF32, y.data()),
      Error);
}

TEST(QuantFormat, AValueThatIsNotFiniteIsRejectedWithItsPlace) {
  for (const QuantFormat& f : test::all_quant_formats()) {
    const std::int64_t rows = 3, cols = 256;
    std::vector<float> x(rows * cols, 0.5f);
    x[cols + 17] = std::numeric_limits<float>::quiet_NaN();
    std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
    try {
      quantize(f, x.data(), FloatDType::kF32, rows, cols, blob.data());
      ADD_FAILURE() << to_string(f) << " accepted a NaN";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("row 1, column 17 is NaN"), std::string::npos)
          << to_string(f) << ": " << e.what();
    }
  }
}

// --- dequantize() against the reference decoder
// ---------------------------------------------------

TEST(QuantDequantize, EqualsTheReferenceDecoderForQuantisedWeights) {
  auto rng = rng_for_test();
  for (const QuantFormat& f : test::all_quant_formats())
    for (Shape s : shapes_for(f.type)) {
      std::vector<double> values;
      const auto x = random_weights(rng, s.rows, s.cols, FloatDType::kF32, &values);
      std::vector<std::uint8_t> blob(quant_bytes(f, s.rows, s.cols));
      quantize(f, x.data(), FloatDType::kF32, s.rows, s.cols, blob.data());
      for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16})
        expect_dequantize_equals_reference(f, blob, s.rows, s.cols, out);
    }
}

// Random bytes reach every code and scale pattern a quantiser may never write (negative and
// subnormal scales, every nibble of every sub-block). Scales are finite f16: a NaN scale is not a
// value any format defines.
TEST(QuantDequantize, EqualsTheReferenceDecoderForRandomBlocks) {
  auto rng = rng_for_test();
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto f16_scale = [&](float sigma) {
    const std::uint16_t h = nearest_half(normal(rng) * sigma, false);
    return std::isfinite(f16_value(h)) ? h : std::uint16_t{0x3C00};
  };
  for (const QuantFormat& f : test::all_quant_formats())
    for (Shape s : shapes_for(f.type)) {
      std::vector<std::uint8_t> blob(quant_bytes(f, s.rows, s.cols));
      for (auto& b : blob)
        b = static_cast<std::uint8_t>(byte(rng));
      const std::int64_t n = s.rows * s.cols;
      auto put16 = [&](std::uint64_t at, std::uint16_t v) {
        blob[at] = static_cast<std::uint8_t>(v);
        blob[at + 1] = static_cast<std::uint8_t>(v >> 8);
      };
      auto put32 = [&](std::uint64_t at, float v) { std::memcpy(&blob[at], &v, 4); };
      switch (f.type) {
        case QuantType::kQ8_0:
        case QuantType::kQ4_0:
          for (std::int64_t b = 0; b < n / 32; ++b)
            put16(b * (f.type == QuantType::kQ8_0 ? 34 : 18), f16_scale(0.01f));
          break;
        case QuantType::kQ4_1:
          for (std::int64_t b = 0; b < n / 32; ++b) {
            put16(20 * b, f16_scale(0.01f));
            put16(20 * b + 2, f16_scale(0.1f));
          }
          break;
        case QuantType::kQ4_K:
          for (std::int64_t b = 0; b < n / 256; ++b) {
            put16(144 * b, f16_scale(0.001f));
            put16(144 * b + 2, f16_scale(0.001f));
          }
          break;
        case QuantType::kQ6_K:
          for (std::int64_t b = 0; b < n / 256; ++b)
            put16(210 * b + 208, f16_scale(0.001f));
          break;
        case QuantType::kNF4: {
          const Nf4Layout l = nf4_layout(f, s.rows, s.cols);
          if (f.double_quant) {
            for (std::int64_t b = 0; b < l.blocks2; ++b)
              put32(l.absmax2 + 4 * b, std::fabs(normal(rng)));
            put32(l.offset, normal(rng));
          } else {
            for (std::int64_t b = 0; b < l.blocks; ++b)
              put32(l.absmax + 4 * b, normal(rng));
          }
          break;
        }
        case QuantType::kInt8:
          for (std::int64_t r = 0; r < s.rows; ++r)
            put32(int8_layout(s.rows, s.cols).scales + 4 * r, normal(rng) * 0.01f);
          break;
        case QuantType::kMXFP4:  // not among the formats swept here (MXFP4's own test below)
        case QuantType::kGgufMXFP4:
        case QuantType::kNone:
          break;
      }
      for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16})
        expect_dequantize_equals_reference(f, blob, s.rows, s.cols, out);
    }
}

// MXFP4 (GPT-OSS's experts) equals the format's definition on random bytes: every code, every
// scale (255 included, as torch's power of two makes it an infinity), 1 and 3 experts, each
// expert's (R, C) matrix transposed into the (E * C, R) tensor; ggml's MXFP4 blocks (GGUF) equal
// ggml's definition likewise; and Rondo makes neither.
TEST(QuantDequantize, Mxfp4AndGgmlMxfp4AreTheirDefinitions) {
  auto rng = rng_for_test();
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto [experts, c, r] : {std::array<std::int64_t, 3>{1, 32, 1}, {3, 64, 7}, {2, 96, 301}}) {
    const QuantFormat f{.type = QuantType::kMXFP4, .experts = experts};
    const std::int64_t rows = experts * c, cols = r;
    std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
    EXPECT_EQ(blob.size(), static_cast<std::size_t>(rows * cols / 32 * 17));
    for (auto& b : blob)
      b = static_cast<std::uint8_t>(byte(rng));
    for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16})
      expect_dequantize_equals_reference(f, blob, rows, cols, out);
  }
  // ggml's MXFP4 blocks (GGUF) likewise.
  const QuantFormat ggml{.type = QuantType::kGgufMXFP4};
  for (auto [rows, cols] : {std::array<std::int64_t, 2>{1, 32}, {5, 96}, {3, 4096}}) {
    std::vector<std::uint8_t> blob(quant_bytes(ggml, rows, cols));
    EXPECT_EQ(blob.size(), static_cast<std::size_t>(rows * cols / 32 * 17));
    for (auto& b : blob)
      b = static_cast<std::uint8_t>(byte(rng));
    for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16})
      expect_dequantize_equals_reference(ggml, blob, rows, cols, out);
  }
  const QuantFormat three{.type = QuantType::kMXFP4, .experts = 3};
  EXPECT_THROW(quant_bytes(three, 3 * 48, 4), Error);  // 48 rows an expert: not groups of 32
  EXPECT_THROW(quant_bytes(three, 64, 4), Error);      // not a multiple of the experts
  std::vector<float> x(64 * 4, 1.0f);
  std::vector<std::uint8_t> blob(quant_bytes({.type = QuantType::kMXFP4}, 64, 4));
  EXPECT_THROW(
      quantize({.type = QuantType::kMXFP4}, x.data(), FloatDType::kF32, 64, 4, blob.data()), Error);
}

// Large enough to spread over threads; the result must not depend on how many there are.
TEST(QuantDequantize, DoesNotDependOnTheThreadCount) {
  auto rng = rng_for_test();
  const std::int64_t rows = 300, cols = 1024;
  std::vector<double> values;
  const auto x = random_weights(rng, rows, cols, FloatDType::kBF16, &values);
  for (const QuantFormat& f : {QuantFormat{.type = QuantType::kQ4_K},
                               QuantFormat{.type = QuantType::kNF4, .double_quant = true}}) {
    std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols)), blob1(blob.size());
    std::vector<std::uint16_t> y(rows * cols), y1(rows * cols);
    quantize(f, x.data(), FloatDType::kBF16, rows, cols, blob.data());
    dequantize(f, blob.data(), rows, cols, FloatDType::kBF16, y.data());
    tbb::task_arena(1).execute([&] {
      quantize(f, x.data(), FloatDType::kBF16, rows, cols, blob1.data());
      dequantize(f, blob1.data(), rows, cols, FloatDType::kBF16, y1.data());
    });
    EXPECT_EQ(blob, blob1) << to_string(f);
    EXPECT_EQ(y, y1) << to_string(f);
  }
}

// --- Round trips ---------------------------------------------------------------------------------

// Round trips: the most any element may move follows from the format's definition: half a step
// of its block's grid, plus what storing the scales in f16 (or an 8-bit code) can add, plus the one
// level a format lacks (Q4_0's +8), times 1.001 for float32 rounding.

// How far storing v in f16 may move it: half a unit in the last place, 2^-25 among subnormals.
double f16_half_ulp(double v) {
  return std::max(std::fabs(v) * 0x1p-11, 0x1p-25);
}

double block_absmax(const std::vector<double>& x, std::int64_t begin, std::int64_t end) {
  double m = 0;
  for (std::int64_t i = begin; i < end; ++i)
    m = std::max(m, std::fabs(x[i]));
  return m;
}

// Checks every element against its bound; returns the RMS error relative to RMS(x).
double expect_round_trip(const QuantFormat& f, std::int64_t rows, std::int64_t cols, FloatDType in,
                         std::mt19937_64& rng, bool plain = false) {
  std::vector<double> x;
  const auto input = random_weights(rng, rows, cols, in, &x, plain);
  std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
  quantize(f, input.data(), in, rows, cols, blob.data());
  std::vector<float> y(rows * cols);
  dequantize(f, blob.data(), rows, cols, FloatDType::kF32, y.data());
  const std::int64_t n = rows * cols;
  double worst = 0, sum_e2 = 0, sum_x2 = 0;
  std::int64_t worst_at = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double bound = 0;
    const std::int64_t r = i / cols;
    switch (f.type) {
      case QuantType::kQ8_0: {  // half a step amax/127, plus 127 times d's f16 rounding
        const double a = block_absmax(x, i / 32 * 32, i / 32 * 32 + 32);
        bound = 0.5 * a / 127 + 127 * f16_half_ulp(a / 127);
        break;
      }
      case QuantType::kQ4_0: {  // a step amax/8: the side opposite the largest lacks level +8
        const double a = block_absmax(x, i / 32 * 32, i / 32 * 32 + 32);
        bound = a / 8 + 8 * f16_half_ulp(a / 8);
        break;
      }
      case QuantType::kQ4_1: {  // half a step (max - min)/15; f16 d and m
        double lo = x[i / 32 * 32], hi = lo;
        for (std::int64_t k = i / 32 * 32; k < i / 32 * 32 + 32; ++k)
          lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
        bound = 0.5 * (hi - lo) / 15 + 15 * f16_half_ulp((hi - lo) / 15) + f16_half_ulp(lo);
        break;
      }
      case QuantType::kQ4_K:
      case QuantType::kQ6_K: {
        // Fitted grids: one step of a plain grid over the super-block's range (Q4_K: 15 steps
        // over max - min; Q6_K: 32 steps over the largest magnitude). Measured worst cases reach
        // three quarters of that; a broken fit or scale packing is off by whole ranges.
        const std::int64_t b0 = i / 256 * 256;
        double lo = 0, hi = 0;
        for (std::int64_t k = b0; k < b0 + 256; ++k)
          lo = std::min(lo, x[k]), hi = std::max(hi, x[k]);
        bound = f.type == QuantType::kQ4_K ? (hi - lo) / 15 : std::max(hi, -lo) / 32;
        break;
      }
      case QuantType::kNF4: {
        // Half the widest gap between NF4 codes (between -1 and the next, 0.304) times the block's
        // absmax, plus how far the stored (maybe double-quantised) absmax is from the true one.
        const std::int64_t b0 = i / f.block * f.block;
        const double a = block_absmax(x, b0, std::min(n, b0 + f.block));
        const double stored = reference_absmax(f, blob, n, i / f.block);
        bound = ((kNf4[1] - kNf4[0]) / 2) * a + std::fabs(stored - a) + 1e-30;
        break;
      }
      case QuantType::kInt8: {
        const double a = block_absmax(x, r * cols, r * cols + cols);
        bound = 0.5 * a / 127;
        break;
      }
      case QuantType::kMXFP4:  // never made (quantize throws)
      case QuantType::kGgufMXFP4:
      case QuantType::kNone:
        break;
    }
    bound = bound * 1.001 + 1e-45;
    const double e = std::fabs(y[i] - x[i]);
    sum_e2 += e * e;
    sum_x2 += x[i] * x[i];
    if (e / bound > worst) {
      worst = e / bound;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, 1.0) << to_string(f) << " (" << rows << ", " << cols << ") from "
                        << to_string(in) << ": element " << worst_at << " (row " << worst_at / cols
                        << ", column " << worst_at % cols << ") moved from " << x[worst_at]
                        << " to " << y[worst_at] << ", " << worst << " times the format's bound";
  return std::sqrt(sum_e2 / sum_x2);
}

TEST(QuantRoundTrip, EveryFormatStaysWithinItsBound) {
  auto rng = rng_for_test();
  for (const QuantFormat& f : test::all_quant_formats())
    for (Shape s : shapes_for(f.type))
      for (FloatDType in : {FloatDType::kF32, FloatDType::kBF16, FloatDType::kF16})
        expect_round_trip(f, s.rows, s.cols, in, rng);
}

// RMS error relative to RMS(x) on independent N(0, 1) weights, (64, 4096) of them: the figures
// docs/quantisation.md quotes, with room for the spread between runs (a few per mille). A format
// that lost a bit or mixed up its scales is off by far more.
TEST(QuantRoundTrip, ErrorOnNormalWeightsIsTheDocumentedOne) {
  auto rng = rng_for_test();
  struct Case {
    QuantFormat format;
    double limit;
  };
  const Case cases[] = {
      {{.type = QuantType::kQ8_0}, 0.0056},                      // measured 0.00535
      {{.type = QuantType::kQ4_0}, 0.089},                       // 0.0859
      {{.type = QuantType::kQ4_1}, 0.081},                       // 0.0781
      {{.type = QuantType::kQ4_K}, 0.074},                       // 0.0714
      {{.type = QuantType::kQ6_K}, 0.0185},                      // 0.0177
      {{.type = QuantType::kNF4}, 0.095},                        // 0.0919
      {{.type = QuantType::kNF4, .double_quant = true}, 0.095},  // 0.0920
      {{.type = QuantType::kInt8}, 0.0095},                      // 0.0087
  };
  for (const Case& c : cases) {
    const double rms = expect_round_trip(c.format, 64, 4096, FloatDType::kF32, rng, true);
    std::cout << to_string(c.format) << ": RMS error " << rms << " of RMS(x)\n";
    EXPECT_LE(rms, c.limit) << to_string(c.format);
  }
}

// An all-zero block must come back as zeros, whatever the format does with its scale.
TEST(QuantRoundTrip, ZerosStayZero) {
  for (const QuantFormat& f : test::all_quant_formats()) {
    const std::int64_t rows = 3, cols = 256;
    std::vector<float> x(rows * cols, 0.0f), y(rows * cols, 1.0f);
    for (std::int64_t c = 0; c < cols; ++c)
      x[2 * cols + c] = 0.01f * static_cast<float>(c % 7) - 0.03f;  // one row that is not
    std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
    quantize(f, x.data(), FloatDType::kF32, rows, cols, blob.data());
    dequantize(f, blob.data(), rows, cols, FloatDType::kF32, y.data());
    for (std::int64_t i = 0; i < 2 * cols; ++i)
      ASSERT_EQ(y[i], 0.0f) << to_string(f) << " element " << i;
  }
}

// --- The simulated device ------------------------------------------------------------------------

TEST(QuantSimDevice, DequantizeRunsInStreamOrderAfterTheUpload) {
  auto rng = rng_for_test();
  // A slow link: the upload takes a while, and a dequantisation that did not wait for it would
  // read the zeros the buffer was filled with.
  auto dev =
      make_sim_device({.bytes_cap = 64 << 20, .link = {.bytes_per_s = 2e8, .latency_s = 2e-3}});
  Stream& s = dev->create_stream("weights");
  for (const QuantFormat& f : test::all_quant_formats())
    for (FloatDType out : {FloatDType::kF32, FloatDType::kBF16}) {
      const std::int64_t rows = 67, cols = f.type == QuantType::kQ4_K || f.type == QuantType::kQ6_K
                                               ? 512
                                               : 288;
      std::vector<double> values;
      const auto x = random_weights(rng, rows, cols, FloatDType::kBF16, &values);
      std::vector<std::uint8_t> blob(quant_bytes(f, rows, cols));
      quantize(f, x.data(), FloatDType::kBF16, rows, cols, blob.data());
      const std::size_t out_bytes = rows * cols * dtype_size(out);
      std::vector<std::uint8_t> want(out_bytes), got(out_bytes);
      dequantize(f, blob.data(), rows, cols, out, want.data());
      DeviceBuffer q = dev->allocate(blob.size(), &s), w = dev->allocate(out_bytes, &s);
      s.fill(q.data(), 0, blob.size());
      s.upload(q.data(), blob.data(), blob.size());
      s.dequantize(f, q.data(), rows, cols, out, w.data());
      s.download(got.data(), w.data(), out_bytes);
      s.synchronize();
      EXPECT_EQ(got, want) << to_string(f) << " to " << to_string(out);
    }
}

TEST(QuantSimDevice, ABadCallThrowsAtOnceAndEnqueuesNothing) {
  auto dev = make_sim_device({});
  Stream& s = dev->create_stream("weights");
  DeviceBuffer q = dev->allocate(4096, &s), w = dev->allocate(4096, &s);
  EXPECT_THROW(
      s.dequantize({.type = QuantType::kQ6_K}, q.data(), 1, 96, FloatDType::kF32, w.data()), Error);
  EXPECT_THROW(s.dequantize({.type = QuantType::kQ8_0}, q.data(), 1, 32, FloatDType::kF32,
                            static_cast<char*>(w.data()) + 2),
               Error);
  s.synchronize();  // nothing failed on the stream
  EXPECT_TRUE(s.query());
}

}  // namespace
}  // namespace rondo::kernels
