#include "models/gguf_export.h"

#include <ATen/ATen.h>

#include <cmath>
#include <unordered_map>

#include "kernels/error.h"
#include "kernels/quant.h"
#include "models/dequant.h"
#include "models/gguf_model.h"
#include "models/gguf_writer.h"

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
                     const GgufFile& base) {
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
      const GgmlType t = base.tensor(m.gguf_name).type;
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

// HF name -> the mapping of the model's tensors.
std::unordered_map<std::string, GgufTensorMapping> by_hf_name(const ModelConfig& config) {
  std::unordered_map<std::string, GgufTensorMapping> out;
  for (GgufTensorMapping& m : gguf_names(config))
    out.emplace(m.hf_name, std::move(m));
  return out;
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
  w.set_string("general.architecture", gguf_architecture(config.family));
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

void write_gguf_merged(
    const std::string& path, const ModelConfig& config, const std::vector<LayerSpec>& specs,
    const std::function<std::map<std::string, at::Tensor>(std::size_t)>& layer_tensors,
    const GgufFile& base, GgufExportType type,
    const std::function<void(std::size_t, std::size_t)>& progress) {
  GgufWriter w;
  for (const auto& [key, value] : base.metadata())
    if (key != "general.alignment" && !key.starts_with("split.")) w.copy(key, value);
  // `base` keeps the base's file type (its types, where Rondo can write them).
  if (type != GgufExportType::kBase) w.set_u32("general.file_type", file_type(type));
  w.set_u32("general.quantization_version", 2);

  // Where each tensor comes from: the base file as it is (rope_freqs.weight), or a layer's merged
  // tensor by HF name.
  struct Source {
    const GgufTensorInfo* raw = nullptr;
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
  for (const GgufTensorInfo& t : base.tensors())
    if (!mapped_gguf.count(t.name)) {
      w.add_tensor(t.name, t.shape(), t.type);
      sources.push_back({.raw = &t, .type = t.type});
    }
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (const ParamSpec& p : specs[l].params) {
      if (p.tied || is_lora_param(p.name)) continue;
      const auto it = by_name.find(p.name);
      if (it == by_name.end()) throw InternalError("GGUF export: no llama.cpp name for " + p.name);
      const GgmlType t = choose_type(type, *it->second, config, base);
      w.add_tensor(it->second->gguf_name, it->second->shape, t);
      sources.push_back({.layer = l, .mapping = it->second, .type = t});
    }
  if (w.tensor_count() != base.tensors().size())
    throw Error("export: " + base.path() + " holds " + std::to_string(base.tensors().size()) +
                " tensors but the model has " + std::to_string(w.tensor_count()) +
                "; the base file does not match the run's model");

  std::map<std::string, at::Tensor> merged;
  std::size_t merged_layer = specs.size();
  w.write(path, [&](std::size_t i, const GgufSink& sink) {
    const Source& s = sources[i];
    if (s.raw != nullptr) {
      sink(base.tensor_data(*s.raw), s.raw->n_bytes);
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
