// The bridge between a model's layer list and the host state the engine trains
// (offload::LayerStore): which tensors are trainable, filling the streaming copies and master
// weights from a model's tensors, and torch views of the store for inspection (tests, checkpoints,
// export).
//
//   auto descs = engine::layer_descs(model.layers(), [](const models::ParamSpec&) { return true;
//   }); offload::LayerStore store(arena, descs, kernels::FloatDType::kF32,
//   kernels::FloatDType::kF32); engine::load_weights(store, model.layers(), [&](auto& name) {
//   return model.tensor(name); });
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "kernels/cpu/simd.h"
#include "models/layers.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// One LayerDesc per layer, tensors in LayerSpec::params order; a tied parameter (the LM head that
// is the embedding) points at the earlier layer that owns it and is trainable when its owner is.
std::vector<offload::LayerDesc> layer_descs(
    const std::vector<models::LayerSpec>& specs,
    const std::function<bool(const models::ParamSpec&)>& trainable);

at::ScalarType scalar_type(kernels::FloatDType dtype);

// Fills every owned tensor's streaming copy (rounded to the store's dtype) and, for trainable
// ones, its fp32 master, from `tensor(name)` (any dtype, CPU). Moments and gradients stay zero.
// Throws Error naming a tensor whose shape differs from the spec.
void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const std::function<at::Tensor(const std::string&)>& tensor);

enum class StateView { kStream, kMaster, kGrad, kM, kV };
// A CPU tensor viewing one tensor of the store (no copy), shaped as its spec. Throws Error when
// the tensor has no such state (a frozen tensor has no master, moments or gradient).
at::Tensor state_view(const offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                      std::size_t layer, std::size_t index, StateView what);

}  // namespace rondo::engine
