// Mixture-of-experts routing: a sparse block's MLP (router, top-k, the experts), the record of one
// microbatch's routing and the router load-balancing loss from it, and experts' names and LoRA
// factors. Touches only the tensors handed to it (and a RoutingRecord under its mutex). Used by the
// block (models/layers.cpp), the engine (the aux loss) and LoRA/export (expert names, factors).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "models/config.h"

namespace rondo::models {

struct AttentionContext;  // models/attention.h
struct BlockWeights;      // models/layers.h

// One microbatch's routing, per sparse block: how many of its tokens each expert got (top-k
// selections) and the sum of each expert's router probability over the tokens. Shared by the
// microbatch's forward and backward jobs, which may run on different threads and devices.
struct BlockRouting {
  std::vector<std::int64_t> counts;  // (E) on the host
  at::Tensor prob_sums;              // (E) fp32, where the block ran (no autograd)
  std::int64_t tokens = 0;
  // The counts of each run of tokens the block routed at once, by its first token's row in the
  // flattened microbatch: the whole microbatch at 0, or each tile (AttentionContext::
  // mlp_tile_tokens). A recompute of the same rows finds them here. Tile size, counts.
  std::map<std::int64_t, std::pair<std::int64_t, std::vector<std::int64_t>>> by_row;
};
struct RoutingRecord {
  std::mutex mu;
  std::map<int, BlockRouting> blocks;  // by block index
};

// transformers' load_balancing_loss_func over every sparse block of the microbatch (all tokens,
// padding included: Rondo passes it no attention mask, as a transformers training forward without
// one): E * sum_e f_e * P_e, with f_e the share of top-k selections and P_e the mean router
// probability of expert e over all (block, token) pairs. 0 when nothing was recorded.
double router_aux_loss(const ModelConfig& config, RoutingRecord& record);
// Its gradient with respect to each block's prob_sums (the same for every block): E * counts_e /
// (sum over blocks of tokens)^2 summed over blocks, times `weight`. (E) fp32 on `device`.
at::Tensor router_aux_grad(const ModelConfig& config, RoutingRecord& record, double weight,
                           at::Device device);

// An expert's tensor by Hugging Face name (mlp.experts.3.up_proj.weight, or Mixtral's
// block_sparse_moe.experts.3.w3.weight): its expert and which projection (0 gate, 1 up, 2 down).
bool parse_expert_name(const std::string& name, std::int64_t* expert, int* projection);

// Expert `e`'s factors A_e (R, in) and B_e (out, R) of an adapter in PEFT's layout for a 3-D
// parameter of `experts` experts (BlockWeights::expert_lora_a / _b): A's rows e*R.., B's columns
// e, e+E, ...; and its delta B_e A_e (out, in), unscaled.
std::pair<at::Tensor, at::Tensor> expert_lora_factors(const at::Tensor& a, const at::Tensor& b,
                                                      std::int64_t experts, std::int64_t e);
at::Tensor expert_lora_delta(const at::Tensor& a, const at::Tensor& b, std::int64_t experts,
                             std::int64_t e);

// A sparse block's MLP on the normed hidden states `h` (..., C), as transformers computes it
// (block_forward's second half for a block with a router): records or reuses the microbatch's
// routing through ctx.routing, appends the router probability sums to ctx.router_prob_sums.
// `row`: h's first token in the microbatch's flattened tokens (a tile of them starting there adds
// its routing to the record; row 0 starts the block's record afresh).
at::Tensor moe_mlp(const ModelConfig& config, const BlockWeights& w, const at::Tensor& h,
                   const AttentionContext& ctx, std::int64_t row = 0);

}  // namespace rondo::models
