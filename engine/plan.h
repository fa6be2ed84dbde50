// Execution plans and the partitioner (docs/architecture.md §2.1 and §3.2).
//
// A plan cuts the layer list [prefix, block_0 .. block_{L-1}, head] into forward stages, a fused
// tail (the last layers + LM head + loss, forward and backward in one job, no recompute) and
// backward stages — forward and backward cut independently. Jobs run in the order
// F_0 .. F_{f-1}, T, B_1 .. B_{b-1} (B_1 follows the tail down the layers), each over all M
// microbatches, dispatched round-robin to the devices.
//
// Two partitioners: plan_reference() is RoundPipe's (cost = compute only, stages capped at half the
// device memory); plan_ours() costs a stage job as max(compute, bytes streamed / link bandwidth),
// counts activation memory against the cap, and picks among candidate cuts by simulating the
// round-robin schedule on the actual devices (speeds may differ). predict() is that simulation.
//
//   engine::PlanInputs in = ...;           // per-layer costs, devices, M, tokens per step
//   engine::Plan plan = engine::plan_ours(in);
//   engine::PlanPrediction p = engine::predict(plan, in);  // step time, peak memory, idle share
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace rondo::engine {

struct LayerRange {
  int begin = 0, end = 0;  // layers [begin, end)
  int size() const { return end - begin; }
  bool operator==(const LayerRange&) const = default;
};

enum class RecomputeGrain {
  kStage,  // save each backward stage's input; recompute the whole stage at once
  kLayer,  // save every layer's input; recompute and backpropagate layer by layer (less memory)
};
const char* to_string(RecomputeGrain grain);

struct Plan {
  std::vector<LayerRange> forward;   // ascending, covering [0, tail.begin)
  LayerRange tail;                   // [k, layers): forward, loss, backward in one job
  std::vector<LayerRange> backward;  // after the tail, descending, covering [0, tail.begin)
  int microbatches = 1;              // M: a job runs its stage over all of them
  RecomputeGrain grain = RecomputeGrain::kStage;
  // Sequence tiling: blocks run all but attention itself over tiles of this many tokens of a
  // microbatch (models::AttentionContext::mlp_tile_tokens), in forward and backward; 0 = untiled.
  std::int64_t mlp_tile_tokens = 0;

  int layers() const { return tail.end; }
  int jobs() const { return static_cast<int>(forward.size() + 1 + backward.size()); }
  // Every rule a plan breaks, each in words; empty when valid for a model of `layers` layers.
  std::vector<std::string> problems(int layers) const;
  // "F[0,4) F[4,9) T[9,12) B[5,9) B[0,5) M=3 stage" (and " tile=4096" when tiled)
  std::string describe() const;
  // The layers whose inputs the forward saves for the backward (activation checkpoints, one per
  // microbatch each): every block before the tail (layer grain), or each backward stage's first
  // block (stage grain); never layer 0's (the tokens).
  std::set<int> checkpointed_layers() const;
};

// What one layer costs, as the planner sees it. Compute times are per token on a device of speed
// 1; bytes are what crosses the link or sits in device memory.
struct LayerCosts {
  double forward_s_per_token = 0;   // forward (= recompute)
  double backward_s_per_token = 0;  // backward alone (without the recompute)
  // Under sequence tiling, what a backward computes once more: those of a block's projections
  // whose values its backward needs (models::LayerSpec::flops_tiled_recompute_per_token).
  double tiled_recompute_s_per_token = 0;
  std::uint64_t param_bytes = 0;         // streamed to the device for every job holding the layer
                                         // (as stored: quantised where the base is kept so)
  std::uint64_t device_param_bytes = 0;  // the weights once on the device (dequantised);
                                         // 0 = param_bytes
  std::uint64_t nvme_read_bytes = 0;     // of param_bytes, read from the NVMe tier first
  std::uint64_t nvme_update_bytes = 0;   // optimizer state on NVMe: read and written per step
  std::uint64_t grad_bytes = 0;  // trainable part: gradients held on the device and downloaded
  std::uint64_t activation_bytes_per_token = 0;  // what autograd keeps while running the layer
  // The same under sequence tiling (models::LayerSpec::tiled_activation_bytes_per_token); 0 = as
  // untiled.
  std::uint64_t tiled_activation_bytes_per_token = 0;
  // What sequence tiling holds for one tile, per token of it (an MLP's intermediates, or the
  // attention half's projections: models::LayerSpec::tileable_bytes_per_token); 0 = the layer is
  // not tiled.
  std::uint64_t tileable_bytes_per_token = 0;
  // What its backward holds per token beyond that, untiled and tiled
  // (models::LayerSpec::backward_bytes_per_token): one layer's at a time.
  std::uint64_t backward_bytes_per_token = 0, backward_tiled_bytes_per_token = 0;
  // What its forward without autograd holds per token at its peak, beyond its input
  // (models::LayerSpec::forward_bytes_per_token).
  std::uint64_t forward_bytes_per_token = 0;
  std::uint64_t output_bytes_per_token = 0;  // its output: a stage boundary or a checkpoint
  // Held only while the layer's backward runs, whatever the microbatch: the head's chunk of fp32
  // logits and their gradient, and its weight's fp32 gradient before it joins the accumulator.
  std::uint64_t transient_bytes = 0;
};

struct DeviceModel {
  double speed = 1.0;            // relative compute speed (1 = the speed the costs assume)
  std::uint64_t memory_cap = 0;  // bytes the plan may use on it
  double link_bytes_per_s = 0;   // host link, each direction; 0 = free
  double link_latency_s = 0;
};

struct PlanInputs {
  std::vector<LayerCosts> layers;
  std::vector<DeviceModel> devices;
  std::int64_t tokens_per_step = 0;  // global batch in tokens (split over the microbatches)
  int microbatches = 0;              // M; 0 = devices + 1
  RecomputeGrain grain = RecomputeGrain::kStage;
  double nvme_bytes_per_s = 0;  // the NVMe tier, shared by every device; 0 = none in use
  // Activation checkpoints go to the NVMe tier once downloaded and come back from it (read ahead
  // from when the backward job's device starts its previous job) before their upload.
  bool checkpoints_on_nvme = false;
  // The CPU optimizer: seconds of AdamW per byte of a layer's gradient (0 = free). Once a step's
  // gradients are all in (the global norm needs them), it updates the layers in forward order,
  // one after another; a layer's next upload waits for its update.
  double optimizer_s_per_grad_byte = 0;
  double upper_threshold = 1.1;  // candidate stage budgets in [W, threshold * W]
  int min_stages = 0;            // 0 = number of devices
  bool one_step_stale = false;   // RoundPipe's default: weights lag the gradients by a step
  // The devices compute on the same cores (simulated GPUs on the CPU): one microbatch's compute
  // at a time across all of them, each at its full speed when alone. Two simulated GPUs on 2
  // cores ran a LoRA step 1.6x as long as one device's; counted as parallel, the prediction was
  // 36% short.
  bool shared_compute = false;
  // A step's inputs per token (tokens, targets, positions, document ids, rotary tables), on every
  // device that runs a job of the step, for the whole step and two steps at a time.
  std::uint64_t input_bytes_per_token = 0;
  // The attention masks per token (a row of keys for packed documents, another for a sliding
  // window), built on the device for the microbatch a job runs: one microbatch's at a time.
  std::uint64_t mask_bytes_per_token = 0;
  // Sequence tiling (Plan::mlp_tile_tokens): -1 = the planner's choice (untiled when a plan fits
  // so, else the largest of kMlpTiles that fits a plan), 0 = never, > 0 = that tile.
  std::int64_t mlp_tile_tokens = -1;

  int resolved_microbatches() const;
  std::vector<std::string> problems() const;
};

// The tiles plan_ours tries, largest first: 4096 tokens keep the MLP's matmuls as long as a
// microbatch of ordinary length; below 256 their rows get too short to run at speed.
inline constexpr std::int64_t kMlpTiles[] = {4096, 2048, 1024, 512, 256};

struct PlanPrediction {
  double step_time_s = 0;                 // steady state, one optimizer step
  double idle_fraction = 0;               // share of device time without compute, steady state
  std::vector<std::uint64_t> peak_bytes;  // per device
  bool fits = true;                       // every device's peak within its cap
  std::string why_not;                    // the first device over its cap, and by how much
  // Bytes one step moves, steady state.
  double bytes_up = 0;          // host -> devices: weights (as stored) and activations
  double bytes_weights_up = 0;  // of bytes_up, the weights
  double bytes_down = 0;        // devices -> host: activations, checkpoints and gradients
  double bytes_nvme_read = 0, bytes_nvme_write = 0;  // the NVMe tier
};

// Simulates four steps of the round-robin schedule (no global barrier between steps) and
// reports the third: per-microbatch compute, weight upload once per job (prefetched behind the
// previous job, one stage ahead at most), boundary transfers on the links, and memory per device
// (two stages of weights, the running stage's gradients, one microbatch's activations).
PlanPrediction predict(const Plan& plan, const PlanInputs& inputs);

// RoundPipe's planner (docs/architecture.md §3.2). Throws Error when the inputs are invalid.
Plan plan_reference(const PlanInputs& inputs);
// Ours: candidate cuts by job cost max(compute, transfer) under memory including activations,
// chosen by predict(). The reference plan is among the candidates, so ours never predicts slower.
// Throws Error naming the settings that would fit when nothing fits the device memory.
Plan plan_ours(const PlanInputs& inputs);

}  // namespace rondo::engine
