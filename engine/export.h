// Exports from the host state (offload::LayerStore): trained tensors as their fp32 masters, frozen
// ones as loaded (their streaming copies), written by models/export.h as a PEFT adapter folder or a
// merged Hugging Face checkpoint.
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

void export_peft_adapter(const std::string& dir, offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::LoraConfig& lora, const std::string& base_model);

// `base_dir`: the Hugging Face folder the base came from (config and tokenizer files are copied);
// adapters in `specs` (if any) are merged.
void export_merged(const std::string& dir, offload::LayerStore& store,
                   const std::vector<models::LayerSpec>& specs, const std::string& base_dir,
                   models::DType dtype);

}  // namespace rondo::engine
