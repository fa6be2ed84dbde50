// A model with a PEFT LoRA adapter folded in: what `rondo generate --adapter` runs. The adapter is
// a PEFT folder (adapter_config.json + adapter_model.safetensors, as `rondo export` and peft's
// save_pretrained write it) or a run folder holding one in adapter/. Every adapter tensor is
// checked against the base before anything is merged, so an adapter of another model is refused
// with the tensors named.
//
//   models::Model m = models::load_with_adapter("models/qwen", "runs/qwen-chat", {});
#pragma once

#include <map>
#include <string>

#include "models/lora.h"
#include "models/model.h"

namespace rondo::models {

// The base (a Hugging Face folder or a .gguf file) with W + B A * scaling for every adapted
// projection, merged in fp32, then held in options.dtype (default fp32).
Model load_with_adapter(const std::string& model_path, const std::string& adapter,
                        const LoadOptions& options = {});

// The base with trained tensors by name (a checkpoint's masters): with `lora`, its adapters (every
// one required) merged in; without, trained weights in place of the base's (a full run; any the
// checkpoint lacks stay the base's). Every tensor is checked against the base first; `source`
// names them in errors.
Model load_with_trained(const std::string& model_path, const LoraConfig* lora,
                        const std::map<std::string, at::Tensor>& trained, const std::string& source,
                        const LoadOptions& options = {});

}  // namespace rondo::models
