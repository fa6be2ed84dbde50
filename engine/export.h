// Exports from the host state (offload::LayerStore): trained tensors as their fp32 masters, frozen
// ones as loaded (their streaming copies).
//  - A PEFT adapter folder: adapter_config.json and adapter_model.safetensors (f32, PEFT's names),
//    which peft.PeftModel.from_pretrained loads onto the base model.
//  - A merged checkpoint: the base weights with each adapter folded in (W + B A * scaling), in
//    `dtype`, with config.json and the tokenizer files copied from the base folder — a plain
//    Hugging Face folder transformers loads.
// Every file is written under a temporary name, fsynced and renamed.
//
//   engine::export_peft_adapter(run_dir + "/adapter", store, specs, lora, "Qwen/Qwen3-0.6B");
#pragma once

#include <string>
#include <vector>

#include "models/dtype.h"
#include "models/layers.h"
#include "models/lora.h"
#include "offload/layer_store.h"

namespace rondo::engine {

void export_peft_adapter(const std::string& dir, const offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::LoraConfig& lora, const std::string& base_model);

// `base_dir`: the Hugging Face folder the base came from (config and tokenizer files are copied);
// adapters in `specs` (if any) are merged.
void export_merged(const std::string& dir, const offload::LayerStore& store,
                   const std::vector<models::LayerSpec>& specs, const std::string& base_dir,
                   models::DType dtype);

}  // namespace rondo::engine
