// A loaded model: its config, its layer list and the weights of every layer, from a Hugging Face
// folder (zero-copy views of the safetensors mapping when the dtype matches) or a GGUF file.
// Loading checks every tensor the config needs (present, right shape) and rejects unexpected
// ones, naming the file and the tensor. Also a whole-model forward for inference and tests; the
// engine runs the same layer functions stage by stage instead.
//
//   models::Model m = models::Model::load("~/models/Qwen3-0.6B", {.dtype = models::DType::kF32});
//   at::Tensor logits = m.logits({.tokens = ids});  // (B, T, V) fp32
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/config.h"
#include "models/layers.h"

namespace rondo::models {

enum class ModelFormat { kHfFolder, kGguf };

// What `path` holds: a Hugging Face folder or a .gguf file. Throws Error (missing, or neither)
// with the one message every entry point (load, inspect, tokenizer, chat template) gives.
ModelFormat model_format(const std::string& path);

struct LoadOptions {
  std::optional<DType> dtype;  // weights' dtype in memory; default: as stored (GGUF: F32)
};

class Model {
 public:
  // A folder (Hugging Face) or a .gguf file.
  static Model load(const std::string& path, const LoadOptions& options = {});
  static Model load_hf_folder(const std::string& dir, const LoadOptions& options = {});
  // Dequantises every tensor to options.dtype (F32 by default, or BF16).
  static Model load_gguf(const std::string& path, const LoadOptions& options = {});
  // From tensors already in memory, by Hugging Face name; checks them against the config.
  // `keepalive` owns whatever memory the tensors view (a mapping), if anything.
  static Model from_tensors(ModelConfig config, std::map<std::string, at::Tensor> tensors,
                            std::string source, std::shared_ptr<void> keepalive = nullptr);

  const ModelConfig& config() const { return config_; }
  const std::vector<LayerSpec>& layers() const { return layers_; }
  const std::string& source() const { return source_; }
  DType dtype() const;
  const at::Tensor& tensor(const std::string& name) const;
  std::vector<at::Tensor> layer_tensors(std::size_t layer) const;  // in LayerSpec::params order
  std::int64_t param_count() const;
  // What the tensors may view (a file mapping) and must outlive them; null if they own their
  // memory.
  const std::shared_ptr<void>& keepalive() const { return keepalive_; }

  // The whole model on the weights' device: fp32 logits (B, T, V).
  at::Tensor logits(const TokenBatch& batch) const;
  // Sum of the cross-entropy over targets != -100 (targets (B, T), already shifted).
  at::Tensor loss_sum(const TokenBatch& batch, const at::Tensor& targets) const;
  // Hidden states after the last block (before the final norm).
  at::Tensor hidden(const TokenBatch& batch) const;

 private:
  ModelConfig config_;
  std::vector<LayerSpec> layers_;
  std::map<std::string, at::Tensor> tensors_;
  std::string source_;
  std::shared_ptr<void> keepalive_;
};

// Checks a checkpoint's tensors (name -> shape) against what the config's layers need: every one
// present with its shape, nothing unexpected. Throws Error listing the problems (up to 12) under
// `source`; returns the names that are present but ignorable (a stored copy of a tied LM head,
// rotary inv_freq buffers).
std::vector<std::string> check_weights_match(
    const ModelConfig& config, const std::vector<LayerSpec>& layers,
    const std::map<std::string, std::vector<std::int64_t>>& shapes, const std::string& source);

// Targets for next-token prediction: targets[t] = tokens[t + 1] inside the same document,
// -100 at each document's last token (and where `loss_mask` is false, if given).
at::Tensor next_token_targets(const TokenBatch& batch, const at::Tensor& loss_mask = {});

}  // namespace rondo::models
