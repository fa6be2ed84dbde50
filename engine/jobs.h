// A plan's jobs: what each job of a step runs (forward stages, the fused tail, backward stages;
// for evaluation the forward stages and a loss job over the tail's layers), which layers' weights
// it streams and which block inputs the forward saves for the backward. Pure: no threads, no
// devices; the pipeline (pipeline.h) runs the list, job g of a segment being jobs[g % J].
//
//   JobList jobs = make_jobs(plan, store, /*evaluation=*/false);
//   for (const JobSpec& js : jobs.jobs) std::puts(js.name.c_str());  // F0 F1 T B1 B2
#pragma once

#include <set>
#include <string>
#include <vector>

#include "engine/plan.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// kEval: evaluation's last job, forward through the tail's layers to the loss sum (no backward).
enum class JobKind { kForward, kTail, kBackward, kEval };

// Whether a job of this kind runs forward only (no backward, no gradients).
inline bool forward_only(JobKind kind) {
  return kind == JobKind::kForward || kind == JobKind::kEval;
}

struct JobSpec {
  JobKind kind = JobKind::kForward;
  LayerRange range;
  std::string name;           // "F0", "T", "B1", "E"
  std::vector<int> streamed;  // layers whose streaming copies the job needs (tied owners too)
  bool has_output = false;    // hands a tensor to the next job of the step
  std::int64_t mlp_tile_tokens = 0;  // sequence tiling (Plan::mlp_tile_tokens)
};

struct JobList {
  std::vector<JobSpec> jobs;   // J of them, in the order of a step
  std::set<int> checkpointed;  // blocks whose inputs the forward saves for the backward
  std::size_t size() const { return jobs.size(); }
  const JobSpec& operator[](std::size_t j) const { return jobs[j]; }
};

// The layers whose streaming copies a job over `range` needs: its own and their tied owners.
std::vector<int> streamed_layers(const offload::LayerStore& store, LayerRange range);

// Training's jobs (forward stages, fused tail, backward stages) or, for evaluation, the forward
// stages and an evaluation job over the tail's layers (no checkpoints: nothing runs backward).
JobList make_jobs(const Plan& plan, const offload::LayerStore& store, bool evaluation);

}  // namespace rondo::engine
