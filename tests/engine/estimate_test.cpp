// The run estimate's inputs to the planner: what the head's backward holds on the device beyond
// its per-token activations (the chunk of fp32 logits and their gradient; in full fine-tuning
// the LM head's fp32 weight gradient), so that a plan cannot fit only by leaving them out.
#include "engine/estimate.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/devices.h"
#include "engine/disk_speeds.h"
#include "models/attention_masks.h"
#include "models/inspect.h"
#include "tests/support/tiny_model_folder.h"

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;

// RONDO_SPEED_CACHE (engine/speed.h) set to `dir` while it lives, as it was after.
class SpeedCacheIn {
 public:
  explicit SpeedCacheIn(const fs::path& dir) {
    if (const char* old = std::getenv("RONDO_SPEED_CACHE")) saved_ = old;
    ::setenv("RONDO_SPEED_CACHE", dir.c_str(), 1);
  }
  ~SpeedCacheIn() {
    if (saved_)
      ::setenv("RONDO_SPEED_CACHE", saved_->c_str(), 1);
    else
      ::unsetenv("RONDO_SPEED_CACHE");
  }
  SpeedCacheIn(const SpeedCacheIn&) = delete;
  SpeedCacheIn& operator=(const SpeedCacheIn&) = delete;

 private:
  std::optional<std::string> saved_;
};

// The CPU's speeds a plan reads from the cache in `dir` (one JSON object a figure, as
// engine/speed.cpp writes them), each figure already cached there set to these, as if measured on
// a quiet machine: a block's FLOP/s, the head's, the optimizer's parameters a second. A plan on
// the CPU weighs compute against the NVMe tier and recompute against memory by them, and a
// loaded machine (CI's, running tests beside each other) measures them anywhere from a fifth of a
// quiet one's up: what a test says of a CPU placement must hold at all of them.
struct CpuSpeeds {
  double block_flops, head_flops, optimizer_params_per_s;
};

void set_cpu_speeds(const fs::path& dir, const CpuSpeeds& s) {
  int set = 0;
  for (const fs::directory_entry& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".json") continue;
    nlohmann::json j = nlohmann::json::parse(std::ifstream(f.path()));
    const std::string key = j.at("key");
    j["value"] = key.find("|optimizer|") != std::string::npos ? s.optimizer_params_per_s
                 : key.find("|head|") != std::string::npos    ? s.head_flops
                                                              : s.block_flops;
    j["busy"] = 0.0;
    std::ofstream(f.path()) << j.dump() << "\n";
    ++set;
  }
  ASSERT_GE(set, 3) << "the plan cached no block, head and optimizer figures in " << dir;
}

// Loaded and quiet machines' figures: at the first four, one of the CPU placement tests below
// failed before the planner fell back on single-layer jobs and the capped plan brought state back;
// the last is a fast machine's.
constexpr CpuSpeeds kCpuSpeeds[] = {
    {8e9, 4e9, 3e8}, {20e9, 20e9, 1e9}, {50e9, 20e9, 3e8}, {200e9, 4e9, 1e9}, {150e9, 190e9, 1e9},
};

// `check()` at this machine's speeds (measured into the cache in `dir`), then at each of
// kCpuSpeeds.
void at_cpu_speeds(const fs::path& dir, const std::function<void()>& check) {
  check();
  for (const CpuSpeeds& s : kCpuSpeeds) {
    SCOPED_TRACE(fmt::format("blocks at {:g} FLOP/s, the head at {:g}, the optimizer at {:g}",
                             s.block_flops, s.head_flops, s.optimizer_params_per_s));
    set_cpu_speeds(dir, s);
    check();
  }
}

