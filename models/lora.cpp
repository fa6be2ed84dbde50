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
    bool known = t == "all-linear" || t == "gate";
    for (const auto& [name, where] : projections())
      known = known || t == name;
    if (!known)
      out.push_back("LoRA target module '" + t +
                    "' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                    "down_proj, gate (a mixture of experts' router), all-linear");
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
  // PEFT's form for the fused experts of a mixture of experts (Note [LoRA on experts]):
  // target_parameters gate_up_proj (both MLP inputs) and down_proj, with gate_up_proj's rank and
  // alpha doubled by a pattern.
  bool fused = false;
  if (j.contains("target_parameters") && !j["target_parameters"].is_null() &&
      !j["target_parameters"].empty()) {
    const auto& t = j["target_parameters"];
    for (const auto& m : t.is_array() ? t : nlohmann::json::array({t})) {
      const std::string name = m.is_string() ? m.get<std::string>() : m.dump();
      const std::string leaf =
          name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
      if (leaf == "gate_up_proj") {
        fused = true;
        for (const char* p : {"gate_proj", "up_proj"})
          if (std::find(c.targets.begin(), c.targets.end(), p) == c.targets.end())
            c.targets.push_back(p);
      } else if (name == "gate.weight" || name.ends_with(".gate.weight") ||
                 name == "router.weight" || name.ends_with(".router.weight")) {  // the router
        if (std::find(c.targets.begin(), c.targets.end(), "gate") == c.targets.end())
          c.targets.push_back("gate");
      } else if (leaf == "down_proj") {
        if (std::find(c.targets.begin(), c.targets.end(), leaf) == c.targets.end())
          c.targets.push_back(leaf);
      } else {
        problems.push_back(
            "target_parameters: '" + name +
            "' is not an expert or router weight Rondo adapts (gate_up_proj, down_proj, "
            "gate.weight, router.weight)");
      }
    }
  }
  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    if (!j.contains(key) || j[key].is_null() || j[key].empty()) continue;
    const double want = std::string(key) == "rank_pattern" ? 2.0 * c.rank : 2.0 * c.alpha;
    const auto& pattern = j[key];
    const bool doubled_gate_up = fused && pattern.is_object() && pattern.size() == 1 &&
                                 pattern.contains(".*\\.gate_up_proj") &&
                                 pattern[".*\\.gate_up_proj"].is_number() &&
                                 pattern[".*\\.gate_up_proj"].get<double>() == want;
    if (!doubled_gate_up)
      problems.push_back(std::string(key) + " " + pattern.dump() +
                         ": per-module ranks and alphas are not supported (only PEFT's doubling "
                         "for the fused gate_up_proj of experts)");
  }
  if (j.value("fan_in_fan_out", false)) problems.push_back("fan_in_fan_out: true is not supported");
  if (j.value("lora_bias", false)) problems.push_back("lora_bias: true is not supported");
  for (const char* key : {"layers_to_transform", "layers_pattern", "exclude_modules",
                          "trainable_token_indices", "layer_replication"})
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
  // A mixture of experts, as PEFT 0.21 with transformers 5 adapts one (Note [LoRA on experts]):
  // the MLP names mean the sparse blocks' fused experts, gate_proj and up_proj together.
  const bool moe = !specs.empty() && specs.front().config.num_experts > 0;
  // GPT-OSS's experts and router are plain parameters to PEFT, adapted only when named
  // (target_parameters; all-linear reaches its attention alone), at the adapter's own rank.
  const bool gpt_oss = moe && specs.front().config.family == Family::kGptOss;
  auto named = [&](const char* t) {
    return std::find(lora.targets.begin(), lora.targets.end(), t) != lora.targets.end();
  };
  const bool gate_up = gpt_oss ? named("gate_proj") && named("up_proj")
                               : targets(lora, "gate_proj") && targets(lora, "up_proj");
  const bool down = gpt_oss ? named("down_proj") : targets(lora, "down_proj");
  // The router only when named (all-linear leaves it frozen).
  const bool router = named("gate");
  if (router && !moe)
    throw Error("LoRA target 'gate' is a mixture of experts' router; " +
                (specs.empty() ? std::string("this model") : specs.front().config.architecture) +
                " has none");
  if (moe && (gpt_oss ? named("gate_proj") != named("up_proj")
                      : targets(lora, "gate_proj") != targets(lora, "up_proj")))
    throw Error(
        "LoRA targets: gate_proj and up_proj of a mixture of experts are one fused weight per "
        "expert (gate_up_proj, as transformers 5 and PEFT hold them): target both or neither");
  if (moe && (gate_up || down || router) && lora.dropout > 0)
    throw Error(
        "LoRA dropout must be 0 for adapters on experts or the router (PEFT's parameter adapters "
        "cannot apply it): set lora.dropout = 0, or target only the attention projections q_proj, "
        "k_proj, v_proj, o_proj");
  for (LayerSpec& s : specs) {
    if (s.kind != LayerKind::kBlock) continue;
    const std::string prefix = "model.layers." + std::to_string(s.block) + ".";
    std::vector<ParamSpec> adapters;
    for (const auto& [module, where] : projections()) {
      if (!targets(lora, module) || (moe && where == "mlp")) continue;
      const std::string base = prefix + where + "." + module;
      auto it = std::find_if(s.params.begin(), s.params.end(),
                             [&](const ParamSpec& p) { return p.name == base + ".weight"; });
      RONDO_ASSERT_MSG(it != s.params.end(), "no " + base + ".weight to adapt");
      const std::int64_t out = it->shape[0], in = it->shape[1];
      adapters.push_back({"base_model.model." + base + ".lora_A.weight", {lora.rank, in}});
      adapters.push_back({"base_model.model." + base + ".lora_B.weight", {out, lora.rank}});
    }
    if (moe && s.config.sparse(s.block)) {
      // PEFT's layout for a 3-D parameter (E, out, in), or GPT-OSS's (E, in, out): A (E*R, in),
      // B (out, E*R). Converted from module names, gate_up_proj has rank and alpha doubled (PEFT
      // keeps alpha / r of the two projections it fuses); GPT-OSS's, named as a parameter, has
      // the adapter's own. The parameter wrapped first (gate_up_proj) is the inner one,
      // base_layer, when both are.
      const std::int64_t E = s.config.num_experts, I = s.config.moe_intermediate_size,
                         C = s.config.hidden_size, r = lora.rank * (gpt_oss ? 1 : 2);
      const std::string experts = "base_model.model." + prefix + "mlp.experts.";
      if (gate_up) {
        const std::string stem = experts + (down ? "base_layer." : "");
        adapters.push_back({stem + "lora_A.weight", {r * E, C}});
        adapters.push_back({stem + "lora_B.weight", {2 * I, r * E}});
        LoraConfig fused = lora;
        fused.rank = static_cast<int>(r);
        fused.alpha = gpt_oss ? lora.alpha : 2 * lora.alpha;
        s.lora_fused_scaling = fused.scaling();
        s.lora_experts_gate_up = true;
      }
      if (down) {
        adapters.push_back({experts + "lora_A.weight", {lora.rank * E, I}});
        adapters.push_back({experts + "lora_B.weight", {C, lora.rank * E}});
        s.lora_experts_down = true;
      }
      if (router) {  // PEFT's target_parameters gate.weight (router.weight): a 2-D adapter
        const std::string gate =
            "base_model.model." + prefix + (gpt_oss ? "mlp.router." : "mlp.gate.");
        adapters.push_back({gate + "lora_A.weight", {lora.rank, C}});
        adapters.push_back({gate + "lora_B.weight", {E, lora.rank}});
      }
    }
    s.params.insert(s.params.end(), adapters.begin(), adapters.end());
    s.lora_scaling = lora.scaling();
    s.lora_dropout = lora.dropout;
  }
  return specs;
}

