// Text generation on the engine's devices (Engine::generate): where the weights are kept —
// resident on one device, spread over the devices stage by stage, or streamed stage by stage for
// every token — and where the KV caches live between tokens, chosen by a pure function
// (choose_residency); then the token loop, the prompts split into groups that follow each other
// through the stages. Every byte between host and devices (tokens and attention context, stage
// outputs, KV caches kept in host memory, logits) goes through offload::Transfers. Uses the
// engine's parts read-only; runs between train() calls, on the calling thread.
//
//   ResidencyChoice c = choose_residency(query);  // tests: no devices needed
//   Generation g = Generator(parts, plan).run(prompts, sampling, settings);
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/engine.h"
#include "engine/engine_parts.h"
#include "engine/plan.h"

namespace rondo::engine {

// What choose_residency decides from: the model's weights per layer on a device, the plan's
// stages, the devices' room and what generation needs besides the weights.
struct ResidencyQuery {
  Residency residency = Residency::kAuto;
  KvCaches kv_caches = KvCaches::kAuto;
  std::vector<std::uint64_t> layer_bytes;      // per layer: its weights on a device (dequantised)
  std::vector<LayerRange> forward;             // the plan's forward stages
  LayerRange tail;                             // the plan's tail
  std::vector<std::vector<int>> stage_layers;  // streamed layers of forward[0..], then the tail
  std::uint64_t first_device_room = 0;         // what device 0 may hold (resident)
  std::vector<std::uint64_t> room;             // per device: what it may hold (spread, streamed)
  // Device bytes generation needs beyond the weights on a device that runs `blocks` blocks: their
  // KV caches and the prefill's temporaries.
  std::function<std::uint64_t(std::int64_t blocks)> extra;
  std::int64_t blocks = 0;  // the model's blocks (resident: all on device 0)
};

// One stage of generation: layers `range` on device `device`, streaming `layers`.
struct GenerationStage {
  LayerRange range;
  int device = 0;
  std::vector<int> layers;
};

struct ResidencyChoice {
  bool resident = false;  // one stage, every layer on device 0
  bool spread = false;    // the plan's stages, stage j on device j % N, uploaded once
  bool kv_host = false;   // the KV caches in host memory between tokens (streamed only)
  std::vector<GenerationStage> stages;
};

// Resident when asked, or (kAuto) when every weight and `extra(blocks)` fit device 0's room, or
// when the plan is one stage; else the plan's forward stages and its tail, stage j on device
// j % N: spread when asked, or (kAuto, N > 1) when every device holds its stages' weights and
// `extra` for its blocks; else streamed. Streamed, the KV caches stay in host memory when asked,
// or (kAuto) when some device cannot hold two stages' weights (the largest two) beside `extra`
// for its blocks. Pure.
ResidencyChoice choose_residency(const ResidencyQuery& query);

// Device bytes generation needs beyond the weights: the KV caches of `blocks` blocks for `rows`
// rows of `positions` positions (and, for the block attending, its cache extended beside the old
// copy and its grouped heads repeated), and the
// prefill's largest temporaries (the blocks' activations,
// the attention scores of the plain path, the last position's fp32 logits) for a prompt of
// `prompt` tokens. `element` bytes per activation.
std::uint64_t generation_bytes(const models::ModelConfig& config, std::size_t element,
                               std::int64_t rows, std::int64_t prompt, std::int64_t positions,
                               std::int64_t blocks);

class Generator {
 public:
  Generator(const EngineParts& parts, const Plan& plan) : parts_(parts), plan_(plan) {}
  Generation run(const std::vector<std::vector<std::int64_t>>& prompts,
                 const models::SamplingOptions& options, const GenerateSettings& settings);

 private:
  const EngineParts& parts_;
  const Plan& plan_;
};

}  // namespace rondo::engine
