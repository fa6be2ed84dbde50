// The SIMD loops of the CPU AdamW kernel, written once against an ISA traits struct and
// instantiated by adamw_avx2.cpp (Avx2: 8 lanes) and adamw_avx512.cpp (Avx512: 16 lanes), each
// compiled with its own -m flags. Not a public header: everything here has internal linkage so
// that no ISA-specific code is shared across translation units (Note [One ISA per translation
// unit] in adamw.cpp). The arithmetic is the scalar path's (adamw.cpp, adamw_scalar), operation
// for operation, so results are bit-identical; both files build with -ffp-contract=off so the
// compiler fuses nothing we did not write as a fused multiply-add.
//
// An ISA traits struct provides: kWidth (floats per vector), F (the float vector), set1, add,
// sub, mul, div, sqrt, fmadd(a, b, c) = a*b + c rounded once; load/store of f32, bf16 and f16
// lanes; D (a double vector of kWidth/2 lanes), dzero, lo_pd/hi_pd (widen the low/high half of an
// F), dfmadd, dstore.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/adamw_internal.h"

namespace rondo::kernels::detail {
namespace {

template <class Isa, FloatDType kType>
inline typename Isa::F load_lanes(const void* base, std::size_t i) {
  if constexpr (kType == FloatDType::kF32) {
    return Isa::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (kType == FloatDType::kBF16) {
    return Isa::load_bf16(static_cast<const std::uint16_t*>(base) + i);
  } else {
    return Isa::load_f16(static_cast<const std::uint16_t*>(base) + i);
  }
}

template <class Isa, FloatDType kType>
inline void store_lanes(void* base, std::size_t i, typename Isa::F x) {
  if constexpr (kType == FloatDType::kF32) {
    Isa::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (kType == FloatDType::kBF16) {
    Isa::store_bf16(static_cast<std::uint16_t*>(base) + i, x);
  } else {
    Isa::store_f16(static_cast<std::uint16_t*>(base) + i, x);
  }
}

// The f32 loop, a Body for run_by_dtypes below. kStream false: no streaming copy (kStreamType is
// then unused).
struct AdamWBody {
  template <class Isa, FloatDType kGrad, bool kStream, FloatDType kStreamType>
  static std::size_t run(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                         std::size_t end) {
    using F = typename Isa::F;
    constexpr std::size_t kW = Isa::kWidth;
    const F grad_scale = Isa::set1(c.grad_scale);
    const F decay = Isa::set1(c.decay);
    const F m_coeff = Isa::set1(c.m_coeff);
    const F beta2 = Isa::set1(c.beta2);
    const F one_minus_beta2 = Isa::set1(c.one_minus_beta2);
    const F bc2_sqrt = Isa::set1(c.bc2_sqrt);
    const F eps = Isa::set1(c.eps);
    const F neg_step = Isa::set1(c.neg_step);
    std::size_t i = begin;
    for (; i + kW <= end; i += kW) {
      const F g = Isa::mul(load_lanes<Isa, kGrad>(a.grad, i), grad_scale);
      const F p = Isa::mul(Isa::load_f32(a.master + i), decay);
      const F m = Isa::load_f32(a.m + i);
      const F m1 = Isa::fmadd(m_coeff, Isa::sub(g, m), c.m_from_m ? m : g);
      const F v1 =
          Isa::fmadd(Isa::mul(one_minus_beta2, g), g, Isa::mul(Isa::load_f32(a.v + i), beta2));
      const F denom = Isa::add(Isa::div(Isa::sqrt(v1), bc2_sqrt), eps);
      const F p1 = Isa::add(p, Isa::div(Isa::mul(neg_step, m1), denom));
      Isa::store_f32(a.m + i, m1);
      Isa::store_f32(a.v + i, v1);
      Isa::store_f32(a.master + i, p1);
      if constexpr (kStream) store_lanes<Isa, kStreamType>(a.stream, i, p1);
    }
    return i;
  }
};

// Body::run instantiated for the arrays' gradient and streaming dtypes (shared by the f32 and
// 8-bit kernels, whose array structs both have grad_dtype, stream and stream_dtype).
template <class Body, class Isa, FloatDType kGrad, class C, class A>
std::size_t run_by_stream(const C& c, const A& a, std::size_t begin, std::size_t end) {
  if (a.stream == nullptr)
    return Body::template run<Isa, kGrad, false, FloatDType::kF32>(c, a, begin, end);
  switch (a.stream_dtype) {
    case FloatDType::kF32:
      return Body::template run<Isa, kGrad, true, FloatDType::kF32>(c, a, begin, end);
    case FloatDType::kF16:
      return Body::template run<Isa, kGrad, true, FloatDType::kF16>(c, a, begin, end);
    case FloatDType::kBF16:
      return Body::template run<Isa, kGrad, true, FloatDType::kBF16>(c, a, begin, end);
  }
  return begin;  // unreachable: the caller validated the dtype; the scalar path does it all
}

template <class Body, class Isa, class C, class A>
std::size_t run_by_dtypes(const C& c, const A& a, std::size_t begin, std::size_t end) {
  switch (a.grad_dtype) {
    case FloatDType::kF32:
      return run_by_stream<Body, Isa, FloatDType::kF32>(c, a, begin, end);
    case FloatDType::kF16:
      return run_by_stream<Body, Isa, FloatDType::kF16>(c, a, begin, end);
    case FloatDType::kBF16:
      return run_by_stream<Body, Isa, FloatDType::kBF16>(c, a, begin, end);
  }
  return begin;
}

template <class Isa>
std::size_t adamw_entry(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                        std::size_t end) {
  return run_by_dtypes<AdamWBody, Isa>(c, a, begin, end);
}

// Four f64 accumulators (two vectors of input per iteration) hide the FMA latency; the squares
// of f32 values are exact in f64, so only the additions round.
template <class Isa, FloatDType kType>
std::size_t sum_squares_loop(const void* grad, std::size_t begin, std::size_t end, double* sum) {
  using D = typename Isa::D;
  constexpr std::size_t kW = Isa::kWidth;
  D acc0 = Isa::dzero(), acc1 = Isa::dzero(), acc2 = Isa::dzero(), acc3 = Isa::dzero();
  std::size_t i = begin;
  for (; i + 2 * kW <= end; i += 2 * kW) {
    const typename Isa::F x0 = load_lanes<Isa, kType>(grad, i);
    const typename Isa::F x1 = load_lanes<Isa, kType>(grad, i + kW);
    const D lo0 = Isa::lo_pd(x0), hi0 = Isa::hi_pd(x0);
    const D lo1 = Isa::lo_pd(x1), hi1 = Isa::hi_pd(x1);
    acc0 = Isa::dfmadd(lo0, lo0, acc0);
    acc1 = Isa::dfmadd(hi0, hi0, acc1);
    acc2 = Isa::dfmadd(lo1, lo1, acc2);
    acc3 = Isa::dfmadd(hi1, hi1, acc3);
  }
  double lanes[4 * (kW / 2)];
  Isa::dstore(lanes, acc0);
  Isa::dstore(lanes + kW / 2, acc1);
  Isa::dstore(lanes + kW, acc2);
  Isa::dstore(lanes + 3 * (kW / 2), acc3);
  double total = 0.0;
  for (double lane : lanes)
    total += lane;
  *sum = total;
  return i;
}

template <class Isa>
std::size_t sum_squares_entry(const void* grad, FloatDType dtype, std::size_t begin,
                              std::size_t end, double* sum) {
  switch (dtype) {
    case FloatDType::kF32:
      return sum_squares_loop<Isa, FloatDType::kF32>(grad, begin, end, sum);
    case FloatDType::kF16:
      return sum_squares_loop<Isa, FloatDType::kF16>(grad, begin, end, sum);
    case FloatDType::kBF16:
      return sum_squares_loop<Isa, FloatDType::kBF16>(grad, begin, end, sum);
  }
  *sum = 0.0;
  return begin;
}

template <class Isa, FloatDType kType>
std::size_t cast_loop(const float* src, void* dst, std::size_t begin, std::size_t end) {
  constexpr std::size_t kW = Isa::kWidth;
  std::size_t i = begin;
  for (; i + kW <= end; i += kW)
    store_lanes<Isa, kType>(dst, i, Isa::load_f32(src + i));
  return i;
}

template <class Isa>
std::size_t cast_entry(const float* src, void* dst, FloatDType dtype, std::size_t begin,
                       std::size_t end) {
  switch (dtype) {
    case FloatDType::kF32:
      return cast_loop<Isa, FloatDType::kF32>(src, dst, begin, end);
    case FloatDType::kF16:
      return cast_loop<Isa, FloatDType::kF16>(src, dst, begin, end);
    case FloatDType::kBF16:
      return cast_loop<Isa, FloatDType::kBF16>(src, dst, begin, end);
  }
  return begin;
}

}  // namespace
}  // namespace rondo::kernels::detail
