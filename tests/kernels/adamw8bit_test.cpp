// The 8-bit CPU AdamW kernel (kernels/cpu/adamw8bit.h) and bitsandbytes' dynamic maps and
// quantiser (kernels/cpu/dynamic_map.h) against float64 re-computations of bitsandbytes' published
// algorithm written here, on every SIMD path this CPU has, every gradient and streaming dtype,
// sizes that are not multiples of the block (1, 22, 255, 257, 4099, 70001), a block whose
// gradient is zero (absmax 0), ranges, threads and many steps. The SIMD paths must equal the
// scalar path bit for bit. Torch-free (also runs under ThreadSanitizer); the comparison with
// bitsandbytes itself is tests/oracle/test_adamw.py.
//
// The reference is checked one step at a time from the kernel's own state: quantisation rounds,
// so two correct evaluations that differ by an ulp can pick neighbouring codes, after which
// their trajectories differ by a quantisation step. Per step, everything the kernel computes in
// f32 carries a first-order error bound (adamw_test_support.h); a code is accepted when it is the
// table's code of a bin the bound allows.
//
// Inputs are fresh random numbers each run; the seed is printed, and RONDO_TEST_SEED=<n> repeats
// a run.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../support/test_seed.h"
#include "adamw_test_support.h"
#include "kernels/cpu/adamw8bit.h"
#include "kernels/cpu/dynamic_map.h"
#include "kernels/error.h"
#include "kernels/quant_blocks.h"

