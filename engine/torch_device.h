// Running torch on a kernels::Device: the torch device a device's memory belongs to, and a scope
// that makes torch issue its kernels on one of our streams (CUDA) — on a SimDevice torch simply
// runs on the CPU, on the stream's own thread.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "kernels/cuda/cuda_device.h"
#include "kernels/device.h"

namespace rondo::engine {

c10::Device torch_device(const kernels::Device& device);

// What torch's own CUDA caching allocator holds on a GPU (activations, autograd buffers,
// attention temporaries: everything torch allocates, which the engine's pool does not see), with
// the peaks since the process started or the last reset. nullopt without CUDA in this build or
// on this machine. reset_torch_cuda_memory returns the allocator's cached blocks to the device and
// starts its peaks afresh.
struct TorchCudaMemory {
  std::uint64_t allocated = 0, reserved = 0;            // now
  std::uint64_t peak_allocated = 0, peak_reserved = 0;  // since the last reset
};
std::optional<TorchCudaMemory> torch_cuda_memory(int device_index);
void reset_torch_cuda_memory(int device_index);

// Torch's CUDA caching allocator as a CudaDevice's allocator (kernels::ExternalAllocator): the
// engine's buffers and torch's tensors then come from one cache, and the device's cap becomes
// torch's memory fraction, so one cap bounds every byte the process allocates on the GPU. When an
// allocation fails, torch's cached blocks are released and it is tried once more. nullptr in a
// build without CUDA.
std::shared_ptr<const kernels::ExternalAllocator> torch_cuda_allocator(int device_index);

// Torch's deterministic algorithms on or off, process-wide: on, every op that has a deterministic
// implementation uses it (index_add_ without atomics, attention backwards without races), cuDNN
// does not benchmark, and cuBLAS gets a fixed workspace (CUBLAS_WORKSPACE_CONFIG, unless already
// set; it must precede cuBLAS's first use in the process). An op without one throws (not torch's
// warn_only, under which the attention backwards stay non-deterministic). Returns whether they
// are on.
bool use_deterministic_torch(bool on);

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
