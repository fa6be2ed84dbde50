#include "models/inspect.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include "kernels/error.h"
#include "models/dequant.h"
#include "models/gguf_model.h"
#include "models/model.h"
#include "models/mxfp4.h"
#include "models/safetensors.h"

namespace rondo::models {
namespace fs = std::filesystem;

namespace {

// "BF16" or "BF16 92%, F32 8%" (shares of stored bytes).
std::string dtype_mix(const std::map<std::string, std::uint64_t>& bytes_by_dtype) {
  std::uint64_t total = 0;
  for (auto& [d, b] : bytes_by_dtype)
    total += b;
  if (bytes_by_dtype.size() == 1) return bytes_by_dtype.begin()->first;
  std::vector<std::pair<std::uint64_t, std::string>> order;
  for (auto& [d, b] : bytes_by_dtype)
    order.push_back({b, d});
  std::sort(order.rbegin(), order.rend());
  std::string out;
  for (auto& [b, d] : order) {
    int pct = total ? static_cast<int>(100.0 * b / total + 0.5) : 0;
    out += (out.empty() ? "" : ", ") + d + " " + (pct == 0 ? "<1" : std::to_string(pct)) + "%";
  }
  return out;
}

// A folder with config.json but neither model.safetensors nor a sharded index: the weights are
// not downloaded yet.
bool has_weights(const std::string& dir) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".safetensors") || name == "model.safetensors.index.json") return true;
  }
  return ec.value() != 0;  // unreadable: let the checkpoint reader report it
}

}  // namespace

ModelSummary inspect_model(const std::string& path, std::int64_t seq_len) {
  ModelSummary s;
  s.path = path;
  s.seq_len = seq_len;
  std::map<std::string, std::uint64_t> by_dtype;
  // Stored bytes of each HF tensor name, from the headers only.
  std::map<std::string, std::pair<std::uint64_t, std::string>> stored;
  if (model_format(path) == ModelFormat::kHfFolder && !has_weights(path)) {
    s.format = "config only";
    s.config = load_hf_config((fs::path(path) / "config.json").string());
    for (const LayerSpec& spec : layer_specs(s.config))
      for (const ParamSpec& p : spec.params)
        stored[p.name] = {static_cast<std::uint64_t>(p.numel()) * dtype_size(s.config.dtype),
                          to_string(s.config.dtype)};
  } else if (model_format(path) == ModelFormat::kHfFolder) {
    s.format = "safetensors";
    s.config = load_hf_config((fs::path(path) / "config.json").string());
    Checkpoint ckpt = Checkpoint::open_hf_folder(path);
    const std::map<std::string, Mxfp4Weight> mxfp4 = mxfp4_weights(ckpt);
    for (const LayerSpec& spec : layer_specs(s.config))
      for (const ParamSpec& p : spec.params) {
        if (auto m = mxfp4.find(p.name); m != mxfp4.end()) {  // GPT-OSS's experts
          if (m->second.shape != p.shape)
            throw Error(m->second.blocks->file + ": MXFP4 tensor '" + p.name + "' has shape " +
                        shape_text(m->second.shape) + " but config.json implies " +
                        shape_text(p.shape));
          stored[p.name] = {m->second.bytes(), "MXFP4"};
          continue;
        }
        const TensorEntry& e = ckpt.get(p.name);
        if (e.shape != p.shape)
          throw Error(e.file + ": tensor '" + p.name + "' has shape " + shape_text(e.shape) +
                      " but config.json implies " + shape_text(p.shape));
        stored[p.name] = {e.bytes, to_string(e.dtype)};
      }
  } else {
    s.format = "gguf";
    GgufFile file(path);
    s.config = config_from_gguf(file);
    for (const GgufTensorMapping& m : gguf_tensor_mapping(file, s.config)) {
      const GgufTensorInfo& t = file.tensor(m.gguf_name);
      const std::uint64_t second = m.gguf_name2.empty() ? 0 : file.tensor(m.gguf_name2).n_bytes;
      stored[m.hf_name] = {t.n_bytes + second, ggml_type_info(t.type).name};
    }
  }
  for (const LayerSpec& spec : layer_specs(s.config)) {
    LayerSummary l;
    l.kind = spec.kind;
    l.block = spec.block;
    l.params = spec.param_count();
    l.flops_forward_per_token = spec.flops_forward_per_token(seq_len);
    l.activation_bytes_per_token = spec.activation_bytes_per_token(2);
    for (const ParamSpec& p : spec.params) {
      if (p.tied) continue;
      const auto& [bytes, dtype] = stored.at(p.name);
      l.bytes_stored += bytes;
      by_dtype[dtype] += bytes;
      s.stored_types[p.name] = dtype;
    }
    s.params += l.params;
    s.active_params += spec.active_param_count();
    s.bytes_stored += l.bytes_stored;
    s.layers.push_back(l);
  }
  s.dtypes = dtype_mix(by_dtype);
  return s;
}

}  // namespace rondo::models
