// Exports from the host state (offload::LayerStore): trained tensors as their fp32 masters, frozen
// ones as loaded (their streaming copies), written by models/export.h as a PEFT adapter folder or a
// merged Hugging Face checkpoint, and by models/gguf_export.h as llama.cpp's adapter or a merged
// GGUF.
//
//   engine::export_peft_adapter(run_dir + "/adapter", store, specs, lora, "Qwen/Qwen3-0.6B");
#pragma once

#include <string>
#include <vector>

#include "models/config.h"
#include "models/dtype.h"
#include "models/gguf_export.h"
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

// `path`: the .gguf file (its folder is created).
void export_gguf_adapter(const std::string& path, offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::ModelConfig& config, const models::LoraConfig& lora);

// `base_gguf`: the base model (a GGUF file, whose metadata is copied, or a Hugging Face folder);
// adapters are merged.
void export_gguf_merged(const std::string& path, offload::LayerStore& store,
                        const std::vector<models::LayerSpec>& specs,
                        const models::ModelConfig& config, const std::string& base_gguf,
                        models::GgufExportType type);

}  // namespace rondo::engine
