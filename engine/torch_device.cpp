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

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>

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

namespace {

// Note [Torch's memory on a simulated device]
// A simulated device computes with torch on the CPU, so the activations, attention and head
// temporaries and gradients of its work are host allocations that its own allocate() never sees;
// on a card they are device memory under the cap (torch_cuda_allocator). So that the cap bounds
// them on a simulated device too — and the planner's device-memory model can be checked against
// what the work really held — torch's CPU allocator is wrapped: while a TorchStreamScope of a
// device with a MemoryAccount is alive on a thread, what torch allocates on that thread is
// reserved in that account (OutOfMemory past the cap) and released when it is freed, on any
// thread. Each block carries a header before its data: the account (or none) and its size, so
// that one raw deleter frees every block (torch's raw_allocate needs one). Installed when the
// first such scope opens; blocks allocated before keep their own deleter.
thread_local std::shared_ptr<kernels::MemoryAccount> t_account;

struct alignas(64) ChargedHeader {
  std::shared_ptr<kernels::MemoryAccount> account;
  std::size_t bytes = 0;
};
static_assert(sizeof(ChargedHeader) == 64);

void free_charged(void* data) {
  if (data == nullptr) return;
  auto* header = static_cast<ChargedHeader*>(data) - 1;
  if (header->account) header->account->release(header->bytes);
  header->~ChargedHeader();
  c10::free_cpu(header);
}

class ChargingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t n) override {
    const std::shared_ptr<kernels::MemoryAccount>& account = t_account;
    if (account && n > 0) account->reserve(n);
    void* raw = nullptr;
    try {
      raw = c10::alloc_cpu(n + sizeof(ChargedHeader));
    } catch (...) {
      if (account && n > 0) account->release(n);
      throw;
    }
    auto* header = new (raw) ChargedHeader{n > 0 ? account : nullptr, n};
    void* data = header + 1;
    return {data, data, &free_charged, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_charged; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

void install_charging_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static ChargingCpuAllocator allocator;
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  });
}

}  // namespace

struct TorchStreamScope::State {
#if RONDO_ENGINE_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard;
#endif
  std::shared_ptr<kernels::MemoryAccount> previous_account;
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
#endif
  if (auto account = stream.device().memory_account()) {
    install_charging_allocator();
    state_->previous_account = std::exchange(t_account, std::move(account));
  } else {
    state_->previous_account = t_account;
  }
}

TorchStreamScope::~TorchStreamScope() {
  t_account = std::move(state_->previous_account);
}

}  // namespace rondo::engine