TEST(Estimate, TheHeadsBackwardTransientsAreCounted) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_head_transients";
  fs::remove_all(dir);
  const std::int64_t V = 5000, C = 64, T = 64, M = 2;
  test::write_model_folder(
      dir.string(), 1,
      {.layers = 2, .hidden = static_cast<int>(C), .intermediate = 128, .vocab = V});
  const models::ModelSummary summary = models::inspect_model(dir.string(), T);
  const DevicePlan devices = plan_devices({});
  auto head_costs = [&](const std::string& method) {
    TrainConfig c;
    c.model.path = dir.string();
    c.model.dtype = "bf16";
    c.data.seq_len = T;
    c.training.method = method;
    c.training.grad_accum = M;
    const RunEstimate est = estimate_run(c, summary, devices, 1, M * T, /*host_free=*/1ull << 40,
                                         /*disk_free=*/1ull << 40);
    EXPECT_FALSE(est.inputs.layers.empty());
    return est.inputs.layers.back();
  };
  // One microbatch's logits (T tokens: fewer than a chunk) in fp32, and their fp32 gradient.
  const std::uint64_t logits = static_cast<std::uint64_t>(T * V) * 4 * 2;
  const std::uint64_t lm_grad = static_cast<std::uint64_t>(V * C) * 4;
  const LayerCosts lora = head_costs("lora"), full = head_costs("full");
  EXPECT_GE(lora.transient_bytes, logits);
  EXPECT_GE(full.transient_bytes, logits + lm_grad);
  // What full fine-tuning adds is the LM head's fp32 gradient, which LoRA does not have.
  EXPECT_EQ(full.transient_bytes - lora.transient_bytes, lm_grad);
  fs::remove_all(dir);
}

// A preference objective's tail runs the head forward twice (its per-token scores, then the
// weighted pass with its backward), and DPO scores every pair once before step 1: the plan
// counts both (docs/preference.md).
TEST(Estimate, APreferenceRunCountsTheHeadsSecondForwardAndDposReferencePass) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_preference";
  fs::remove_all(dir);
  const std::int64_t T = 64, M = 2;
  test::write_model_folder(dir.string(), 1,
                           {.layers = 2, .hidden = 64, .intermediate = 128, .vocab = 1000});
  const models::ModelSummary summary = models::inspect_model(dir.string(), T);
  const DevicePlan devices = plan_devices({});
  auto estimate = [&](const std::string& objective) {
    TrainConfig c;
    c.model.path = dir.string();
    c.data.seq_len = T;
    c.training.objective = objective;
    c.training.grad_accum = M;
    return estimate_run(c, summary, devices, 10, M * T, /*host_free=*/1ull << 40,
                        /*disk_free=*/1ull << 40);
  };
  const RunEstimate sft = estimate("sft"), dpo = estimate("dpo");
  ASSERT_EQ(sft.inputs.layers.size(), dpo.inputs.layers.size());
  const std::size_t head = sft.inputs.layers.size() - 1;
  for (std::size_t l = 0; l < head; ++l)
    EXPECT_EQ(dpo.inputs.layers[l].forward_s_per_token, sft.inputs.layers[l].forward_s_per_token);
  EXPECT_EQ(dpo.inputs.layers[head].forward_s_per_token,
            2 * sft.inputs.layers[head].forward_s_per_token);
  EXPECT_EQ(dpo.inputs.layers[head].backward_s_per_token,
            sft.inputs.layers[head].backward_s_per_token);

  // The pass: forward only, so less than training steps over as many tokens take; in proportion
  // to the tokens; in the run's time, and in the report.
  ASSERT_GT(dpo.prediction.step_time_s, 0);
  RunEstimate once = dpo, twice = dpo;
  add_reference_pass(once, 5 * M * T);
  add_reference_pass(twice, 10 * M * T);
  EXPECT_GT(once.reference_s, 0);
  EXPECT_LT(once.reference_s, 5 * dpo.prediction.step_time_s);
  EXPECT_DOUBLE_EQ(twice.reference_s, 2 * once.reference_s);
  EXPECT_DOUBLE_EQ(once.seconds, dpo.seconds + once.reference_s);
  EXPECT_NE(once.text().find("DPO's reference: every pair scored once"), std::string::npos)
      << once.text();
  EXPECT_EQ(nlohmann::json::parse(once.json())["reference"]["tokens"], 5 * M * T);
  EXPECT_EQ(dpo.text().find("DPO's reference"), std::string::npos);  // not asked for
  fs::remove_all(dir);
}

