#include "engine/export.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "engine/model_store.h"
#include "kernels/error.h"
#include "kernels/quant.h"
#include "models/export.h"

namespace rondo::engine {
namespace {

// Layer l's trained tensors (untied) as copies of their fp32 masters, read a chunk at a time
// wherever the store keeps them (Note [Optimizer chunks] in offload/layer_store.cpp): staging
// holds a chunk, not the layer's masters and moments.
void add_masters(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                 std::size_t l, std::map<std::string, at::Tensor>& out) {
  const std::vector<offload::TensorState>& ts = store.layer(l);
  std::vector<at::Tensor> flat(ts.size());
  for (std::size_t i = 0; i < ts.size(); ++i)
    if (ts[i].trainable && !ts[i].tied) {
      at::Tensor t = at::empty(specs[l].params[i].shape, at::TensorOptions().dtype(at::kFloat));
      flat[i] = t.view({-1});
      out[specs[l].params[i].name] = t;
    }
  const std::size_t chunks = store.optimizer_chunks(l);
  for (std::size_t k = 0; k < chunks; ++k) {
    if (k + 1 < chunks) store.prefetch_chunk(l, k + 1);
    const offload::LayerAccess c = store.access_chunk(l, k, offload::AccessMode::kRead);
    for (std::size_t i = 0; i < c.size(); ++i)
      flat[c.piece(i).tensor]
          .narrow(0, static_cast<std::int64_t>(c.piece(i).begin),
                  static_cast<std::int64_t>(c[i].numel))
          .copy_(at::from_blob(c[i].master, {static_cast<std::int64_t>(c[i].numel)}, at::kFloat));
  }
}

// The trained tensors of the store by name: copies of their fp32 masters, layer by layer.
std::map<std::string, at::Tensor> trained_tensors(offload::LayerStore& store,
                                                  const std::vector<models::LayerSpec>& specs) {
  std::map<std::string, at::Tensor> out;
  for (std::size_t l = 0; l < specs.size(); ++l)
    add_masters(store, specs, l, out);
  return out;
}

// Layer l's tensors: trained ones as their masters, frozen ones as streamed (dequantised); one
// layer of the store in memory at a time, wherever it lives. A frozen part on NVMe is read a
// weight piece at a time into the memory its tensors then view, not staged whole in the arena.
std::map<std::string, at::Tensor> layer_tensors(offload::LayerStore& store,
                                                const std::vector<models::LayerSpec>& specs,
                                                std::size_t l) {
  std::map<std::string, at::Tensor> out;
  add_masters(store, specs, l, out);
  if (store.tier(l, offload::kBasePart) == offload::Tier::kHost) {
    const offload::LayerAccess a = store.access(l, offload::kBasePart, offload::AccessMode::kRead);
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!a[i].tied && !a[i].trainable)
        out[specs[l].params[i].name] = stream_tensor(a, store, specs, l, i).clone();
    return out;
  }
  const std::size_t bytes = store.stream_bytes(l, offload::kBasePart).bytes;
  at::Tensor region = at::empty({static_cast<std::int64_t>(bytes)}, at::kByte);
  for (std::size_t k = 0; k < store.pieces(l, offload::kBasePart); ++k) {
    if (k + 1 < store.pieces(l, offload::kBasePart))
      store.prefetch_piece(l, offload::kBasePart, k + 1);
    const offload::HostBuffer piece = store.read_piece(l, offload::kBasePart, k);
    const std::size_t at = k * store.piece_bytes();
    std::memcpy(region.data_ptr<std::uint8_t>() + at, piece.data(),
                std::min(piece.bytes(), bytes - at));
  }
  const at::ScalarType sd = scalar_type(store.stream_dtype());
  for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
    const offload::TensorState& t = store.layer(l)[i];
    if (t.tied || t.trainable) continue;
    const models::ParamSpec& p = specs[l].params[i];
    std::uint8_t* data = region.data_ptr<std::uint8_t>() + t.stream_offset;
    if (t.quant.type == kernels::QuantType::kNone) {
      // A view that keeps the region alive: no second copy of the layer.
      out[p.name] = at::from_blob(
          data, p.shape, [region](void*) {}, at::TensorOptions().dtype(sd));
    } else {
      at::Tensor d = at::empty(p.shape, at::TensorOptions().dtype(sd));
      kernels::dequantize(t.quant, data, t.rows, t.cols, store.stream_dtype(), d.data_ptr());
      out[p.name] = d;
    }
  }
  return out;
}

void make_parent(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) throw Error("cannot create the folder " + parent.string() + ": " + ec.message());
}

}  // namespace

void export_peft_adapter(const std::string& dir, offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::LoraConfig& lora, const std::string& base_model) {
  models::write_peft_adapter(dir, specs, trained_tensors(store, specs), lora, base_model);
}

void export_merged(const std::string& dir, offload::LayerStore& store,
                   const std::vector<models::LayerSpec>& specs, const std::string& base_dir,
                   models::DType dtype) {
  models::write_merged(
      dir, specs, [&](std::size_t l) { return layer_tensors(store, specs, l); }, base_dir, dtype);
}

void export_gguf_adapter(const std::string& path, offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::ModelConfig& config, const models::LoraConfig& lora) {
  make_parent(path);
  models::write_gguf_adapter(path, config, specs, trained_tensors(store, specs), lora);
}

void export_gguf_merged(const std::string& path, offload::LayerStore& store,
                        const std::vector<models::LayerSpec>& specs,
                        const models::ModelConfig& config, const std::string& base_gguf,
                        models::GgufExportType type) {
  make_parent(path);
  models::write_gguf_merged(
      path, config, specs, [&](std::size_t l) { return layer_tensors(store, specs, l); }, base_gguf,
      type);
}

}  // namespace rondo::engine
