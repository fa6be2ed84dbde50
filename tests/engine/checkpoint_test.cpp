// Checkpoints: a write then a read into a fresh store gives back the training state bit for bit
// (masters, moments, streaming copies: kept when stale, else rounded from the master as the
// optimizer rounds them), for full fine-tuning with frozen tensors, tied embeddings and LoRA; the
// folder protocol (leftover "*.tmp", folders without state.json, overwrite, prune); and reads that
// refuse a checkpoint of another model or setting before touching the store.
#include "engine/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "engine/model_store.h"
#include "engine/run_lock.h"
#include "kernels/checksum.h"
#include "kernels/error.h"
#include "models/lora.h"
#include "models/safetensors.h"
#include "tests/support/error_of.h"
#include "tests/support/plain_loop.h"

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;
using kernels::FloatDType;

struct Model {
  std::vector<models::LayerSpec> specs;
  std::map<std::string, at::Tensor> weights;
};

Model llama() {
  const models::ModelConfig config = test::tiny_llama(2);
  return {models::layer_specs(config), test::random_weights(config)};
}

Model qwen2_tied() {
  const models::ModelConfig config = test::tiny_qwen2(2);
  return {models::layer_specs(config), test::random_weights(config)};
}

Model llama_lora(int rank) {
  Model m = llama();
  m.specs = models::add_lora(m.specs, {.rank = rank, .alpha = 2.0 * rank});
  for (auto& [name, t] : models::init_lora(m.specs, /*seed=*/1))
    m.weights[name] = t;
  return m;
}

using Trainable = std::function<bool(const std::string&)>;
bool all(const std::string&) {
  return true;
}
bool mlp_and_norms(const std::string& n) {
  return n.find(".mlp.") != std::string::npos || n.find("norm") != std::string::npos;
}

// A store holding a model's weights, as a run builds it before training or resuming.
struct TestStore {
  TestStore(const Model& m, const Trainable& trainable, FloatDType stream_dtype,
            offload::MomentFormat moments = offload::MomentFormat::kF32)
      : specs(m.specs), store(arena, descs(m, trainable, moments), stream_dtype, FloatDType::kF32) {
    load_weights(store, specs, [&](const std::string& n) { return m.weights.at(n); });
  }
  static std::vector<offload::LayerDesc> descs(const Model& m, const Trainable& trainable,
                                               offload::MomentFormat moments) {
    auto d = layer_descs(m.specs, [&](const models::ParamSpec& p) { return trainable(p.name); });
    for (offload::LayerDesc& layer : d)
      layer.moments = moments;
    return d;
  }
  bool eight_bit() const { return store.moments(0) == offload::MomentFormat::kBlockwise8; }
  // The moments' views: f32 m and v, or the 8-bit codes and absmax.
  std::vector<std::pair<const char*, StateView>> moment_views() const {
    if (!eight_bit()) return {{"/m", StateView::kM}, {"/v", StateView::kV}};
    return {{"/m_codes", StateView::kMCodes},
            {"/m_absmax", StateView::kMAbsmax},
            {"/v_codes", StateView::kVCodes},
            {"/v_absmax", StateView::kVAbsmax}};
  }

  at::Tensor view(std::size_t l, std::size_t i, StateView what) const {
    return state_view(store, specs, l, i, what);
  }

  // Random state as training leaves it: masters, moments and gradients, and streaming copies
  // that lag the masters (one-step-stale) when `stale`, else the masters rounded.
  void fill_random(bool stale) {
    for (std::size_t l = 0; l < store.layers(); ++l)
      for (std::size_t i = 0; i < store.layer(l).size(); ++i) {
        const offload::TensorState& t = store.layer(l)[i];
        if (!t.trainable) continue;
        view(l, i, StateView::kGrad).copy_(at::randn(view(l, i, StateView::kGrad).sizes()));
        if (t.tied) continue;
        at::Tensor master = view(l, i, StateView::kMaster);
        master.copy_(at::randn(master.sizes()));
        for (auto [suffix, what] : moment_views()) {
          at::Tensor st = view(l, i, what);
          st.copy_(st.scalar_type() == at::kByte ? at::randint(256, st.sizes(), at::kByte)
                                                 : 1e-2 * at::rand(st.sizes()));
        }
        view(l, i, StateView::kStream)
            .copy_(stale ? master + 1e-2 * at::randn(master.sizes()) : master);
      }
  }