// The head's logits go in chunks of 1024 rows on a GPU, but the CPU (and simulated GPUs, which
// compute in host memory) keep a chunk's fp32 logits within 16 MiB (half the tuned heap's block
// limit, offload/process_heap.h): the planner counts the chunk the device will use.
TEST(Estimate, TheHeadsChunkOnTheCpuIsTheEnginesSmallerOne) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_cpu_head_chunk";
  fs::remove_all(dir);
  const std::int64_t V = 50000, C = 32, T = 512;
  test::write_model_folder(
      dir.string(), 1,
      {.layers = 1, .hidden = static_cast<int>(C), .intermediate = 64, .vocab = V});
  const models::ModelSummary summary = models::inspect_model(dir.string(), T);
  auto head_transient = [&](const DeviceSelection& selection) {
    TrainConfig c;
    c.model.path = dir.string();
    c.model.dtype = "fp32";
    c.data.seq_len = T;
    c.training.method = "lora";
    c.training.grad_accum = 1;
    const RunEstimate est = estimate_run(c, summary, plan_devices(selection), 1, T,
                                         /*host_free=*/1ull << 40, /*disk_free=*/1ull << 40);
    return est.inputs.layers.back().transient_bytes;
  };
  // Per row of logits: fp32 logits in the streaming dtype and in fp32, their fp32 gradient and its
  // copy (fp32 here): 16 bytes per vocabulary entry.
  const std::uint64_t per_row = static_cast<std::uint64_t>(V) * 16;
  const std::uint64_t cpu = head_transient({}), sim = head_transient({.sim_devices = 2}),
                      gpu = head_transient({.gpu = "RTX 4090"});
  EXPECT_EQ(gpu, per_row * T);  // the whole microbatch: fewer rows than a chunk
  const std::uint64_t rows_in_16mib = (16ull << 20) / (static_cast<std::uint64_t>(V) * 4);  // 83
  EXPECT_EQ(cpu, per_row * rows_in_16mib);
  EXPECT_EQ(sim, cpu);
  fs::remove_all(dir);
}

// A run says when its steps are far from what the plan predicted (the median of the judged
// steps, so one slow step does not), either way, and not when they are within 25%.
TEST(Estimate, StepsFarFromThePredictionAreSaid) {
  const std::int64_t steps = 1000;
  EXPECT_EQ(step_time_warning(1.0, {1.1, 0.9, 1.2}, steps), "");
  EXPECT_EQ(step_time_warning(1.0, {0.85, 1.24, 1.0}, steps), "");
  EXPECT_EQ(step_time_warning(1.0, {1.0, 5.0, 1.1}, steps), "");  // one outlier
  EXPECT_EQ(step_time_warning(0.0, {2.0, 2.0, 2.0}, steps), "");  // nothing predicted
  const std::string slow = step_time_warning(1.0, {2.0, 2.2, 1.9}, steps);
  EXPECT_NE(slow.find("steps take 2 s, the plan predicted 1 s (2x slower)"), std::string::npos)
      << slow;
  EXPECT_NE(slow.find("the ETA follows the measured steps"), std::string::npos) << slow;
  const std::string fast = step_time_warning(2.0, {0.5, 0.5, 0.6}, steps);
  EXPECT_NE(fast.find("(4x faster)"), std::string::npos) << fast;
  // A run of under a minute either way: not worth saying.
  EXPECT_EQ(step_time_warning(0.01, {0.05, 0.05, 0.05}, 100), "");
  EXPECT_NE(step_time_warning(0.01, {0.05, 0.05, 0.05}, 2000), "");
}

