// The CPU speed the planner assumes: measured on a block of the model's own shape, cached per
// machine and shape so that repeated estimates agree, robust to a bad cache file, and quick for
// blocks far larger than a desktop CPU would train (measured narrower).
#include "engine/speed.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

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
  fs::path dir_;
  std::string old_;
};

TEST_F(SpeedCache, AMeasurementIsCachedAndRepeatsExactly) {
  EXPECT_EQ(speed_cache_dir(), dir_.string());
  const models::ModelConfig c = shape(128, 344, 4, 2);
  const double first = cpu_flops(c, 64, 1, "fp32");
  EXPECT_GT(first, 1e6);  // any CPU does a million FLOP/s
  ASSERT_EQ(files().size(), 1u);
  // The same machine and shape: the cached figure, exactly (repeated `rondo plan` calls agree).
  EXPECT_EQ(cpu_flops(c, 64, 1, "fp32"), first);
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
  EXPECT_EQ(cpu_optimizer_params_per_s("bf16"), adamw);
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
  EXPECT_EQ(cpu_flops(c, 64, 1, "fp32"), again);  // the rewritten file is read back
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
  EXPECT_EQ(cpu_flops(c, 64, 1, "fp32", true, &r8), lora);
  cpu_flops(c, 64, 1, "fp32", true, &r16);
  cpu_flops(c, 64, 1, "fp32", true, &attention);
  EXPECT_EQ(files().size(), 3u);
  const double head = cpu_head_flops(c, 64, 1, "fp32", /*trained_head=*/false);
  EXPECT_GT(head, 1e6);
  EXPECT_EQ(cpu_head_flops(c, 64, 1, "fp32", false), head);
  EXPECT_GT(cpu_head_flops(c, 64, 1, "fp32", /*trained_head=*/true), 1e6);
  EXPECT_EQ(files().size(), 5u);
  // Llama-3-70B's head (128256 x 8192, 1B parameters) is measured on fewer vocabulary rows.
  models::ModelConfig big = shape(8192, 28672, 64, 8);
  big.vocab_size = 128256;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_GT(cpu_head_flops(big, 4096, 1, "bf16", true), 1e6);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
}

TEST_F(SpeedCache, AnUnwritableCacheOnlyCostsTheMeasurement) {
  ::setenv("RONDO_SPEED_CACHE", "/proc/rondo-cannot-write-here", 1);
  EXPECT_GT(cpu_flops(shape(64, 172, 4, 2), 32, 1, "fp32"), 1e6);
}

}  // namespace
}  // namespace rondo::engine
