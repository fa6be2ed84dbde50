// Helpers shared by the CPU AdamW kernel tests (adamw_test.cpp, adamw8bit_test.cpp): the tests'
// own bf16/f16 rounding (written differently from the kernels' bit tricks on purpose), arrays of a
// storage dtype, the float64 reference of the master's update with its f32 error bound, and
// element-wise comparisons that report the worst index. Test code only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/simd.h"

namespace rondo::kernels {

// Names instead of bytes in gtest's parameter printouts (found by argument-dependent lookup).
inline void PrintTo(SimdPath path, std::ostream* os) {
  *os << to_string(path);
}
inline void PrintTo(FloatDType dtype, std::ostream* os) {
  *os << to_string(dtype);
}

namespace adamw_test {

// --- The test's own conversions: nearest representable value by distance, ties to the even
// pattern (written differently from the kernel's bit tricks on purpose) --------------------------

inline std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float float_of(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Rounds a magnitude `a` between the patterns lo and lo+1 whose values are vlo <= a < vhi.
inline std::uint32_t nearest(double a, std::uint32_t lo, double vlo, double vhi) {
  const double below = a - vlo, above = vhi - a;
  if (below < above) return lo;
  if (above < below) return lo + 1;
  return (lo % 2 == 0) ? lo : lo + 1;
}

inline std::uint16_t ref_bf16(float f) {
  const std::uint32_t sign = bits_of(f) & 0x80000000u;
  if (std::isnan(f)) return static_cast<std::uint16_t>((sign >> 16) | 0x7FC0);
  const float mag = std::fabs(f);
  std::uint32_t lo = bits_of(mag) >> 16;  // truncation: the pattern at or below
  if (lo >= 0x7F80) return static_cast<std::uint16_t>((sign >> 16) | 0x7F80);  // Inf
  const double vlo = float_of(lo << 16);
  // Above the largest finite bf16 the next "value" is 2^128: rounding there means overflow.
  const double vhi = (lo + 1 == 0x7F80) ? std::ldexp(1.0, 128) : float_of((lo + 1) << 16);
  return static_cast<std::uint16_t>((sign >> 16) | nearest(mag, lo, vlo, vhi));
}

inline double decode_f16(std::uint16_t h) {
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

inline std::uint16_t ref_f16(float f) {
  const std::uint16_t sign = (bits_of(f) & 0x80000000u) ? 0x8000 : 0;
  if (std::isnan(f)) return sign | 0x7E00;
  const double mag = std::fabs(static_cast<double>(f));
  if (mag >= 65536.0) return sign | 0x7C00;
  // The spacing of f16 values around mag: 2^-24 among subnormals, 2^(E-10) in [2^E, 2^(E+1)).
  int e;
  std::frexp(mag, &e);  // mag in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, std::max(e - 1, -14) - 10);
  const double lo = std::floor(mag / ulp) * ulp;  // exact: powers of two and small integers
  const std::uint32_t lo_units = static_cast<std::uint32_t>(std::min(lo / ulp, 4096.0));
  const double below = mag - lo, above = lo + ulp - mag;
  const double value = below < above || (below == above && lo_units % 2 == 0) ? lo : lo + ulp;
  if (value >= 65536.0) return sign | 0x7C00;  // past the largest finite, 65504: overflow
  if (value < 0x1p-14) return static_cast<std::uint16_t>(sign | static_cast<int>(value * 0x1p24));
  int ve;
  const double frac = std::frexp(value, &ve);  // value = frac * 2^ve, frac in [0.5, 1)
  const int mantissa = static_cast<int>((frac * 2 - 1) * 1024);
  return static_cast<std::uint16_t>(sign | ((ve - 1 + 15) << 10) | mantissa);
}

// Two storage patterns mean the same number (any NaN matches any NaN of the same sign).
inline bool same_value(std::uint16_t got, std::uint16_t want, FloatDType dtype) {
  const bool nan_got = dtype == FloatDType::kBF16 ? std::isnan(float_of(std::uint32_t{got} << 16))
                                                  : std::isnan(decode_f16(got));
  const bool nan_want = dtype == FloatDType::kBF16 ? std::isnan(float_of(std::uint32_t{want} << 16))
                                                   : std::isnan(decode_f16(want));
  if (nan_got || nan_want) return nan_got && nan_want && (got & 0x8000) == (want & 0x8000);
  return got == want;
}

// --- Arrays of a storage dtype -------------------------------------------------------------------

struct Storage {
  FloatDType dtype;
  std::vector<std::uint8_t> bytes;
  Storage(FloatDType d, std::size_t n) : dtype(d), bytes(n * dtype_size(d)) {}
  void* data() { return bytes.data(); }
  // Stores `x` rounded; returns the value stored, exactly.
  double put(std::size_t i, float x) {
    if (dtype == FloatDType::kF32) {
      std::memcpy(&bytes[4 * i], &x, 4);
      return x;
    }
    const std::uint16_t h = dtype == FloatDType::kBF16 ? ref_bf16(x) : ref_f16(x);
    std::memcpy(&bytes[2 * i], &h, 2);
    return get(i);
  }
  double get(std::size_t i) const {
    if (dtype == FloatDType::kF32) {
      float f;
      std::memcpy(&f, &bytes[4 * i], 4);
      return f;
    }
    std::uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    return dtype == FloatDType::kBF16 ? float_of(std::uint32_t{h} << 16) : decode_f16(h);
  }
  std::uint16_t half(std::size_t i) const {
    std::uint16_t h;
    std::memcpy(&h, &bytes[2 * i], 2);
    return h;
  }
};

// --- The float64 reference, with a running bound on the error of an f32 evaluation -------------
//
// Each quantity carries, next to its exact (float64) value, a first-order bound on how far any
// correct f32 evaluation in torch's order of operations may be from it: every f32 operation and
// every constant rounded to f32 adds at most u = 2^-24 of its magnitude, and errors of operands
// propagate through the operation's derivative. The kernel must stay within twice that bound
// (the factor covers second-order terms). A wrong formula, order or constant is off by far more.

inline constexpr double kU = 0x1p-24;

// The constants of the master's update, in float64.
struct MasterConstants {
  double decay, bc2_sqrt, eps, neg_step;
};

// The last part of a step, the same in both kernels: p = p * decay + (neg_step * m1) /
// (sqrt(v1) / bc2_sqrt + eps), from moments m1 and v1 with error bounds e_m1 and e_v1; updates p
// and its bound ep.
inline void reference_master(double& p, double& ep, double m1, double e_m1, double v1, double e_v1,
                             const MasterConstants& c) {
  const double p1 = p * c.decay, e_p1 = c.decay * ep + 2 * kU * std::fabs(p1);
  const double sq = std::sqrt(v1);
  const double e_sq = sq > 0 ? e_v1 / (2 * sq) + kU * sq : std::sqrt(e_v1);
  const double r = sq / c.bc2_sqrt, e_r = e_sq / c.bc2_sqrt + 2 * kU * r;
  const double den = r + c.eps, e_den = e_r + kU * c.eps + kU * den;
  const double num = c.neg_step * m1,
               e_num = std::fabs(c.neg_step) * e_m1 + 2 * kU * std::fabs(num);
  const double upd = num / den;
  const double e_upd = e_num / den + std::fabs(upd) * e_den / den + kU * std::fabs(upd);
  p = p1 + upd;
  ep = e_p1 + e_upd + kU * std::fabs(p);
}

// Element-wise |got - want| <= 2*bound (+ the smallest subnormal); reports the worst element.
inline ::testing::AssertionResult within_bound(const char* what, const std::vector<float>& got,
                                               const std::vector<double>& want,
                                               const std::vector<double>& bound) {
  double worst_ratio = -1;
  std::size_t worst = 0, failures = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = 2 * bound[i] + std::numeric_limits<float>::denorm_min();
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity() : err / tol;
    if (ratio > 1) ++failures;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << failures << " of " << got.size() << " elements outside the bound; "
         << "worst at index " << worst << ": got " << got[worst] << ", float64 reference "
         << want[worst] << ", error " << std::fabs(got[worst] - want[worst]) << " > allowed "
         << 2 * bound[worst] << " (" << worst_ratio << "x)";
}

// First index where two float arrays differ bit for bit, or -1.
inline long first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (bits_of(a[i]) != bits_of(b[i])) return static_cast<long>(i);
  return -1;
}

// The streaming copy equals the master rounded, bit for bit.
inline ::testing::AssertionResult stream_is_rounded_master(const std::vector<float>& p,
                                                           const Storage& stream) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    bool same;
    if (stream.dtype == FloatDType::kF32) {
      same = stream.get(i) == static_cast<double>(p[i]);
    } else {
      const std::uint16_t want = stream.dtype == FloatDType::kBF16 ? ref_bf16(p[i]) : ref_f16(p[i]);
      same = same_value(stream.half(i), want, stream.dtype);
    }
    if (!same)
      return ::testing::AssertionFailure()
             << "streaming copy (" << to_string(stream.dtype) << ") at index " << i << " is "
             << stream.get(i) << ", but the master " << p[i] << " rounds differently";
  }
  return ::testing::AssertionSuccess();
}

inline std::string path_skip_reason(SimdPath path) {
  return std::string("this CPU has no ") + to_string(path) + " (the widest it supports is " +
         to_string(simd_path_resolve(SimdPath::kAuto)) + ")";
}

// Random inputs are never zero: a zero would hide a missing term.
inline double nonzero(double x) {
  return x == 0 ? 1e-7 : x;
}

// Uniform in [-1, 1): the shape of the distribution does not matter here, and it is several
// times cheaper to draw than a normal one (this test draws tens of millions).
inline double symmetric(std::mt19937_64& rng) {
  return std::uniform_real_distribution<double>(-1.0, 1.0)(rng);
}

// --- Parametrisation shared by both kernels' tests ----------------------------------------------

inline const SimdPath kPaths[] = {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512};
inline const FloatDType kDtypes[] = {FloatDType::kF32, FloatDType::kF16, FloatDType::kBF16};

using Combo = std::tuple<SimdPath, FloatDType, FloatDType>;  // path, gradient, streaming copy

// Every SIMD path with every gradient and streaming dtype.
inline auto every_combo() {
  return ::testing::Combine(::testing::ValuesIn(kPaths), ::testing::ValuesIn(kDtypes),
                            ::testing::ValuesIn(kDtypes));
}

inline std::string combo_name(const ::testing::TestParamInfo<Combo>& info) {
  const auto [path, grad, stream] = info.param;
  return std::string(to_string(path)) + "_grad" + to_string(grad) + "_stream" + to_string(stream);
}

inline std::string path_name(const ::testing::TestParamInfo<SimdPath>& info) {
  return to_string(info.param);
}

// A test run once per SIMD path; skips itself on a path this CPU lacks.
class SimdPathTest : public ::testing::TestWithParam<SimdPath> {
 protected:
  void SetUp() override {
    if (!simd_path_supported(GetParam())) GTEST_SKIP() << path_skip_reason(GetParam());
  }
};

}  // namespace adamw_test
}  // namespace rondo::kernels
