// The compute speed the planner assumes of this machine's CPU (and of simulated GPUs, which
// compute on it): measured on the model's own work, not a single moment's matmul. One block of
// the model's shape runs forward and backward under autograd on the run's microbatch (`rows` rows
// of `seq_len` tokens, cut to 1024 tokens and to 10 GFLOP a pass) after a warm-up, five times and
// for 0.4 s at least (a small block's pass takes milliseconds); the median pass gives FLOP/s in the
// planner's units (LayerSpec::flops_*_per_token; a frozen weight's backward counts half). With
// `frozen_weights` (LoRA) the backward computes input gradients only, as a LoRA run's does: its
// elementwise work stays while its matmuls halve, so it runs at a FLOP/s of its own; with `lora`
// the block carries its adapters (frozen base, trained adapters), whose small matmuls and
// elementwise passes a LoRA step pays in every block. Blocks too
// large to run quickly are measured at a narrower width with the same head size. The result is
// cached per machine (CPU model, torch's thread count) and shape in $RONDO_SPEED_CACHE (default
// $XDG_CACHE_HOME/rondo/speed, else ~/.cache/rondo/speed), so repeated `rondo plan` calls agree; an
// unwritable cache only costs the measurement. A probe disturbed by other programs is repeated,
// marked, and measured again later (Note [A probe on a busy machine] in speed.cpp).
//
//   double flops = engine::cpu_flops(config, seq_len, batch_rows, "bf16", /*frozen_weights=*/true);
#pragma once

#include <cstdint>
#include <string>

#include "models/config.h"

namespace rondo::models {
struct LoraConfig;
}  // namespace rondo::models

namespace rondo::engine {

double cpu_flops(const models::ModelConfig& config, std::int64_t seq_len, std::int64_t rows,
                 const std::string& dtype, bool frozen_weights = false,
                 const models::LoraConfig* lora = nullptr);

// The same for the head (final norm, LM head, cross-entropy: models::head_forward_backward) in the
// chunks of logits the engine computes at a time in host memory (head_chunk_tokens): a chunk of a
// few dozen rows against a large vocabulary runs its matmuls well below a block's FLOP/s (on this
// project's machine, torch's matmuls for SmolLM2's head took 1.5 times as long in chunks of 85 rows
// as in one of 512). Without
// `trained_head` its backward computes the input gradient only. A large head is measured on fewer
// vocabulary rows, in its own chunks.
double cpu_head_flops(const models::ModelConfig& config, std::int64_t seq_len, std::int64_t rows,
                      const std::string& dtype, bool trained_head);

// The optimizer's speed on this machine: parameters per second through what it does to each one a
// step (engine/optimizer.h), the gradient's sum of squares (for the global norm) and the fused
// CPU AdamW (kernels/cpu/adamw.h; f32 gradient, master and moments, the streaming copy in
// `stream_dtype`: "bf16", "fp16" or "fp32"), on this thread's oneTBB arena. Measured on arrays
// twice the size of the last-level cache (4 M to 64 M parameters): a step's optimizer state is
// read from memory, not from a cache (on this project's machine, whose virtual CPU reports a
// 480 MiB L3, 4 M parameters ran at twice the speed the optimizer then had in a step). The median
// pass after a warm-up, timed as cpu_flops is (five passes and 0.4 s at least), cached the same
// way. With `eight_bit_moments`, the 8-bit kernel (kernels/cpu/adamw8bit.h) instead.
double cpu_optimizer_params_per_s(const std::string& stream_dtype, bool eight_bit_moments = false);

// Where the cache lives (for tests and messages).
std::string speed_cache_dir();

// The share of the cores' time other programs took while the most disturbed figure this process
// used was measured, when above the probe's threshold; 0 when every figure came from a quiet
// machine (Note [A probe on a busy machine] in speed.cpp). A plan that used one says so.
double speed_probe_caveat();

// Forgets the figures this process's plans used and every other one cached for this machine (its
// CPU and thread count), so that the next plan measures again: what a run on the CPU does when its
// steps are far from the plan's. Returns how many were forgotten.
int forget_cpu_speeds();

}  // namespace rondo::engine
