#include "engine/inference.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "engine/model_store.h"
#include "kernels/error.h"
#include "models/peft_adapter.h"
#include "models/weight_reader.h"
#include "offload/host_arena.h"
#include "offload/layer_store.h"

namespace rondo::engine {

Plan generation_plan(const std::vector<std::uint64_t>& layer_bytes, std::uint64_t budget) {
  const int L = static_cast<int>(layer_bytes.size());
  RONDO_ASSERT(L >= 1);
  std::vector<LayerRange> stages;
  int begin = 0;
  std::uint64_t held = 0;
  for (int l = 0; l < L; ++l) {
    if (l > begin && held + layer_bytes[static_cast<std::size_t>(l)] > budget) {
      stages.push_back({begin, l});
      begin = l;
      held = 0;
    }
    held += layer_bytes[static_cast<std::size_t>(l)];
  }
  Plan plan;
  plan.tail = {begin, L};
  plan.forward = stages;
  plan.backward.assign(stages.rbegin(), stages.rend());
  plan.microbatches = 1;
  return plan;
}

struct DeviceGenerator::Impl {
  models::WeightReader reader;
  std::vector<models::LayerSpec> specs;
  offload::HostArena arena;
  std::optional<offload::LayerStore> store;
  std::vector<std::unique_ptr<kernels::Device>> devices;
  std::optional<Engine> engine;
  DeviceMode mode;

  explicit Impl(GeneratorOptions& o)
      : reader(o.model), specs(reader.layers()), mode(o.devices.mode) {
    if (o.devices.mode != DeviceMode::kCuda && o.devices.mode != DeviceMode::kSim)
      throw Error(std::string("generation on the devices needs CUDA or simulated GPUs; this plan "
                              "has ") +
                  to_string(o.devices.mode) + " devices");
    if (o.lora) specs = models::add_lora(specs, *o.lora);
    const std::vector<std::string> problems =
        models::trained_problems(specs, o.trained, o.lora.has_value());
    if (!problems.empty())
      models::throw_trained_problems(problems, o.source, o.model, o.lora.has_value());
    // Checked before anything is loaded: a layer no device can stream.
    std::uint64_t smallest = std::numeric_limits<std::uint64_t>::max();
    for (const kernels::DeviceInfo& d : o.devices.devices)
      smallest = std::min(smallest, d.bytes_cap);
    if (o.devices.devices.empty()) smallest = 0;
    std::vector<std::uint64_t> bytes;
    for (const models::LayerSpec& s : specs) {
      const std::uint64_t b =
          static_cast<std::uint64_t>(s.param_count()) * kernels::dtype_size(o.dtype);
      bytes.push_back(b);
      // Streaming holds a layer computing and the next one arriving, on one device at worst.
      if (2 * b > smallest)
        throw Error(fmt::format(
            "generating on the devices: {} (layer {} of {}) holds {} of weights, and streaming "
            "puts two layers on a device at once; the smallest device holds {}: give the devices "
            "more memory (--memory-cap, --sim-memory), a smaller dtype (--dtype bf16), or "
            "generate on the CPU (--cpu)",
            s.kind == models::LayerKind::kBlock  ? "block " + std::to_string(s.block)
            : s.kind == models::LayerKind::kHead ? std::string("the LM head")
                                                 : std::string("the embedding"),
            bytes.size(), specs.size(), format_bytes(b), format_bytes(smallest)));
    }
    // Every tensor frozen, in the streaming dtype; the adapters apart (applied unmerged).
    store.emplace(arena, layer_descs(specs, [](const models::ParamSpec&) { return false; }),
                  o.dtype, kernels::FloatDType::kF32);
    load_weights(*store, specs, reader, o.trained);
    o.trained.clear();
    devices = open_devices(o.devices);
    std::vector<kernels::Device*> raw;
    for (auto& d : devices)
      raw.push_back(d.get());
    // Stages of a quarter of the smallest device: one computing and the next one arriving, with
    // room left for caches and activations.
    engine.emplace(reader.config(), specs, *store, arena, raw, generation_plan(bytes, smallest / 4),
                   EngineOptions{});
  }
};

DeviceGenerator::DeviceGenerator(GeneratorOptions options)
    : impl_(std::make_unique<Impl>(options)) {}

DeviceGenerator::~DeviceGenerator() = default;

const models::ModelConfig& DeviceGenerator::config() const {
  return impl_->reader.config();
}

std::string DeviceGenerator::where() const {
  const std::size_t n = impl_->devices.size();
  return fmt::format("{} {}{}", n, impl_->mode == DeviceMode::kSim ? "simulated GPU" : "CUDA GPU",
                     n == 1 ? "" : "s");
}

Generation DeviceGenerator::generate(
    const std::vector<std::vector<std::int64_t>>& prompts, const models::SamplingOptions& options,
    const std::function<void(std::size_t, std::int64_t)>& on_token) {
  try {
    return impl_->engine->generate(prompts, options, {.on_token = on_token});
  } catch (const Error& e) {
    // A device out of memory (the engine's pool uploading, or torch's allocator computing)
    // advises what helps a training run, or nothing; say what helps here.
    std::string what = e.what();
    if (what.find("out of memory") == std::string::npos) throw;
    if (const std::size_t cut = what.find("; use more microbatches"); cut != std::string::npos)
      what.resize(cut);
    throw Error("generating on " + where() + ": " + what +
                "; give the devices more memory (--memory-cap, --sim-memory), generate fewer "
                "tokens (--max-new-tokens), or generate on the CPU (--cpu)");
  }
}

}  // namespace rondo::engine
