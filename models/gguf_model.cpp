// Note [llama.cpp rotary permutation]
// Hugging Face's Llama applies rotary embeddings to the two halves of each head (element i pairs
// with i + D/2); ggml's "normal" rope pairs neighbours (2i with 2i+1). So llama.cpp's converter
// reorders the rows of q_proj and k_proj (weights and biases) of `llama` models, per head: viewing
// a head's D rows as (2, D/2), it swaps the axes to (D/2, 2). We undo that on load: view as
// (heads, D/2, 2, ...), swap back to (heads, 2, D/2, ...). Qwen2 and Qwen3 use ggml's "neox"
// rope, which pairs halves as HF does, so their rows are stored unchanged.
#include "models/gguf_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "kernels/error.h"

namespace rondo::models {
namespace {

constexpr const char* kRopeFreqs = "rope_freqs.weight";

// llama.cpp keeps no llama3 rope parameters, only their result: rope_freqs.weight. Recover them:
// the largest factor is `factor`; between the two plateaus 1/f is linear in position/wavelength,
// which gives low_freq_factor and high_freq_factor for the original context length (scaling all
// three together leaves every factor unchanged, so the length from metadata, or Llama 3's 8192,
// is as good as any). The result is checked by recomputing every factor.
void recover_llama3_rope(const GgufFile& file, ModelConfig& c, const std::string& arch) {
  const GgufTensorInfo& t = file.tensor(kRopeFreqs);
  auto fail = [&](const std::string& why) {
    throw Error(file.path() + ": tensor '" + kRopeFreqs + "': " + why +
                "; Rondo supports rope frequency factors only as Llama 3 rope scaling");
  };
  if (t.ne.size() != 1 || t.ne[0] != c.head_dim / 2)
    fail("expected " + std::to_string(c.head_dim / 2) + " factors (head_dim / 2), found shape " +
         shape_text(t.shape()));
  at::Tensor ft = load_tensor(file, kRopeFreqs, DType::kF32);
  std::vector<double> f(ft.data_ptr<float>(), ft.data_ptr<float>() + ft.numel());
  // Before any comparison: max_element and the tolerance checks below are false for NaN.
  for (std::size_t i = 0; i < f.size(); ++i)
    if (!std::isfinite(f[i]))
      fail("factor " + std::to_string(i) + " is " + std::to_string(f[i]) + ", not a finite number");
  RopeConfig r = c.rope;
  r.type = "llama3";
  r.factor = *std::max_element(f.begin(), f.end());
  const std::string context_key = arch + ".rope.scaling.original_context_length";
  r.original_max_position_embeddings = file.get_int(context_key, 8192);
  if (r.original_max_position_embeddings <= 0)
    throw Error(file.path() + ": metadata '" + context_key + "' is " +
                std::to_string(r.original_max_position_embeddings) +
                "; Llama 3 rope scaling needs a positive original context length");
  if (!(r.factor >= 1.0))
    fail("the largest factor is " + std::to_string(r.factor) +
         ", but Llama 3 rope scaling only divides frequencies by factors of at least 1");
  if (r.factor == 1.0) return;                  // no scaling at all
  constexpr double kTol = 1e-5;                 // the factors are stored in float32
  std::vector<std::pair<double, double>> ramp;  // (context / wavelength, smooth) between plateaus
  for (std::size_t i = 0; i < f.size(); ++i) {
    if (f[i] <= 1.0 + kTol || f[i] >= r.factor * (1 - kTol)) continue;
    const double freq = 1.0 / std::pow(r.theta, static_cast<double>(2 * i) / c.head_dim);
    const double x = r.original_max_position_embeddings / (2 * M_PI / freq);
    ramp.emplace_back(x, (1.0 / f[i] - 1.0 / r.factor) / (1.0 - 1.0 / r.factor));
  }
  if (ramp.size() >= 2) {
    const auto [x1, s1] = ramp.front();
    const auto [x2, s2] = ramp.back();
    const double slope = (s2 - s1) / (x2 - x1);  // 1 / (high - low)
    if (!(slope > 0)) fail("the factors between the plateaus do not rise as Llama 3's do");
    r.low_freq_factor = x1 - s1 / slope;
    r.high_freq_factor = r.low_freq_factor + 1.0 / slope;
  }  // else keep Llama 3's defaults (1, 4) if they reproduce the factors
  const std::vector<double> expect = llama3_rope_factors(r, c.head_dim);
  for (std::size_t i = 0; i < f.size(); ++i)
    if (!(std::abs(expect[i] - f[i]) <= kTol * std::max(1.0, std::abs(f[i]))))  // NaN fails
      fail("factor " + std::to_string(i) + " is " + std::to_string(f[i]) +
           " but Llama 3 rope scaling with factor " + std::to_string(r.factor) + " gives " +
           std::to_string(expect[i]));
  c.rope = r;
}

}  // namespace

// llama3 frequency factors for given parameters, as llama.cpp's converter computes them into
// rope_freqs.weight (one factor per rotary pair; the rotation frequency is divided by it).
std::vector<double> llama3_rope_factors(const RopeConfig& r, std::int64_t head_dim) {
  std::vector<double> out;
  const double low_wavelen = r.original_max_position_embeddings / r.low_freq_factor;
  const double high_wavelen = r.original_max_position_embeddings / r.high_freq_factor;
  for (std::int64_t i = 0; i < head_dim; i += 2) {
    const double freq = 1.0 / std::pow(r.theta, static_cast<double>(i) / head_dim);
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      out.push_back(1.0);
    } else if (wavelen > low_wavelen) {
      out.push_back(r.factor);
    } else {
      const double smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) /
                            (r.high_freq_factor - r.low_freq_factor);
      out.push_back(1.0 / ((1 - smooth) / r.factor + smooth));
    }
  }
  return out;
}

