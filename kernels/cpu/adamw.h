// The fused CPU AdamW step: one pass over a parameter tensor reads the low-precision gradient,
// updates the f32 master weights and the f32 moments m and v, and writes the streaming copy the
// devices upload (docs/architecture.md §2.6). Also the gradient's sum of squares (for global-norm
// clipping) and a plain f32 -> bf16/f16 cast. Used by the engine's optimizer driver, per layer.
//
// Semantics are torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), in torch's
// order of f32 operations, so results agree with it to float rounding (tests/oracle/test_adamw.py).
// Invariants: the arrays of one call do not overlap; the SIMD paths give bit-identical results
// to the scalar path; the result does not depend on the number of threads.
//
//   kernels::AdamWTensor t{.n = n, .grad = grad_bf16, .grad_dtype = kernels::FloatDType::kBF16,
//                          .master = master, .m = m, .v = v,
//                          .stream = weights_bf16, .stream_dtype = kernels::FloatDType::kBF16};
//   kernels::adamw_step(t, {.lr = 2e-5, .weight_decay = 0.1, .step = step,
//                           .grad_scale = clip_coef});
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/simd.h"

namespace rondo::kernels {

// Hyper-parameters of one AdamW update. The defaults are torch.optim.AdamW's.
struct AdamWParams {
  double lr = 1e-3;            // γ, the learning rate for this step (after any schedule)
  double beta1 = 0.9;          // β1 in [0, 1): decay of the first moment m
  double beta2 = 0.999;        // β2 in [0, 1): decay of the second moment v
  double eps = 1e-8;           // ε >= 0, added to sqrt(v̂) (after bias correction, as in torch)
  double weight_decay = 1e-2;  // λ >= 0, decoupled: p *= 1 - γλ before the Adam update
  std::int64_t step = 1;       // t >= 1: updates so far including this one (bias corrections
                               // 1 - β1^t and 1 - β2^t); the caller counts it per tensor
  double grad_scale = 1.0;     // finite; the gradient is multiplied by float(grad_scale) before
                               // anything else: the global-norm clip coefficient times the
                               // inverse fp16 loss scale (1.0 = as stored)
};

// One parameter tensor's state, as flat arrays of n elements. All are host memory owned by the
// caller; none may overlap another.
struct AdamWTensor {
  std::size_t n = 0;                         // elements in every array
  const void* grad = nullptr;                // (n) grad_dtype, read only
  FloatDType grad_dtype = FloatDType::kF32;  // as the device wrote it
  float* master = nullptr;                   // (n) f32 master weights, updated in place
  float* m = nullptr;                        // (n) f32 first moment (torch: exp_avg)
  float* v = nullptr;                        // (n) f32 second moment (torch: exp_avg_sq)
  void* stream = nullptr;                    // (n) stream_dtype, written: the updated master
                                             // rounded for the devices; null = none
  FloatDType stream_dtype = FloatDType::kBF16;
};

// One AdamW step, torch.optim.AdamW's algorithm in f32:
//   g = float(grad) * float(grad_scale)
//   p = p * float(1 - lr*wd)                      (skipped by torch when wd == 0; same result)
//   m = m + float(1 - β1) * (g - m)               (torch's lerp_, fused multiply-add)
//   v = v * float(β2) + float(1 - β2) * g * g     (torch's mul_ + addcmul_, fused multiply-add)
//   p = p + float(-lr / (1 - β1^t)) * m / (sqrt(v) / float((1 - β2^t)^0.5) + float(eps))
//   stream = round(p)
// Constants are computed in double, as torch computes them in Python. grad_scale is one f32
// multiply: where torch would unscale (GradScaler) and then clip (clip_grad_norm_), two
// multiplies, a combined grad_scale can differ from that by an ulp of the gradient. Large tensors
// are cut into tiles spread over oneTBB threads (in the caller's task arena); small ones run on the
// caller's thread. Throws rondo::Error for a hyper-parameter torch would reject, null arrays, or a
// path the CPU lacks.
void adamw_step(const AdamWTensor& tensor, const AdamWParams& params,
                SimdPath path = SimdPath::kAuto);

// Σ g_i² over a gradient, accumulated in f64 (relative error ~1e-16 · log, not ~1e-7 · n as a
// plain f32 sum would be), for global-norm clipping: norm = sqrt(Σ over all tensors), and the
// clip coefficient is passed to adamw_step as grad_scale. Deterministic: the same for any number
// of threads (per-tile partial sums added in tile order). A NaN or Inf gradient gives NaN or Inf,
// which is how fp16 loss scaling detects overflow.
double grad_sum_squares(const void* grad, FloatDType dtype, std::size_t n,
                        SimdPath path = SimdPath::kAuto);

// grad_sum_squares of a gradient that arrives in consecutive ranges (elements [0, n) in pieces
// of any size, as they come down a chunk at a time), bit for bit the value grad_sum_squares gives
// for the whole: the tile partial sums are the same (a tile cut by a range's end is completed in
// a carry buffer of at most one tile) and are added in the same order. Single-threaded.
//
//   SumSquaresStream s(FloatDType::kF32, n);
//   s.add(piece0, 300); s.add(piece1, n - 300);
//   double sum = s.total();  // == grad_sum_squares(whole, kF32, n)
class SumSquaresStream {
 public:
  SumSquaresStream(FloatDType dtype, std::size_t n, SimdPath path = SimdPath::kAuto);
  // The next `count` elements of the gradient.
  void add(const void* grad, std::size_t count);
  std::size_t seen() const { return seen_; }
  // The sum once all n elements came (InternalError before).
  double total() const;

 private:
  FloatDType dtype_;
  std::size_t n_, seen_ = 0;
  SimdPath path_;
  double total_ = 0;
  std::vector<std::uint8_t> carry_;  // the elements of a tile cut by a range's end
};

// sum[i] = 0 + float(grad[i]) (first) or sum[i] + float(grad[i]): a tied tensor's gradients summed
// in f32 before the update (0 + x turns a -0 into +0, as torch's accumulation does). Spread over
// oneTBB threads like adamw_step; elementwise, so the same for any number of threads.
void grad_accumulate(float* sum, const void* grad, FloatDType dtype, std::size_t n, bool first);

// dst[i] = round(src[i]) to dst_dtype (a copy for kF32): the rounding adamw_step applies to the
// streaming copy, for building it from a loaded master (or a checkpoint) without an update.
void cast_from_f32(const float* src, void* dst, FloatDType dst_dtype, std::size_t n,
                   SimdPath path = SimdPath::kAuto);

}  // namespace rondo::kernels
