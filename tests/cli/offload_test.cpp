// Bigger than the host memory budget, as a user runs it (`rondo train` on a model folder the test
// writes, two simulated devices): a LoRA run and a full fine-tuning run whose training state is
// at least 3x the budget complete with the state placed on the NVMe tier (io_uring, and the
// thread-pool fallback forced on tmpfs), end bit for bit where the same runs held in host memory
// end, and stay under the budget plus the overhead the run states. NVMe faults (EIO, ENOSPC, a
// short read, a corrupt block) end the run with an error naming the file and offset, and a resume
// once the fault is gone ends bit-identical to an uninterrupted run. `rondo plan` answers for a
// config.json-only Llama-3-70B on an RTX 4090.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "../support/tiny_model_folder.h"
#include "run_files.h"
#include "run_rondo.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using rondo::test::contains;
using rondo::test::events;
using rondo::test::Result;
using rondo::test::run_rondo;
using rondo::test::slurp;
using rondo::test::step_losses;

json last(const std::vector<json>& ev, const std::string& type) {
  json out;
  for (const json& e : ev)
    if (e["type"] == type) out = e;
  return out;
}

// 80 blocks of C = 128, I = 512 (about 21 M parameters, 1 MiB of fp32 weights per block): many
// small layers, as in a large model (Llama-3-70B has 80), so that the few layers of NVMe staging
// in flight are a small share.
constexpr int kLayers = 80, kHidden = 128, kInter = 512;

struct Offload : ::testing::Test {
  fs::path dir, model, data;
  std::int64_t params = 0, block_params = 0;
  // `rondo plan` of a model folder for one RTX 4090 and 96 GB of host memory, 1024-token rows.
  static std::string plan_on_a_4090(const fs::path& model_dir, bool json = true) {
    return std::string("plan") + (json ? " --json" : "") +
           " --set model.path=" + model_dir.string() +
           " --set hardware.gpu='RTX 4090' --set hardware.host_memory=96GB"
           " --set training.steps=100 --set data.seq_len=1024";
  }
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("rondo-offload-test-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    model = dir / "model";
    const rondo::models::ModelConfig mc =
        rondo::test::write_tiny_model_folder(model.string(), 5, kLayers, 512, kHidden, kInter);
    for (const rondo::models::LayerSpec& l : rondo::models::layer_specs(mc)) {
      params += l.param_count();
      if (l.kind == rondo::models::LayerKind::kBlock) block_params = l.param_count();
    }
    data = dir / "train.jsonl";
    std::string lines;
    for (int i = 0; i < 16; ++i)
      lines +=
          json{{"text", "example " + std::to_string(i) + " says hello to the world"}}.dump() + "\n";
    std::ofstream(data) << lines;
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }
  std::string config(const std::string& run, const std::string& method,
                     const std::string& extra = "") const {
    return "[model]\npath = \"" + model.string() + "\"\ndtype = \"fp32\"\n" + "[data]\ntrain = \"" +
           data.string() + "\"\nseq_len = 32\n" +
           "[lora]\nrank = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\"]\n" +
           "[training]\nmethod = \"" + method +
           "\"\nsteps = 6\nbatch_rows = 2\ngrad_accum = 2\nlr = 1e-3\nseed = 3\n" +
           "[checkpoint]\nevery = 2\nkeep = 0\n" + "[hardware]\nsim_devices = 2\n" + extra +
           "[output]\nrun_dir = \"" + (dir / run).string() + "\"\nexports = [\"" +
           (method == "lora" ? "adapter" : "merged") + "\"]\n";
  }
  Result train(const std::string& run, const std::string& method, const std::string& extra,
               const std::string& env = "") {
    const fs::path cfg = dir / (run + ".toml");
    std::ofstream(cfg) << config(run, method, extra);
    return run_rondo("train " + cfg.string(), true, env);
  }
  std::string export_bytes(const std::string& run, const std::string& method) const {
    return method == "lora" ? slurp(dir / run / "adapter" / "adapter_model.safetensors")
                            : slurp(dir / run / "merged" / "model.safetensors");
  }
};

// Training state of a run, independently of Rondo: fp32 weights 4 B/param; trained parameters
// also 4 B of gradient, 4 of master and 8 of moments.
std::uint64_t state_bytes(std::int64_t params, std::int64_t trained) {
  return static_cast<std::uint64_t>(params) * 4 + static_cast<std::uint64_t>(trained) * 16;
}

