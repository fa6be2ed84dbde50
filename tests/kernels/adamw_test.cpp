// The fused CPU AdamW kernel (kernels/cpu/adamw.h) against a float64 re-computation written here,
// on every SIMD path this CPU has (scalar, AVX2, AVX-512), every gradient and streaming dtype,
// with and without weight decay, over 10 steps; bf16/f16 rounding of special values; the
// gradient sum of squares; independence from the thread count. Torch-free: this binary also runs
// under ThreadSanitizer (scripts/test.sh). The comparison with torch.optim.AdamW itself is
// tests/oracle/test_adamw.py.
//
// Inputs are fresh random numbers each run; the seed is printed, and RONDO_TEST_SEED=<n> repeats
// a run.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../support/test_seed.h"
#include "adamw_test_support.h"
#include "kernels/cpu/adamw.h"
#include "kernels/error.h"

namespace rondo::kernels {
namespace {

using namespace adamw_test;  // adamw_test_support.h

// --- Seeds -----------------------------------------------------------------------------------

using rondo::test::rng_for_test;
using rondo::test::test_seed;

struct RefState {
  std::vector<double> p, m, v;     // exact values
  std::vector<double> ep, em, ev;  // error bounds of an f32 evaluation
};

struct StepInput {
  double lr, beta1, beta2, eps, wd, grad_scale;
  std::int64_t step;
};

void reference_step(RefState& s, const std::vector<double>& grad, const StepInput& in) {
  const double t = static_cast<double>(in.step);
  const double bc1 = 1.0 - std::pow(in.beta1, t), bc2 = 1.0 - std::pow(in.beta2, t);
  const double w = 1.0 - in.beta1, decay = 1.0 - in.lr * in.wd, c2 = 1.0 - in.beta2;
  const double bc2_sqrt = std::sqrt(bc2), neg_step = -in.lr / bc1;
  const bool from_m = std::fabs(w) < 0.5;
  for (std::size_t i = 0; i < grad.size(); ++i) {
    const double g = grad[i] * in.grad_scale, e_g = 2 * kU * std::fabs(g);
    const double diff = g - s.m[i], e_diff = e_g + s.em[i] + kU * std::fabs(diff);
    const double m1 = s.m[i] + w * diff;
    const double e_m1 = (from_m ? s.em[i] : e_g) + std::fabs(from_m ? w : w - 1) * e_diff +
                        kU * std::fabs(w * diff) + kU * std::fabs(m1);
    const double a = s.v[i] * in.beta2, e_a = in.beta2 * s.ev[i] + 2 * kU * std::fabs(a);
    const double q = c2 * g, e_q = c2 * e_g + 2 * kU * std::fabs(q);
    const double v1 = a + q * g;
    const double e_v1 = e_a + std::fabs(q) * e_g + std::fabs(g) * e_q + kU * std::fabs(v1);
    reference_master(s.p[i], s.ep[i], m1, e_m1, v1, e_v1,
                     {.decay = decay, .bc2_sqrt = bc2_sqrt, .eps = in.eps, .neg_step = neg_step});
    s.m[i] = m1;
    s.em[i] = e_m1;
    s.v[i] = v1;
    s.ev[i] = e_v1;
  }
}

// --- The kernel's state ----------------------------------------------------------------------

struct KernelState {
  std::vector<float> p, m, v;
  Storage stream;
  KernelState(std::size_t n, FloatDType stream_dtype) : p(n), m(n), v(n), stream(stream_dtype, n) {}
  AdamWTensor tensor(Storage& grad) {
    return {.n = p.size(),
            .grad = grad.data(),
            .grad_dtype = grad.dtype,
            .master = p.data(),
            .m = m.data(),
            .v = v.data(),
            .stream = stream.data(),
            .stream_dtype = stream.dtype};
  }
};

#if defined(__SANITIZE_THREAD__)
// Under ThreadSanitizer every access is instrumented: the large size is cut to one that still
// spreads over many tiles and threads.
constexpr std::size_t kLarge = 100'003;
#else
constexpr std::size_t kLarge = 1'000'000;
#endif
// Not multiples of the SIMD widths (1, 22, 4097) next to ones that are (64), and one large enough
// to run on several threads.
const std::size_t kSizes[] = {1, 22, 64, 4097, kLarge};
constexpr int kSteps = 10;

// Random initial state and gradients of the magnitudes training sees.
void random_init(std::mt19937_64& rng, KernelState& k, RefState& r, std::vector<double>& g_mag) {
  std::uniform_real_distribution<double> unit;
  const std::size_t n = k.p.size();
  r.p.resize(n), r.m.resize(n), r.v.resize(n);
  r.ep.assign(n, 0), r.em.assign(n, 0), r.ev.assign(n, 0);
  g_mag.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    // Per-element gradient magnitude over six decades, so sqrt(v) meets eps at the small end.
    g_mag[i] = std::pow(10.0, -6.0 + 6.0 * unit(rng));
    k.p[i] = static_cast<float>(nonzero(0.1 * symmetric(rng)));
    k.m[i] = static_cast<float>(nonzero(0.1 * g_mag[i] * symmetric(rng)));
    const double s = g_mag[i] * symmetric(rng);
    k.v[i] = static_cast<float>(nonzero(0.01 * s * s));
    r.p[i] = k.p[i], r.m[i] = k.m[i], r.v[i] = k.v[i];
  }
}

void random_grad(std::mt19937_64& rng, const std::vector<double>& g_mag, Storage& grad,
                 std::vector<double>& exact) {
  exact.resize(g_mag.size());
  for (std::size_t i = 0; i < g_mag.size(); ++i) {
    exact[i] = grad.put(i, static_cast<float>(g_mag[i] * symmetric(rng)));
    if (exact[i] == 0) exact[i] = grad.put(i, static_cast<float>(g_mag[i]));
  }
}

// --- AdamW against the float64 reference ------------------------------------------------------

class AdamWKernel : public ::testing::TestWithParam<Combo> {};

TEST_P(AdamWKernel, MatchesFloat64ReferenceAndScalarPathOver10Steps) {
  const auto [path, grad_dtype, stream_dtype] = GetParam();
  if (!simd_path_supported(path)) GTEST_SKIP() << path_skip_reason(path);
  std::mt19937_64 rng = rng_for_test();
  std::uniform_real_distribution<double> unit;
  for (std::size_t n : kSizes) {
    for (double wd : {0.0, 0.1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " weight_decay=" + std::to_string(wd));
      KernelState kernel(n, stream_dtype);
      RefState ref;
      std::vector<double> g_mag, g_exact;
      random_init(rng, kernel, ref, g_mag);
      KernelState scalar = kernel;  // the reference path, for the bit-for-bit comparison
      Storage grad(grad_dtype, n);
      for (int step = 1; step <= kSteps; ++step) {
        random_grad(rng, g_mag, grad, g_exact);
        // grad_scale as global-norm clipping and loss-scale unscaling make it: anything but 1.
        const StepInput in{.lr = 1e-2,
                           .beta1 = 0.9,
                           .beta2 = 0.999,
                           .eps = 1e-8,
                           .wd = wd,
                           .grad_scale = 0.25 + 1.5 * unit(rng),
                           .step = step};
        const AdamWParams params{.lr = in.lr,
                                 .beta1 = in.beta1,
                                 .beta2 = in.beta2,
                                 .eps = in.eps,
                                 .weight_decay = in.wd,
                                 .step = in.step,
                                 .grad_scale = in.grad_scale};
        reference_step(ref, g_exact, in);
        adamw_step(kernel.tensor(grad), params, path);
        if (path != SimdPath::kScalar) adamw_step(scalar.tensor(grad), params, SimdPath::kScalar);
      }
      EXPECT_TRUE(within_bound("master", kernel.p, ref.p, ref.ep));
      EXPECT_TRUE(within_bound("m", kernel.m, ref.m, ref.em));
      EXPECT_TRUE(within_bound("v", kernel.v, ref.v, ref.ev));
      EXPECT_TRUE(stream_is_rounded_master(kernel.p, kernel.stream));
      if (path != SimdPath::kScalar) {
        EXPECT_EQ(first_difference(kernel.p, scalar.p), -1) << "master differs from scalar path";
        EXPECT_EQ(first_difference(kernel.m, scalar.m), -1) << "m differs from scalar path";
        EXPECT_EQ(first_difference(kernel.v, scalar.v), -1) << "v differs from scalar path";
        EXPECT_EQ(kernel.stream.bytes, scalar.stream.bytes) << "stream differs from scalar path";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPathsAndDtypes, AdamWKernel, every_combo(), combo_name);

class AdamWPath : public SimdPathTest {};

// torch's lerp switches form when the weight 1 - β1 reaches 0.5; β1 = 0 must make m = g exactly.
TEST_P(AdamWPath, SmallBeta1UsesTheOtherLerpForm) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 4097;
  for (double beta1 : {0.0, 0.3, 0.5}) {
    SCOPED_TRACE("beta1=" + std::to_string(beta1));
    KernelState kernel(n, FloatDType::kBF16);
    RefState ref;
    std::vector<double> g_mag, g_exact;
    random_init(rng, kernel, ref, g_mag);
    Storage grad(FloatDType::kBF16, n);
    for (int step = 1; step <= 3; ++step) {
      random_grad(rng, g_mag, grad, g_exact);
      const StepInput in{.lr = 1e-3,
                         .beta1 = beta1,
                         .beta2 = 0.99,
                         .eps = 1e-8,
                         .wd = 0.01,
                         .grad_scale = 1.0,
                         .step = step};
      reference_step(ref, g_exact, in);
      adamw_step(kernel.tensor(grad),
                 {.lr = in.lr,
                  .beta1 = beta1,
                  .beta2 = in.beta2,
                  .eps = in.eps,
                  .weight_decay = in.wd,
                  .step = step},
                 GetParam());
      if (beta1 == 0.0) {
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_EQ(kernel.m[i], g_exact[i]) << "index " << i;
      }
    }
    EXPECT_TRUE(within_bound("master", kernel.p, ref.p, ref.ep));
    EXPECT_TRUE(within_bound("m", kernel.m, ref.m, ref.em));
  }
}

// --- Rounding to bf16 and f16 --------------------------------------------------------------------

struct Special {
  std::uint32_t f32;
  std::uint16_t want;
  const char* what;
};

const Special kBf16Specials[] = {
    {0x7FC00000, 0x7FC0, "quiet NaN"},
    {0xFFC00000, 0xFFC0, "negative quiet NaN"},
    {0x7F800001, 0x7FC0, "signalling NaN whose payload is all in the dropped half (not Inf!)"},
    {0xFF800001, 0xFFC0, "negative signalling NaN, payload in the dropped half"},
    {0x7FA00000, 0x7FE0, "signalling NaN with a high payload"},
    {0x7F800000, 0x7F80, "+Inf"},
    {0xFF800000, 0xFF80, "-Inf"},
    {0x7F7FFFFF, 0x7F80, "FLT_MAX rounds up to Inf, as torch's .to(bfloat16)"},
    {0xFF7FFFFF, 0xFF80, "-FLT_MAX rounds to -Inf"},
    {0x7F7F0000, 0x7F7F, "largest finite bf16 stays"},
    {0xFF7F0000, 0xFF7F, "most negative finite bf16 stays"},
    {0x7F7F7FFF, 0x7F7F, "just below the overflow tie"},
    {0x7F7F8000, 0x7F80, "overflow tie: to even, which is Inf"},
    {0x3F808000, 0x3F80, "tie 1 + 2^-8: down to even"},
    {0x3F818000, 0x3F82, "tie 1 + 3*2^-8: up to even"},
    {0x3F808001, 0x3F81, "just above a tie"},
    {0x3F807FFF, 0x3F80, "just below a tie"},
    {0xBF808000, 0xBF80, "negative tie: down to even"},
    {0xBF818000, 0xBF82, "negative tie: up to even"},
    {0x00018000, 0x0002, "subnormal tie: up to even"},
    {0x80018000, 0x8002, "negative subnormal tie"},
    {0x00008001, 0x0001, "smallest subnormal, from above the tie"},
    {0x007FFFFF, 0x0080, "largest subnormal rounds to the smallest normal"},
    {0x3F800000, 0x3F80, "1 exactly"},
};

const Special kF16Specials[] = {
    {0x7FC00000, 0x7E00, "quiet NaN"},
    {0xFFC00000, 0xFE00, "negative quiet NaN"},
    {0x7F800000, 0x7C00, "+Inf"},
    {0xFF800000, 0xFC00, "-Inf"},
    {0x477FE000, 0x7BFF, "65504, the largest finite f16"},
    {0x477FEFFF, 0x7BFF, "just below the overflow tie"},
    {0x477FF000, 0x7C00, "65520, the overflow tie: to even, which is Inf"},
    {0xC77FF000, 0xFC00, "-65520 to -Inf"},
    {0x7F7FFFFF, 0x7C00, "FLT_MAX to Inf"},
    {0x3F801000, 0x3C00, "tie 1 + 2^-11: down to even"},
    {0x3F803000, 0x3C02, "tie 1 + 3*2^-11: up to even"},
    {0x33800000, 0x0001, "2^-24, the smallest subnormal"},
    {0x33C00000, 0x0002, "3*2^-25, a subnormal tie: up to even"},
    {0x33000001, 0x0001, "just above 2^-25 (the tie with zero)"},
    {0x387FE000, 0x0400, "tie between the largest subnormal and the smallest normal: to even"},
};

// A pattern of specials, repeated to a length that is no multiple of a SIMD width, so that each
// special lands in vector lanes and in the scalar tail.
std::vector<float> repeat_specials(const Special* specials, std::size_t count, std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i)
    x[i] = float_of(specials[i % count].f32);
  return x;
}

TEST_P(AdamWPath, CastRoundsSpecialValuesToBf16AndF16) {
  for (FloatDType dtype : {FloatDType::kBF16, FloatDType::kF16}) {
    const Special* specials = dtype == FloatDType::kBF16 ? kBf16Specials : kF16Specials;
    const std::size_t count =
        dtype == FloatDType::kBF16 ? std::size(kBf16Specials) : std::size(kF16Specials);
    const std::size_t n = 5 * count + 3;
    const std::vector<float> src = repeat_specials(specials, count, n);
    Storage out(dtype, n);
    cast_from_f32(src.data(), out.data(), dtype, n, GetParam());
    for (std::size_t i = 0; i < n; ++i) {
      const Special& s = specials[i % count];
      const std::uint16_t want_ref =
          dtype == FloatDType::kBF16 ? ref_bf16(src[i]) : ref_f16(src[i]);
      ASSERT_TRUE(same_value(s.want, want_ref, dtype))
          << "the test's own tables disagree on " << s.what;
      if (dtype == FloatDType::kBF16) {
        EXPECT_EQ(out.half(i), s.want) << to_string(dtype) << " " << s.what << " at index " << i;
      } else {
        EXPECT_TRUE(same_value(out.half(i), s.want, dtype))
            << to_string(dtype) << " " << s.what << " at index " << i << ": got 0x" << std::hex
            << out.half(i) << ", want 0x" << s.want;
      }
    }
  }
}

TEST_P(AdamWPath, CastMatchesNearestEvenOnRandomBitPatterns) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = 100'003;  // all exponents, NaNs and Infs included, over several tiles
  std::vector<float> src(n);
  for (auto& x : src)
    x = float_of(static_cast<std::uint32_t>(rng()));
  for (FloatDType dtype : {FloatDType::kBF16, FloatDType::kF16}) {
    Storage out(dtype, n);
    cast_from_f32(src.data(), out.data(), dtype, n, GetParam());
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t want = dtype == FloatDType::kBF16 ? ref_bf16(src[i]) : ref_f16(src[i]);
      ASSERT_TRUE(same_value(out.half(i), want, dtype))
          << to_string(dtype) << " of bits 0x" << std::hex << bits_of(src[i]) << " is 0x"
          << out.half(i) << ", want 0x" << want << std::dec << " (index " << i << ")";
    }
  }
  std::vector<float> copy(n);
  cast_from_f32(src.data(), copy.data(), FloatDType::kF32, n, GetParam());
  EXPECT_EQ(std::memcmp(copy.data(), src.data(), 4 * n), 0);
}

