// A model with a PEFT LoRA adapter folded in: what `rondo generate --adapter` runs. The adapter is
// a PEFT folder (adapter_config.json + adapter_model.safetensors, as `rondo export` and peft's
// save_pretrained write it) or a run folder holding one in adapter/. Every adapter tensor is
// checked against the base before anything is merged, so an adapter of another model is refused
// with the tensors named.
//
//   models::Model m = models::load_with_adapter("models/qwen", "runs/qwen-chat", {});
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/lora.h"
#include "models/model.h"

namespace rondo::models {

// A PEFT adapter folder as read: its config and its tensors (views of the file, which `file`
// keeps mapped). `adapter` is the folder or a run folder holding one in adapter/.
struct PeftAdapter {
  std::shared_ptr<void> file;  // first: destroyed after the views below
  LoraConfig lora;
  std::map<std::string, at::Tensor> tensors;  // views of `file`: copy what must outlive it
  std::string source;                         // the safetensors file, for errors
};
PeftAdapter read_peft_adapter(const std::string& adapter);

// Every way `trained` does not fit `specs` (the base's layers, with `lora`'s adapters when given):
// an adapter the config targets but the tensors lack, a shape the base does not have, a tensor the
// base has no place for. Empty when it fits.
std::vector<std::string> trained_problems(const std::vector<LayerSpec>& specs,
                                          const std::map<std::string, at::Tensor>& trained,
                                          bool lora);
// The Error for those problems, naming `source` and `model_path`.
[[noreturn]] void throw_trained_problems(const std::vector<std::string>& problems,
                                         const std::string& source, const std::string& model_path,
                                         bool lora);

// Adapters to train from: `adapter`'s tensors (a PEFT folder, or a run folder holding one) in
// place of `adapters`' fresh ones (init_lora's, for `specs`). Its scaling must be `lora`'s
// (rank, alpha, rsLoRA) and it must hold exactly the adapters `specs` has; Error naming what
// differs otherwise.
void start_from_adapter(const std::string& adapter, const LoraConfig& lora,
                        const std::vector<LayerSpec>& specs,
                        std::map<std::string, at::Tensor>& adapters);

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
