// The model as a list of layers — [prefix, block_0 .. block_{L-1}, head] — and each layer as a
// pure function of its weights and inputs (docs/architecture.md §10). The engine streams a layer's
// weights to a device and calls these functions there; nothing here owns memory or knows where it
// lives. Shared by every family: Llama, Mistral, Qwen2 and Qwen3 differ only in ModelConfig flags.
// This header owns the block itself (binding its weights, forward, backward), the embedding and
// the head (layers.cpp), and gathers the rest: the layer list and its costs (layer_specs.h),
// attention (attention.h, attention_masks.h) and mixture-of-experts routing (moe.h).
//
//   auto specs = models::layer_specs(cfg);                  // what the planner needs
//   auto ctx = models::make_attention_context(cfg, batch, at::kFloat);
//   at::Tensor x = models::embed(w_embed, batch.tokens);    // prefix
//   x = models::block_forward(cfg, models::BlockWeights::bind(specs[1], w1), x, ctx);
//   at::Tensor loss_sum = models::head_loss_sum(cfg, w_norm, w_lm_head, x, targets);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/attention.h"
#include "models/config.h"
#include "models/layer_specs.h"
#include "models/moe.h"

namespace rondo::models {

// Inverted dropout with a counter-based mask: x where hash(seed, index) >= p, scaled by 1/(1-p);
// zero elsewhere. Deterministic for (seed, shape) on every device. `first_index` is the flat index
// of x's first element in the tensor whose mask it shares (a tile of rows of a larger tensor draws
// what those rows drew in the whole).
at::Tensor seeded_dropout(const at::Tensor& x, double p, std::int64_t seed,
                          std::int64_t first_index = 0);

// The weights of one block, bound by name from a layer's tensors (in LayerSpec::params order).
// Optional tensors (biases, q/k norms) are undefined when the family has none.
struct BlockWeights {
  at::Tensor input_norm;                      // (C)
  at::Tensor q, k, v, o;                      // (H*D, C) (KV*D, C) (KV*D, C) (C, H*D)
  at::Tensor q_bias, k_bias, v_bias, o_bias;  // optional
  at::Tensor q_norm, k_norm;                  // (D), Qwen3
  at::Tensor post_norm;                       // (C)
  at::Tensor gate, up, down;                  // (I, C) (I, C) (C, I)
  at::Tensor gate_bias, up_bias, down_bias;   // optional (Llama mlp_bias)
  // A sparse (MoE) block instead of gate/up/down: the router (E, C) and each expert's
  // (I, C) (I, C) (C, I).
  at::Tensor router;
  std::vector<at::Tensor> expert_gate, expert_up, expert_down;
  // LoRA on the experts in PEFT's layout for a 3-D parameter (E experts, rank R each):
  // [0] gate_up: A (E*R, C), B (2I, E*R); [1] down: A (E*R, I), B (C, E*R). Expert e's A is rows
  // e*R..(e+1)*R, its B the columns e, e+E, e+2E, ... (PEFT reshapes B as (out, R, E)).
  at::Tensor expert_lora_a[2], expert_lora_b[2];
  double expert_lora_scaling[2] = {0, 0};
  at::Tensor router_lora_a, router_lora_b;  // (r, C), (E, r), scaled by lora_scaling
  // GPT-OSS: per-head attention sinks (H); the router's bias (E); fused experts
  // (E, C, 2I) + (E, 2I), gate and up interleaved, and (E, I, C) + (E, C), used as x @ W + b.
  at::Tensor sinks, router_bias;
  at::Tensor fused_gate_up, fused_gate_up_bias, fused_down, fused_down_bias;
  // LoRA adapters per projection (q, k, v, o, gate, up, down), undefined where there is none:
  // y = x W^T + b + (dropout(x) A^T) B^T * lora_scaling.
  enum Projection { kQ, kK, kV, kO, kGate, kUp, kDown, kProjections };
  at::Tensor lora_a[kProjections], lora_b[kProjections];  // (r, in), (out, r)
  double lora_scaling = 0, lora_dropout = 0;
  int block = -1;  // which block (seeds its dropout)