  // Every state the store has, by "<name>/<state>", copied.
  std::map<std::string, at::Tensor> snapshot() const {
    std::map<std::string, at::Tensor> out;
    for (std::size_t l = 0; l < store.layers(); ++l)
      for (std::size_t i = 0; i < store.layer(l).size(); ++i) {
        const offload::TensorState& t = store.layer(l)[i];
        const std::string& name = specs[l].params[i].name;
        if (t.trainable)
          out[name + "/grad@" + std::to_string(l)] = view(l, i, StateView::kGrad).clone();
        if (t.tied) continue;
        out[name + "/stream"] = view(l, i, StateView::kStream).clone();
        if (!t.trainable) continue;
        out[name + "/master"] = view(l, i, StateView::kMaster).clone();
        for (auto [suffix, what] : moment_views())
          out[name + suffix] = view(l, i, what).clone();
      }
    return out;
  }

  std::vector<models::LayerSpec> specs;
  offload::HostArena arena;  // before the store: it allocates from it
  offload::LayerStore store;
};

// Bytes, not values: -0 vs +0 or a NaN payload would count.
bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(-1).view(at::kByte),
                   b.contiguous().view(-1).view(at::kByte));
}

// A fresh folder per test, removed after.
class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) /
            ("rondo-ckpt-" + std::string(info->name()) + "-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string step_dir(std::int64_t step) const {
    return (root_ / "checkpoints" / ("step-" + std::to_string(step))).string();
  }
  std::vector<std::int64_t> steps() const {
    std::vector<std::int64_t> out;
    for (const CheckpointInfo& c : list_checkpoints(root_.string()))
      out.push_back(c.step);
    return out;
  }

  // Writes, reads into a fresh store holding different random state, and checks every byte.
  void round_trip(const Model& m, const Trainable& trainable, FloatDType stream_dtype, bool stale,
                  bool include_stream,
                  offload::MomentFormat moments = offload::MomentFormat::kF32) {
    TestStore src(m, trainable, stream_dtype, moments);
    src.fill_random(stale);
    const auto before = src.snapshot();
    const nlohmann::json meta = {{"step", 40},
                                 {"rng", {{"seed", 7}, {"offset", 123456789012345LL}}},
                                 {"data", {{"epoch", 1}, {"position", 8191}}},
                                 {"loss_scale", 65536.0}};
    const std::uint64_t bytes =
        write_checkpoint(step_dir(40), src.store, src.specs, meta, include_stream);
    EXPECT_EQ(bytes, fs::file_size(fs::path(step_dir(40)) / "state.safetensors") +
                         fs::file_size(fs::path(step_dir(40)) / "state.json"));
    EXPECT_FALSE(fs::exists(step_dir(40) + ".tmp"));

    // The file holds exactly the owned trainable tensors: master and moments (two f32, or four
    // 8-bit: codes and absmax of each), and the stream when asked.
    std::size_t owned = 0;
    for (std::size_t l = 0; l < src.store.layers(); ++l)
      for (const offload::TensorState& t : src.store.layer(l))
        owned += t.trainable && !t.tied;
    ASSERT_GT(owned, 0u);
    models::SafetensorsFile file((fs::path(step_dir(40)) / "state.safetensors").string());
    EXPECT_EQ(file.tensors().size(),
              owned * (1 + src.moment_views().size() + (include_stream ? 1 : 0)));

    TestStore dst(m, trainable, stream_dtype, moments);
    dst.fill_random(true);
    EXPECT_EQ(read_checkpoint(step_dir(40), dst.store, dst.specs), meta);
    const auto after = dst.snapshot();
    ASSERT_EQ(after.size(), before.size());

    std::size_t stale_differs = 0;
    for (std::size_t l = 0; l < dst.store.layers(); ++l)
      for (std::size_t i = 0; i < dst.store.layer(l).size(); ++i) {
        const offload::TensorState& t = dst.store.layer(l)[i];
        const std::string& name = dst.specs[l].params[i].name;
        if (t.trainable) {
          const at::Tensor g = after.at(name + "/grad@" + std::to_string(l));
          EXPECT_EQ(g.count_nonzero().item<std::int64_t>(), 0) << name << " gradient not zeroed";
        }
        if (t.tied) continue;
        const at::Tensor stream = after.at(name + "/stream");
        if (!t.trainable) {  // frozen: the model's weights, never in a checkpoint
          EXPECT_TRUE(same_bytes(stream, before.at(name + "/stream"))) << name;
          continue;
        }
        EXPECT_TRUE(same_bytes(after.at(name + "/master"), before.at(name + "/master"))) << name;
        for (auto [suffix, what] : dst.moment_views())
          EXPECT_TRUE(same_bytes(after.at(name + suffix), before.at(name + suffix)))
              << name << suffix;
        if (include_stream) {
          EXPECT_TRUE(same_bytes(stream, before.at(name + "/stream"))) << name << " stream";
        } else {
          // torch's round-to-nearest-even, independent of the kernel the reader uses.
          const at::Tensor rounded = before.at(name + "/master").to(scalar_type(stream_dtype));
          EXPECT_TRUE(same_bytes(stream, rounded)) << name << " stream not the rounded master";
        }
        stale_differs += !same_bytes(stream, before.at(name + "/stream"));
      }
    // The test can tell a kept stale stream from a re-rounded one.
    if (stale && !include_stream) {
      EXPECT_GT(stale_differs, 0u);
    }
    if (include_stream) {
      EXPECT_EQ(stale_differs, 0u);
    }
  }

  fs::path root_;
};

