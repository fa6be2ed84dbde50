// LoRA adapters as PEFT defines them: for each targeted projection W (out x in) of every block,
// A (r x in) and B (out x r), and y = x W^T + (dropout(x) A^T) B^T * scaling with
// scaling = alpha / r (rsLoRA: alpha / sqrt(r)). Adapters are extra parameters of the block's
// LayerSpec, named as PEFT saves them
// (base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight), so the engine streams and
// trains them like any other tensor while the base stays frozen.
//
//   models::LoraConfig lora{.rank = 16, .alpha = 32, .targets = {"all-linear"}};
//   auto specs = models::add_lora(models::layer_specs(config), lora);
//   auto adapters = models::init_lora(specs, /*seed=*/0);   // A uniform, B zero, as PEFT
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/layers.h"

namespace rondo::models {

struct LoraConfig {
  int rank = 8;
  double alpha = 16;
  double dropout = 0;  // on the adapter's input, in training
  // PEFT module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
  // "all-linear" (all seven; the LM head is never adapted). Mixtures of experts: the MLP names
  // adapt the experts as PEFT does (Note [LoRA on experts] in lora.cpp).
  std::vector<std::string> targets = {"all-linear"};
  bool rslora = false;

  double scaling() const;
  std::vector<std::string> problems() const;  // every problem, for validation messages
};

// A LoraConfig from PEFT's adapter_config.json. Throws Error naming `source` and the field for what
// Rondo cannot reproduce (DoRA, biases, modules_to_save, per-module ranks, other targets).
LoraConfig parse_peft_adapter_config(const std::string& json_text, const std::string& source);

// The layer specs with adapter parameters added to the targeted projections of every block.
std::vector<LayerSpec> add_lora(std::vector<LayerSpec> specs, const LoraConfig& lora);

bool is_lora_param(const std::string& name);

// PEFT's initialisation for every adapter in `specs`: A ~ kaiming_uniform(a = sqrt(5)), which is
// U(-1/sqrt(in), 1/sqrt(in)), and B = 0 (the adapted model starts equal to the base). f32.
// The base weights with every adapter of `specs` folded in (W + B A * scaling, in fp32); the
// adapters themselves left out. `tensors`: every owned parameter by name.
std::map<std::string, at::Tensor> merge_lora(const std::vector<LayerSpec>& specs,
                                             const std::map<std::string, at::Tensor>& tensors);

std::map<std::string, at::Tensor> init_lora(const std::vector<LayerSpec>& specs,
                                            std::uint64_t seed);

}  // namespace rondo::models
