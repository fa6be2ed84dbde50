#include "models/config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "models/mapped_file.h"

namespace rondo::models {

namespace {
// Each family's transformers class and model_type, in Family order.
struct FamilyNames {
  Family family;
  const char* architecture;
  const char* model_type;
};
constexpr FamilyNames kFamilies[] = {
    {Family::kLlama, "LlamaForCausalLM", "llama"},
    {Family::kMistral, "MistralForCausalLM", "mistral"},
    {Family::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Family::kQwen3, "Qwen3ForCausalLM", "qwen3"},
    {Family::kQwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe"},
    {Family::kMixtral, "MixtralForCausalLM", "mixtral"},
    {Family::kGptOss, "GptOssForCausalLM", "gpt_oss"},
};
}  // namespace

const char* to_string(Family family) {
  for (const FamilyNames& f : kFamilies)
    if (f.family == family) return f.model_type;
  return "?";
}

std::int64_t ModelConfig::sparse_layer_count() const {
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < num_layers; ++l)
    n += sparse(l) ? 1 : 0;
  return n;
}

std::vector<std::string> ModelConfig::problems() const {
  std::vector<std::string> out;
  // Upper bounds far above any real model keep products like H * D and V * C well inside int64
  // and stop a hostile file from making Rondo build billions of layer descriptions.
  auto bounded = [&](std::int64_t v, const char* field, std::int64_t most) {
    if (v <= 0)
      out.push_back(std::string(field) + " must be positive (got " + std::to_string(v) + ")");
    else if (v > most)
      out.push_back(std::string(field) + " of " + std::to_string(v) + " is beyond what Rondo " +
                    "supports (at most " + std::to_string(most) + "); is the config corrupt?");
  };
  bounded(vocab_size, "vocab_size", 1 << 24);
  bounded(hidden_size, "hidden_size", 1 << 18);
  bounded(intermediate_size, "intermediate_size", 1 << 20);
  bounded(num_layers, "num_hidden_layers", 4096);
  bounded(num_heads, "num_attention_heads", 4096);
  bounded(num_kv_heads, "num_key_value_heads", 4096);
  bounded(head_dim, "head_dim", 4096);
  if (max_position_embeddings < 0 || max_position_embeddings > (1ll << 30))
    out.push_back("max_position_embeddings of " + std::to_string(max_position_embeddings) +
                  " is out of range");
  if (num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads != 0)
    out.push_back("num_attention_heads (" + std::to_string(num_heads) +
                  ") must be a multiple of num_key_value_heads (" + std::to_string(num_kv_heads) +
                  ")");
  if (head_dim > 0 && head_dim % 2 != 0)
    out.push_back("head_dim must be even for rotary embeddings (got " + std::to_string(head_dim) +
                  ")");
  if (!(rms_norm_eps > 0)) out.push_back("rms_norm_eps must be positive");
  if (!(attention_dropout >= 0 && attention_dropout < 1))
    out.push_back("attention_dropout must be in [0, 1)");
  if (!(rope.theta > 0)) out.push_back("rope_theta must be positive");
  if (rope.type != "default" && rope.type != "llama3" && rope.type != "linear" &&
      rope.type != "dynamic" && rope.type != "yarn")
    out.push_back("rope type '" + rope.type +
                  "' is not supported (supported: default, linear, dynamic, yarn, llama3)");
  if ((rope.type == "linear" || rope.type == "dynamic" || rope.type == "yarn") &&
      !(rope.factor > 0))
    out.push_back(rope.type + " rope scaling needs factor > 0");
  if (rope.type == "yarn" &&
      (rope.original_max_position_embeddings <= 0 || !(rope.attention_factor > 0) ||
       !(rope.beta_fast > 0) || !(rope.beta_slow > 0)))
    out.push_back(
        "yarn rope scaling needs original_max_position_embeddings, attention_factor, beta_fast "
        "and beta_slow > 0");
  if (rope.type == "llama3" && (!(rope.factor > 0) || !(rope.low_freq_factor > 0) ||
                                !(rope.high_freq_factor > rope.low_freq_factor) ||
                                rope.original_max_position_embeddings <= 0))
    out.push_back(
        "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
        "and original_max_position_embeddings > 0");
  if (sliding_window < 0) out.push_back("sliding_window must not be negative");
  if (num_experts < 0 || num_experts > 4096)
    out.push_back("num_experts of " + std::to_string(num_experts) + " is out of range (0..4096)");
  if (num_experts > 0) {
    if (experts_per_token <= 0 || experts_per_token > num_experts)
      out.push_back("num_experts_per_tok (" + std::to_string(experts_per_token) +
                    ") must be between 1 and the number of experts (" +
                    std::to_string(num_experts) + ")");
    bounded(moe_intermediate_size, "moe_intermediate_size", 1 << 20);
    if (!sparse_layers.empty() && static_cast<std::int64_t>(sparse_layers.size()) != num_layers)
      out.push_back("the sparse-layer list has " + std::to_string(sparse_layers.size()) +
                    " entries for " + std::to_string(num_layers) + " layers");
    if (!(router_aux_loss_coef >= 0)) out.push_back("router_aux_loss_coef must not be negative");
  }
  return out;
}

namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& source;
  std::vector<std::string>& problems;