TEST_F(CheckpointTest, RoundTripBf16StreamRoundedFromMaster) {
  round_trip(llama(), mlp_and_norms, FloatDType::kBF16, /*stale=*/true, /*include_stream=*/false);
}

TEST_F(CheckpointTest, RoundTripBf16StaleStreamKept) {
  round_trip(llama(), mlp_and_norms, FloatDType::kBF16, /*stale=*/true, /*include_stream=*/true);
}

TEST_F(CheckpointTest, RoundTripTiedEmbeddingF16) {
  round_trip(qwen2_tied(), all, FloatDType::kF16, /*stale=*/false, /*include_stream=*/false);
}

TEST_F(CheckpointTest, RoundTripTiedEmbeddingStaleStreamKept) {
  round_trip(qwen2_tied(), all, FloatDType::kBF16, /*stale=*/true, /*include_stream=*/true);
}

// 8-bit moments (training.optimizer = "adamw_8bit"): their codes and absmax round-trip bit for
// bit, the tied embedding's with its owner's.
TEST_F(CheckpointTest, RoundTrip8bitMoments) {
  round_trip(qwen2_tied(), all, FloatDType::kBF16, /*stale=*/true, /*include_stream=*/true,
             offload::MomentFormat::kBlockwise8);
  round_trip(llama(), mlp_and_norms, FloatDType::kF32, /*stale=*/false, /*include_stream=*/false,
             offload::MomentFormat::kBlockwise8);
}

