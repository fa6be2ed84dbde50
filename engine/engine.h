// The engine: runs a plan's stage jobs on stateless devices, round-robin, and the optimizer on the
// host (docs/architecture.md §2–§4). This header is its whole interface; behind it (engine.cpp
// says where each piece lives): the board that the threads share (board.h), the loaders and
// workers (pipeline.h), one microbatch's math (job_compute.h), a step's inputs (step_inputs.h),
// the optimizer thread (optimizer_driver.h), re-planning (replan.h) and generation
// (generation.h).
//
// Threads: per device a loader (uploads a job's weights, one stage ahead at most) and a worker
// (enqueues the job's computation microbatch by microbatch, hands outputs on, downloads the
// gradients); one optimizer thread (per step: waits for every gradient, then AdamW layer by layer
// in forward order, releasing each layer to the next step's loaders). Job g of the global sequence
// (step s = g / J, stage j = g % J) runs on device g % N: one round-robin pointer across stages
// and steps, no barrier between steps. See Note [Engine synchronisation] in board.cpp.
//
// Per device four streams: compute, activation upload (high priority), weight upload (weights cut
// into chunks of at most max_chunk_bytes, so activation uploads slot in between) and download;
// every copy is offload::Transfers' and counted in its TransferStats. A stage's output stays on
// the device when the next stage runs there; otherwise it goes down to host staging memory and up
// to the next device. Activation checkpoints (each backward stage's input, or every layer's input
// in layer grain) always go down to the host (and on to the NVMe tier with
// spill_checkpoint_bytes).
//
//   engine::Engine eng(model.config(), model.layers(), store, arena, devices, plan, options);
//   auto results = eng.train(3, [&](std::int64_t step) { return microbatches_for(step); });
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/plan.h"
#include "engine/preference.h"
#include "kernels/cpu/adamw.h"
#include "kernels/device.h"
#include "models/generate.h"
#include "models/layers.h"
#include "offload/host_arena.h"
#include "offload/layer_store.h"
#include "offload/transfer.h"