namespace rondo::kernels {
namespace {

using namespace adamw_test;  // adamw_test_support.h
using rondo::test::rng_for_test;

constexpr std::size_t kBlock = kAdamW8bitBlock;

// --- The maps ------------------------------------------------------------------------------------

const DynamicMap& map_of(Moment moment) {
  return moment == Moment::kFirst ? dynamic_map_signed() : dynamic_map_unsigned();
}

// create_dynamic_map in float64: 10^(i-6) times the midpoints of linspace(0.1, 1) of 2^i + 1
// (signed) or 2^(i+1) + 1 points, with negatives when signed, then 0 and 1; sorted.
std::vector<double> recipe_codes(bool is_signed) {
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
    for (int k = 0; k + 1 < items; ++k) {
      const double lo = 0.1 + 0.9 * k / (items - 1), hi = 0.1 + 0.9 * (k + 1) / (items - 1);
      const double mean = std::pow(10.0, i - 6) * (lo + hi) / 2;
      data.push_back(mean);
      if (is_signed) data.push_back(-mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  std::sort(data.begin(), data.end());
  return data;
}

TEST(DynamicMap, SignedMapIsBitsandbytesTableStoredForNf4) {
  // quant_blocks.h's copy was taken from bitsandbytes and is checked against it by test_quant.py;
  // ours is computed from the recipe.
  const float stored[256] = RONDO_DYNAMIC_MAP_CODE;
  for (int k = 0; k < 256; ++k)
    EXPECT_EQ(bits_of(dynamic_map_signed().code[k]), bits_of(stored[k])) << "code " << k;
}

TEST(DynamicMap, BothMapsFollowTheFloat64Recipe) {
  for (Moment moment : {Moment::kFirst, Moment::kSecond}) {
    const DynamicMap& map = map_of(moment);
    const std::vector<double> want = recipe_codes(moment == Moment::kFirst);
    ASSERT_EQ(want.size(), 256u);
    for (int k = 0; k < 256; ++k) {
      // linspace, the midpoint and the scaling each round once in f32 (the scale too).
      EXPECT_NEAR(map.code[k], want[k], 6 * kU * std::fabs(want[k])) << "code " << k;
      if (k > 0) {
        EXPECT_LT(map.code[k - 1], map.code[k]) << "codes must be sorted and distinct";
      }
    }
    EXPECT_EQ(map.code[255], 1.0f);
  }
  EXPECT_EQ(dynamic_map_unsigned().code[0], 0.0f);
  EXPECT_NEAR(dynamic_map_signed().code[0], -0.99296875, 1e-7)
      << "the signed map stops short of -1";
}

// Whether code k is (one of) the nearest to x among the map's codes; ties blur by the f32 rounding
// of the table's midpoints and grid points (a few 1e-8), hence the slack.
bool nearest_code(const DynamicMap& map, double x, int k) {
  const float* end = map.code + 256;
  const auto right =
      static_cast<int>(std::lower_bound(map.code, end, static_cast<float>(x)) - map.code);
  double best = std::numeric_limits<double>::infinity();
  for (int j = std::max(0, right - 2); j <= std::min(255, right + 1); ++j)
    best = std::min(best, std::fabs(map.code[j] - x));
  return std::fabs(map.code[k] - x) <= best + 1e-6;
}

// The table's meaning: bin i holds the code nearest to the grid point -1 + 2i / 65535.
TEST(DynamicMap, EachBinHoldsTheCodeNearestToItsGridPoint) {
  for (Moment moment : {Moment::kFirst, Moment::kSecond}) {
    const DynamicMap& map = map_of(moment);
    for (int i = 0; i < DynamicMap::kBins; ++i) {
      const double grid = -1.0 + 2.0 * i / 65535.0;
      ASSERT_TRUE(nearest_code(map, grid, map.bin_code[i]))
          << (moment == Moment::kFirst ? "signed" : "unsigned") << " bin " << i << " (grid point "
          << grid << ") holds code " << int{map.bin_code[i]} << " = " << map.code[map.bin_code[i]];
    }
  }
}

// --- The quantiser against float64 --------------------------------------------------------------

// Whether `got` is a code the kernel may write for a value whose exact scaled value (value /
// absmax) is `scaled`, when its f32 evaluation may be off by `e_scaled`: the bin is
// (int)((clamp(scaled) + 1) / 2 * 65535 + 0.5), whose own f32 evaluation adds a few units in the
// last place of 65535 (the (v + 1) and the fused multiply-add); the code is the one nearest to the
// bin's grid point.
bool allowed_code(const DynamicMap& map, double scaled, double e_scaled, std::uint8_t got) {
  const double v = std::clamp(scaled, -1.0, 1.0);
  const double t = (v + 1.0) / 2.0 * 65535.0 + 0.5;
  const double et = 2 * (e_scaled * 65535.0 / 2.0 + 2 * kU * 65535.0 / 2.0 + kU * 65536.0);
  const int lo = std::clamp(static_cast<int>(std::floor(t - et)), 0, 65535);
  const int hi = std::clamp(static_cast<int>(std::floor(t + et)), 0, 65535);
  for (int bin = lo; bin <= hi; ++bin)
    if (nearest_code(map, -1.0 + 2.0 * bin / 65535.0, got)) return true;
  return false;
}

// Checks one block's absmax and codes against exact values x with f32 error bounds ex (as the
// kernel computed them). An all-zero block must have absmax 0 and code 0.
::testing::AssertionResult block_matches(const DynamicMap& map, const double* x, const double* ex,
                                         std::size_t len, float absmax, const std::uint8_t* codes) {
  double amax = 0, e_amax = 0;
  for (std::size_t j = 0; j < len; ++j) {
    amax = std::max(amax, std::fabs(x[j]));
    e_amax = std::max(e_amax, ex[j]);
  }
  if (amax == 0 && e_amax == 0) {
    for (std::size_t j = 0; j < len; ++j)
      if (codes[j] != 0)
        return ::testing::AssertionFailure() << "zero block: code " << int{codes[j]} << " at " << j;
    if (absmax != 0.0f) return ::testing::AssertionFailure() << "zero block: absmax " << absmax;
    return ::testing::AssertionSuccess();
  }
  if (std::fabs(absmax - amax) > 2 * e_amax)
    return ::testing::AssertionFailure()
           << "absmax " << absmax << ", float64 reference " << amax << " +- " << 2 * e_amax;
  for (std::size_t j = 0; j < len; ++j) {
    const double scaled = x[j] / amax;
    const double e_scaled =
        ex[j] / amax + std::fabs(scaled) * e_amax / amax + 2 * kU * std::fabs(scaled);
    if (!allowed_code(map, scaled, e_scaled, codes[j]))
      return ::testing::AssertionFailure()
             << "element " << j << " of the block: value " << x[j] << " (scaled " << scaled
             << " +- " << e_scaled << ") got code " << int{codes[j]} << " = " << map.code[codes[j]];
  }
  return ::testing::AssertionSuccess();
}

const std::size_t kSizes[] = {1, 22, 255, 257, 4099, 70'001};

// Magnitudes that change per block by decades, as moments do across a weight matrix.
std::vector<double> block_scales(std::mt19937_64& rng, std::size_t n) {
  std::uniform_real_distribution<double> unit;
  std::vector<double> scale(n);
  double block_scale = 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % kBlock == 0) block_scale = std::pow(10.0, -6.0 + 5.0 * unit(rng));
    scale[i] = block_scale * std::pow(10.0, -3.0 * unit(rng));
  }
  return scale;
}

TEST(DynamicMapQuantize, MatchesFloat64OnBothMaps) {
  std::mt19937_64 rng = rng_for_test();
  for (Moment moment : {Moment::kFirst, Moment::kSecond}) {
    for (std::size_t n : kSizes) {
      SCOPED_TRACE("n=" + std::to_string(n));
      const std::vector<double> scale = block_scales(rng, n);
      std::vector<float> x(n);
      std::vector<double> exact(n), zero_error(n, 0.0);
      for (std::size_t i = 0; i < n; ++i) {
        const double s = symmetric(rng);
        x[i] = static_cast<float>(nonzero(scale[i] * (moment == Moment::kFirst ? s : s * s)));
        exact[i] = x[i];
      }
      if (n > 2 * kBlock) std::fill(x.begin() + kBlock, x.begin() + 2 * kBlock, 0.0f);  // absmax 0
      if (n > 2 * kBlock) std::fill(exact.begin() + kBlock, exact.begin() + 2 * kBlock, 0.0);
      std::vector<std::uint8_t> codes(n);
      std::vector<float> absmax(adamw8bit_blocks(n));
      quantize_moment(moment, x.data(), n, codes.data(), absmax.data());
      for (std::size_t b = 0; b < absmax.size(); ++b) {
        const std::size_t begin = b * kBlock, len = std::min(kBlock, n - begin);
        // The inputs are f32 already: only the scaling and the bin round.
        ASSERT_TRUE(block_matches(map_of(moment), &exact[begin], &zero_error[begin], len, absmax[b],
                                  &codes[begin]))
            << "block " << b;
      }
      std::vector<float> back(n);
      dequantize_moment(moment, codes.data(), absmax.data(), n, back.data());
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits_of(back[i]), bits_of(map_of(moment).code[codes[i]] * absmax[i / kBlock]))
            << "dequantised value " << i;
    }
  }
}

// --- The step against float64 -------------------------------------------------------------------

struct State8 {
  std::vector<float> p;
  std::vector<std::uint8_t> m_codes, v_codes;
  std::vector<float> m_absmax, v_absmax;
  Storage stream;
  State8(std::size_t n, FloatDType stream_dtype)
      : p(n),
        m_codes(n),
        v_codes(n),
        m_absmax(adamw8bit_blocks(n)),
        v_absmax(adamw8bit_blocks(n)),
        stream(stream_dtype, n) {}
  AdamW8bitTensor tensor(Storage& grad) {
    return {.n = p.size(),
            .grad = grad.data(),
            .grad_dtype = grad.dtype,
            .master = p.data(),
            .m_codes = m_codes.data(),
            .m_absmax = m_absmax.data(),
            .v_codes = v_codes.data(),
            .v_absmax = v_absmax.data(),
            .stream = stream.data(),
            .stream_dtype = stream.dtype};
  }
  // The elements [begin, end) as a tensor of their own (begin a multiple of the block).
  AdamW8bitTensor range(Storage& grad, std::size_t begin, std::size_t end) {
    AdamW8bitTensor t = tensor(grad);
    t.n = end - begin;
    t.grad = static_cast<const std::uint8_t*>(t.grad) + begin * dtype_size(grad.dtype);
    t.master += begin;
    t.m_codes += begin;
    t.v_codes += begin;
    t.m_absmax += begin / kBlock;
    t.v_absmax += begin / kBlock;
    t.stream = static_cast<std::uint8_t*>(t.stream) + begin * dtype_size(stream.dtype);
    return t;
  }
  bool operator==(const State8& o) const {
    return first_difference(p, o.p) == -1 && m_codes == o.m_codes && v_codes == o.v_codes &&
           first_difference(m_absmax, o.m_absmax) == -1 &&
           first_difference(v_absmax, o.v_absmax) == -1 && stream.bytes == o.stream.bytes;
  }
};

struct Hyper {
  double lr, beta1, beta2, eps, wd, grad_scale;
  std::int64_t step;
  AdamWParams params() const {
    return {.lr = lr,
            .beta1 = beta1,
            .beta2 = beta2,
            .eps = eps,
            .weight_decay = wd,
            .step = step,
            .grad_scale = grad_scale};
  }
};

// One step in float64 from the state `before` (the kernel's, before its step), checked against
// the state `after` (the kernel's, after it): the master within its bound, absmax and codes as
// block_matches allows.
::testing::AssertionResult step_matches(const State8& before, const State8& after,
                                        const std::vector<double>& grad, const Hyper& h) {
  const std::size_t n = grad.size();
  const double t = static_cast<double>(h.step);
  const MasterConstants mc{.decay = 1.0 - h.lr * h.wd,
                           .bc2_sqrt = std::sqrt(1.0 - std::pow(h.beta2, t)),
                           .eps = h.eps,
                           .neg_step = -h.lr / (1.0 - std::pow(h.beta1, t))};
  std::vector<double> p(n), ep(n, 0.0), m1(n), em1(n), v1(n), ev1(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t b = i / kBlock;
    const double g = grad[i] * h.grad_scale, e_g = 2 * kU * std::fabs(g);
    const double m =
        static_cast<double>(dynamic_map_signed().code[before.m_codes[i]]) * before.m_absmax[b];
    const double v =
        static_cast<double>(dynamic_map_unsigned().code[before.v_codes[i]]) * before.v_absmax[b];
    const double e_m = kU * std::fabs(m), e_v = kU * std::fabs(v);  // the dequantising multiply
    const double a = m * h.beta1, e_a = h.beta1 * e_m + 2 * kU * std::fabs(a);
    const double w = 1.0 - h.beta1;
    m1[i] = a + w * g;
    em1[i] = e_a + w * e_g + kU * w * std::fabs(g) + kU * std::fabs(m1[i]);
    const double c = v * h.beta2, e_c = h.beta2 * e_v + 2 * kU * std::fabs(c);
    const double q = (1.0 - h.beta2) * g, e_q = (1.0 - h.beta2) * e_g + 2 * kU * std::fabs(q);
    v1[i] = c + q * g;
    ev1[i] = e_c + std::fabs(q) * e_g + std::fabs(g) * e_q + kU * std::fabs(v1[i]);
    p[i] = before.p[i];
    reference_master(p[i], ep[i], m1[i], em1[i], v1[i], ev1[i], mc);
  }
  ::testing::AssertionResult master = within_bound("master", after.p, p, ep);
  if (!master) return master;
  for (std::size_t b = 0; b < after.m_absmax.size(); ++b) {
    const std::size_t begin = b * kBlock, len = std::min(kBlock, n - begin);
    ::testing::AssertionResult r = block_matches(dynamic_map_signed(), &m1[begin], &em1[begin], len,
                                                 after.m_absmax[b], &after.m_codes[begin]);
    if (!r) return r << " (m, block " << b << ")";
    r = block_matches(dynamic_map_unsigned(), &v1[begin], &ev1[begin], len, after.v_absmax[b],
                      &after.v_codes[begin]);
    if (!r) return r << " (v, block " << b << ")";
  }
  return stream_is_rounded_master(after.p, after.stream);
}

// What a test steps: a random state (moments quantised from random values, as after some training,
// or the fresh state), per-element gradient magnitudes over six decades, and a gradient buffer.
// Block 1, when there is a third block, gets zero gradients throughout: from the fresh state its
// moments stay exactly 0 (absmax 0).
struct Case8 {
  State8 state;
  Storage grad;
  std::vector<double> g_mag, g_exact;  // magnitudes; the current gradient's exact values

