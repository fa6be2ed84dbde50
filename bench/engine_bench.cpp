// engine_bench: the engine's schedule and its overhead, as ratios measured in one run (never
// absolute targets: these machines are shared).
//
//  (a) schedule — 4 simulated devices behind a link slow enough that uploading a stage's weights
//      takes about as long as computing it. Compute is emulated from per-layer costs
//      (test::EngineHooks: each job lasts at least what the costs say), so that four
//      devices sharing two CPU cores behave like four GPUs; transfers are the SimDevice's emulated
//      link. Reports the measured idle fraction next to the plan's predicted one (the simulator's
//      figure, a lower bound: it has no dispatch overhead), and the step time of RoundPipe's
//      partition (plan_reference) against ours (plan_ours) on the same costs. Then 1 device with
//      a link 20 times faster and memory to spare: ours recomputes nothing (one fused tail),
//      RoundPipe's recomputes nearly every layer.
//  (b) overhead — 1 simulated device, no link limit, real compute: tokens/s of the engine against
//      the plain libtorch training loop (tests/support/plain_loop.h) on the same model and
//      microbatches, both on one CPU thread. Once with the whole model in the fused tail (no
//      recompute: the same arithmetic as the plain loop) and once with separate forward and
//      backward stages (activation checkpointing: the recompute is extra work by design).
//
//  (c) generation — 2 simulated devices, the stages spread over them: tokens/s of greedy
//      generation with the prompts split into groups pipelined through the stages (by default,
//      and in every pass) against all of them in one group (one device computing at a time), one
//      CPU thread each. With real compute (two devices sharing two cores and one memory bus) and
//      with compute emulated as in (a), linear in tokens as a GPU's compute-bound matmuls are.
//
//   engine_bench [--steps 6] [--only a|b|c]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>

#include "engine/engine.h"
#include "engine/events.h"
#include "engine/model_store.h"
#include "kernels/cpu/sim_device.h"
#include "tests/support/engine_hooks.h"
#include "tests/support/plain_loop.h"

using namespace rondo;
using Clock = std::chrono::steady_clock;

namespace {

struct Model {
  models::ModelConfig config;
  std::vector<models::LayerSpec> specs;
  std::map<std::string, at::Tensor> weights;
};

Model make_model(const models::ModelConfig& c) {
  at::manual_seed(1);
  return {c, models::layer_specs(c), test::random_weights(c)};
}

struct Store {
  offload::HostArena arena;
  std::unique_ptr<offload::LayerStore> store;
  explicit Store(const Model& m) {
    store = std::make_unique<offload::LayerStore>(
        arena, engine::layer_descs(m.specs, [](const models::ParamSpec&) { return true; }),
        kernels::FloatDType::kF32, kernels::FloatDType::kF32);
    engine::load_weights(*store, m.specs, [&](const std::string& n) { return m.weights.at(n); });
  }
};

struct Measured {
  double step_s = 0;  // mean over the measured steps
  double idle = 0;    // 1 - mean busy fraction over devices and measured steps
  double tokens_per_s = 0;
};

// Runs `steps` steps; the first `warmup` are not measured.
Measured run_engine(const Model& m, const engine::Plan& plan, int devices, kernels::LinkSpec link,
                    const std::vector<engine::Microbatch>& batch, int steps, int warmup,
                    engine::EngineOptions options = {}) {
  Store st(m);
  std::vector<std::unique_ptr<kernels::Device>> devs;
  std::vector<kernels::Device*> raw;
  for (int d = 0; d < devices; ++d) {
    devs.push_back(kernels::make_sim_device(
        {.name = "sim" + std::to_string(d), .bytes_cap = 4ull << 30, .link = link}));
    raw.push_back(devs.back().get());
  }
  const std::string events =
      (std::filesystem::temp_directory_path() / "rondo_engine_bench.jsonl").string();
  std::filesystem::remove(events);
  auto sink = engine::EventSink::open(events);
  options.events = sink.get();
  options.adamw.lr = 1e-4;
  Measured out;
  {
    engine::Engine eng(m.config, m.specs, *st.store, st.arena, raw, plan, options);
    std::int64_t tokens = 0;
    for (const auto& mb : batch)
      tokens += mb.batch.tokens.numel();
    std::vector<engine::StepResult> r = eng.train(steps, [&](std::int64_t) { return batch; });
    double s = 0;
    for (int i = warmup; i < steps; ++i)
      s += r[i].seconds;
    out.step_s = s / (steps - warmup);
    out.tokens_per_s = static_cast<double>(tokens) / out.step_s;
  }
  sink.reset();
  // Device events come once per step per device, busy_fraction covering the step.
  std::ifstream f(events);
  std::string line;
  int device_events = 0;
  double busy = 0, n = 0;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "device") continue;
    if (device_events++ / devices < warmup) continue;
    busy += j["busy_fraction"].get<double>();
    n += 1;
  }
  out.idle = 1 - busy / n;
  return out;
}

