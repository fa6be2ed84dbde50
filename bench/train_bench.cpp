// train_bench: CPU tokens/s of `rondo train` (engine::Session, what the CLI runs: one CPU
// device, the planner's plan, batching, events) against the plain libtorch training loop
// (tests/support/plain_loop.h) on the same model, the same rows and the same trainable tensors,
// measured in one run — a ratio, not an absolute target. Steady state: the first `warmup` steps
// are left out of both. One torch thread for both (the engine's own threads are not limited).
//
//   train_bench [--steps 12] [--method lora|full]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "engine/batching.h"
#include "engine/data.h"
#include "engine/session.h"
#include "models/chat_template.h"
#include "models/lora.h"
#include "models/model.h"
#include "models/model_files.h"
#include "tests/support/plain_loop.h"
#include "tests/support/tiny_model_folder.h"

using namespace rondo;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

constexpr int kWarmup = 2;

struct Figures {
  double tokens_per_s = 0;
  double loss_first = 0, loss_last = 0;
};

engine::TrainConfig config_for(const fs::path& dir, const std::string& method, int steps) {
  engine::TrainConfig c;
  c.model.path = (dir / "model").string();
  c.model.dtype = "fp32";
  c.data.train = (dir / "text.jsonl").string();
  c.data.seq_len = 256;
  c.training.method = method;
  c.training.steps = steps;
  c.training.batch_rows = 2;
  c.training.grad_accum = 2;
  c.training.lr = 1e-3;
  c.training.schedule = "constant";
  c.training.max_grad_norm = 1.0;
  c.lora.rank = 16;
  c.lora.alpha = 32;
  c.checkpoint.keep = 1;
  c.output.run_dir = (dir / ("run-" + method)).string();
  c.output.exports = {};
  return c;
}

Figures run_session(const engine::TrainConfig& c) {
  std::vector<std::pair<double, std::int64_t>> marks;  // (time, tokens) after each step
  std::vector<double> losses;
  const auto t0 = Clock::now();
  engine::SessionOptions so;
  so.config_toml = "# train_bench\n";
  so.events = (fs::path(c.output.run_dir).parent_path() / "events.jsonl").string();
  so.on_step = [&](const engine::StepEvent& e) {
    marks.emplace_back(
        std::chrono::duration<double>(Clock::now() - t0).count(),
        static_cast<std::int64_t>(c.data.seq_len * c.training.batch_rows * c.training.grad_accum));
    losses.push_back(e.loss);
  };
  engine::Session s(c, so);
  s.run();
  Figures f;
  double tokens = 0;
  for (std::size_t i = kWarmup + 1; i < marks.size(); ++i)
    tokens += static_cast<double>(marks[i].second);
  f.tokens_per_s = tokens / (marks.back().first - marks[kWarmup].first);
  f.loss_first = losses.front();
  f.loss_last = losses.back();
  return f;
}

Figures run_plain(const engine::TrainConfig& c) {
  models::Model model = models::Model::load(c.model.path, {.dtype = models::DType::kF32});
  models::Tokenizer tok = models::load_tokenizer(c.model.path);
  models::ChatTemplate tmpl = models::chat_template_from_name("chatml");
  engine::Dataset d = engine::load_data(c.data.train, tok, tmpl, {});
  engine::Batcher batcher(d, {.seq_len = c.data.seq_len,
                              .rows = c.training.batch_rows,
                              .microbatches = c.training.grad_accum,
                              .seed = c.training.seed});
  const bool lora = c.training.method == "lora";
  std::vector<models::LayerSpec> specs = model.layers();
  std::map<std::string, at::Tensor> weights;
  for (const models::LayerSpec& l : specs)
    for (const models::ParamSpec& p : l.params)
      if (!p.tied) weights[p.name] = model.tensor(p.name);
  if (lora) {
    specs = models::add_lora(specs, c.lora_config());
    for (auto& [name, t] : models::init_lora(specs, c.training.seed))
      weights[name] = t;
  }
  test::PlainLoop loop(model.config(), weights,
                       {.lr = c.training.lr, .weight_decay = c.training.weight_decay},
                       c.training.max_grad_norm, at::kFloat, &specs,
                       [&](const std::string& n) { return !lora || models::is_lora_param(n); });
  Figures f;
  Clock::time_point start;
  double tokens = 0;
  for (std::int64_t s = 1; s <= c.training.steps; ++s) {
    if (s == kWarmup + 1) start = Clock::now();
    std::vector<engine::Microbatch> mbs = batcher.step(s);
    const double loss = loop.step(mbs, nullptr, s, c.training.seed);
    if (s == 1) f.loss_first = loss;
    f.loss_last = loss;
    if (s > kWarmup)
      for (const auto& mb : mbs)
        tokens += static_cast<double>(mb.batch.tokens.numel());
  }
  f.tokens_per_s = tokens / std::chrono::duration<double>(Clock::now() - start).count();
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 12;
  std::string method = "lora";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--method") && i + 1 < argc) {
      method = argv[++i];
    } else {
      std::fprintf(stderr, "usage: train_bench [--steps 12] [--method lora|full]\n");
      return 2;
    }
  }
  if (steps < kWarmup + 2) steps = kWarmup + 2;
  at::set_num_threads(1);
  const fs::path dir =
      fs::temp_directory_path() / ("rondo-train-bench-" + std::to_string(::getpid()));
  try {
    fs::create_directories(dir);
    // A small Llama (4 blocks, C = 256) and 200 documents of random words.
    const models::ModelConfig mc =
        test::write_tiny_model_folder((dir / "model").string(), 1, 4, 512, 256, 688);
    std::mt19937 rng(5);
    std::ofstream data(dir / "text.jsonl");
    const char* words[] = {"round", "pipe",  "stage", "host",   "memory", "stream",
                           "adam",  "token", "layer", "device", "link",   "batch"};
    for (int doc = 0; doc < 200; ++doc) {
      std::string text;
      for (int w = 0; w < 30 + static_cast<int>(rng() % 40); ++w)
        text += std::string(w ? " " : "") + words[rng() % 12];
      data << nlohmann::json{{"text", text}}.dump() << "\n";
    }
    data.close();
    const engine::TrainConfig c = config_for(dir, method, steps);
    const Figures plain = run_plain(c);
    const Figures ours = run_session(c);
    std::printf(
        "train_bench: %s, %d steps of %lld tokens (%lld blocks, C = %lld), 1 torch thread, "
        "first %d steps left out\n",
        method.c_str(), steps,
        static_cast<long long>(c.data.seq_len * c.training.batch_rows * c.training.grad_accum),
        static_cast<long long>(mc.num_layers), static_cast<long long>(mc.hidden_size), kWarmup);
    std::printf("  %-34s %10.0f tokens/s  (loss %.3f -> %.3f)\n", "plain libtorch loop",
                plain.tokens_per_s, plain.loss_first, plain.loss_last);
    std::printf("  %-34s %10.0f tokens/s  (loss %.3f -> %.3f)\n",
                "rondo train (Session, 1 CPU device)", ours.tokens_per_s, ours.loss_first,
                ours.loss_last);
    std::printf("  ratio rondo / plain: %.3f\n", ours.tokens_per_s / plain.tokens_per_s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    fs::remove_all(dir);
    return 1;
  }
  fs::remove_all(dir);
  return 0;
}
