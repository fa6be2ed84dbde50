// Driver subcommand for the LoRA oracle test.
//   lora-logits <base_model_dir> <peft_adapter_dir> <batch.json> <out.safetensors>
//     batch.json: {"tokens": [[...]]}; loads the base (f32) and the PEFT adapter
//     (adapter_config.json, adapter_model.safetensors), runs the model's layer functions with the
//     adapters bound (inference: no dropout) and writes "logits" (B, T, V) f32.
#include <ATen/ATen.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "driver_json.h"
#include "kernels/error.h"
#include "models/lora.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/safetensors.h"

namespace rondo::oracle {
namespace {

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
  models::TokenBatch batch{int_matrix(j["tokens"]), {}};
  const models::ModelConfig& c = model.config();
  models::AttentionContext ctx = models::make_attention_context(c, batch, at::kFloat);
  at::Tensor x = models::embed(tensor(specs[0].params[0].name), batch.tokens);
  for (std::size_t l = 1; l + 1 < specs.size(); ++l) {
    std::vector<at::Tensor> w;
    for (const models::ParamSpec& p : specs[l].params)
      w.push_back(tensor(p.name));
    x = models::block_forward(c, models::BlockWeights::bind(specs[l], w), x, ctx);
  }
  const models::LayerSpec& head = specs.back();
  at::Tensor logits =
      models::head_logits(c, tensor(head.params[0].name), tensor(head.params[1].name), x);
  models::write_safetensors(args[3], {{"logits", logits}});
  return 0;
}

RegisterCommand reg_lora_logits("lora-logits",
                                "<base_model_dir> <peft_adapter_dir> <batch.json> <out>",
                                lora_logits);

}  // namespace
}  // namespace rondo::oracle
