// The planner's device memory is what a run really holds: `rondo train` on a simulated device,
// whose ledger counts the engine's buffers and everything torch allocates for its work
// (Note [Torch's memory on a simulated device], engine/torch_device.cpp), peaks within 10% of the
// plan's prediction at sequence lengths spanning 16x. And under a cap smaller than one block's
// untiled activations at its length the planner tiles the sequence through the blocks: the run
// completes under the cap and trains what the uncapped, untiled run trains. About 25 s.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../support/tiny_model_folder.h"
#include "models/safetensors.h"
#include "run_files.h"
#include "run_rondo.h"

namespace rondo::test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct MemoryModel : ::testing::Test {
  fs::path dir, data;
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("rondo-memory-test-" + std::to_string(::getpid()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    // Plain text, documents of 60 to 120 words (a few hundred tokens), packed into the rows.
    data = dir / "train.jsonl";
    std::mt19937 rng(1);
    const char* words[] = {"alpha", "beta",  "gamma", "delta", "river",
                           "stone", "cloud", "light", "quiet", "north"};
    std::ofstream out(data);
    for (int i = 0; i < 400; ++i) {
      std::string text;
      const int n = 60 + static_cast<int>(rng() % 61);
      for (int w = 0; w < n; ++w)
        text += std::string(w ? " " : "") + words[rng() % 10];
      out << json{{"text", text}}.dump() << "\n";
    }
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir);
  }

  fs::path model(const std::string& name, int hidden, int intermediate) const {
    const fs::path m = dir / name;
    write_model_folder(m.string(), 1,
                       {.layers = 2,
                        .max_positions = 8192,
                        .hidden = hidden,
                        .intermediate = intermediate,
                        .heads = 4,
                        .kv_heads = 2});
    return m;
  }

  struct Run {
    std::string plan;
    double predicted = 0, measured = 0;  // device 0's peak bytes
    std::vector<double> losses;
    fs::path folder;
  };
  // Two LoRA steps of one fp32 row of `seq_len` tokens on one simulated device.
  Run train(const fs::path& m, std::int64_t seq_len, const std::string& name,
            const std::string& extra = "") const {
    Run r;
    r.folder = dir / name;
    const Result out =
        run_rondo("train --set model.path=" + m.string() +
                  " --set model.dtype=fp32 --set data.train=" + data.string() +
                  " --set data.seq_len=" + std::to_string(seq_len) +
                  " --set lora.rank=4 --set lora.alpha=8 --set training.steps=2 --set "
                  "training.batch_rows=1 --set training.grad_accum=1 --set training.seed=3 --set "
                  "training.lr=1e-2 --set training.warmup_steps=0 --set training.eps=1e-4 --set "
                  "checkpoint.every=0 --set hardware.sim_devices=1 --set output.run_dir=" +
                  r.folder.string() + " " + extra);
    EXPECT_EQ(out.code, 0) << out.out;
    if (out.code != 0) return r;
    for (const json& e : events(r.folder / "events.jsonl")) {
      if (e["type"] == "plan") {
        r.plan = e["plan"];
        r.predicted = e["predicted_peak_bytes"][0].get<double>();
      }
      if (e["type"] == "device" && e["device"] == 0)
        r.measured = std::max(r.measured, e["bytes_peak"].get<double>());
      if (e["type"] == "step") r.losses.push_back(e["loss"]);
    }
    return r;
  }
};

