// Writing trained weights as Hugging Face and PEFT folders, from tensors by name (the engine
// gathers them from its host state: engine/export.h).
//  - A PEFT adapter folder: adapter_config.json and adapter_model.safetensors (f32, PEFT's names),
//    which peft.PeftModel.from_pretrained loads onto the base model.
//  - A merged checkpoint: the base weights with each adapter folded in (W + B A * scaling), in
//    `dtype`, with config.json and the tokenizer files copied from the base folder — a plain
//    Hugging Face folder transformers loads.
// Every file is written under a temporary name, fsynced and renamed.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/dtype.h"
#include "models/layers.h"
#include "models/lora.h"

namespace rondo::models {

// `tensors`: at least every adapter of `specs` by name.
void write_peft_adapter(const std::string& dir, const std::vector<LayerSpec>& specs,
                        const std::map<std::string, at::Tensor>& tensors, const LoraConfig& lora,
                        const std::string& base_model);

// `tensors`: every owned parameter of `specs` by name (adapters, if any, are merged).
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
