#include "engine/torch_device.h"

#include <ATen/Parallel.h>

#if RONDO_ENGINE_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <optional>

namespace rondo::engine {

c10::Device torch_device(const kernels::Device& device) {
  if (device.info().kind == kernels::DeviceKind::kCuda)
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.info().index));
  return c10::Device(c10::DeviceType::CPU);
}

struct TorchStreamScope::State {
#if RONDO_ENGINE_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard;
#endif
};

TorchStreamScope::TorchStreamScope(kernels::Stream& stream) : state_(std::make_unique<State>()) {
  // Threads that torch did not create start with OpenMP's default team size; this applies the
  // process-wide at::set_num_threads() to the calling thread.
  at::init_num_threads();
#if RONDO_ENGINE_CUDA
  if (stream.device().info().kind == kernels::DeviceKind::kCuda)
    state_->guard.emplace(c10::cuda::getStreamFromExternal(
        static_cast<cudaStream_t>(stream.native_handle()),
        static_cast<c10::DeviceIndex>(stream.device().info().index)));
#else
  (void)stream;
#endif
}

TorchStreamScope::~TorchStreamScope() = default;

}  // namespace rondo::engine