void expect_budget_held(const fs::path& run) {
  const std::vector<json> ev = events(run / "events.jsonl");
  const json end = last(ev, "run_end");
  ASSERT_EQ(end["status"], "completed") << end.dump();
  const auto budget = end["host_budget_bytes"].get<std::uint64_t>();
  const auto overhead = end["host_overhead_bytes"].get<std::uint64_t>();
  const auto peak = end["host_peak_bytes"].get<std::uint64_t>();
  const auto arena = end["host_arena_peak_bytes"].get<std::uint64_t>();
  // Simulated devices' memory is host memory too (under each device's own cap).
  std::uint64_t devices = 0;
  std::map<int, std::uint64_t> device_peak;
  for (const json& e : ev)
    if (e["type"] == "device")
      device_peak[e["device"].get<int>()] =
          std::max(device_peak[e["device"].get<int>()], e["bytes_peak"].get<std::uint64_t>());
  for (auto& [d, b] : device_peak)
    devices += b;
  std::printf(
      "%s: peak RSS %.1f MiB, arena peak %.1f MiB of a %.1f MiB budget, stated overhead "
      "%.1f MiB, simulated devices %.1f MiB\n",
      run.filename().c_str(), peak / 1048576.0, arena / 1048576.0, budget / 1048576.0,
      overhead / 1048576.0, devices / 1048576.0);
  EXPECT_LE(arena, budget);
  EXPECT_LE(peak, budget + overhead + devices);
}

TEST_F(Offload, StateThreeTimesTheBudgetTrainsBitForBitUnderIt) {
  struct Case {
    std::string method, io, offload_dir;
  };
  // LoRA through io_uring (where the kernel allows it) on the disk; full fine-tuning through the
  // thread-pool fallback on tmpfs.
  const std::vector<Case> cases = {
      {"lora", "auto", (dir / "nvme").string()},
      {"full", "threads", "/dev/shm/rondo-offload-test-" + std::to_string(::getpid())}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method);
    // LoRA: the frozen base (the adapters' state, a few MiB, not counted).
    const std::uint64_t state = state_bytes(params, c.method == "full" ? params : 0);
    const std::uint64_t budget = state / 3;
    Result ref = train("mem-" + c.method, c.method, "");
    ASSERT_EQ(ref.code, 0) << ref.out;
    const std::string extra = "host_memory = \"" + std::to_string(budget) + "\"\noffload_dir = \"" +
                              c.offload_dir + "\"\noffload_io = \"" + c.io + "\"\n";
    Result r = train("nvme-" + c.method, c.method, extra);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "NVMe tier: ")) << r.out;
    const json plan = last(events(dir / ("nvme-" + c.method) / "events.jsonl"), "plan");
    ASSERT_TRUE(plan.contains("placement")) << plan.dump();
    EXPECT_GT(plan["placement"]["nvme_bytes"].get<std::uint64_t>(), 2 * state / 3) << plan.dump();
    if (c.io == "threads") {
      EXPECT_EQ(plan["placement"]["backend"], "threads");
    }
    std::printf("%s: state %.1f MiB, budget %.1f MiB, on NVMe %.1f MiB via %s\n", c.method.c_str(),
                state / 1048576.0, budget / 1048576.0,
                plan["placement"]["nvme_bytes"].get<double>() / 1048576.0,
                plan["placement"]["backend"].get<std::string>().c_str());
    EXPECT_EQ(step_losses(dir / ("nvme-" + c.method) / "events.jsonl"),
              step_losses(dir / ("mem-" + c.method) / "events.jsonl"));
    const std::string a = export_bytes("mem-" + c.method, c.method);
    EXPECT_FALSE(a.empty());
    EXPECT_TRUE(a == export_bytes("nvme-" + c.method, c.method)) << "the exports differ";
    expect_budget_held(dir / ("nvme-" + c.method));
    fs::remove_all(c.offload_dir);
  }
}

