// Everything a training run is set up from, one aggregate per section, as `config.toml` spells it
// (cli/config_file.h reads and writes the TOML; the GUI's wizard fills the same fields). Defaults
// are what a LoRA run on a small chat dataset wants. validate() lists every problem at once, each
// naming its field ("training.lr: ...").
//
//   engine::TrainConfig c;
//   c.model.path = "models/Qwen3-0.6B";
//   c.data.train = "data/chat.jsonl";
//   for (auto& p : c.validate()) std::puts(p.c_str());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/lora.h"

namespace rondo::engine {

struct ModelSection {
  std::string path;            // a Hugging Face folder or a .gguf file
  std::string dtype = "bf16";  // weights streamed and computed in: "bf16", "fp16" (with dynamic
                               // loss scaling) or "fp32"; masters and moments are always fp32
  // How a frozen LoRA base is kept in host memory, on NVMe and on the link (dequantised on the
  // device to `dtype` just before use): "auto" (a GGUF base keeps its own block types on GPUs, or
  // on the CPU when memory is short; a Hugging Face base is not quantised), "none", "nf4"
  // (QLoRA's NormalFloat4, blocks of 64), "int8" (per output channel), "gguf" (keep the GGUF
  // file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors).
  std::string quantize = "auto";
  bool double_quant = false;  // nf4: quantise the block scales too (bitsandbytes' double quant)
};

struct DataSection {
  std::string train;                 // JSONL file
  std::string validation;            // JSONL file; "" = split off `validation_split`
  double validation_split = 0;       // share of the training examples held out, [0, 0.5]
  std::string format = "auto";       // "auto", "text", "alpaca", "chat", "sharegpt"
  std::string chat_format;           // "" = the model's own chat template
  bool train_on_everything = false;  // loss on prompts too, not only on assistant replies
  bool skip_bad_lines = false;       // count and skip bad lines instead of stopping
  std::string max_line = "16MiB";    // the longest line read; longer ones are bad lines
  std::int64_t seq_len = 1024;       // tokens per row; longer examples are truncated
  bool pack = true;                  // several examples per row, attention kept apart
  bool shuffle = true;               // a new order each epoch, from training.seed
  // Not a setting: once the data is read, the mean tokens of a training example (cut to seq_len).
  // The planner counts attention masks by it where that decides them (the CPU's and simulated
  // devices' packed rows, models::attend_per_document). 0 = not known.
  std::int64_t mean_example_tokens = 0;
};

struct LoraSection {
  int rank = 16;
  double alpha = 32;
  double dropout = 0;
  std::vector<std::string> targets = {"all-linear"};  // PEFT module names, or "all-linear"
  bool rslora = false;                                // scaling alpha / sqrt(rank)
  // A PEFT adapter folder to start from (e.g. a supervised run's adapter before a DPO run): its
  // rank, alpha and targets must be these. "" = fresh adapters (A random, B zero, as PEFT).
  std::string init_adapter;
};

struct TrainingSection {
  std::string method = "lora";  // "lora" or "full"
  // "sft" (next-token loss on the answers), or a preference objective on pairs of a chosen and a
  // rejected answer: "dpo" (with a reference: the starting weights), "orpo", "simpo"
  // (PreferenceSection; docs/preference.md).
  std::string objective = "sft";
  std::int64_t steps = 0;           // optimizer steps; 0 = from `epochs`
  double epochs = 1;                // used when steps = 0
  std::int64_t batch_rows = 1;      // rows (of seq_len tokens) per microbatch
  int grad_accum = 1;               // microbatches per optimizer step
  double lr = 2e-4;                 // peak learning rate
  std::string schedule = "cosine";  // "constant", "linear", "cosine"
  std::int64_t warmup_steps = 0;
  double min_lr_ratio = 0;  // cosine floor, as a share of lr
  double weight_decay = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;  // <= 0: no clipping
  std::uint64_t seed = 42;     // adapters' initialisation, shuffling, dropout
  // "adamw": f32 moments (8 bytes per trained parameter); "adamw_8bit": both moments in
  // bitsandbytes' blockwise 8-bit (2.03 bytes; its AdamW8bit on the CPU, bit for bit).
  std::string optimizer = "adamw";
  bool one_step_stale = false;  // RoundPipe's asynchronous update (see EngineOptions)
  // Sequence tiling: tokens per tile of the MLPs (engine::Plan::mlp_tile_tokens); -1 = the
  // planner's choice (untiled where that fits the devices), 0 = never.
  std::int64_t sequence_tile = -1;
  // Torch's deterministic algorithms (and cuBLAS's fixed workspace): what an exact resume needs on
  // a GPU, where atomics (index_add_) and some attention backwards otherwise add in a different
  // order on each run. CPU kernels are deterministic either way.
  bool deterministic = true;
};

// A preference objective's settings, TRL's names in brackets (engine/preference.h).
struct PreferenceSection {
  double beta = 0.1;             // DPO's beta (IPO's tau), ORPO's lambda, SimPO's beta
  std::string loss = "sigmoid";  // DPO: "sigmoid" or "ipo"
  double label_smoothing = 0;    // DPO sigmoid and SimPO: conservative labels, [0, 0.5)
  double gamma = 0.5;            // SimPO: target reward margin (simpo_gamma)
  double sft_weight = 0;         // SimPO: weight of the chosen answers' NLL (cpo_alpha)
  // Tokens of one sequence (prompt and answer); 0 = half of data.seq_len, so that a pair fills a
  // row. DPO drops a pair whose prompt fills it and cuts longer sequences; ORPO and SimPO cut
  // the answers.
  std::int64_t max_length = 0;
  std::int64_t sequence_tokens(std::int64_t seq_len) const {
    return max_length > 0 ? max_length : seq_len / 2;
  }
};

struct CheckpointSection {
  std::int64_t every = 0;  // steps between checkpoints; 0 = only at the end
  int keep = 2;            // newest checkpoints kept; 0 = all
};

struct EvalSection {
  std::int64_t every = 0;            // steps between validation-loss evaluations; 0 = never
  std::int64_t sample_every = 0;     // steps between sample generations; 0 = never
  std::vector<std::string> prompts;  // user messages (chat) or text to continue
  std::int64_t sample_tokens = 48;   // new tokens per sample (greedy)
};

struct HardwareSection {
  int sim_devices = 0;      // > 0: this many simulated GPUs instead of CUDA ones
  std::string memory_cap;   // per GPU, e.g. "24GB"; "" = whole device
  std::string host_memory;  // host memory the run may use, e.g. "64GB"; "" = what is free
  // A folder on an NVMe drive for the state that does not fit host_memory (frozen base weights,
  // masters and moments, activation checkpoints); "" = none: everything must fit in host memory.
  std::string offload_dir;
  std::string offload_io = "auto";  // "auto" (io_uring where it works), "io_uring", "threads"
  std::string disk_space;           // space the run may use in offload_dir, e.g. "500GB"; "" =
                                    // what is free there (a plan for another drive names its own)
  std::string disk_speed;           // offload_dir's sequential read speed for planning, e.g.
                                    // "3GB" (per second); "" = 3 GB/s (measure: rondo devices
                                    // --disk DIR)
  // The most bytes of optimizer state (masters and moments) staged at a time for one piece of a
  // layer on NVMe, e.g. "256MB"; "" = 256 MiB, less for a budget under 7.5 GiB (engine/estimate).
  std::string offload_chunk;
  // Plan for a GPU that is not in this machine (`rondo plan` only): a name from the table of
  // common cards (engine/gpus.h: "RTX 4090", "A100", ...) and how many.
  std::string gpu;
  int gpu_count = 1;
};

struct OutputSection {
  std::string run_dir;  // where the run folder goes
  // At the end: "adapter" (LoRA, PEFT), "merged" (HF folder), "gguf" (merged GGUF in Q8_0),
  // "gguf-adapter" (LoRA, llama.cpp), from either kind of base. Left out of a config file:
  // "adapter" for LoRA, "merged" for a full run, "gguf" for a full run on a GGUF base
  // (cli/config_file).
  std::vector<std::string> exports = {"adapter"};
};

// Data parallelism across processes (docs/distributed.md): how many and which rank come from the
// launcher (torchrun, Slurm) or `rondo train --nodes N --node-rank R --master HOST:PORT`.
struct DistributedSection {
  std::string backend = "gloo";  // the only one: gradients are summed in host memory, over TCP
  double timeout = 600;          // seconds a collective or the rendezvous waits for the others
  // Seconds a rank waits for the others where one works alone for long: loading the model, rank
  // 0 writing a checkpoint or samples.
  double meet_timeout = 7200;
  std::string interface;  // network interface for Gloo; "" = the one that reaches the master
  // The link between the ranks, for planning: "10Gbit" (bits per second, decimal prefixes, as
  // networks are sold) or "1.25GB" (bytes per second, as hardware.disk_speed); "" = 10 Gbit/s.
  std::string link_speed;
  // Sharded optimizer state (ZeRO-1, engine/sharding.h): each rank holds the masters and moments
  // of its share of the layers, updates them, and broadcasts their new weights.
  bool shard_optimizer = false;
  // Not keys: the run's ranks and this one, set by the session on the copy it plans with; and
  // this rank's share of the node's GPUs (DeviceSelection::share_index, share_count), set by the
  // CLI from the launcher (LOCAL_RANK of LOCAL_WORLD_SIZE) unless CUDA_VISIBLE_DEVICES is set.
  int ranks = 1, rank = 0;
  int gpu_share = 0, gpu_shares = 1;
};

// distributed.link_speed in bytes per second (10 Gbit/s when empty). Throws Error naming the key.
double link_bytes_per_s(const std::string& link_speed);

struct TrainConfig {
  ModelSection model;
  DataSection data;
  LoraSection lora;
  TrainingSection training;
  PreferenceSection preference;
  CheckpointSection checkpoint;
  EvalSection eval;
  HardwareSection hardware;
  OutputSection output;
  DistributedSection distributed;

  // Every problem, each "section.field: what is wrong (got X); what to do". Checks values only
  // (files are checked when the run opens them).
  // `planning` (`rondo plan`): data and a run folder may be left out.
  std::vector<std::string> validate(bool planning = false) const;
  models::LoraConfig lora_config() const;
};

}  // namespace rondo::engine
