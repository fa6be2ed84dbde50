// Writing trained weights as GGUF files for llama.cpp (and Ollama, LM Studio, which run it):
//  - A LoRA adapter in llama.cpp's adapter layout, for `llama-cli -m base.gguf --lora x.gguf`:
//    `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and per adapted
//    tensor `<gguf name>.lora_a` (ggml ne [in, r]) and `.lora_b` (ne [r, out]) in f32, B's rows in
//    llama.cpp's q/k order for llama models. llama.cpp scales by alpha / r; rsLoRA's
//    alpha / sqrt(r) is written as alpha' = alpha * sqrt(r).
//  - A merged model (every adapter folded in), each weight in the chosen type (GgufExportType):
//    from a GGUF base with the base's metadata (architecture, tokenizer, chat template), so that it
//    loads as the downloaded model did; from a Hugging Face folder with the metadata llama.cpp's
//    converter writes (architecture keys, rope_freqs.weight for Llama 3 rope scaling, the
//    byte-level BPE tokenizer with llama.cpp's name for its pre-tokenizer, the chat template).
// Files are written under a temporary name, fsynced and renamed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/config.h"
#include "models/gguf.h"
#include "models/layers.h"
#include "models/lora.h"

namespace rondo::models {

// `tensors`: at least every adapter of `specs` by name (PEFT names).
void write_gguf_adapter(const std::string& path, const ModelConfig& config,
                        const std::vector<LayerSpec>& specs,
                        const std::map<std::string, at::Tensor>& tensors, const LoraConfig& lora);

// The types of a merged GGUF's matrices (1-D tensors, norms and biases, stay F32, as llama.cpp
// keeps them):
//   f32, f16, bf16, q8_0;
//   q4_k_m: llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the output matrix (the embedding when
//           tied) and for attn_v and ffn_down in the layers llama.cpp gives more bits (the first
//           and last eighth, and every third between);
//   base:   each tensor in its type in the base file (Q8_0 where that is a type Rondo cannot
//           write).
// A matrix whose rows are not whole blocks of the type (Q4_K and Q6_K: 256 elements) is written
// in Q8_0 (32), or F16 when that does not fit either. (llama.cpp's quantiser falls back from
// Q4_K to Q5_0, which Rondo cannot write, and from Q6_K to Q8_0; its mix also raises attn_v to Q5_K
// for 70B-class models, which this one does not.)
enum class GgufExportType { kF32, kF16, kBF16, kQ8_0, kQ4_K_M, kBase };
inline constexpr const char* kGgufExportTypes = "f32, f16, bf16, q8_0, q4_k_m, base";
GgufExportType parse_gguf_export_type(const std::string& text);  // throws Error listing the types
const char* to_string(GgufExportType type);

// Throws the Error write_gguf_merged would throw for what it cannot write from this base (a Hugging
// Face tokenizer that is not byte-level BPE, or whose pre-tokenizer llama.cpp has no name for;
// --type base of a Hugging Face base), so that a run can refuse before it trains.
void check_gguf_mergeable(const std::string& base_path, GgufExportType type);

// `layer_tensors(l)`: layer l's tensors by HF name (its own and its adapters'). `progress(done,
// total)` after each tensor written, when given.
void write_gguf_merged(
    const std::string& path, const ModelConfig& config, const std::vector<LayerSpec>& specs,
    const std::function<std::map<std::string, at::Tensor>(std::size_t)>& layer_tensors,
    const std::string& base_path, GgufExportType type,
    const std::function<void(std::size_t, std::size_t)>& progress = {});

}  // namespace rondo::models
