// SimDevice: a CPU-backed device for tests and for training without a GPU. Memory is host memory
// under a capacity; each stream is an ordered queue served by its own thread; copies to and from
// the host pay an emulated link (bandwidth + latency) by taking at least that long.
// Used by the engine exactly like a CudaDevice (ARCHITECTURE.md §3).
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
};

std::unique_ptr<Device> make_sim_device(const SimDeviceOptions& options);

}  // namespace rondo::kernels