// The planner counts the attention masks a device builds for a job (PlanInputs::
// mask_bytes_per_token): on the CPU what limit_attention builds for short packed documents, with
// and without a window over all layers or some; on a GPU none where flash attention attends per
// document (half precision, no dropout), the masks otherwise.
TEST(Estimate, CountsTheMasksTheDeviceBuilds) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_masks";
  fs::remove_all(dir);
  const std::int64_t B = 2, T = 256;
  test::write_model_folder(dir.string(), 1, {.layers = 2, .hidden = 64, .intermediate = 128});
  models::ModelSummary summary = models::inspect_model(dir.string(), T);
  const DevicePlan cpu = plan_devices({}), gpu = plan_devices({.gpu = "RTX 4090"});
  DevicePlan turing = gpu;  // an RTX 2080's compute capability
  turing.devices.at(0).compute_major = 7;
  turing.devices.at(0).compute_minor = 5;
  auto counted = [&](const DevicePlan& devices, const std::string& dtype, bool pack) {
    TrainConfig c;
    c.model.path = dir.string();
    c.model.dtype = dtype;
    c.data.seq_len = T;
    c.data.pack = pack;
    c.training.method = "lora";
    const RunEstimate est = estimate_run(c, summary, devices, 1, B * T, /*host_free=*/1ull << 40,
                                         /*disk_free=*/1ull << 40);
    return est.inputs.mask_bytes_per_token;
  };
  // What the CPU builds: documents of 8 tokens (too short to attend one by one there).
  auto built = [&](bool pack) {
    at::Tensor tokens = at::zeros({B, T}, at::kLong);
    at::Tensor docs = at::arange(B * T, at::kLong).div(8, "floor").view({B, T});
    const models::AttentionContext ctx = models::make_attention_context(
        summary.config, {tokens, pack ? docs : at::Tensor()}, at::kFloat);
    EXPECT_TRUE(ctx.doc_offsets.empty());
    std::uint64_t bytes = 0;
    for (const at::Tensor& m : {ctx.mask, ctx.window_mask})
      if (m.defined()) bytes += static_cast<std::uint64_t>(m.numel()) * m.element_size();
    return bytes / static_cast<std::uint64_t>(B * T);
  };
  struct Window {
    std::int64_t size;
    std::vector<bool> layers;
  };
  for (const Window& w : {Window{0, {}}, Window{64, {}}, Window{64, {true, false}}}) {
    summary.config.sliding_window = w.size;
    summary.config.sliding_layers = w.layers;
    for (bool pack : {true, false}) {
      SCOPED_TRACE("window " + std::to_string(w.size) + " over " +
                   (w.layers.empty() ? "all layers" : "one layer") + (pack ? ", packed" : ""));
      EXPECT_EQ(counted(cpu, "fp32", pack), built(pack));
      // A GPU in half precision attends packed rows per document (the window in the kernel); rows
      // of one document each, packed or not, get the window's mask as on the CPU.
      EXPECT_EQ(counted(gpu, "bf16", pack), built(false));
      EXPECT_EQ(counted(gpu, "fp16", pack), built(false));
      // fp32 is not flash attention's, nor is a card older than Ampere: the masks, as on the CPU.
      EXPECT_EQ(counted(gpu, "fp32", pack), built(pack));
      EXPECT_EQ(counted(turing, "bf16", pack), built(pack));
    }
  }
  // Attention dropout needs the masked path on a GPU too.
  summary.config.sliding_window = 0;
  summary.config.sliding_layers.clear();
  summary.config.attention_dropout = 0.1;
  EXPECT_EQ(counted(gpu, "bf16", true), built(true));
  EXPECT_EQ(built(true), static_cast<std::uint64_t>(T));
  fs::remove_all(dir);
}

