// What a run will need and how fast it will go, before anything is allocated: where each class of
// state lives (host memory or the NVMe tier, quantised or not: the placement the run builds its
// store from), host memory (by purpose), disk (checkpoints and exports), the plan per device with
// its predicted peak memory, traffic per step over the links and the NVMe tier, tokens/s and time,
// and a verdict — "fits", "tight" or "does not fit" — with what to change.
// `rondo plan` prints it, `rondo train` checks it before loading weights, the GUI's review page
// shows it.
//
//   engine::RunEstimate e = engine::estimate_run(config, models::inspect_model(path), devices,
//                                                steps, tokens_per_step, host_free, disk_free);
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/devices.h"
#include "engine/plan.h"
#include "engine/train_config.h"
#include "models/inspect.h"
#include "offload/layer_store.h"

namespace rondo::offload {
class NvmeStore;
}

namespace rondo::engine {

struct HostNeeds {
  std::uint64_t weights = 0;  // streaming copies kept in host memory (as stored: quantised ones
                              // at their quantised size)
  std::uint64_t masters = 0;  // fp32 masters of the trained parameters kept in host memory
  std::uint64_t moments = 0;  // AdamW m and v kept in host memory (f32, or 8-bit with absmax)
  std::uint64_t grads = 0;    // fp32 gradients of the trained parameters kept in host memory
  std::uint64_t loading = 0;  // the largest tensor converted while loading (one at a time)
  std::uint64_t staging = 0;  // stage outputs and step inputs in flight
  // Activation checkpoints kept for the backward, two steps' worth; on the NVMe tier, those read
  // ahead and those waiting for the drive.
  std::uint64_t checkpoints = 0;
  std::uint64_t nvme_staging = 0;  // NVMe reads ahead of uploads and write-backs in flight
  // A run on the CPU device: the device's own memory (weights as computed on, gradient
  // accumulators, activations: the plan's predicted peak), which is this machine's memory too.
  std::uint64_t cpu_device = 0;
  std::uint64_t total() const {
    return weights + masters + moments + grads + loading + staging + checkpoints + nvme_staging +
           cpu_device;
  }
};

// Where the planner put each class of state (docs/architecture.md §5).
struct Placement {
  // The store as planned: every layer's tensors (frozen ones with the format they are kept in)
  // and each part's tier. The run builds its LayerStore from exactly this.
  std::vector<offload::LayerDesc> layers;
  std::string quantize;  // resolved model.quantize: "none", "nf4", "int8" or "gguf"
  std::string formats;   // what the frozen base is kept as: "NF4 (block 64)", "Q4_1 98%, F32 2%"
  std::uint64_t nvme_bytes = 0;  // on the NVMe tier
  // hardware.offload_chunk: the most optimizer state of one chunk (offload::LayerStore)
  std::uint64_t chunk_bytes = offload::kDefaultChunkBytes;
  std::uint64_t offload_free = 0;  // hardware.disk_space, or the free space in offload_dir
  // Bytes of each class in host memory and on NVMe: frozen base, trained weights, optimizer,
  // gradients (f32).
  std::uint64_t host_part[4] = {0, 0, 0, 0}, nvme_part[4] = {0, 0, 0, 0};
  int nvme_layers[4] = {0, 0, 0, 0};  // layers with that class on NVMe
  // Activation checkpoints (docs/training.md, "Bigger than host memory"): where they live, what
  // two steps of them take in host memory, one microbatch's checkpoint, and the NVMe space set
  // aside for them (checkpoint_spill_bytes) when there.
  offload::Tier activations = offload::Tier::kHost;
  std::uint64_t host_activations = 0, activation_checkpoint_bytes = 0, spill_bytes = 0;
  double disk_bytes_per_s = 0;    // read speed assumed for offload_dir
  std::string disk_speed_source;  // where it comes from: set, measured (when, where) or assumed
  // Sharded optimizer state (distributed.shard_optimizer on several ranks): each layer's owner
  // (engine/sharding.h), the layers of other ranks marked optimizer_elsewhere in `layers`; empty:
  // not sharded.
  std::vector<int> optimizer_owners;
  int ranks = 1, rank = 0;    // sharded: among how many, and which this plan is
  std::string lines() const;  // one line per class for `rondo plan`
};

// One change of settings that makes a run fit: the keys to set (as `--set key=value` spells
// them) and why it helps. find_fixes() checks each by planning the run with it.
struct Fix {
  std::vector<std::pair<std::string, std::string>> set;
  std::string why;
};

struct RunEstimate {
  std::int64_t params = 0, trained_params = 0;
  // A mixture of experts: the parameters a token uses (its experts count top-k / E) and the
  // expert counts; every parameter still streams. active_params == params for a dense model.
  double active_params = 0;
  std::int64_t experts = 0, experts_per_token = 0;
  HostNeeds host;
  std::uint64_t host_available = 0;  // hardware.host_memory, or what the OS reports free
  std::uint64_t host_overhead = 0;   // outside the budget: the process itself (Note [Host budget])
  Placement placement;
  std::uint64_t checkpoint_bytes = 0;  // one checkpoint
  std::uint64_t disk_needed = 0;       // checkpoints kept (plus one being written) and exports
  std::uint64_t disk_free = 0;
  DevicePlan devices;
  PlanInputs inputs;
  Plan plan;  // empty when nothing fits
  PlanPrediction prediction;
  double weights_up_unquantised = 0;  // bytes of weights a step would upload without quantisation
  std::int64_t steps = 0, tokens_per_step = 0;
  std::int64_t steps_per_epoch = 0;      // optimizer steps in one pass over the data (0: no data)
  double tokens_per_s = 0, seconds = 0;  // predicted (compute speeds are estimates)
  // When a CPU speed it used was measured while other programs kept the cores busy: the share of
  // the cores' time they took (speed_probe_caveat); 0 otherwise.
  double speed_probe_busy = 0;
  // With an NVMe tier: the step's time were the drive free; when the drive makes the step over
  // 10% longer than that, the tokens per step (and training.grad_accum, at the same rows per
  // microbatch) that would hide it behind compute (0 otherwise).
  double step_time_without_drive_s = 0;
  std::int64_t tokens_per_step_to_hide_drive = 0;
  int grad_accum_to_hide_drive = 0;
  std::string verdict;                // "fits", "tight", "does not fit"
  std::vector<std::string> problems;  // why it does not fit, each with what to change
  std::vector<std::string> warnings;  // why it is tight
  // Changes that make a run that does not fit fit, each planned, the least change to the training
  // first (find_fixes; empty until it is called).
  std::vector<Fix> fixes;
  // The longest rows (data.seq_len) that fit, the rest of the config as it is: 0 when none does,
  // -1 when not asked (find_longest_seq_len). `longest_is_positions`: the model's positions
  // (max_position_embeddings) end there, not the memory.
  std::int64_t longest_seq_len = -1;
  bool longest_is_positions = false;
  // Data parallel (add_ranks; docs/distributed.md): the ranks that share each step, the link
  // between them, and the gradients summed across them a step (ring all-reduce: every rank sends
  // and receives 2 (R - 1) / R of them). The step time and speed above are then the whole run's:
  // one rank's step or the sums, whichever is longer, plus the last bucket's sum (the rest
  // overlaps the backward).
  int ranks = 1;
  double link_bytes_per_s = 0;
  std::string link_speed_source;  // "set" (distributed.link_speed) or what is assumed
  double gradient_bytes = 0, allreduce_s = 0, step_time_one_rank_s = 0;
  // Sharded optimizer state: the trained weights broadcast from their owners after each update
  // (every rank receives (R - 1) / R of them), counted whole on top of the step (not overlapped);
  // and the run's step time with everything.
  double broadcast_bytes = 0, broadcast_s = 0, step_time_ranks_s = 0;
  // DPO (docs/preference.md): the pass that scores every pair with the starting weights once
  // before step 1, a forward over `reference_tokens` row positions (training and validation), and
  // its time, estimated as the forward's share of a step's compute over that many tokens (counted
  // in `seconds`). 0: none (another objective, or a resume, which reads the scores back).
  std::int64_t reference_tokens = 0;
  double reference_s = 0;

