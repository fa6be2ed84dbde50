#include "engine/export.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <map>

#include "engine/model_store.h"
#include "kernels/error.h"
#include "models/export.h"

namespace rondo::engine {
namespace {

// The trained tensors of the store by name: copies of their fp32 masters, read layer by layer
// wherever the store keeps them.
std::map<std::string, at::Tensor> trained_tensors(offload::LayerStore& store,
                                                  const std::vector<models::LayerSpec>& specs) {
  std::map<std::string, at::Tensor> out;
  for (std::size_t l = 0; l < specs.size(); ++l) {
    const offload::LayerAccess a =
        store.access(l, offload::kOptimizerPart, offload::AccessMode::kRead);
    for (std::size_t i = 0; i < specs[l].params.size(); ++i)
      if (!a[i].tied && a[i].trainable)
        out[specs[l].params[i].name] =
            state_view(a, store, specs, l, i, StateView::kMaster).clone();
  }
  return out;
}

// Layer l's tensors: trained ones as their masters, frozen ones as streamed; one layer of the
// store in memory at a time, wherever it lives.
std::map<std::string, at::Tensor> layer_tensors(offload::LayerStore& store,
                                                const std::vector<models::LayerSpec>& specs,
                                                std::size_t l) {
  std::map<std::string, at::Tensor> out;
  const offload::LayerAccess a =
      store.access(l, offload::kBasePart | offload::kOptimizerPart, offload::AccessMode::kRead);
  for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
    if (a[i].tied) continue;
    out[specs[l].params[i].name] =
        a[i].trainable ? state_view(a, store, specs, l, i, StateView::kMaster).clone()
                       : stream_tensor(a, store, specs, l, i).clone();
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
