#include "models/peft_adapter.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "kernels/error.h"
#include "models/lora.h"
#include "models/mapped_file.h"
#include "models/safetensors.h"
#include "models/tensor_view.h"

namespace rondo::models {

namespace fs = std::filesystem;

PeftAdapter read_peft_adapter(const std::string& adapter) {
  fs::path dir(adapter);
  std::error_code ec;
  if (!fs::exists(dir / "adapter_config.json", ec) &&
      fs::exists(dir / "adapter" / "adapter_config.json", ec))
    dir /= "adapter";  // a run folder: its final export
  const fs::path config_path = dir / "adapter_config.json";
  if (!fs::exists(config_path, ec))
    throw Error(adapter +
                ": no adapter_config.json; give a PEFT adapter folder (rondo export RUN writes "
                "one; a finished LoRA run has it in RUN/adapter)");
  PeftAdapter out;
  out.lora = parse_peft_adapter_config(
      read_text_file(config_path.string(), "the LoRA adapter config"), config_path.string());
  auto file = std::make_shared<SafetensorsFile>((dir / "adapter_model.safetensors").string());
  for (const TensorEntry& t : file->tensors())
    out.tensors.emplace(t.name, t.view());
  out.source = file->path();
  out.file = std::move(file);
  return out;
}

Model load_with_adapter(const std::string& model_path, const std::string& adapter,
                        const LoadOptions& options) {
  const PeftAdapter a = read_peft_adapter(adapter);
  return load_with_trained(model_path, &a.lora, a.tensors, a.source, options);
}

std::vector<std::string> trained_problems(const std::vector<LayerSpec>& specs,
                                          const std::map<std::string, at::Tensor>& trained,
                                          bool lora) {
  std::vector<std::string> problems;
  std::set<std::string> known;
  for (const LayerSpec& spec : specs)
    for (const ParamSpec& p : spec.params) {
      if (p.tied) continue;
      known.insert(p.name);
      auto it = trained.find(p.name);
      if (it == trained.end()) {
        if (is_lora_param(p.name))
          problems.push_back("no tensor " + p.name + " (the adapter config targets it)");
      } else if (it->second.sizes().vec() != p.shape) {
        problems.push_back(p.name + " is " + shape_text(it->second.sizes().vec()) +
                           ", this base needs " + shape_text(p.shape));
      }
    }
  for (const auto& [name, t] : trained)
    if (!known.count(name))
      problems.push_back(name + " is not a tensor of this base" +
                         (lora ? "'s targeted projections" : ""));
  return problems;
}

void throw_trained_problems(const std::vector<std::string>& problems, const std::string& source,
                            const std::string& model_path, bool lora) {
  throw Error(join_problems(
      source + " does not fit " + model_path + (lora ? " (an adapter of another model?):" : ":"),
      problems));
}

Model load_with_trained(const std::string& model_path, const LoraConfig* lora,
                        const std::map<std::string, at::Tensor>& trained, const std::string& source,
                        const LoadOptions& options) {
  // The merged model keeps the base's untouched tensors, which may view its file mapping: the
  // mapping stays alive with it (the base's other tensors go with the base).
  const Model base = Model::load(model_path, {.dtype = DType::kF32});
  const std::vector<LayerSpec> specs = lora ? add_lora(base.layers(), *lora) : base.layers();
  const std::vector<std::string> problems = trained_problems(specs, trained, lora != nullptr);
  if (!problems.empty()) throw_trained_problems(problems, source, model_path, lora != nullptr);
  std::map<std::string, at::Tensor> all;
  for (const LayerSpec& spec : specs)
    for (const ParamSpec& p : spec.params) {
      if (p.tied) continue;
      auto it = trained.find(p.name);
      // A copy: `trained` may view a mapping that goes before the model does.
      all.emplace(p.name, it == trained.end() ? base.tensor(p.name)
                                              : it->second.to(at::kFloat, /*non_blocking=*/false,
                                                              /*copy=*/true));
    }
  std::map<std::string, at::Tensor> merged = lora ? merge_lora(specs, all) : std::move(all);
  all.clear();
  std::shared_ptr<void> keepalive = base.keepalive();
  if (options.dtype && *options.dtype != DType::kF32) {
    for (auto& [name, t] : merged)
      t = t.to(to_scalar_type(*options.dtype));  // copies: nothing views the mapping any more
    keepalive.reset();
  }
  return Model::from_tensors(base.config(), std::move(merged), model_path + " with " + source,
                             std::move(keepalive));
}

void start_from_adapter(const std::string& adapter, const LoraConfig& lora,
                        const std::vector<LayerSpec>& specs,
                        std::map<std::string, at::Tensor>& adapters) {
  const PeftAdapter start = read_peft_adapter(adapter);
  if (start.lora.rank != lora.rank || start.lora.scaling() != lora.scaling())
    throw Error("lora.init_adapter " + start.source + ": rank " + std::to_string(start.lora.rank) +
                ", alpha " + std::to_string(start.lora.alpha) +
                (start.lora.rslora ? " (rsLoRA)" : "") +
                ", but the run's lora settings give rank " + std::to_string(lora.rank) +
                ", alpha " + std::to_string(lora.alpha) + (lora.rslora ? " (rsLoRA)" : "") +
                "; set lora.rank, lora.alpha and lora.rslora as the adapter has them");
  const std::vector<std::string> problems = trained_problems(specs, start.tensors, true);
  if (!problems.empty())
    throw_trained_problems(problems, "lora.init_adapter " + start.source, "the run's model", true);
  for (auto& [name, t] : adapters)
    t = start.tensors.at(name).to(at::kFloat).clone();
}

}  // namespace rondo::models
