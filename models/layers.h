// The model as a list of layers — [prefix, block_0 .. block_{L-1}, head] — and each layer as a
// pure function of its weights and inputs (ARCHITECTURE.md §4). The engine streams a layer's
// weights to a device and calls these functions there; nothing here owns memory or knows where it
// lives. Shared by every family: Llama, Mistral, Qwen2 and Qwen3 differ only in ModelConfig flags.
//
//   auto specs = models::layer_specs(cfg);                  // what the planner needs
//   auto ctx = models::make_attention_context(cfg, batch, at::kFloat, at::kCPU);
//   at::Tensor x = models::embed(w_embed, batch.tokens);    // prefix
//   x = models::block_forward(cfg, models::BlockWeights::bind(cfg, specs[1], w1), x, ctx);
//   at::Tensor loss_sum = models::head_loss_sum(cfg, w_norm, w_lm_head, x, targets);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/config.h"

namespace rondo::models {

enum class LayerKind { kPrefix, kBlock, kHead };
const char* to_string(LayerKind kind);

struct ParamSpec {
  std::string name;  // Hugging Face name, e.g. model.layers.3.self_attn.q_proj.weight
  std::vector<std::int64_t> shape;  // torch order
  bool tied = false;                // the same tensor as a parameter of another layer (LM head =
                                    // embedding); its owner is the other layer
  std::int64_t numel() const;
};

struct LayerSpec {
  LayerKind kind = LayerKind::kBlock;
  int block = -1;  // 0..L-1 for blocks
  std::vector<ParamSpec> params;

  // Parameters this layer owns (tied ones not counted).
  std::int64_t param_count() const;
  // Of those, the ones a token uses: a sparse block's experts count experts_per_token / E.
  double active_param_count() const;
  // FLOPs per token, forward, for sequences of `seq_len` tokens (attention grows with it;
  // causal: on average seq_len / 2 keys per query).
  double flops_forward_per_token(std::int64_t seq_len) const;
  // Backward without recompute: twice the forward (input and weight gradients).
  double flops_backward_per_token(std::int64_t seq_len) const;
  // Bytes autograd keeps per token to run this layer's backward, activations in `act` dtype
  // (an estimate from the shapes; the planner replaces it with measurements). With `seq_len`,
  // rows of that many tokens whose attention runs on the math kernel (an explicit mask for
  // packed documents rules out the fused ones): each block keeps its (H, T, T) probabilities, H·T
  // per token, and the prefix's (T, T) boolean mask, T bytes per token, lives as long as any block
  // of the microbatch does. At T = 4096 that is most of a block's activations.
  std::uint64_t activation_bytes_per_token(std::size_t act_bytes, std::int64_t seq_len = 0) const;

