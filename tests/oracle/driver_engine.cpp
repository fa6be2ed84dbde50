// Driver subcommand for the engine oracle test.
//   engine-train <model_dir> <in.json> <out.safetensors>
//     in.json: {"microbatches": [[{"tokens": [[..]], "doc_ids": [[..]]} per microbatch] per step],
//               "forward": [[b, e], ...], "tail": [b, e], "backward": [[b, e], ...],
//               "grain": "stage" | "layer", "mlp_tile_tokens" (optional), "devices": n,
//               "lr", "weight_decay", "betas": [b1, b2], "eps", "max_grad_norm",
//               "head_chunk_tokens" (optional),
//               "eval": [{"tokens", "doc_ids"} per microbatch] (optional)}
//     Loads the model in f32, makes every parameter trainable (f32 streaming copy and gradients),
//     computes each microbatch's targets with models::next_token_targets and runs Engine::train on
//     n simulated devices for as many steps as "microbatches" holds. Writes "loss<step>",
//     "norm<step>" (before clipping) and "targets<step>" (target tokens of the step), each a
//     1-element tensor (f32, f32, i64), and the final master weights by Hugging Face name (owners
//     only: a tied LM head is written as the embedding it is). With "eval", then Engine::evaluate
//     on those microbatches (any number): "eval_loss" (f64) and "eval_targets" (i64).
//   engine-generate <model_dir> <in.json> <out.json>
//     in.json: {"prompts": [[ids..], ...], "max_new_tokens", "devices": n, "residency":
//               "resident" | "spread" | "streamed", "kv_host": bool, "min_group_tokens" (256),
//               "groups" (0), "forward", "tail", "backward" (the plan, as above)}
//     Loads the model in f32 (frozen), runs Engine::generate (greedy) on n simulated devices;
//     writes {"tokens": [[..] per prompt], "resident", "spread", "kv_host": bool, "groups": n}.
#include <ATen/ATen.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "driver_json.h"
#include "engine/engine.h"
#include "engine/model_store.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/error.h"
#include "models/model.h"
#include "models/safetensors.h"