  static BlockWeights bind(const LayerSpec& spec, const std::vector<at::Tensor>& tensors);
};

// Prefix: token embeddings. (B, T) -> (B, T, C) in the embedding's dtype.
at::Tensor embed(const at::Tensor& embed_weight, const at::Tensor& tokens);

// One decoder block: x + attn(norm(x)), then + mlp(norm(.)). With a cache, x holds only the new
// tokens; their keys and values are appended to it and attention covers the cache too.
at::Tensor block_forward(const ModelConfig& config, const BlockWeights& w, const at::Tensor& x,
                         const AttentionContext& ctx, KvCache* cache = nullptr);

// Head: final norm then LM head, fp32 logits (B, T, V). For inference and tests; training uses
// head_loss_sum, which never holds more than `chunk_tokens` rows of logits.
at::Tensor head_logits(const ModelConfig& config, const at::Tensor& norm_weight,
                       const at::Tensor& lm_head_weight, const at::Tensor& x);

// Sum over target tokens (targets != -100) of the fp32 cross-entropy, computed chunk by chunk.
at::Tensor head_loss_sum(const ModelConfig& config, const at::Tensor& norm_weight,
                         const at::Tensor& lm_head_weight, const at::Tensor& x,
                         const at::Tensor& targets, std::int64_t chunk_tokens = 1024);

// The same cross-entropy per token: (B, T) fp32, 0 where targets == -100 (a preference objective
// sums its negation per sequence: engine/preference.h).
at::Tensor head_token_losses(const ModelConfig& config, const at::Tensor& norm_weight,
                             const at::Tensor& lm_head_weight, const at::Tensor& x,
                             const at::Tensor& targets, std::int64_t chunk_tokens = 1024);

// The head's forward and backward in one pass over token chunks (the fused tail's last layer):
// for each chunk, fp32 logits, the cross-entropy and its gradient (softmax - one-hot) * loss_scale,
// which is folded straight into the gradients of the hidden states and of the LM head — so at most
// `chunk_tokens` rows of logits ever exist, in forward or backward. loss_scale is what the summed
// loss is multiplied by (1 / target tokens of the whole global batch, times the fp16 loss scale).
// With `token_weights` ((B, T) fp32, defined): the gradient is that of the sum of each target's
// cross-entropy times its weight (a preference objective's coefficients); loss_sum stays
// unweighted.
struct HeadGrads {
  at::Tensor loss_sum;      // () fp32: sum of the cross-entropy over targets != -100, unscaled
  at::Tensor grad_x;        // like x: gradient of loss_sum * loss_scale w.r.t. the head's input
  at::Tensor grad_norm;     // (C): w.r.t. the final norm's weight
  at::Tensor grad_lm_head;  // (V, C) fp32, w.r.t. the LM head; undefined unless asked for
};
HeadGrads head_forward_backward(const ModelConfig& config, const at::Tensor& norm_weight,
                                const at::Tensor& lm_head_weight, const at::Tensor& x,
                                const at::Tensor& targets, double loss_scale,
                                bool want_lm_head_grad, std::int64_t chunk_tokens = 1024,
                                const at::Tensor& token_weights = {});

// One block of a backward stage: its layer spec, its weights, and where its weight gradients
// accumulate (same order and shapes as `weights`; an undefined entry, or no vector at all, for
// frozen weights).
struct BlockRun {
  const LayerSpec* spec = nullptr;
  std::vector<at::Tensor> weights;
  std::vector<at::Tensor>* grads = nullptr;
  // The gradients are written, not added to (a job's first microbatch: what `grads` held before
  // is never read, and a trained weight this run gives no gradient, such as an expert no token
  // was routed to, gets zeros).
  bool overwrite = false;
};

// The backward of a run of blocks from saved inputs (activation checkpointing): recomputes the
// forward under autograd and backpropagates `grad_out` (the gradient of the last block's output).
// Stage grain: `saved_inputs` holds the input of the first block and all blocks are recomputed at
// once. Layer grain: it holds every block's input and each block is recomputed and
// backpropagated alone (less memory). Weight gradients are added to (or, with BlockRun::overwrite,
// written into) BlockRun::grads; returns the gradient of the first block's input. Weights are never
// modified (autograd uses aliases). With AttentionContext::mlp_tile_tokens, blocks keep no
// MLP intermediates in the graph: their MLPs are recomputed and backpropagated tile by tile.
at::Tensor blocks_backward(const ModelConfig& config, const std::vector<BlockRun>& blocks,
                           const std::vector<at::Tensor>& saved_inputs, const AttentionContext& ctx,
                           const at::Tensor& grad_out);

// The fused tail's blocks: their forward under autograd from `x` (kept, not recomputed), then
// `head` gets the last block's output and returns the gradient to backpropagate into it (it runs
// the head's own forward and backward, e.g. head_forward_backward), then the blocks' backward.
// Weight gradients are added to (or, with BlockRun::overwrite, written into) BlockRun::grads;
// returns the gradient of `x`. With no blocks, returns head(x).
at::Tensor blocks_forward_backward(const ModelConfig& config, const std::vector<BlockRun>& blocks,
                                   const at::Tensor& x, const AttentionContext& ctx,
                                   const std::function<at::Tensor(const at::Tensor&)>& head);

// The embedding's weight gradient for `grad_x` (B, T, C) flowing into embed(weight, tokens):
// added to `grad_weight` (V, C).
void embed_backward(const at::Tensor& tokens, const at::Tensor& grad_x, at::Tensor& grad_weight);

// RMSNorm as Hugging Face computes it for the family: in fp32 (f64 for f64 input), then back to
// the input dtype, times the weight; GPT-OSS multiplies by the weight in fp32 before the cast.
at::Tensor rms_norm(const ModelConfig& c, const at::Tensor& x, const at::Tensor& weight);

}  // namespace rondo::models