TEST_F(Offload, FaultsEndTheRunNamedAndAResumeEndsExactly) {
  const std::string extra = "host_memory = \"" + std::to_string(state_bytes(params, params) / 3) +
                            "\"\noffload_dir = \"" + (dir / "nvme").string() + "\"\n";
  Result ref = train("ref", "full", extra);
  ASSERT_EQ(ref.code, 0) << ref.out;
  const json end = last(events(dir / "ref" / "events.jsonl"), "run_end");
  // Block reads per step (1 MiB blocks): a fault in the third step, after a checkpoint.
  const double reads_per_step = end["nvme_read_bytes"].get<double>() / 6 / (1 << 20);
  ASSERT_GT(reads_per_step, 1) << end.dump();
  const int nth = static_cast<int>(2.5 * reads_per_step);
  for (const std::string& fault :
       {"eio:read:" + std::to_string(nth), "enospc:write:" + std::to_string(nth),
        "short:read:" + std::to_string(nth), "corrupt:read:" + std::to_string(nth)}) {
    SCOPED_TRACE(fault);
    const std::string run = "fault-" + fault.substr(0, fault.find(':'));
    Result r = train(run, "full", extra, "RONDO_FAULT_IO=" + fault);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(contains(r.out, "offset")) << r.out;
    EXPECT_TRUE(contains(r.out, "rondo-offload") || contains(r.out, (dir / "nvme").string()))
        << r.out;
    const json failed = last(events(dir / run / "events.jsonl"), "run_end");
    EXPECT_EQ(failed["status"], "failed");
    // The steps it had done, not 0.
    const auto losses = step_losses(dir / run / "events.jsonl");
    ASSERT_FALSE(losses.empty());
    EXPECT_EQ(failed["steps"].get<std::int64_t>(), losses.rbegin()->first) << failed.dump();
    int checkpoints = 0;
    if (fs::exists(dir / run / "checkpoints"))
      for (const auto& e : fs::directory_iterator(dir / run / "checkpoints"))
        checkpoints += e.path().filename().string().rfind("step-", 0) == 0;
    const std::size_t at = r.out.find("rondo: error:");
    std::printf("%s: %d checkpoint(s) before the fault; %s\n", fault.c_str(), checkpoints,
                r.out.substr(at == std::string::npos ? 0 : at, 400).c_str());
    EXPECT_GE(checkpoints, 1) << "the fault came before the first checkpoint";
    Result resumed = run_rondo("train --resume " + (dir / run).string());
    ASSERT_EQ(resumed.code, 0) << resumed.out;
    EXPECT_EQ(step_losses(dir / run / "events.jsonl"), step_losses(dir / "ref" / "events.jsonl"));
    EXPECT_TRUE(export_bytes(run, "full") == export_bytes("ref", "full"))
        << "the resumed run's export differs";
  }
}

