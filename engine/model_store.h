// A model's tensors in the host store the engine trains: the bridge between a model's layer list
// and offload::LayerStore — which tensors are trainable, filling the streaming copies and master
// weights from a model's tensors, and torch views of the store for inspection (tests, checkpoints,
// export).
//
//   auto descs = engine::layer_descs(model.layers(),
//                                    [](const models::ParamSpec&) { return true; });
//   offload::LayerStore store(arena, descs, kernels::FloatDType::kF32, kernels::FloatDType::kF32);
//   engine::load_weights(store, model.layers(),
//                        [&](const std::string& name) { return model.tensor(name); });
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/simd.h"
#include "models/layers.h"
#include "models/weight_reader.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// One LayerDesc per layer, tensors in LayerSpec::params order; a tied parameter (the LM head that
// is the embedding) points at the earlier layer that owns it and is trainable when its owner is.
std::vector<offload::LayerDesc> layer_descs(
    const std::vector<models::LayerSpec>& specs,
    const std::function<bool(const models::ParamSpec&)>& trainable);

at::ScalarType scalar_type(kernels::FloatDType dtype);
// model.dtype's name ("fp32", "fp16", else bf16) as the store's streaming dtype.
kernels::FloatDType stream_dtype(const std::string& dtype);

// Where load_weights gets each tensor.
struct WeightSource {
  // The tensor by Hugging Face name: any float dtype, CPU.
  std::function<at::Tensor(const std::string&)> tensor;
  // Optional, for tensors the store keeps quantised: the blob already in the store's format
  // (GGUF blocks kept as stored), as a uint8 tensor; nullopt = quantise tensor(name) here.
  std::function<std::optional<at::Tensor>(const std::string&)> blocks;
  // Optional: called once a tensor has been copied into the store (the reader drops its pages).
  std::function<void(const std::string&)> done;
  // Optional: called as elements [first, first + count) of a tensor not kept quantised have been
  // copied into the store (the reader may drop their pages before the rest is read).
  std::function<void(const std::string&, std::int64_t, std::int64_t)> done_range;
  // Optional: called after each layer with (layers done, layers in all).
  std::function<void(std::size_t, std::size_t)> progress;
};

// Fills every owned tensor's streaming copy (rounded to the store's dtype, or quantised into the
// store's format for it) and, for trainable ones, its fp32 master — layer by layer, wherever the
// store keeps them (host or NVMe), so that memory holds one tensor of the source at a time.
// Moments and gradients stay zero. Throws Error naming a tensor whose shape differs from the
// spec, or a blob of the wrong size.
void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const WeightSource& source);
void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const std::function<at::Tensor(const std::string&)>& tensor);
// From a model file: each tensor read once (in the store's streaming dtype, or fp32 for an fp16
// one), GGUF blocks kept as stored where the store keeps that type, the file's pages dropped as
// soon as a tensor is in; `extra` (LoRA adapters) by name before the file.
void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const models::WeightReader& reader,
                  const std::map<std::string, at::Tensor>& extra = {},
                  const std::function<void(std::size_t, std::size_t)>& progress = {});

// kM, kV: f32 moments; kMCodes, kVCodes (uint8, shaped as the spec) and kMAbsmax, kVAbsmax (f32,
// one per block of 256 elements: (blocks)): 8-bit moments (offload::MomentFormat::kBlockwise8).
enum class StateView { kStream, kMaster, kGrad, kM, kV, kMCodes, kMAbsmax, kVCodes, kVAbsmax };

// One kind of optimizer state (kMaster and the moments) of a piece of a tensor, as
// LayerStore::access_chunk views it: its bytes, and their offset in the whole tensor's state of
// that kind (e.g. in a checkpoint entry). `begin`: the piece's first element in the tensor.
struct PieceState {
  std::uint8_t* data = nullptr;
  std::size_t bytes = 0, offset = 0;
};
PieceState piece_state(const offload::TensorState& view, std::size_t begin, StateView what);
// A CPU tensor viewing one tensor of the store (no copy), shaped as its spec. Throws Error when
// the tensor has no such state (a frozen tensor has no master, moments or gradient; 8-bit moments
// no f32 ones, f32 moments no codes), when the state lives on the NVMe tier (open the layer with
// LayerStore::access and use the overload below), and for a quantised streaming copy (use
// stream_tensor).
at::Tensor state_view(const offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                      std::size_t layer, std::size_t index, StateView what);
// The same through an open access of the layer (which must include the part viewed).
at::Tensor state_view(const offload::LayerAccess& access, const offload::LayerStore& store,
                      const std::vector<models::LayerSpec>& specs, std::size_t layer,
                      std::size_t index, StateView what);
// The streaming copy as a tensor of the streaming dtype: a view, or — for a tensor the store
// keeps quantised — its dequantisation into fresh memory (what a device computes with). A tied
// tensor must be read through its owner.
at::Tensor stream_tensor(const offload::LayerAccess& access, const offload::LayerStore& store,
                         const std::vector<models::LayerSpec>& specs, std::size_t layer,
                         std::size_t index);

}  // namespace rondo::engine
