#include "engine/export.h"

#include <ATen/ATen.h>

#include <map>

#include "engine/state.h"
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

}  // namespace

void export_peft_adapter(const std::string& dir, offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::LoraConfig& lora, const std::string& base_model) {
  models::write_peft_adapter(dir, specs, trained_tensors(store, specs), lora, base_model);
}

void export_merged(const std::string& dir, offload::LayerStore& store,
                   const std::vector<models::LayerSpec>& specs, const std::string& base_dir,
                   models::DType dtype) {
  // Layer by layer: one layer of the store in memory at a time, wherever it lives.
  models::write_merged(
      dir, specs,
      [&](std::size_t l) {
        std::map<std::string, at::Tensor> out;
        const offload::LayerAccess a = store.access(l, offload::kBasePart | offload::kOptimizerPart,
                                                    offload::AccessMode::kRead);
        for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
          if (a[i].tied) continue;
          out[specs[l].params[i].name] =
              a[i].trainable ? state_view(a, store, specs, l, i, StateView::kMaster).clone()
                             : stream_tensor(a, store, specs, l, i).clone();
        }
        return out;
      },
      base_dir, dtype);
}

}  // namespace rondo::engine