// A drive measured by `rondo devices --disk` is remembered (engine/disk_speeds.h) and planned
// with; and when the drive sets the step time, the estimate says so with the tokens per step that
// would hide it: the same step with a drive 100 times faster is about as fast as compute alone.
TEST(Estimate, ARememberedDriveIsPlannedWithAndASlowOneIsNamed) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_drive";
  fs::remove_all(dir);
  fs::create_directories(dir / "offload");
  const SpeedCacheIn cache(dir / "cache");
  test::write_model_folder((dir / "model").string(), 1,
                           {.layers = 4, .hidden = 256, .intermediate = 512, .vocab = 4000});
  const models::ModelSummary summary = models::inspect_model((dir / "model").string(), 64);
  TrainConfig c;
  c.model.path = (dir / "model").string();
  c.model.dtype = "fp32";
  c.data.seq_len = 64;
  c.training.method = "full";
  c.training.grad_accum = 2;
  c.hardware.offload_dir = (dir / "offload").string();
  const DevicePlan devices = plan_devices({.gpu = "RTX 4090"});
  // A host budget the full state does not fit: masters and moments go to the tier.
  auto plan = [&](const TrainConfig& config) {
    return estimate_run(config, summary, devices, 10, 2 * 64, /*host_free=*/24ull << 20,
                        /*disk_free=*/1ull << 40);
  };
  const RunEstimate assumed = plan(c);
  ASSERT_GT(assumed.placement.nvme_bytes, 0u) << assumed.text();
  EXPECT_EQ(assumed.placement.disk_bytes_per_s, 3e9);
  EXPECT_NE(assumed.placement.disk_speed_source.find("assumed"), std::string::npos);

  ASSERT_TRUE(remember_disk_speed((dir / "offload").string(), 20e6, 15e6));
  const RunEstimate measured = plan(c);
  EXPECT_EQ(measured.placement.disk_bytes_per_s, 20e6);
  EXPECT_NE(measured.placement.disk_speed_source.find("measured"), std::string::npos);
  // 20 MB/s: the drive sets the step time, and the estimate says how many tokens would hide it.
  EXPECT_GT(measured.prediction.step_time_s, 1.1 * measured.step_time_without_drive_s);
  EXPECT_GT(measured.tokens_per_step_to_hide_drive, 2 * 64);
  EXPECT_GT(measured.grad_accum_to_hide_drive, 2);
  EXPECT_NE(measured.text().find("Drive       sets the step time"), std::string::npos)
      << measured.text();
  // hardware.disk_speed wins over the remembered one; at 2 TB/s the drive hides.
  TrainConfig fast = c;
  fast.hardware.disk_speed = "2000GB";
  const RunEstimate set = plan(fast);
  EXPECT_EQ(set.placement.disk_bytes_per_s, static_cast<double>(2000ull << 30));  // GB: GiB
  EXPECT_EQ(set.placement.disk_speed_source, "hardware.disk_speed");
  EXPECT_EQ(set.tokens_per_step_to_hide_drive, 0);
  EXPECT_EQ(set.text().find("Drive       sets"), std::string::npos);
  fs::remove_all(dir);
}

