#include "engine/state.h"

#include <ATen/ATen.h>

#include "kernels/error.h"

namespace rondo::engine {

std::vector<offload::LayerDesc> layer_descs(
    const std::vector<models::LayerSpec>& specs,
    const std::function<bool(const models::ParamSpec&)>& trainable) {
  std::vector<offload::LayerDesc> out(specs.size());
  for (std::size_t l = 0; l < specs.size(); ++l)
    for (const models::ParamSpec& p : specs[l].params) {
      offload::TensorDesc t{.name = p.name, .numel = p.numel()};
      if (p.tied) {
        for (std::size_t o = 0; o < l && t.tied_to_layer < 0; ++o)
          for (const models::ParamSpec& q : specs[o].params)
            if (q.name == p.name && !q.tied) {
              t.tied_to_layer = static_cast<int>(o);
              t.trainable = trainable(q);
            }
        if (t.tied_to_layer < 0)
          throw InternalError("tied parameter " + p.name + " has no owner in an earlier layer");
      } else {
        t.trainable = trainable(p);
      }
      out[l].tensors.push_back(std::move(t));
    }
  return out;
}

at::ScalarType scalar_type(kernels::FloatDType dtype) {
  switch (dtype) {
    case kernels::FloatDType::kF32:
      return at::kFloat;
    case kernels::FloatDType::kBF16:
      return at::kBFloat16;
    case kernels::FloatDType::kF16:
      return at::kHalf;
  }
  throw InternalError("unknown FloatDType");
}

namespace {
const models::ParamSpec& spec_of(const std::vector<models::LayerSpec>& specs,
                                 const offload::LayerStore& store, std::size_t layer,
                                 std::size_t index) {
  RONDO_ASSERT_MSG(layer < specs.size() && specs.size() == store.layers() &&
                       index < specs[layer].params.size() &&
                       specs[layer].params.size() == store.layer(layer).size(),
                   "the layer specs do not describe this store");
  return specs[layer].params[index];
}
}  // namespace

void load_weights(offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                  const std::function<at::Tensor(const std::string&)>& tensor) {
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (std::size_t i = 0; i < store.layer(l).size(); ++i) {
      const offload::TensorState& t = store.layer(l)[i];
      if (t.tied) continue;
      const models::ParamSpec& p = spec_of(specs, store, l, i);
      at::Tensor src = tensor(p.name);
      if (src.sizes() != at::IntArrayRef(p.shape))
        throw Error("tensor " + p.name + " has shape " + models::shape_text(src.sizes().vec()) +
                    ", the model needs " + models::shape_text(p.shape));
      src = src.to(at::kCPU).contiguous();
      state_view(store, specs, l, i, StateView::kStream).copy_(src);
      if (t.trainable) state_view(store, specs, l, i, StateView::kMaster).copy_(src);
    }
}

at::Tensor state_view(const offload::LayerStore& store, const std::vector<models::LayerSpec>& specs,
                      std::size_t layer, std::size_t index, StateView what) {
  const models::ParamSpec& p = spec_of(specs, store, layer, index);
  const offload::TensorState& t = store.layer(layer)[index];
  auto f32 = [&](float* data) {
    if (data == nullptr)
      throw Error("tensor " + p.name + " of layer " + std::to_string(layer) +
                  " is frozen: it has no master weights, moments or gradient");
    return at::from_blob(data, p.shape, at::kFloat);
  };
  switch (what) {
    case StateView::kStream:
      return at::from_blob(t.stream, p.shape, scalar_type(store.stream_dtype()));
    case StateView::kGrad:
      if (t.grad == nullptr) return f32(nullptr);
      return at::from_blob(t.grad, p.shape, scalar_type(store.grad_dtype()));
    case StateView::kMaster:
      return f32(t.master);
    case StateView::kM:
      return f32(t.m);
    case StateView::kV:
      return f32(t.v);
  }
  throw InternalError("unknown StateView");
}

}  // namespace rondo::engine