  std::string text() const;  // the report `rondo plan` prints
  std::string json() const;  // the same as one JSON object (`rondo plan --json`, the GUI)
};

// Compute speed a GPU is assumed to have (FLOP/s in the run's dtype): a table by GPU generation.
// The CPU's (and simulated GPUs') is measured: engine::cpu_flops (speed.h).
double device_flops(const kernels::DeviceInfo& device, DeviceMode mode, const std::string& dtype);

// An estimate of one rank's share of a step (grad_accum / ranks microbatches) turned into the
// run's on `ranks` ranks joined by a link of `link_bytes_per_s` (RunEstimate::ranks): the
// gradients' sums added to the step time, the tokens per step and speed over every rank.
void add_ranks(RunEstimate& e, int ranks, double link_bytes_per_s, const std::string& source);
// DPO's reference pass over `tokens` row positions (RunEstimate::reference_s): its time added
// to the run's. Call after add_ranks (every rank scores every pair).
void add_reference_pass(RunEstimate& e, std::int64_t tokens);
// Sharded optimizer state (distributed.shard_optimizer, d.ranks > 1): the owners of the layers'
// optimizer state, the layers rank d.rank does not own marked optimizer_elsewhere, before the
// planner places the parts. No-op otherwise.
void shard_placement(Placement& pl, const DistributedSection& d);

// The plan event's `placement`: where each class of state lives, as what, and the NVMe tier's
// backend (a run says which one it uses; null: none).
std::string placement_json(const RunEstimate& est, const offload::NvmeStore* nvme);

// A resume: the step it continues from and the checkpoints already in the run folder (their bytes
// are on the disk already; only what is left to write counts against the free space).
struct ResumePoint {
  std::int64_t step = 0;
  std::size_t checkpoints = 0;
};

// `host_free` / `disk_free`: 0 = ask the OS (MemAvailable; statvfs of output.run_dir or the
// nearest existing parent). For a run that does not plan steps (steps = 0), time is per step.
RunEstimate estimate_run(const TrainConfig& config, const models::ModelSummary& model,
                         const DevicePlan& devices, std::int64_t steps,
                         std::int64_t tokens_per_step, std::uint64_t host_free = 0,
                         std::uint64_t disk_free = 0,
                         const std::optional<ResumePoint>& resume = std::nullopt);

// Fills `e.fixes` for a run that does not fit: each candidate change that applies to it (a
// quantised frozen base, sharded optimizer state on several ranks, bf16, 8-bit moments, an NVMe
// folder `offload_dir` next to the run, half the rows per microbatch with twice the microbatches,
// LoRA for a full run, half the sequence) planned again with the same arguments, kept when it fits
// or is tight; at most `most`. On several ranks `config` is one rank's share (the session's), and
// a fix names the whole run's values.
void find_fixes(RunEstimate& e, const TrainConfig& config, const models::ModelSummary& model,
                const DevicePlan& devices, std::int64_t steps, std::uint64_t host_free,
                std::uint64_t disk_free, const std::optional<ResumePoint>& resume,
                const std::string& offload_dir, std::size_t most = 3);

// Fills `e.longest_seq_len`: the longest data.seq_len, in steps of kSeqLenStep tokens, at which
// the run (the same rows, microbatches and everything else) plans with no problem but the disk's
// (checkpoints and exports do not grow with it), up to the model's positions.
inline constexpr std::int64_t kSeqLenStep = 128;
void find_longest_seq_len(RunEstimate& e, const TrainConfig& config,
                          const models::ModelSummary& model, const DevicePlan& devices,
                          std::int64_t steps, std::uint64_t host_free, std::uint64_t disk_free,
                          const std::optional<ResumePoint>& resume);

// The NVMe space activation checkpoints of `plan` take on the tier: two steps' worth (every
// microbatch's, of `checkpoint_bytes` each at most), in the store's default 1 MiB blocks.
std::uint64_t checkpoint_spill_bytes(const Plan& plan, std::uint64_t checkpoint_bytes);

std::uint64_t host_memory_available();  // MemAvailable, bytes
// What the process needs outside its host budget: the runtime (torch, code, heaps), measured as
// a baseline. See Note [Host budget] in estimate.cpp.
std::uint64_t host_fixed_overhead();
std::uint64_t disk_space_free(const std::string& path);  // nearest existing parent
// Why nothing can be written at or under `path` (its nearest existing parent is a file, on a
// read-only or virtual file system such as /proc, or not writable by this user); "" when it can.
std::string why_unwritable(const std::string& path);
std::string format_bytes(std::uint64_t bytes);  // "1.50 GiB"
std::string format_count(std::int64_t n);       // "812", "135.0 M", "7.24 B"

// Measured steps against the plan's prediction: once a run has timed kStepsToJudge steps after its
// first (which pays for warm-up), a message when their median is off the predicted step time by
// more than 25% either way (saying that the ETA follows the measured steps), else "". Runs of
// `steps` steps that take under a minute either way are not worth the warning.
inline constexpr int kStepsToJudge = 3;
std::string step_time_warning(double predicted_s, std::vector<double> measured_s,
                              std::int64_t steps);

}  // namespace rondo::engine
