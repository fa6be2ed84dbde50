// Running torch on a kernels::Device: the torch device a device's memory belongs to, and a scope
// that makes torch issue its kernels on one of our streams (CUDA) — on a SimDevice torch simply
// runs on the CPU, on the stream's own thread.
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "kernels/device.h"

namespace rondo::engine {

c10::Device torch_device(const kernels::Device& device);

// While alive (on the calling thread), torch's current stream for the device is `stream`, and
// torch uses at most the engine's CPU thread count. Construct inside Stream::enqueue work.
class TorchStreamScope {
 public:
  explicit TorchStreamScope(kernels::Stream& stream);
  ~TorchStreamScope();
  TorchStreamScope(const TorchStreamScope&) = delete;
  TorchStreamScope& operator=(const TorchStreamScope&) = delete;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace rondo::engine