namespace rondo::oracle {
namespace {

engine::LayerRange range(const nlohmann::json& r) {
  if (!r.is_array() || r.size() != 2) throw Error("a layer range is [begin, end]");
  return {r[0].get<int>(), r[1].get<int>()};
}

at::Tensor scalar(double x) {
  return at::full({1}, x, at::kFloat);
}

engine::Plan plan_of(const nlohmann::json& j, int microbatches) {
  engine::Plan plan;
  for (const auto& r : j["forward"])
    plan.forward.push_back(range(r));
  plan.tail = range(j["tail"]);
  for (const auto& r : j["backward"])
    plan.backward.push_back(range(r));
  plan.microbatches = microbatches;
  const std::string grain = j.value("grain", "stage");
  if (grain != "stage" && grain != "layer") throw Error("grain must be stage or layer");
  plan.grain = grain == "stage" ? engine::RecomputeGrain::kStage : engine::RecomputeGrain::kLayer;
  plan.mlp_tile_tokens = j.value("mlp_tile_tokens", std::int64_t{0});
  std::fprintf(stderr, "plan %s\n", plan.describe().c_str());
  return plan;
}

struct SimDevices {
  std::vector<std::unique_ptr<kernels::Device>> owned;
  std::vector<kernels::Device*> raw;
  explicit SimDevices(int n) {
    if (n < 1) throw Error("devices must be at least 1");
    for (int d = 0; d < n; ++d) {
      owned.push_back(kernels::make_sim_device({.name = "sim" + std::to_string(d), .index = d}));
      raw.push_back(owned.back().get());
    }
  }
};

int engine_train(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: engine-train <model_dir> <in.json> <out.safetensors>");
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  models::Model model = models::Model::load_hf_folder(args[0], {.dtype = models::DType::kF32});
  const std::vector<models::LayerSpec>& specs = model.layers();

  auto microbatch = [](const nlohmann::json& mb) -> engine::Microbatch {
    models::TokenBatch batch{int_matrix(mb["tokens"]), int_matrix(mb["doc_ids"])};
    return {batch, models::next_token_targets(batch)};
  };
  std::vector<std::vector<engine::Microbatch>> steps;
  for (const auto& step : j["microbatches"]) {
    std::vector<engine::Microbatch> mbs;
    for (const auto& mb : step)
      mbs.push_back(microbatch(mb));
    if (!steps.empty() && mbs.size() != steps[0].size())
      throw Error("every step needs the same number of microbatches");
    steps.push_back(std::move(mbs));
  }
  if (steps.empty() || steps[0].empty()) throw Error("no microbatches");

  const engine::Plan plan = plan_of(j, static_cast<int>(steps[0].size()));

  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  offload::LayerStore store(
      arena, engine::layer_descs(specs, [](const models::ParamSpec&) { return true; }),
      kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  engine::load_weights(store, specs, [&](const std::string& name) { return model.tensor(name); });

  SimDevices devices(j["devices"].get<int>());

  engine::EngineOptions options;
  options.adamw.lr = j["lr"];
  options.adamw.weight_decay = j["weight_decay"];
  options.adamw.beta1 = j["betas"][0];
  options.adamw.beta2 = j["betas"][1];
  options.adamw.eps = j["eps"];
  options.max_grad_norm = j["max_grad_norm"];
  options.head_chunk_tokens = j.value("head_chunk_tokens", options.head_chunk_tokens);

  std::vector<std::pair<std::string, at::Tensor>> out;
  {
    engine::Engine eng(model.config(), specs, store, arena, devices.raw, plan, options);
    auto results = eng.train(static_cast<std::int64_t>(steps.size()),
                             [&](std::int64_t step) { return steps.at(step - 1); });
    for (const engine::StepResult& r : results) {
      const std::string s = std::to_string(r.step);
      out.push_back({"loss" + s, scalar(r.loss)});
      out.push_back({"norm" + s, scalar(r.grad_norm)});
      out.push_back({"targets" + s, at::full({1}, r.targets, at::kLong)});
    }
    if (j.contains("eval")) {
      std::vector<engine::Microbatch> mbs;
      for (const auto& mb : j["eval"])
        mbs.push_back(microbatch(mb));
      const engine::EvalResult e = eng.evaluate(std::move(mbs));
      out.push_back({"eval_loss", at::full({1}, e.loss(), at::kDouble)});
      out.push_back({"eval_targets", at::full({1}, e.targets, at::kLong)});
    }
  }
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
      if (store.layer(l)[i].tied) continue;
      out.push_back({specs[l].params[i].name,
                     engine::state_view(store, specs, l, i, engine::StateView::kMaster).clone()});
    }
  models::write_safetensors(args[2], out);
  return 0;
}

int engine_generate(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: engine-generate <model_dir> <in.json> <out.json>");
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  models::Model model = models::Model::load_hf_folder(args[0], {.dtype = models::DType::kF32});
  const std::vector<models::LayerSpec>& specs = model.layers();
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  offload::LayerStore store(
      arena, engine::layer_descs(specs, [](const models::ParamSpec&) { return false; }),
      kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  engine::load_weights(store, specs, [&](const std::string& name) { return model.tensor(name); });
  SimDevices devices(j["devices"].get<int>());
  engine::Engine eng(model.config(), specs, store, arena, devices.raw, plan_of(j, 1), {});
  const std::string residency = j["residency"];
  if (residency != "resident" && residency != "spread" && residency != "streamed")
    throw Error("residency must be resident, spread or streamed");
  models::SamplingOptions options;
  options.max_new_tokens = j["max_new_tokens"];
  const engine::Generation g = eng.generate(
      j["prompts"].get<std::vector<std::vector<std::int64_t>>>(), options,
      {.residency = residency == "resident" ? engine::Residency::kResident
                    : residency == "spread" ? engine::Residency::kSpread
                                            : engine::Residency::kStreamed,
       .kv_caches = j.value("kv_host", false) ? engine::KvCaches::kHost : engine::KvCaches::kDevice,
       .groups = j.value("groups", 0),
       .min_group_tokens = j.value("min_group_tokens", std::int64_t{256})});
  std::ofstream(args[2]) << nlohmann::json{
      {"tokens", g.tokens},
      {"resident", g.resident},
      {"spread", g.spread},
      {"kv_host", g.kv_host},
      {"groups", g.groups}}.dump();
  return 0;
}

RegisterCommand reg_generate("engine-generate", "<model_dir> <in.json> <out.json>",
                             engine_generate);
RegisterCommand reg("engine-train", "<model_dir> <in.json> <out.safetensors>", engine_train);

}  // namespace
}  // namespace rondo::oracle
