// What a model is without loading its weights: config, parameter count, stored dtypes and bytes
// per layer, read from the checkpoint's headers only (fast for a 70B model) — or from config.json
// alone when the weights are not there yet. For `rondo inspect`, `rondo plan` and the GUI
// wizard's model page.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/config.h"
#include "models/layers.h"

namespace rondo::models {

struct LayerSummary {
  LayerKind kind = LayerKind::kBlock;
  int block = -1;
  std::int64_t params = 0;             // owned parameters
  std::uint64_t bytes_stored = 0;      // in the checkpoint, as stored (quantised for GGUF)
  double flops_forward_per_token = 0;  // at `seq_len`
  std::uint64_t activation_bytes_per_token = 0;  // bf16 activations
};

struct ModelSummary {
  std::string path;
  // "safetensors", "gguf", or "config only" (a folder holding config.json but no weights yet:
  // planning before downloading; stored bytes then follow the config's torch_dtype)
  std::string format;
  ModelConfig config;
  std::string dtypes;  // stored dtypes with their share, e.g. "BF16" or "Q4_K 80%, F32 20%"
  std::int64_t params = 0;
  // Parameters a token uses: fewer than params in a mixture of experts (its experts count top-k
  // / E), all of them otherwise. Every byte still streams: the link carries params.
  double active_params = 0;
  std::uint64_t bytes_stored = 0;
  std::int64_t seq_len = 0;  // the sequence length the FLOPs assume
  std::vector<LayerSummary> layers;
  // Per owned tensor (Hugging Face name): its stored type, "BF16", "Q4_K", ... (the GGUF type
  // decides what a GGUF base keeps on the link).
  std::map<std::string, std::string> stored_types;
};

// Throws Error for anything that is not a readable model.
ModelSummary inspect_model(const std::string& path, std::int64_t seq_len = 4096);

}  // namespace rondo::models
