// The layer list and the planner's cost model (layer_specs.h): parameter names and shapes per
// layer, and the parameters, FLOPs and activation bytes a token costs in each. Pure arithmetic on
// ModelConfig, no tensors. Used by the planner (engine/estimate.cpp) and by BlockWeights::bind.
#include "models/layer_specs.h"

#include <algorithm>
#include <string>
#include <utility>

namespace rondo::models {

const char* to_string(LayerKind kind) {
  switch (kind) {
    case LayerKind::kPrefix:
      return "prefix";
    case LayerKind::kBlock:
      return "block";
    case LayerKind::kHead:
      return "head";
  }
  return "?";
}

std::int64_t ParamSpec::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape)
    n *= d;
  return n;
}

std::int64_t LayerSpec::param_count() const {
  std::int64_t n = 0;
  for (const ParamSpec& p : params)
    if (!p.tied) n += p.numel();
  return n;
}

namespace {
// A sparse block's per-expert parameter (weights and biases; not the router's).
bool is_expert_param(const ParamSpec& p) {
  return p.name.find(".experts.") != std::string::npos;
}
}  // namespace

double LayerSpec::active_param_count() const {
  double n = 0, experts = 0;
  for (const ParamSpec& p : params)
    if (!p.tied) (is_expert_param(p) ? experts : n) += static_cast<double>(p.numel());
  if (config.num_experts > 0)
    n += experts * static_cast<double>(config.experts_per_token) /
         static_cast<double>(config.num_experts);
  return n;
}

double LayerSpec::flops_forward_per_token(std::int64_t seq_len) const {
  const ModelConfig& c = config;
  switch (kind) {
    case LayerKind::kPrefix:
      return 0;  // a gather
    case LayerKind::kHead:
      return 2.0 * static_cast<double>(c.vocab_size) * c.hidden_size;
    case LayerKind::kBlock: {
      // A sparse block computes only the routed share of its experts: experts_per_token of them
      // per token.
      double matmul = 0, experts = 0;
      for (const ParamSpec& p : params)
        if (is_expert_param(p))
          experts += 2.0 * p.numel();  // biases too: a token pays for its experts' adds
        else if (p.shape.size() == 2)
          matmul += 2.0 * p.numel();
      if (c.num_experts > 0)
        matmul +=
            experts * static_cast<double>(c.experts_per_token) / static_cast<double>(c.num_experts);
      // Scores and the weighted sum: 2 * 2 * H * D multiply-adds per key, seq_len / 2 keys.
      double attention = 4.0 * c.num_heads * c.head_dim * (static_cast<double>(seq_len) / 2.0);
      return matmul + attention;
    }
  }
  return 0;
}

double LayerSpec::flops_backward_per_token(std::int64_t seq_len) const {
  return 2.0 * flops_forward_per_token(seq_len);
}

double LayerSpec::flops_tiled_recompute_per_token() const {
  if (kind != LayerKind::kBlock) return 0;
  double flops = flops_forward_per_token(0);
  auto ends_with = [](const std::string& s, const std::string& end) {
    return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
  };
  for (const ParamSpec& p : params) {
    bool gradients_alone = ends_with(p.name, "self_attn.o_proj.weight") ||
                           ends_with(p.name, "self_attn.v_proj.weight") ||
                           ends_with(p.name, ".mlp.down_proj.weight");
    if (!config.qk_norm)
      gradients_alone = gradients_alone || ends_with(p.name, "self_attn.q_proj.weight") ||
                        ends_with(p.name, "self_attn.k_proj.weight");
    if (gradients_alone) flops -= 2.0 * static_cast<double>(p.numel());
  }
  return flops;
}

namespace {
// What an RMSNorm (models::rms_norm) keeps for its backward beyond its input and output, per
// token, for norms over `width` values: below fp32 activations only an fp32 scale a token (Note
// [RMSNorm below fp32 under autograd]); in fp32 (or f64), differentiated op by op, the normalised
// input that the weight's product saves when the weight is trained.
std::uint64_t norm_kept_bytes(std::uint64_t width, std::size_t act_bytes, bool trained) {
  return act_bytes < 4 ? 4 : trained ? width * act_bytes : 0;
}
}  // namespace

