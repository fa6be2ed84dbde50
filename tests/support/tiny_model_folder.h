// A tiny Hugging Face model folder for tests of whole runs (`rondo train`, the session): a Llama
// config (2 blocks, C = 32), random weights in model.safetensors, the tiny byte-level tokenizer
// (tests/support/tiny_tokenizer.h) as tokenizer.json, and a ChatML chat template in
// tokenizer_config.json. Header-only.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/config.h"
#include "models/layers.h"
#include "models/safetensors.h"
#include "tiny_tokenizer.h"

namespace rondo::test {

// The shape of the model written; the defaults are the tiny test model.
struct ModelFolderShape {
  int layers = 2;
  std::int64_t max_positions = 512;
  int hidden = 32, intermediate = 64, heads = 4, kv_heads = 2;
  std::int64_t vocab = 0;  // 0 = the tokenizer's; larger pads the embedding as real models do
  bool tie = false;        // tie_word_embeddings
  at::ScalarType dtype = at::kFloat;  // of the weights in model.safetensors
};

// Writes the folder (created if missing) and returns its config. Weights from `seed`.
inline models::ModelConfig write_model_folder(const std::string& dir, int seed,
                                              const ModelFolderShape& shape) {
  namespace fs = std::filesystem;
  using nlohmann::json;
  fs::create_directories(dir);
  models::Tokenizer tok = tiny_tokenizer();
  json tj = tiny_tokenizer_json();
  const std::int64_t vocab = std::max(shape.vocab, static_cast<std::int64_t>(tok.vocab_size()));
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"vocab_size", vocab},
                 {"hidden_size", shape.hidden},
                 {"intermediate_size", shape.intermediate},
                 {"num_hidden_layers", shape.layers},
                 {"num_attention_heads", shape.heads},
                 {"num_key_value_heads", shape.kv_heads},
                 {"max_position_embeddings", shape.max_positions},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 10000.0},
                 {"tie_word_embeddings", shape.tie},
                 {"bos_token_id", *tok.token_to_id("<|begin_of_text|>")},
                 {"eos_token_id", *tok.token_to_id("<|end_of_text|>")},
                 {"torch_dtype", shape.dtype == at::kBFloat16 ? "bfloat16" : "float32"}};
  std::ofstream(fs::path(dir) / "config.json") << config.dump(2);
  std::ofstream(fs::path(dir) / "tokenizer.json") << tj.dump();
  json tc = {{"bos_token", "<|begin_of_text|>"},
             {"eos_token", "<|end_of_text|>"},
             {"chat_template",
              "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
              "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
              "%}{{ '<|im_start|>assistant\\n' }}{% endif %}"}};
  std::ofstream(fs::path(dir) / "tokenizer_config.json") << tc.dump(2);
  models::ModelConfig mc = models::parse_hf_config(config.dump(), dir + "/config.json");
  at::manual_seed(seed);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const models::LayerSpec& l : models::layer_specs(mc))
    for (const models::ParamSpec& p : l.params) {
      if (p.tied) continue;
      // Matrices: std 0.2 at C = 32, shrinking as 1/sqrt(fan-in) for larger ones.
      at::Tensor t = p.shape.size() == 1 ? 1 + 0.1 * at::randn(p.shape)
                                         : 0.2 * std::sqrt(32.0 / static_cast<double>(p.shape[1])) *
                                               at::randn(p.shape);
      tensors.emplace_back(p.name, t.to(shape.dtype).contiguous());
    }
  models::write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors);
  return mc;
}

// The tiny test model; `hidden` and `intermediate` size it up.
inline models::ModelConfig write_tiny_model_folder(const std::string& dir, int seed = 1,
                                                   int layers = 2, std::int64_t max_positions = 512,
                                                   int hidden = 32, int intermediate = 64) {
  return write_model_folder(dir, seed,
                            {.layers = layers,
                             .max_positions = max_positions,
                             .hidden = hidden,
                             .intermediate = intermediate});
}

}  // namespace rondo::test
