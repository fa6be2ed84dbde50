// Driver subcommand for the optimizer oracle test.
//   optimizer <in.json> <out.safetensors>
//     in.json: {"layers": [[{"name", "numel", "trainable", "tied_to"}, ...], ...],
//               "init": {name: [f32...]}, "grads": [[{name: [f32...]} per layer] per step],
//               "lr", "weight_decay", "betas": [b1, b2], "eps", "max_norm",
//               "moments": "f32" (default) or "8bit"}
//     writes "s<step>.<name>" (the f32 master after each step, owners only) and "norm<step>";
//     with 8-bit moments also "s<step>.<name>.{m_codes,m_absmax,v_codes,v_absmax}".
#include <ATen/ATen.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "engine/optimizer.h"
#include "kernels/cpu/adamw8bit.h"
#include "kernels/error.h"
#include "models/safetensors.h"

namespace rondo::oracle {
namespace {

int optimizer(const std::vector<std::string>& args) {
  if (args.size() != 2) throw Error("usage: optimizer <in.json> <out.safetensors>");
  nlohmann::json j;
  std::ifstream(args[0]) >> j;
  std::vector<offload::LayerDesc> layers;
  for (const auto& layer : j["layers"]) {
    offload::LayerDesc d;
    d.moments = j.value("moments", "f32") == "8bit" ? offload::MomentFormat::kBlockwise8
                                                    : offload::MomentFormat::kF32;
    for (const auto& t : layer)
      d.tensors.push_back({t["name"], t["numel"], t["trainable"], t.value("tied_to", -1)});
    layers.push_back(d);
  }
  offload::HostArena arena({.pinning = offload::Pinning::kOff});
  offload::LayerStore store(arena, layers, kernels::FloatDType::kF32, kernels::FloatDType::kF32);
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (const auto& t : store.layer(l))
      if (!t.tied) {
        auto init = j["init"][t.name].get<std::vector<float>>();
        RONDO_ASSERT(init.size() == t.numel);
        std::memcpy(t.stream, init.data(), t.numel * 4);
        if (t.master) std::memcpy(t.master, init.data(), t.numel * 4);
      }
  kernels::AdamWParams p;
  p.lr = j["lr"];
  p.weight_decay = j["weight_decay"];
  p.beta1 = j["betas"][0];
  p.beta2 = j["betas"][1];
  p.eps = j["eps"];
  engine::Optimizer opt(store, p, j["max_norm"]);
  std::vector<std::pair<std::string, at::Tensor>> out;
  int step = 0;
  for (const auto& grads : j["grads"]) {
    ++step;
    for (std::size_t l = 0; l < store.layers(); ++l)
      for (const auto& t : store.layer(l))
        if (t.trainable) {
          auto g = grads[l][t.name].get<std::vector<float>>();
          std::memcpy(t.grad, g.data(), t.numel * 4);
        }
    double norm = opt.begin_step();
    for (std::size_t l = 0; l < store.layers(); ++l)
      opt.update_layer(l);
    out.push_back({"norm" + std::to_string(step), at::scalar_tensor(norm, at::kDouble)});
    for (std::size_t l = 0; l < store.layers(); ++l)
      for (const auto& t : store.layer(l))
        if (t.trainable && !t.tied) {
          const std::string name = "s" + std::to_string(step) + "." + t.name;
          const auto n = static_cast<std::int64_t>(t.numel);
          const auto blocks = static_cast<std::int64_t>(kernels::adamw8bit_blocks(t.numel));
          out.push_back({name, at::from_blob(t.master, {n}, at::kFloat).clone()});
          if (t.m_codes) {
            out.push_back({name + ".m_codes", at::from_blob(t.m_codes, {n}, at::kByte).clone()});
            out.push_back({name + ".v_codes", at::from_blob(t.v_codes, {n}, at::kByte).clone()});
            out.push_back(
                {name + ".m_absmax", at::from_blob(t.m_absmax, {blocks}, at::kFloat).clone()});
            out.push_back(
                {name + ".v_absmax", at::from_blob(t.v_absmax, {blocks}, at::kFloat).clone()});
          }
        }
  }
  models::write_safetensors(args[1], out);
  return 0;
}

RegisterCommand reg("optimizer", "<in.json> <out.safetensors>", optimizer);

}  // namespace
}  // namespace rondo::oracle
