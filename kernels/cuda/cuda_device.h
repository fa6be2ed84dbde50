// CudaDevice: a GPU through the CUDA runtime. Streams and events are CUDA's; device memory comes
// from a stream-ordered pool of the device's own, or from an allocator shared with the rest of
// the process (ExternalAllocator: torch's, so that one cap bounds every byte); a memory cap makes
// a large card behave like a small one ("24GB" on an 80 GB card). Compiled only when CUDA is on;
// probe_cuda() exists always and says why there is no device when there is none.
//
//   kernels::CudaProbe probe = kernels::probe_cuda();
//   if (!probe.devices.empty())
//     auto gpu = kernels::open_cuda_device({.index = 0, .bytes_cap = parse_bytes("24GB")});
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/device.h"

namespace rondo::kernels {

struct CudaProbe {
  bool compiled = false;            // was Rondo built with CUDA support?
  std::vector<DeviceInfo> devices;  // bytes_cap = bytes_total here
  std::string error;                // why `devices` is empty, or ""
  int driver_version = 0;           // 13020 = 13.2; 0 = no driver
  int runtime_version = 0;
};

// Never throws and never crashes without a driver or GPU.
CudaProbe probe_cuda();

// A stream-ordered caching allocator the device's buffers come from instead of its own pool.
// allocate(bytes, stream) returns device memory whose reuse is ordered in `stream` (a
// cudaStream_t), or nullptr when the device is full even after what the allocator caches was
// released; release(data) gives it back, reusable in the order of the stream it was allocated on;
// set_cap(bytes) bounds everything the allocator holds on the device (the device's cap: its own
// buffers and whatever else the allocator serves).
struct ExternalAllocator {
  std::function<void*(std::size_t bytes, void* stream)> allocate;
  std::function<void(void* data)> release;
  std::function<void(std::uint64_t bytes)> set_cap;
};

struct CudaDeviceOptions {
  int index = 0;                                       // CUDA ordinal
  std::uint64_t bytes_cap = 0;                         // 0 = the whole device
  std::shared_ptr<const ExternalAllocator> allocator;  // null = the device's own pool
};

// Throws Error when the device cannot be opened.
std::unique_ptr<Device> open_cuda_device(const CudaDeviceOptions& options);

}  // namespace rondo::kernels