// On the CPU device the device's memory is host memory, and the plan counts it in the budget:
// what the device computes on beyond what it reads in place. With the state in host memory that
// is less than the plan's device peak (weights read, gradients accumulated, in place); with the
// trained weights and gradients on NVMe, the device holds copies of a stage's weights and its
// gradients, so at least the largest layer's (the embedding's) at once. Where device and arena
// together pass the budget, the plan is made again with the device capped at what the arena
// leaves (smaller stages), and the device opens with that cap.
TEST(Estimate, TheCpuDevicesMemoryIsInTheHostBudget) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_cpu_device";
  fs::remove_all(dir);
  fs::create_directories(dir / "offload");
  const DevicePlan devices = plan_devices({});
  ASSERT_EQ(devices.mode, DeviceMode::kCpu);
  auto config = [&](const std::string& model) {
    TrainConfig c;
    c.model.path = (dir / model).string();
    c.model.dtype = "fp32";
    c.data.seq_len = 64;
    c.training.method = "full";
    c.training.grad_accum = 1;
    c.hardware.offload_chunk = "1MB";
    return c;
  };
  auto plan = [&](const TrainConfig& c) {
    return estimate_run(c, models::inspect_model(c.model.path, 64), devices, 10, 2 * 64,
                        /*host_free=*/1ull << 40, /*disk_free=*/1ull << 40);
  };
  // A third of the state as the budget, with an NVMe tier.
  auto third = [&](TrainConfig c, const RunEstimate& roomy) {
    c.hardware.offload_dir = (dir / "offload").string();
    c.hardware.host_memory = std::to_string(static_cast<std::uint64_t>(roomy.params) * 20 / 3);
    return plan(c);
  };
  {
    const std::int64_t V = 8000, C = 128;
    test::write_model_folder((dir / "wide").string(), 1,
                             {.layers = 12, .hidden = 128, .intermediate = 256, .vocab = V});
    const RunEstimate roomy = plan(config("wide"));
    ASSERT_FALSE(roomy.prediction.peak_bytes.empty());
    EXPECT_GT(roomy.host.cpu_device, 0u);
    EXPECT_LT(roomy.host.cpu_device, roomy.prediction.peak_bytes[0]) << roomy.text();
    const RunEstimate e = third(config("wide"), roomy);
    ASSERT_GT(e.placement.nvme_part[1], 0u) << e.text();  // trained weights
    EXPECT_GE(e.host.cpu_device, 2 * static_cast<std::uint64_t>(V * C) * 4) << e.text();
  }
  {
    // Many blocks, a small vocabulary: a stage of all of them would not fit next to the arena.
    test::write_model_folder((dir / "deep").string(), 1,
                             {.layers = 48, .hidden = 128, .intermediate = 256, .vocab = 2000});
    const RunEstimate roomy = plan(config("deep"));
    const RunEstimate e = third(config("deep"), roomy);
    EXPECT_NE(e.verdict, "does not fit") << e.text();
    EXPECT_LE(e.host.total(), e.host_available) << e.text();
    ASSERT_FALSE(e.prediction.peak_bytes.empty());
    EXPECT_LE(e.prediction.peak_bytes[0], e.devices.devices[0].bytes_cap) << e.text();
    EXPECT_NE(e.text().find("the CPU device"), std::string::npos) << e.text();
  }
  fs::remove_all(dir);
}

// A config.json-only Llama shape (hidden 512, 8 heads of which 4 for K and V, fp32, untied) in
// `dir`/model, with an offload folder beside it, and a run of it on the CPU: `method`, two rows
// of 128 tokens.
TrainConfig llama_on_the_cpu(const fs::path& dir, int blocks, int vocab,
                             const std::string& method) {
  fs::remove_all(dir);
  fs::create_directories(dir / "model");
  fs::create_directories(dir / "offload");
  std::ofstream(dir / "model" / "config.json")
      << R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":512,
             "intermediate_size":1376,"num_hidden_layers":)"
      << blocks << R"(,"num_attention_heads":8,"num_key_value_heads":4,"vocab_size":)" << vocab
      << R"(,"max_position_embeddings":2048,"rms_norm_eps":1e-5,"rope_theta":10000.0,
             "tie_word_embeddings":false,"torch_dtype":"float32"})";
  TrainConfig c;
  c.model.path = (dir / "model").string();
  c.model.dtype = "fp32";
  c.data.seq_len = 128;
  c.training.method = method;
  c.training.batch_rows = 2;
  c.hardware.offload_dir = (dir / "offload").string();
  return c;
}