ModelConfig config_from_gguf(const GgufFile& file) {
  const std::string arch = file.get_string("general.architecture");
  ModelConfig c;
  if (arch == "llama") {
    c.family = Family::kLlama;  // Mistral too: llama.cpp stores it as llama
    c.architecture = "LlamaForCausalLM";
  } else if (arch == "qwen2") {
    c.family = Family::kQwen2;
    c.architecture = "Qwen2ForCausalLM";
  } else if (arch == "qwen3") {
    c.family = Family::kQwen3;
    c.architecture = "Qwen3ForCausalLM";
  } else if (arch == "qwen3moe") {
    c.family = Family::kQwen3Moe;
    c.architecture = "Qwen3MoeForCausalLM";
  } else if (arch == "gpt-oss") {
    c.family = Family::kGptOss;
    c.architecture = "GptOssForCausalLM";
  } else {
    throw Error(file.path() + ": metadata 'general.architecture' is '" + arch +
                "', which Rondo does not support (supported: llama, which includes Mistral and "
                "Mixtral, qwen2, qwen3, qwen3moe, gpt-oss)");
  }
  auto key = [&](const char* suffix) { return arch + "." + suffix; };
  // Experts: llama.cpp's llama with expert_count is Mixtral. Every block with a router
  // (ffn_gate_inp) is sparse; the top-k probabilities are renormalised (llama.cpp does so for
  // both unless expert_weights_norm says otherwise).
  c.num_experts = file.get_int(key("expert_count"), 0);
  if (c.num_experts > 0) {
    if (c.family == Family::kLlama) {
      c.family = Family::kMixtral;
      c.architecture = "MixtralForCausalLM";
    }
    if (c.family != Family::kMixtral && c.family != Family::kQwen3Moe &&
        c.family != Family::kGptOss)
      throw Error(file.path() + ": metadata '" + key("expert_count") + "' says " +
                  std::to_string(c.num_experts) +
                  " experts; Rondo reads experts for llama "
                  "(Mixtral), qwen3moe and gpt-oss only");
    c.experts_per_token = file.get_int(key("expert_used_count"));
    c.norm_topk_prob = file.get_bool(key("expert_weights_norm"), true);
  }

  c.hidden_size = file.get_int(key("embedding_length"));
  c.num_layers = file.get_int(key("block_count"));
  c.intermediate_size = file.get_int(key("feed_forward_length"));
  if (c.num_experts > 0) {
    c.moe_intermediate_size = c.family == Family::kMixtral
                                  ? c.intermediate_size
                                  : file.get_int(key("expert_feed_forward_length"));
    std::vector<bool> sparse;
    for (std::int64_t l = 0; l < c.num_layers && l < 4096; ++l)
      sparse.push_back(file.find_tensor("blk." + std::to_string(l) + ".ffn_gate_inp.weight") !=
                       nullptr);
    if (std::find(sparse.begin(), sparse.end(), false) != sparse.end())
      c.sparse_layers = std::move(sparse);
  }
  c.num_heads = file.get_int(key("attention.head_count"));
  c.num_kv_heads = file.get_int(key("attention.head_count_kv"), c.num_heads);
  c.head_dim =
      file.get_int(key("attention.key_length"), c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  const std::int64_t value_length = file.get_int(key("attention.value_length"), c.head_dim);
  if (value_length != c.head_dim)
    throw Error(file.path() + ": metadata '" + key("attention.value_length") + "' (" +
                std::to_string(value_length) + ") differs from the key length (" +
                std::to_string(c.head_dim) + "); Rondo's families need equal lengths");
  const std::int64_t rope_dims = file.get_int(key("rope.dimension_count"), c.head_dim);
  if (rope_dims != c.head_dim)
    throw Error(file.path() + ": metadata '" + key("rope.dimension_count") + "' (" +
                std::to_string(rope_dims) + ") is not the head dimension (" +
                std::to_string(c.head_dim) + "): partial rotary embeddings are not supported");
  c.max_position_embeddings = file.get_int(key("context_length"), 4096);
  if (c.max_position_embeddings <= 0)
    throw Error(file.path() + ": metadata '" + key("context_length") + "' is " +
                std::to_string(c.max_position_embeddings) +
                ": it must be the number of positions the model supports");
  c.rms_norm_eps = file.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope.theta = file.get_float(key("rope.freq_base"), 10000.0);
  // Rope scaling as llama.cpp's converter writes it: type, factor and, for yarn, the pretraining
  // context (the yarn parameters llama.cpp does not store take transformers' defaults).
  const std::string scaling = file.get_string(key("rope.scaling.type"), "none");
  if (scaling == "linear" || scaling == "yarn") {
    c.rope.type = scaling;
    c.rope.factor = file.get_float(key("rope.scaling.factor"));
    if (scaling == "yarn") {
      c.rope.original_max_position_embeddings =
          file.get_int(key("rope.scaling.original_context_length"), c.max_position_embeddings);
      c.rope.attention_factor = c.rope.factor <= 1 ? 1.0 : 0.1 * std::log(c.rope.factor) + 1.0;
    }
  } else if (scaling != "none") {
    throw Error(file.path() + ": metadata '" + key("rope.scaling.type") + "' is '" + scaling +
                "'; Rondo supports none, linear, yarn and Llama 3's (stored as rope_freqs.weight)");
  }

  if (file.has("tokenizer.ggml.tokens")) {
    const GgufValue& tokens = *file.find("tokenizer.ggml.tokens");
    if (tokens.type() != GgufValueType::kArray)
      throw Error(file.path() + ": metadata 'tokenizer.ggml.tokens' should be an array");
    c.vocab_size = static_cast<std::int64_t>(tokens.size());
  } else if (file.has(key("vocab_size"))) {
    c.vocab_size = file.get_int(key("vocab_size"));
  } else if (const GgufTensorInfo* e = file.find_tensor("token_embd.weight");
             e != nullptr && e->ne.size() == 2) {
    c.vocab_size = e->ne[1];
  }

  c.tie_word_embeddings = file.find_tensor("output.weight") == nullptr;
  c.attention_bias = c.family == Family::kQwen2 || file.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.attention_out_bias = file.find_tensor("blk.0.attn_output.bias") != nullptr;
  c.mlp_bias = file.find_tensor("blk.0.ffn_gate.bias") != nullptr;
  c.qk_norm = c.family == Family::kQwen3 || c.family == Family::kQwen3Moe;
  if (c.family == Family::kGptOss) {
    // As llama.cpp reads gpt-oss: every block sparse with biased experts and router, sinks,
    // biased attention, even layers sliding (unless sliding_window_pattern says otherwise), and
    // the SwiGLU's alpha and limit it hardcodes (transformers' defaults). The YaRN of GPT-OSS's
    // checkpoints does not truncate its correction range; llama.cpp keeps no flag for it.
    if (c.num_experts <= 0)
      throw Error(file.path() + ": metadata '" + key("expert_count") +
                  "' is missing: gpt-oss blocks are mixtures of experts");
    c.sparse_layers.clear();
    c.attention_bias = c.attention_out_bias = true;
    c.attention_sinks = true;
    c.swiglu_alpha = 1.702;
    c.swiglu_limit = 7.0;
    c.rope.truncate = false;
    c.sliding_window = file.get_int(key("attention.sliding_window"));
    c.sliding_layers.assign(
        static_cast<std::size_t>(std::clamp<std::int64_t>(c.num_layers, 0, 4096)), false);
    const GgufValue* pattern = file.find(key("attention.sliding_window_pattern"));
    for (std::size_t l = 0; l < c.sliding_layers.size(); ++l) {
      if (pattern == nullptr) {
        c.sliding_layers[l] = l % 2 == 0;
      } else if (pattern->type() == GgufValueType::kArray) {
        if (pattern->size() != c.sliding_layers.size())
          throw Error(file.path() + ": metadata '" + key("attention.sliding_window_pattern") +
                      "' lists " + std::to_string(pattern->size()) + " layers, the model has " +
                      std::to_string(c.sliding_layers.size()));
        const std::optional<bool> b = pattern->at(l).to_bool();
        if (!b)
          throw Error(file.path() + ": metadata '" + key("attention.sliding_window_pattern") +
                      "' must be booleans or one integer");
        c.sliding_layers[l] = *b;
      } else {  // every n-th layer is full, as llama.cpp's set_swa_pattern
        const std::int64_t n = file.get_int(key("attention.sliding_window_pattern"));
        c.sliding_layers[l] = n <= 0 || static_cast<std::int64_t>(l) % n < n - 1;
      }
    }
  }

  // The declared dtype: F32 or F16 when every tensor is (F32 norms beside F16 matrices count as
  // F16); anything quantised or BF16 streams as BF16.
  bool all_f32 = true, all_f16_or_f32 = true;
  for (const GgufTensorInfo& t : file.tensors()) {
    all_f32 = all_f32 && t.type == GgmlType::kF32;
    all_f16_or_f32 = all_f16_or_f32 && (t.type == GgmlType::kF32 || t.type == GgmlType::kF16);
  }
  c.dtype = all_f32 ? DType::kF32 : all_f16_or_f32 ? DType::kF16 : DType::kBF16;

  auto token_id = [&](const char* k) -> std::int64_t { return file.get_int(k, -1); };
  c.bos_token_id = token_id("tokenizer.ggml.bos_token_id");
  for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                        "tokenizer.ggml.eom_token_id"}) {
    const std::int64_t id = token_id(k);
    if (id >= 0 &&
        std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
      c.eos_token_ids.push_back(id);
  }

  auto check = [&] {
    std::vector<std::string> problems = c.problems();
    if (problems.empty()) return;
    std::string text = file.path() + ": invalid model metadata:";
    for (auto& p : problems)
      text += "\n  - " + p;
    throw Error(text);
  };
  check();  // recover_llama3_rope needs a valid head_dim
  if (file.find_tensor(kRopeFreqs) != nullptr) {
    recover_llama3_rope(file, c, arch);
    check();
  }
  return c;
}