  ModelConfig config;  // the model this layer belongs to (dimensions for the costs)
  // LoRA adapters among `params` (models/lora.h): their output is scaled by lora_scaling, their
  // input goes through dropout lora_dropout in training. 0 / 0 without adapters.
  double lora_scaling = 0, lora_dropout = 0;
  // A sparse block's expert adapters (PEFT's target_parameters on the fused experts): on
  // gate_up_proj (scaled by lora_fused_scaling: PEFT doubles its rank and alpha) and on
  // down_proj. PEFT names the one wrapped first ...experts.base_layer.lora_A when both exist.
  bool lora_experts_gate_up = false, lora_experts_down = false;
  double lora_fused_scaling = 0;
};

std::vector<LayerSpec> layer_specs(const ModelConfig& config);

// One batch of token rows. Packed rows hold several documents: doc_ids marks them (equal ids =
// same document, each document contiguous); attention never crosses documents and positions
// restart at 0 for each one.
struct TokenBatch {
  at::Tensor tokens;   // (B, T) int64
  at::Tensor doc_ids;  // (B, T) int64, or undefined: one document per row
};

// What every block of a batch shares: rotary tables and the attention mask. Computed once per
// batch (by the prefix) and passed to each block.
struct AttentionContext {
  at::Tensor positions;  // (B, T) int64
  at::Tensor cos, sin;   // (B, 1, T, D) in the compute dtype
  // (B, 1, T, T) bool, true = may attend; undefined = plain causal. Packed rows get one (a
  // document sees only itself); rows that each hold one document do not, so that attention can
  // run on the fused kernels (flash attention takes no mask).
  at::Tensor mask;
  // Per-layer windows (ModelConfig::sliding_layers): the mask of the windowed layers, when it
  // differs from `mask`; undefined = every layer uses `mask`.
  at::Tensor window_mask;
  // Packed rows attended per document instead of under `mask`, where that is the faster kernel
  // (models/attention_masks.h, attend_per_document; the masks are then not built): document d is
  // tokens [doc_offsets[d], doc_offsets[d + 1]) of the B * T flattened ones (host), each within
  // one row; doc_offsets_dev the same as int32 on the device (CUDA's variable-length flash
  // attention takes it); max_doc_len the longest. Empty = attention uses the masks.
  std::vector<std::int64_t> doc_offsets;
  at::Tensor doc_offsets_dev;
  std::int64_t max_doc_len = 0;
  // Every token sees every one before it in its row (no documents, no window).
  bool plain_causal() const { return !mask.defined() && doc_offsets.empty(); }
  // Mixture of experts, training: where each sparse block records its routing in its first
  // forward (record_routing) and finds it again in the recompute of its backward (the router
  // load-balancing loss needs every block's counts; the recompute reuses the per-expert token
  // counts instead of syncing with the host for them again). Null for inference.
  std::shared_ptr<struct RoutingRecord> routing;
  bool record_routing = false;
  // Backward: the router load-balancing loss's weight in what is differentiated (the fp16 loss
  // scale times router_aux_loss_coef times this microbatch's share); 0 = no aux loss.
  double aux_loss_weight = 0;
  // Set by the backward while it recomputes: each sparse block appends its per-expert sums of
  // router probabilities (E), under autograd.
  std::vector<at::Tensor>* router_prob_sums = nullptr;
  // Training: >= 0 turns dropout on (the config's attention_dropout). Every random draw is a pure
  // function of (dropout_seed, block, element), with no generator state, so a recompute from a
  // checkpoint — on any device, in any order — draws exactly what the forward drew. The engine
  // gives each (step, microbatch) its own seed. -1 = inference: no dropout.
  std::int64_t dropout_seed = -1;
  // Grouped-query heads with a mask: repeat the key and value heads up to the query heads before
  // SDPA. The memory-efficient kernel takes a mask but not grouped heads, so without this a masked
  // GQA model (Llama 3, Qwen, Mistral with packed rows) falls to the math kernel, which keeps the
  // (B, H, T, T) probabilities. nullopt = on CUDA only (on the CPU the math kernel runs either
  // way and the copies only cost); true / false force it (tests).
  std::optional<bool> expand_kv_heads;
};

// One microbatch's routing, per sparse block: how many of its tokens each expert got (top-k
// selections) and the sum of each expert's router probability over the tokens. Shared by the
// microbatch's forward and backward jobs, which may run on different threads and devices.
struct BlockRouting {
  std::vector<std::int64_t> counts;  // (E) on the host
  at::Tensor prob_sums;              // (E) fp32, where the block ran (no autograd)
  std::int64_t tokens = 0;
};
struct RoutingRecord {
  std::mutex mu;
  std::map<int, BlockRouting> blocks;  // by block index
};

// transformers' load_balancing_loss_func over every sparse block of the microbatch (all tokens,
// padding included: Rondo passes it no attention mask, as a transformers training forward without
// one): E * sum_e f_e * P_e, with f_e the share of top-k selections and P_e the mean router
// probability of expert e over all (block, token) pairs. 0 when nothing was recorded.
double router_aux_loss(const ModelConfig& config, RoutingRecord& record);
// Its gradient with respect to each block's prob_sums (the same for every block): E * counts_e /
// (sum over blocks of tokens)^2 summed over blocks, times `weight`. (E) fp32 on `device`.
at::Tensor router_aux_grad(const ModelConfig& config, RoutingRecord& record, double weight,
                           at::Device device);

// Inverted dropout with a counter-based mask: x where hash(seed, index) >= p, scaled by 1/(1-p);
// zero elsewhere. Deterministic for (seed, shape) on every device.
at::Tensor seeded_dropout(const at::Tensor& x, double p, std::int64_t seed);

AttentionContext make_attention_context(const ModelConfig& config, const TokenBatch& batch,
                                        at::ScalarType dtype);

// Generation: keys and values of the tokens seen so far, per block (B rows).
struct KvCache {
  at::Tensor k, v;  // (B, KV, T_seen, D)
  std::int64_t length() const { return k.defined() ? k.size(2) : 0; }
};

// Context for `count` new tokens after `offset` cached ones (B = 1): positions offset.., causal
// over cache + new tokens, the sliding window applied.
AttentionContext make_decode_context(const ModelConfig& config, std::int64_t offset,
                                     std::int64_t count, at::ScalarType dtype, at::Device device);
// The same for B rows generated together, row b left-padded by left_pad[b] slots (B = its size):
// slots offset..offset+count of every row, a padding slot's position 0 and a real token's its slot
// minus the padding. A real token attends to the real tokens before it (the window applied), a
// padding slot to itself only (so that no softmax row is empty: its output is never used).
AttentionContext make_decode_context(const ModelConfig& config, std::int64_t offset,
                                     std::int64_t count, at::ScalarType dtype, at::Device device,
                                     const std::vector<std::int64_t>& left_pad);

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

// An expert's tensor by Hugging Face name (mlp.experts.3.up_proj.weight, or Mixtral's
// block_sparse_moe.experts.3.w3.weight): its expert and which projection (0 gate, 1 up, 2 down).
bool parse_expert_name(const std::string& name, std::int64_t* expert, int* projection);

// Expert `e`'s factors A_e (R, in) and B_e (out, R) of an adapter in PEFT's layout for a 3-D
// parameter of `experts` experts (BlockWeights::expert_lora_a / _b): A's rows e*R.., B's columns
// e, e+E, ...; and its delta B_e A_e (out, in), unscaled.
std::pair<at::Tensor, at::Tensor> expert_lora_factors(const at::Tensor& a, const at::Tensor& b,
                                                      std::int64_t experts, std::int64_t e);
at::Tensor expert_lora_delta(const at::Tensor& a, const at::Tensor& b, std::int64_t experts,
                             std::int64_t e);

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

// The head's forward and backward in one pass over token chunks (the fused tail's last layer):
// for each chunk, fp32 logits, the cross-entropy and its gradient (softmax - one-hot) * loss_scale,
// which is folded straight into the gradients of the hidden states and of the LM head — so at most
// `chunk_tokens` rows of logits ever exist, in forward or backward. loss_scale is what the summed
// loss is multiplied by (1 / target tokens of the whole global batch, times the fp16 loss scale).
struct HeadGrads {
  at::Tensor loss_sum;      // () fp32: sum of the cross-entropy over targets != -100, unscaled
  at::Tensor grad_x;        // like x: gradient of loss_sum * loss_scale w.r.t. the head's input
  at::Tensor grad_norm;     // (C): w.r.t. the final norm's weight
  at::Tensor grad_lm_head;  // (V, C) fp32, w.r.t. the LM head; undefined unless asked for
};
HeadGrads head_forward_backward(const ModelConfig& config, const at::Tensor& norm_weight,
                                const at::Tensor& lm_head_weight, const at::Tensor& x,
                                const at::Tensor& targets, double loss_scale,
                                bool want_lm_head_grad, std::int64_t chunk_tokens = 1024);

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
// modified (autograd uses aliases).
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