  Case8(std::mt19937_64& rng, std::size_t n, FloatDType grad_dtype, FloatDType stream_dtype,
        bool fresh)
      : state(n, stream_dtype), grad(grad_dtype, n), g_mag(n) {
    std::uniform_real_distribution<double> unit;
    std::vector<float> m(n), v(n);
    for (std::size_t i = 0; i < n; ++i) {
      g_mag[i] = std::pow(10.0, -6.0 + 6.0 * unit(rng));
      state.p[i] = static_cast<float>(nonzero(0.1 * symmetric(rng)));
      m[i] = static_cast<float>(nonzero(0.1 * g_mag[i] * symmetric(rng)));
      const double r = g_mag[i] * symmetric(rng);
      v[i] = static_cast<float>(nonzero(0.01 * r * r));
    }
    if (n > 2 * kBlock) std::fill(g_mag.begin() + kBlock, g_mag.begin() + 2 * kBlock, 0.0);
    if (fresh) return;  // codes and absmax stay all zero: m = v = 0
    quantize_moment(Moment::kFirst, m.data(), n, state.m_codes.data(), state.m_absmax.data());
    quantize_moment(Moment::kSecond, v.data(), n, state.v_codes.data(), state.v_absmax.data());
  }

  // A new random gradient of the case's magnitudes.
  void next_grad(std::mt19937_64& rng) {
    g_exact.resize(g_mag.size());
    for (std::size_t i = 0; i < g_mag.size(); ++i) {
      g_exact[i] = grad.put(i, static_cast<float>(g_mag[i] * symmetric(rng)));
      if (g_exact[i] == 0 && g_mag[i] != 0) g_exact[i] = grad.put(i, static_cast<float>(g_mag[i]));
    }
  }
  AdamW8bitTensor tensor() { return state.tensor(grad); }
};

class AdamW8bitKernel : public ::testing::TestWithParam<Combo> {};

TEST_P(AdamW8bitKernel, MatchesFloat64EachStepAndTheScalarPathBitForBit) {
  const auto [path, grad_dtype, stream_dtype] = GetParam();
  if (!simd_path_supported(path)) GTEST_SKIP() << path_skip_reason(path);
  std::mt19937_64 rng = rng_for_test();
  std::uniform_real_distribution<double> unit;
  for (std::size_t n : kSizes) {
    for (double wd : {0.0, 0.1}) {
      for (bool fresh : {true, false}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " weight_decay=" + std::to_string(wd) +
                     (fresh ? " from the fresh state" : " from a random state"));
        Case8 c(rng, n, grad_dtype, stream_dtype, fresh);
        State8 scalar = c.state;
        for (int step = 1; step <= 6; ++step) {
          c.next_grad(rng);
          const Hyper h{.lr = 1e-2 * (1.0 - 0.05 * step),  // a schedule: lr differs per step
                        .beta1 = 0.9,
                        .beta2 = 0.999,
                        .eps = 1e-8,
                        .wd = wd,
                        .grad_scale = 0.25 + 1.5 * unit(rng),
                        .step = step};
          const State8 before = c.state;
          adamw8bit_step(c.tensor(), h.params(), path);
          ASSERT_TRUE(step_matches(before, c.state, c.g_exact, h)) << "step " << step;
          if (path != SimdPath::kScalar) {
            adamw8bit_step(scalar.tensor(c.grad), h.params(), SimdPath::kScalar);
            ASSERT_TRUE(c.state == scalar) << "differs from the scalar path at step " << step;
          }
        }
        if (n > 2 * kBlock && fresh) {
          EXPECT_EQ(c.state.m_absmax[1], 0.0f) << "the zero-gradient block";
          EXPECT_EQ(c.state.v_absmax[1], 0.0f);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPathsAndDtypes, AdamW8bitKernel, every_combo(), combo_name);

class AdamW8bitPath : public SimdPathTest {};

// 300 steps from the fresh state, with β1 = 0 and 0.5 beside the default: every step against
// float64, the scalar path bit for bit.
TEST_P(AdamW8bitPath, ManyStepsFromTheFreshState) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 4099;
  for (double beta1 : {0.9, 0.5, 0.0}) {
    SCOPED_TRACE("beta1=" + std::to_string(beta1));
    Case8 c(rng, n, FloatDType::kBF16, FloatDType::kBF16, /*fresh=*/true);
    State8 scalar = c.state;
    for (int step = 1; step <= 300; ++step) {
      c.next_grad(rng);
      const Hyper h{.lr = 1e-3,
                    .beta1 = beta1,
                    .beta2 = 0.99,
                    .eps = 1e-8,
                    .wd = 0.01,
                    .grad_scale = 1.0,
                    .step = step};
      const State8 before = c.state;
      adamw8bit_step(c.tensor(), h.params(), GetParam());
      ASSERT_TRUE(step_matches(before, c.state, c.g_exact, h)) << "step " << step;
      adamw8bit_step(scalar.tensor(c.grad), h.params(), SimdPath::kScalar);
      ASSERT_TRUE(c.state == scalar) << "differs from the scalar path at step " << step;
    }
  }
}

// bitsandbytes leaves a NaN moment out of its block's absmax and gives it code 0; every path must
// do the same (the engine skips such steps, but the paths may not disagree on them).
TEST_P(AdamW8bitPath, NaNGradientIsLeftOutOfTheAbsmax) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 3 * kBlock + 5;
  Case8 c(rng, n, FloatDType::kF32, FloatDType::kBF16, /*fresh=*/false);
  State8 scalar = c.state;
  c.next_grad(rng);
  for (std::size_t i : {std::size_t{3}, kBlock + 17, n - 1})
    c.grad.put(i, std::numeric_limits<float>::quiet_NaN());
  const AdamWParams params{.lr = 1e-3, .step = 3};
  adamw8bit_step(c.tensor(), params, GetParam());
  adamw8bit_step(scalar.tensor(c.grad), params, SimdPath::kScalar);
  const State8& kernel = c.state;
  EXPECT_TRUE(kernel == scalar);
  for (std::size_t i : {std::size_t{3}, kBlock + 17, n - 1}) {
    EXPECT_TRUE(std::isnan(kernel.p[i])) << i;
    EXPECT_EQ(kernel.m_codes[i], 0) << i;
    EXPECT_EQ(kernel.v_codes[i], 0) << i;
    EXPECT_TRUE(std::isfinite(kernel.m_absmax[i / kBlock]) && kernel.m_absmax[i / kBlock] > 0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, AdamW8bitPath, ::testing::ValuesIn(kPaths), path_name);

// --- Ranges, threads, errors ---------------------------------------------------------------------

// A tensor stepped in block-aligned ranges (the last one ending at n) gives the bits of one call:
// how the engine streams state in chunks.
TEST(AdamW8bitRanges, BlockAlignedRangesGiveTheWholeTensorsBits) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 70'001;
  Case8 whole(rng, n, FloatDType::kBF16, FloatDType::kBF16, /*fresh=*/false);
  State8 pieces = whole.state;
  for (int step = 1; step <= 3; ++step) {
    whole.next_grad(rng);
    const AdamWParams params{.lr = 1e-3, .weight_decay = 0.1, .step = step};
    adamw8bit_step(whole.tensor(), params);
    const std::size_t cuts[] = {0, kBlock, 5 * kBlock, 40 * kBlock, 200 * kBlock, n};
    for (std::size_t k = 0; k + 1 < std::size(cuts); ++k)
      adamw8bit_step(pieces.range(whole.grad, cuts[k], cuts[k + 1]), params);
    ASSERT_TRUE(whole.state == pieces) << "step " << step;
  }
}

TEST(AdamW8bitThreads, ResultsDoNotDependOnTheThreadCount) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 300'007;
  Case8 a(rng, n, FloatDType::kBF16, FloatDType::kBF16, /*fresh=*/false);
  State8 b = a.state;
  a.next_grad(rng);
  const AdamWParams params{.lr = 1e-3, .weight_decay = 0.1, .step = 7, .grad_scale = 0.5};
  const int many = std::max(2, tbb::this_task_arena::max_concurrency());
  tbb::task_arena(1).execute([&] { adamw8bit_step(a.tensor(), params); });
  tbb::task_arena(many).execute([&] { adamw8bit_step(b.tensor(a.grad), params); });
  EXPECT_TRUE(a.state == b);
}

TEST(AdamW8bitErrors, RejectsBadHyperParametersAndNullArrays) {
  float x = 1.0f;
  std::uint8_t code = 0;
  const AdamW8bitTensor t{.n = 1,
                          .grad = &x,
                          .master = &x,
                          .m_codes = &code,
                          .m_absmax = &x,
                          .v_codes = &code,
                          .v_absmax = &x};
  try {
    adamw8bit_step(t, {.lr = -1.0, .beta1 = 1.0, .step = 0});
    FAIL() << "accepted invalid hyper-parameters";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* field : {"lr", "beta1", "step"})
      EXPECT_NE(what.find(field), std::string::npos) << field << " missing from: " << what;
  }
  AdamW8bitTensor missing = t;
  missing.v_absmax = nullptr;
  EXPECT_THROW(adamw8bit_step(missing, {}), Error);
  EXPECT_THROW(quantize_moment(Moment::kFirst, nullptr, 4, &code, &x), Error);
  EXPECT_NO_THROW(adamw8bit_step({.n = 0}, {}));
}

}  // namespace
}  // namespace rondo::kernels