const char* gguf_architecture(Family family) {
  switch (family) {
    case Family::kLlama:
    case Family::kMistral:
      return "llama";
    case Family::kQwen2:
      return "qwen2";
    case Family::kQwen3:
      return "qwen3";
    case Family::kQwen3Moe:
      return "qwen3moe";
    case Family::kMixtral:
      return "llama";  // llama.cpp stores Mixtral as llama with experts
    case Family::kGptOss:
      return "gpt-oss";
  }
  return "?";
}

std::vector<GgufTensorMapping> gguf_names(const ModelConfig& c) {
  gguf_architecture(c.family);  // refuses a family without a GGUF layout here
  const std::int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  const std::int64_t V = c.vocab_size, F = c.intermediate_size;
  // llama.cpp permutes q/k rows for llama only (Note [llama.cpp rotary permutation]).
  const bool permuted =
      c.family == Family::kLlama || c.family == Family::kMistral || c.family == Family::kMixtral;
  std::vector<GgufTensorMapping> out;
  auto add = [&](std::string gguf, std::string hf, std::vector<std::int64_t> shape,
                 std::int64_t heads = 0, std::int64_t expert = -1) {
    out.push_back({std::move(gguf), std::move(hf), std::move(shape), permuted ? heads : 0, expert});
  };
  add("token_embd.weight", "model.embed_tokens.weight", {V, C});
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string g = "blk." + std::to_string(l) + ".";
    const std::string h = "model.layers." + std::to_string(l) + ".";
    add(g + "attn_norm.weight", h + "input_layernorm.weight", {C});
    add(g + "attn_q.weight", h + "self_attn.q_proj.weight", {H * D, C}, H);
    add(g + "attn_k.weight", h + "self_attn.k_proj.weight", {KV * D, C}, KV);
    add(g + "attn_v.weight", h + "self_attn.v_proj.weight", {KV * D, C});
    add(g + "attn_output.weight", h + "self_attn.o_proj.weight", {C, H * D});
    if (c.attention_bias) {
      add(g + "attn_q.bias", h + "self_attn.q_proj.bias", {H * D}, H);
      add(g + "attn_k.bias", h + "self_attn.k_proj.bias", {KV * D}, KV);
      add(g + "attn_v.bias", h + "self_attn.v_proj.bias", {KV * D});
    }
    if (c.attention_out_bias) add(g + "attn_output.bias", h + "self_attn.o_proj.bias", {C});
    if (c.qk_norm) {
      add(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight", {D});
      add(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight", {D});
    }
    if (c.family == Family::kGptOss) {
      // llama.cpp's gpt-oss: gate and up as separate expert tensors (E, I, C), down as (E, C, I),
      // F32 biases; HF's fused x @ W experts are made from them (GgufTensorMapping).
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size;
      add(g + "attn_sinks.weight", h + "self_attn.sinks", {H});
      add(g + "post_attention_norm.weight", h + "post_attention_layernorm.weight", {C});
      add(g + "ffn_gate_inp.weight", h + "mlp.router.weight", {E, C});
      add(g + "ffn_gate_inp.bias", h + "mlp.router.bias", {E});
      auto fused = [&](std::string gguf, std::string gguf2, std::string hf,
                       std::vector<std::int64_t> shape, std::vector<std::int64_t> gguf_shape,
                       bool transpose) {
        add(std::move(gguf), std::move(hf), std::move(shape));
        out.back().gguf_name2 = std::move(gguf2);
        out.back().gguf_shape = std::move(gguf_shape);
        out.back().transpose = transpose;
      };
      fused(g + "ffn_gate_exps.weight", g + "ffn_up_exps.weight", h + "mlp.experts.gate_up_proj",
            {E, C, 2 * I}, {E, I, C}, true);
      fused(g + "ffn_gate_exps.bias", g + "ffn_up_exps.bias", h + "mlp.experts.gate_up_proj_bias",
            {E, 2 * I}, {E, I}, false);
      fused(g + "ffn_down_exps.weight", "", h + "mlp.experts.down_proj", {E, I, C}, {E, C, I},
            true);
      add(g + "ffn_down_exps.bias", h + "mlp.experts.down_proj_bias", {E, C});
      continue;
    }
    add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", {C});
    if (c.sparse(l)) {
      // llama.cpp stores a sparse block's experts as one tensor per projection, expert-major
      // (torch shape (E, rows, cols)); each HF expert tensor is one slice.
      const std::int64_t E = c.num_experts, I = c.moe_intermediate_size;
      const bool mixtral = c.family == Family::kMixtral;
      const std::string moe = h + (mixtral ? "block_sparse_moe." : "mlp.");
      add(g + "ffn_gate_inp.weight", moe + "gate.weight", {E, C});
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string x = moe + "experts." + std::to_string(e) + ".";
        add(g + "ffn_gate_exps.weight", x + (mixtral ? "w1" : "gate_proj") + ".weight", {I, C}, 0,
            e);
        add(g + "ffn_up_exps.weight", x + (mixtral ? "w3" : "up_proj") + ".weight", {I, C}, 0, e);
        add(g + "ffn_down_exps.weight", x + (mixtral ? "w2" : "down_proj") + ".weight", {C, I}, 0,
            e);
      }
      continue;
    }
    add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", {F, C});
    add(g + "ffn_up.weight", h + "mlp.up_proj.weight", {F, C});
    add(g + "ffn_down.weight", h + "mlp.down_proj.weight", {C, F});
    if (c.mlp_bias) {
      add(g + "ffn_gate.bias", h + "mlp.gate_proj.bias", {F});
      add(g + "ffn_up.bias", h + "mlp.up_proj.bias", {F});
      add(g + "ffn_down.bias", h + "mlp.down_proj.bias", {C});
    }
  }
  add("output_norm.weight", "model.norm.weight", {C});
  if (!c.tie_word_embeddings) add("output.weight", "lm_head.weight", {V, C});
  return out;
}

