// The CPU AdamW kernel: validation, the f32 constants of a step, the scalar reference path, the
// run-time choice of SIMD path and the tiling over oneTBB threads. The SIMD loops are in
// adamw_avx2.cpp and adamw_avx512.cpp (one body, adamw_simd_body.h).
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/adamw_common.h"
#include "kernels/error.h"

// Note [One ISA per translation unit]
// The baseline build targets x86-64-v3, and the AVX-512 loops must never run on a CPU without
// AVX-512. They live in their own file compiled with -mavx512f, entered through a plain function
// only after simd_path_resolve() checked the CPU. The trap is inline functions with external
// linkage (std:: templates, inline helpers from our headers): each translation unit that uses one
// emits a copy compiled with its own flags, and the linker keeps any one of them, so an AVX-512
// copy could end up serving baseline code. So the per-ISA files include only <immintrin.h>, plain
// C headers and declaration-only headers (simd.h, adamw_internal.h), keep everything they define
// in an anonymous namespace (adamw_simd_body.h), and use no std:: templates.
//
// Note [Bit-identical paths]
// The scalar path is the reference; the SIMD paths perform the same IEEE operations in the same
// order (sqrt and division are correctly rounded in both; the two fused multiply-adds are written
// as std::fma / _mm*_fmadd_ps), and every adamw file is compiled with -ffp-contract=off so the
// compiler adds no fusion of its own. Results therefore do not depend on the path, on where a
// tile's scalar tail starts, or on the thread count; the tests check this bit for bit.
//
// Note [Matching torch.optim.AdamW]
// torch (2.x, foreach=False on CPU, capturable=False) computes per tensor, with Python doubles
// bc1 = 1 - β1**t, bc2 = 1 - β2**t, step_size = lr/bc1, bc2_sqrt = bc2**0.5, and then in f32:
//   param.mul_(1 - lr*wd)                       if wd != 0
//   exp_avg.lerp_(grad, 1 - β1)                 vectorised lerp = fmadd(w, g - m, m) for |w| < 0.5
//   exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1 - β2)   contracted by the compiler into
//                                               fma((1-β2)*g, g, v*β2)
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)          p + (-step_size*m)/denom
// Each Python scalar reaches the f32 kernel rounded to float once. The two fusions were checked
// against torch 2.15 (AVX-512 kernels) bit for bit. One known difference remains: torch's sqrt on
// large tensors goes through a vector math library that is not always correctly rounded (1 ulp
// off for about 0.6% of elements); ours is IEEE sqrt. That moves an update by at most ~1e-7 of its
// size, far inside the 1e-6 the oracle test allows.

namespace rondo::kernels {
namespace detail {

Loops loops_for(SimdPath requested) {
  switch (simd_path_resolve(requested)) {
    case SimdPath::kAvx512:
      return {adamw_avx512, adamw8bit_avx512, sum_squares_avx512, cast_avx512};
    case SimdPath::kAvx2:
      return {adamw_avx2, adamw8bit_avx2, sum_squares_avx2, cast_avx2};
    default:
      return {};
  }
}

// Every problem at once, in torch's terms, so a bad config is fixed in one go.
void append_step_problems(const AdamWParams& p, FloatDType grad_dtype, const void* stream,
                          FloatDType stream_dtype, std::string& problems) {
  auto bad = [&](const std::string& what) { problems += "\n  " + what; };
  auto num = [](double x) { return std::to_string(x); };
  if (!(p.lr >= 0.0) || !std::isfinite(p.lr)) bad("lr must be finite and >= 0, got " + num(p.lr));
  if (!(p.beta1 >= 0.0 && p.beta1 < 1.0)) bad("beta1 must be in [0, 1), got " + num(p.beta1));
  if (!(p.beta2 >= 0.0 && p.beta2 < 1.0)) bad("beta2 must be in [0, 1), got " + num(p.beta2));
  if (!(p.eps >= 0.0) || !std::isfinite(p.eps))
    bad("eps must be finite and >= 0, got " + num(p.eps));
  if (!(p.weight_decay >= 0.0) || !std::isfinite(p.weight_decay))
    bad("weight_decay must be finite and >= 0, got " + num(p.weight_decay));
  if (p.step < 1)
    bad("step must be >= 1 (the count of updates including this one), got " +
        std::to_string(p.step));
  if (!std::isfinite(p.grad_scale))
    bad("grad_scale must be finite, got " + num(p.grad_scale) +
        " (a zero gradient norm or loss scale upstream?)");
  if (!valid_dtype(grad_dtype)) bad("grad_dtype is not F32, F16 or BF16");
  if (stream != nullptr && !valid_dtype(stream_dtype)) bad("stream_dtype is not F32, F16 or BF16");
}

// Note [Matching torch.optim.AdamW]: doubles first, each rounded to float once.
AdamWConstants adamw_constants(const AdamWParams& p) {
  const double t = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(p.beta1, t);
  const double bc2 = 1.0 - std::pow(p.beta2, t);
  AdamWConstants c{};
  c.grad_scale = static_cast<float>(p.grad_scale);
  c.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  // torch's lerp: weight below 0.5 in magnitude gives m + w*(g - m); otherwise g - (1-w)*(g - m),
  // written as g + (w - 1)*(g - m), which is exact at w = 1 (β1 = 0: m becomes g).
  const float w = static_cast<float>(1.0 - p.beta1);
  c.m_from_m = std::fabs(w) < 0.5f;
  c.m_coeff = c.m_from_m ? w : w - 1.0f;
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));  // Python's `bc2 ** 0.5` is pow, not sqrt
  c.eps = static_cast<float>(p.eps);
  c.neg_step = static_cast<float>(-(p.lr / bc1));
  return c;
}

}  // namespace detail

