// Driver subcommand for the engine oracle test.
//   engine-train <model_dir> <in.json> <out.safetensors>
//     in.json: {"microbatches": [[{"tokens": [[..]], "doc_ids": [[..]]} per microbatch] per step],
//               "forward": [[b, e], ...], "tail": [b, e], "backward": [[b, e], ...],
//               "grain": "stage" | "layer", "devices": n,
//               "lr", "weight_decay", "betas": [b1, b2], "eps", "max_grad_norm",
//               "head_chunk_tokens" (optional)}
//     Loads the model in f32, makes every parameter trainable (f32 streaming copy and gradients),
//     computes each microbatch's targets with models::next_token_targets and runs Engine::train on
//     n simulated devices for as many steps as "microbatches" holds. Writes "loss<step>",
//     "norm<step>" (before clipping) and "targets<step>" (target tokens of the step), each a
//     1-element tensor (f32, f32, i64), and the final master weights by Hugging Face name (owners
//     only: a tied LM head is written as the embedding it is).
#include <ATen/ATen.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "driver_json.h"
#include "engine/engine.h"
#include "engine/state.h"
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

int engine_train(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: engine-train <model_dir> <in.json> <out.safetensors>");
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  models::Model model = models::Model::load_hf_folder(args[0], {.dtype = models::DType::kF32});
  const std::vector<models::LayerSpec>& specs = model.layers();

  std::vector<std::vector<engine::Microbatch>> steps;
  for (const auto& step : j["microbatches"]) {
    std::vector<engine::Microbatch> mbs;
    for (const auto& mb : step) {
      models::TokenBatch batch{int_matrix(mb["tokens"]), int_matrix(mb["doc_ids"])};
      mbs.push_back({batch, models::next_token_targets(batch)});
    }
    if (!steps.empty() && mbs.size() != steps[0].size())
      throw Error("every step needs the same number of microbatches");
    steps.push_back(std::move(mbs));
  }
  if (steps.empty() || steps[0].empty()) throw Error("no microbatches");

  engine::Plan plan;
  for (const auto& r : j["forward"])
    plan.forward.push_back(range(r));
  plan.tail = range(j["tail"]);
  for (const auto& r : j["backward"])
    plan.backward.push_back(range(r));
  plan.microbatches = static_cast<int>(steps[0].size());
  const std::string grain = j["grain"];
  if (grain != "stage" && grain != "layer") throw Error("grain must be stage or layer");
  plan.grain = grain == "stage" ? engine::RecomputeGrain::kStage : engine::RecomputeGrain::kLayer;
  std::fprintf(stderr, "plan %s\n", plan.describe().c_str());

  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  offload::LayerStore store(
      arena, engine::layer_descs(specs, [](const models::ParamSpec&) { return true; }),
      kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  engine::load_weights(store, specs, [&](const std::string& name) { return model.tensor(name); });

  const int n = j["devices"];
  if (n < 1) throw Error("devices must be at least 1");
  std::vector<std::unique_ptr<kernels::Device>> devices;
  std::vector<kernels::Device*> raw;
  for (int d = 0; d < n; ++d) {
    devices.push_back(kernels::make_sim_device({.name = "sim" + std::to_string(d), .index = d}));
    raw.push_back(devices.back().get());
  }

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
    engine::Engine eng(model.config(), specs, store, arena, raw, plan, options);
    auto results = eng.train(static_cast<std::int64_t>(steps.size()),
                             [&](std::int64_t step) { return steps.at(step - 1); });
    for (const engine::StepResult& r : results) {
      const std::string s = std::to_string(r.step);
      out.push_back({"loss" + s, scalar(r.loss)});
      out.push_back({"norm" + s, scalar(r.grad_norm)});
      out.push_back({"targets" + s, at::full({1}, r.targets, at::kLong)});
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

RegisterCommand reg("engine-train", "<model_dir> <in.json> <out.safetensors>", engine_train);

}  // namespace
}  // namespace rondo::oracle