engine::PlanInputs costs_for(const Model& m, const Store& st, int devices, double f_tok,
                             double link_bps, std::int64_t tokens, int M) {
  engine::PlanInputs in;
  for (std::size_t l = 0; l < m.specs.size(); ++l) {
    const double weight = m.specs[l].kind == models::LayerKind::kBlock ? 1.0 : 0.25;
    in.layers.push_back(
        {.forward_s_per_token = weight * f_tok,
         .backward_s_per_token = 2 * weight * f_tok,
         .param_bytes = st.store->stream_bytes(l, offload::kBasePart).bytes +
                        st.store->stream_bytes(l, offload::kStreamPart).bytes,
         .grad_bytes = st.store->grad_bytes(l).bytes,
         .activation_bytes_per_token = m.specs[l].activation_bytes_per_token(4),
         .output_bytes_per_token = static_cast<std::uint64_t>(m.config.hidden_size * 4)});
  }
  for (int d = 0; d < devices; ++d)
    in.devices.push_back({.memory_cap = 4ull << 30, .link_bytes_per_s = link_bps});
  in.tokens_per_step = tokens;
  in.microbatches = M;
  return in;
}

void bench_schedule(int steps, int N, double link_scale) {
  // Small blocks and a large vocabulary, as in small real models (Qwen2.5-0.5B: a quarter of the
  // weights is the embedding): the head's weights cost far more to move than to compute with.
  Model m = make_model(models::parse_hf_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":2048,"hidden_size":64,
          "intermediate_size":160,"num_hidden_layers":8,"num_attention_heads":4,
          "num_key_value_heads":2,"tie_word_embeddings":false})",
      "bench model"));
  Store st(m);
  const int M = 5;
  at::manual_seed(2);
  std::vector<engine::Microbatch> batch = test::random_batch(m.config, 2 * M, 32, M);
  std::int64_t tokens = 0;
  for (const auto& mb : batch)
    tokens += mb.batch.tokens.numel();
  // A block's forward over one microbatch takes 2 ms, its backward 4 ms (plus the 2 ms
  // recompute); the link moves one block's weights in the time of its recompute and backward
  // over the M microbatches: transfers about equal compute.
  const double f_tok = 2e-3 / (2 * 32);
  const double block_bytes =
      static_cast<double>(st.store->stream_bytes(1, offload::kBasePart).bytes +
                          st.store->stream_bytes(1, offload::kStreamPart).bytes);
  const double link_bps = link_scale * block_bytes / (M * 6e-3);
  engine::PlanInputs in = costs_for(m, st, N, f_tok, link_bps, tokens, M);
  kernels::LinkSpec link{.bytes_per_s = link_bps, .latency_s = 0};
  engine::EngineOptions o;
  test::EngineHooks emulation;
  emulation.costs = in.layers;
  o.probe = &emulation;
  std::printf(
      "(a) schedule: %d simulated devices, %s of weights per block, link %.1f MB/s, "
      "block forward %.1f ms per microbatch, M = %d\n",
      N, format_bytes(static_cast<std::uint64_t>(block_bytes)).c_str(), link_bps / 1e6,
      f_tok * 64 * 1e3, M);
  std::printf("%-10s %-58s %9s %9s %9s %9s\n", "partition", "plan", "step s", "pred s", "idle",
              "pred idle");
  double t_ref = 0, t_ours = 0, p_ref = 0, p_ours = 0;
  for (bool ours : {false, true}) {
    engine::Plan plan = ours ? engine::plan_ours(in) : engine::plan_reference(in);
    engine::PlanPrediction p = engine::predict(plan, in);
    o.partitioner = ours ? "ours" : "reference";
    Measured r = run_engine(m, plan, N, link, batch, steps, 2, o);
    std::printf("%-10s %-58s %9.4f %9.4f %9.3f %9.3f\n", ours ? "ours" : "reference",
                plan.describe().c_str(), r.step_s, p.step_time_s, r.idle, p.idle_fraction);
    (ours ? t_ours : t_ref) = r.step_s;
    (ours ? p_ours : p_ref) = p.step_time_s;
    std::printf("    idle measured / predicted lower bound: %.2f (%.3f vs %.3f)\n",
                r.idle / std::max(p.idle_fraction, 1e-9), r.idle, p.idle_fraction);
  }
  std::printf("    reference step time / ours: measured %.3f, predicted %.3f\n", t_ref / t_ours,
              p_ref / p_ours);
}

