// The engine on a real GPU (label cuda; skips without one): the same training as the plain
// libtorch loop on the CPU — step-1 gradients and weights after 3 steps — on one CUDA device under
// a memory cap, with a plan of separate forward, tail and backward stages (fp32, TF32 off). Checks
// the CUDA paths the simulated devices cannot: torch running on the engine's own streams, events
// across streams, the engine's buffers in torch's caching allocator under one cap, copies from and
// to pinned host memory. And the same training twice gives the same bits (run-to-run determinism
// on the GPU).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>

#include "engine/devices.h"
#include "engine/engine.h"
#include "engine/model_store.h"
#include "engine/torch_device.h"
#include "models/generate.h"
#include "offload/activation_spill.h"
#include "offload/nvme_store.h"
#include "tests/support/engine_hooks.h"
#include "tests/support/cuda_or_skip.h"
#include "tests/support/plain_loop.h"

namespace rondo::engine {
namespace {

struct GpuRun {
  std::map<std::string, at::Tensor> grads1;   // step 1's gradients, by name
  std::map<std::string, at::Tensor> masters;  // fp32 masters after the last step (untied ones)
  std::uint64_t bytes_in_use_after = 0;       // the device pool once the engine is gone
  std::uint64_t engine_peak = 0;              // the engine's buffers at most
  std::uint64_t cap = 0;                      // the device's memory cap
  TorchCudaMemory torch;                      // torch's allocator over the run
  std::uint64_t nvme_written = 0;             // bytes the NVMe tier wrote (spill_dir)
};

// Trains `steps` on one CUDA device (cap 2 GiB) with a plan of separate forward, tail and
// backward stages; nullopt (and the test skipped) without a GPU. With `spill_dir`, the activation
// checkpoints go to an NVMe tier there (two steps' worth of space).
std::optional<GpuRun> train_on_one_gpu(const models::ModelConfig& config,
                                       const std::map<std::string, at::Tensor>& weights,
                                       const std::vector<std::vector<Microbatch>>& steps,
                                       const std::string& spill_dir = "") {
  DevicePlan dp = plan_devices({.memory_cap = 2ull << 30});
  if (dp.mode != DeviceMode::kCuda) return std::nullopt;
  dp.devices.resize(1);
  reset_torch_cuda_memory(0);
  auto devices = open_devices(dp);
  const auto specs = models::layer_specs(config);
  Plan plan{{{0, 2}, {2, 4}}, {4, 6}, {{2, 4}, {0, 2}}, 3, RecomputeGrain::kLayer};
  EngineOptions o;
  std::unique_ptr<offload::NvmeStore> nvme;
  if (!spill_dir.empty()) {
    std::int64_t rows = 0, tokens = 0;
    for (const Microbatch& mb : steps.at(0)) {
      rows = std::max(rows, mb.batch.tokens.size(0));
      tokens = std::max(tokens, mb.batch.tokens.size(1));
    }
    o.spill_checkpoint_bytes = offload::ActivationSpill::capacity_for(
        static_cast<std::uint64_t>(rows * tokens * config.hidden_size) * 4,
        2 * plan.checkpointed_layers().size() * static_cast<std::uint64_t>(plan.microbatches),
        offload::NvmeStoreOptions{}.block_bytes);
    nvme = std::make_unique<offload::NvmeStore>(offload::NvmeStoreOptions{.dir = spill_dir},
                                                o.spill_checkpoint_bytes);
  }
  offload::HostArena arena;
  offload::LayerStore store(arena,
                            layer_descs(specs, [](const models::ParamSpec&) { return true; }),
                            kernels::FloatDType::kF32, kernels::FloatDType::kF32, nvme.get());
  load_weights(store, specs, [&](const std::string& n) { return weights.at(n); });
  o.adamw = {.lr = 1e-3, .eps = 1e-6, .weight_decay = 0.1};
  o.max_grad_norm = 0.5;
  GpuRun run;
  test::EngineHooks hooks;
  o.probe = &hooks;
  hooks.on_gradients = [&](std::int64_t step) {
    if (step != 1) return;
    for (std::size_t l = 0; l < specs.size(); ++l)
      for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
        at::Tensor g = state_view(store, specs, l, i, StateView::kGrad).clone();
        auto& slot = run.grads1[specs[l].params[i].name];
        slot = slot.defined() ? slot + g : g;
      }
  };
  {
    Engine engine(config, specs, store, arena, {devices[0].get()}, plan, o);
    engine.train(static_cast<std::int64_t>(steps.size()),
                 [&](std::int64_t s) { return steps.at(s - 1); });
  }
  run.bytes_in_use_after = devices[0]->memory().bytes_in_use;
  run.engine_peak = devices[0]->memory().bytes_peak;
  run.cap = devices[0]->memory().bytes_cap;
  if (auto m = torch_cuda_memory(0)) run.torch = *m;
  if (nvme) run.nvme_written = nvme->info().bytes_written;
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!store.layer(l)[i].tied)
        run.masters[specs[l].params[i].name] =
            state_view(store, specs, l, i, StateView::kMaster).cpu().clone();
  return run;
}

class EngineCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    RONDO_CUDA_OR_SKIP();
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
    at::manual_seed(5);
    weights = test::random_weights(config);
    for (int i = 0; i < 3; ++i)
      steps.push_back(test::random_batch(config, 6, 16, 3));
  }
  const models::ModelConfig config = test::tiny_qwen2(4, 4);
  std::map<std::string, at::Tensor> weights;
  std::vector<std::vector<Microbatch>> steps;
};

TEST_F(EngineCuda, TrainsLikeThePlainLoopOnOneGpu) {
  std::optional<GpuRun> run = train_on_one_gpu(config, weights, steps);
  if (!run) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(run->bytes_in_use_after, 0u);

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
    EXPECT_LE(rel(run->grads1.at(name), g), 1e-4) << name;
  for (auto& [name, w] : run->masters)
    EXPECT_LE(rel(w, ref.param(name)), 1e-4) << name;
}

// One cap bounds every byte: the engine's buffers come from torch's caching allocator (they show
// in its statistics), and torch's peak — buffers, activations, attention and head temporaries —
// stays under the device's cap.
TEST_F(EngineCuda, OneCapBoundsTheEnginesBuffersAndTorchsTensors) {
  std::optional<GpuRun> run = train_on_one_gpu(config, weights, steps);
  if (!run) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(run->cap, 2ull << 30);
  EXPECT_GT(run->engine_peak, 0u);
  EXPECT_GE(run->torch.peak_allocated, run->engine_peak);
  EXPECT_LE(run->torch.peak_reserved, run->cap);
}

// The same training twice in one process gives the same bits, with deterministic kernels on: what
// an exact resume on a GPU rests on (the schedule, the streams and torch's kernels all repeat).
TEST_F(EngineCuda, RepeatsBitIdenticallyOnOneGpu) {
  // As an exact run (training.deterministic) has it, before the process's first cuBLAS call.
  ASSERT_TRUE(use_deterministic_torch(true));
  std::optional<GpuRun> a = train_on_one_gpu(config, weights, steps);
  if (!a) GTEST_SKIP() << "no CUDA device";
  std::optional<GpuRun> b = train_on_one_gpu(config, weights, steps);
  ASSERT_TRUE(b);
  int differ = 0;
  for (auto& [name, w] : a->masters)
    if (!at::equal(w, b->masters.at(name))) {
      ++differ;
      ADD_FAILURE() << name << " differs between two identical runs by up to "
                    << (w - b->masters.at(name)).abs().max().item<double>();
    }
  EXPECT_EQ(differ, 0) << "of " << a->masters.size() << " tensors";
}

// Activation checkpoints through the NVMe tier on a GPU: downloaded from the device into pinned
// staging, written to the drive by the spill's thread once the download's CUDA event has
// completed, read back and uploaded for the backward. The training ends on the same bits as with
// them in host memory (deterministic kernels, as for the repeat test).
TEST_F(EngineCuda, CheckpointsOnNvmeTrainBitForBitLikeHostMemoryOnOneGpu) {
  ASSERT_TRUE(use_deterministic_torch(true));
  std::optional<GpuRun> in_memory = train_on_one_gpu(config, weights, steps);
  if (!in_memory) GTEST_SKIP() << "no CUDA device";
  const std::string dir = ::testing::TempDir() + "rondo-cuda-spill";
  std::optional<GpuRun> spilled = train_on_one_gpu(config, weights, steps, dir);
  ASSERT_TRUE(spilled);
  std::filesystem::remove_all(dir);
  EXPECT_GT(spilled->nvme_written, 0u) << "no checkpoint reached the drive";
  EXPECT_EQ(spilled->bytes_in_use_after, 0u);
  for (auto& [name, w] : in_memory->masters)
    EXPECT_TRUE(at::equal(w, spilled->masters.at(name))) << name;
}

// The model's weights frozen in a host store, and one CUDA device (cap 2 GiB) to run them on:
// what evaluation and generation need; null without a GPU.
struct FrozenOnOneGpu {
  std::vector<std::unique_ptr<kernels::Device>> devices;
  std::vector<models::LayerSpec> specs;
  offload::HostArena arena;
  std::optional<offload::LayerStore> store;