// Where the CPU device's stages and the arena together pass the budget, the plan is made again
// with the device capped at what the arena leaves, and the device opens with that cap. A LoRA of
// a 60-block model (hidden 512, an untied vocabulary of 49,152: 224M parameters, 0.9 GB fp32)
// with its base on NVMe at 400 MB: planned freely, one stage holds 56 blocks' weights copied
// from the tier (1.45 GiB); capped, many small stages. (The roomy plan is the same model without
// a budget: its base in host memory, read in place.) At this machine's speeds and at each of
// kCpuSpeeds: with a slow head, the packings at the heaviest layer's budget and up all put
// several blocks in a job, and only single-layer jobs fit the cap.
TEST(Estimate, OnTheCpuTheDeviceIsCappedAtWhatTheArenaLeaves) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_cpu_capped";
  TrainConfig c = llama_on_the_cpu(dir, 60, 49152, "lora");
  const SpeedCacheIn cache(dir / "speed");
  const DevicePlan devices = plan_devices({});
  ASSERT_EQ(devices.mode, DeviceMode::kCpu);
  auto plan = [&](const TrainConfig& cfg) {
    return estimate_run(cfg, models::inspect_model(cfg.model.path, 128), devices, 3, 2 * 128,
                        /*host_free=*/1ull << 40, /*disk_free=*/1ull << 40);
  };
  auto check = [&] {
    TrainConfig capped = c;
    const RunEstimate roomy = plan(c);
    capped.hardware.host_memory = "400MB";
    const RunEstimate e = plan(capped);
    ASSERT_FALSE(roomy.devices.devices.empty());
    ASSERT_FALSE(e.prediction.peak_bytes.empty());
    EXPECT_NE(e.verdict, "does not fit") << e.text();
    EXPECT_GT(e.placement.nvme_part[0], 0u) << e.text();  // the frozen base
    EXPECT_LE(e.host.total(), e.host_available) << e.text();
    EXPECT_LT(e.devices.devices[0].bytes_cap, roomy.devices.devices[0].bytes_cap) << e.text();
    EXPECT_EQ(e.inputs.devices[0].memory_cap, e.devices.devices[0].bytes_cap);
    EXPECT_LE(e.prediction.peak_bytes[0], e.devices.devices[0].bytes_cap) << e.text();
    // Planned freely, the stages are larger: fewer jobs.
    EXPECT_GT(e.plan.jobs(), roomy.plan.jobs()) << roomy.text();
  };
  at_cpu_speeds(dir / "speed", check);
  fs::remove_all(dir);
}

// The placement on the CPU device judges the device under the plan made before the NVMe tier's
// traffic is known (larger stages); after the plan made with it, what the host has room for comes
// back. A 120M-parameter full fine-tuning (40 blocks, vocabulary 4,000) at 1.7 GB: its optimizer
// state on NVMe is enough (state: 2.4 GB, of which 1.4 GB masters and moments), so its trained
// weights (the first to come back) stay in host memory, and the plan fits. (Before, everything
// went to the tier: 2.24 GiB.) At this machine's speeds and at each of kCpuSpeeds: on a slow CPU
// the plan's fused tail saves more recompute than its copies of 20 blocks cost, the device and
// the arena pass the budget, and the plan made under a cap has the room: the weights come back
// after it too.
TEST(Estimate, OnTheCpuWhatFitsComesBackFromTheTier) {
  const fs::path dir = fs::path(::testing::TempDir()) / "estimate_cpu_comeback";
  TrainConfig c = llama_on_the_cpu(dir, 40, 4000, "full");
  const SpeedCacheIn cache(dir / "speed");
  const DevicePlan devices = plan_devices({});
  ASSERT_EQ(devices.mode, DeviceMode::kCpu);
  c.hardware.host_memory = "1700MB";
  auto check = [&] {
    const RunEstimate e = estimate_run(c, models::inspect_model(c.model.path, 128), devices, 3,
                                       2 * 128, /*host_free=*/1ull << 40, /*disk_free=*/1ull << 40);
    EXPECT_NE(e.verdict, "does not fit") << e.text();
    EXPECT_LE(e.host.total(), e.host_available) << e.text();
    EXPECT_GT(e.placement.nvme_part[2], 0u) << e.text();  // optimizer state
    EXPECT_EQ(e.placement.nvme_part[1], 0u) << e.text();  // trained weights
  };
  at_cpu_speeds(dir / "speed", check);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rondo::engine