std::uint64_t LayerSpec::activation_bytes_per_token(std::size_t act_bytes, std::int64_t seq_len,
                                                    bool norms_trained) const {
  const ModelConfig& c = config;
  const auto T = static_cast<std::uint64_t>(std::max<std::int64_t>(seq_len, 0));
  switch (kind) {
    case LayerKind::kPrefix:
      // The embedding's output.
      return c.hidden_size * act_bytes;
    case LayerKind::kHead:
      // Normed input, plus one chunk of fp32 logits is transient, not per token.
      return 2 * c.hidden_size * act_bytes +
             norm_kept_bytes(c.hidden_size, act_bytes, norms_trained);
    case LayerKind::kBlock: {
      // x, normed x (twice), q k v (rotated copies too), attention output, o output; then the
      // MLP's.
      std::uint64_t bytes =
          (4 * c.hidden_size + 2 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
           c.num_heads * c.head_dim) *
          act_bytes;
      // The norms' own (the input and post-attention norms, and q and k's where the family has
      // them).
      bytes += norm_kept_bytes(
          2 * c.hidden_size + (c.qk_norm ? (c.num_heads + c.num_kv_heads) * c.head_dim : 0),
          act_bytes, norms_trained);
      // Attention's own, and the MLP's intermediates.
      return bytes + attention_kept_bytes(act_bytes, T) + mlp_bytes_per_token(act_bytes);
    }
  }
  return 0;
}

std::uint64_t LayerSpec::attention_kept_bytes(std::size_t act_bytes, std::uint64_t seq_len) const {
  // The probabilities on the plain path, kept for the backward; a logsumexp per head on the fused
  // kernels.
  const bool plain = config.attention_dropout > 0 || config.attention_sinks;
  return plain ? config.num_heads * seq_len * act_bytes : config.num_heads * 4;
}

std::uint64_t LayerSpec::tiled_activation_bytes_per_token(std::size_t act_bytes,
                                                          std::int64_t seq_len,
                                                          bool norms_trained) const {
  if (kind != LayerKind::kBlock)
    return activation_bytes_per_token(act_bytes, seq_len, norms_trained);
  // Note [Sequence tiling of the attention half] (models/layers.cpp): x, the rotated q, k and v,
  // attention's output (as it returns it, and as the rows o takes) and the half's output; the
  // rest is one tile's.
  const ModelConfig& c = config;
  return (2 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
          2 * c.num_heads * c.head_dim) *
             act_bytes +
         attention_kept_bytes(act_bytes,
                              static_cast<std::uint64_t>(std::max<std::int64_t>(seq_len, 0)));
}