void bench_overhead(int steps) {
  Model m = make_model(test::tiny_llama(4, 16));
  const int M = 2;
  at::manual_seed(3);
  std::vector<engine::Microbatch> batch = test::random_batch(m.config, 8, 128, M);
  std::int64_t tokens = 0;
  for (const auto& mb : batch)
    tokens += mb.batch.tokens.numel();
  const int L = static_cast<int>(m.specs.size());
  std::printf(
      "\n(b) overhead: 1 simulated device, no link limit, %d layers, hidden %lld, "
      "%lld tokens per step in %d microbatches, 1 CPU thread\n",
      L - 2, static_cast<long long>(m.config.hidden_size), static_cast<long long>(tokens), M);
  // The plain loop, timed over the same steps (best of two runs, like the engine's).
  auto plain = [&] {
    test::PlainLoop loop(m.config, m.weights, {.lr = 1e-4}, 0);
    loop.step(batch);  // warm-up
    auto t0 = Clock::now();
    for (int i = 1; i < steps; ++i)
      loop.step(batch);
    return static_cast<double>(tokens) * (steps - 1) /
           std::chrono::duration<double>(Clock::now() - t0).count();
  };
  engine::Plan whole{{}, {0, L}, {}, M, engine::RecomputeGrain::kStage};
  engine::Plan staged{{{0, L / 2}}, {L / 2, L}, {{0, L / 2}}, M, engine::RecomputeGrain::kStage};
  double best_plain = 0, best_whole = 0, best_staged = 0;
  for (int rep = 0; rep < 2; ++rep) {
    best_plain = std::max(best_plain, plain());
    best_whole = std::max(best_whole, run_engine(m, whole, 1, {}, batch, steps, 1).tokens_per_s);
    best_staged = std::max(best_staged, run_engine(m, staged, 1, {}, batch, steps, 1).tokens_per_s);
  }
  std::printf("%-44s %12s %8s\n", "", "tokens/s", "ratio");
  std::printf("%-44s %12.0f %8s\n", "plain libtorch loop", best_plain, "1.00");
  std::printf("%-44s %12.0f %8.3f\n", ("engine " + whole.describe()).c_str(), best_whole,
              best_whole / best_plain);
  std::printf("%-44s %12.0f %8.3f   (recomputes the forward)\n",
              ("engine " + staged.describe()).c_str(), best_staged, best_staged / best_plain);
}

