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

Model load_with_adapter(const std::string& model_path, const std::string& adapter,
                        const LoadOptions& options) {
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
  const LoraConfig lora = parse_peft_adapter_config(
      read_text_file(config_path.string(), "the LoRA adapter config"), config_path.string());
  const SafetensorsFile file((dir / "adapter_model.safetensors").string());
  std::map<std::string, at::Tensor> trained;
  for (const TensorEntry& t : file.tensors())
    trained.emplace(t.name, t.view());
  return load_with_trained(model_path, &lora, trained, file.path(), options);
}

Model load_with_trained(const std::string& model_path, const LoraConfig* lora,
                        const std::map<std::string, at::Tensor>& trained, const std::string& source,
                        const LoadOptions& options) {
  // The merged model keeps the base's untouched tensors, which may view its file mapping: the
  // mapping stays alive with it (the base's other tensors go with the base).
  const Model base = Model::load(model_path, {.dtype = DType::kF32});
  const std::vector<LayerSpec> specs = lora ? add_lora(base.layers(), *lora) : base.layers();
  std::map<std::string, at::Tensor> all;
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
        else
          all.emplace(p.name, base.tensor(p.name));
      } else if (it->second.sizes().vec() != p.shape) {
        problems.push_back(p.name + " is " + shape_text(it->second.sizes().vec()) +
                           ", this base needs " + shape_text(p.shape));
      } else {  // a copy: `trained` may view a mapping that goes before the model does
        all.emplace(p.name, it->second.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
      }
    }
  for (const auto& [name, t] : trained)
    if (!known.count(name))
      problems.push_back(name + " is not a tensor of this base" +
                         (lora ? "'s targeted projections" : ""));
  if (!problems.empty())
    throw Error(join_problems(
        source + " does not fit " + model_path + (lora ? " (an adapter of another model?):" : ":"),
        problems));
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

}  // namespace rondo::models
