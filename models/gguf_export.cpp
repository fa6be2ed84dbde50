#include "models/gguf_export.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "kernels/error.h"
#include "kernels/quant.h"
#include "models/dequant.h"
#include "models/gguf_model.h"
#include "models/gguf_writer.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/tokenizer.h"

namespace rondo::models {
namespace {

constexpr const char* kLoraA = ".lora_A.weight";
constexpr const char* kLoraB = ".lora_B.weight";
constexpr const char* kPeftPrefix = "base_model.model.";

// llama.cpp's llama_ftype numbers for general.file_type.
std::uint32_t file_type(GgufExportType t) {
  switch (t) {
    case GgufExportType::kF32:
      return 0;
    case GgufExportType::kF16:
      return 1;
    case GgufExportType::kQ8_0:
      return 7;
    case GgufExportType::kQ4_K_M:
      return 15;
    case GgufExportType::kBF16:
      return 32;
    case GgufExportType::kBase:
      break;
  }
  RONDO_ASSERT(false);
  return 0;
}

// llama.cpp gives these layers of attn_v and ffn_down more bits in its _M mixes: the first and
// last eighth, and every third layer between.
bool use_more_bits(std::int64_t layer, std::int64_t layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

// A type whose blocks hold whole rows of `cols` elements: `want`, or Q8_0, or F16.
GgmlType fitting(GgmlType want, std::int64_t cols) {
  for (GgmlType t : {want, GgmlType::kQ8_0, GgmlType::kF16})
    if (cols % ggml_type_info(t).block_size == 0) return t;
  return GgmlType::kF16;
}

bool writable(GgmlType t) {
  return t == GgmlType::kF32 || t == GgmlType::kF16 || t == GgmlType::kBF16 ||
         ggml_quant_type(t) != kernels::QuantType::kNone;
}

GgmlType choose_type(GgufExportType type, const GgufTensorMapping& m, const ModelConfig& c,
                     const GgufFile* base) {
  if (m.shape.size() == 1) return GgmlType::kF32;  // norms and biases, as llama.cpp keeps them
  const std::int64_t cols = m.shape.back();
  switch (type) {
    case GgufExportType::kF32:
      return GgmlType::kF32;
    case GgufExportType::kF16:
      return GgmlType::kF16;
    case GgufExportType::kBF16:
      return GgmlType::kBF16;
    case GgufExportType::kQ8_0:
      return fitting(GgmlType::kQ8_0, cols);
    case GgufExportType::kQ4_K_M: {
      const std::string& g = m.gguf_name;
      bool more = g == "output.weight" || (c.tie_word_embeddings && g == "token_embd.weight");
      if (g.starts_with("blk.") &&
          (g.ends_with(".attn_v.weight") || g.ends_with(".ffn_down.weight"))) {
        const std::int64_t layer = std::stoll(g.substr(4));
        more = use_more_bits(layer, c.num_layers);
      }
      return fitting(more ? GgmlType::kQ6_K : GgmlType::kQ4_K, cols);
    }
    case GgufExportType::kBase: {
      const GgmlType t = base->tensor(m.gguf_name).type;
      return writable(t) ? fitting(t, cols) : fitting(GgmlType::kQ8_0, cols);
    }
  }
  RONDO_ASSERT(false);
  return GgmlType::kF32;
}

// `t` (any float dtype, torch layout) as `type`'s bytes, in ggml's row-major order (ne[0] = the
// last torch dimension).
std::vector<std::uint8_t> encode(const at::Tensor& t, GgmlType type, const std::string& name) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  const std::int64_t cols = f.dim() == 0 ? 1 : f.size(-1);
  const std::int64_t rows = f.numel() / cols;
  auto bytes_of = [](const at::Tensor& x) {
    const auto* p = static_cast<const std::uint8_t*>(x.data_ptr());
    return std::vector<std::uint8_t>(p, p + x.nbytes());
  };
  switch (type) {
    case GgmlType::kF32:
      return bytes_of(f);
    case GgmlType::kF16:
      return bytes_of(f.to(at::kHalf));
    case GgmlType::kBF16:
      return bytes_of(f.to(at::kBFloat16));
    default:
      break;
  }
  const kernels::QuantFormat format{.type = ggml_quant_type(type)};
  RONDO_ASSERT(format.type != kernels::QuantType::kNone);
  std::vector<std::uint8_t> out(kernels::quant_bytes(format, rows, cols));
  try {
    kernels::quantize(format, f.data_ptr(), kernels::FloatDType::kF32, rows, cols, out.data());
  } catch (const Error& e) {
    throw Error("tensor '" + name + "': " + e.what());
  }
  return out;
}

// The architecture a GGUF Rondo writes says. GPT-OSS is read, not yet written: its merged
// export and adapters have not been checked against llama.cpp.
std::string export_architecture(Family family) {
  if (family == Family::kGptOss)
    throw Error(
        "GGUF export of GPT-OSS is not supported yet: export a merged Hugging Face folder "
        "(--format merged) or a PEFT adapter (--format adapter)");
  return gguf_architecture(family);
}

// HF name -> the mapping of the model's tensors.
std::unordered_map<std::string, GgufTensorMapping> by_hf_name(const ModelConfig& config) {
  std::unordered_map<std::string, GgufTensorMapping> out;
  for (GgufTensorMapping& m : gguf_names(config))
    out.emplace(m.hf_name, std::move(m));
  return out;
}

// llama.cpp's pre-tokenizer name for a tokenizer.json's pre_tokenizer, from what it does: the
// Split regexes and ByteLevel steps of the families Rondo reads. Throws Error for any other.
std::string llama_cpp_pre(const nlohmann::json& j, const std::string& source) {
  std::vector<nlohmann::json> steps;
  const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
  if (pre.is_object() && pre.value("type", "") == "Sequence")
    steps = pre.value("pretokenizers", std::vector<nlohmann::json>{});
  else if (pre.is_object())
    steps = {pre};
  auto is = [&](std::size_t i, const char* type) {
    return i < steps.size() && steps[i].value("type", "") == type;
  };
  auto byte_level = [&](std::size_t i, bool regex) {
    return is(i, "ByteLevel") && steps[i].value("use_regex", true) == regex;
  };
  auto split = [&](std::string_view regex) {
    return is(0, "Split") && steps[0].contains("pattern") &&
           steps[0]["pattern"].value("Regex", "") == regex &&
           steps[0].value("behavior", "") == "Isolated" && !steps[0].value("invert", false);
  };
  if (steps.size() == 2 && split(kSplitRegexLlama3) && byte_level(1, false)) return "llama-bpe";
  if (steps.size() == 2 && split(kSplitRegexQwen2) && byte_level(1, false)) return "qwen2";
  if (steps.size() == 2 && is(0, "Digits") && steps[0].value("individual_digits", false) &&
      byte_level(1, true))
    return "smollm";
  if (steps.size() == 1 && byte_level(0, true)) return "gpt-2";
  throw Error(source +
              ": its pre-tokenizer is not one whose llama.cpp name Rondo knows (Llama 3, "
              "Qwen2, SmolLM, GPT-2); convert a merged export with llama.cpp's "
              "convert_hf_to_gguf.py instead");
}

// A Hugging Face folder's tokenizer.json, checked to be what a merged GGUF can carry: byte-level
// BPE (its pre-tokenizer is checked by llama_cpp_pre).
nlohmann::json hf_tokenizer_json(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  nlohmann::json j = nlohmann::json::parse(read_text_file(path, "tokenizer", kTokenizerFileLimit),
                                           nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw Error(path + ": not a tokenizer.json with a model");
  const nlohmann::json& model = j["model"];
  if (model.value("type", "") != "BPE" || model.value("byte_fallback", false))
    throw Error(path +
                ": a merged GGUF is written for byte-level BPE tokenizers (Llama 3, Qwen, "
                "SmolLM, GPT-2); for this one, convert a merged export with llama.cpp's "
                "convert_hf_to_gguf.py");
  return j;
}

// The chat template text of a Hugging Face folder: tokenizer_config.json's chat_template (a string
// or the "default" entry of a list), else chat_template.jinja; "" when there is none.
std::string hf_chat_template(const std::string& dir) {
  const std::string cfg = dir + "/tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(cfg, ec)) {
    const nlohmann::json j = nlohmann::json::parse(read_text_file(cfg, "tokenizer config"));
    const nlohmann::json t = j.value("chat_template", nlohmann::json());
    if (t.is_string()) return t.get<std::string>();
    if (t.is_array())
      for (const nlohmann::json& e : t)
        if (e.is_object() && e.value("name", "") == "default") return e.value("template", "");
  }
  const std::string jinja = dir + "/chat_template.jinja";
  if (std::filesystem::exists(jinja, ec)) return read_text_file(jinja, "chat template");
  return "";
}

// llama.cpp's metadata for a model from a Hugging Face folder: the architecture's keys (as
// llama.cpp's converter writes them) and the tokenizer (byte-level BPE).
void set_hf_metadata(GgufWriter& w, const std::string& dir, const ModelConfig& c) {
  const std::string arch = export_architecture(c.family);
  auto key = [&](const char* k) { return arch + "." + k; };
  auto u32 = [](std::int64_t v) { return static_cast<std::uint32_t>(v); };
  w.set_string("general.architecture", arch);
  w.set_string("general.type", "model");
  w.set_string("general.name", std::filesystem::path(dir).filename().string());
  w.set_u32(key("context_length"), u32(c.max_position_embeddings));
  w.set_u32(key("embedding_length"), u32(c.hidden_size));
  w.set_u32(key("block_count"), u32(c.num_layers));
  w.set_u32(key("feed_forward_length"), u32(c.intermediate_size));
  w.set_u32(key("attention.head_count"), u32(c.num_heads));
  w.set_u32(key("attention.head_count_kv"), u32(c.num_kv_heads));
  w.set_u32(key("attention.key_length"), u32(c.head_dim));
  w.set_u32(key("attention.value_length"), u32(c.head_dim));
  w.set_u32(key("rope.dimension_count"), u32(c.head_dim));
  w.set_f32(key("rope.freq_base"), static_cast<float>(c.rope.theta));
  w.set_f32(key("attention.layer_norm_rms_epsilon"), static_cast<float>(c.rms_norm_eps));
  w.set_u32(key("vocab_size"), u32(c.vocab_size));
  if (c.rope.type == "llama3" || c.rope.type == "yarn")
    w.set_u32(key("rope.scaling.original_context_length"),
              u32(c.rope.original_max_position_embeddings));
  // Dynamic (NTK) rope is the default within max_position_embeddings; llama.cpp has no such type.
  if (c.rope.type == "linear" || c.rope.type == "yarn") {
    w.set_string(key("rope.scaling.type"), c.rope.type);
    w.set_f32(key("rope.scaling.factor"), static_cast<float>(c.rope.factor));
  }

  const std::string path = dir + "/tokenizer.json";
  const nlohmann::json j = hf_tokenizer_json(dir);
  const nlohmann::json& model = j.at("model");
  const std::string pre = llama_cpp_pre(j, path);
  // Token strings by id: the vocabulary, then added tokens; rows of the embedding beyond the
  // tokenizer are padding, as llama.cpp's converter names them.
  std::vector<std::string> tokens(static_cast<std::size_t>(c.vocab_size));
  std::vector<std::int32_t> types(tokens.size(), 5);  // unused
  std::vector<bool> set(tokens.size(), false);
  auto put = [&](std::int64_t id, const std::string& text, std::int32_t type) {
    if (id < 0 || id >= c.vocab_size)
      throw Error(path + ": token '" + text + "' has id " + std::to_string(id) +
                  ", beyond the model's " + std::to_string(c.vocab_size) + " embedding rows");
    tokens[static_cast<std::size_t>(id)] = text;
    types[static_cast<std::size_t>(id)] = type;
    set[static_cast<std::size_t>(id)] = true;
  };
  for (const auto& [text, id] : model.at("vocab").items())
    put(id.get<std::int64_t>(), text, 1);  // normal
  for (const nlohmann::json& a : j.value("added_tokens", nlohmann::json::array()))
    put(a.at("id").get<std::int64_t>(), a.at("content").get<std::string>(),
        a.value("special", false) ? 3 : 4);  // control, user defined
  for (std::size_t id = 0; id < tokens.size(); ++id)
    if (!set[id]) tokens[id] = "[PAD" + std::to_string(id) + "]";
  std::vector<std::string> merges;
  for (const nlohmann::json& m : model.value("merges", nlohmann::json::array()))
    merges.push_back(m.is_string() ? m.get<std::string>()
                                   : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  w.set_string("tokenizer.ggml.model", "gpt2");
  w.set_string("tokenizer.ggml.pre", pre);
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_i32s("tokenizer.ggml.token_type", types);
  w.set_strings("tokenizer.ggml.merges", merges);
  const Tokenizer tok = Tokenizer::from_file(path);
  if (tok.bos_id()) w.set_u32("tokenizer.ggml.bos_token_id", u32(*tok.bos_id()));
  // The tokenizer's own (tokenizer_config.json), as llama.cpp's converter reads it; config.json's
  // only when the tokenizer names none.
  if (tok.eos_id())
    w.set_u32("tokenizer.ggml.eos_token_id", u32(*tok.eos_id()));
  else if (!c.eos_token_ids.empty())
    w.set_u32("tokenizer.ggml.eos_token_id", u32(c.eos_token_ids.front()));
  const std::vector<std::int32_t> empty = tok.encode("", /*add_special_tokens=*/true);
  w.set_bool("tokenizer.ggml.add_bos_token",
             !empty.empty() && tok.bos_id() && empty.front() == *tok.bos_id());
  const std::string tmpl = hf_chat_template(dir);
  if (!tmpl.empty()) w.set_string("tokenizer.chat_template", tmpl);
}

}  // namespace

GgufExportType parse_gguf_export_type(const std::string& text) {
  for (GgufExportType t : {GgufExportType::kF32, GgufExportType::kF16, GgufExportType::kBF16,
                           GgufExportType::kQ8_0, GgufExportType::kQ4_K_M, GgufExportType::kBase})
    if (text == to_string(t)) return t;
  throw Error("unknown GGUF type '" + text + "' (one of: " + kGgufExportTypes + ")");
}

const char* to_string(GgufExportType type) {
  switch (type) {
    case GgufExportType::kF32:
      return "f32";
    case GgufExportType::kF16:
      return "f16";
    case GgufExportType::kBF16:
      return "bf16";
    case GgufExportType::kQ8_0:
      return "q8_0";
    case GgufExportType::kQ4_K_M:
      return "q4_k_m";
    case GgufExportType::kBase:
      return "base";
  }
  return "?";
}

void write_gguf_adapter(const std::string& path, const ModelConfig& config,
                        const std::vector<LayerSpec>& specs,
                        const std::map<std::string, at::Tensor>& tensors, const LoraConfig& lora) {
  const auto mapping = by_hf_name(config);
  GgufWriter w;
  w.set_string("general.architecture", export_architecture(config.family));
  w.set_string("general.type", "adapter");
  w.set_string("adapter.type", "lora");
  // llama.cpp scales by alpha / r, with r read from lora_b.
  w.set_f32("adapter.lora.alpha", static_cast<float>(lora.scaling() * lora.rank));
  std::vector<at::Tensor> data;
  for (const LayerSpec& spec : specs)
    for (const ParamSpec& p : spec.params) {
      if (!p.name.ends_with(kLoraA)) continue;
      const std::string stem = p.name.substr(0, p.name.size() - std::strlen(kLoraA));
      std::string base = stem + ".weight";
      if (base.starts_with(kPeftPrefix)) base = base.substr(std::strlen(kPeftPrefix));
      const auto m = mapping.find(base);
      if (base.find(".mlp.experts") != std::string::npos)
        throw Error(
            "export: a GGUF adapter of LoRA on experts is not supported yet (" + stem +
            "); export a PEFT adapter (--format adapter) or a merged model (--format merged)");
      if (m == mapping.end())
        throw Error("export: the adapter of " + base + " has no llama.cpp tensor to adapt");
      const at::Tensor a = tensors.at(p.name).to(at::kFloat).contiguous();
      const at::Tensor b =
          permute_for_gguf(tensors.at(stem + kLoraB).to(at::kFloat), m->second.unpermute_heads)
              .contiguous();
      w.add_tensor(m->second.gguf_name + ".lora_a", a.sizes().vec(), GgmlType::kF32);
      w.add_tensor(m->second.gguf_name + ".lora_b", b.sizes().vec(), GgmlType::kF32);
      data.push_back(a);
      data.push_back(b);
    }
  if (data.empty()) throw Error("export: the model has no LoRA adapters to export");
  w.write(path,
          [&](std::size_t i, const GgufSink& sink) { sink(data[i].data_ptr(), data[i].nbytes()); });
}

namespace {
void refuse_moe(const ModelConfig& c) {
  if (c.num_experts > 0)
    throw Error("a merged GGUF of a mixture-of-experts model (" + c.architecture +
                ") is not supported yet: export a merged Hugging Face folder (--format merged) or "
                "a PEFT adapter (--format adapter); for llama.cpp, a GGUF adapter of LoRA on the "
                "attention (--format gguf-adapter; Qwen3-MoE and Mixtral)");
}
}  // namespace

void check_gguf_mergeable(const std::string& base_path, GgufExportType type) {
  const bool gguf = model_format(base_path) == ModelFormat::kGguf;
  refuse_moe(gguf ? config_from_gguf(GgufFile(base_path))
                  : load_hf_config((std::filesystem::path(base_path) / "config.json").string()));
  if (gguf) return;  // its own metadata is copied
  if (type == GgufExportType::kBase)
    throw Error("--type base keeps a GGUF base's types; " + base_path +
                " is a Hugging Face folder: choose f32, f16, bf16, q8_0 or q4_k_m");
  llama_cpp_pre(hf_tokenizer_json(base_path), base_path + "/tokenizer.json");
}

void write_gguf_merged(
    const std::string& path, const ModelConfig& config, const std::vector<LayerSpec>& specs,
    const std::function<std::map<std::string, at::Tensor>(std::size_t)>& layer_tensors,
    const std::string& base_path, GgufExportType type,
    const std::function<void(std::size_t, std::size_t)>& progress) {
  refuse_moe(config);
  std::optional<GgufFile> base;
  if (model_format(base_path) == ModelFormat::kGguf) base.emplace(base_path);
  GgufWriter w;
  if (base) {
    for (const auto& [key, value] : base->metadata())
      if (key != "general.alignment" && !key.starts_with("split.")) w.copy(key, value);
  } else {
    check_gguf_mergeable(base_path, type);
    set_hf_metadata(w, base_path, config);
  }
  // `base` keeps the base's file type (its types, where Rondo can write them).
  if (type != GgufExportType::kBase) w.set_u32("general.file_type", file_type(type));
  w.set_u32("general.quantization_version", 2);

  // Where each tensor comes from: the base file as it is (rope_freqs.weight of a GGUF base), values
  // computed here (rope_freqs.weight of a Hugging Face Llama 3 base), or a layer's merged tensor by
  // HF name.
  struct Source {
    const GgufTensorInfo* raw = nullptr;
    std::vector<float> values;
    std::size_t layer = 0;
    const GgufTensorMapping* mapping = nullptr;
    GgmlType type = GgmlType::kF32;
  };
  const std::vector<GgufTensorMapping> mappings = gguf_names(config);
  std::unordered_map<std::string, const GgufTensorMapping*> by_name;
  std::unordered_map<std::string, bool> mapped_gguf;
  for (const GgufTensorMapping& m : mappings) {
    by_name[m.hf_name] = &m;
    mapped_gguf[m.gguf_name] = true;
  }
  std::vector<Source> sources;
  if (base) {
    for (const GgufTensorInfo& t : base->tensors())
      if (!mapped_gguf.count(t.name)) {
        w.add_tensor(t.name, t.shape(), t.type);
        sources.push_back({.raw = &t, .type = t.type});
      }
  } else if (config.rope.type == "llama3") {
    Source s;
    for (double f : llama3_rope_factors(config.rope, config.head_dim))
      s.values.push_back(static_cast<float>(f));
    w.add_tensor("rope_freqs.weight", {static_cast<std::int64_t>(s.values.size())}, GgmlType::kF32);
    sources.push_back(std::move(s));
  }
  const std::size_t extra = sources.size();
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (const ParamSpec& p : specs[l].params) {
      if (p.tied || is_lora_param(p.name)) continue;
      const auto it = by_name.find(p.name);
      if (it == by_name.end()) throw InternalError("GGUF export: no llama.cpp name for " + p.name);
      const GgmlType t = choose_type(type, *it->second, config, base ? &*base : nullptr);
      w.add_tensor(it->second->gguf_name, it->second->shape, t);
      sources.push_back({.layer = l, .mapping = it->second, .type = t});
    }
  if (sources.size() - extra != mappings.size() ||
      (base && w.tensor_count() != base->tensors().size()))
    throw Error("export: " + base_path + " does not match the run's model (" +
                std::to_string(w.tensor_count()) + " tensors to write)");

  std::map<std::string, at::Tensor> merged;
  std::size_t merged_layer = specs.size();
  w.write(path, [&](std::size_t i, const GgufSink& sink) {
    const Source& s = sources[i];
    if (s.raw != nullptr) {
      sink(base->tensor_data(*s.raw), s.raw->n_bytes);
    } else if (s.mapping == nullptr) {
      sink(s.values.data(), s.values.size() * sizeof(float));
    } else {
      if (merged_layer != s.layer) {
        merged_layer = s.layer;
        merged = merge_lora({specs[s.layer]}, layer_tensors(s.layer));
      }
      const at::Tensor t =
          permute_for_gguf(merged.at(s.mapping->hf_name), s.mapping->unpermute_heads);
      const std::vector<std::uint8_t> bytes = encode(t, s.type, s.mapping->gguf_name);
      sink(bytes.data(), bytes.size());
    }
    if (progress) progress(i + 1, sources.size());
  });
}

}  // namespace rondo::models
