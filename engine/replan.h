// Re-planning from measured timings, as a pure function: the jobs' measured device times fold
// into the per-layer costs the plan was made from (each cost moves half-way to what was
// measured), and when some layer's cost moved by more than a threshold the planner is asked
// again. The engine calls it between segments (EngineOptions::replan_every); no threads here.
//
//   std::vector<Measurement> ms = ...;               // one per job run in the last segment
//   if (std::optional<Plan> next = replan(costs, plan, jobs.jobs, ms, 0.2, false)) plan = *next;
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/jobs.h"
#include "engine/plan.h"

namespace rondo::engine {

// One job's measured device time: job j of the segment's list on device d, over `tokens` tokens.
struct Measurement {
  int job = 0, device = 0;
  double seconds = 0;
  std::int64_t tokens = 0;
};

// Folds `measured` into costs.layers: each layer of a measured job gets the ratio of measured to
// predicted time (predicted from the costs, the job's tokens and its device's speed), and its
// forward cost (and, for a job with a backward, its backward cost) moves half-way to the cost that
// ratio gives (the mean ratio over the jobs that ran it). Returns whether some layer's ratio was
// off 1 by more than `threshold`.
bool fold_measurements(PlanInputs& costs, const std::vector<JobSpec>& jobs,
                       const std::vector<Measurement>& measured, double threshold);

// fold_measurements, then the plan to switch to: plan_ours(costs) when a cost moved enough and
// that plan differs from `current`; never one that checkpoints more layers than `current` when
// checkpoints go to the NVMe tier (`checkpoints_spill`: their space there was sized for the
// current plan). nullopt: keep the current plan.
std::optional<Plan> replan(PlanInputs& costs, const Plan& current, const std::vector<JobSpec>& jobs,
                           const std::vector<Measurement>& measured, double threshold,
                           bool checkpoints_spill);

}  // namespace rondo::engine
