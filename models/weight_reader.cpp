#include "models/weight_reader.h"

#include <ATen/ATen.h>

#include <map>

#include "kernels/error.h"
#include "models/gguf.h"
#include "models/gguf_model.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/mxfp4.h"
#include "models/safetensors.h"
#include "models/tensor_view.h"

namespace rondo::models {

struct WeightReader::Impl {
  std::string path;
  ModelConfig config;
  std::vector<LayerSpec> layers;
  // One of the two:
  std::unique_ptr<Checkpoint> hf;
  std::unique_ptr<GgufFile> gguf;
  std::map<std::string, GgufTensorMapping> mapping;  // GGUF: by HF name
  std::map<std::string, Mxfp4Weight> mxfp4;          // HF: MXFP4 weights by their name
};

WeightReader::WeightReader(const std::string& path) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  if (model_format(path) == ModelFormat::kHfFolder) {
    m.config = load_hf_config(path + "/config.json");
    m.hf = std::make_unique<Checkpoint>(Checkpoint::open_hf_folder(path));
    m.layers = layer_specs(m.config);
    std::map<std::string, std::vector<std::int64_t>> shapes;
    for (const std::string& name : m.hf->names())
      shapes.emplace(name, m.hf->get(name).shape);
    m.mxfp4 = mxfp4_weights(*m.hf);
    for (const auto& [name, w] : m.mxfp4) {
      shapes.erase(name + "_blocks");
      shapes.erase(name + "_scales");
      shapes[name] = w.shape;
    }
    check_weights_match(m.config, m.layers, shapes, path);
  } else {
    m.gguf = std::make_unique<GgufFile>(path);
    m.config = config_from_gguf(*m.gguf);
    m.layers = layer_specs(m.config);
    // gguf_tensor_mapping checks the set of tensors and their shapes.
    for (GgufTensorMapping& t : gguf_tensor_mapping(*m.gguf, m.config))
      m.mapping.emplace(t.hf_name, std::move(t));
  }
}

WeightReader::~WeightReader() = default;
WeightReader::WeightReader(WeightReader&&) noexcept = default;
WeightReader& WeightReader::operator=(WeightReader&&) noexcept = default;

const std::string& WeightReader::path() const {
  return impl_->path;
}
bool WeightReader::is_gguf() const {
  return impl_->gguf != nullptr;
}
const ModelConfig& WeightReader::config() const {
  return impl_->config;
}
const std::vector<LayerSpec>& WeightReader::layers() const {
  return impl_->layers;
}

at::Tensor WeightReader::read(const std::string& name, DType dtype) const {
  const Impl& m = *impl_;
  if (m.gguf) {
    auto it = m.mapping.find(name);
    if (it == m.mapping.end()) throw Error(m.path + ": no tensor '" + name + "'");
    return load_hf_tensor(*m.gguf, it->second, dtype);
  }
  if (auto it = m.mxfp4.find(name); it != m.mxfp4.end())
    return dequantize_mxfp4(it->second, to_scalar_type(dtype));
  const TensorEntry& e = m.hf->get(name);
  at::Tensor t = e.view();
  if (dtype != e.dtype) t = t.to(to_scalar_type(dtype));
  return t.contiguous();
}

std::optional<std::pair<kernels::QuantFormat, at::Tensor>> WeightReader::read_mxfp4(
    const std::string& name) const {
  auto it = impl_->mxfp4.find(name);
  if (it == impl_->mxfp4.end()) return std::nullopt;
  return std::make_pair(it->second.format(), mxfp4_blob(it->second));
}

std::optional<GgufBlocks> WeightReader::read_blocks(const std::string& name) const {
  const Impl& m = *impl_;
  if (!m.gguf) return std::nullopt;
  auto it = m.mapping.find(name);
  if (it == m.mapping.end()) throw Error(m.path + ": no tensor '" + name + "'");
  const GgufTensorMapping& map = it->second;
  if (!map.gguf_shape.empty()) return std::nullopt;  // made from other tensors: dequantised
  const GgufTensorInfo& info = m.gguf->tensor(map.gguf_name);
  const GgmlTypeInfo& type = ggml_type_info(info.type);
  if (type.block_size == 1 || map.shape.size() != 2) return std::nullopt;
  GgufBlocks b;
  b.type = info.type;
  b.rows = map.shape[0];
  b.cols = map.shape[1];
  const std::int64_t row_bytes = b.cols / type.block_size * type.type_size;
  // One expert of an expert-major (E, rows, cols) tensor: its rows are one contiguous slice.
  const std::int64_t slices = map.expert >= 0 ? static_cast<std::int64_t>(info.shape()[0]) : 1;
  RONDO_ASSERT(static_cast<std::uint64_t>(slices * b.rows * row_bytes) == info.n_bytes);
  const std::uint8_t* data =
      m.gguf->tensor_data(info) + std::max<std::int64_t>(map.expert, 0) * b.rows * row_bytes;
  b.bytes = at::from_blob(const_cast<std::uint8_t*>(data), {b.rows, row_bytes},
                          at::TensorOptions().dtype(at::kByte));
  if (map.unpermute_heads > 0) {
    // The same row move as load_hf_tensor's (Note [llama.cpp rotary permutation]), on rows of
    // blocks.
    const std::int64_t heads = map.unpermute_heads;
    RONDO_ASSERT(b.rows % (2 * heads) == 0);
    b.bytes = b.bytes.reshape({heads, b.rows / heads / 2, 2, row_bytes})
                  .transpose(1, 2)
                  .reshape({b.rows, row_bytes});
  }
  b.bytes = b.bytes.contiguous();
  return b;
}

void WeightReader::release(const std::string& name) const {
  const Impl& m = *impl_;
  if (m.gguf) {
    auto it = m.mapping.find(name);
    if (it == m.mapping.end()) return;
    const GgufTensorInfo& info = m.gguf->tensor(it->second.gguf_name);
    if (!it->second.gguf_name2.empty()) {
      const GgufTensorInfo& second = m.gguf->tensor(it->second.gguf_name2);
      release_mapped_pages(m.gguf->tensor_data(second), second.n_bytes);
    }
    if (it->second.expert >= 0) {  // that expert's slice only
      const std::uint64_t slice = info.n_bytes / static_cast<std::uint64_t>(info.shape()[0]);
      release_mapped_pages(
          m.gguf->tensor_data(info) + static_cast<std::uint64_t>(it->second.expert) * slice, slice);
      return;
    }
    release_mapped_pages(m.gguf->tensor_data(info), info.n_bytes);
  } else if (auto it = m.mxfp4.find(name); it != m.mxfp4.end()) {
    for (const TensorEntry* e : {it->second.blocks, it->second.scales})
      release_mapped_pages(e->data, e->bytes);
  } else if (const TensorEntry* e = m.hf->find(name)) {
    release_mapped_pages(e->data, e->bytes);
  }
}

void WeightReader::release_range(const std::string& name, std::int64_t first,
                                 std::int64_t count) const {
  const Impl& m = *impl_;
  if (m.gguf || m.mxfp4.count(name)) return;
  const TensorEntry* e = m.hf->find(name);
  if (e == nullptr || e->numel() == 0 || first < 0 || count <= 0 || first + count > e->numel())
    return;
  const std::uint64_t element = e->bytes / static_cast<std::uint64_t>(e->numel());
  release_mapped_pages(e->data + static_cast<std::uint64_t>(first) * element,
                       static_cast<std::uint64_t>(count) * element);
}

}  // namespace rondo::models
