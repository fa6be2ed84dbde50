// The CPU quantisers of kernels/quant.h: NF4 as bitsandbytes computes it, INT8 per row, and the
// GGUF types. Compiled with -ffp-contract=off (Note [No FMA in dequantisation] in quant.cpp): every
// product and sum below is rounded where its reference rounds it, and the one fused multiply-add
// bitsandbytes performs is written as std::fma.
//
// Note [NF4 as bitsandbytes computes it]
// bitsandbytes 0.50.2 on the CPU runs quantize_4bit in plain torch (backends/default/ops.py) and
// the double quantisation of the absmax in its C++ library (csrc/cpu_ops.cpp, quantize_cpu_impl).
// What it computes, in float32, and what we do the same way:
//  - The input is widened to float32 (exact for bf16 and fp16).
//  - Full blocks: absmax = max |x| is stored as is; x is scaled by multiplying with the reciprocal
//    1 / max(absmax, 1e-38f) (torch's `1.0 / t` is a reciprocal, correctly rounded), then clamped
//    to [-1, 1]. The last, partial block is scaled by dividing by max(absmax, 1e-38f) instead, and
//    that clamped absmax is what is stored: an all-zero partial block stores 1e-38f (a subnormal),
//    an all-zero full block stores 0.
//  - The code is torch.bucketize against the 15 midpoints (code[k] + code[k+1]) / 2 of the NF4
//    table (right=False): the number of midpoints strictly below the scaled value, so a value on a
//    midpoint takes the lower code. An odd element count is padded with the value 0 (code 7), and
//    element 2i goes to the high nibble of byte i.
//  - Double quantisation: offset = absmax.mean(), which torch computes on the CPU as a cascade sum
//    (aten/src/ATen/native/cpu/SumKernel.cpp: 8 float lanes, 4 interleaved accumulators, a
//    multi-level cascade) divided by the count; the sum kernel is registered for AVX2 only, so
//    AVX-512 machines use the same 8 lanes. Above 32768 blocks (2 Mi parameters at block 64) torch
//    splits that sum over its threads, and bitsandbytes' offset then depends on
//    torch.get_num_threads(); ours equals torch's with one thread. The values absmax - offset are
//    then quantised in blocks of 256 to bitsandbytes' signed dynamic map, not to the nearest
//    code but through a 65536-entry table: index = (int)fma((clamp(v / amax) + 1) * 0.5, 65535,
//    0.5) with v / amax computed as v * (1 / amax), and table[index] the first code whose midpoint
//    with the next is >= -1 + 2 * index / 65535. The fused multiply-add is in the x86-64 wheel's
//    machine code (GCC contracted the source's `* 65535 + 0.5`; it can change an index only where
//    the sum crosses a power of two); an all-zero block gets code 0. That quantiser is shared with
//    the 8-bit AdamW (dynamic_map.h, Note [bitsandbytes' 8-bit quantiser]).
#include "kernels/quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/dynamic_map.h"
#include "kernels/cpu/float_convert.h"
#include "kernels/cpu/parallel.h"
#include "kernels/error.h"
#include "kernels/quant_blocks.h"

