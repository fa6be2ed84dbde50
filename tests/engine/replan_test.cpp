// Re-planning from measured timings as a pure function (engine/replan.h): how measured job times
// move the per-layer costs (worked out by hand below), when they are enough to ask the planner
// again, and the NVMe guard. No threads, no devices.
#include "engine/replan.h"

#include <gtest/gtest.h>

#include "engine/jobs.h"

namespace rondo::engine {
namespace {

PlanInputs uniform(int layers, int devices, double f, double b) {
  PlanInputs in;
  for (int l = 0; l < layers; ++l)
    in.layers.push_back({.forward_s_per_token = f, .backward_s_per_token = b});
  for (int d = 0; d < devices; ++d)
    in.devices.push_back({.memory_cap = 1ull << 30});
  in.tokens_per_step = 80;
  in.microbatches = 2;
  return in;
}

// F[0,2) T[2,4) B[0,2): job 0 forward, job 1 the tail, job 2 backward.
std::vector<JobSpec> three_jobs() {
  return {{.kind = JobKind::kForward, .range = {0, 2}, .name = "F0"},
          {.kind = JobKind::kTail, .range = {2, 4}, .name = "T"},
          {.kind = JobKind::kBackward, .range = {0, 2}, .name = "B1"}};
}

TEST(Replan, MeasuredTimesMoveCostsHalfWay) {
  PlanInputs costs = uniform(4, 2, 1e-3, 2e-3);
  costs.devices[1].speed = 2;
  // F0 over 10 tokens on device 0: predicted (1e-3 + 1e-3) * 10 = 0.02 s; measured 0.04 (ratio 2).
  // T over 10 tokens on device 1 (speed 2): predicted (3e-3 + 3e-3) * 10 / 2 = 0.03 s; measured
  // 0.03 (ratio 1). B1 over 10 tokens on device 0: predicted 0.06 s; measured 0.09 (ratio 1.5).
  const std::vector<Measurement> ms = {{.job = 0, .device = 0, .seconds = 0.04, .tokens = 10},
                                       {.job = 1, .device = 1, .seconds = 0.03, .tokens = 10},
                                       {.job = 2, .device = 0, .seconds = 0.09, .tokens = 10}};
  EXPECT_TRUE(fold_measurements(costs, three_jobs(), ms, 0.2));
  // Layers 0, 1: forward ratios 2 (F0) and 1.5 (B1), mean 1.75, half-way: x 1.375; backward ratio
  // 1.5 (B1 only): x 1.25. Layers 2, 3: ratio 1, unchanged.
  for (int l : {0, 1}) {
    EXPECT_DOUBLE_EQ(costs.layers[l].forward_s_per_token, 1e-3 * 1.375) << l;
    EXPECT_DOUBLE_EQ(costs.layers[l].backward_s_per_token, 2e-3 * 1.25) << l;
  }
  for (int l : {2, 3}) {
    EXPECT_DOUBLE_EQ(costs.layers[l].forward_s_per_token, 1e-3) << l;
    EXPECT_DOUBLE_EQ(costs.layers[l].backward_s_per_token, 2e-3) << l;
  }
}

TEST(Replan, SmallDriftMovesCostsButAsksNoPlan) {
  PlanInputs costs = uniform(4, 1, 1e-3, 2e-3);
  // Ratio 1.1 on F0, under a threshold of 0.2: the costs still move (x 1.05), nothing more.
  const std::vector<Measurement> ms = {{.job = 0, .device = 0, .seconds = 0.022, .tokens = 10}};
  EXPECT_FALSE(fold_measurements(costs, three_jobs(), ms, 0.2));
  EXPECT_DOUBLE_EQ(costs.layers[0].forward_s_per_token, 1e-3 * 1.05);
  // A measurement of nothing (no time, or no tokens) is left out.
  PlanInputs before = costs;
  EXPECT_FALSE(fold_measurements(
      costs, three_jobs(), {{.job = 0, .device = 0, .seconds = 0, .tokens = 10},
                            {.job = 2, .device = 0, .seconds = 1.0, .tokens = 0}},
      0.2));
  for (std::size_t l = 0; l < costs.layers.size(); ++l) {
    EXPECT_EQ(costs.layers[l].forward_s_per_token, before.layers[l].forward_s_per_token);
    EXPECT_EQ(costs.layers[l].backward_s_per_token, before.layers[l].backward_s_per_token);
  }
}

// Measurements that say one block is eight times slower than assumed: the plan replan() gives is
// predicted faster on the true costs than the plan in use; measurements as assumed give none.
TEST(Replan, ASlowBlockGivesAFasterPlan) {
  const int L = 8;
  PlanInputs assumed = uniform(L, 2, 1e-3 / 40, 2e-3 / 40);
  assumed.layers[0].forward_s_per_token *= 0.25;
  assumed.layers[L - 1].forward_s_per_token *= 0.25;
  PlanInputs actual = assumed;
  actual.layers[4].forward_s_per_token *= 8;
  actual.layers[4].backward_s_per_token *= 8;
  const Plan current = plan_ours(assumed);
  std::vector<JobSpec> jobs;
  for (std::size_t i = 0; i < current.forward.size(); ++i)
    jobs.push_back({.kind = JobKind::kForward, .range = current.forward[i]});
  jobs.push_back({.kind = JobKind::kTail, .range = current.tail});
  for (const LayerRange& r : current.backward)
    jobs.push_back({.kind = JobKind::kBackward, .range = r});
  // Each job measured as the true costs say, on device j % 2, for 40 tokens.
  auto measure = [&](const PlanInputs& truth) {
    std::vector<Measurement> ms;
    for (std::size_t j = 0; j < jobs.size(); ++j) {
      double s = 0;
      for (int l = jobs[j].range.begin; l < jobs[j].range.end; ++l)
        s += truth.layers[l].forward_s_per_token +
             (jobs[j].kind == JobKind::kForward ? 0 : truth.layers[l].backward_s_per_token);
      ms.push_back({.job = static_cast<int>(j), .device = static_cast<int>(j % 2),
                    .seconds = s * 40, .tokens = 40});
    }
    return ms;
  };
  PlanInputs as_assumed = assumed;
  EXPECT_FALSE(replan(as_assumed, current, jobs, measure(assumed), 0.2, false).has_value());
  PlanInputs costs = assumed;
  const std::optional<Plan> next = replan(costs, current, jobs, measure(actual), 0.2, false);
  ASSERT_TRUE(next.has_value());
  EXPECT_NE(next->describe(), current.describe());
  EXPECT_LT(predict(*next, actual).step_time_s, predict(current, actual).step_time_s)
      << current.describe() << " -> " << next->describe();
  // The costs moved towards the truth (a job's ratio is shared by all its layers, so layer 4's
  // neighbours in its jobs moved too, but less).
  const double moved4 = costs.layers[4].forward_s_per_token / assumed.layers[4].forward_s_per_token;
  EXPECT_GT(moved4, 1.5);
  EXPECT_LT(moved4, 4.5);
  for (int l : {1, 2, 6})
    EXPECT_LT(costs.layers[l].forward_s_per_token / assumed.layers[l].forward_s_per_token, moved4)
        << l;
}

// With checkpoints on the NVMe tier (sized for the plan in use), a plan that saves more block
// inputs is not taken.
TEST(Replan, CheckpointsOnNvmeKeepAPlanThatWouldSaveMore) {
  const int L = 6;
  PlanInputs costs = uniform(L, 2, 1e-3 / 40, 2e-3 / 40);
  const Plan one_tail{{}, {0, L}, {}, 2, RecomputeGrain::kStage};  // saves nothing
  const std::vector<JobSpec> jobs = {{.kind = JobKind::kTail, .range = {0, L}, .name = "T"}};
  const std::vector<Measurement> slow = {{.job = 0, .device = 0, .seconds = 1.0, .tokens = 40}};
  PlanInputs free_costs = costs;
  const std::optional<Plan> free = replan(free_costs, one_tail, jobs, slow, 0.2, false);
  ASSERT_TRUE(free.has_value());
  ASSERT_GT(free->checkpointed_layers().size(), 0u) << free->describe();
  EXPECT_FALSE(replan(costs, one_tail, jobs, slow, 0.2, /*checkpoints_spill=*/true).has_value());
}

}  // namespace
}  // namespace rondo::engine
