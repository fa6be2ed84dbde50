// Rondo's side of test_gguf.py: reads GGUF files with models::GgufFile and writes what it read as
// JSON (metadata, tensor infos, config) and raw little-endian tensors (`<i>.bin`, listed in
// index.json) that numpy reads with np.fromfile, so no Rondo code runs on the Python side.
#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "driver.h"
#include "models/export.h"
#include "models/gguf.h"
#include "models/gguf_model.h"
#include "models/mapped_file.h"

namespace rondo::oracle {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

json value_json(const models::GgufValue& v) {
  using T = models::GgufValueType;
  switch (v.type()) {
    case T::kString:
      return std::string(*v.to_string());
    case T::kBool:
      return *v.to_bool();
    case T::kF32:
    case T::kF64:
      return *v.to_float();
    case T::kI8:
    case T::kI16:
    case T::kI32:
    case T::kI64:
      return *v.to_int();
    case T::kArray: {
      json a = json::array();
      for (std::uint64_t i = 0; i < v.size(); ++i)
        a.push_back(value_json(v.at(i)));
      return a;
    }
    default:
      return *v.to_uint();
  }
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(1, ' ', false, json::error_handler_t::replace);
  if (!out.flush()) throw std::runtime_error("cannot write " + path.string());
}

void write_tensor(const fs::path& path, const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(c.data_ptr()),
            static_cast<std::streamsize>(c.numel() * c.element_size()));
  if (!out.flush()) throw std::runtime_error("cannot write " + path.string());
}

models::DType target_dtype(const std::string& name) {
  if (name == "f32") return models::DType::kF32;
  if (name == "bf16") return models::DType::kBF16;
  throw std::runtime_error("dtype must be f32 or bf16, got " + name);
}

// gguf-meta <file.gguf> <out.json>
int gguf_meta(const std::vector<std::string>& args) {
  if (args.size() != 2) throw std::runtime_error("usage: gguf-meta <file.gguf> <out.json>");
  models::GgufFile f(args[0]);
  json meta = json::object();
  for (const auto& [key, v] : f.metadata()) {
    json e = {{"type", models::to_string(v.type())}, {"value", value_json(v)}};
    if (v.type() == models::GgufValueType::kArray)
      e["element_type"] = models::to_string(v.element_type());
    meta[key] = e;
  }
  json tensors = json::array();
  for (const models::GgufTensorInfo& t : f.tensors())
    tensors.push_back({{"name", t.name},
                       {"ne", t.ne},
                       {"type", models::ggml_type_info(t.type).name},
                       {"offset", t.offset},
                       {"n_bytes", t.n_bytes}});
  write_json(args[1], {{"version", f.version()},
                       {"alignment", f.alignment()},
                       {"data_offset", f.data_offset()},
                       {"metadata", meta},
                       {"tensors", tensors}});
  return 0;
}

// gguf-dequant <file.gguf> <out_dir> <f32|bf16>: every tensor through load_tensor.
int gguf_dequant(const std::vector<std::string>& args) {
  if (args.size() != 3)
    throw std::runtime_error("usage: gguf-dequant <file.gguf> <out_dir> <f32|bf16>");
  models::GgufFile f(args[0]);
  const models::DType dtype = target_dtype(args[2]);
  fs::path dir(args[1]);
  fs::create_directories(dir);
  json index = json::array();
  for (std::size_t i = 0; i < f.tensors().size(); ++i) {
    const models::GgufTensorInfo& t = f.tensors()[i];
    at::Tensor x = models::load_tensor(f, t.name, dtype);
    const std::string file = std::to_string(i) + ".bin";
    write_tensor(dir / file, x);
    index.push_back({{"name", t.name}, {"file", file}, {"shape", x.sizes().vec()}});
  }
  write_json(dir / "index.json", {{"dtype", args[2]}, {"tensors", index}});
  return 0;
}

// gguf-model <file.gguf> <out_dir> <f32|bf16>: config.json (ModelConfig) and every tensor under
// its Hugging Face name and layout.
int gguf_model(const std::vector<std::string>& args) {
  if (args.size() != 3)
    throw std::runtime_error("usage: gguf-model <file.gguf> <out_dir> <f32|bf16>");
  models::GgufFile f(args[0]);
  const models::DType dtype = target_dtype(args[2]);
  const models::ModelConfig c = models::config_from_gguf(f);
  fs::path dir(args[1]);
  fs::create_directories(dir);
  write_json(dir / "config.json",
             {{"architecture", c.architecture},
              {"family", models::to_string(c.family)},
              {"vocab_size", c.vocab_size},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_layers},
              {"num_attention_heads", c.num_heads},
              {"num_key_value_heads", c.num_kv_heads},
              {"head_dim", c.head_dim},
              {"max_position_embeddings", c.max_position_embeddings},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_theta", c.rope.theta},
              {"rope_type", c.rope.type},
              {"rope_factor", c.rope.factor},
              {"rope_low_freq_factor", c.rope.low_freq_factor},
              {"rope_high_freq_factor", c.rope.high_freq_factor},
              {"rope_original_max_position_embeddings", c.rope.original_max_position_embeddings},
              {"rope_attention_factor", c.rope.attention_factor},
              {"tie_word_embeddings", c.tie_word_embeddings},
              {"attention_bias", c.attention_bias},
              {"attention_out_bias", c.attention_out_bias},
              {"mlp_bias", c.mlp_bias},
              {"qk_norm", c.qk_norm},
              {"num_experts", c.num_experts},
              {"experts_per_token", c.experts_per_token},
              {"moe_intermediate_size", c.moe_intermediate_size},
              {"norm_topk_prob", c.norm_topk_prob},
              {"bos_token_id", c.bos_token_id},
              {"eos_token_ids", c.eos_token_ids}});
  json index = json::array();
  const auto mapping = models::gguf_tensor_mapping(f, c);
  for (std::size_t i = 0; i < mapping.size(); ++i) {
    at::Tensor x = models::load_hf_tensor(f, mapping[i], dtype);
    const std::string file = std::to_string(i) + ".bin";
    write_tensor(dir / file, x);
    index.push_back({{"name", mapping[i].hf_name},
                     {"gguf_name", mapping[i].gguf_name},
                     {"file", file},
                     {"shape", x.sizes().vec()}});
  }
  write_json(dir / "index.json", {{"dtype", args[2]}, {"tensors", index}});
  return 0;
}

// gguf-hf-files <file.gguf> <out_dir>: the Hugging Face files a merged export of the model writes
// beside its weights (config.json, generation_config.json, tokenizer.json, tokenizer_config.json).
int gguf_hf_files(const std::vector<std::string>& args) {
  if (args.size() != 2) throw std::runtime_error("usage: gguf-hf-files <file.gguf> <out_dir>");
  fs::create_directories(args[1]);
  for (const auto& [name, text] : models::hf_files_from_gguf(args[0], models::DType::kF32))
    models::write_file_durably((fs::path(args[1]) / name).string(), text);
  return 0;
}

RegisterCommand hf_files_cmd("gguf-hf-files", "<file.gguf> <out_dir>", gguf_hf_files);
RegisterCommand meta_cmd("gguf-meta", "<file.gguf> <out.json>", gguf_meta);
RegisterCommand dequant_cmd("gguf-dequant", "<file.gguf> <out_dir> <f32|bf16>", gguf_dequant);
RegisterCommand model_cmd("gguf-model", "<file.gguf> <out_dir> <f32|bf16>", gguf_model);

}  // namespace
}  // namespace rondo::oracle