void bench_generation(int tokens) {
  // Four stages over 2 devices (stage j on device j % 2), each kept where it is (spread): in one
  // group of prompts one device computes at a time; in a group per device, the stages pipeline
  // them. By default a pass splits only with 256 rows of tokens per group (here the prefill: a
  // decoding step of 8 prompts stays whole).
  Model m = make_model(models::parse_hf_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":2048,"hidden_size":256,
          "intermediate_size":704,"num_hidden_layers":6,"num_attention_heads":8,
          "num_key_value_heads":4,"tie_word_embeddings":false})",
      "bench model"));
  const int L = static_cast<int>(m.specs.size());
  engine::Plan plan{{{0, 3}, {3, 5}, {5, 7}},
                    {7, L},
                    {{5, 7}, {3, 5}, {0, 3}},
                    1,
                    engine::RecomputeGrain::kStage};
  const std::int64_t B = 8, P = 64;
  std::mt19937 rng(4);
  std::vector<std::vector<std::int64_t>> prompts(B);
  for (auto& p : prompts)
    for (std::int64_t t = 0; t < P; ++t)
      p.push_back(static_cast<std::int64_t>(rng() % 2048));
  const models::SamplingOptions greedy{.max_new_tokens = tokens, .stop_tokens = {-1}};
  // Emulated: a block's forward takes 0.2 ms per token (the embedding and the head a quarter of
  // that), linear in tokens as on a GPU's compute-bound matmuls, over the real compute.
  std::vector<engine::LayerCosts> costs(static_cast<std::size_t>(L));
  for (int l = 0; l < L; ++l)
    costs[static_cast<std::size_t>(l)].forward_s_per_token =
        m.specs[static_cast<std::size_t>(l)].kind == models::LayerKind::kBlock ? 2e-4 : 5e-5;
  std::printf(
      "\n(c) generation: 2 simulated devices, no link limit, %s spread, %lld prompts of %lld "
      "tokens, %d new tokens each, 1 CPU thread per device\n",
      plan.describe().c_str(), static_cast<long long>(B), static_cast<long long>(P), tokens);
  Store st(m);
  std::vector<std::unique_ptr<kernels::Device>> devs;
  std::vector<kernels::Device*> raw;
  for (int d = 0; d < 2; ++d) {
    devs.push_back(kernels::make_sim_device({.name = "sim" + std::to_string(d)}));
    raw.push_back(devs.back().get());
  }
  const std::vector<std::pair<int, const char*>> ways = {
      {1, "one group"},
      {0, "groups by default (the prefill split)"},
      {2, "2 groups in every pass"}};
  std::printf("%-40s %14s %8s %14s %8s\n", "", "real tokens/s", "ratio", "emulated", "ratio");
  std::map<std::pair<bool, int>, double> best;
  std::map<std::pair<bool, int>, std::vector<std::vector<std::int64_t>>> produced;
  for (bool emulated : {false, true}) {
    engine::EngineOptions options;
    test::EngineHooks emulation;
    emulation.costs = costs;
    if (emulated) options.probe = &emulation;
    engine::Engine eng(m.config, m.specs, *st.store, st.arena, raw, plan, options);
    for (int rep = 0; rep < 2; ++rep)
      for (const auto& [groups, name] : ways) {
        const auto t0 = Clock::now();
        engine::Generation g = eng.generate(
            prompts, greedy, {.residency = engine::Residency::kSpread, .groups = groups});
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        double& b = best[{emulated, groups}];
        b = std::max(b, static_cast<double>(B * tokens) / s);
        produced[{emulated, groups}] = g.tokens;
        if (g.groups != (groups == 1 ? 1 : 2))
          throw std::runtime_error(std::string(name) + ": " + std::to_string(g.groups) + " groups");
      }
  }
  bool same = true;
  for (const auto& [groups, name] : ways) {
    std::printf("%-40s %14.1f %8.3f %14.1f %8.3f\n", name, best[{false, groups}],
                best[{false, groups}] / best[{false, 1}], best[{true, groups}],
                best[{true, groups}] / best[{true, 1}]);
    same = same && produced[{false, groups}] == produced[{false, 1}] &&
           produced[{true, groups}] == produced[{false, 1}];
  }
  std::printf("    the same tokens every way: %s\n", same ? "yes" : "no (rounding)");
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 6;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc)
      steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else {
      std::fprintf(stderr, "usage: engine_bench [--steps 6] [--only a|b|c]\n");
      return 2;
    }
  }
  if (steps < 3) steps = 3;
  at::set_num_threads(1);
  try {
    // Four devices, then one with a link 20 times faster (a GPU on PCIe, where compute rather than
    // the link bounds a step): alone, with memory to spare, it should recompute nothing.
    if (only.empty() || only == "a") {
      bench_schedule(steps, 4, 1);
      bench_schedule(steps, 1, 20);
    }
    if (only.empty() || only == "b") bench_overhead(steps);
    if (only.empty() || only == "c") bench_generation(4 * steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
