// Plans: validation, RoundPipe's partitioner on a case worked out by hand from
// docs/architecture.md §3.2, the schedule simulation against closed-form step times, and our
// partitioner's guarantees (never predicted slower than the reference, fits memory or says what
// would).
#include "engine/plan.h"

#include <gtest/gtest.h>

#include <cmath>

#include "engine/inference.h"
#include "kernels/error.h"

namespace rondo::engine {
namespace {

PlanInputs uniform(int layers, int devices, double f, double b, int M, std::int64_t tokens) {
  PlanInputs in;
  for (int l = 0; l < layers; ++l)
    in.layers.push_back({.forward_s_per_token = f, .backward_s_per_token = b});
  for (int d = 0; d < devices; ++d)
    in.devices.push_back({});
  in.microbatches = M;
  in.tokens_per_step = tokens;
  return in;
}

TEST(Plan, ValidPlansPassAndBrokenOnesAreExplained) {
  Plan ok{{{0, 3}, {3, 7}}, {7, 8}, {{6, 7}, {0, 6}}, 2, RecomputeGrain::kStage};
  EXPECT_TRUE(ok.problems(8).empty());
  EXPECT_EQ(ok.describe(), "F[0,3) F[3,7) T[7,8) B[6,7) B[0,6) M=2 stage");
  EXPECT_EQ(ok.jobs(), 5);

  Plan gap = ok;
  gap.forward[1] = {4, 7};
  EXPECT_FALSE(gap.problems(8).empty());
  Plan short_tail = ok;
  EXPECT_FALSE(short_tail.problems(9).empty());  // the tail must reach the last layer
  Plan backward_short = ok;
  backward_short.backward[1] = {1, 6};
  auto p = backward_short.problems(8);
  ASSERT_FALSE(p.empty());
  EXPECT_NE(p.back().find("not 0"), std::string::npos) << p.back();
  Plan no_mb = ok;
  no_mb.microbatches = 0;
  EXPECT_FALSE(no_mb.problems(8).empty());
  Plan all_tail{{}, {0, 8}, {}, 1, RecomputeGrain::kStage};
  EXPECT_TRUE(all_tail.problems(8).empty());
}

TEST(PlanReference, PacksAsRoundPipeDescribes) {
  // 8 layers, forward 1, backward 3 (so recompute + backward = 4), no memory limit.
  // By hand (docs/architecture.md §3.2): W = 4; candidate budgets in [4, 4.4] are only 4. Tail:
  // from the top while sum(f + b) <= 4: layer 7 alone. Forward, from layer 6 down, sum(f) <= 4:
  // [3,7), then [0,3); reversed. Backward, from layer 0 up, sum(f + b) <= 4: single layers,
  // descending.
  PlanInputs in = uniform(8, 4, 1.0, 3.0, 5, 100);
  Plan plan = plan_reference(in);
  EXPECT_EQ(plan.describe(),
            "F[0,3) F[3,7) T[7,8) B[6,7) B[5,6) B[4,5) B[3,4) B[2,3) B[1,2) B[0,1) M=5 stage");
}

TEST(Predict, OneDeviceWithoutLinkCostsIsTheSumOfCompute) {
  PlanInputs in = uniform(6, 1, 2e-3, 5e-3, 3, 300);
  Plan plan{{{0, 2}, {2, 4}}, {4, 6}, {{2, 4}, {0, 2}}, 3, RecomputeGrain::kStage};
  PlanPrediction p = predict(plan, in);
  // Forward layers 0-3 once (f), tail 4-5 (f + b), backward 0-3 (recompute f + b), all tokens.
  double expect = 300 * (4 * 2e-3 + 2 * 7e-3 + 4 * 7e-3);
  EXPECT_NEAR(p.step_time_s, expect, 1e-9);
  EXPECT_NEAR(p.idle_fraction, 0.0, 1e-9);
  EXPECT_TRUE(p.fits);
}

// docs/architecture.md §3.3: N = 4, M = 5, eight jobs of equal length
// (F0 F1 F2 T B1 B2 B3 B4). Five layers with costs chosen so that every job is one unit:
// F0 = f0 + f1, F1 = f2, F2 = f3, T = f4 + b4, B = f + b of one layer each; a unit is a
// microbatch of 100 tokens at 1e-3 s per token, 0.1 s, so each job takes 0.5 s per step.
struct RoundRobinCase {
  PlanInputs in = uniform(5, 4, 0, 0, 5, 500);
  Plan plan{{{0, 2}, {2, 3}, {3, 4}},
            {4, 5},
            {{3, 4}, {2, 3}, {1, 2}, {0, 1}},
            5,
            RecomputeGrain::kStage};
  RoundRobinCase() {
    const double u = 1e-3;
    const double f[] = {0.5, 0.5, 1, 1, 0.5}, b[] = {0.5, 0.5, 0, 0, 0.5};
    for (int l = 0; l < 5; ++l) {
      in.layers[l].forward_s_per_token = f[l] * u;
      in.layers[l].backward_s_per_token = b[l] * u;
    }
  }
};

TEST(Predict, RoundRobinKeepsDevicesBusyWhenMicrobatchesCoverDevices) {
  // Every device stays busy after the first fill.
  const RoundRobinCase c;
  ASSERT_TRUE(c.plan.problems(5).empty());
  PlanPrediction p = predict(c.plan, c.in);
  // Eight jobs of 0.5 s per step over four devices: 1 s, if nobody waits.
  EXPECT_NEAR(p.step_time_s, 1.0, 1e-9);
  EXPECT_NEAR(p.idle_fraction, 0.0, 1e-9);
}

TEST(Predict, DevicesSharingTheCoresTakeTurns) {
  // The same jobs on simulated GPUs that share the CPU's cores: one compute at a time, so the
  // step is all eight jobs end to end.
  RoundRobinCase c;
  c.in.shared_compute = true;
  EXPECT_NEAR(predict(c.plan, c.in).step_time_s, 4.0, 1e-9);
}

TEST(Predict, ExactSynchronyMakesTheNextForwardWaitForItsGradients) {
  PlanInputs in = uniform(4, 2, 1e-3, 1e-3, 2, 200);
  for (auto& l : in.layers)
    l.grad_bytes = 1000;
  Plan plan{{{0, 2}}, {2, 4}, {{0, 2}}, 2, RecomputeGrain::kStage};
  PlanPrediction sync = predict(plan, in);
  in.one_step_stale = true;
  PlanPrediction stale = predict(plan, in);
  // Synchronous: each step is the whole chain F -> T -> B (0.4 + 0.8 + 0.8 s of work, pipelined
  // over 2 microbatches only inside adjacent jobs); stale overlaps steps.
  EXPECT_GT(sync.step_time_s, stale.step_time_s);
  EXPECT_GE(sync.step_time_s, 200 * (2 * 1e-3 + 2 * 2e-3 + 2 * 2e-3) / 2 - 1e-9);
}

TEST(Predict, TheCpuOptimizerUpdatesLayerByLayerBeforeTheirNextUpload) {
  // One device, no link costs, 200 tokens a step: F[0,2) takes 200 x 2 x 1 ms = 0.4 s, T[2,4)
  // and B[0,2) 200 x 2 x 3 ms = 1.2 s each: 2.8 s a step with a free optimizer. At 1 ms per
  // gradient byte (1000 bytes a layer), the optimizer starts once B has brought the step's last
  // gradients home and updates layers 0, 1, 2, 3 a second each: the next F waits 2 s for its
  // layers, its T the full 4 s (F's 0.4 s hides under the update), then T and B: 6.4 s a step.
  PlanInputs in = uniform(4, 1, 1e-3, 2e-3, 2, 200);
  for (auto& l : in.layers)
    l.grad_bytes = 1000;
  const Plan plan{{{0, 2}}, {2, 4}, {{0, 2}}, 2, RecomputeGrain::kStage};
  EXPECT_NEAR(predict(plan, in).step_time_s, 2.8, 1e-9);
  in.optimizer_s_per_grad_byte = 1e-3;
  EXPECT_NEAR(predict(plan, in).step_time_s, 6.4, 1e-9);
  // One step stale, the update of step s overlaps step s + 1: less than compute plus update, not
  // less than the compute.
  in.one_step_stale = true;
  const double stale = predict(plan, in).step_time_s;
  EXPECT_LT(stale, 6.4 - 1);
  EXPECT_GE(stale, 2.8);
}

TEST(Predict, ALinkBoundStepIsTheBytesOverTheBandwidth) {
  // One device, no compute: the upload link is the only resource. Per step it carries each job's
  // weights (F[0,1), T[1,2), B[0,1): 3 x P) and the step's tokens once (8 bytes per token): the
  // backward stage B[0,1) starts from them too, and they are on the device already (nothing is
  // checkpointed for it). Nothing stays idle, so the step takes exactly those bytes over the
  // bandwidth.
  PlanInputs in = uniform(2, 1, 0, 0, 2, 1000);
  const double P = 1e8, bw = 1e9;
  for (auto& l : in.layers)
    l.param_bytes = static_cast<std::uint64_t>(P);
  in.devices[0].link_bytes_per_s = bw;
  Plan plan{{{0, 1}}, {1, 2}, {{0, 1}}, 2, RecomputeGrain::kStage};
  PlanPrediction p = predict(plan, in);
  EXPECT_NEAR(p.step_time_s, (3 * P + 8 * 1000) / bw, 1e-12);
}

TEST(Predict, CheckpointsComeBackOnlyAfterTheyWentDown) {
  // Two devices, zero compute, layer grain: the backward stage's saved inputs of layer 1 must be
  // downloaded (by the forward) before they can be uploaded again, so a larger checkpoint makes
  // the step longer by at least its download and upload.
  PlanInputs in = uniform(3, 2, 0, 0, 1, 1000);
  for (auto& d : in.devices)
    d.link_bytes_per_s = 1e9;
  Plan plan{{{0, 2}}, {2, 3}, {{0, 2}}, 1, RecomputeGrain::kLayer};
  in.layers[0].output_bytes_per_token = 1000;  // the input of layer 1: 1 MB per step
  PlanPrediction small = predict(plan, in);
  in.layers[0].output_bytes_per_token = 100000;  // 100 MB
  PlanPrediction large = predict(plan, in);
  EXPECT_GE(large.step_time_s - small.step_time_s, 2 * (1e8 - 1e6) / 1e9 - 1e-9);
}

TEST(Predict, ASlowerDeviceSlowsTheStep) {
  PlanInputs in = uniform(8, 4, 1e-3, 2e-3, 5, 500);
  Plan plan = plan_reference(in);
  PlanPrediction fast = predict(plan, in);
  in.devices[1].speed = 0.5;
  PlanPrediction slow = predict(plan, in);
  EXPECT_GT(slow.step_time_s, fast.step_time_s);
}

PlanInputs pcie_bound() {
  // Big layers on a slow link: streaming weights costs more than computing with them.
  PlanInputs in = uniform(12, 4, 2e-6, 4e-6, 5, 4000);
  for (auto& l : in.layers) {
    l.param_bytes = 200ull << 20;
    l.grad_bytes = 0;  // LoRA-like: frozen base
    l.output_bytes_per_token = 8192;
    l.activation_bytes_per_token = 65536;
  }
  for (auto& d : in.devices) {
    d.link_bytes_per_s = 2e9;
    d.memory_cap = 24ull << 30;
  }
  return in;
}

TEST(PlanOurs, ReturnsAValidPlanThatFits) {
  for (PlanInputs in : {pcie_bound(), uniform(10, 3, 1e-3, 2e-3, 4, 400)}) {
    Plan ours = plan_ours(in);
    EXPECT_TRUE(ours.problems(static_cast<int>(in.layers.size())).empty());
    PlanPrediction po = predict(ours, in);
    EXPECT_TRUE(po.fits) << po.why_not;
    for (std::size_t d = 0; d < in.devices.size(); ++d) {
      if (in.devices[d].memory_cap) {
        EXPECT_LE(po.peak_bytes[d], in.devices[d].memory_cap);
      }
    }
  }
}

TEST(PlanOurs, StreamingCostsChangeTheCut) {
  // Layers of equal compute but very unequal size (think embedding and LM head against blocks):
  // the reference balances compute and so lumps big layers together; with the link as the
  // bottleneck that leaves some jobs far longer than others. Ours balances max(compute, bytes /
  // bandwidth) and must predict a step at least 10% shorter.
  PlanInputs in = pcie_bound();
  for (std::size_t l = 0; l < in.layers.size(); ++l)
    in.layers[l].param_bytes = (l % 4 == 0 ? 600ull : 40ull) << 20;
  Plan ours = plan_ours(in), reference = plan_reference(in);
  PlanPrediction po = predict(ours, in), pr = predict(reference, in);
  EXPECT_LT(po.step_time_s, 0.9 * pr.step_time_s)
      << "ours " << ours.describe() << " (" << po.step_time_s << " s) vs reference "
      << reference.describe() << " (" << pr.step_time_s << " s)";
}

// One GPU of a 24 GB card, a model shaped like the first GPU run's (docs/measurements/gpu.md):
// 30 layers of about 120 MB of bf16 weights, LoRA-like (no weight gradients), 8 microbatches of
// 4096 tokens.
PlanInputs one_gpu(std::uint64_t cap) {
  PlanInputs in = uniform(30, 1, 1e-10, 2e-10, 8, 8 * 4096);
  for (auto& l : in.layers) {
    l.param_bytes = 120ull << 20;
    l.grad_bytes = 0;
    l.output_bytes_per_token = 4096;
    l.activation_bytes_per_token = 200000;  // with the (H, T, T) attention probabilities
  }
  in.devices[0].memory_cap = cap;
  in.devices[0].link_bytes_per_s = 50e9;
  return in;
}

TEST(PlanOurs, WithMemoryToSpareItRecomputesNothing) {
  // 30 layers of 0.8 GB of activations per microbatch and 3.6 GB of weights: the whole graph
  // fits a 48 GB device, so the fastest plan is the plain loop's: one fused tail, no forward
  // stages, no recompute. RoundPipe's balanced packing recomputes almost every layer.
  PlanInputs in = one_gpu(48ull << 30);
  Plan ours = plan_ours(in), reference = plan_reference(in);
  EXPECT_TRUE(ours.forward.empty()) << ours.describe();
  EXPECT_TRUE(ours.backward.empty()) << ours.describe();
  EXPECT_EQ(ours.tail.begin, 0) << ours.describe();
  PlanPrediction po = predict(ours, in), pr = predict(reference, in);
  EXPECT_TRUE(po.fits) << po.why_not;
  EXPECT_FALSE(reference.forward.empty()) << reference.describe();
  // No recompute saves one forward in (forward + recompute + backward) = 1 of 4 time units.
  EXPECT_LT(po.step_time_s, 0.8 * pr.step_time_s)
      << "ours " << ours.describe() << " (" << po.step_time_s << " s) vs reference "
      << reference.describe() << " (" << pr.step_time_s << " s)";
}

TEST(PlanOurs, WithSomeMemoryToSpareTheTailGrowsAndStillFits) {
  // 12 GB: the whole graph (3.6 + 24 GB) does not fit, a part of it does. The tail takes what
  // fits; every job stays within the cap.
  PlanInputs in = one_gpu(12ull << 30);
  Plan ours = plan_ours(in), reference = plan_reference(in);
  PlanPrediction po = predict(ours, in), pr = predict(reference, in);
  EXPECT_TRUE(po.fits) << po.why_not;
  EXPECT_LE(po.peak_bytes[0], in.devices[0].memory_cap);
  EXPECT_FALSE(ours.forward.empty()) << ours.describe();
  EXPECT_GT(ours.tail.end - ours.tail.begin, reference.tail.end - reference.tail.begin)
      << "ours " << ours.describe() << ", reference " << reference.describe();
  EXPECT_LT(po.step_time_s, pr.step_time_s);
}

// The head's backward holds memory beyond its per-token activations (its logit chunk, in full
// fine-tuning the LM head's fp32 gradient). A plan that fits only when that is left out no longer
// claims to fit, and the planner finds one that fits with it.
TEST(PlanOurs, TransientsOfTheHeadCountAgainstTheCap) {
  PlanInputs in = one_gpu(48ull << 30);
  const Plan whole = plan_ours(in);  // everything in one fused tail (as above)
  const PlanPrediction before = predict(whole, in);
  ASSERT_TRUE(before.fits) << before.why_not;
  ASSERT_TRUE(whole.forward.empty()) << whole.describe();
  const std::uint64_t transient = in.devices[0].memory_cap - before.peak_bytes[0] + (1ull << 30);
  in.layers.back().transient_bytes = transient;
  const PlanPrediction after = predict(whole, in);
  EXPECT_EQ(after.peak_bytes[0], before.peak_bytes[0] + transient);  // counted once
  EXPECT_FALSE(after.fits);
  const Plan now = plan_ours(in);
  const PlanPrediction pn = predict(now, in);
  EXPECT_TRUE(pn.fits) << pn.why_not;
  EXPECT_LE(pn.peak_bytes[0], in.devices[0].memory_cap);
  EXPECT_NE(now.describe(), whole.describe());
}

// A step's inputs (tokens, targets, rotary tables, masks) sit on every device that runs a job of
// the step, for the whole step, two steps at a time: on each device's peak.
TEST(Predict, AStepsInputsCountOnEveryDevice) {
  PlanInputs in = uniform(6, 2, 1e-6, 2e-6, 2, 512);
  const Plan plan{{{0, 2}}, {2, 6}, {{0, 2}}, 2, RecomputeGrain::kStage};
  const PlanPrediction before = predict(plan, in);
  in.input_bytes_per_token = 4096 + 40;
  const PlanPrediction after = predict(plan, in);
  for (std::size_t d = 0; d < in.devices.size(); ++d)
    EXPECT_EQ(after.peak_bytes[d], before.peak_bytes[d] + 2 * 512 * (4096 + 40)) << d;
}

TEST(Predict, MasksCountForTheRunningMicrobatchOnly) {
  // 512 tokens a step in 2 microbatches: a job holds the step's inputs (two steps of them) but
  // builds the masks of one microbatch at a time, 256 tokens x 4096 bytes.
  PlanInputs in = uniform(6, 2, 1e-6, 2e-6, 2, 512);
  const Plan plan{{{0, 2}}, {2, 6}, {{0, 2}}, 2, RecomputeGrain::kStage};
  const PlanPrediction before = predict(plan, in);
  in.mask_bytes_per_token = 4096;
  const PlanPrediction after = predict(plan, in);
  for (std::size_t d = 0; d < in.devices.size(); ++d)
    EXPECT_EQ(after.peak_bytes[d], before.peak_bytes[d] + 256 * 4096) << d;
}

TEST(PlanOurs, WhenNothingFitsItSaysWhatWould) {
  PlanInputs in = pcie_bound();
  for (auto& l : in.layers)
    l.activation_bytes_per_token = 4ull << 20;  // 4 MiB per token
  for (auto& d : in.devices)
    d.memory_cap = 2ull << 30;
  try {
    plan_ours(in);
    FAIL() << "a plan was returned although activations cannot fit";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("no plan fits"), std::string::npos) << msg;
    EXPECT_NE(msg.find("would fit"), std::string::npos) << msg;
    EXPECT_NE(msg.find("microbatches"), std::string::npos) << msg;
  }
}

TEST(PlanInputs, ProblemsAreListed) {
  PlanInputs in;
  EXPECT_GE(in.problems().size(), 3u);
  EXPECT_THROW(plan_reference(in), Error);
  // A measured bandwidth of NaN (0/0) must be refused, not loop forever in the simulation.
  PlanInputs nan = uniform(4, 2, 1e-3, 1e-3, 2, 100);
  nan.devices[1].link_bytes_per_s = std::nan("");
  auto problems = nan.problems();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("device 1"), std::string::npos) << problems[0];
  EXPECT_THROW(predict(plan_reference(uniform(4, 2, 1e-3, 1e-3, 2, 100)), nan), Error);
}

}  // namespace
}  // namespace rondo::engine

namespace rondo::engine {
namespace {

// Generation's plan: layers in order into stages of at most the budget (a larger layer alone),
// the last stage the tail, backward stages mirroring the forward ones; valid for the engine.
TEST(GenerationPlan, CutsTheLayersInOrderUnderTheBudget) {
  const Plan p = generation_plan({4, 10, 10, 3, 30, 5}, 20);
  EXPECT_EQ(p.describe(), "F[0,2) F[2,4) F[4,5) T[5,6) B[4,5) B[2,4) B[0,2) M=1 stage");
  EXPECT_TRUE(p.problems(6).empty());
  const Plan one = generation_plan({4, 10, 5}, 1000);
  EXPECT_TRUE(one.forward.empty() && one.backward.empty());
  EXPECT_EQ(one.tail.begin, 0);
  EXPECT_EQ(one.tail.end, 3);
  EXPECT_TRUE(one.problems(3).empty());
}

}  // namespace
}  // namespace rondo::engine