// Note [LoRA on experts]
// transformers 5 holds a sparse block's experts fused (experts.gate_up_proj (E, 2I, C),
// experts.down_proj (E, C, I)), and PEFT 0.21 converts the MLP module names of a LoRA config for
// such a model into target_parameters on them (transformers_weight_conversion.py): gate_proj and
// up_proj together become gate_up_proj with rank 2r and alpha 2*alpha, down_proj stays; the dense
// blocks' MLPs (Qwen3-MoE's mlp_only_layers) are then not adapted at all, since the names no
// longer reach them. PEFT's ParamWrapper gives each 3-D parameter one A (E*R, in) and one B
// (out, E*R); expert e's delta is B[:, e::E] A[e*R:(e+1)*R] * scaling (B is read as (out, R, E)),
// added to the expert's weight. Rondo keeps its experts one tensor per projection as the
// checkpoints store them, and these adapters as PEFT names and shapes them, so that an adapter
// folder goes to and from peft unchanged; the layers apply expert e's slices to its tokens.

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
      std::int64_t e = 0;
      int proj = 0;
      if ((spec.lora_experts_gate_up || spec.lora_experts_down) &&
          parse_expert_name(p.name, &e, &proj)) {
        // PEFT's expert adapters (Note [LoRA on experts]): gate and up share gate_up_proj's.
        const bool fused = proj < 2;
        if (fused ? spec.lora_experts_gate_up : spec.lora_experts_down) {
          const std::string stem = "base_model.model.model.layers." + std::to_string(spec.block) +
                                   ".mlp.experts." +
                                   (fused && spec.lora_experts_down ? "base_layer." : "");
          at::Tensor d = expert_lora_delta(all.at(stem + "lora_A.weight").to(at::kFloat),
                                           all.at(stem + "lora_B.weight").to(at::kFloat),
                                           spec.config.num_experts, e);
          if (fused) d = d.narrow(0, proj == 0 ? 0 : w.size(0), w.size(0));
          w = w.to(at::kFloat) + d * (fused ? spec.lora_fused_scaling : spec.lora_scaling);
        }
        out.emplace(p.name, w);
        continue;
      }
      const std::string experts = "model.layers." + std::to_string(spec.block) + ".mlp.experts.";
      const bool fused_gate_up = p.name == experts + "gate_up_proj",
                 fused_down = p.name == experts + "down_proj";
      if (fused_gate_up ? spec.lora_experts_gate_up : fused_down && spec.lora_experts_down) {
        // GPT-OSS's (E, in, out) experts: expert e gains (B_e A_e)^T, as PEFT's ParamWrapper adds.
        const std::string stem = "base_model.model." + experts +
                                 (fused_gate_up && spec.lora_experts_down ? "base_layer." : "");
        const at::Tensor a = all.at(stem + "lora_A.weight").to(at::kFloat),
                         b = all.at(stem + "lora_B.weight").to(at::kFloat);
        std::vector<at::Tensor> deltas;
        for (std::int64_t x = 0; x < spec.config.num_experts; ++x)
          deltas.push_back(expert_lora_delta(a, b, spec.config.num_experts, x).t());
        out.emplace(p.name,
                    w.to(at::kFloat) + at::stack(deltas) * (fused_gate_up ? spec.lora_fused_scaling
                                                                          : spec.lora_scaling));
        continue;
      }
      std::string stem = p.name.substr(0, p.name.size() - std::string(".weight").size());
      // Mixtral's router is block_sparse_moe.gate on disk, mlp.gate to PEFT (transformers 5).
      if (const std::size_t m = stem.find(".block_sparse_moe.gate"); m != std::string::npos)
        stem.replace(m, std::string(".block_sparse_moe").size(), ".mlp");
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
