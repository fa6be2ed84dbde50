#include "engine/export.h"

#include <ATen/ATen.h>

#include <map>

#include "engine/state.h"
#include "models/export.h"

namespace rondo::engine {
namespace {

// Every owned tensor of the store by name: the master when it trains, else the streaming copy.
std::map<std::string, at::Tensor> trained_tensors(const offload::LayerStore& store,
                                                  const std::vector<models::LayerSpec>& specs) {
  std::map<std::string, at::Tensor> out;
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
      const offload::TensorState& t = store.layer(l)[i];
      if (t.tied) continue;
      out[specs[l].params[i].name] =
          state_view(store, specs, l, i, t.trainable ? StateView::kMaster : StateView::kStream);
    }
  return out;
}

}  // namespace

void export_peft_adapter(const std::string& dir, const offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs,
                         const models::LoraConfig& lora, const std::string& base_model) {
  models::write_peft_adapter(dir, specs, trained_tensors(store, specs), lora, base_model);
}

void export_merged(const std::string& dir, const offload::LayerStore& store,
                   const std::vector<models::LayerSpec>& specs, const std::string& base_dir,
                   models::DType dtype) {
  models::write_merged(dir, specs, trained_tensors(store, specs), base_dir, dtype);
}

}  // namespace rondo::engine