// A checkpoint whose moments are kept the other way than the run keeps them is refused in one
// problem that names the setting, either way round.
TEST_F(CheckpointTest, ReadRefusesMomentsOfTheOtherFormat) {
  for (auto [written, read] :
       {std::pair{offload::MomentFormat::kF32, offload::MomentFormat::kBlockwise8},
        std::pair{offload::MomentFormat::kBlockwise8, offload::MomentFormat::kF32}}) {
    TestStore src(llama(), all, FloatDType::kBF16, written);
    src.fill_random(false);
    write_checkpoint(step_dir(1), src.store, src.specs, {{"step", 1}}, false);
    TestStore dst(llama(), all, FloatDType::kBF16, read);
    const std::string msg =
        test::error_of([&] { read_checkpoint(step_dir(1), dst.store, dst.specs); });
    EXPECT_NE(msg.find("this checkpoint keeps the AdamW moments of"), std::string::npos) << msg;
    EXPECT_NE(msg.find("training.optimizer"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("unknown tensor"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("missing"), std::string::npos) << msg;
    fs::remove_all(step_dir(1));
  }
}

TEST_F(CheckpointTest, RoundTripLoraF32) {
  round_trip(llama_lora(4), models::is_lora_param, FloatDType::kF32, /*stale=*/false,
             /*include_stream=*/false);
}

TEST_F(CheckpointTest, StateJsonMarksFormatAndMeta) {
  const Model m = llama();
  TestStore s(m, all, FloatDType::kF32);
  s.fill_random(false);
  write_checkpoint(step_dir(3), s.store, s.specs, {{"step", 3}});
  std::ifstream in(fs::path(step_dir(3)) / "state.json");
  const nlohmann::json state = nlohmann::json::parse(in);
  EXPECT_EQ(state.at("format"), "rondo-checkpoint");
  EXPECT_EQ(state.at("version"), 2);
  EXPECT_EQ(state.at("meta"), nlohmann::json({{"step", 3}}));
  // The tensors file's size and XXH3-64, recomputed here from the file's bytes.
  const fs::path tensors = fs::path(step_dir(3)) / "state.safetensors";
  std::ifstream t(tensors, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(t)), std::istreambuf_iterator<char>());
  EXPECT_EQ(state.at("files").at("state.safetensors").at("bytes"), bytes.size());
  EXPECT_EQ(state.at("files").at("state.safetensors").at("xxh3_64"),
            kernels::hex64(kernels::xxh3(bytes.data(), bytes.size())));
  EXPECT_TRUE(checkpoint_problems(step_dir(3)).empty());
}

// What checkpoint_problems finds, one damage at a time, each on a fresh copy of a sound checkpoint.
TEST_F(CheckpointTest, ProblemsFindEachDamage) {
  const Model m = llama();
  TestStore s(m, all, FloatDType::kF32);
  s.fill_random(false);
  write_checkpoint(step_dir(4), s.store, s.specs, {{"step", 4}, {"optimizer_step", 4}});
  ASSERT_TRUE(checkpoint_problems(step_dir(4)).empty());
  const fs::path good = fs::path(step_dir(4));
  auto damaged = [&](const std::string& name, const std::function<void(const fs::path&)>& harm) {
    const fs::path copy = root_ / "damaged" / name;
    fs::create_directories(copy.parent_path());
    fs::remove_all(copy);
    fs::copy(good, copy);
    harm(copy);
    std::string all;
    bool own = false;
    for (const std::string& p : checkpoint_problems(copy.string(), &own))
      all += p + "\n";
    return all.empty() ? all : all + (own ? "(damaged)" : "(not its own fault)");
  };
  auto edit_state = [](const fs::path& dir, const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(dir / "state.json"));
    f(j);
    std::ofstream(dir / "state.json") << j.dump(2);
  };
  // One byte of the tensors flipped.
  std::string p = damaged("step-4", [](const fs::path& d) {
    std::fstream f(d / "state.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  });
  EXPECT_NE(p.find("does not match its checksum"), std::string::npos) << p;
  EXPECT_NE(p.find("(damaged)"), std::string::npos) << p;  // a resume sets it aside
  // A newer Rondo's: not damaged (a resume skips it and leaves it where it is).
  p = damaged("step-4",
              [&](const fs::path& d) { edit_state(d, [](auto& j) { j["version"] = 99; }); });
  EXPECT_NE(p.find("checkpoint version 99"), std::string::npos) << p;
  EXPECT_NE(p.find("(not its own fault)"), std::string::npos) << p;
  // A state.json far larger than any checkpoint writes: refused unread, and damaged.
  p = damaged("step-4", [](const fs::path& d) { fs::resize_file(d / "state.json", 17u << 20); });
  EXPECT_NE(p.find("is larger than 16.00 MiB"), std::string::npos) << p;
  EXPECT_NE(p.find("(damaged)"), std::string::npos) << p;
  // Truncated.
  p = damaged("step-4", [](const fs::path& d) {
    fs::resize_file(d / "state.safetensors", fs::file_size(d / "state.safetensors") - 4);
  });
  EXPECT_NE(p.find("truncated or replaced"), std::string::npos) << p;
  // The folder renamed: its name and the step disagree.
  p = damaged("step-8", [](const fs::path&) {});
  EXPECT_NE(p.find("says step 4 but the folder is step-8"), std::string::npos) << p;
  // The step edited (with or without the checksum of meta redone: the name still disagrees).
  p = damaged("step-4", [&](const fs::path& d) {
    edit_state(d, [](nlohmann::json& j) { j["meta"]["step"] = 9999; });
  });
  EXPECT_NE(p.find("\"meta\" does not match its checksum"), std::string::npos) << p;
  EXPECT_NE(p.find("says step 9999"), std::string::npos) << p;
  // The optimizer ahead of the step.
  p = damaged("step-4", [&](const fs::path& d) {
    edit_state(d, [](nlohmann::json& j) {
      j["meta"]["optimizer_step"] = 5;
      const std::string text = j["meta"].dump();
      j["meta_xxh3_64"] = kernels::hex64(kernels::xxh3(text.data(), text.size()));
    });
  });
  EXPECT_NE(p.find("optimizer step 5 is not within 0..4"), std::string::npos) << p;
  EXPECT_EQ(p.find("\"meta\" does not match"), std::string::npos) << p;
  // A number no integer or double holds (found by fuzz/state_json_fuzz: it escaped as a JSON
  // out_of_range exception instead of a problem).
  p = damaged("step-4", [](const fs::path& d) {
    std::ofstream(d / "state.json")
        << "{\"format\": \"rondo-checkpoint\", \"meta\": " + std::string(400, '9') + "}";
  });
  EXPECT_NE(p.find("state.json is not valid JSON"), std::string::npos) << p;
  // Not JSON.
  p = damaged("step-4", [](const fs::path& d) { std::ofstream(d / "state.json") << "{\"format"; });
  EXPECT_NE(p.find("state.json is not valid JSON"), std::string::npos) << p;
  EXPECT_EQ(p.find("not a Rondo checkpoint"), std::string::npos) << p;
  // A version 1 checkpoint (before checksums) is sound as long as its structure is.
  p = damaged("step-4", [&](const fs::path& d) {
    edit_state(d, [](nlohmann::json& j) {
      j["version"] = 1;
      j.erase("files");
      j.erase("meta_xxh3_64");
    });
  });
  EXPECT_EQ(p, "");
  TestStore back(m, all, FloatDType::kF32);
  EXPECT_EQ(
      read_checkpoint((root_ / "damaged" / "step-4").string(), back.store, back.specs).at("step"),
      4);
}

TEST_F(CheckpointTest, LeftoverTmpAndIncompleteFoldersIgnoredThenReplaced) {
  const Model m = llama();
  // A crash mid-write: "step-10.tmp" with garbage (even a state.json), and a folder whose
  // state.json was never written.
  const fs::path tmp = step_dir(10) + ".tmp";
  fs::create_directories(tmp);
  std::ofstream(tmp / "state.json") << "{\"format\": \"rondo-checkpoint\"}";
  std::ofstream(tmp / "garbage.bin") << "not a tensor";
  fs::create_directories(step_dir(20));
  std::ofstream(fs::path(step_dir(20)) / "state.safetensors") << "half";
  fs::create_directories(root_ / "checkpoints" / "step-x");
  std::ofstream(root_ / "checkpoints" / "step-x" / "state.json") << "{}";
  EXPECT_TRUE(steps().empty());

  TestStore s(m, all, FloatDType::kBF16);
  s.fill_random(true);
  write_checkpoint(step_dir(10), s.store, s.specs, {{"step", 10}});
  EXPECT_EQ(steps(), std::vector<std::int64_t>{10});
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(fs::path(step_dir(10)) / "garbage.bin"));
  TestStore back(m, all, FloatDType::kBF16);
  EXPECT_EQ(read_checkpoint(step_dir(10), back.store, back.specs).at("step"), 10);
}

TEST_F(CheckpointTest, OverwriteReplacesTheCheckpoint) {
  const Model m = llama();
  TestStore s(m, all, FloatDType::kBF16);
  s.fill_random(true);
  write_checkpoint(step_dir(10), s.store, s.specs, {{"version", "first"}}, true);
  // A crash between the renames of an earlier overwrite left an "old" one behind.
  fs::create_directories(step_dir(10) + ".old");
  s.fill_random(true);
  const auto second = s.snapshot();
  write_checkpoint(step_dir(10), s.store, s.specs, {{"version", "second"}}, true);
  EXPECT_FALSE(fs::exists(step_dir(10) + ".old"));
  EXPECT_FALSE(fs::exists(step_dir(10) + ".tmp"));
  EXPECT_EQ(steps(), std::vector<std::int64_t>{10});

  TestStore back(m, all, FloatDType::kBF16);
  EXPECT_EQ(read_checkpoint(step_dir(10), back.store, back.specs).at("version"), "second");
  const auto got = back.snapshot();
  for (const auto& [key, t] : second)
    if (key.find("/grad@") == std::string::npos) {
      EXPECT_TRUE(same_bytes(got.at(key), t)) << key;
    }
}

TEST_F(CheckpointTest, ListSortsByStepAndPruneKeepsNewest) {
  const Model m = llama_lora(2);
  TestStore s(m, models::is_lora_param, FloatDType::kBF16);
  s.fill_random(false);
  for (std::int64_t step : {100, 5, 20, 9})
    write_checkpoint(step_dir(step), s.store, s.specs, {{"step", step}});
  fs::create_directories(step_dir(7) + ".tmp");
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{5, 9, 20, 100}));  // 100 after 20: numeric
  EXPECT_EQ(list_checkpoints(root_.string()).back().path, step_dir(100));

  prune_checkpoints(root_.string(), 0);
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{5, 9, 20, 100}));
  prune_checkpoints(root_.string(), 2);
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{20, 100}));
  EXPECT_FALSE(fs::exists(step_dir(5)));
  EXPECT_FALSE(fs::exists(step_dir(9)));
  EXPECT_TRUE(fs::exists(step_dir(7) + ".tmp"));  // not a checkpoint: not prune's business
  prune_checkpoints(root_.string(), 5);
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{20, 100}));

  EXPECT_TRUE(list_checkpoints((root_ / "no-such-run").string()).empty());
}