std::uint64_t LayerSpec::backward_bytes_per_token(std::size_t act_bytes, bool tiled) const {
  const ModelConfig& c = config;
  // The head (models::head_forward_backward): the gradient of the normed input, filled chunk by
  // chunk, then the final norm's backward in fp32 (its input, its gradient and one temporary).
  if (kind == LayerKind::kHead) return c.hidden_size * act_bytes + 3 * c.hidden_size * 4;
  if (kind != LayerKind::kBlock) return 0;
  // Tiled (attention_backward_tiled): the gradient of the half's output, of attention's output
  // (as o gives it, and as attention takes it) and of the rotated q, k and v; the rest is a tile's.
  if (tiled)
    return (c.hidden_size + (3 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * act_bytes;
  // Untiled, before the MLP's: the gradients of attention's tensors and of the normed input, and
  // the input norm's backward, in fp32 whatever the activations' dtype (its input, its input's
  // gradient and one temporary).
  const std::uint64_t attention =
      (c.hidden_size + (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim) * act_bytes +
      3 * c.hidden_size * 4;
  const std::uint64_t mlp =
      c.sparse(block) ? 2 * c.experts_per_token * c.moe_intermediate_size : 2 * c.intermediate_size;
  return std::max(attention, mlp * act_bytes);
}

std::uint64_t LayerSpec::forward_bytes_per_token(std::size_t act_bytes) const {
  if (kind != LayerKind::kBlock) return 0;
  // The half's output, the norm's fp32 copy of it (none in fp32), the normalised input in fp32,
  // and the result in the activations' dtype (models::rms_norm).
  const std::uint64_t C = config.hidden_size;
  return C * act_bytes + (act_bytes < 4 ? 4 * C : 0) + 4 * C + C * act_bytes;
}

std::uint64_t LayerSpec::tileable_bytes_per_token(std::size_t act_bytes) const {
  if (kind != LayerKind::kBlock) return 0;
  // The attention half's share: what it keeps untiled beyond what it keeps tiled (its norms'
  // own included), with the norm's fp32 transients.
  const std::uint64_t attention =
      activation_bytes_per_token(act_bytes) - mlp_bytes_per_token(act_bytes) -
      tiled_activation_bytes_per_token(act_bytes) + 3 * config.hidden_size * 4;
  return std::max(attention, mlp_bytes_per_token(act_bytes));
}

std::uint64_t LayerSpec::mlp_bytes_per_token(std::size_t act_bytes) const {
  const ModelConfig& c = config;
  if (kind != LayerKind::kBlock) return 0;
  // A sparse block: router logits and probabilities, and per routed copy of a token its gathered
  // input, the four MLP intermediates and the weighted output. A dense one: gate, up,
  // silu(gate), their product.
  if (c.sparse(block))
    return (2 * c.num_experts +
            c.experts_per_token * (2 * c.hidden_size + 4 * c.moe_intermediate_size)) *
           act_bytes;
  return 4 * static_cast<std::uint64_t>(c.intermediate_size) * act_bytes;
}

std::vector<LayerSpec> layer_specs(const ModelConfig& c) {
  const std::int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim,
                     I = c.intermediate_size, V = c.vocab_size;
  std::vector<LayerSpec> specs;
  LayerSpec prefix;
  prefix.kind = LayerKind::kPrefix;
  prefix.config = c;
  prefix.params.push_back({"model.embed_tokens.weight", {V, C}});
  specs.push_back(prefix);
  for (std::int64_t b = 0; b < c.num_layers; ++b) {
    LayerSpec s;
    s.kind = LayerKind::kBlock;
    s.block = static_cast<int>(b);
    s.config = c;
    std::string p = "model.layers." + std::to_string(b) + ".";
    auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
      s.params.push_back({p + name, std::move(shape)});
    };
    add("input_layernorm.weight", {C});
    add("self_attn.q_proj.weight", {H * D, C});
    if (c.attention_bias) add("self_attn.q_proj.bias", {H * D});
    add("self_attn.k_proj.weight", {KV * D, C});
    if (c.attention_bias) add("self_attn.k_proj.bias", {KV * D});
    add("self_attn.v_proj.weight", {KV * D, C});
    if (c.attention_bias) add("self_attn.v_proj.bias", {KV * D});
    add("self_attn.o_proj.weight", {C, H * D});
    if (c.attention_out_bias) add("self_attn.o_proj.bias", {C});
    if (c.qk_norm) {
      add("self_attn.q_norm.weight", {D});
      add("self_attn.k_norm.weight", {D});
    }
    if (c.attention_sinks) add("self_attn.sinks", {H});
    add("post_attention_layernorm.weight", {C});
    if (c.sparse(b) && c.family == Family::kGptOss) {
      // GPT-OSS stores its experts fused, x @ W layout, gate and up interleaved, with biases.
      const std::int64_t E = c.num_experts, F = c.moe_intermediate_size;
      add("mlp.router.weight", {E, C});
      add("mlp.router.bias", {E});
      add("mlp.experts.gate_up_proj", {E, C, 2 * F});
      add("mlp.experts.gate_up_proj_bias", {E, 2 * F});
      add("mlp.experts.down_proj", {E, F, C});
      add("mlp.experts.down_proj_bias", {E, C});
      specs.push_back(std::move(s));
      continue;
    }
    if (c.sparse(b)) {
      // As the checkpoints store them: one module per expert.
      const std::int64_t E = c.num_experts, F = c.moe_intermediate_size;
      const bool mixtral = c.family == Family::kMixtral;
      const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
      add(moe + "gate.weight", {E, C});
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string x = moe + "experts." + std::to_string(e) + ".";
        add(x + (mixtral ? "w1" : "gate_proj") + ".weight", {F, C});
        add(x + (mixtral ? "w3" : "up_proj") + ".weight", {F, C});
        add(x + (mixtral ? "w2" : "down_proj") + ".weight", {C, F});
      }
      specs.push_back(std::move(s));
      continue;
    }
    add("mlp.gate_proj.weight", {I, C});
    if (c.mlp_bias) add("mlp.gate_proj.bias", {I});
    add("mlp.up_proj.weight", {I, C});
    if (c.mlp_bias) add("mlp.up_proj.bias", {I});
    add("mlp.down_proj.weight", {C, I});
    if (c.mlp_bias) add("mlp.down_proj.bias", {C});
    specs.push_back(std::move(s));
  }
  LayerSpec head;
  head.kind = LayerKind::kHead;
  head.config = c;
  head.params.push_back({"model.norm.weight", {C}});
  if (c.tie_word_embeddings)
    head.params.push_back({"model.embed_tokens.weight", {V, C}, true});
  else
    head.params.push_back({"lm_head.weight", {V, C}});
  specs.push_back(head);
  return specs;
}

}  // namespace rondo::models
