#include "offload/layer_store.h"

#include <cstring>
#include <map>

#include "kernels/error.h"

namespace rondo::offload {
namespace {
constexpr std::size_t kAlign = 64;  // a cache line, and a whole AVX-512 vector
std::size_t align_up(std::size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}
}  // namespace

LayerStore::LayerStore(HostArena& arena, const std::vector<LayerDesc>& layers,
                       kernels::FloatDType stream_dtype, kernels::FloatDType grad_dtype)
    : stream_dtype_(stream_dtype), grad_dtype_(grad_dtype) {
  const std::size_t ss = kernels::dtype_size(stream_dtype), gs = kernels::dtype_size(grad_dtype);
  // First pass: offsets. Per layer: streaming copies (owned tensors), gradients (trainable,
  // tied included), and master/m/v (owned trainable tensors).
  struct Offsets {
    std::size_t stream = 0, grad = 0, opt = 0;
  };
  std::vector<std::vector<Offsets>> at(layers.size());
  std::size_t stream_total = 0, grad_total = 0, opt_elems = 0;
  std::vector<std::pair<std::size_t, std::size_t>> stream_span(layers.size()),
      grad_span(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    stream_span[l].first = stream_total;
    grad_span[l].first = grad_total;
    for (const TensorDesc& t : layers[l].tensors) {
      if (t.numel <= 0)
        throw Error("layer " + std::to_string(l) + ": tensor '" + t.name + "' has no elements");
      if (t.tied_to_layer >= static_cast<int>(l))
        throw Error("layer " + std::to_string(l) + ": tensor '" + t.name +
                    "' is tied to a layer that is not earlier (" + std::to_string(t.tied_to_layer) +
                    ")");
      Offsets o;
      const std::size_t n = static_cast<std::size_t>(t.numel);
      if (t.tied_to_layer < 0) {
        o.stream = stream_total;
        stream_total += align_up(n * ss);
        if (t.trainable) {
          o.opt = opt_elems;
          opt_elems += align_up(n * 4) / 4;
        }
      }
      if (t.trainable) {
        o.grad = grad_total;
        grad_total += align_up(n * gs);
      }
      at[l].push_back(o);
    }
    stream_span[l].second = stream_total;
    grad_span[l].second = grad_total;
  }
  weights_ = arena.allocate(stream_total, Purpose::kWeights);
  gradients_ = arena.allocate(grad_total, Purpose::kGradients);
  optimizer_ = arena.allocate(3 * opt_elems * sizeof(float), Purpose::kOptimizerState);

  // Second pass: views. Fresh mmap'd memory is already zero.
  auto* wbase = weights_.as<std::uint8_t>();
  auto* gbase = gradients_.as<std::uint8_t>();
  float* master = optimizer_.as<float>();
  float* m = master ? master + opt_elems : nullptr;
  float* v = master ? master + 2 * opt_elems : nullptr;
  layers_.resize(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    std::map<std::string, std::size_t> seen;
    for (std::size_t i = 0; i < layers[l].tensors.size(); ++i) {
      const TensorDesc& t = layers[l].tensors[i];
      if (!seen.emplace(t.name, i).second)
        throw Error("layer " + std::to_string(l) + ": tensor '" + t.name + "' appears twice");
      TensorState s;
      s.name = t.name;
      s.numel = static_cast<std::size_t>(t.numel);
      s.trainable = t.trainable;
      if (t.tied_to_layer >= 0) {
        const TensorState* owner = nullptr;
        for (std::size_t oi = 0; oi < layers_[t.tied_to_layer].size(); ++oi)
          if (layers_[t.tied_to_layer][oi].name == t.name) {
            owner = &layers_[t.tied_to_layer][oi];
            s.owner_layer = t.tied_to_layer;
            s.owner_index = static_cast<int>(oi);
          }
        if (owner == nullptr || owner->tied || owner->numel != s.numel ||
            owner->trainable != s.trainable)
          throw Error("layer " + std::to_string(l) + ": tensor '" + t.name + "' is tied to layer " +
                      std::to_string(t.tied_to_layer) +
                      ", which has no untied tensor of that name, size and trainability");
        s.tied = true;
        s.stream = owner->stream;
        s.master = owner->master;
        s.m = owner->m;
        s.v = owner->v;
      } else {
        s.stream = wbase + at[l][i].stream;
        s.stream_offset = at[l][i].stream - stream_span[l].first;
        if (t.trainable) {
          s.master = master + at[l][i].opt;
          s.m = m + at[l][i].opt;
          s.v = v + at[l][i].opt;
        }
      }
      if (t.trainable) s.grad = gbase + at[l][i].grad;
      layers_[l].push_back(s);
    }
    stream_ranges_.push_back({wbase ? wbase + stream_span[l].first : nullptr,
                              stream_span[l].second - stream_span[l].first});
    grad_ranges_.push_back(
        {gbase ? gbase + grad_span[l].first : nullptr, grad_span[l].second - grad_span[l].first});
  }
}

const TensorState& LayerStore::tensor(std::size_t layer, const std::string& name) const {
  if (layer >= layers_.size())
    throw Error("layer " + std::to_string(layer) + " does not exist (" +
                std::to_string(layers_.size()) + " layers)");
  for (const TensorState& t : layers_[layer])
    if (t.name == name) return t;
  throw Error("layer " + std::to_string(layer) + " has no tensor '" + name + "'");
}

}  // namespace rondo::offload