// The update's own arithmetic keeps NaN and Inf masters, and the streaming copy keeps them too.
// lr = 0 and no decay leave every finite master unchanged, so the copy is the specials rounded.
TEST_P(AdamWPath, UpdateKeepsNaNAndInfInTheStreamingCopy) {
  const std::size_t count = std::size(kBf16Specials);
  const std::size_t n = 3 * count + 5;
  std::vector<float> p = repeat_specials(kBf16Specials, count, n);
  std::vector<float> m(n, 1e-3f), v(n, 1e-6f), g(n, 2e-3f);
  Storage out(FloatDType::kBF16, n);
  adamw_step({.n = n,
              .grad = g.data(),
              .grad_dtype = FloatDType::kF32,
              .master = p.data(),
              .m = m.data(),
              .v = v.data(),
              .stream = out.data(),
              .stream_dtype = FloatDType::kBF16},
             {.lr = 0.0, .weight_decay = 0.0, .step = 1}, GetParam());
  for (std::size_t i = 0; i < n; ++i) {
    const Special& s = kBf16Specials[i % count];
    // Arithmetic quiets a signalling NaN (setting bit 22), which bf16 keeps.
    const std::uint16_t want = std::isnan(float_of(s.f32)) ? (s.want | 0x0040) : s.want;
    EXPECT_TRUE(same_value(out.half(i), want, FloatDType::kBF16))
        << s.what << " at index " << i << ": got 0x" << std::hex << out.half(i);
    if (!std::isnan(float_of(s.f32))) {
      EXPECT_EQ(bits_of(p[i]), s.f32) << s.what;
    }
  }
}

