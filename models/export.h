// Writing trained weights as Hugging Face and PEFT folders, from tensors by name (the engine
// gathers them from its host state: engine/export.h).
//  - A PEFT adapter folder: adapter_config.json and adapter_model.safetensors (f32, PEFT's names),
//    which peft.PeftModel.from_pretrained loads onto the base model.
//  - A merged checkpoint: the base weights with each adapter folded in (W + B A * scaling), in
//    `dtype`, with config.json and the tokenizer files copied from the base folder (or, for a GGUF
//    base, rebuilt from its metadata: config.json, generation_config.json, tokenizer.json and
//    tokenizer_config.json with the chat template) — a plain Hugging Face folder transformers
//    loads.
// Every file is written under a temporary name, fsynced and renamed.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "models/dtype.h"
#include "models/layers.h"
#include "models/lora.h"

namespace rondo::models {

// `tensors`: at least every adapter of `specs` by name. `base_model`: the base's path; a GGUF file
// is named in base_model_name_or_path by the Hugging Face repository its metadata names
// (general.source.huggingface.repository or a huggingface.co general.source.url), when it does.
void write_peft_adapter(const std::string& dir, const std::vector<LayerSpec>& specs,
                        const std::map<std::string, at::Tensor>& tensors, const LoraConfig& lora,
                        const std::string& base_model);

// Throws the Error write_merged would throw for this base before any weight is written (a GGUF
// whose tokenizer cannot be rebuilt as tokenizer.json), so that a run can refuse before it trains.
void check_mergeable(const std::string& base_dir);

// The Hugging Face files of a GGUF model besides its weights (declared as `dtype`), rebuilt from
// its metadata: name and text of config.json, generation_config.json, tokenizer.json and
// tokenizer_config.json. Throws Error for what cannot be rebuilt (a SentencePiece tokenizer).
std::vector<std::pair<std::string, std::string>> hf_files_from_gguf(const std::string& path,
                                                                    DType dtype);

// `tensors`: every owned parameter of `specs` by name (adapters, if any, are merged). `base_dir`:
// the base model, a Hugging Face folder or a .gguf file.
void write_merged(const std::string& dir, const std::vector<LayerSpec>& specs,
                  const std::map<std::string, at::Tensor>& tensors, const std::string& base_dir,
                  DType dtype);
// The same, one layer at a time: `layer_tensors(l)` gives layer l's tensors by name (its own and
// its adapters'), so that a model larger than memory is written holding one layer.
void write_merged(
    const std::string& dir, const std::vector<LayerSpec>& specs,
    const std::function<std::map<std::string, at::Tensor>(std::size_t)>& layer_tensors,
    const std::string& base_dir, DType dtype);

}  // namespace rondo::models
