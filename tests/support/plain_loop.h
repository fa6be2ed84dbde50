// The reference the engine is measured against: a plain single-device libtorch training loop over
// the same layer functions (models/layers.h) — one autograd graph per microbatch through embed,
// block_forward, the final norm, the LM head and torch's cross-entropy, the loss divided by the
// step's target tokens, gradients accumulated by autograd, torch::nn::utils::clip_grad_norm_, then
// torch::optim::AdamW. No engine code: no stages, no checkpoints, no hand-written backward, no
// Rondo optimizer.
//
//   test::PlainLoop ref(config, weights, {.lr = 1e-3, .weight_decay = 0.1}, 1.0);
//   double loss = ref.step(microbatches);  // one optimizer step
//   at::Tensor w = ref.param("model.layers.0.mlp.up_proj.weight");
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "models/config.h"

namespace rondo::test {

struct PlainAdamW {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

class PlainLoop {
 public:
  // `weights` by Hugging Face name (any dtype; trained in `dtype`). Every parameter is trained.
  // `specs` (default: the config's layers) may carry LoRA adapters; `trainable` (default: all)
  // says which parameters train — the others get no gradient and no optimizer state. `device`:
  // where the parameters, the optimizer and every microbatch live (a GPU for benchmarks).
  PlainLoop(const models::ModelConfig& config, const std::map<std::string, at::Tensor>& weights,
            const PlainAdamW& adamw, double max_grad_norm, at::ScalarType dtype = at::kFloat,
            const std::vector<models::LayerSpec>* specs = nullptr,
            const std::function<bool(const std::string&)>& trainable = {},
            at::Device device = at::kCPU);
  ~PlainLoop();

  // Forward and backward of every microbatch, then clipping and one AdamW step. Returns the mean
  // loss over the step's target tokens. If `grads` is given, it receives the step's gradients by
  // name (before clipping), copies in the loop's dtype.
  // With attention dropout in the config, `step_no` (1-based) and the run seed choose the masks,
  // as engine::dropout_seed does for the engine.
  double step(const std::vector<engine::Microbatch>& microbatches,
              std::map<std::string, at::Tensor>* grads = nullptr, std::int64_t step_no = 1,
              std::uint64_t seed = 0);
  // RoundPipe's one-step-stale step: the gradients are taken at the weights from before the
  // previous step's update (w_i = θ_{i-1}, w_0 = θ_0), then clipping and AdamW update θ.
  double stale_step(const std::vector<engine::Microbatch>& microbatches,
                    std::map<std::string, at::Tensor>* grads = nullptr, std::int64_t step_no = 1);

  // Forward and backward only (no optimizer step): the gradients, then zeroed.
  std::map<std::string, at::Tensor> gradients(const std::vector<engine::Microbatch>& microbatches);

  at::Tensor param(const std::string& name) const;

 private:
  double forward_backward(const std::vector<engine::Microbatch>& microbatches, std::int64_t step_no,
                          std::uint64_t seed);
  struct State;
  std::unique_ptr<State> state_;
};

// Tiny models of two families for engine tests and benchmarks: Llama (GQA, untied, no biases) and
// Qwen2 (tied embeddings, QKV biases). `scale` multiplies the sizes (1 = unit-test size).
models::ModelConfig tiny_llama(int layers = 4, int scale = 1);
models::ModelConfig tiny_qwen2(int layers = 4, int scale = 1);
// Qwen3-MoE: 4 experts, top-2 renormalised, block 1 dense (mlp_only_layers), the router's
// load-balancing loss on with coefficient 0.05.
models::ModelConfig tiny_qwen3_moe(int layers = 4, int scale = 1);
// GPT-OSS: attention sinks, biases, windows on even blocks, 4 fused experts (top-2) with the
// clamped SwiGLU, the load-balancing loss on.
models::ModelConfig tiny_gpt_oss(int layers = 4, int scale = 1);
// Random weights for a config (norm weights around 1), from the current torch seed.
std::map<std::string, at::Tensor> random_weights(const models::ModelConfig& config);
// A global batch of `rows` rows of `seq` tokens, two packed documents per row, split into `m`
// microbatches of consecutive rows (sizes as even as the division allows). Targets: the next
// token inside each document, none at a row's first position (like a prompt).
std::vector<engine::Microbatch> random_batch(const models::ModelConfig& config, int rows, int seq,
                                             int m);
// The same rows split differently.
std::vector<engine::Microbatch> resplit(const std::vector<engine::Microbatch>& batch, int m);

}  // namespace rondo::test