// --- Sum of squares ------------------------------------------------------------------------------

TEST_P(AdamWPath, GradSumSquaresIsAccurateInEveryDtype) {
  std::mt19937_64 rng = rng_for_test();
  std::uniform_real_distribution<double> unit;
  for (FloatDType dtype : kDtypes) {
    for (std::size_t n :
         {std::size_t{1}, std::size_t{22}, std::size_t{64}, std::size_t{4097}, kLarge}) {
      Storage g(dtype, n);
      long double exact = 0;  // 64-bit significand: exact enough to judge a double sum
      for (std::size_t i = 0; i < n; ++i) {
        double x =
            g.put(i, static_cast<float>(std::pow(10.0, -3 + 3 * unit(rng)) * symmetric(rng)));
        if (x == 0) x = g.put(i, 1e-3f);
        exact += static_cast<long double>(x) * x;
      }
      const double got = grad_sum_squares(g.data(), dtype, n, GetParam());
      // Any order of double additions of n positive terms is within n*2^-53 of the sum; a float
      // accumulation of 1M terms misses by about 1e-4 relative.
      const double tol = static_cast<double>(n) * 0x1p-53 * static_cast<double>(exact);
      EXPECT_NEAR(got, static_cast<double>(exact), tol)
          << to_string(dtype) << " n=" << n << " relative error "
          << std::fabs(got - static_cast<double>(exact)) / static_cast<double>(exact);
    }
  }
  const float inf[3] = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  EXPECT_TRUE(std::isinf(grad_sum_squares(inf, FloatDType::kF32, 3, GetParam())));
  std::vector<float> nan(100, 1.0f);
  nan[70] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(grad_sum_squares(nan.data(), FloatDType::kF32, 100, GetParam())))
      << "a NaN gradient must reach the norm, so that the step is skipped";
}

