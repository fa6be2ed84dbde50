// SimDevice: a CPU-backed device for tests and for training without a GPU. Memory is host memory
// under a capacity; each stream is an ordered queue served by its own thread; copies to and from
// the host pay an emulated link (bandwidth + latency) by taking at least that long.
// Used by the engine exactly like a CudaDevice (docs/architecture.md §6).
//
//   auto dev = kernels::make_sim_device({.name = "sim0", .bytes_cap = 1 << 30,
//                                        .link = {.bytes_per_s = 1e9, .latency_s = 20e-6}});
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/device.h"

namespace rondo::kernels {

struct SimDeviceOptions {
  std::string name = "sim0";             // shown in errors and by `rondo devices`
  int index = 0;                         // ordinal among simulated devices
  std::uint64_t bytes_cap = 1ull << 30;  // bytes the device may hand out
  LinkSpec link;                         // emulated host link; {0, 0} = free, instant copies
  // Tests: the host copy (upload or download, counted from 0 in enqueue order) that fails on its
  // stream as a faulting CUDA copy would: the stream's later work is skipped, and its events and
  // synchronize() report the error. -1 = none.
  std::int64_t fail_copy = -1;
  // Keep freed buffers for reuse by an allocation of the same rounded size, as CUDA's caching
  // allocators do, instead of returning them to the C library. Host memory freed to glibc (and
  // anything above its 32 MiB mmap threshold always is) comes back as fresh pages that the
  // kernel must fault in and zero on the next touch: on a CPU run, where this device's memory
  // is the host's, that cost more than the compute it fed. Kept bytes do not count as in use;
  // they are returned when an allocation finds the host out of memory, and are bounded by the
  // most bytes ever in use at once. Off for tests that want every use after release to reach
  // the allocator (AddressSanitizer).
  bool cache_freed = false;
  // Count what torch allocates for the device's work against the cap (Device::memory_account),
  // as a card would. Off for the CPU device, whose "device memory" is the host's: the host
  // budget bounds it (the planner's share for the CPU device is an estimate, not a cap).
  bool count_compute = true;
};

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options);

}  // namespace rondo::kernels