// The checkpoint just written is never pruned for a newer folder left from before a resume; one
// set aside as damaged leaves the list (and keep's count) under a name list_checkpoints skips.
TEST_F(CheckpointTest, PruneKeepsTheOneJustWrittenAndSetAsideLeavesTheList) {
  const Model m = llama_lora(2);
  TestStore s(m, models::is_lora_param, FloatDType::kBF16);
  s.fill_random(false);
  for (std::int64_t step : {12, 10})
    write_checkpoint(step_dir(step), s.store, s.specs, {{"step", step}});
  prune_checkpoints(root_.string(), 1, 10);
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{10}));

  write_checkpoint(step_dir(12), s.store, s.specs, {{"step", 12}});
  EXPECT_EQ(set_aside_checkpoint(step_dir(12)), step_dir(12) + ".damaged");
  write_checkpoint(step_dir(12), s.store, s.specs, {{"step", 12}});
  EXPECT_EQ(set_aside_checkpoint(step_dir(12)), step_dir(12) + ".damaged.2");
  EXPECT_TRUE(fs::exists(fs::path(step_dir(12) + ".damaged") / "state.json"));
  EXPECT_EQ(steps(), (std::vector<std::int64_t>{10}));
  prune_checkpoints(root_.string(), 1, 10);
  EXPECT_TRUE(fs::exists(step_dir(12) + ".damaged.2"));  // not a checkpoint: not prune's business
}