std::vector<GgufTensorMapping> gguf_tensor_mapping(const GgufFile& file, const ModelConfig& c) {
  std::vector<GgufTensorMapping> out = gguf_names(c);
  std::unordered_set<std::string> expected;
  for (const GgufTensorMapping& m : out)
    for (const std::string& name : {m.gguf_name, m.gguf_name2}) {
      if (name.empty()) continue;
      expected.insert(name);
      const GgufTensorInfo* t = file.find_tensor(name);
      const std::string what = file.path() + ": tensor '" + name + "' (" + m.hf_name + ")";
      if (t == nullptr)
        throw Error(what + " is missing; the " + to_string(c.family) +
                    " model its metadata describes needs it");
      std::vector<std::int64_t> want = m.gguf_shape.empty() ? m.shape : m.gguf_shape;
      if (m.expert >= 0) want.insert(want.begin(), c.num_experts);
      if (t->shape() != want)
        throw Error(what + " has shape " + shape_text(t->shape()) + " but the model's metadata " +
                    "implies " + shape_text(want) + "; the file is inconsistent");
      if (m.expert >= 0 && t->n_bytes % static_cast<std::uint64_t>(c.num_experts) != 0)
        throw Error(what + ": its " + std::to_string(t->n_bytes) + " bytes do not split into " +
                    std::to_string(c.num_experts) + " experts");
      if (!ggml_type_info(t->type).dequantizable)
        throw Error(what + " " + ggml_not_dequantizable(t->type));
    }
  for (const GgufTensorInfo& t : file.tensors())
    if (expected.count(t.name) == 0 && t.name != kRopeFreqs)
      throw Error(file.path() + ": tensor '" + t.name + "' is not part of the " +
                  to_string(c.family) + " model its metadata describes (" +
                  std::to_string(c.num_layers) + " layers" +
                  (c.tie_word_embeddings ? ", tied embeddings" : "") +
                  "); the file is for another architecture or inconsistent");
  return out;
}