// Gradients on NVMe are summed as they come down a chunk at a time: in ranges cut anywhere (the
// chunks cut at multiples of 256 elements, tiles are 8192), the stream gives the sum of the whole
// bit for bit, so the clip coefficient, and every update, is the same as in memory.
TEST_P(AdamWPath, GradSumSquaresInRangesIsTheWholesBitForBit) {
  std::mt19937_64 rng = rng_for_test();
  for (FloatDType dtype : kDtypes)
    for (std::size_t n : {std::size_t{1}, std::size_t{8191}, std::size_t{8192}, std::size_t{8193},
                          std::size_t{3 * 8192 + 17}, kLarge}) {
      Storage g(dtype, n);
      for (std::size_t i = 0; i < n; ++i)
        g.put(i, static_cast<float>(symmetric(rng)));
      const double whole = grad_sum_squares(g.data(), dtype, n, GetParam());
      for (std::size_t cut : {std::size_t{256}, std::size_t{8192}, std::size_t{5000}, n}) {
        SumSquaresStream stream(dtype, n, GetParam());
        const auto* p = static_cast<const std::uint8_t*>(g.data());
        for (std::size_t at = 0; at < n;) {
          // Ranges around `cut` elements, some shorter: a carried tile may take several.
          const std::size_t count =
              std::min(n - at, std::max<std::size_t>(1, cut - (rng() % 2) * (cut / 3)));
          stream.add(p + at * dtype_size(dtype), count);
          at += count;
        }
        EXPECT_EQ(stream.total(), whole) << to_string(dtype) << " n=" << n << " cut " << cut;
      }
    }
  SumSquaresStream early(FloatDType::kF32, 10);
  EXPECT_THROW((void)early.total(), InternalError);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, AdamWPath, ::testing::ValuesIn(kPaths), path_name);

