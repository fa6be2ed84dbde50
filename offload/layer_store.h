// The model's state at rest in host memory, layer by layer (ARCHITECTURE.md §2): for every tensor
// the streaming copy the devices upload, and for trainable tensors the fp32 master weights, the
// AdamW moments m and v, and a buffer for the gradient as the devices download it. Flat arenas
// with named views, so that uploads, checkpoints and (later) NVMe offload are byte ranges:
//  - one streaming region per layer (its tensors back to back, each 64-byte aligned): a stage's
//    weights upload as one copy per layer;
//  - one gradient region per layer, laid out like its trainable tensors;
//  - master, m and v per layer, each contiguous.
// A tied tensor (the LM head that is the embedding) is stored once, by its owner; the tying layer
// views the owner's streaming copy and master, but gets a gradient buffer of its own (each layer's
// job downloads its own gradient; the optimizer adds them).
//
//   offload::LayerStore store(arena, layers, kernels::FloatDType::kBF16,
//   kernels::FloatDType::kBF16); const offload::TensorState& q = store.tensor(3,
//   "model.layers.2.self_attn.q_proj.weight"); std::memcpy(q.stream, bf16_bits, q.numel * 2);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/simd.h"
#include "offload/host_arena.h"

namespace rondo::offload {

struct TensorDesc {
  std::string name;
  std::int64_t numel = 0;
  bool trainable = false;
  int tied_to_layer = -1;  // >= 0: the same tensor as `name` in that (earlier) layer
};

struct LayerDesc {
  std::vector<TensorDesc> tensors;
};

struct TensorState {
  std::string name;
  std::size_t numel = 0;
  bool trainable = false;
  bool tied = false;     // viewing another layer's streaming copy and master
  int owner_layer = -1;  // tied: the layer and index of the tensor it views
  int owner_index = -1;
  std::size_t stream_offset = 0;  // owned: offset of its streaming copy in the layer's region
  void* stream = nullptr;         // (numel) streaming dtype: what devices upload
  void* grad = nullptr;           // (numel) gradient dtype, trainable only: what devices download
  float* master = nullptr;        // (numel) f32, trainable only
  float* m = nullptr;             // (numel) f32 AdamW first moment, trainable only
  float* v = nullptr;             // (numel) f32 AdamW second moment, trainable only
};

struct ByteRange {
  std::uint8_t* data = nullptr;
  std::size_t bytes = 0;
};

class LayerStore {
 public:
  // Allocates everything from `arena` (weights, gradients, optimizer state), zero-filled. Throws
  // Error for inconsistent descriptions (a tie to a later layer or to a missing tensor, ...).
  LayerStore(HostArena& arena, const std::vector<LayerDesc>& layers,
             kernels::FloatDType stream_dtype, kernels::FloatDType grad_dtype);

  std::size_t layers() const { return layers_.size(); }
  const std::vector<TensorState>& layer(std::size_t i) const { return layers_.at(i); }
  // Throws Error naming the layer and tensor when absent.
  const TensorState& tensor(std::size_t layer, const std::string& name) const;

  // The layer's streaming copies (tied ones excluded: their owner uploads them) and gradients.
  ByteRange stream_bytes(std::size_t layer) const { return stream_ranges_.at(layer); }
  ByteRange grad_bytes(std::size_t layer) const { return grad_ranges_.at(layer); }

  kernels::FloatDType stream_dtype() const { return stream_dtype_; }
  kernels::FloatDType grad_dtype() const { return grad_dtype_; }

 private:
  kernels::FloatDType stream_dtype_, grad_dtype_;
  std::vector<std::vector<TensorState>> layers_;
  std::vector<ByteRange> stream_ranges_, grad_ranges_;
  HostBuffer weights_, gradients_, optimizer_;
};

}  // namespace rondo::offload