TEST_F(MemoryModel, PlannedDevicePeakIsTheLedgersWithinTenPercentAcrossLengths) {
  // One block balanced between attention and the MLP, one whose MLP is nearly all of it; and the
  // balanced one tiled through the sequence (attention half and MLP, tiles of 256 tokens).
  struct Shape {
    int hidden, intermediate;
    const char* tile;
  };
  for (const Shape& shape : {Shape{64, 256, ""}, Shape{32, 4096, ""},
                             Shape{64, 256, "--set training.sequence_tile=256"}}) {
    const fs::path m =
        model("model-" + std::to_string(shape.intermediate), shape.hidden, shape.intermediate);
    for (std::int64_t len : {512, 1024, 2048, 8192}) {
      const Run r = train(m, len,
                          "run-" + std::to_string(shape.intermediate) + "-" + std::to_string(len) +
                              (*shape.tile ? "-tiled" : ""),
                          shape.tile);
      ASSERT_GT(r.measured, 0);
      const double ratio = r.predicted / r.measured;
      std::printf("C=%d I=%d, %5lld tokens: planned %.1f MiB, ledger %.1f MiB (%.3f) %s\n",
                  shape.hidden, shape.intermediate, static_cast<long long>(len),
                  r.predicted / 1048576.0, r.measured / 1048576.0, ratio, r.plan.c_str());
      EXPECT_NEAR(ratio, 1.0, 0.10)
          << len << " tokens, I = " << shape.intermediate << " " << shape.tile;
      if (*shape.tile) EXPECT_NE(r.plan.find("tile=256"), std::string::npos) << r.plan;
    }
  }
}

TEST_F(MemoryModel, ACapBelowOneBlocksActivationsTilesTheSequenceAndTrainsTheSame) {
  const fs::path m = model("model", 32, 4096);
  // One block's MLP intermediates at 8,192 tokens: 4 x 4096 fp32 values a token, 512 MiB.
  const double untiled_block = 4.0 * 4096 * 4 * 8192;
  const Run whole = train(m, 8192, "whole");
  const Run tiled = train(m, 8192, "tiled", "--set hardware.memory_cap=256MiB");
  std::printf("untiled: %s, peak %.1f MiB; under 256 MiB: %s, peak %.1f MiB (planned %.1f)\n",
              whole.plan.c_str(), whole.measured / 1048576.0, tiled.plan.c_str(),
              tiled.measured / 1048576.0, tiled.predicted / 1048576.0);
  EXPECT_EQ(whole.plan.find("tile="), std::string::npos) << "no cap, no tiling";
  EXPECT_NE(tiled.plan.find("tile="), std::string::npos) << tiled.plan;
  EXPECT_GT(whole.measured, untiled_block);
  EXPECT_LE(tiled.measured, 256.0 * 1048576.0);
  EXPECT_LT(tiled.measured, untiled_block / 2);
  EXPECT_NEAR(tiled.predicted / tiled.measured, 1.0, 0.10);
  ASSERT_EQ(tiled.losses.size(), 2u);
  ASSERT_EQ(whole.losses.size(), 2u);
  for (std::size_t s = 0; s < 2; ++s)
    EXPECT_NEAR(tiled.losses[s], whole.losses[s], 1e-5 * std::abs(whole.losses[s])) << s;
  // The trained adapters: the tiles sum the weight gradients in another order, nothing else.
  // (AdamW's eps is 1e-4 here, as in the oracle tests: with 1e-8 its first steps move an entry
  // whose gradient nearly cancels by up to the learning rate times that rounding over eps, 1e-3
  // of the largest entry in the MLP's adapters.)
  models::SafetensorsFile a((whole.folder / "adapter" / "adapter_model.safetensors").string());
  models::SafetensorsFile b((tiled.folder / "adapter" / "adapter_model.safetensors").string());
  ASSERT_FALSE(a.tensors().empty());
  for (const models::TensorEntry& e : a.tensors()) {
    const std::string& name = e.name;
    ASSERT_NE(b.find(name), nullptr) << name;
    const at::Tensor x = e.view().to(at::kFloat), y = b.find(name)->view().to(at::kFloat);
    const double scale = x.abs().max().item<double>();
    EXPECT_LE((x - y).abs().max().item<double>(), 1e-4 * scale) << name;
  }
}

}  // namespace
}  // namespace rondo::test