// Reads that must fail, each leaving the store as it was.
void expect_read_error(const std::string& dir, TestStore& s,
                       const std::vector<std::string>& needles) {
  const auto before = s.snapshot();
  try {
    read_checkpoint(dir, s.store, s.specs);
    ADD_FAILURE() << "read_checkpoint(" << dir << ") did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir), std::string::npos) << what;
    for (const std::string& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << "no '" << n << "' in: " << what;
  }
  const auto after = s.snapshot();
  for (const auto& [key, t] : before)
    EXPECT_TRUE(same_bytes(after.at(key), t)) << key << " touched by a failed read";
}

TEST_F(CheckpointTest, ReadRefusesMissingTensor) {
  const Model m = llama();
  TestStore s(m, mlp_and_norms, FloatDType::kF32);
  s.fill_random(false);
  write_checkpoint(step_dir(1), s.store, s.specs, {});
  TestStore full(m, all, FloatDType::kF32);
  full.fill_random(false);
  expect_read_error(
      step_dir(1), full,
      {"no tensor model.layers.0.self_attn.q_proj.weight", "another model or LoRA setting"});
}

TEST_F(CheckpointTest, ReadRefusesUnknownTensorAndFullFineTuneIntoLora) {
  const Model m = llama();
  TestStore s(m, all, FloatDType::kF32);
  s.fill_random(false);
  write_checkpoint(step_dir(1), s.store, s.specs, {});

  TestStore part(m, mlp_and_norms, FloatDType::kF32);
  part.fill_random(false);
  expect_read_error(step_dir(1), part,
                    {"unknown tensor model.embed_tokens.weight —", "more unknown tensors"});

  const Model lora = llama_lora(4);
  TestStore adapters(lora, models::is_lora_param, FloatDType::kF32);
  adapters.fill_random(false);
  expect_read_error(step_dir(1), adapters,
                    {"no tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                     "unknown tensor model."});
}

TEST_F(CheckpointTest, ReadRefusesWrongShape) {
  TestStore rank4(llama_lora(4), models::is_lora_param, FloatDType::kF32);
  rank4.fill_random(false);
  write_checkpoint(step_dir(1), rank4.store, rank4.specs, {});
  TestStore rank8(llama_lora(8), models::is_lora_param, FloatDType::kF32);
  rank8.fill_random(false);
  expect_read_error(step_dir(1), rank8,
                    {"tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has "
                     "shape [4, 16], the model needs [8, 16]"});
}

TEST_F(CheckpointTest, ReadRefusesStreamOfAnotherDtype) {
  const Model m = llama();
  TestStore bf16(m, mlp_and_norms, FloatDType::kBF16);
  bf16.fill_random(true);
  write_checkpoint(step_dir(1), bf16.store, bf16.specs, {}, /*include_stream=*/true);
  TestStore f32(m, mlp_and_norms, FloatDType::kF32);
  f32.fill_random(true);
  expect_read_error(step_dir(1), f32, {"model.layers.0.mlp.up_proj.weight.stream is BF16"});
}

TEST_F(CheckpointTest, ReadRefusesWhatIsNotACheckpoint) {
  const Model m = llama();
  TestStore s(m, all, FloatDType::kF32);
  s.fill_random(false);

  // A Hugging Face model folder.
  const fs::path hf = root_ / "hf-model";
  fs::create_directories(hf);
  std::vector<std::pair<std::string, at::Tensor>> weights(m.weights.begin(), m.weights.end());
  models::write_safetensors((hf / "model.safetensors").string(), weights);
  expect_read_error(hf.string(), s, {"not a Rondo checkpoint", "state.json"});

  // A state.json of something else.
  std::ofstream(hf / "state.json") << R"({"format": "something-else", "version": 1})";
  expect_read_error(hf.string(), s, {"not a Rondo checkpoint"});

  // A checkpoint of a newer format.
  write_checkpoint(step_dir(2), s.store, s.specs, {});
  std::ofstream(fs::path(step_dir(2)) / "state.json")
      << R"({"format": "rondo-checkpoint", "version": 3, "meta": {}})";
  expect_read_error(step_dir(2), s, {"version 3"});

  expect_read_error((root_ / "nowhere").string(), s, {"no such checkpoint folder"});
}

// RunLock::holder says who holds a run folder (rondo chat asks before taking the GPUs a training
// run may be using), and nothing once the holder is gone or when there never was one.
TEST(RunLockHolder, NamesTheHolderWhileItHoldsTheLock) {
  const std::string dir = ::testing::TempDir() + "rondo-runlock-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  EXPECT_EQ(RunLock::holder(dir), "");  // no lock file yet
  {
    RunLock lock(dir, "rondo train");
    EXPECT_EQ(RunLock::holder(dir), "process " + std::to_string(::getpid()) + " (rondo train)");
    // Asking took nothing from the holder: a second writer is still refused.
    EXPECT_THROW(RunLock(dir, "rondo export"), Error);
  }
  EXPECT_EQ(RunLock::holder(dir), "");
  RunLock again(dir, "rondo train --resume");  // the probe left no lock behind
  std::filesystem::remove_all(dir);
}

// Two processes locking at the same instant: the loser may look before the winner has written
// its PID into the lock file. It waits a moment for it and names it; where it never comes, it says
// so (before, both cases read "in use by another process").
TEST(RunLockHolder, TheLoserOfARaceNamesTheWinner) {
  const std::string dir = ::testing::TempDir() + "rondo-runlock-race-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/" + RunLock::kFile;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // another open file description: as another process
  auto message = [&] {
    try {
      RunLock lock(dir, "rondo train --resume");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("locked");
  };
  // The PID written 100 ms after the lock was taken.
  std::thread winner([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string text = "4242 rondo train --resume\n";
    ASSERT_EQ(::pwrite(fd, text.data(), text.size(), 0), static_cast<ssize_t>(text.size()));
  });
  const std::string named = message();
  winner.join();
  EXPECT_NE(named.find("in use by process 4242 (rondo train --resume)"), std::string::npos)
      << named;
  // Never written.
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  const std::string unnamed = message();
  EXPECT_NE(unnamed.find("its PID, written there once it locks, could not be read"),
            std::string::npos)
      << unnamed;
  EXPECT_EQ(RunLock::holder(dir), "another process");
  ::close(fd);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace rondo::engine
