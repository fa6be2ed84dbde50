// What a run's estimate adds to its plan's steps (estimate.h): on several ranks (add_ranks;
// docs/distributed.md, "Planning"), one rank's planned share of a step and the gradients' sums
// across the ranks over their link; DPO's reference pass before step 1 (add_reference_pass).
#include <algorithm>

#include "engine/estimate.h"
#include "engine/ranks.h"
#include "engine/sharding.h"

namespace rondo::engine {

void shard_placement(Placement& pl, const DistributedSection& d) {
  if (!d.shard_optimizer || d.ranks <= 1) return;
  pl.optimizer_owners = optimizer_owners(pl.layers, d.ranks);
  pl.ranks = d.ranks;
  pl.rank = d.rank;
  shard_layers(pl.layers, pl.optimizer_owners, pl.rank);
}

void add_ranks(RunEstimate& e, int ranks, double link_bytes_per_s, const std::string& source) {
  e.ranks = ranks;
  e.link_bytes_per_s = link_bytes_per_s;
  e.link_speed_source = source;
  if (ranks <= 1 || e.prediction.step_time_s <= 0 || link_bytes_per_s <= 0) return;
  e.gradient_bytes = static_cast<double>(e.trained_params) * sizeof(float);  // fp32, host memory
  const double share = 2.0 * (ranks - 1) / ranks / link_bytes_per_s;
  e.allreduce_s = e.gradient_bytes * share;
  const double last = std::min(e.gradient_bytes, static_cast<double>(kGradientBucketBytes)) * share;
  e.step_time_one_rank_s = e.prediction.step_time_s;
  if (!e.placement.optimizer_owners.empty()) {
    e.broadcast_bytes = static_cast<double>(e.placement.host_part[1] + e.placement.nvme_part[1]);
    e.broadcast_s = e.broadcast_bytes * (ranks - 1) / ranks / link_bytes_per_s;
  }
  const double step = std::max(e.step_time_one_rank_s, e.allreduce_s) + last + e.broadcast_s;
  e.step_time_ranks_s = step;
  e.tokens_per_step *= ranks;
  e.tokens_per_s = static_cast<double>(e.tokens_per_step) / step;
  e.seconds = step * static_cast<double>(e.steps);
}

void add_reference_pass(RunEstimate& e, std::int64_t tokens) {
  e.reference_tokens = tokens;
  if (tokens <= 0 || e.prediction.step_time_s <= 0 || e.inputs.tokens_per_step <= 0) return;
  // A step runs each layer's forward, the backward's recompute of it (all but the tail's) and its
  // backward: about 2f + b. The pass runs f alone, on as many tokens as it scores.
  double forward = 0, step = 0;
  for (const LayerCosts& l : e.inputs.layers) {
    forward += l.forward_s_per_token;
    step += 2 * l.forward_s_per_token + l.backward_s_per_token;
  }
  if (step <= 0) return;
  e.reference_s = e.prediction.step_time_s * forward / step * static_cast<double>(tokens) /
                  static_cast<double>(e.inputs.tokens_per_step);
  e.seconds += e.reference_s;
}

}  // namespace rondo::engine
