#include "models/lora.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "kernels/error.h"

namespace rondo::models {
namespace {

// The projections PEFT can target, with their place in a block.
const std::vector<std::pair<std::string, std::string>>& projections() {
  static const std::vector<std::pair<std::string, std::string>> kAll = {
      {"q_proj", "self_attn"}, {"k_proj", "self_attn"}, {"v_proj", "self_attn"},
      {"o_proj", "self_attn"}, {"gate_proj", "mlp"},    {"up_proj", "mlp"},
      {"down_proj", "mlp"}};
  return kAll;
}

bool targets(const LoraConfig& lora, const std::string& module) {
  for (const std::string& t : lora.targets)
    if (t == "all-linear" || t == module) return true;
  return false;
}

}  // namespace

double LoraConfig::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / rank;
}

std::vector<std::string> LoraConfig::problems() const {
  std::vector<std::string> out;
  if (rank < 1 || rank > 4096)
    out.push_back("LoRA rank must be in 1..4096 (got " + std::to_string(rank) + ")");
  if (!(alpha > 0)) out.push_back("LoRA alpha must be positive");
  if (!(dropout >= 0 && dropout < 1)) out.push_back("LoRA dropout must be in [0, 1)");
  if (targets.empty()) out.push_back("LoRA target modules: none given");
  for (const std::string& t : targets) {
    bool known = t == "all-linear";
    for (const auto& [name, where] : projections())
      known = known || t == name;
    if (!known)
      out.push_back("LoRA target module '" + t +
                    "' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                    "down_proj, all-linear");
  }
  return out;
}

LoraConfig parse_peft_adapter_config(const std::string& json_text, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const std::exception& e) {
    throw Error(source + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(source + ": not a JSON object");
  std::vector<std::string> problems;
  auto number = [&](const char* key, double fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_number()) {
      problems.push_back("'" + std::string(key) + "' must be a number");
      return fallback;
    }
    return j[key].get<double>();
  };
  LoraConfig c;
  if (j.value("peft_type", std::string("LORA")) != "LORA")
    problems.push_back("peft_type is '" + j["peft_type"].dump() + "', only LORA is supported");
  c.rank = static_cast<int>(number("r", 8));
  c.alpha = number("lora_alpha", 8);
  c.dropout = number("lora_dropout", 0);
  if (j.contains("use_rslora") && j["use_rslora"].is_boolean()) c.rslora = j["use_rslora"];
  if (j.contains("target_modules")) {
    const auto& t = j["target_modules"];
    c.targets.clear();
    if (t.is_string()) {
      c.targets.push_back(t.get<std::string>());
    } else if (t.is_array()) {
      // PEFT saves "all-linear" expanded into module paths (model.layers.0.mlp.down_proj): the
      // last component names the projection. A layer it leaves out shows as a missing tensor
      // when the adapter is loaded.
      std::set<std::string> seen;
      for (const auto& m : t) {
        if (!m.is_string()) continue;
        std::string name = m.get<std::string>();
        name = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
        if (seen.insert(name).second) c.targets.push_back(name);
      }
    } else {
      problems.push_back("'target_modules' must be a list of module names or \"all-linear\"");
    }
  }
  if (j.value("use_dora", false)) problems.push_back("use_dora: DoRA adapters are not supported");
  if (j.contains("bias") && j["bias"] != "none")
    problems.push_back("bias: " + j["bias"].dump() + " (only \"none\" is supported)");
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null() &&
      !j["modules_to_save"].empty())
    problems.push_back("modules_to_save is not supported");
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (j.contains(key) && !j[key].is_null() && !j[key].empty())
      problems.push_back(std::string(key) + ": per-module ranks and alphas are not supported");
  if (j.value("fan_in_fan_out", false)) problems.push_back("fan_in_fan_out: true is not supported");
  if (j.value("lora_bias", false)) problems.push_back("lora_bias: true is not supported");
  for (const char* key : {"layers_to_transform", "layers_pattern", "exclude_modules",
                          "target_parameters", "trainable_token_indices", "layer_replication"})
    if (j.contains(key) && !j[key].is_null() && !j[key].empty())
      problems.push_back(std::string(key) + " is not supported");
  std::vector<std::string> own = c.problems();
  problems.insert(problems.end(), own.begin(), own.end());
  if (!problems.empty())
    throw Error(join_problems(source + ": unusable LoRA adapter config:", problems));
  return c;
}

std::vector<LayerSpec> add_lora(std::vector<LayerSpec> specs, const LoraConfig& lora) {
  const std::vector<std::string> problems = lora.problems();
  if (!problems.empty()) throw Error(join_problems("LoRA settings:", problems));
  for (LayerSpec& s : specs) {
    if (s.kind != LayerKind::kBlock) continue;
    const std::string prefix = "model.layers." + std::to_string(s.block) + ".";
    std::vector<ParamSpec> adapters;
    for (const auto& [module, where] : projections()) {
      if (!targets(lora, module)) continue;
      const std::string base = prefix + where + "." + module;
      auto it = std::find_if(s.params.begin(), s.params.end(),
                             [&](const ParamSpec& p) { return p.name == base + ".weight"; });
      RONDO_ASSERT_MSG(it != s.params.end(), "no " + base + ".weight to adapt");
      const std::int64_t out = it->shape[0], in = it->shape[1];
      adapters.push_back({"base_model.model." + base + ".lora_A.weight", {lora.rank, in}});
      adapters.push_back({"base_model.model." + base + ".lora_B.weight", {out, lora.rank}});
    }
    s.params.insert(s.params.end(), adapters.begin(), adapters.end());
    s.lora_scaling = lora.scaling();
    s.lora_dropout = lora.dropout;
  }
  return specs;
}

bool is_lora_param(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

std::map<std::string, at::Tensor> merge_lora(const std::vector<LayerSpec>& specs,
                                             const std::map<std::string, at::Tensor>& all) {
  std::map<std::string, at::Tensor> out;
  for (const LayerSpec& spec : specs)
    for (const ParamSpec& p : spec.params) {
      if (p.tied || is_lora_param(p.name)) continue;
      at::Tensor w = all.at(p.name);
      const std::string stem = p.name.substr(0, p.name.size() - std::string(".weight").size());
      auto a = all.find("base_model.model." + stem + ".lora_A.weight");
      auto b = all.find("base_model.model." + stem + ".lora_B.weight");
      if (a != all.end() && b != all.end())
        w = w.to(at::kFloat) +
            at::matmul(b->second.to(at::kFloat), a->second.to(at::kFloat)) * spec.lora_scaling;
      out.emplace(p.name, w);
    }
  return out;
}

std::map<std::string, at::Tensor> init_lora(const std::vector<LayerSpec>& specs,
                                            std::uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::map<std::string, at::Tensor> out;
  for (const LayerSpec& s : specs)
    for (const ParamSpec& p : s.params) {
      if (!is_lora_param(p.name)) continue;
      if (p.name.find(".lora_B.") != std::string::npos) {
        out[p.name] = at::zeros(p.shape, at::kFloat);
      } else {
        const double bound = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
        out[p.name] = at::empty(p.shape, at::kFloat).uniform_(-bound, bound, gen);
      }
    }
  return out;
}

}  // namespace rondo::models