  static std::unique_ptr<FrozenOnOneGpu> open(const models::ModelConfig& config,
                                              const std::map<std::string, at::Tensor>& weights) {
    DevicePlan dp = plan_devices({.memory_cap = 2ull << 30});
    if (dp.mode != DeviceMode::kCuda) return nullptr;
    dp.devices.resize(1);
    auto g = std::make_unique<FrozenOnOneGpu>();
    g->devices = open_devices(dp);
    g->specs = models::layer_specs(config);
    g->store.emplace(g->arena,
                     layer_descs(g->specs, [](const models::ParamSpec&) { return false; }),
                     kernels::FloatDType::kF32, kernels::FloatDType::kF32);
    load_weights(*g->store, g->specs, [&](const std::string& n) { return weights.at(n); });
    return g;
  }
};

// Generation on the GPU (greedy, two prompts of different lengths): every layer resident, the
// stages streamed per token, and streamed with the KV caches in host memory between tokens (the
// copies up and down that simulated devices, whose tensors are host memory already, cannot
// exercise) give the same tokens, bit for bit the same computation; the first token is the CPU
// path's (models::generate on the same weights; later ones may part at a near tie, as GPU sums
// round otherwise); every upload is freed.
TEST_F(EngineCuda, GeneratesAsTheCpuDoesResidentStreamedAndWithHostCaches) {
  const std::unique_ptr<FrozenOnOneGpu> gpu = FrozenOnOneGpu::open(config, weights);
  if (!gpu) GTEST_SKIP() << "no CUDA device";
  auto& [devices, specs, arena, store] = *gpu;
  const models::Model cpu = models::Model::from_tensors(config, weights, "cpu reference", nullptr);
  const std::vector<std::vector<std::int64_t>> prompts = {{3, 1, 4, 1, 5}, {9, 2}};
  const models::SamplingOptions greedy{.max_new_tokens = 10, .stop_tokens = {-1}};
  struct Setup {
    Plan plan;
    Residency residency;
    KvCaches kv;
  };
  const Plan staged{{{0, 2}, {2, 4}}, {4, 6}, {{2, 4}, {0, 2}}, 1, RecomputeGrain::kStage};
  std::vector<std::vector<std::int64_t>> first;
  for (const Setup& s : {Setup{staged, Residency::kResident, KvCaches::kDevice},
                         Setup{staged, Residency::kStreamed, KvCaches::kDevice},
                         Setup{staged, Residency::kStreamed, KvCaches::kHost}}) {
    SCOPED_TRACE(std::string(s.residency == Residency::kResident ? "resident" : "streamed") +
                 (s.kv == KvCaches::kHost ? ", host caches" : ""));
    {
      Engine engine(config, specs, *store, arena, {devices[0].get()}, s.plan, {});
      const Generation g =
          engine.generate(prompts, greedy, {.residency = s.residency, .kv_caches = s.kv});
      EXPECT_EQ(g.kv_host, s.kv == KvCaches::kHost);
      EXPECT_EQ(g.resident, s.residency == Residency::kResident);
      if (first.empty()) {
        first = g.tokens;
        for (std::size_t k = 0; k < prompts.size(); ++k)
          EXPECT_EQ(g.tokens[k].at(0), models::generate(cpu, prompts[k], greedy).at(0))
              << "prompt " << k;
      }
      EXPECT_EQ(g.tokens, first);
    }
    EXPECT_EQ(devices[0]->memory().bytes_in_use, 0u);
  }
}

// Validation on the GPU (Engine::evaluate: forward-only jobs, the loss summed on the device) gives
// the plain loop's loss on the CPU over the same microbatches, within 1e-4 relative (GPU sums),
// under a staged plan, and frees every upload.
TEST_F(EngineCuda, EvaluatesAsThePlainLoopOnOneGpu) {
  const std::unique_ptr<FrozenOnOneGpu> gpu = FrozenOnOneGpu::open(config, weights);
  if (!gpu) GTEST_SKIP() << "no CUDA device";
  auto& [devices, specs, arena, store] = *gpu;
  const Plan staged{{{0, 2}, {2, 4}}, {4, 6}, {{2, 4}, {0, 2}}, 3, RecomputeGrain::kStage};
  double got = 0;
  {
    Engine engine(config, specs, *store, arena, {devices[0].get()}, staged, {});
    got = engine.evaluate(steps[0]).loss();
  }
  EXPECT_EQ(devices[0]->memory().bytes_in_use, 0u);
  // The plain loop's step returns the loss before its update (lr 0: nothing moves anyway).
  test::PlainLoop ref(config, weights, {.lr = 0, .weight_decay = 0}, 0);
  const double want = ref.step(steps[0]);
  EXPECT_NEAR(got, want, 1e-4 * want);
}

}  // namespace
}  // namespace rondo::engine
