// AdamW over the LayerStore, layer by layer, with exact global-norm gradient clipping (the
// optimizer thread that drives it is optimizer_driver.h); moments in f32 or, where the store keeps
// them so, bitsandbytes' blockwise 8-bit (kernels/cpu/adamw8bit.h). Per step: once every gradient
// of the step has landed, begin_step() computes the global norm (tied tensors' two gradients summed
// first) and the clip coefficient; then update_layer() runs the fused AdamW kernel on each layer,
// in forward order, so that the next step's first stage can start as soon as its own layers are
// updated. See Note [Exact clipping with per-layer updates].
//
//   engine::Optimizer opt(store, {.lr = 2e-5, .weight_decay = 0.1}, /*max_grad_norm=*/1.0);
//   double norm = opt.begin_step();            // all gradients of the step are in the store
//   for (std::size_t l = 0; l < store.layers(); ++l) opt.update_layer(l);
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// One AdamW step of a tensor whose master and moments `t` points at — f32 moments or 8-bit ones,
// whichever the store keeps (kernels::adamw_step or kernels::adamw8bit_step) — reading `grad`
// and writing the rounded master to `stream` (null: none).
void adamw_update(const offload::TensorState& t, const void* grad, kernels::FloatDType grad_dtype,
                  void* stream, kernels::FloatDType stream_dtype, const kernels::AdamWParams& p);

class Optimizer {
 public:
  // `params.step` is ignored: the driver counts steps. max_grad_norm <= 0 disables clipping.
  Optimizer(offload::LayerStore& store, const kernels::AdamWParams& params, double max_grad_norm);

  // Starts step t + 1: the global gradient norm (before clipping) over every trainable tensor.
  // Returns it; a NaN or Inf norm is returned as is (the caller skips the step, e.g. fp16
  // overflow) and update_layer must not be called for it.
  // `partial`, if given, holds partial_sum_squares(l) for every layer, computed as the gradients
  // landed (so only tied tensors are read here).
  double begin_step(const std::vector<double>* partial = nullptr);
  // The sum of squares of layer l's gradients, except tensors with ties (an owner's and its tied
  // copies' gradients are summed before squaring, in begin_step). Read-only: call it as soon as
  // the layer's gradients of the step are in.
  double partial_sum_squares(std::size_t layer) const;
  // AdamW on the layer's own trainable tensors (a tied tensor is updated by its owner, with both
  // gradients, summed by begin_step), then the gradients of the layer are zeroed for the next step
  // unless set_zero_grads(false).
  // With write_stream = false only the master and moments change (one-step-stale training
  // publishes the master to the streaming copy later, with publish_layer).
  void update_layer(std::size_t layer, bool write_stream = true);
  // The layer's streaming copies := its masters, rounded to the streaming dtype.
  void publish_layer(std::size_t layer);

  // Undoes begin_step() for a step that will not be applied (fp16 overflow): the step count goes
  // back and every gradient is zeroed.
  void discard_step();

  // What the stored gradients are multiplied by before use: 1 / the fp16 loss scale (1 = none).
  // The norm begin_step() returns and clips against is that of the unscaled gradient.
  void set_grad_unscale(double unscale) { unscale_ = unscale; }
  // Whether update_layer zeroes the layer's gradients (default true). The engine's gradients are
  // overwritten whole every step, so it turns this off (a pass over every gradient byte saved).
  void set_zero_grads(bool zero) { zero_grads_ = zero; }

  std::int64_t step() const { return step_; }
  void set_step(std::int64_t step) { step_ = step; }  // resuming from a checkpoint
  double clip_coefficient() const { return clip_; }
  void set_lr(double lr) { params_.lr = lr; }

 private:
  class StreamOut;  // where an update writes a layer's streaming copies (optimizer.cpp)
  bool has_ties(std::size_t layer, std::size_t index) const;
  // tied_sums_ for the owner (layer, index), from this step's gradients.
  void sum_tied(std::size_t layer, std::size_t index);
  // The gradient AdamW sees for an owned tensor: its own, or for an owner of tied copies the sum
  // begin_step made (as f32).
  const void* gradient(std::size_t layer, std::size_t index, kernels::FloatDType& dtype) const;

  offload::LayerStore& store_;
  kernels::AdamWParams params_;
  double max_norm_;
  std::int64_t step_ = 0;
  double clip_ = 1.0;
  double unscale_ = 1.0;
  // For each owned tensor with tied copies: (layer, index) of each copy.
  struct Tie {
    std::size_t owner_layer, owner_index, layer, index;
  };
  std::vector<Tie> ties_;
  bool zero_grads_ = true;
  // Per owner of tied copies: its gradient and theirs summed (f32), made once a step by begin_step
  // for the norm and read again by update_layer.
  std::map<std::pair<std::size_t, std::size_t>, std::vector<float>> tied_sums_;
};

}  // namespace rondo::engine