// A tied tensor's gradients summed for the optimizer: 0 + a, then + b, in f32 from the stored
// values (decoded here), so a -0 becomes +0 as in torch's accumulation; large enough for the
// parallel tiles, with a ragged tail.
TEST(AdamWGradAccumulate, SumsInF32FromZero) {
  std::mt19937_64 rng = rng_for_test();
  for (FloatDType dtype : kDtypes)
    for (std::size_t n : {std::size_t{5}, kLarge + 3}) {
      Storage a(dtype, n), b(dtype, n);
      std::vector<float> want(n);
      for (std::size_t i = 0; i < n; ++i) {
        const float x =
            static_cast<float>(a.put(i, i == 1 ? -0.0f : static_cast<float>(symmetric(rng))));
        const float y =
            static_cast<float>(b.put(i, i == 1 ? -0.0f : static_cast<float>(symmetric(rng))));
        want[i] = (0.0f + x) + y;
      }
      std::vector<float> sum(n, 42.0f);
      grad_accumulate(sum.data(), a.data(), dtype, n, /*first=*/true);
      EXPECT_FALSE(std::signbit(sum[1])) << to_string(dtype) << ": 0 + (-0) is +0";
      grad_accumulate(sum.data(), b.data(), dtype, n, /*first=*/false);
      EXPECT_EQ(first_difference(sum, want), -1) << to_string(dtype) << " n=" << n;
    }
}