  bool has(const char* key) const { return j.contains(key) && !j.at(key).is_null(); }

  std::int64_t integer(const char* key, std::int64_t fallback, bool required) {
    if (!has(key)) {
      if (required) problems.push_back("missing field '" + std::string(key) + "'");
      return fallback;
    }
    const json& v = j.at(key);
    if (!v.is_number_integer()) {
      problems.push_back("field '" + std::string(key) + "' must be an integer (got " + v.dump() +
                         ")");
      return fallback;
    }
    return v.get<std::int64_t>();
  }
  double number(const json& obj, const char* key, double fallback) {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    if (!obj.at(key).is_number()) {
      problems.push_back("field '" + std::string(key) + "' must be a number (got " +
                         obj.at(key).dump() + ")");
      return fallback;
    }
    return obj.at(key).get<double>();
  }
  bool boolean(const char* key, bool fallback) {
    if (!has(key)) return fallback;
    if (!j.at(key).is_boolean()) {
      problems.push_back("field '" + std::string(key) + "' must be true or false");
      return fallback;
    }
    return j.at(key).get<bool>();
  }
};

}  // namespace

namespace {
ModelConfig parse_hf_config_json(const json& j, const std::string& source);

// An optional string field: `fallback` when it is absent or null (transformers writes null for
// unset ones), else the string; anything else is an error naming the field.
std::string string_or(const json& j, const char* key, const std::string& fallback,
                      const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string())
    throw Error(source + ": \"" + key + "\" must be a string, not " + it->dump());
  return it->get<std::string>();
}
}  // namespace

ModelConfig parse_hf_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(source + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(source + ": expected a JSON object");
  try {
    return parse_hf_config_json(j, source);
  } catch (const json::exception& e) {
    // A field of the wrong JSON type (e.g. "model_type": null) in one of the lookups below.
    throw Error(source + ": a field has the wrong type: " + e.what());
  }
}

