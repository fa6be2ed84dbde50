// A GGUF model (llama.cpp's metadata keys, tensor names and layouts) as the same model the
// Hugging Face checkpoint describes: a ModelConfig, and each GGUF tensor under its HF name, in
// its HF shape and row order. llama.cpp stores Mistral as `llama`; Qwen2 and Qwen3 as themselves.
// Used by the model loader, so that everything past loading sees one naming.
//
//   models::GgufFile f("model.gguf");
//   models::ModelConfig c = models::config_from_gguf(f);
//   for (const auto& m : models::gguf_tensor_mapping(f, c))   // checks the set of tensors
//     weights[m.hf_name] = models::load_hf_tensor(f, m, DType::kBF16);
//
// See Note [llama.cpp rotary permutation] in gguf_model.cpp for why q/k rows move.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "models/config.h"
#include "models/dtype.h"
#include "models/gguf.h"

namespace rondo::models {

// Family and dimensions from `general.architecture` (llama, qwen2, qwen3, qwen3moe, gpt-oss; llama
// with experts is Mixtral) and `<arch>.*` keys;
// vocab size from `tokenizer.ggml.tokens`; tied embeddings when `output.weight` is absent; llama3
// rope scaling recovered from `rope_freqs.weight`. Throws Error naming the file and key.
ModelConfig config_from_gguf(const GgufFile& file);

struct GgufTensorMapping {
  std::string gguf_name;             // "blk.0.attn_q.weight"
  std::string hf_name;               // "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;   // HF (torch) shape, e.g. (H*D, C)
  std::int64_t unpermute_heads = 0;  // > 0: undo llama.cpp's q/k row permutation over this many
                                     // heads (llama only)
  std::int64_t expert = -1;          // >= 0: this slice of a GGUF expert tensor (E, rows, cols)
  // GPT-OSS's fused experts from llama.cpp's separate tensors. With gguf_shape set (each GGUF
  // tensor's torch shape): the HF tensor is gguf_name's, or with gguf_name2 the two interleaved
  // along dimension 1 (row i of the first becomes row 2i, of the second 2i + 1: HF's gate and up
  // as gate_up), then with `transpose` its last two dimensions swapped (HF's x @ W layout).
  std::string gguf_name2;
  std::vector<std::int64_t> gguf_shape;
  bool transpose = false;
};

// Every tensor a model of this config has, in HF order (embedding, layers, norm, head), under
// llama.cpp's names: what a GGUF of the model holds (besides rope_freqs.weight for llama3 rope
// scaling).
std::vector<GgufTensorMapping> gguf_names(const ModelConfig& config);

// rope_freqs.weight for Llama 3 rope scaling, as llama.cpp's converter computes it: one factor per
// rotary pair (the rotation frequency is divided by it).
std::vector<double> llama3_rope_factors(const RopeConfig& rope, std::int64_t head_dim);

// llama.cpp's `general.architecture` for a family: llama (Mistral, Mixtral too), qwen2, qwen3,
// qwen3moe, gpt-oss.
const char* gguf_architecture(Family family);

// The same as gguf_names(config), checked against a file. Throws Error naming
// the file and tensor when one is missing, has another shape, has a type Rondo cannot dequantise,
// or when the file holds a tensor the config does not use.
std::vector<GgufTensorMapping> gguf_tensor_mapping(const GgufFile& file, const ModelConfig& config);

// The tensor under its HF name and layout, dequantised to `target` (F32 or BF16).
at::Tensor load_hf_tensor(const GgufFile& file, const GgufTensorMapping& mapping, DType target);

// The rows of an HF tensor (its first dimension) in llama.cpp's order when mapping.unpermute_heads
// > 0 (the inverse of what load_hf_tensor undoes), else `t` itself. Any leading shape (H*D, ...),
// so that it serves a LoRA B (H*D, r) as well as the weight.
at::Tensor permute_for_gguf(const at::Tensor& t, std::int64_t heads);

}  // namespace rondo::models