// --- Threads, paths, errors --------------------------------------------------------------------

// One thread and all threads give the same bits: tiles are independent and the sum of squares
// adds per-tile partials in tile order.
TEST(AdamWThreads, ResultsDoNotDependOnTheThreadCount) {
  std::mt19937_64 rng = rng_for_test();
  const std::size_t n = kLarge;
  KernelState a(n, FloatDType::kBF16);
  RefState unused;
  std::vector<double> g_mag, g_exact;
  random_init(rng, a, unused, g_mag);
  KernelState b = a;
  Storage grad(FloatDType::kBF16, n);
  random_grad(rng, g_mag, grad, g_exact);
  const AdamWParams params{.lr = 1e-3, .weight_decay = 0.1, .step = 7, .grad_scale = 0.5};
  const int many = std::max(2, tbb::this_task_arena::max_concurrency());
  double sum_one = 0, sum_many = 0;
  tbb::task_arena(1).execute([&] {
    adamw_step(a.tensor(grad), params);
    sum_one = grad_sum_squares(grad.data(), grad.dtype, n);
  });
  tbb::task_arena(many).execute([&] {
    adamw_step(b.tensor(grad), params);
    sum_many = grad_sum_squares(grad.data(), grad.dtype, n);
  });
  EXPECT_EQ(first_difference(a.p, b.p), -1);
  EXPECT_EQ(first_difference(a.m, b.m), -1);
  EXPECT_EQ(first_difference(a.v, b.v), -1);
  EXPECT_EQ(a.stream.bytes, b.stream.bytes);
  EXPECT_EQ(sum_one, sum_many);
}

TEST(AdamWPaths, AutoPicksTheWidestPathAndExplicitOnesAreChecked) {
  const SimdPath used = simd_path_resolve(SimdPath::kAuto);
  std::cout << "AdamW runs on the " << to_string(used) << " path here (avx2 "
            << (simd_path_supported(SimdPath::kAvx2) ? "yes" : "no") << ", avx512 "
            << (simd_path_supported(SimdPath::kAvx512) ? "yes" : "no") << ")\n";
  if (std::getenv("RONDO_SIMD") == nullptr) {
    const SimdPath widest = simd_path_supported(SimdPath::kAvx512) ? SimdPath::kAvx512
                            : simd_path_supported(SimdPath::kAvx2) ? SimdPath::kAvx2
                                                                   : SimdPath::kScalar;
    EXPECT_EQ(used, widest);
  }
  for (SimdPath p : kPaths) {
    if (simd_path_supported(p)) {
      EXPECT_EQ(simd_path_resolve(p), p);
    } else {
      EXPECT_THROW(simd_path_resolve(p), Error) << to_string(p);
    }
  }
}

TEST(AdamWErrors, ListsEveryBadHyperParameterAtOnce) {
  float x = 1.0f;
  const AdamWTensor t{.n = 1, .grad = &x, .master = &x, .m = &x, .v = &x};
  try {
    adamw_step(t, {.lr = -1.0,
                   .beta1 = 1.0,
                   .beta2 = -0.5,
                   .eps = -1.0,
                   .weight_decay = -0.1,
                   .step = 0,
                   .grad_scale = std::numeric_limits<double>::infinity()});
    FAIL() << "accepted invalid hyper-parameters";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* field : {"lr", "beta1", "beta2", "eps", "weight_decay", "step", "grad_scale"})
      EXPECT_NE(what.find(field), std::string::npos) << field << " missing from: " << what;
  }
  const AdamWTensor missing{.n = 4, .grad = &x, .master = &x};
  EXPECT_THROW(adamw_step(missing, {}), Error);
  EXPECT_NO_THROW(adamw_step({.n = 0}, {}));
}

}  // namespace
}  // namespace rondo::kernels
