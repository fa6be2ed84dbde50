#include "models/inspect.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include "kernels/error.h"
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
    out += (out.empty() ? "" : ", ") + d + " " + std::to_string(pct) + "%";
  }
  return out;
}

}  // namespace

ModelSummary inspect_model(const std::string& path, std::int64_t seq_len) {
  if (!fs::exists(path)) throw Error("model " + path + " does not exist");
  ModelSummary s;
  s.path = path;
  s.seq_len = seq_len;
  if (!fs::is_directory(path))
    throw Error(path +
                " is not a Hugging Face model folder (GGUF files are not supported by this "
                "build yet)");
  s.format = "safetensors";
  s.config = load_hf_config((fs::path(path) / "config.json").string());
  Checkpoint ckpt = Checkpoint::open_hf_folder(path);
  std::map<std::string, std::uint64_t> by_dtype;
  for (const LayerSpec& spec : layer_specs(s.config)) {
    LayerSummary l;
    l.kind = spec.kind;
    l.block = spec.block;
    l.params = spec.param_count();
    l.flops_forward_per_token = spec.flops_forward_per_token(seq_len);
    l.activation_bytes_per_token = spec.activation_bytes_per_token(2);
    for (const ParamSpec& p : spec.params) {
      if (p.tied) continue;
      const TensorEntry& e = ckpt.get(p.name);
      if (e.shape != p.shape)
        throw Error(e.file + ": tensor '" + p.name +
                    "' does not have the shape config.json implies");
      l.bytes_stored += e.bytes;
      by_dtype[to_string(e.dtype)] += e.bytes;
    }
    s.params += l.params;
    s.bytes_stored += l.bytes_stored;
    s.layers.push_back(l);
  }
  s.dtypes = dtype_mix(by_dtype);
  return s;
}

}  // namespace rondo::models
