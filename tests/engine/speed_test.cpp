// The CPU speed the planner assumes: measured on a block of the model's own shape, cached per
// machine and shape so that repeated estimates agree, robust to a bad cache file, and quick for
// blocks far larger than a desktop CPU would train (measured narrower).
#include "engine/speed.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "models/config.h"
#include "models/lora.h"

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;

models::ModelConfig shape(int hidden, int ffn, int heads, int kv) {
  return models::parse_hf_config(
      "{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":32000,\"hidden_size\":" +
          std::to_string(hidden) + ",\"intermediate_size\":" + std::to_string(ffn) +
          ",\"num_hidden_layers\":4,\"num_attention_heads\":" + std::to_string(heads) +
          ",\"num_key_value_heads\":" + std::to_string(kv) + "}",
      "test config");
}

// Points the cache at a fresh folder for the test, and back after.
class SpeedCache : public ::testing::Test {
 protected:
  void SetUp() override {
    // One folder per test and process: ctest runs the tests in parallel processes.
    dir_ = fs::path(::testing::TempDir()) /
           ("speed_cache_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    if (const char* old = std::getenv("RONDO_SPEED_CACHE")) old_ = old;
    ::setenv("RONDO_SPEED_CACHE", dir_.c_str(), 1);
  }
  void TearDown() override {
    if (old_.empty())
      ::unsetenv("RONDO_SPEED_CACHE");
    else
      ::setenv("RONDO_SPEED_CACHE", old_.c_str(), 1);
    fs::remove_all(dir_);
  }
  std::vector<fs::path> files() const {
    std::vector<fs::path> out;
    if (fs::exists(dir_))
      for (const auto& e : fs::directory_iterator(dir_))
        out.push_back(e.path());
    return out;
  }
  // The share of the cores other programs took while the figure in `file` was measured.
  static double busy_of(const fs::path& file) {
    std::ifstream in(file);
    return nlohmann::json::parse(in).value("busy", 1.0);
  }
  // ... in the file whose key has `part`.
  double busy_where(const std::string& part) const {
    for (const fs::path& f : files()) {
      std::ifstream in(f);
      const nlohmann::json j = nlohmann::json::parse(in);
      if (j.value("key", "").find(part) != std::string::npos) return j.value("busy", 1.0);
    }
    return 1.0;
  }
  fs::path dir_;
  std::string old_;
};

TEST_F(SpeedCache, AMeasurementIsCachedAndRepeatsExactly) {
  EXPECT_EQ(speed_cache_dir(), dir_.string());
  const models::ModelConfig c = shape(128, 344, 4, 2);
  const double first = cpu_flops(c, 64, 1, "fp32");
  EXPECT_GT(first, 1e6);  // any CPU does a million FLOP/s
  ASSERT_EQ(files().size(), 1u);
  // The same machine and shape: the cached figure, exactly (repeated `rondo plan` calls agree),
  // unless other programs disturbed the probe and the machine is quiet now (Note [A probe on a
  // busy machine]): ctest runs tests side by side.
  if (busy_of(files()[0]) <= 0.25) EXPECT_EQ(cpu_flops(c, 64, 1, "fp32"), first);
  // Another shape, sequence length, row count, dtype or method is measured and cached apart.
  cpu_flops(shape(64, 172, 4, 2), 64, 1, "fp32");
  cpu_flops(c, 32, 1, "fp32");
  cpu_flops(c, 64, 2, "fp32");
  cpu_flops(c, 64, 1, "bf16");
  EXPECT_GT(cpu_flops(c, 64, 1, "fp32", /*frozen_weights=*/true), 1e6);
  EXPECT_EQ(files().size(), 6u);
  // The optimizer's speed: measured once per streaming dtype, then read back.
  const double adamw = cpu_optimizer_params_per_s("bf16");
  EXPECT_GT(adamw, 1e6);  // any CPU updates a million parameters a second
  if (busy_where("stream=bf16") <= 0.25) EXPECT_EQ(cpu_optimizer_params_per_s("bf16"), adamw);
  cpu_optimizer_params_per_s("fp32");
  EXPECT_EQ(files().size(), 8u);
}

TEST_F(SpeedCache, ABrokenCacheFileIsMeasuredAgainAndRewritten) {
  const models::ModelConfig c = shape(128, 344, 4, 2);
  cpu_flops(c, 64, 1, "fp32");
  ASSERT_EQ(files().size(), 1u);
  { std::ofstream(files()[0]) << "{\"key\": \"not this one\", \"flops\": 5"; }  // truncated
  const double again = cpu_flops(c, 64, 1, "fp32");
  EXPECT_GT(again, 1e6);
  // The rewritten file is read back (when it was measured on a quiet machine).
  if (busy_of(files()[0]) <= 0.25) EXPECT_EQ(cpu_flops(c, 64, 1, "fp32"), again);
}

TEST_F(SpeedCache, ALargeBlockIsMeasuredNarrowerAndQuickly) {
  // A 70B-class block (C = 8192, FFN 28672, 64 query / 8 key-value heads: 0.9B parameters)
  // would take seconds per pass here and gigabytes for its gradients.
  const auto t0 = std::chrono::steady_clock::now();
  const double flops = cpu_flops(shape(8192, 28672, 64, 8), 4096, 1, "bf16");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(flops, 1e6);
  EXPECT_LT(s, 60.0);  // generous: a loaded 2-core machine under a sanitizer
}

// A LoRA run's block is measured with its adapters, and the head on its own (in the engine's
// chunks of logits): each cached apart, by rank and targets, and by whether the head is trained.
TEST_F(SpeedCache, LoraBlocksAndTheHeadAreMeasuredAndCachedApart) {
  models::ModelConfig c = shape(128, 344, 4, 2);
  c.vocab_size = 5000;
  const models::LoraConfig r8{.rank = 8}, r16{.rank = 16},
      attention{.rank = 8, .targets = {"q_proj", "v_proj"}};
  const double lora = cpu_flops(c, 64, 1, "fp32", true, &r8);
  EXPECT_GT(lora, 1e6);
  if (busy_of(files()[0]) <= 0.25) EXPECT_EQ(cpu_flops(c, 64, 1, "fp32", true, &r8), lora);
  cpu_flops(c, 64, 1, "fp32", true, &r16);
  cpu_flops(c, 64, 1, "fp32", true, &attention);
  EXPECT_EQ(files().size(), 3u);
  const double head = cpu_head_flops(c, 64, 1, "fp32", /*trained_head=*/false);
  EXPECT_GT(head, 1e6);
  if (busy_where("|head|") <= 0.25) EXPECT_EQ(cpu_head_flops(c, 64, 1, "fp32", false), head);
  EXPECT_GT(cpu_head_flops(c, 64, 1, "fp32", /*trained_head=*/true), 1e6);
  EXPECT_EQ(files().size(), 5u);
  // Llama-3-70B's head (128256 x 8192, 1B parameters) is measured on fewer vocabulary rows.
  models::ModelConfig big = shape(8192, 28672, 64, 8);
  big.vocab_size = 128256;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_GT(cpu_head_flops(big, 4096, 1, "bf16", true), 1e6);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
}

// A probe while other programs keep every core busy (here: as many spinning child processes as
// cores) knows it: the cached figure is marked with the share they took, and plans that use it say
// so (speed_probe_caveat). Before, the figure was cached as if measured on a quiet machine and
// used by every later plan.
TEST_F(SpeedCache, AProbeOnABusyMachineIsMarkedAndNamed) {
  const long cores = std::max<long>(::sysconf(_SC_NPROCESSORS_ONLN), 1);
  std::vector<pid_t> spinners;
  for (long k = 0; k < cores; ++k) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0)
      for (volatile unsigned long n = 0;; n = n + 1) {
      }
    spinners.push_back(pid);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double speed = cpu_optimizer_params_per_s("fp32");
  for (pid_t pid : spinners) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  EXPECT_GT(speed, 0);
  ASSERT_EQ(files().size(), 1u);
  EXPECT_GT(busy_of(files()[0]), 0.25);
  EXPECT_GT(speed_probe_caveat(), 0.25);
}

// What a run corrects: forget_cpu_speeds() removes this machine's figures, and only those (another
// CPU's, sharing the folder, stay).
TEST_F(SpeedCache, ForgettingDropsThisMachinesFiguresOnly) {
  cpu_flops(shape(64, 172, 4, 2), 32, 1, "fp32");
  cpu_optimizer_params_per_s("fp32");
  ASSERT_EQ(files().size(), 2u);
  const fs::path other = dir_ / "other.json";
  std::ofstream(other) << R"({"key": "median-0.4s-busy|cpu=Another CPU|threads=64|C=64", )"
                       << R"("value": 1e12, "busy": 0})";
  EXPECT_EQ(forget_cpu_speeds(), 2);
  EXPECT_EQ(files(), std::vector<fs::path>{other});
}

TEST_F(SpeedCache, AnUnwritableCacheOnlyCostsTheMeasurement) {
  ::setenv("RONDO_SPEED_CACHE", "/proc/rondo-cannot-write-here", 1);
  EXPECT_GT(cpu_flops(shape(64, 172, 4, 2), 32, 1, "fp32"), 1e6);
}

}  // namespace
}  // namespace rondo::engine