namespace {
ModelConfig parse_hf_config_json(const json& j, const std::string& source) {
  std::vector<std::string> problems;
  Reader r{j, source, problems};
  ModelConfig c;

  std::string arch;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    arch = j["architectures"][0].get<std::string>();
  std::string model_type = string_or(j, "model_type", "", source);
  // By the class, else (no architectures) by model_type.
  const FamilyNames* found = nullptr;
  for (const FamilyNames& f : kFamilies)
    if (arch.empty() ? model_type == f.model_type : arch == f.architecture) found = &f;
  if (found == nullptr) {
    std::string supported;
    for (const FamilyNames& f : kFamilies)
      supported += std::string(supported.empty() ? "" : ", ") + f.architecture;
    throw Error(source + ": architecture '" + (arch.empty() ? model_type : arch) +
                "' is not supported (supported: " + supported + ")");
  }
  c.family = found->family;
  c.architecture = found->architecture;

  c.vocab_size = r.integer("vocab_size", 0, true);
  c.hidden_size = r.integer("hidden_size", 0, true);
  // Mixtral has no dense MLP: its experts' width is intermediate_size.
  c.intermediate_size = r.integer("intermediate_size", 0, true);
  c.num_layers = r.integer("num_hidden_layers", 0, true);
  // Per-layer lists only for a layer count problems() accepts (a corrupt count must not allocate).
  const std::size_t per_layer =
      c.num_layers > 0 && c.num_layers <= 4096 ? static_cast<std::size_t>(c.num_layers) : 0;
  c.num_heads = r.integer("num_attention_heads", 0, true);
  c.num_kv_heads = r.integer("num_key_value_heads", c.num_heads, false);
  c.head_dim = r.has("head_dim") ? r.integer("head_dim", 0, false)
                                 : (c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.max_position_embeddings = r.integer("max_position_embeddings", 4096, false);
  // 0 is not "no limit": no model supports every length; a config stating 0 is broken.
  if (r.has("max_position_embeddings") && c.max_position_embeddings == 0)
    problems.push_back(
        "field 'max_position_embeddings' is 0: it must be the number of positions the model "
        "supports (leave it out for 4096)");
  c.rms_norm_eps = r.number(j, "rms_norm_eps", 1e-6);
  c.attention_dropout = r.number(j, "attention_dropout", 0.0);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  std::string act = string_or(j, "hidden_act", "silu", source);
  if (act != "silu") problems.push_back("hidden_act '" + act + "' is not supported (only silu)");

  switch (c.family) {
    case Family::kLlama:
      c.attention_bias = c.attention_out_bias = r.boolean("attention_bias", false);
      c.mlp_bias = r.boolean("mlp_bias", false);
      break;
    case Family::kMistral:
      break;
    case Family::kQwen2:
      c.attention_bias = true;  // Qwen2 always has q/k/v biases
      break;
    case Family::kQwen3:
    case Family::kQwen3Moe:
      c.attention_bias = c.attention_out_bias = r.boolean("attention_bias", false);
      c.qk_norm = true;
      break;
    case Family::kMixtral:
      break;
    case Family::kGptOss:
      c.attention_bias = c.attention_out_bias = r.boolean("attention_bias", true);
      c.attention_sinks = true;
      break;
  }
  // Experts, as transformers' Qwen3MoeConfig, MixtralConfig and GptOssConfig (their defaults).
  if (c.family == Family::kQwen3Moe) {
    // Qwen's files say num_experts; transformers 5 writes num_local_experts (its attribute map).
    c.num_experts = r.has("num_experts") ? r.integer("num_experts", 128, false)
                                         : r.integer("num_local_experts", 128, false);
    c.experts_per_token = r.integer("num_experts_per_tok", 8, false);
    c.moe_intermediate_size = r.integer("moe_intermediate_size", 768, false);
    c.norm_topk_prob = r.boolean("norm_topk_prob", false);
    // A block is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th.
    const std::int64_t step = r.integer("decoder_sparse_step", 1, false);
    if (step <= 0)
      problems.push_back("field 'decoder_sparse_step' must be positive (got " +
                         std::to_string(step) + ")");
    std::vector<bool> sparse(per_layer);
    for (std::size_t l = 0; l < sparse.size(); ++l)
      sparse[l] = step > 0 && (static_cast<std::int64_t>(l) + 1) % step == 0;
    if (r.has("mlp_only_layers")) {
      const json& only = j.at("mlp_only_layers");
      if (!only.is_array()) problems.push_back("field 'mlp_only_layers' must be a list of layers");
      for (const json& x : only.is_array() ? only : json::array()) {
        if (!x.is_number_integer() || x.get<std::int64_t>() < 0 ||
            x.get<std::int64_t>() >= c.num_layers) {
          problems.push_back("mlp_only_layers holds " + x.dump() + ", not a layer index (0.." +
                             std::to_string(c.num_layers - 1) + ")");
          continue;
        }
        sparse[static_cast<std::size_t>(x.get<std::int64_t>())] = false;
      }
    }
    if (std::find(sparse.begin(), sparse.end(), false) != sparse.end())
      c.sparse_layers = std::move(sparse);
  } else if (c.family == Family::kGptOss) {
    c.num_experts = r.integer("num_local_experts", 128, false);
    c.experts_per_token = r.integer("num_experts_per_tok", 4, false);
    c.moe_intermediate_size = c.intermediate_size;
    c.swiglu_alpha = r.number(j, "swiglu_alpha", 1.702);
    c.swiglu_limit = r.number(j, "swiglu_limit", 7.0);
    // Sliding and full layers as layer_types says (every other one by default).
    c.sliding_window = r.integer("sliding_window", 128, false);
    c.sliding_layers.assign(per_layer, false);
    const json none = json::array();
    const json& types = r.has("layer_types") ? j.at("layer_types") : none;
    if (r.has("layer_types") && (!types.is_array() || types.size() != c.sliding_layers.size()))
      problems.push_back("field 'layer_types' must list one type per layer (" +
                         std::to_string(c.num_layers) + ")");
    for (std::size_t i = 0; i < c.sliding_layers.size(); ++i)
      c.sliding_layers[i] =
          types.size() == c.sliding_layers.size() ? types[i] == "sliding_attention" : i % 2 == 0;
  } else if (c.family == Family::kMixtral) {
    c.num_experts = r.integer("num_local_experts", 8, false);
    c.experts_per_token = r.integer("num_experts_per_tok", 2, false);
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;  // Mixtral always renormalises the top-k probabilities
  }
  if (c.num_experts > 0) {
    c.output_router_logits = r.boolean("output_router_logits", false);
    c.router_aux_loss_coef = r.number(j, "router_aux_loss_coef", 0.001);
  }
  // Sliding windows: Mistral applies one to every layer whenever set. Qwen applies one only with
  // use_sliding_window, and then per layer, as transformers does: to the layers layer_types calls
  // "sliding_attention", or without layer_types to the layers from max_window_layers on.
  if ((c.family == Family::kMistral || c.family == Family::kMixtral) && r.has("sliding_window"))
    c.sliding_window = r.integer("sliding_window", 0, false);
  if ((c.family == Family::kQwen2 || c.family == Family::kQwen3 || c.family == Family::kQwen3Moe) &&
      r.boolean("use_sliding_window", false)) {
    c.sliding_window = r.integer("sliding_window", 4096, false);
    c.sliding_layers.assign(per_layer, false);
    if (r.has("layer_types")) {
      const json& types = j.at("layer_types");
      if (!types.is_array() || types.size() != c.sliding_layers.size()) {
        problems.push_back("field 'layer_types' must list one type per layer (" +
                           std::to_string(c.num_layers) + ")");
      } else {
        for (std::size_t i = 0; i < types.size(); ++i) {
          const std::string t = types[i].is_string() ? types[i].get<std::string>() : "";
          if (t != "full_attention" && t != "sliding_attention")
            problems.push_back("layer_types[" + std::to_string(i) + "] is " + types[i].dump() +
                               "; Rondo knows full_attention and sliding_attention");
          c.sliding_layers[i] = t == "sliding_attention";
        }
      }
    } else {
      const std::int64_t from = r.integer("max_window_layers", 28, false);
      for (std::size_t i = 0; i < c.sliding_layers.size(); ++i)
        c.sliding_layers[i] = static_cast<std::int64_t>(i) >= from;
    }
  }

  // Rotary: transformers 5 writes rope_parameters (with rope_theta inside); older files have
  // rope_theta and rope_scaling at the top level.
  const json* scaling = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    scaling = &j["rope_parameters"];
    c.rope.theta = r.number(*scaling, "rope_theta", r.number(j, "rope_theta", 10000.0));
  } else {
    c.rope.theta = r.number(j, "rope_theta", 10000.0);
    if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) scaling = &j["rope_scaling"];
  }
  if (scaling != nullptr) {
    std::string type = scaling->value("rope_type", scaling->value("type", std::string("default")));
    c.rope.type = type;
    if (type == "llama3") {
      c.rope.factor = r.number(*scaling, "factor", 1.0);
      c.rope.low_freq_factor = r.number(*scaling, "low_freq_factor", 1.0);
      c.rope.high_freq_factor = r.number(*scaling, "high_freq_factor", 4.0);
      c.rope.original_max_position_embeddings =
          static_cast<std::int64_t>(r.number(*scaling, "original_max_position_embeddings", 8192));
    } else if (type == "linear" || type == "dynamic") {
      c.rope.factor = r.number(*scaling, "factor", 1.0);
    } else if (type == "yarn") {
      // As transformers' standardize_rope_params and _compute_yarn_parameters: a top-level
      // original_max_position_embeddings first, then the rope dict's, then max_position_embeddings.
      c.rope.original_max_position_embeddings = static_cast<std::int64_t>(
          r.number(j, "original_max_position_embeddings",
                   r.number(*scaling, "original_max_position_embeddings",
                            static_cast<double>(c.max_position_embeddings))));
      c.rope.factor = r.number(*scaling, "factor",
                               c.rope.original_max_position_embeddings > 0
                                   ? static_cast<double>(c.max_position_embeddings) /
                                         c.rope.original_max_position_embeddings
                                   : 1.0);
      auto mscale = [](double scale, double m) {
        return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
      };
      const double m = r.number(*scaling, "mscale", 0),
                   m_all = r.number(*scaling, "mscale_all_dim", 0);
      c.rope.attention_factor =
          r.number(*scaling, "attention_factor",
                   m != 0 && m_all != 0 ? mscale(c.rope.factor, m) / mscale(c.rope.factor, m_all)
                                        : mscale(c.rope.factor, 1));
      // `or` in transformers: 0 (or null) means the default.
      c.rope.beta_fast = r.number(*scaling, "beta_fast", 0);
      if (c.rope.beta_fast == 0) c.rope.beta_fast = 32;
      c.rope.beta_slow = r.number(*scaling, "beta_slow", 0);
      if (c.rope.beta_slow == 0) c.rope.beta_slow = 1;
      c.rope.truncate = scaling->value("truncate", true);
    }
  }

