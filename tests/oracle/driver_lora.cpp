// Driver subcommand for the LoRA oracle test.
//   lora-logits <base_model_dir> <peft_adapter_dir> <batch.json> <out.safetensors>
//     batch.json: {"tokens": [[...]]}; loads the base (f32) and the PEFT adapter
//     (adapter_config.json, adapter_model.safetensors), runs the model's layer functions with the
//     adapters bound (inference: no dropout) and writes "logits" (B, T, V) f32.
//   lora-train-export <base_model_dir> <in.json> <out_dir>: see lora_train_export below.
#include <ATen/ATen.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/config_file.h"
#include "driver.h"
#include "driver_json.h"
#include "engine/checkpoint.h"
#include "engine/engine.h"
#include "engine/estimate.h"
#include "engine/export.h"
#include "engine/model_store.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/error.h"
#include "models/inspect.h"
#include "models/lora.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/safetensors.h"
#include "models/weight_reader.h"

namespace rondo::oracle {
namespace {

// The model's layer functions over `specs` (adapters bound; inference: no dropout): fp32 logits.
at::Tensor forward(const models::ModelConfig& c, const std::vector<models::LayerSpec>& specs,
                   const std::function<at::Tensor(const std::string&)>& tensor,
                   const at::Tensor& tokens) {
  models::TokenBatch batch{tokens, {}};
  models::AttentionContext ctx = models::make_attention_context(c, batch, at::kFloat);
  at::Tensor x = models::embed(tensor(specs[0].params[0].name), batch.tokens);
  for (std::size_t l = 1; l + 1 < specs.size(); ++l) {
    std::vector<at::Tensor> w;
    for (const models::ParamSpec& p : specs[l].params)
      w.push_back(tensor(p.name));
    x = models::block_forward(c, models::BlockWeights::bind(specs[l], w), x, ctx);
  }
  const models::LayerSpec& head = specs.back();
  return models::head_logits(c, tensor(head.params[0].name), tensor(head.params[1].name), x);
}

int lora_logits(const std::vector<std::string>& args) {
  if (args.size() != 4)
    throw Error("usage: lora-logits <base_model_dir> <peft_adapter_dir> <batch.json> <out>");
  models::Model model = models::Model::load_hf_folder(args[0], {.dtype = models::DType::kF32});
  const std::string config_path = args[1] + "/adapter_config.json";
  models::LoraConfig lora = models::parse_peft_adapter_config(
      models::read_text_file(config_path, "the LoRA adapter config"), config_path);
  models::SafetensorsFile adapter(args[1] + "/adapter_model.safetensors");
  std::vector<models::LayerSpec> specs = models::add_lora(model.layers(), lora);
  auto tensor = [&](const std::string& name) -> at::Tensor {
    if (!models::is_lora_param(name)) return model.tensor(name);
    const models::TensorEntry* e = adapter.find(name);
    if (!e) throw Error(adapter.path() + ": no tensor " + name);
    return e->view().to(at::kFloat);
  };
  nlohmann::json j;
  std::ifstream(args[2]) >> j;
  at::Tensor logits = forward(model.config(), specs, tensor, int_matrix(j["tokens"]));
  models::write_safetensors(args[3], {{"logits", logits}});
  return 0;
}

// Trains LoRA adapters (PEFT init, seed given) with the engine on 2 simulated devices, exports them
// (PEFT folder and merged checkpoint) and writes Rondo's logits with the trained adapters.
//   in.json: {"lora": {r, alpha, targets, rslora, dropout (default 0)}, "seed", "lr",
//   "steps": [[tokens of microbatch, ...] per step], "eval_tokens": [[...]]}; optional:
//   "init_adapter" (a PEFT folder whose adapter tensors start the training instead of the
//   seed's), "eps" (AdamW's, default 1e-8), "mlp_tile_tokens" (sequence tiling, default none).
//   AdamW without weight decay, no clipping.
int lora_train_export(const std::vector<std::string>& args) {
  if (args.size() != 3)
    throw Error("usage: lora-train-export <base_model_dir> <in.json> <out_dir>");
  models::Model model = models::Model::load_hf_folder(args[0], {.dtype = models::DType::kF32});
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  models::LoraConfig lora{.rank = j["lora"]["r"],
                          .alpha = j["lora"]["alpha"],
                          .dropout = j["lora"].value("dropout", 0.0),
                          .targets = j["lora"]["targets"].get<std::vector<std::string>>(),
                          .rslora = j["lora"]["rslora"]};
  std::vector<models::LayerSpec> specs = models::add_lora(model.layers(), lora);
  std::map<std::string, at::Tensor> adapters = models::init_lora(specs, j["seed"]);
  if (j.contains("init_adapter")) {
    const models::SafetensorsFile start(j["init_adapter"].get<std::string>() +
                                        "/adapter_model.safetensors");
    for (auto& [name, t] : adapters) {
      const models::TensorEntry* e = start.find(name);
      if (e == nullptr) throw Error("init_adapter has no " + name);
      t = e->view().to(at::kFloat).clone();
    }
  }
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  offload::LayerStore store(
      arena,
      engine::layer_descs(specs,
                          [](const models::ParamSpec& p) { return models::is_lora_param(p.name); }),
      kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  engine::load_weights(store, specs, [&](const std::string& n) {
    return models::is_lora_param(n) ? adapters.at(n) : model.tensor(n);
  });
  std::vector<std::vector<engine::Microbatch>> steps;
  for (const auto& step : j["steps"]) {
    std::vector<engine::Microbatch> mbs;
    for (const auto& mb : step) {
      models::TokenBatch b{int_matrix(mb), {}};
      mbs.push_back({b, models::next_token_targets(b)});
    }
    steps.push_back(std::move(mbs));
  }
  const int L = static_cast<int>(specs.size());
  engine::Plan plan{{{0, L / 2}},
                    {L / 2, L},
                    {{0, L / 2}},
                    static_cast<int>(steps[0].size()),
                    engine::RecomputeGrain::kStage};
  plan.mlp_tile_tokens = j.value("mlp_tile_tokens", std::int64_t{0});
  std::vector<std::unique_ptr<kernels::Device>> devs;
  for (int d = 0; d < 2; ++d)
    devs.push_back(
        kernels::make_sim_device({.name = "sim" + std::to_string(d), .bytes_cap = 1ull << 30}));
  engine::EngineOptions o;
  o.adamw = {.lr = j["lr"], .eps = j.value("eps", 1e-8), .weight_decay = 0.0};
  {
    engine::Engine eng(model.config(), specs, store, arena, {devs[0].get(), devs[1].get()}, plan,
                       o);
    eng.train(static_cast<std::int64_t>(steps.size()),
              [&](std::int64_t s) { return steps.at(s - 1); });
  }
  const std::string out = args[2];
  engine::export_peft_adapter(out + "/adapter", store, specs, lora, args[0]);
  engine::export_merged(out + "/merged", store, specs, args[0], models::DType::kF32);
  std::map<std::string, at::Tensor> trained;
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!store.layer(l)[i].tied)
        trained[specs[l].params[i].name] = engine::state_view(
            store, specs, l, i,
            store.layer(l)[i].trainable ? engine::StateView::kMaster : engine::StateView::kStream);
  at::Tensor logits = forward(
      model.config(), specs, [&](const std::string& n) { return trained.at(n); },
      int_matrix(j["eval_tokens"]));
  models::write_safetensors(out + "/logits.safetensors", {{"logits", logits}});
  return 0;
}

// The base model's tensors as a run's devices compute with them: in the run's model.dtype, kept
// as its config says (model.quantize: GGUF blocks as stored, NF4 or INT8 quantised at load) and
// dequantised — the placement and loading a run itself uses (engine::estimate_run,
// engine::load_weights) — as fp32 tensors.
std::map<std::string, at::Tensor> base_as_trained(engine::TrainConfig c) {
  c.training.method = "lora";  // the base frozen, as quantisation needs
  const models::ModelSummary summary = models::inspect_model(c.model.path, 64);
  const engine::DevicePlan devices = engine::plan_devices({});
  const engine::RunEstimate est =
      engine::estimate_run(c, summary, devices, 1, 64, /*host_free=*/1ull << 50,
                           /*disk_free=*/1ull << 50);
  models::WeightReader reader(c.model.path);
  std::vector<models::LayerSpec> specs = models::add_lora(reader.layers(), c.lora_config());
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  const kernels::FloatDType sd = c.model.dtype == "fp32"   ? kernels::FloatDType::kF32
                                 : c.model.dtype == "fp16" ? kernels::FloatDType::kF16
                                                           : kernels::FloatDType::kBF16;
  offload::LayerStore store(arena, est.placement.layers, sd, kernels::FloatDType::kF32);
  engine::load_weights(store, specs, reader, models::init_lora(specs, 1));
  std::map<std::string, at::Tensor> out;
  for (std::size_t l = 0; l < specs.size(); ++l) {
    const offload::LayerAccess a = store.access(l, offload::kAllParts, offload::AccessMode::kRead);
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!a[i].tied && !models::is_lora_param(specs[l].params[i].name)) {
        out[specs[l].params[i].name] =
            engine::stream_tensor(a, store, specs, l, i).to(at::kFloat, false, /*copy=*/true);
        if (a[i].quant.type != kernels::QuantType::kNone)  // what the store keeps, on stdout
          std::printf("kept %s %s\n", specs[l].params[i].name.c_str(),
                      kernels::to_string(a[i].quant.type));
      }
  }
  return out;
}

// quantised-base <model> <quantize> <double_quant 0|1> <out.safetensors>: every base tensor as a
// LoRA run with model.quantize = <quantize> computes with it (fp32); prints "kept <name> <type>"
// for each tensor the store keeps quantised.
int quantised_base(const std::vector<std::string>& args) {
  if (args.size() != 4)
    throw Error("usage: quantised-base <model> <quantize> <double_quant 0|1> <out.safetensors>");
  engine::TrainConfig c;
  c.model.path = args[0];
  c.model.dtype = "fp32";
  c.model.quantize = args[1];
  c.model.double_quant = args[2] == "1";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& [name, t] : base_as_trained(c))
    tensors.emplace_back(name, t);
  models::write_safetensors(args[3], tensors);
  return 0;
}

