// The model as a list of layers — [prefix, block_0 .. block_{L-1}, head] — by parameter names and
// shapes, and the planner's cost model for each layer (parameters, FLOPs, activation bytes per
// token). Owns no tensors and touches none: pure arithmetic on ModelConfig. Used by the planner
// (engine/estimate.cpp), the weight readers and the block functions (models/layers.h).
//
//   auto specs = models::layer_specs(cfg);
//   double f = specs[1].flops_forward_per_token(/*seq_len=*/4096);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
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
  // What a block's backward under sequence tiling computes once more, per token: its forward
  // without attention, less the projections recomputed for their gradients alone (o, v, a dense
  // MLP's down, q and k where they have no norms: Note [Projections recomputed for their
  // gradients alone] in models/layers.cpp). 0 for other layers.
  double flops_tiled_recompute_per_token() const;
  // Bytes autograd keeps per token to run this layer's backward, activations in `act` dtype
  // (an estimate from the shapes). Attention as it runs in training (models::attend): on the
  // fused kernels (flash or memory-efficient attention, per document or under a mask, on CUDA
  // and on the CPU alike) a block keeps its output and one fp32 logsumexp per head; on the plain
  // path (attention dropout, GPT-OSS's sinks) its (H, T, T) probabilities, H·T values per token
  // for rows of `seq_len` tokens. The masks are the planner's (PlanInputs::mask_bytes_per_token).
  // `norms_trained` (full fine-tuning): in fp32 each norm also keeps its normalised input.
  std::uint64_t activation_bytes_per_token(std::size_t act_bytes, std::int64_t seq_len = 0,
                                           bool norms_trained = false) const;
  // activation_bytes_per_token under sequence tiling (AttentionContext::mlp_tile_tokens, Note
  // [Sequence tiling of the attention half] in models/layers.cpp): a block keeps its input, the
  // rotated q, k and v, attention's output and its own, and the half's output; the rest exists for
  // one tile. Other layers: as untiled.
  std::uint64_t tiled_activation_bytes_per_token(std::size_t act_bytes, std::int64_t seq_len = 0,
                                                 bool norms_trained = false) const;
  // What one tile holds per token while sequence tiling runs a block (its forward; the backward
  // holds their gradients beside them): the MLP's intermediates (a sparse block's router and
  // experts') or the attention half's projections and norms, whichever is more. 0 for other
  // layers.
  std::uint64_t tileable_bytes_per_token(std::size_t act_bytes) const;
  // What the layer's backward holds per token beyond what it keeps: the gradients of its
  // activations alive at once — in a block, those of the MLP's intermediates (2 x
  // intermediate_size) or, before them, of attention's q, k, v and output and the normed input
  // with the norm's fp32 backward, whichever is more; in the head, its normed input's gradient
  // and the final norm's backward. `tiled`: the MLP's and the projections' are one tile's, so
  // only the gradients of the half's output, of attention's output and of q, k, v count.
  std::uint64_t backward_bytes_per_token(std::size_t act_bytes, bool tiled) const;
  // What the layer's forward without autograd (a forward stage) holds per token at its peak
  // beyond its input: in a block, the attention half's output beside the post-attention norm's
  // fp32 work (its input in fp32, the normalised input, the result); the MLP's intermediates are
  // activation_bytes_per_token's. 0 for other layers.
  std::uint64_t forward_bytes_per_token(std::size_t act_bytes) const;

 private:
  // A block's MLP intermediates per token (a sparse block's router and experts').
  std::uint64_t mlp_bytes_per_token(std::size_t act_bytes) const;
  // What attention itself keeps per token for its backward, in rows of seq_len tokens.
  std::uint64_t attention_kept_bytes(std::size_t act_bytes, std::uint64_t seq_len) const;

 public:
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

}  // namespace rondo::models
