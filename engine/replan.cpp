// Re-planning from measured timings (replan.h): pure arithmetic on the plan inputs.
#include "engine/replan.h"

#include <cmath>

namespace rondo::engine {

bool fold_measurements(PlanInputs& costs, const std::vector<JobSpec>& jobs,
                       const std::vector<Measurement>& measured, double threshold) {
  const std::size_t L = costs.layers.size();
  std::vector<double> f_sum(L, 0), f_n(L, 0), b_sum(L, 0), b_n(L, 0);
  for (const Measurement& m : measured) {
    const JobSpec& js = jobs.at(static_cast<std::size_t>(m.job));
    double predicted = 0;
    for (int l = js.range.begin; l < js.range.end; ++l) {
      const LayerCosts& c = costs.layers[static_cast<std::size_t>(l)];
      predicted += js.kind == JobKind::kForward ? c.forward_s_per_token
                                                : c.forward_s_per_token + c.backward_s_per_token;
    }
    const double speed = costs.devices.at(static_cast<std::size_t>(m.device)).speed;
    predicted *= static_cast<double>(m.tokens) / (speed > 0 ? speed : 1);
    if (!(predicted > 0) || !(m.seconds > 0)) continue;
    const double ratio = m.seconds / predicted;  // the job's layers all took this much longer
    for (int l = js.range.begin; l < js.range.end; ++l) {
      const auto i = static_cast<std::size_t>(l);
      f_sum[i] += ratio;
      f_n[i] += 1;
      if (js.kind != JobKind::kForward) {
        b_sum[i] += ratio;
        b_n[i] += 1;
      }
    }
  }
  bool moved = false;
  // Moves a cost half-way to what was measured (sum / n times it).
  auto update = [&](double& cost, double sum, double n) {
    if (n == 0) return;
    const double r = sum / n;
    moved = moved || std::abs(r - 1) > threshold;
    cost *= 0.5 + 0.5 * r;
  };
  for (std::size_t l = 0; l < L; ++l) {
    update(costs.layers[l].forward_s_per_token, f_sum[l], f_n[l]);
    update(costs.layers[l].backward_s_per_token, b_sum[l], b_n[l]);
  }
  return moved;
}

std::optional<Plan> replan(PlanInputs& costs, const Plan& current, const std::vector<JobSpec>& jobs,
                           const std::vector<Measurement>& measured, double threshold,
                           bool checkpoints_spill) {
  if (!fold_measurements(costs, jobs, measured, threshold)) return std::nullopt;
  Plan next = plan_ours(costs);
  if (next.describe() == current.describe()) return std::nullopt;
  // Checkpoints on the NVMe tier have the space the first plan's need (the planner's); a plan
  // that saves more would keep the excess in host memory the planner did not count.
  if (checkpoints_spill &&
      next.checkpointed_layers().size() > current.checkpointed_layers().size())
    return std::nullopt;
  return next;
}

}  // namespace rondo::engine
