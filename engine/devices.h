// Which devices a run uses: the CUDA GPUs when there are any (each under the memory cap), else the
// CPU as one device; simulated GPUs behind an emulated PCIe link on request (`--sim N`), for tests
// and for trying a multi-GPU schedule on a machine without GPUs. `rondo devices` prints this.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/device.h"

namespace rondo::engine {

struct DeviceSelection {
  int sim_devices = 0;                    // > 0: use this many simulated GPUs instead of CUDA ones
  std::uint64_t sim_bytes = 24ull << 30;  // memory of each simulated GPU (an RTX 4090's)
  kernels::LinkSpec sim_link{.bytes_per_s = 25e9, .latency_s = 10e-6};  // PCIe 4.0 x16, measured
  std::uint64_t memory_cap = 0;  // per-GPU cap in bytes (24GB makes an H100 act like a 4090);
                                 // 0 = whole device
  std::string gpu;  // plan for `gpu_count` of this card from engine/gpus.h instead (not opened)
  int gpu_count = 1;
  // Several ranks on one node (docs/distributed.md): this one takes its share of the CUDA GPUs
  // found, gpu_share(found, share_index, share_count); 1 = all of them.
  int share_index = 0, share_count = 1;
  std::vector<std::string> validate() const;  // every problem, for the CLI to print at once
};

enum class DeviceMode {
  kCuda,     // CUDA GPUs
  kSim,      // simulated GPUs (asked for)
  kCpu,      // no GPU: the CPU is the one device
  kPlanned,  // cards from the GPU table that this machine need not have: for planning only
};
const char* to_string(DeviceMode mode);

struct DevicePlan {
  DeviceMode mode = DeviceMode::kCpu;
  std::vector<kernels::DeviceInfo> devices;  // bytes_cap already lowered to the memory cap
  std::string why_no_gpu;                    // set when mode != kCuda: what CUDA said
  int cuda_driver_version = 0, cuda_runtime_version = 0;
  bool cuda_compiled = false;
  int cpu_cores = 0;
  std::uint64_t host_bytes = 0;  // physical host memory
};

// Of `gpus` GPUs, the ones share `index` of `count` takes: [first, end), as even as whole GPUs
// allow (the first shares take one more when they do not divide evenly); empty when there are
// fewer GPUs than shares.
std::pair<int, int> gpu_share(int gpus, int index, int count);

// Looks, opens nothing. Throws Error when the selection is invalid.
DevicePlan plan_devices(const DeviceSelection& selection);

// Opens the devices of a plan, in order. Throws Error for planned (DeviceMode::kPlanned) ones.
std::vector<std::unique_ptr<kernels::Device>> open_devices(const DevicePlan& plan);

}  // namespace rondo::engine