  std::string dtype = string_or(j, "torch_dtype", string_or(j, "dtype", "float32", source), source);
  if (dtype == "bfloat16")
    c.dtype = DType::kBF16;
  else if (dtype == "float16")
    c.dtype = DType::kF16;
  else
    c.dtype = DType::kF32;

  if (r.has("bos_token_id") && j["bos_token_id"].is_number_integer())
    c.bos_token_id = j["bos_token_id"].get<std::int64_t>();
  if (r.has("eos_token_id")) {
    const json& e = j["eos_token_id"];
    if (e.is_number_integer())
      c.eos_token_ids.push_back(e.get<std::int64_t>());
    else if (e.is_array())
      for (const json& x : e)
        if (x.is_number_integer()) c.eos_token_ids.push_back(x.get<std::int64_t>());
  }

  if (problems.empty())  // missing fields already said; the checks below would repeat them
    for (auto& p : c.problems())
      problems.push_back(p);
  if (!problems.empty()) throw Error(join_problems(source + ": invalid model config:", problems));
  return c;
}
}  // namespace

ModelConfig load_hf_config(const std::string& path) {
  return parse_hf_config(read_text_file(path, "a Hugging Face model folder needs config.json"),
                         path);
}

std::string hf_config_json(const ModelConfig& c, DType dtype) {
  using ojson = nlohmann::ordered_json;
  ojson j = {{"architectures", {c.architecture}},
             {"model_type", to_string(c.family)},
             {"vocab_size", c.vocab_size},
             {"hidden_size", c.hidden_size},
             {"intermediate_size", c.intermediate_size},
             {"num_hidden_layers", c.num_layers},
             {"num_attention_heads", c.num_heads},
             {"num_key_value_heads", c.num_kv_heads},
             {"head_dim", c.head_dim},
             {"hidden_act", "silu"},
             {"max_position_embeddings", c.max_position_embeddings},
             {"rms_norm_eps", c.rms_norm_eps},
             {"rope_theta", c.rope.theta},
             {"tie_word_embeddings", c.tie_word_embeddings},
             {"attention_dropout", c.attention_dropout},
             {"torch_dtype", dtype == DType::kBF16  ? "bfloat16"
                             : dtype == DType::kF16 ? "float16"
                                                    : "float32"}};
  if (c.rope.type == "linear" || c.rope.type == "dynamic")
    j["rope_scaling"] = {{"rope_type", c.rope.type}, {"factor", c.rope.factor}};
  if (c.rope.type == "yarn")
    j["rope_scaling"] = {
        {"rope_type", "yarn"},
        {"factor", c.rope.factor},
        {"original_max_position_embeddings", c.rope.original_max_position_embeddings},
        {"attention_factor", c.rope.attention_factor},
        {"beta_fast", c.rope.beta_fast},
        {"beta_slow", c.rope.beta_slow},
        {"truncate", c.rope.truncate}};
  if (c.rope.type == "llama3")
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope.factor},
        {"low_freq_factor", c.rope.low_freq_factor},
        {"high_freq_factor", c.rope.high_freq_factor},
        {"original_max_position_embeddings", c.rope.original_max_position_embeddings}};
  auto layer_types = [&] {
    std::vector<std::string> types;
    for (std::int64_t l = 0; l < c.num_layers; ++l)
      types.push_back(c.windowed(l) ? "sliding_attention" : "full_attention");
    return types;
  };
  switch (c.family) {
    case Family::kLlama:
      if (c.attention_bias != c.attention_out_bias)
        throw Error(
            "config.json: this Llama has biases on q/k/v but not on o_proj (or the reverse), which "
            "transformers' attention_bias cannot say");
      j["attention_bias"] = c.attention_bias;
      j["mlp_bias"] = c.mlp_bias;
      break;
    case Family::kGptOss:
      j["attention_bias"] = c.attention_bias;
      j["num_local_experts"] = c.num_experts;
      j["swiglu_alpha"] = c.swiglu_alpha;
      j["swiglu_limit"] = c.swiglu_limit;
      j["sliding_window"] = c.sliding_window;
      j["layer_types"] = layer_types();
      break;
    case Family::kMistral:
    case Family::kMixtral:
      if (c.sliding_window > 0) j["sliding_window"] = c.sliding_window;
      if (c.family == Family::kMixtral) j["num_local_experts"] = c.num_experts;
      break;
    case Family::kQwen2:
    case Family::kQwen3:
    case Family::kQwen3Moe:
      if (c.family != Family::kQwen2) j["attention_bias"] = c.attention_bias;
      if (c.family == Family::kQwen3Moe) {
        j["num_experts"] = c.num_experts;
        j["moe_intermediate_size"] = c.moe_intermediate_size;
        j["norm_topk_prob"] = c.norm_topk_prob;
        j["decoder_sparse_step"] = 1;
        std::vector<std::int64_t> dense;
        for (std::int64_t l = 0; l < c.num_layers; ++l)
          if (!c.sparse(l)) dense.push_back(l);
        j["mlp_only_layers"] = dense;
      }
      j["use_sliding_window"] = c.sliding_window > 0;
      if (c.sliding_window > 0) {
        j["sliding_window"] = c.sliding_window;
        j["layer_types"] = layer_types();
      }
      break;
  }
  if (c.num_experts > 0) {
    j["num_experts_per_tok"] = c.experts_per_token;
    j["output_router_logits"] = c.output_router_logits;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  if (c.eos_token_ids.size() == 1) j["eos_token_id"] = c.eos_token_ids[0];
  if (c.eos_token_ids.size() > 1) j["eos_token_id"] = c.eos_token_ids;
  return j.dump(2) + "\n";
}

