// What the engine's rooms share for the engine's lifetime: the model, the store, the devices with
// their compute streams, the transfers and the options. Set up once by the Engine (engine.cpp) and
// read, not changed, by the pipeline, the optimizer driver and generation; what changes while a
// segment runs lives on the board (board.h), under its lock. Internal to engine/.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <memory>
#include <mutex>
#include <vector>

#include "engine/engine.h"
#include "kernels/device.h"
#include "models/config.h"
#include "models/layers.h"
#include "offload/host_arena.h"
#include "offload/layer_store.h"
#include "offload/transfer.h"

namespace rondo::engine {

// One device as the engine's threads see it.
struct DeviceContext {
  kernels::Device* dev = nullptr;
  int index = 0;
  kernels::Stream* compute = nullptr;  // the copy streams are offload::Transfers'
  c10::Device torch = c10::Device(c10::DeviceType::CPU);
  // Device time in compute (from timing events; for device events), under busy_mutex.
  std::mutex busy_mutex;
  double busy_s = 0, busy_reported_s = 0;
  // A timing event recorded on the compute stream at the start of the segment, when the event
  // sink's clock read clock_t: device times become span times on the sink's clock.
  std::unique_ptr<kernels::Event> clock;
  double clock_t = 0;
};

struct EngineParts {
  models::ModelConfig config;
  std::vector<models::LayerSpec> specs;
  offload::LayerStore& store;
  offload::HostArena& arena;
  EngineOptions options;
  at::ScalarType act_dtype;  // the streaming dtype: weights and activations on the devices
  std::vector<std::unique_ptr<DeviceContext>> devs;
  std::unique_ptr<offload::Transfers> transfers;

  std::size_t devices() const { return devs.size(); }
  // The CPU device works on the store's trained weights and gradients in place (exact mode).
  bool shares_trained() const { return options.share_trained_state && !options.one_step_stale; }
  // Layer l's weights among uploaded ones as device tensors on `dev`, in spec order.
  std::vector<at::Tensor> layer_weights(const offload::DeviceWeights& weights, int l,
                                        c10::Device dev) const;
};

// A tensor over device or host memory the engine owns (at::from_blob: no copy, no ownership).
at::Tensor tensor_view(void* data, const std::vector<std::int64_t>& sizes, at::ScalarType dtype,
                       c10::Device device);
// Bytes of a dense tensor of `sizes` in `dtype`.
std::size_t dense_bytes(const std::vector<std::int64_t>& sizes, at::ScalarType dtype);

}  // namespace rondo::engine