namespace rondo::kernels {
namespace {

constexpr float kNf4Code[16] = RONDO_NF4_CODE;
constexpr float kDynamicMap[256] = RONDO_DYNAMIC_MAP_CODE;

// Below this many blocks a call runs on the caller's thread.
constexpr std::size_t kInlineBlocks = 64;

template <class Body>
void for_each_block(std::int64_t blocks, const Body& body) {
  const auto count = static_cast<std::size_t>(blocks);
  if (count < kInlineBlocks) {
    body(std::size_t{0}, count);
    return;
  }
  detail::parallel_for_tiles(count, body);
}

// Reads elements [begin, begin + count) of a tensor of `in` values as float32 (exact widening) and
// throws if one is not finite: no format here has a meaning for it, and bitsandbytes and gguf-py
// would turn a whole block into garbage without saying so.
void load_finite(const void* src, FloatDType in, std::int64_t begin, std::int64_t count,
                 std::int64_t cols, const char* format, float* out) {
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t k = begin + i;
    float x;
    switch (in) {
      case FloatDType::kF32:
        x = static_cast<const float*>(src)[k];
        break;
      case FloatDType::kF16:
        x = f32_from_f16(static_cast<const std::uint16_t*>(src)[k]);
        break;
      case FloatDType::kBF16:
      default:
        x = f32_from_bf16(static_cast<const std::uint16_t*>(src)[k]);
        break;
    }
    if (!std::isfinite(x))
      throw Error(std::string("cannot quantise to ") + format + ": the element at row " +
                  std::to_string(k / cols) + ", column " + std::to_string(k % cols) + " is " +
                  (std::isnan(x) ? "NaN" : "infinite") + "; the weights are damaged");
    out[i] = x;
  }
}

// f16 bits of a block scale; a scale too large for f16 would decode to infinity.
std::uint16_t f16_scale(float value, const char* format, std::int64_t block) {
  const std::uint16_t h = f16_from_f32(value);
  if ((h & 0x7C00u) == 0x7C00u)
    throw Error(std::string("cannot quantise to ") + format + ": block " + std::to_string(block) +
                " needs a scale of " + std::to_string(value) +
                ", beyond f16's 65504; these weights are too large for " + format);
  return h;
}

void store_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v & 0xFF);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}

void store_f32(std::uint8_t* p, float v) {
  std::memcpy(p, &v, 4);
}

// --- NF4 (Note [NF4 as bitsandbytes computes it]) -----------------------------------------------

struct Nf4Midpoints {
  std::array<float, 15> value;
  Nf4Midpoints() {
    for (int k = 0; k < 15; ++k)
      value[k] = (kNf4Code[k] + kNf4Code[k + 1]) / 2.0f;
  }
};

// torch.bucketize(v, midpoints, right=False): midpoints strictly below v.
int nf4_bucket(const Nf4Midpoints& mid, float v) {
  int code = 0;
  for (int k = 0; k < 15; ++k)
    code += mid.value[k] < v ? 1 : 0;
  return code;
}

// ceil(log2(x)) as torch's utils::CeilLog2 (1 for x <= 2).
std::int64_t ceil_log2(std::int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<unsigned long long>(x - 1));
}

