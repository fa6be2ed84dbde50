// What attention needs for one batch — the token rows (TokenBatch), the rotary tables and the
// limits on what each token sees (AttentionContext), the keys and values of generation (KvCache) —
// and the attention of one block. Limits for training batches: models/attention_masks.h. Both are
// implemented in attention.cpp, which touches only tensors handed to it; used by the block
// (models/layers.h), the engine and generation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "models/config.h"

namespace rondo::models {

struct BlockWeights;  // models/layers.h

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
  // Sequence tiling: everything in a block but attention itself (the norms, projections and
  // rotary positions, the MLP dense or sparse) runs over tiles of this many tokens of the
  // flattened batch (B * T), so that its intermediates exist for one tile at a time; in the
  // backward each tile is recomputed (models/layers.h, blocks_backward; Note [Sequence tiling of
  // the attention half] in models/layers.cpp). 0 = the whole batch at once. The planner chooses
  // it (engine::Plan::mlp_tile_tokens; the name is older than the attention half's tiling).
  std::int64_t mlp_tile_tokens = 0;
  // Training: >= 0 turns dropout on (the config's attention_dropout). Every random draw is a pure
  // function of (dropout_seed, block, element), with no generator state, so a recompute from a
  // checkpoint — on any device, in any order — draws exactly what the forward drew. The engine
  // gives each (step, microbatch) its own seed. -1 = inference: no dropout.
  std::int64_t dropout_seed = -1;
  // Grouped-query heads with a mask: repeat the key and value heads up to the query heads before
  // SDPA. The memory-efficient kernel takes a mask but not grouped heads, so without this a masked
  // GQA model (Llama 3, Qwen, Mistral with packed rows) falls to the math kernel, which keeps the
  // (B, H, T, T) probabilities; so does fp32, which has no flash kernel. nullopt = on CUDA only
  // (on the CPU flash attention takes grouped heads and masks, and the copies would only cost);
  // true / false force it (tests).
  std::optional<bool> expand_kv_heads;
};

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

// A block's attention (block_forward's middle): rotary positions on q (B, H, T, D) and k
// (B, KV, T, D), the keys and values appended to `cache` when there is one, then softmax(q k^T)
// v under the layer's limits from `ctx` — per document, on the plain path (attention dropout,
// GPT-OSS's sinks) or on SDPA's fused kernels. Returns (B, H, T, D).
at::Tensor attend(const ModelConfig& config, const BlockWeights& w, at::Tensor q, at::Tensor k,
                  at::Tensor v, const AttentionContext& ctx, KvCache* cache);
// attend's two parts: the rotary positions on x (any layout whose second-to-last dimension lines
// up with the tables' tokens, e.g. (B, heads, T, D) with cos and sin (B, 1, T, D), or a tile of
// flattened tokens (n, heads, D) with their rows of the tables as (n, 1, D)), and attention on
// rotated q and k.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor attend_rotated(const ModelConfig& config, const BlockWeights& w, const at::Tensor& q,
                          at::Tensor k, at::Tensor v, const AttentionContext& ctx, KvCache* cache);

}  // namespace rondo::models
