#include "engine/torch_device.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#if RONDO_ENGINE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include "kernels/error.h"

namespace rondo::engine {

c10::Device torch_device(const kernels::Device& device) {
  if (device.info().kind == kernels::DeviceKind::kCuda)
    return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.info().index));
  return c10::Device(c10::DeviceType::CPU);
}

bool use_deterministic_torch(bool on) {
  // ":4096:8" is one of the two settings cuBLAS documents as deterministic.
  if (on) ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  // Not warn-only: torch's attention backwards (flash, memory-efficient) take their deterministic
  // path only then; warn-only runs them with atomics and merely says so. An op with no
  // deterministic implementation then throws (the engine's error names the setting to change).
  at::globalContext().setDeterministicAlgorithms(on, /*warn_only=*/false);
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

std::shared_ptr<const kernels::ExternalAllocator> torch_cuda_allocator(int device_index) {
#if RONDO_ENGINE_CUDA
  const auto index = static_cast<c10::DeviceIndex>(device_index);
  // Torch sets up its CUDA state, the caching allocator among it, on its first CUDA tensor; the
  // allocator's raw calls and memory fraction need it set up.
  (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(c10::DeviceType::CUDA, index));
  auto a = std::make_shared<kernels::ExternalAllocator>();
  a->allocate = [index](std::size_t bytes, void* stream) -> void* {
    c10::cuda::CUDAGuard guard(index);
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
            bytes, static_cast<cudaStream_t>(stream));
      } catch (const c10::OutOfMemoryError&) {
        // Torch already released what it caches for this device before giving up; release
        // every device's cache (blocks of other streams included) and try once more.
        c10::cuda::CUDACachingAllocator::emptyCache();
      }
    }
    return nullptr;
  };
  a->release = [](void* data) { c10::cuda::CUDACachingAllocator::raw_delete(data); };
  a->set_cap = [index](std::uint64_t bytes) {
    std::size_t free_bytes = 0, total = 0;
    c10::cuda::CUDAGuard guard(index);
    if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess || total == 0) {
      cudaGetLastError();
      throw Error("cuda:" + std::to_string(index) + ": cannot read the device's memory size");
    }
    c10::cuda::CUDACachingAllocator::setMemoryFraction(
        std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total)), index);
  };
  return a;
#else
  (void)device_index;
  return nullptr;
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