namespace rondo::engine {

class EventSink;
class Collective;  // engine/ranks.h

// One microbatch, CPU tensors: tokens (B, T) int64, optional doc_ids, targets (B, T) int64 with
// -100 where there is no loss (already shifted: targets[t] is the token after t).
struct Microbatch {
  models::TokenBatch batch;
  at::Tensor targets;
  // A preference objective's pairs (EngineOptions::preference; engine/preference.h): per target
  // position the sequence whose answer it scores (int64, -1: none; sequence 2p is pair p's chosen
  // answer, 2p + 1 its rejected one), the chosen answers' NLL positions (fp32 0/1, or undefined),
  // and the reference's summed log-probability of each sequence (2P fp32: DPO; zeros otherwise and
  // in the pass that computes them). Undefined seq: a supervised microbatch.
  struct Pairs {
    at::Tensor seq, nll, reference;
  } pairs;
};

struct LossScaling {  // fp16: dynamic loss scaling
  bool enabled = false;
  double initial_scale = 65536;
  int growth_interval = 2000;  // finite steps in a row before the scale doubles
  double min_scale = 1.0 / 65536;
};

// Test and benchmark seams: the engine calls these at fixed points and does nothing else for them
// (it never sleeps, reads the environment or kills anything itself). Every method defaults to
// nothing. Called from the engine's threads: an implementation must be thread-safe.
class EngineProbe {
 public:
  virtual ~EngineProbe() = default;
  // On the optimizer thread once every gradient of `step` (1-based) is in the store, before the
  // update (tests read them there).
  virtual void gradients_in(std::int64_t step) { (void)step; }
  // In compute-stream order on device `device`, right after one microbatch of a job (or one layer
  // of a generation pass) over `layers` took `seconds` of host time for `tokens` tokens, forward
  // only or with the backward. A benchmark's cost emulation sleeps here, so that simulated devices
  // sharing a few cores behave like separate GPUs (tests/support/engine_hooks.h).
  virtual void computed(int device, LayerRange layers, bool forward_only, std::int64_t tokens,
                        double seconds) {
    (void)device, (void)layers, (void)forward_only, (void)tokens, (void)seconds;
  }
};

// A device ran out of memory in a job: the message says where (step, job, device) and what was
// asked; `whose` tells whether the engine's own buffers (weights, activations, gradients) or
// torch's allocations (its temporaries) did not fit. The caller adds the settings that lower it.
class DeviceMemoryError : public Error {
 public:
  enum class Whose { kEngineBuffers, kTorch };
  DeviceMemoryError(const std::string& message, Whose whose) : Error(message), whose(whose) {}
  Whose whose;
};

// An op without a deterministic implementation ran while torch's deterministic algorithms were on
// (engine::use_deterministic_torch): the message names the op and where it ran.
class NondeterministicOpError : public Error {
 public:
  using Error::Error;
};

struct EngineOptions {
  kernels::AdamWParams adamw;  // adamw.step is ignored (the optimizer counts)
  double max_grad_norm = 0;    // <= 0: no clipping
  // Learning rate for a (1-based) step; empty = adamw.lr throughout.
  std::function<double(std::int64_t step)> lr;
  LossScaling loss_scaling;
  // RoundPipe's asynchronous mode: step i runs on the weights before the previous step's update
  // (w_i = θ_{i-1}, θ_{i+1} = θ_i + U(∇L(w_i))), so the optimizer's AdamW pass overlaps the next
  // step instead of delaying it. Default: exact synchronous training. After train() the streaming
  // copies then lag the masters by one update (checkpoints and exports use the masters).
  bool one_step_stale = false;
  std::uint64_t seed = 0;  // run seed: dropout draws depend on it, the step and the microbatch
  std::int64_t head_chunk_tokens = 1024;  // rows of logits at a time in the fused tail
  std::uint64_t max_chunk_bytes = 256ull << 20;
  // Activation checkpoints on the NVMe tier: bytes of the store's NVMe file (store.nvme(), sized
  // for them) they may take; 0 = they stay in host staging memory. Written there once downloaded,
  // read back (one microbatch ahead) for the backward; the results are the same bit for bit.
  std::uint64_t spill_checkpoint_bytes = 0;
  // The devices are the CPU itself (DeviceMode::kCpu): frozen weights in host memory are read
  // where the store keeps them, not copied every step (offload::TransferOptions::share_frozen).
  bool share_frozen_weights = false;
  // The same for the trained weights, and a job's gradients accumulate where the store keeps them
  // instead of in device buffers downloaded afterwards: no copy either way (for a 135M-parameter
  // full fine-tuning, two 0.5 GB copies and a 0.5 GB clearing of the store's gradients, serial
  // between two steps). Exact training only: ignored with one_step_stale, whose optimizer
  // publishes weights while jobs run.
  bool share_trained_state = false;
  EventSink* events = nullptr;  // plan, span and device events when set
  // The costs the plan was made from: for the plan event's prediction and for re-planning. May
  // be null (then no prediction and no re-planning).
  const PlanInputs* plan_inputs = nullptr;
  // The training objective: next-token cross-entropy (kSft), or a preference objective over pairs
  // (every microbatch then carries Microbatch::pairs). A preference step's loss is the mean of
  // its microbatches' losses (each the mean over its pairs, as TRL), not a mean over tokens.
  PreferenceOptions preference;
  std::string partitioner = "ours";  // who made the plan, for the plan event ("reference", ...)
  std::string placement_json;        // for the plan event: where the state lives (a JSON object)
  // Re-planning from measured timings: every `replan_every` steps (0 = never) the engine folds the
  // jobs' measured compute times into the per-layer costs (smoothed: each update moves a cost
  // half-way to what was measured), and when some layer's cost moved by more than
  // `replan_threshold` it asks plan_ours() again and switches to the new plan at that step
  // boundary (a `plan` event says so). The measured times are device times (timing events).
  int replan_every = 0;
  double replan_threshold = 0.2;
  // Tests and benchmarks: told when gradients are in and how long compute took (EngineProbe).
  EngineProbe* probe = nullptr;
  // Data parallelism across processes (engine/ranks.h, docs/distributed.md); null: one process.
  // Each rank's train() gets its share of every step, M of the R * M microbatches (rank r's are
  // the step's r * M to r * M + M - 1: dropout draws from the global index). `steps` sums each
  // step's target count on the main thread as the step is read, so that every rank's loss is
  // scaled by the step's whole count; `gradients` sums each layer's gradients on the optimizer
  // thread as they land (in host memory, fp32), then the loss. Every rank then updates the same
  // way. Gradients on the NVMe tier are refused. evaluate() and generate() stay per rank.
  // A stop (request_stop) is agreed: `steps` tells every rank after each step whether any was
  // asked to stop, and all stop after the same step.
  struct DataParallel {
    Collective* steps = nullptr;
    Collective* gradients = nullptr;
    // Sharded optimizer state (engine/sharding.h): each layer's owner among the ranks (-1: no
    // trained state), empty = every rank holds every layer's. The store must hold exactly the
    // layers this rank owns (shard_layers). Each rank updates its layers, then the new streaming
    // copies are broadcast from their owners, in layer order. Not with one_step_stale.
    std::vector<int> optimizer_owners;
  } data_parallel;
};

// Rows of logits the head computes at a time: `configured` (EngineOptions::head_chunk_tokens); on
// a CPU-backed device (the CPU, simulated GPUs) at most what keeps a chunk's fp32 logits under
// half the tuned heap's block limit (offload/process_heap.h), so that they are reused from the
// heap instead of mapped and faulted in every step; at least 16.
std::int64_t head_chunk_tokens(std::int64_t configured, std::int64_t vocab, bool cpu_backed);

// The dropout seed of one microbatch of one (1-based) step: what AttentionContext::dropout_seed
// holds while the engine trains (and what a reference loop must use to draw the same masks).
std::int64_t dropout_seed(std::uint64_t run_seed, std::int64_t step, int microbatch);

struct StepResult {
  std::int64_t step = 0;                 // 1-based, counted across train() calls
  double loss = 0;                       // mean cross-entropy over the step's target tokens
  std::int64_t tokens = 0, targets = 0;  // data parallel: every rank's
  double grad_norm = 0;                  // of the unscaled gradient, before clipping
  bool skipped = false;  // fp16 overflow: the update was skipped and the scale lowered
  double loss_scale = 1;
  double seconds = 0;  // wall time since the previous step ended (or train() began)
  // A preference objective's metrics (PreferenceMetric order): means over the step's microbatches.
  std::array<double, kPreferenceMetrics> preference{};
  // The step's jobs' microbatches (a job runs a stage's forward or backward on one microbatch)
  // whose attention ran per document (packed rows, models::attend_per_document), or under
  // (B, 1, T, T) masks; neither for rows of one document each within the window.
  std::int64_t attention_per_document = 0, attention_masked = 0;
};

// A loss over an evaluation set: the cross-entropy summed over its target tokens, and their count.
// A preference objective's: the loss summed over microbatches, and their count in `targets`; the
// metrics' sums; each microbatch's sequences' summed log-probabilities (the reference pass).
struct EvalResult {
  double loss_sum = 0;
  std::int64_t targets = 0;
  std::array<double, kPreferenceMetrics> preference{};
  std::vector<std::vector<float>> sequence_logps;  // per microbatch given (preference only)
  double loss() const { return targets > 0 ? loss_sum / static_cast<double>(targets) : 0.0; }
};

// Where generate() keeps the weights: kAuto = resident when they fit on the first device, else
// spread when every device holds its own stages, else streamed.
enum class Residency { kAuto, kResident, kSpread, kStreamed };
// Where generate() keeps the KV caches between tokens: kAuto = on the devices that run their
// blocks, unless (streamed) they would not fit there beside two stages of weights.
enum class KvCaches { kAuto, kDevice, kHost };

struct GenerateSettings {
  Residency residency = Residency::kAuto;
  KvCaches kv_caches = KvCaches::kAuto;
  // Prompt groups that follow each other through the stages (at most one per prompt), in every
  // pass. 0: as many as keep min_group_tokens rows of tokens each in a pass (the prompts' prefill,
  // a decoding step of many), at most one per device that runs a stage (spread or streamed over
  // several simulated devices; on CUDA GPUs not yet: docs/engine.md); else 1, all together. Below a
  // few hundred rows a GPU's matmuls are bound by reading the weights, which every group would read
  // again.
  int groups = 0;
  std::int64_t min_group_tokens = 256;
  // Runs on the calling thread as each token is chosen: (prompt index, token), to stream text.
  std::function<void(std::size_t, std::int64_t)> on_token;
};

struct Generation {
  std::vector<std::vector<std::int64_t>> tokens;  // per prompt: the new tokens, as models::generate
  bool resident = false;                          // the weights stayed on one device
  bool spread = false;      // each stage stayed on its device across tokens (uploaded once)
  bool kv_host = false;     // the KV caches stayed in host memory between tokens
  std::int64_t groups = 1;  // the most prompt groups a pass pipelined through the stages
  // kv_host: bytes of KV cache moved between host memory and the devices. Up: each block's cache
  // so far before it runs; down: only the keys and values of the new positions.
  std::uint64_t kv_bytes_up = 0, kv_bytes_down = 0;
};

// What a checkpoint must hold beyond the store's tensors for a bit-identical resume.
struct EngineCounters {
  std::int64_t steps_done = 0;      // optimizer steps run, skipped fp16 steps included
  std::int64_t optimizer_step = 0;  // AdamW's step count (bias correction): applied steps only
  double loss_scale = 1;            // fp16 loss scaling: the scale of the next step
  int good_steps = 0;               // finite steps since the scale last changed
};

class Engine {
 public:
  // `devices` are borrowed and must outlive the engine; `store` holds the weights (and, for
  // trainable tensors, gradients and optimizer state); `arena` gives staging memory. Throws Error
  // when the plan does not match the model or the devices.
  Engine(const models::ModelConfig& config, const std::vector<models::LayerSpec>& specs,
         offload::LayerStore& store, offload::HostArena& arena,
         std::vector<kernels::Device*> devices, Plan plan, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  using BatchSource = std::function<std::vector<Microbatch>(std::int64_t step)>;
  // Runs `steps` optimizer steps; `batches(step)` (1-based step) gives the step's M microbatches
  // (called on this thread, a step or two ahead). `on_step` runs on this thread after each step.
  // On failure (a device out of memory, bad input, an error in a layer) every thread stops and
  // the first error is rethrown, naming the device, the job and the step (DeviceMemoryError,
  // NondeterministicOpError or Error); state already updated stays as it was after the last
  // completed step's update of each layer.
  std::vector<StepResult> train(std::int64_t steps, const BatchSource& batches,
                                const std::function<void(const StepResult&)>& on_step = {});

  // Between train() calls: the loss of `microbatches` (any number, each as a training microbatch,
  // no more rows) under the weights the devices train with (the streaming copies), without dropout
  // and without the router's auxiliary loss. Runs as forward-only jobs on the devices, the weights
  // streamed as in training: the plan's forward stages, then a job over the tail's layers that
  // ends in the loss sum (fp32 on the device, per M microbatches), round-robin. Nothing is
  // updated; the first error is rethrown as train()'s are.
  EvalResult evaluate(std::vector<Microbatch> microbatches);

  // Between train() calls: text generation from the weights the devices train with (the streaming
  // copies, LoRA adapters applied unmerged, a quantised base dequantised on the device), all
  // prompts together (left-padded), a KV cache per block on the device that runs it. Resident:
  // every layer uploaded once to the first device, when they and the caches fit under its free
  // memory, or when the plan is one stage (or as `residency` says). Spread: the plan's stages,
  // stage j on device j % N, each uploaded once and kept, when every device holds its own.
  // Streamed: the plan's forward stages and its tail's layers uploaded again for every token, stage
  // j on device j % N, the next stages' uploads (one per other device) overlapping. Each prompt's
  // tokens are chosen as models::generate chooses them (its own sampling state from options.seed),
  // and stop after a stop token or max_new_tokens. The KV caches stay on the devices, or in host
  // memory between tokens (settings.kv_caches; kAuto: when streaming and they would not fit).
  // Spread or streamed over several devices, the prompts split into groups (one per device) that
  // pipeline through the stages like training's microbatches: a device runs a stage for one group
  // while the next device runs the next stage for the group before, every stage's weights serving
  // every group once uploaded.
  Generation generate(const std::vector<std::vector<std::int64_t>>& prompts,
                      const models::SamplingOptions& options,
                      const GenerateSettings& settings = {});

  // Asks train() to return early: the steps some thread has begun finish (and are returned), no
  // other starts, even one already handed out; in exact mode a stop during step s usually ends
  // after s (the next step begins once s has updated its first layers), with one-step-stale
  // updates after s + 1 (which overlaps s). Thread-safe, may be called from on_step or any other
  // thread (not from a signal handler); sticky: later train() calls return at once.
  void request_stop();

  // Between train() calls: the counters a checkpoint saves, and setting them back on a fresh
  // engine over a store read from that checkpoint (the next step is then steps_done + 1).
  EngineCounters counters() const;
  void restore(const EngineCounters& counters);

  const Plan& plan() const;  // the plan in use (it changes when the engine re-plans)
  double loss_scale() const;
  // Bytes moved since the engine was made (offload::TransferStats).
  offload::TransferStats transfer_stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rondo::engine