// Rondo's logits for a finished `rondo train` run, from its own state: the run's config.toml (LoRA
// settings) and the fp32 masters in its newest checkpoint, on the base model — nothing read back
// from the exported folders.
//   run-logits <run_dir> <batch.json> <out.safetensors>
int run_logits(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: run-logits <run_dir> <batch.json> <out>");
  const cli::ConfigFile f = cli::read_config(args[0] + "/config.toml", {});
  f.check();
  const engine::TrainConfig& c = f.config;
  std::vector<engine::CheckpointInfo> ckpts = engine::list_checkpoints(args[0]);
  if (ckpts.empty()) throw Error(args[0] + ": no checkpoint");
  models::SafetensorsFile state(ckpts.back().path + "/state.safetensors");
  models::Model model = models::Model::load(c.model.path, {.dtype = models::DType::kF32});
  std::vector<models::LayerSpec> specs = model.layers();
  if (c.training.method == "lora") specs = models::add_lora(specs, c.lora_config());
  // A LoRA run on a quantised base trained against the dequantised weights.
  std::map<std::string, at::Tensor> base;
  if (c.training.method == "lora") base = base_as_trained(c);
  auto tensor = [&](const std::string& name) -> at::Tensor {
    if (const models::TensorEntry* e = state.find(name)) return e->view().to(at::kFloat);
    if (models::is_lora_param(name)) throw Error(state.path() + ": no tensor " + name);
    if (auto it = base.find(name); it != base.end()) return it->second;
    return model.tensor(name);
  };
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  at::Tensor logits = forward(model.config(), specs, tensor, int_matrix(j["tokens"]));
  models::write_safetensors(args[2], {{"logits", logits}});
  return 0;
}

RegisterCommand reg_quantised_base("quantised-base",
                                   "<model> <quantize> <double_quant 0|1> <out.safetensors>",
                                   quantised_base);
RegisterCommand reg_run_logits("run-logits", "<run_dir> <batch.json> <out>", run_logits);
RegisterCommand reg_lora_train_export("lora-train-export", "<base_model_dir> <in.json> <out_dir>",
                                      lora_train_export);
RegisterCommand reg_lora_logits("lora-logits",
                                "<base_model_dir> <peft_adapter_dir> <batch.json> <out>",
                                lora_logits);

}  // namespace
}  // namespace rondo::oracle