std::int64_t ModelConfig::positions() const {
  if (rope.type == "yarn" && rope.original_max_position_embeddings > 0 && rope.factor > 1)
    return std::max<std::int64_t>(
        max_position_embeddings,
        static_cast<std::int64_t>(
            std::floor(static_cast<double>(rope.original_max_position_embeddings) * rope.factor)));
  return max_position_embeddings;
}

RopeAdvice rope_scaling_advice(const ModelConfig& config, std::int64_t seq_len) {
  // The context the scaling stretches: the one the checkpoint was trained at.
  const std::int64_t original = (config.rope.type == "yarn" || config.rope.type == "llama3") &&
                                        config.rope.original_max_position_embeddings > 0
                                    ? config.rope.original_max_position_embeddings
                                    : config.max_position_embeddings;
  double factor = 2;
  while (static_cast<double>(original) * factor < static_cast<double>(seq_len))
    factor *= 2;
  const auto positions = static_cast<std::int64_t>(static_cast<double>(original) * factor);
  const std::string f = std::to_string(static_cast<long long>(factor)) + ".0";
  const std::string o = std::to_string(original);
  if (config.family == Family::kLlama)
    return {"\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": " + f +
                ", \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                "\"original_max_position_embeddings\": " +
                o + "}, \"max_position_embeddings\": " + std::to_string(positions),
            "Llama 3's rope scaling (as Llama 3.1's config.json has it)"};
  return {"\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": " + f +
              ", \"original_max_position_embeddings\": " + o + "}",
          "YaRN (as Qwen documents for its models)"};
}

}  // namespace rondo::models
