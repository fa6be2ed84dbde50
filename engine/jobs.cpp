// A plan's jobs (jobs.h): the list a segment runs, derived from the plan and the store's ties.
#include "engine/jobs.h"

#include <utility>

namespace rondo::engine {

std::vector<int> streamed_layers(const offload::LayerStore& store, LayerRange range) {
  std::set<int> layers;
  for (int l = range.begin; l < range.end; ++l) {
    layers.insert(l);
    for (const offload::TensorState& t : store.layer(static_cast<std::size_t>(l)))
      if (t.tied) layers.insert(t.owner_layer);
  }
  return {layers.begin(), layers.end()};
}

JobList make_jobs(const Plan& plan, const offload::LayerStore& store, bool evaluation) {
  JobList out;
  auto add = [&](JobKind kind, LayerRange r, std::string name) {
    out.jobs.push_back({.kind = kind,
                        .range = r,
                        .name = std::move(name),
                        .streamed = streamed_layers(store, r),
                        .mlp_tile_tokens = plan.mlp_tile_tokens});
  };
  for (std::size_t i = 0; i < plan.forward.size(); ++i)
    add(JobKind::kForward, plan.forward[i], "F" + std::to_string(i));
  if (evaluation) {
    add(JobKind::kEval, plan.tail, "E");
    for (JobSpec& js : out.jobs)
      js.has_output = js.kind == JobKind::kForward;
    return out;
  }
  add(JobKind::kTail, plan.tail, "T");
  for (std::size_t i = 0; i < plan.backward.size(); ++i)
    add(JobKind::kBackward, plan.backward[i], "B" + std::to_string(i + 1));
  // Forward stages feed the next stage (or the tail); the tail and backward stages feed the next
  // backward stage unless they reach the prefix.
  for (JobSpec& js : out.jobs)
    js.has_output = js.kind == JobKind::kForward || js.range.begin > 0;
  out.checkpointed = plan.checkpointed_layers();
  return out;
}

}  // namespace rondo::engine