// torch's row_sum over `size` vectors of L float lanes (L = 8: Vectorized<float> under AVX2; L = 1:
// plain floats), operation for operation: 4 interleaved accumulators (the ILP factor), each a
// cascade of 4 levels (multi_row_sum), in aten/src/ATen/native/cpu/SumKernel.cpp. Lanes are
// independent float additions.
template <int L>
std::array<float, L> torch_row_sum(const float* x, std::int64_t size) {
  constexpr int kIlp = 4, kLevels = 4;
  using Vec = std::array<float, L>;
  auto add = [](Vec& a, const Vec& b) {
    for (int l = 0; l < L; ++l)
      a[l] += b[l];
  };
  auto load = [&](std::int64_t v) {
    Vec out;
    std::memcpy(out.data(), x + v * L, sizeof out);
    return out;
  };
  const std::int64_t groups = size / kIlp;  // multi_row_sum's size
  const std::int64_t level_power = std::max<std::int64_t>(4, ceil_log2(groups) / kLevels);
  const std::int64_t level_step = std::int64_t{1} << level_power;
  const std::int64_t level_mask = level_step - 1;
  Vec acc[kLevels][kIlp] = {};
  std::int64_t i = 0;
  for (; i + level_step <= groups;) {
    for (std::int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k)
        add(acc[0][k], load(i * kIlp + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Vec{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i)
    for (int k = 0; k < kIlp; ++k)
      add(acc[0][k], load(i * kIlp + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      add(acc[0][k], acc[j][k]);
  Vec sum = acc[0][0];
  for (std::int64_t v = groups * kIlp; v < size; ++v)
    add(sum, load(v));
  for (int k = 1; k < kIlp; ++k)
    add(sum, acc[0][k]);
  return sum;
}

// torch.sum of a contiguous float32 vector on the CPU with one thread: vectorized_inner_sum (a
// vector row_sum, the scalar tail, then the lanes) from 8 elements on, a scalar row_sum below.
float torch_cpu_sum(const float* x, std::int64_t n) {
  constexpr int kLanes = 8;
  if (n < kLanes) return 0.0f + torch_row_sum<1>(x, n)[0];
  const std::int64_t vectors = n / kLanes;
  const std::array<float, kLanes> lanes = torch_row_sum<kLanes>(x, vectors);
  float total = 0.0f;
  for (std::int64_t k = vectors * kLanes; k < n; ++k)
    total += x[k];
  for (int l = 0; l < kLanes; ++l)
    total += lanes[l];
  return total;
}

// The second level of double quantisation: `values` (absmax - offset) in blocks of 256 to 8-bit
// dynamic-map codes and an fp32 absmax per block, as bitsandbytes' quantize_blockwise on the CPU.
void quantize_dynamic(const std::vector<float>& values, std::uint8_t* codes, float* absmax) {
  static const DynamicMap map(kDynamicMap);
  const auto n = static_cast<std::int64_t>(values.size());
  const std::int64_t blocks = (n + quant::kNf4Block2 - 1) / quant::kNf4Block2;
  for_each_block(blocks, [&](std::size_t first, std::size_t last) {
    for (auto b = static_cast<std::int64_t>(first); b < static_cast<std::int64_t>(last); ++b) {
      const std::int64_t begin = b * quant::kNf4Block2;
      const std::int64_t end = std::min(n, begin + quant::kNf4Block2);
      absmax[b] =
          quantize_dynamic_block(values.data() + begin, static_cast<std::size_t>(end - begin),
                                 map.bin_code, codes + begin);
    }
  });
}

// --- GGUF: Q8_0, Q4_0, Q4_1 as gguf-py's numpy code (float32 throughout) -------------------------

void quantize_q8_0(const float* x, std::uint8_t* y, std::int64_t block) {
  float amax = 0.0f;
  for (int j = 0; j < quant::kQK; ++j)
    amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_u16(y, f16_scale(d, "Q8_0", block));
  for (int j = 0; j < quant::kQK; ++j)  // np_roundf: halves away from zero, as std::round
    y[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(std::round(x[j] * id)));
}

void quantize_q4_0(const float* x, std::uint8_t* y, std::int64_t block) {
  float amax = 0.0f, max = 0.0f;  // the first element of largest magnitude, with its sign
  for (int j = 0; j < quant::kQK; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  const float d = max / -8.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_u16(y, f16_scale(d, "Q4_0", block));
  for (int j = 0; j < quant::kQK / 2; ++j) {
    const auto lo = std::min(15, static_cast<int>(std::trunc(x[j] * id + 8.5f)));
    const auto hi = std::min(15, static_cast<int>(std::trunc(x[j + 16] * id + 8.5f)));
    y[2 + j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
}

void quantize_q4_1(const float* x, std::uint8_t* y, std::int64_t block) {
  float min = x[0], max = x[0];
  for (int j = 1; j < quant::kQK; ++j) {
    min = std::min(min, x[j]);
    max = std::max(max, x[j]);
  }
  const float d = (max - min) / 15.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  store_u16(y, f16_scale(d, "Q4_1", block));
  store_u16(y + 2, f16_scale(min, "Q4_1", block));
  for (int j = 0; j < quant::kQK / 2; ++j) {
    const auto lo = std::min(15, static_cast<int>(std::trunc((x[j] - min) * id + 0.5f)));
    const auto hi = std::min(15, static_cast<int>(std::trunc((x[j + 16] - min) * id + 0.5f)));
    y[4 + j] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
}

// --- GGUF: Q4_K and Q6_K ----------------------------------------------------------------------
//
// Note [K-quant fits]
// Following ggml's reference quantisers (quantize_row_q4_K_ref, quantize_row_q6_K_ref): each
// sub-block gets the scale (and for Q4_K the offset) that minimises a weighted squared error over
// a small search of candidate grids, each refined by least squares; the sub-block scales are then
// themselves quantised (6 bits against the block's largest for Q4_K, int8 for Q6_K), and every
// element is quantised again against the scale it will actually be decoded with (taken from the
// decoder's own functions in quant_blocks.h). Weights as ggml's: Q4_K weighs an element by
// rms(sub-block) + |x|, Q6_K by x^2, so large weights, which matter most to a matmul, are kept
// best. Sums in double.

int nearest(float x) {
  return static_cast<int>(std::nearbyint(x));  // ties to even in the default rounding mode
}

// Q4_K sub-block: x ~ scale * l - offset with l in [0, 15], scale >= 0, offset >= 0.
void fit_offset_scale(const float* x, int n, float* scale, float* offset) {
  constexpr int kMax = 15;
  float lo = x[0], hi = x[0];
  double sum_x2 = 0;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_x2 += static_cast<double>(x[i]) * x[i];
  }
  lo = std::min(lo, 0.0f);  // the offset only moves values down: a positive block keeps l = 0 at 0
  *scale = 0.0f;
  *offset = -lo;
  if (hi == lo) return;
  const double rms = std::sqrt(sum_x2 / n);
  double w[32], sw = 0, swx = 0;
  for (int i = 0; i < n; ++i) {
    w[i] = rms + std::fabs(x[i]);
    sw += w[i];
    swx += w[i] * x[i];
  }
  auto error = [&](double a, double b, const int* l) {
    double e = 0;
    for (int i = 0; i < n; ++i) {
      const double diff = a * l[i] + b - x[i];
      e += w[i] * diff * diff;
    }
    return e;
  };
  int l[32];
  // The plain grid from lo to hi first; then grids a little finer or coarser, each starting at the
  // best offset found so far (so the search walks towards it), each refit by least squares.
  double best_a = (static_cast<double>(hi) - lo) / kMax, best_b = lo;
  for (int i = 0; i < n; ++i)
    l[i] = std::clamp(nearest(static_cast<float>((x[i] - best_b) / best_a)), 0, kMax);
  double best = error(best_a, best_b, l);
  for (int step = 0; step <= 20 && hi > best_b; ++step) {
    const double inv = (kMax - 1.0 + 0.1 * step) / (hi - best_b);
    double sl = 0, sl2 = 0, sxl = 0;
    for (int i = 0; i < n; ++i) {
      l[i] = std::clamp(nearest(static_cast<float>((x[i] - best_b) * inv)), 0, kMax);
      sl += w[i] * l[i];
      sl2 += w[i] * l[i] * l[i];
      sxl += w[i] * l[i] * x[i];
    }
    const double det = sw * sl2 - sl * sl;
    if (det <= 0) continue;
    double a = (sw * sxl - swx * sl) / det;
    double b = (sl2 * swx - sl * sxl) / det;
    if (b > 0) {  // an offset upwards cannot be stored: fit the scale alone
      b = 0;
      a = sxl / sl2;
    }
    const double e = error(a, b, l);
    if (e < best && a > 0) {
      best = e;
      best_a = a;
      best_b = b;
    }
  }
  *scale = static_cast<float>(best_a);
  *offset = static_cast<float>(-best_b);
}

void quantize_q4_k(const float* x, std::uint8_t* y, std::int64_t block) {
  float scale[8], offset[8];
  float max_scale = 0.0f, max_offset = 0.0f;
  for (int sub = 0; sub < 8; ++sub) {
    fit_offset_scale(x + 32 * sub, 32, &scale[sub], &offset[sub]);
    max_scale = std::max(max_scale, scale[sub]);
    max_offset = std::max(max_offset, offset[sub]);
  }
  // Sub-block scales and offsets as 6-bit multiples of the block's d and dmin.
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_offset = max_offset > 0 ? 63.0f / max_offset : 0.0f;
  std::uint8_t* packed = y + 4;
  std::memset(packed, 0, 12);
  for (int sub = 0; sub < 8; ++sub) {
    const int ls = std::clamp(nearest(inv_scale * scale[sub]), 0, 63);
    const int lm = std::clamp(nearest(inv_offset * offset[sub]), 0, 63);
    if (sub < 4) {
      packed[sub] = static_cast<std::uint8_t>(ls);
      packed[sub + 4] = static_cast<std::uint8_t>(lm);
    } else {
      packed[sub + 4] = static_cast<std::uint8_t>((ls & 0x0F) | ((lm & 0x0F) << 4));
      packed[sub - 4] |= static_cast<std::uint8_t>((ls >> 4) << 6);
      packed[sub] |= static_cast<std::uint8_t>((lm >> 4) << 6);
    }
  }
  store_u16(y, f16_scale(max_scale / 63.0f, "Q4_K", block));
  store_u16(y + 2, f16_scale(max_offset / 63.0f, "Q4_K", block));
  std::uint8_t* qs = y + 16;
  std::memset(qs, 0, 128);
  for (int sub = 0; sub < 8; ++sub) {
    float d_sub, m_sub;
    quant::q4_k_sub(y, sub, &d_sub, &m_sub);
    for (int i = 0; i < 32; ++i) {
      const int l =
          d_sub == 0.0f ? 0 : std::clamp(nearest((x[32 * sub + i] + m_sub) / d_sub), 0, 15);
      qs[32 * (sub / 2) + i] |= static_cast<std::uint8_t>(sub % 2 == 0 ? l : l << 4);
    }
  }
}

// Q6_K sub-block: x ~ scale * l with l in [-32, 31]; the element of largest magnitude anchors the
// candidate grids at l = -32, the level the asymmetric range has to spare. Returns a signed scale.
float fit_symmetric(const float* x, int n) {
  constexpr int kMax = 32;
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  if (amax < 1e-15f) return 0.0f;
  double best_quality = -1, best_scale = 0;
  for (int step = -9; step <= 9; ++step) {
    const float inv = -(kMax + 0.1f * step) / max;
    double sxl = 0, sl2 = 0;
    for (int i = 0; i < n; ++i) {
      const double w = static_cast<double>(x[i]) * x[i];
      const int l = std::clamp(nearest(inv * x[i]), -kMax, kMax - 1);
      sxl += w * x[i] * l;
      sl2 += w * l * l;
    }
    // For the least-squares scale sxl / sl2 the weighted error is sum(w x^2) - sxl^2 / sl2.
    if (sl2 > 0 && sxl * sxl / sl2 > best_quality) {
      best_quality = sxl * sxl / sl2;
      best_scale = sxl / sl2;
    }
  }
  return static_cast<float>(best_scale);
}

void quantize_q6_k(const float* x, std::uint8_t* y, std::int64_t block) {
  std::memset(y, 0, quant::kQ6_KBytes);
  float scale[16];
  float max_scale = 0.0f;  // the sub-block scale of largest magnitude, with its sign
  for (int sub = 0; sub < 16; ++sub) {
    scale[sub] = fit_symmetric(x + 16 * sub, 16);
    if (std::fabs(scale[sub]) > std::fabs(max_scale)) max_scale = scale[sub];
  }
  int l[quant::kQKK];
  if (std::fabs(max_scale) < 1e-15f) {
    std::fill(l, l + quant::kQKK, 0);  // an all-zero block: d = 0, every quant 0
  } else {
    // int8 sub-block scales: the largest maps to -128, int8's spare level; d = -max_scale / 128.
    const float inv = -128.0f / max_scale;
    store_u16(y + 208, f16_scale(1.0f / inv, "Q6_K", block));
    for (int sub = 0; sub < 16; ++sub)
      y[192 + sub] = static_cast<std::uint8_t>(
          static_cast<std::int8_t>(std::clamp(nearest(inv * scale[sub]), -128, 127)));
    for (int j = 0; j < quant::kQKK; ++j) {
      const float d_sub = quant::q6_k_sub(y, quant::q6_k_sub_of(j));
      l[j] = d_sub == 0.0f ? 0 : std::clamp(nearest(x[j] / d_sub), -32, 31);
    }
  }
  // Element j at its place in ql and qh: the inverse of quant::q6_k_quant.
  for (int j = 0; j < quant::kQKK; ++j) {
    const int q = l[j] + 32;
    const int half = j >> 7, group = (j >> 5) & 3, i = j & 31;
    std::uint8_t& low = y[64 * half + i + 32 * (group & 1)];
    low |= static_cast<std::uint8_t>(group < 2 ? (q & 0x0F) : (q & 0x0F) << 4);
    y[128 + 32 * half + i] |= static_cast<std::uint8_t>((q >> 4) << (2 * group));
  }
}

}  // namespace

void quantize_nf4(const QuantFormat& format, const void* src, FloatDType in, std::int64_t rows,
                  std::int64_t cols, void* dst) {
  const Nf4Layout layout = nf4_layout(format, rows, cols);  // checks the shape
  static const Nf4Midpoints midpoints;
  const float kTiny = static_cast<float>(1e-38);  // bitsandbytes' clamp(min=1e-38), a subnormal
  auto* blob = static_cast<std::uint8_t*>(dst);
  std::memset(blob, 0, layout.bytes);
  std::vector<float> absmax(static_cast<std::size_t>(layout.blocks));
  const std::int64_t bs = format.block, n = layout.n;
  for_each_block(layout.blocks, [&](std::size_t first, std::size_t last) {
    std::vector<float> x(static_cast<std::size_t>(bs));
    for (auto b = static_cast<std::int64_t>(first); b < static_cast<std::int64_t>(last); ++b) {
      const std::int64_t begin = b * bs, count = std::min(bs, n - begin);
      load_finite(src, in, begin, count, cols, "NF4", x.data());
      float amax = 0.0f;
      for (std::int64_t i = 0; i < count; ++i)
        amax = std::max(amax, std::fabs(x[i]));
      const float clamped = std::max(amax, kTiny);
      const bool partial = count < bs;
      absmax[b] = partial ? clamped : amax;
      const float reciprocal = 1.0f / clamped;
      for (std::int64_t i = 0; i < count; i += 2) {
        auto code = [&](std::int64_t k) {
          if (k >= count) return quant::kNf4Zero;  // the pad of an odd tensor
          const float scaled = partial ? x[k] / clamped : x[k] * reciprocal;
          return nf4_bucket(midpoints, std::clamp(scaled, -1.0f, 1.0f));
        };
        blob[layout.codes + (begin + i) / 2] =
            static_cast<std::uint8_t>((code(i) << 4) | code(i + 1));
      }
    }
  });
  if (!format.double_quant) {
    for (std::int64_t b = 0; b < layout.blocks; ++b)
      store_f32(blob + layout.absmax + 4 * b, absmax[b]);
    return;
  }
  const float offset =
      torch_cpu_sum(absmax.data(), layout.blocks) / static_cast<float>(layout.blocks);
  for (float& a : absmax)
    a -= offset;
  std::vector<float> absmax2(static_cast<std::size_t>(layout.blocks2));
  quantize_dynamic(absmax, blob + layout.absmax, absmax2.data());
  for (std::int64_t b = 0; b < layout.blocks2; ++b)
    store_f32(blob + layout.absmax2 + 4 * b, absmax2[b]);
  store_f32(blob + layout.offset, offset);
}

void quantize_int8_rows(const void* src, FloatDType in, std::int64_t rows, std::int64_t cols,
                        void* dst) {
  const Int8Layout layout = int8_layout(rows, cols);
  auto* blob = static_cast<std::uint8_t*>(dst);
  std::memset(blob + rows * cols, 0, layout.scales - rows * cols);
  for_each_block(rows, [&](std::size_t first, std::size_t last) {
    std::vector<float> x(static_cast<std::size_t>(cols));
    for (auto r = static_cast<std::int64_t>(first); r < static_cast<std::int64_t>(last); ++r) {
      load_finite(src, in, r * cols, cols, cols, "INT8", x.data());
      float amax = 0.0f;
      for (float v : x)
        amax = std::max(amax, std::fabs(v));
      // bitsandbytes' torch.round(x * (127.0 / absmax)): the reciprocal, times 127, times x, each
      // rounded to float32, then to nearest even; |x * inv| <= 127 (1 + 3 * 2^-24) < 127.5.
      const float inv = (1.0f / amax) * 127.0f;
      auto* q = reinterpret_cast<std::int8_t*>(blob + r * cols);
      for (std::int64_t c = 0; c < cols; ++c)
        q[c] = amax == 0.0f ? std::int8_t{0} : static_cast<std::int8_t>(std::nearbyint(x[c] * inv));
      store_f32(blob + layout.scales + 4 * r, amax / 127.0f);
    }
  });
}

void quantize_gguf(QuantType type, const void* src, FloatDType in, std::int64_t rows,
                   std::int64_t cols, void* dst) {
  const QuantFormat format{.type = type};
  check_quant_shape(format, rows, cols);
  using BlockFn = void (*)(const float*, std::uint8_t*, std::int64_t);
  BlockFn fn = nullptr;
  int elements = quant::kQK, bytes = 0;
  switch (type) {
    case QuantType::kQ8_0:
      fn = quantize_q8_0, bytes = quant::kQ8_0Bytes;
      break;
    case QuantType::kQ4_0:
      fn = quantize_q4_0, bytes = quant::kQ4_0Bytes;
      break;
    case QuantType::kQ4_1:
      fn = quantize_q4_1, bytes = quant::kQ4_1Bytes;
      break;
    case QuantType::kQ4_K:
      fn = quantize_q4_k, elements = quant::kQKK, bytes = quant::kQ4_KBytes;
      break;
    case QuantType::kQ6_K:
      fn = quantize_q6_k, elements = quant::kQKK, bytes = quant::kQ6_KBytes;
      break;
    case QuantType::kGgufMXFP4:
      throw Error("MXFP4 is read from GGUF files that store it; Rondo does not quantise to it");
    default:
      throw Error(std::string("quantize_gguf: ") + to_string(type) + " is not a GGUF type");
  }
  auto* blob = static_cast<std::uint8_t*>(dst);
  for_each_block(rows * cols / elements, [&](std::size_t first, std::size_t last) {
    float x[quant::kQKK];
    for (auto b = static_cast<std::int64_t>(first); b < static_cast<std::int64_t>(last); ++b) {
      load_finite(src, in, b * elements, elements, cols, to_string(type), x);
      fn(x, blob + b * bytes, b);
    }
  });
}

void quantize(const QuantFormat& format, const void* src, FloatDType in, std::int64_t rows,
              std::int64_t cols, void* dst) {
  switch (format.type) {
    case QuantType::kNF4:
      quantize_nf4(format, src, in, rows, cols, dst);
      return;
    case QuantType::kInt8:
      quantize_int8_rows(src, in, rows, cols, dst);
      return;
    case QuantType::kMXFP4:
      throw Error(
          "MXFP4 is read from checkpoints that store it (GPT-OSS's experts); Rondo does not "
          "quantise to it: use nf4 or int8");
    default:
      quantize_gguf(format.type, src, in, rows, cols, dst);
  }
}

}  // namespace rondo::kernels
