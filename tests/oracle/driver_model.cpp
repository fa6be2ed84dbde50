// Driver subcommands for the model oracle tests.
//   forward <model> <batch.json> <out.safetensors>
//     batch.json: {"tokens": [[...], ...], "doc_ids": [[...], ...] (optional), "dtype": "F32"}
//     writes "logits" (B, T, V) f32, "loss_sum" () f32 and "target_count" () i64, the loss over
//     next-token targets inside each document.
//   generate <model> <in.json> <out.json>
//     in.json: {"prompt": [...], "max_new_tokens": n, "temperature": t, "top_p": p, "seed": s,
//               "adapter": "<peft folder>" (optional)}
//     out.json: {"tokens": [...]} (new tokens only)
//   rms-norm <config.json> <in.safetensors> <out.safetensors>
//     in: "x" and "weight" in their own dtypes; writes "y", the family's RMSNorm of x.
#include <ATen/ATen.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "driver_json.h"
#include "kernels/error.h"
#include "models/config.h"
#include "models/generate.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/peft_adapter.h"
#include "models/safetensors.h"

namespace rondo::oracle {
namespace {

int forward(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: forward <model> <batch.json> <out.safetensors>");
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  models::LoadOptions options;
  if (j.contains("dtype")) options.dtype = models::dtype_from_string(j["dtype"].get<std::string>());
  models::Model model = models::Model::load(args[0], options);
  models::TokenBatch batch{int_matrix(j["tokens"]), {}};
  if (j.contains("doc_ids")) batch.doc_ids = int_matrix(j["doc_ids"]);
  at::Tensor logits = model.logits(batch);
  at::Tensor targets = models::next_token_targets(batch);
  at::Tensor loss = model.loss_sum(batch, targets);
  at::Tensor count = targets.ne(-100).sum();
  models::write_safetensors(args[2],
                            {{"logits", logits}, {"loss_sum", loss}, {"target_count", count}});
  return 0;
}

int generate(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: generate <model> <in.json> <out.json>");
  nlohmann::json j;
  std::ifstream(args[1]) >> j;
  // "adapter": a PEFT folder folded in, as `rondo generate --adapter` does.
  models::Model model = j.contains("adapter")
                            ? models::load_with_adapter(args[0], j["adapter"].get<std::string>(),
                                                        {.dtype = models::DType::kF32})
                            : models::Model::load(args[0], {.dtype = models::DType::kF32});
  models::SamplingOptions options;
  options.max_new_tokens = j.value("max_new_tokens", 16);
  options.temperature = j.value("temperature", 0.0);
  options.top_p = j.value("top_p", 1.0);
  options.seed = j.value("seed", 0);
  auto tokens = models::generate(model, j["prompt"].get<std::vector<std::int64_t>>(), options);
  std::ofstream(args[2]) << nlohmann::json{{"tokens", tokens}}.dump();
  return 0;
}

int rms_norm(const std::vector<std::string>& args) {
  if (args.size() != 3) throw Error("usage: rms-norm <config.json> <in.safetensors> <out>");
  std::ifstream f(args[0]);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const models::ModelConfig c = models::parse_hf_config(text, args[0]);
  const models::SafetensorsFile in(args[1]);
  const at::Tensor y = models::rms_norm(c, in.find("x")->view(), in.find("weight")->view());
  models::write_safetensors(args[2], {{"y", y}});
  return 0;
}

RegisterCommand reg_rms_norm("rms-norm", "<config.json> <in.safetensors> <out.safetensors>",
                             rms_norm);
RegisterCommand reg_forward("forward", "<model> <batch.json> <out.safetensors>", forward);
RegisterCommand reg_generate("generate", "<model> <in.json> <out.json>", generate);

}  // namespace
}  // namespace rondo::oracle
