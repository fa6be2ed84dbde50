#include "engine/devices.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "engine/gpus.h"
#include "engine/torch_device.h"
#include "kernels/cpu/sim_device.h"
#include "kernels/cuda/cuda_device.h"

namespace rondo::engine {

const char* to_string(DeviceMode mode) {
  switch (mode) {
    case DeviceMode::kCuda:
      return "cuda";
    case DeviceMode::kSim:
      return "sim";
    case DeviceMode::kCpu:
      return "cpu";
    case DeviceMode::kPlanned:
      return "planned";
  }
  return "?";
}

std::pair<int, int> gpu_share(int gpus, int index, int count) {
  if (count < 1 || index < 0 || index >= count || gpus < 0) return {0, 0};
  const int base = gpus / count, extra = gpus % count;
  const int first = index * base + std::min(index, extra);
  return {first, first + base + (index < extra ? 1 : 0)};
}

std::vector<std::string> DeviceSelection::validate() const {
  std::vector<std::string> problems;
  if (sim_devices < 0 || sim_devices > 64)
    problems.push_back("sim_devices must be between 0 and 64 (got " + std::to_string(sim_devices) +
                       ")");
  if (sim_devices > 0 && sim_bytes == 0) problems.push_back("sim_bytes must be above 0");
  if (sim_link.bytes_per_s < 0) problems.push_back("sim link bandwidth must not be negative");
  if (sim_link.latency_s < 0) problems.push_back("sim link latency must not be negative");
  if (gpu_count < 1 || gpu_count > 64)
    problems.push_back("gpu_count must be between 1 and 64 (got " + std::to_string(gpu_count) +
                       ")");
  if (share_count < 1 || share_index < 0 || share_index >= share_count)
    problems.push_back("GPU share " + std::to_string(share_index) + " of " +
                       std::to_string(share_count) + " does not exist");
  if (memory_cap != 0 && memory_cap < (256ull << 20))
    problems.push_back("memory_cap of " + format_bytes(memory_cap) +
                       " is too small to hold a stage; use at least 256MiB, or 0 for the whole "
                       "device");
  return problems;
}

DevicePlan plan_devices(const DeviceSelection& selection) {
  auto problems = selection.validate();
  if (!problems.empty()) {
    std::string text = "invalid device selection:";
    for (auto& p : problems)
      text += "\n  - " + p;
    throw Error(text);
  }
  DevicePlan plan;
  plan.cpu_cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  plan.host_bytes = static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                    static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  kernels::CudaProbe probe = kernels::probe_cuda();
  plan.cuda_compiled = probe.compiled;
  plan.cuda_driver_version = probe.driver_version;
  plan.cuda_runtime_version = probe.runtime_version;
  if (!probe.error.empty() || probe.devices.empty()) plan.why_no_gpu = probe.error;

  if (!selection.gpu.empty()) {
    const GpuSpec* g = find_gpu(selection.gpu);
    if (g == nullptr)
      throw Error("hardware.gpu: '" + selection.gpu + "' is not in Rondo's table of cards (" +
                  gpu_names() + "); choose the nearest one");
    plan.mode = DeviceMode::kPlanned;
    for (int i = 0; i < selection.gpu_count; ++i) {
      kernels::DeviceInfo d;
      d.kind = kernels::DeviceKind::kCuda;
      d.index = i;
      d.name = g->name;
      d.bytes_total = g->memory_bytes;
      d.bytes_cap =
          selection.memory_cap ? std::min(selection.memory_cap, g->memory_bytes) : g->memory_bytes;
      d.compute_major = g->compute_major;
      d.compute_minor = g->compute_minor;
      d.pcie_gen = d.pcie_gen_max = g->pcie_gen;
      d.pcie_width = d.pcie_width_max = g->pcie_width;
      plan.devices.push_back(d);
    }
    plan.why_no_gpu = std::to_string(selection.gpu_count) + " x " + g->name + ", hardware.gpu";
  } else if (selection.sim_devices > 0) {
    plan.mode = DeviceMode::kSim;
    for (int i = 0; i < selection.sim_devices; ++i) {
      kernels::DeviceInfo d;
      d.kind = kernels::DeviceKind::kSim;
      d.index = i;
      d.name = "sim" + std::to_string(i);
      d.bytes_total = selection.sim_bytes;
      d.bytes_cap = selection.memory_cap ? std::min(selection.memory_cap, selection.sim_bytes)
                                         : selection.sim_bytes;
      d.link = selection.sim_link;
      plan.devices.push_back(d);
    }
    if (plan.why_no_gpu.empty()) plan.why_no_gpu = "simulated devices were requested";
  } else if (!probe.devices.empty()) {
    plan.mode = DeviceMode::kCuda;
    const int found = static_cast<int>(probe.devices.size());
    const auto [first, end] = gpu_share(found, selection.share_index, selection.share_count);
    if (first == end)
      throw Error(std::to_string(found) + " GPU" + (found == 1 ? "" : "s") + " for " +
                  std::to_string(selection.share_count) +
                  " ranks on this node: each rank needs one at least. Start fewer ranks a node "
                  "(torchrun --nproc-per-node), or give each its GPUs with CUDA_VISIBLE_DEVICES");
    for (int i = first; i < end; ++i) {
      kernels::DeviceInfo d = probe.devices[static_cast<std::size_t>(i)];
      if (selection.memory_cap) d.bytes_cap = std::min(selection.memory_cap, d.bytes_total);
      plan.devices.push_back(d);
    }
  } else {
    plan.mode = DeviceMode::kCpu;
    kernels::DeviceInfo d;
    d.kind = kernels::DeviceKind::kSim;
    d.name = "cpu";
    d.bytes_total = plan.host_bytes;
    d.bytes_cap = plan.host_bytes;
    plan.devices.push_back(d);  // no link: "device" memory is host memory
  }
  return plan;
}

std::vector<std::unique_ptr<kernels::Device>> open_devices(const DevicePlan& plan) {
  std::vector<std::unique_ptr<kernels::Device>> devices;
  if (plan.mode == DeviceMode::kPlanned)
    throw Error("hardware.gpu plans for cards this machine need not have (" + plan.why_no_gpu +
                "); `rondo plan` answers for them, `rondo train` runs on this machine's devices: "
                "remove hardware.gpu");
  for (const kernels::DeviceInfo& d : plan.devices) {
    if (plan.mode == DeviceMode::kCuda)
      // Torch's caching allocator serves the engine's buffers too: one cap for every byte.
      devices.push_back(kernels::open_cuda_device({.index = d.index,
                                                   .bytes_cap = d.bytes_cap,
                                                   .allocator = torch_cuda_allocator(d.index)}));
    else
      // The CPU "device" and simulated GPUs are host memory: keep their freed buffers for the
      // next step's (the same sizes) instead of faulting in fresh pages every step.
      devices.push_back(kernels::make_sim_device({.name = d.name,
                                                  .index = d.index,
                                                  .bytes_cap = d.bytes_cap,
                                                  .link = d.link,
                                                  .cache_freed = true,
                                                  .count_compute = plan.mode == DeviceMode::kSim}));
  }
  return devices;
}

}  // namespace rondo::engine
