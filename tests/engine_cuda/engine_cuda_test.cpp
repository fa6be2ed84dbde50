// The engine on a real GPU (label cuda; skips without one): the same training as the plain
// libtorch loop on the CPU — step-1 gradients and weights after 3 steps — on one CUDA device under
// a memory cap, with a plan of separate forward, tail and backward stages (fp32, TF32 off). Checks
// the CUDA paths the simulated devices cannot: torch running on the engine's own streams, events
// across streams, the stream-ordered pool, copies from and to pinned host memory.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include "engine/devices.h"
#include "engine/engine.h"
#include "engine/state.h"
#include "tests/support/cuda_or_skip.h"
#include "tests/support/plain_loop.h"

namespace rondo::engine {
namespace {

TEST(EngineCuda, TrainsLikeThePlainLoopOnOneGpu) {
  RONDO_CUDA_OR_SKIP();
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  DevicePlan dp = plan_devices({.memory_cap = 2ull << 30});
  if (dp.mode != DeviceMode::kCuda) GTEST_SKIP() << "no CUDA device: " << dp.why_no_gpu;
  dp.devices.resize(1);
  auto devices = open_devices(dp);

  at::manual_seed(5);
  const models::ModelConfig config = test::tiny_qwen2(4, 4);
  const auto specs = models::layer_specs(config);
  const auto weights = test::random_weights(config);
  std::vector<std::vector<Microbatch>> steps;
  for (int i = 0; i < 3; ++i)
    steps.push_back(test::random_batch(config, 6, 16, 3));

  offload::HostArena arena;
  offload::LayerStore store(arena,
                            layer_descs(specs, [](const models::ParamSpec&) { return true; }),
                            kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  load_weights(store, specs, [&](const std::string& n) { return weights.at(n); });
  EngineOptions o;
  o.adamw = {.lr = 1e-3, .eps = 1e-6, .weight_decay = 0.1};
  o.max_grad_norm = 0.5;
  std::map<std::string, at::Tensor> grads1;
  o.on_gradients = [&](std::int64_t step) {
    if (step != 1) return;
    for (std::size_t l = 0; l < specs.size(); ++l)
      for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
        at::Tensor g = state_view(store, specs, l, i, StateView::kGrad).clone();
        auto& slot = grads1[specs[l].params[i].name];
        slot = slot.defined() ? slot + g : g;
      }
  };
  Plan plan{{{0, 2}, {2, 4}}, {4, 6}, {{2, 4}, {0, 2}}, 3, RecomputeGrain::kLayer};
  {
    Engine engine(config, specs, store, arena, {devices[0].get()}, plan, o);
    engine.train(3, [&](std::int64_t s) { return steps.at(s - 1); });
  }
  EXPECT_EQ(devices[0]->memory().bytes_in_use, 0u);

  test::PlainLoop ref(config, weights, {.lr = 1e-3, .eps = 1e-6, .weight_decay = 0.1}, 0.5);
  std::map<std::string, at::Tensor> ref_grads;
  for (int i = 0; i < 3; ++i)
    ref.step(steps[i], i == 0 ? &ref_grads : nullptr);
  // GPU kernels sum in other orders than the CPU's: 1e-4 relative to each tensor's largest entry.
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return (a.cpu().to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() /
           std::max(1e-30, b.abs().max().item<double>());
  };
  for (auto& [name, g] : ref_grads)
    EXPECT_LE(rel(grads1.at(name), g), 1e-4) << name;
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!store.layer(l)[i].tied) {
        EXPECT_LE(rel(state_view(store, specs, l, i, StateView::kMaster),
                      ref.param(specs[l].params[i].name)),
                  1e-4)
            << specs[l].params[i].name;
      }
}

}  // namespace
}  // namespace rondo::engine
