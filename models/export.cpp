#include "models/export.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "models/gguf_model.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/model_files.h"
#include "models/safetensors.h"
#include "models/tensor_view.h"

namespace rondo::models {
namespace fs = std::filesystem;
namespace {

void make_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create the folder " + dir + ": " + ec.message());
}

// What peft can load the base from: a Hugging Face folder as it is; for a GGUF file, the Hugging
// Face repository its metadata says it was converted from, when it says so, else the file (peft's
// PeftModel.from_pretrained takes a model loaded with transformers' gguf_file= instead).
std::string peft_base_name(const std::string& base_model) {
  std::error_code ec;
  if (!base_model.ends_with(".gguf") || !fs::is_regular_file(base_model, ec)) return base_model;
  const GgufFile f(base_model);
  std::string repo = f.get_string("general.source.huggingface.repository", "");
  const std::string url = f.get_string("general.source.url", "");
  const std::string hub = "huggingface.co/";
  if (repo.empty() && url.find(hub) != std::string::npos) {
    repo = url.substr(url.find(hub) + hub.size());
    // org/name, without a revision or file path after it
    const std::size_t first = repo.find('/');
    const std::size_t second = first == std::string::npos ? first : repo.find('/', first + 1);
    if (second != std::string::npos) repo.resize(second);
    if (first == std::string::npos) repo.clear();
  }
  return repo.empty() ? base_model : repo;
}

}  // namespace