namespace {

using detail::AdamWArrays;
using detail::AdamWConstants;
using detail::for_each_chunk;
using detail::kInlineBelow;
using detail::kTile;
using detail::load_f32_from;
using detail::Loops;
using detail::loops_for;
using detail::parallel_for_tiles;
using detail::store_f32_to;
using detail::valid_dtype;

// The reference. See Note [Bit-identical paths] before changing an operation here: the SIMD body
// (adamw_simd_body.h) must change with it.
void adamw_scalar(const AdamWConstants& c, const AdamWArrays& a, std::size_t begin,
                  std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) {
    const float g = load_f32_from(a.grad, a.grad_dtype, i) * c.grad_scale;
    const float p = a.master[i] * c.decay;
    const float m = a.m[i];
    const float m1 = std::fma(c.m_coeff, g - m, c.m_from_m ? m : g);
    const float v1 = std::fma(c.one_minus_beta2 * g, g, a.v[i] * c.beta2);
    const float denom = std::sqrt(v1) / c.bc2_sqrt + c.eps;
    const float p1 = p + (c.neg_step * m1) / denom;
    a.m[i] = m1;
    a.v[i] = v1;
    a.master[i] = p1;
    if (a.stream != nullptr) store_f32_to(a.stream, a.stream_dtype, i, p1);
  }
}

// Null arrays, on top of the hyper-parameters (detail::append_step_problems).
void validate(const AdamWTensor& t, const AdamWParams& p) {
  std::string problems;
  detail::append_step_problems(p, t.grad_dtype, t.stream, t.stream_dtype, problems);
  if (t.n > 0 && (t.grad == nullptr || t.master == nullptr || t.m == nullptr || t.v == nullptr))
    problems += "\n  grad, master, m and v must all be set for a tensor of " + std::to_string(t.n) +
                " elements";
  if (!problems.empty()) throw Error("AdamW step: invalid arguments:" + problems);
}

}  // namespace

void adamw_step(const AdamWTensor& tensor, const AdamWParams& params, SimdPath path) {
  validate(tensor, params);
  const Loops loops = loops_for(path);
  if (tensor.n == 0) return;
  const AdamWConstants c = detail::adamw_constants(params);
  const AdamWArrays a{tensor.grad, tensor.grad_dtype, tensor.master,      tensor.m,
                      tensor.v,    tensor.stream,     tensor.stream_dtype};
  for_each_chunk(tensor.n, [&](std::size_t begin, std::size_t end) {
    const std::size_t i = loops.adamw ? loops.adamw(c, a, begin, end) : begin;
    adamw_scalar(c, a, i, end);
  });
}

