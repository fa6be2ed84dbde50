// Text generation on the devices, outside a training run: what `rondo generate` and `rondo chat`
// use when the machine has GPUs (or simulated ones are asked for). The model's tensors go into a
// host store (every tensor frozen, in the streaming dtype) as a run's would, LoRA adapters kept
// apart and applied unmerged, and Engine::generate runs on the devices: the whole model resident
// on the first one when it fits, else stages streamed round-robin with a KV cache per block on the
// device that runs it. No merged copy of the model is made in host memory.
//
//   engine::DeviceGenerator g({.model = "models/qwen", .devices = plan_devices({})});
//   auto out = g.generate({prompt_ids}, {.max_new_tokens = 64}, on_token);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/devices.h"
#include "engine/engine.h"
#include "kernels/cpu/simd.h"
#include "models/lora.h"

namespace rondo::engine {

struct GeneratorOptions {
  std::string model;  // a Hugging Face folder or a .gguf file
  // Trained tensors by name, used in place of the file's (a full run's weights) or, with `lora`,
  // the adapters that config adds (every one required). Checked against the base first; `source`
  // names them in errors.
  std::optional<models::LoraConfig> lora;
  std::map<std::string, at::Tensor> trained;
  std::string source;
  DevicePlan devices;  // CUDA or simulated GPUs (plan_devices); opened here
  kernels::FloatDType dtype = kernels::FloatDType::kF32;  // of the weights on the devices
};

class DeviceGenerator {
 public:
  // Loads the model into host memory and opens the devices. Throws Error naming what does not
  // fit (trained tensors of another model, a layer larger than a device).
  explicit DeviceGenerator(GeneratorOptions options);
  ~DeviceGenerator();
  DeviceGenerator(const DeviceGenerator&) = delete;
  DeviceGenerator& operator=(const DeviceGenerator&) = delete;

  const models::ModelConfig& config() const;
  // "2 simulated GPUs" / "1 CUDA GPU", for messages.
  std::string where() const;
  // Engine::generate on the devices; `on_token` runs on this thread as tokens are chosen.
  Generation generate(const std::vector<std::vector<std::int64_t>>& prompts,
                      const models::SamplingOptions& options,
                      const std::function<void(std::size_t, std::int64_t)>& on_token = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The plan generation streams with: the layers cut in order into stages of at most `budget` bytes
// of weights each (a layer larger than that alone), the last stage the tail, backward stages
// mirroring the forward ones (the engine's plans have them; generation runs none). One stage when
// everything fits the budget.
Plan generation_plan(const std::vector<std::uint64_t>& layer_bytes, std::uint64_t budget);

}  // namespace rondo::engine