void write_peft_adapter(const std::string& dir, const std::vector<LayerSpec>& specs,
                        const std::map<std::string, at::Tensor>& all, const LoraConfig& lora,
                        const std::string& base_model) {
  make_dir(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const LayerSpec& spec : specs)
    for (const ParamSpec& p : spec.params)
      if (is_lora_param(p.name)) tensors.emplace_back(p.name, all.at(p.name).to(at::kFloat));
  if (tensors.empty()) throw Error("export: the model has no LoRA adapters to export");
  write_safetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors,
                    {{"format", "pt"}});
  // Module names; a mixture of experts' MLP names as the target_parameters PEFT turns them into
  // (Note [LoRA on experts] in lora.cpp), with gate_up_proj's rank and alpha doubled: what
  // add_lora adapted.
  const bool moe = !specs.empty() && specs.front().config.num_experts > 0;
  const bool gpt_oss = moe && specs.front().config.family == Family::kGptOss;
  nlohmann::json targets = nlohmann::json::array(), parameters = nlohmann::json::array();
  for (const char* m :
       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}) {
    const std::string name = m;
    const bool mlp = name == "gate_proj" || name == "up_proj" || name == "down_proj";
    if ((!moe || !mlp) && std::any_of(lora.targets.begin(), lora.targets.end(),
                                      [&](auto& t) { return t == "all-linear" || t == name; }))
      targets.push_back(name);
  }
  auto any_spec = [&](auto&& has) { return std::any_of(specs.begin(), specs.end(), has); };
  if (any_spec([](const LayerSpec& s) { return s.lora_experts_gate_up; }))
    parameters.push_back("gate_up_proj");
  if (any_spec([](const LayerSpec& s) { return s.lora_experts_down; }))
    parameters.push_back("down_proj");
  if (any_spec([](const LayerSpec& s) {
        return std::any_of(s.params.begin(), s.params.end(), [](const ParamSpec& p) {
          return p.name.find(".mlp.gate.lora_A.") != std::string::npos ||
                 p.name.find(".mlp.router.lora_A.") != std::string::npos;
        });
      }))
    parameters.push_back(gpt_oss ? "router.weight" : "gate.weight");  // the router
  nlohmann::json config = {{"peft_type", "LORA"},
                           {"task_type", "CAUSAL_LM"},
                           {"base_model_name_or_path", peft_base_name(base_model)},
                           {"r", lora.rank},
                           {"lora_alpha", lora.alpha},
                           {"lora_dropout", lora.dropout},
                           {"use_rslora", lora.rslora},
                           {"target_modules", targets},
                           {"bias", "none"},
                           {"fan_in_fan_out", false},
                           {"init_lora_weights", true},
                           {"inference_mode", true},
                           {"modules_to_save", nullptr}};
  if (!parameters.empty()) {
    config["target_parameters"] = parameters;
    // GPT-OSS's experts are named as parameters, at the adapter's own rank and alpha.
    if (!gpt_oss &&
        std::find(parameters.begin(), parameters.end(), "gate_up_proj") != parameters.end()) {
      config["rank_pattern"] = {{".*\\.gate_up_proj", 2 * lora.rank}};
      config["alpha_pattern"] = {{".*\\.gate_up_proj", 2 * lora.alpha}};
    }
  }
  write_file_durably((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n");
}

void check_mergeable(const std::string& base_dir) {
  if (model_format(base_dir) != ModelFormat::kGguf) return;  // its files are copied
  const GgufFile base(base_dir);
  tokenizer_json(tokenizer_spec_from_gguf(base), base_dir);
}

std::vector<std::pair<std::string, std::string>> hf_files_from_gguf(const std::string& path,
                                                                    DType dtype) {
  const GgufFile base(path);
  const ModelConfig config = config_from_gguf(base);
  const TokenizerSpec tokenizer = tokenizer_spec_from_gguf(base);
  nlohmann::ordered_json generation = {{"_from_model_config", true}};
  if (config.bos_token_id >= 0) generation["bos_token_id"] = config.bos_token_id;
  if (!config.eos_token_ids.empty()) generation["eos_token_id"] = config.eos_token_ids;
  return {{"config.json", hf_config_json(config, dtype)},
          {"generation_config.json", generation.dump(2) + "\n"},
          {"tokenizer.json", tokenizer_json(tokenizer, path)},
          {"tokenizer_config.json",
           tokenizer_config_json(tokenizer, base, config.max_position_embeddings)}};
}

void write_merged(const std::string& dir, const std::vector<LayerSpec>& specs,
                  const std::map<std::string, at::Tensor>& all, const std::string& base_dir,
                  DType dtype) {
  write_merged(
      dir, specs, [&](std::size_t) { return all; }, base_dir, dtype);
}

void write_merged(
    const std::string& dir, const std::vector<LayerSpec>& specs,
    const std::function<std::map<std::string, at::Tensor>(std::size_t)>& layer_tensors,
    const std::string& base_dir, DType dtype) {
  // A GGUF base: the Hugging Face files rebuilt from its metadata, before any weight is written
  // (a tokenizer that cannot be rebuilt stops the export here).
  std::vector<std::pair<std::string, std::string>> generated;
  if (model_format(base_dir) == ModelFormat::kGguf) generated = hf_files_from_gguf(base_dir, dtype);
  make_dir(dir);
  // In spec order (the safetensors header lists them so); one layer merged at a time.
  std::vector<SafetensorsEntry> entries;
  std::vector<std::size_t> layer_of;
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (const ParamSpec& p : specs[l].params)
      if (!p.tied && !is_lora_param(p.name)) {
        entries.push_back({p.name, dtype, p.shape});
        layer_of.push_back(l);
      }
  std::map<std::string, at::Tensor> merged;
  std::size_t merged_layer = specs.size();
  write_safetensors((fs::path(dir) / "model.safetensors").string(), entries, {{"format", "pt"}},
                    [&](std::size_t i, const SafetensorsSink& sink) {
                      if (merged_layer != layer_of[i]) {
                        merged_layer = layer_of[i];
                        merged = merge_lora({specs[merged_layer]}, layer_tensors(merged_layer));
                      }
                      const at::Tensor t =
                          merged.at(entries[i].name).to(to_scalar_type(dtype)).contiguous();
                      sink(t.data_ptr(), t.nbytes());
                    });
  if (!generated.empty()) {
    for (const auto& [name, text] : generated)
      write_file_durably((fs::path(dir) / name).string(), text);
    return;
  }
  for (const char* name : {"config.json", "generation_config.json", "tokenizer.json",
                           "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                           "vocab.json", "merges.txt", "chat_template.jinja"}) {
    const fs::path src = fs::path(base_dir) / name;
    if (!fs::exists(src)) continue;
    std::ifstream in(src, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (std::string(name) == "config.json") {  // the weights' dtype as written
      nlohmann::json j = nlohmann::json::parse(text);
      // Written dense: a quantised base's (GPT-OSS's MXFP4 experts) format no longer applies.
      j.erase("quantization_config");
      j["torch_dtype"] = dtype == DType::kBF16  ? "bfloat16"
                         : dtype == DType::kF16 ? "float16"
                                                : "float32";
      text = j.dump(2) + "\n";
    }
    write_file_durably((fs::path(dir) / name).string(), text);
  }
}

}  // namespace rondo::models