double grad_sum_squares(const void* grad, FloatDType dtype, std::size_t n, SimdPath path) {
  if (!valid_dtype(dtype)) throw Error("grad_sum_squares: dtype is not F32, F16 or BF16");
  if (n > 0 && grad == nullptr)
    throw Error("grad_sum_squares: null gradient of " + std::to_string(n) + " elements");
  const Loops loops = loops_for(path);
  // One partial sum per tile, whatever thread computes it, added in tile order: the result does
  // not depend on the thread count or on how oneTBB splits the range.
  auto tile_sum = [&](std::size_t tile) {
    const std::size_t begin = tile * kTile;
    const std::size_t end = std::min(n, begin + kTile);
    double sum = 0.0;
    std::size_t i = loops.sum_squares ? loops.sum_squares(grad, dtype, begin, end, &sum) : begin;
    for (; i < end; ++i) {
      const double g = load_f32_from(grad, dtype, i);
      sum += g * g;  // exact square: a float's 24-bit significand squared fits in a double's 53
    }
    return sum;
  };
  const std::size_t tiles = (n + kTile - 1) / kTile;
  double total = 0.0;
  if (n < kInlineBelow) {
    for (std::size_t tile = 0; tile < tiles; ++tile)
      total += tile_sum(tile);
    return total;
  }
  std::vector<double> partial(tiles);
  parallel_for_tiles(tiles, [&](std::size_t first, std::size_t last) {
    for (std::size_t tile = first; tile < last; ++tile)
      partial[tile] = tile_sum(tile);
  });
  for (double s : partial)
    total += s;
  return total;
}

SumSquaresStream::SumSquaresStream(FloatDType dtype, std::size_t n, SimdPath path)
    : dtype_(dtype), n_(n), path_(path) {
  if (!valid_dtype(dtype)) throw Error("SumSquaresStream: dtype is not F32, F16 or BF16");
}

void SumSquaresStream::add(const void* grad, std::size_t count) {
  if (seen_ + count > n_)
    throw InternalError("SumSquaresStream: " + std::to_string(seen_ + count) + " elements of " +
                        std::to_string(n_));
  const std::size_t es = dtype_size(dtype_);
  const auto* p = static_cast<const std::uint8_t*>(grad);
  while (count > 0) {
    // The tile of element seen_: [start, end), as grad_sum_squares cuts the whole.
    const std::size_t start = seen_ / kTile * kTile, end = std::min(n_, start + kTile);
    const std::size_t take = std::min(count, end - seen_);
    if (seen_ == start && take == end - start) {
      total_ += grad_sum_squares(p, dtype_, take, path_);  // one tile: 0 + its partial sum
    } else {
      carry_.insert(carry_.end(), p, p + take * es);
      if (seen_ + take == end) {
        total_ += grad_sum_squares(carry_.data(), dtype_, end - start, path_);
        carry_.clear();
      }
    }
    seen_ += take;
    p += take * es;
    count -= take;
  }
}

double SumSquaresStream::total() const {
  if (seen_ != n_)
    throw InternalError("SumSquaresStream: total() after " + std::to_string(seen_) + " of " +
                        std::to_string(n_) + " elements");
  return total_;
}

void grad_accumulate(float* sum, const void* grad, FloatDType dtype, std::size_t n, bool first) {
  if (!valid_dtype(dtype)) throw Error("grad_accumulate: dtype is not F32, F16 or BF16");
  if (n > 0 && (sum == nullptr || grad == nullptr))
    throw Error("grad_accumulate: null array of " + std::to_string(n) + " elements");
  // One loop per dtype and case, each simple enough for the compiler to vectorise.
  auto loop = [&](auto load) {
    for_each_chunk(n, [&](std::size_t begin, std::size_t end) {
      if (first)
        for (std::size_t i = begin; i < end; ++i)
          sum[i] = 0.0f + load(i);
      else
        for (std::size_t i = begin; i < end; ++i)
          sum[i] += load(i);
    });
  };
  switch (dtype) {
    case FloatDType::kF32: {
      const auto* p = static_cast<const float*>(grad);
      loop([p](std::size_t i) { return p[i]; });
      break;
    }
    case FloatDType::kBF16: {
      const auto* p = static_cast<const std::uint16_t*>(grad);
      loop([p](std::size_t i) { return f32_from_bf16(p[i]); });
      break;
    }
    case FloatDType::kF16: {
      const auto* p = static_cast<const std::uint16_t*>(grad);
      loop([p](std::size_t i) { return f32_from_f16(p[i]); });
      break;
    }
  }
}

void cast_from_f32(const float* src, void* dst, FloatDType dst_dtype, std::size_t n,
                   SimdPath path) {
  if (!valid_dtype(dst_dtype)) throw Error("cast_from_f32: dtype is not F32, F16 or BF16");
  if (n > 0 && (src == nullptr || dst == nullptr))
    throw Error("cast_from_f32: null array of " + std::to_string(n) + " elements");
  const Loops loops = loops_for(path);
  for_each_chunk(n, [&](std::size_t begin, std::size_t end) {
    std::size_t i = loops.cast ? loops.cast(src, dst, dst_dtype, begin, end) : begin;
    for (; i < end; ++i)
      store_f32_to(dst, dst_dtype, i, src[i]);
  });
}

}  // namespace rondo::kernels
