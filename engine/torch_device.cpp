#include "engine/torch_device.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#if RONDO_ENGINE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <cstdlib>
#include <optional>

namespace rondo::engine {

c10::Device torch_device(const kernels::Device& device) {
  if (device.info().kind == kernels::DeviceKind::kCuda)
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.info().index));
  return c10::Device(c10::DeviceType::CPU);
}

bool use_deterministic_torch(bool on) {
  // ":4096:8" is one of the two settings cuBLAS documents as deterministic.
  if (on) ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::globalContext().setDeterministicAlgorithms(on, /*warn_only=*/true);
  at::globalContext().setDeterministicCuDNN(on);
  at::globalContext().setBenchmarkCuDNN(false);
  return at::globalContext().deterministicAlgorithms();
}

std::optional<TorchCudaMemory> torch_cuda_memory(int device_index) {
#if RONDO_ENGINE_CUDA
  if (!at::hasCUDA()) return std::nullopt;
  // Index 0 of each stat array is the aggregate over small and large pools (StatType::AGGREGATE).
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  return TorchCudaMemory{
      .allocated = static_cast<std::uint64_t>(stats.allocated_bytes[0].current),
      .reserved = static_cast<std::uint64_t>(stats.reserved_bytes[0].current),
      .peak_allocated = static_cast<std::uint64_t>(stats.allocated_bytes[0].peak),
      .peak_reserved = static_cast<std::uint64_t>(stats.reserved_bytes[0].peak)};
#else
  (void)device_index;
  return std::nullopt;
#endif
}

void reset_torch_cuda_memory(int device_index) {
#if RONDO_ENGINE_CUDA
  if (!at::hasCUDA()) return;
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
#else
  (void)device_index;
#endif
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