at::Tensor load_hf_tensor(const GgufFile& file, const GgufTensorMapping& m, DType target) {
  if (!m.gguf_shape.empty()) {  // GPT-OSS's fused experts (see GgufTensorMapping)
    at::Tensor t = load_tensor(file, m.gguf_name, target);
    if (!m.gguf_name2.empty())
      t = at::stack({t, load_tensor(file, m.gguf_name2, target)}, 2).flatten(1, 2);
    if (m.transpose) t = t.transpose(-1, -2);
    t = t.contiguous();
    RONDO_ASSERT(t.sizes().vec() == m.shape);
    return t;
  }
  at::Tensor t = load_tensor(file, m.gguf_name, target, m.expert);
  RONDO_ASSERT(t.sizes().vec() == m.shape);
  if (m.unpermute_heads > 0) {
    // GGUF rows per head are (D/2, 2); HF's are (2, D/2). See the note at the top.
    const std::int64_t heads = m.unpermute_heads;
    RONDO_ASSERT(m.shape[0] % (2 * heads) == 0);
    std::vector<std::int64_t> view = {heads, m.shape[0] / heads / 2, 2};
    view.insert(view.end(), m.shape.begin() + 1, m.shape.end());
    t = t.reshape(view).transpose(1, 2).reshape(m.shape).contiguous();
  }
  return t;
}

at::Tensor permute_for_gguf(const at::Tensor& t, std::int64_t heads) {
  if (heads <= 0) return t;
  // HF rows per head are (2, D/2); llama.cpp's are (D/2, 2). See the note at the top.
  const std::vector<std::int64_t> shape = t.sizes().vec();
  RONDO_ASSERT(shape[0] % (2 * heads) == 0);
  std::vector<std::int64_t> view = {heads, 2, shape[0] / heads / 2};
  view.insert(view.end(), shape.begin() + 1, shape.end());
  return t.reshape(view).transpose(1, 2).reshape(shape).contiguous();
}

}  // namespace rondo::models