// "Does Llama-3-70B LoRA fit on my 24 GB card with 64 GB of RAM and an NVMe drive?", asked before
// downloading: a folder with config.json only.
TEST_F(Offload, PlansALlama70BFromItsConfigAlone) {
  const fs::path llama = dir / "Llama-3-70B";
  fs::create_directories(llama);
  std::ofstream(llama / "config.json") << json{
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", 8192},
      {"intermediate_size", 28672},
      {"num_hidden_layers", 80},
      {"num_attention_heads", 64},
      {"num_key_value_heads", 8},
      {"vocab_size", 128256},
      {"max_position_embeddings", 8192},
      {"rms_norm_eps", 1e-5},
      {"rope_theta", 500000.0},
      {"tie_word_embeddings", false},
      {"torch_dtype", "bfloat16"}}.dump(2);
  const std::string base = "plan --json --set model.path=" + llama.string() +
                           " --set model.quantize=nf4 --set hardware.gpu='RTX 4090'"
                           " --set training.steps=100 --set data.seq_len=1024";
  const std::string nvme = " --set hardware.offload_dir=" + (dir / "nvme").string();
  // 64 GB: the NF4 base (about 40 GiB) fits in host memory; the answer says so.
  Result r = run_rondo(base + " --set hardware.host_memory=64GB" + nvme, false);
  const json roomy = json::parse(r.out);
  std::printf(
      "70B NF4, RTX 4090, 64 GB + NVMe: %s, step %.2f s, weights up %.1f GiB (%.1f GiB "
      "unquantised), NVMe %.1f GiB\n",
      roomy["verdict"].get<std::string>().c_str(), roomy["step_seconds"].get<double>(),
      roomy["traffic_per_step"]["weights_up_bytes"].get<double>() / (1 << 30),
      roomy["traffic_per_step"]["weights_up_unquantised_bytes"].get<double>() / (1 << 30),
      roomy["placement"]["nvme_bytes"].get<double>() / (1 << 30));
  EXPECT_EQ(roomy["verdict"], "fits") << r.out;
  EXPECT_EQ(r.code, 0);
  EXPECT_GT(roomy["params"].get<double>(), 69e9);
  EXPECT_GT(roomy["step_seconds"].get<double>(), 0);
  // Quantised, the weights cross the link in about a quarter of the bytes.
  EXPECT_GT(roomy["traffic_per_step"]["weights_up_bytes"].get<double>(), 0);
  EXPECT_LT(roomy["traffic_per_step"]["weights_up_bytes"].get<double>(),
            0.4 * roomy["traffic_per_step"]["weights_up_unquantised_bytes"].get<double>());

  // 40 GB: part of the base goes to the NVMe tier, and the step pays for reading it.
  r = run_rondo(base + " --set hardware.host_memory=40GB" + nvme, false);
  const json fits = json::parse(r.out);
  std::printf("70B NF4, RTX 4090, 40 GB + NVMe: %s\n", fits.dump(2).c_str());
  EXPECT_EQ(fits["verdict"], "fits") << r.out;
  EXPECT_EQ(r.code, 0);
  EXPECT_GT(fits["placement"]["nvme_bytes"].get<double>(), 10e9);
  EXPECT_GT(fits["traffic_per_step"]["nvme_read_bytes"].get<double>(), 10e9);
  EXPECT_GT(fits["step_seconds"].get<double>(), roomy["step_seconds"].get<double>());
  EXPECT_LE(fits["host"]["needed_bytes"].get<double>(), 40e9);

  // Without the offload folder: it says what does not fit and what to set.
  r = run_rondo(base + " --set hardware.host_memory=40GB", false);
  const json tight = json::parse(r.out);
  EXPECT_EQ(tight["verdict"], "does not fit") << r.out;
  EXPECT_EQ(r.code, 3);
  const std::string problems = tight["problems"].dump();
  EXPECT_TRUE(contains(problems, "host memory")) << problems;
  EXPECT_TRUE(contains(problems, "hardware.offload_dir")) << problems;
  EXPECT_FALSE(contains(problems, "model.dtype = bf16")) << problems;  // it is bf16 already
  EXPECT_FALSE(contains(problems, "model.quantize")) << problems;      // it is nf4 already
}

// The same question for a mixture of experts, Qwen3-30B-A3B (its published config.json). Its
// model card says 30.5B parameters in total and 3.3B activated: the plan reports both.
TEST_F(Offload, PlansAQwen3MoeFromItsConfigAlone) {
  const fs::path qwen = dir / "Qwen3-30B-A3B";
  fs::create_directories(qwen);
  std::ofstream(qwen / "config.json") << json{
      {"architectures", {"Qwen3MoeForCausalLM"}},
      {"model_type", "qwen3_moe"},
      {"hidden_size", 2048},
      {"intermediate_size", 6144},
      {"moe_intermediate_size", 768},
      {"num_hidden_layers", 48},
      {"num_attention_heads", 32},
      {"num_key_value_heads", 4},
      {"head_dim", 128},
      {"num_experts", 128},
      {"num_experts_per_tok", 8},
      {"norm_topk_prob", true},
      {"decoder_sparse_step", 1},
      {"mlp_only_layers", json::array()},
      {"vocab_size", 151936},
      {"max_position_embeddings", 40960},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 1000000.0},
      {"tie_word_embeddings", false},
      {"torch_dtype", "bfloat16"}}.dump(2);
  const std::string base = plan_on_a_4090(qwen);
  // The model's own counts (full fine-tuning: no adapters among them).
  Result r = run_rondo(base + " --set training.method=full", false);
  const json full = json::parse(r.out);
  EXPECT_NEAR(full["params"].get<double>(), 30.5e9, 0.1e9) << r.out;
  EXPECT_NEAR(full["active_params"].get<double>(), 3.3e9, 0.1e9);
  EXPECT_EQ(full["experts"], 128);
  EXPECT_EQ(full["experts_per_token"], 8);
  // LoRA (all-linear: attention and every expert, rank 16) on one 24 GB card.
  r = run_rondo(base + " --set training.method=lora", false);
  const json plan = json::parse(r.out);
  std::printf(
      "Qwen3-30B-A3B: %.2f B parameters, %.2f B active; LoRA (%.2f B adapters), RTX 4090, "
      "96 GB: %s, step %.1f s\n",
      full["params"].get<double>() / 1e9, full["active_params"].get<double>() / 1e9,
      plan["trained_params"].get<double>() / 1e9, plan["verdict"].get<std::string>().c_str(),
      plan["step_seconds"].get<double>());
  EXPECT_NE(plan["verdict"], "does not fit") << r.out;
  EXPECT_EQ(r.code, 0);
  r = run_rondo(plan_on_a_4090(qwen, /*json=*/false) + " --set training.method=lora", false);
  EXPECT_TRUE(contains(r.out, "128 per sparse block, 8 per token")) << r.out;
  // An NF4 base quantises the experts too: the weights cross the link in about a quarter.
  r = run_rondo(base + " --set training.method=lora --set model.quantize=nf4", false);
  const json nf4 = json::parse(r.out);
  EXPECT_LT(nf4["traffic_per_step"]["weights_up_bytes"].get<double>(),
            0.35 * nf4["traffic_per_step"]["weights_up_unquantised_bytes"].get<double>())
      << r.out;
}

