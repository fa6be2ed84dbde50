// What a model is: the family and its dimensions, from a Hugging Face config.json (old style with
// `rope_theta`/`rope_scaling`, or transformers 5's `rope_parameters`) or from GGUF metadata.
// Everything downstream (layers, planner, export) reads this struct; validate() has checked it.
//
// Names: B, T, C, H, KV, D, V, L = batch, tokens, hidden, heads, kv-heads, head dim, vocab, layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/dtype.h"

namespace rondo::models {

enum class Family { kLlama, kMistral, kQwen2, kQwen3, kQwen3Moe, kMixtral, kGptOss };
// "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss" (transformers'
// model_type)
const char* to_string(Family family);

// Rotary position embeddings as transformers computes them (modeling_rope_utils): "default";
// "linear" (positions divided by factor); "dynamic" (NTK: the base grows with the sequence once it
// is longer than max_position_embeddings, computed from the longest position of the batch);
// "yarn" (frequencies ramped between extrapolation and interpolation by factor, cos and sin
// scaled by attention_factor); "llama3".
struct RopeConfig {
  std::string type = "default";
  double theta = 10000.0;  // base
  // linear, dynamic, yarn, llama3:
  double factor = 1.0;
  // llama3:
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3, yarn: the pretraining context
  std::int64_t original_max_position_embeddings = 8192;
  // yarn: the rotation counts bounding the ramp, whether its ends are rounded to whole dimensions,
  // and the factor on cos and sin (from factor, or mscale / mscale_all_dim, unless given).
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  double attention_factor = 1.0;
};

struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", ...
  Family family = Family::kLlama;
  std::int64_t vocab_size = 0;         // V
  std::int64_t hidden_size = 0;        // C
  std::int64_t intermediate_size = 0;  // MLP width
  std::int64_t num_layers = 0;         // L
  std::int64_t num_heads = 0;          // H
  std::int64_t num_kv_heads = 0;       // KV (GQA when < H)
  std::int64_t head_dim = 0;           // D (need not be C / H)
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double attention_dropout = 0;  // on the attention probabilities, in training only
  RopeConfig rope;
  bool tie_word_embeddings = false;  // LM head = embedding matrix
  bool attention_bias = false;       // bias on q, k, v (Qwen2 always; Llama when set)
  bool attention_out_bias = false;   // bias on o_proj (Llama attention_bias)
  bool mlp_bias = false;             // bias on gate/up/down (Llama mlp_bias)
  bool qk_norm = false;              // RMSNorm on q and k per head (Qwen3)
  std::int64_t sliding_window = 0;   // 0 = full attention
  // Which layers the window applies to: empty = all of them (Mistral); else one flag per layer
  // (Qwen2/Qwen3's use_sliding_window: layer_types, or the layers from max_window_layers on).
  std::vector<bool> sliding_layers;
  bool windowed(std::int64_t layer) const {
    return sliding_window > 0 &&
           (sliding_layers.empty() || sliding_layers[static_cast<std::size_t>(layer)]);
  }
  // Mixture of experts (Qwen3-MoE, Mixtral): the MLP of a sparse block is num_experts SwiGLU
  // experts of width moe_intermediate_size and a router (mlp.gate) that sends each token to the
  // experts_per_token with the highest softmax probability, weighted by those probabilities
  // (renormalised to sum to 1 when norm_topk_prob). 0 experts = dense.
  std::int64_t num_experts = 0;
  std::int64_t experts_per_token = 0;
  std::int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  // Which blocks are sparse: empty = all of them (when num_experts > 0); else one flag per block
  // (Qwen3-MoE's decoder_sparse_step and mlp_only_layers: the others have a dense MLP of
  // intermediate_size).
  std::vector<bool> sparse_layers;
  bool sparse(std::int64_t layer) const {
    return num_experts > 0 &&
           (sparse_layers.empty() || sparse_layers[static_cast<std::size_t>(layer)]);
  }
  std::int64_t sparse_layer_count() const;
  // The router's load-balancing loss (transformers' load_balancing_loss_func) is added to the
  // training loss times router_aux_loss_coef when output_router_logits is set, as transformers
  // does.
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
  // GPT-OSS: a learned logit per head that joins each softmax of the attention (attention sinks);
  // the router has a bias and weighs the top-k by a softmax over their logits; the experts are
  // fused (gate_up_proj (E, C, 2I) with gate and up interleaved, down_proj (E, I, C), biases) and
  // gate with a clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
  // g = min(gate, limit).
  bool attention_sinks = false;
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  DType dtype = DType::kF32;  // dtype the checkpoint declares
  std::vector<std::int64_t> eos_token_ids;
  std::int64_t bos_token_id = -1;  // -1 = none

  // Every inconsistency at once (e.g. heads not a multiple of kv-heads), each naming the field.
  std::vector<std::string> problems() const;
  // The positions a run may use: max_position_embeddings, or YaRN's original context times its
  // factor when that is more (Qwen documents adding YaRN to Qwen3's config.json without raising
  // max_position_embeddings; transformers and vLLM then run 4x as long). 0 = no limit known.
  std::int64_t positions() const;
};

// What to add to a model's config.json for rows of `seq_len` tokens past its positions: the rope
// scaling its family is extended with (Llama 3's own for Llama, as 3.1 has it; YaRN for the
// others), with a factor that is a power of two, as a config.json fragment and what names it.
struct RopeAdvice {
  std::string json;  // "\"rope_scaling\": {...}" (and max_position_embeddings for Llama 3's)
  std::string name;  // "YaRN", "Llama 3's rope scaling"
};
RopeAdvice rope_scaling_advice(const ModelConfig& config, std::int64_t seq_len);

// Parses config.json text; `source` names the file in errors. Throws Error listing every problem.
ModelConfig parse_hf_config(const std::string& json_text, const std::string& source);
ModelConfig load_hf_config(const std::string& path);

// config.json for the config (transformers' keys for its family; the weights declared as
// `dtype`), so that parse_hf_config and transformers read back the same model. Throws Error for
// what transformers' config cannot say (Llama biases on q/k/v but not on o_proj).
std::string hf_config_json(const ModelConfig& config, DType dtype);

}  // namespace rondo::models
