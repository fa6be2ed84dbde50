// What a model is without loading its weights: config, parameter count, stored dtypes and bytes
// per layer, read from the checkpoint's headers only (fast for a 70B model). For `rondo inspect`
// and the GUI wizard's model page.
#pragma once

#include <cstdint>
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
  std::string format;  // "safetensors" or "gguf"
  ModelConfig config;
  std::string dtypes;  // stored dtypes with their share, e.g. "BF16" or "Q4_K 80%, F32 20%"
  std::int64_t params = 0;
  std::uint64_t bytes_stored = 0;
  std::int64_t seq_len = 0;  // the sequence length the FLOPs assume
  std::vector<LayerSummary> layers;
};

// Throws Error for anything that is not a readable model.
ModelSummary inspect_model(const std::string& path, std::int64_t seq_len = 4096);

}  // namespace rondo::models