// gpt-oss-20b (its published config.json): the model card says 21B parameters and 3.6B active per
// token, counting the LM head but not the embedding (a lookup); Rondo's active count includes the
// embedding (201088 x 2880 = 0.58B).
TEST_F(Offload, PlansAGptOssFromItsConfigAlone) {
  const fs::path oss = dir / "gpt-oss-20b";
  fs::create_directories(oss);
  json layer_types = json::array();
  for (int l = 0; l < 24; ++l)
    layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  std::ofstream(oss / "config.json") << json{
      {"architectures", {"GptOssForCausalLM"}},
      {"model_type", "gpt_oss"},
      {"hidden_size", 2880},
      {"intermediate_size", 2880},
      {"num_hidden_layers", 24},
      {"num_attention_heads", 64},
      {"num_key_value_heads", 8},
      {"head_dim", 64},
      {"num_local_experts", 32},
      {"experts_per_token", 4},
      {"num_experts_per_tok", 4},
      {"sliding_window", 128},
      {"layer_types", layer_types},
      {"vocab_size", 201088},
      {"max_position_embeddings", 131072},
      {"rms_norm_eps", 1e-5},
      {"rope_scaling",
       {{"rope_type", "yarn"},
        {"factor", 32.0},
        {"beta_fast", 32.0},
        {"beta_slow", 1.0},
        {"truncate", false},
        {"original_max_position_embeddings", 4096}}},
      {"rope_theta", 150000.0},
      {"attention_bias", true},
      {"swiglu_limit", 7.0},
      {"tie_word_embeddings", false},
      {"torch_dtype", "bfloat16"}}.dump(2);
  const std::string base = plan_on_a_4090(oss);
  Result r = run_rondo(base + " --set training.method=full", false);
  const json full = json::parse(r.out);
  EXPECT_NEAR(full["params"].get<double>(), 21e9, 0.15e9) << r.out;
  EXPECT_NEAR(full["active_params"].get<double>() - 201088.0 * 2880, 3.6e9, 0.05e9);
  EXPECT_EQ(full["experts"], 32);
  EXPECT_EQ(full["experts_per_token"], 4);
  r = run_rondo(base + " --set training.method=lora", false);  // attention adapters
  const json plan = json::parse(r.out);
  std::printf(
      "gpt-oss-20b: %.2f B parameters, %.2f B active; LoRA, RTX 4090, 96 GB: %s, step %.1f s\n",
      full["params"].get<double>() / 1e9, full["active_params"].get<double>() / 1e9,
      plan["verdict"].get<std::string>().c_str(), plan["step_seconds"].get<double>());
  EXPECT_NE(plan["verdict"], "does not fit") << r.out;
  EXPECT_EQ(r.code, 0);
}

}  // namespace
