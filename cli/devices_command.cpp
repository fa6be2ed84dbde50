#include "cli/devices_command.h"

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli/test_faults.h"
#include "engine/devices.h"
#include "engine/disk_speeds.h"
#include "offload/disk_speed.h"

namespace rondo::cli {

void add_devices_options(CLI::App& command, DevicesOptions& options) {
  command.add_flag("--json", options.json, "Print JSON (one object) instead of text");
  command.add_option("--sim", options.sim,
                     "Simulate N GPUs behind an emulated PCIe link instead of using CUDA ones");
  command.add_option("--sim-memory", options.sim_memory, "Memory of each simulated GPU")
      ->capture_default_str();
  command
      .add_option("--sim-link", options.sim_link_gbps,
                  "Bandwidth of each simulated GPU's link, GB/s per direction")
      ->capture_default_str();
  command.add_option("--memory-cap", options.memory_cap,
                     "Use at most this much of each GPU's memory, e.g. 24GB");
  command.add_option("--disk", options.disk,
                     "Also measure this folder's sequential O_DIRECT read and write speed "
                     "(hardware.offload_dir) and say which I/O backend works there");
  command.add_option("--disk-bytes", options.disk_bytes, "Bytes --disk writes and reads")
      ->capture_default_str();
}

namespace {

std::string version_text(int v) {
  return v ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : std::string("none");
}

std::string pcie_text(const kernels::DeviceInfo& d) {
  if (d.pcie_gen == 0 && d.pcie_gen_max == 0) return "PCIe link unknown";
  return fmt::format("PCIe gen {} x{} (max gen {} x{})", d.pcie_gen, d.pcie_width, d.pcie_gen_max,
                     d.pcie_width_max);
}

nlohmann::json to_json(const engine::DevicePlan& plan) {
  nlohmann::json out = {
      {"mode", engine::to_string(plan.mode)},
      {"cuda_compiled", plan.cuda_compiled},
      {"cuda_driver_version", plan.cuda_driver_version},
      {"cuda_runtime_version", plan.cuda_runtime_version},
      {"why_no_gpu", plan.why_no_gpu},
      {"cpu_cores", plan.cpu_cores},
      {"host_bytes", plan.host_bytes},
      {"devices", nlohmann::json::array()},
  };
  for (const kernels::DeviceInfo& d : plan.devices) {
    nlohmann::json j = {{"kind", kernels::to_string(d.kind)},
                        {"index", d.index},
                        {"name", d.name},
                        {"bytes_total", d.bytes_total},
                        {"bytes_cap", d.bytes_cap},
                        {"link_bytes_per_s", d.link.bytes_per_s},
                        {"link_latency_s", d.link.latency_s}};
    if (d.kind == kernels::DeviceKind::kCuda) {
      j["compute_capability"] = fmt::format("{}.{}", d.compute_major, d.compute_minor);
      j["multiprocessors"] = d.multiprocessors;
      j["pci_bus_id"] = d.pci_bus_id;
      j["pcie_gen"] = d.pcie_gen;
      j["pcie_width"] = d.pcie_width;
      j["pcie_gen_max"] = d.pcie_gen_max;
      j["pcie_width_max"] = d.pcie_width_max;
    }
    out["devices"].push_back(j);
  }
  return out;
}

void print_text(const engine::DevicePlan& plan) {
  switch (plan.mode) {
    case engine::DeviceMode::kCuda:
      fmt::print("{} CUDA GPU(s) (driver {}, runtime {}):\n", plan.devices.size(),
                 version_text(plan.cuda_driver_version), version_text(plan.cuda_runtime_version));
      for (const kernels::DeviceInfo& d : plan.devices)
        fmt::print("  cuda:{}  {}  {} (using up to {})  sm_{}{}  {} SMs  {}  bus {}\n", d.index,
                   d.name, format_bytes(d.bytes_total), format_bytes(d.bytes_cap), d.compute_major,
                   d.compute_minor, d.multiprocessors, pcie_text(d), d.pci_bus_id);
      break;
    case engine::DeviceMode::kSim:
      fmt::print(
          "{} simulated GPU(s), as requested with --sim (CPU-backed, for testing the "
          "multi-GPU schedule):\n",
          plan.devices.size());
      for (const kernels::DeviceInfo& d : plan.devices)
        fmt::print("  {}  {} (using up to {})  link {:.1f} GB/s per direction, {:.0f} us\n", d.name,
                   format_bytes(d.bytes_total), format_bytes(d.bytes_cap), d.link.bytes_per_s / 1e9,
                   d.link.latency_s * 1e6);
      break;
    case engine::DeviceMode::kPlanned:
      fmt::print("{}\n", plan.why_no_gpu);
      break;
    case engine::DeviceMode::kCpu:
      fmt::print("No CUDA GPU is present ({}).\n", plan.why_no_gpu);
      fmt::print(
          "Rondo will use the CPU instead: one device with {} cores and {} of host memory.\n"
          "Training works this way, at CPU speed. To try the multi-GPU schedule without GPUs,\n"
          "add --sim N to simulate N GPUs behind an emulated PCIe link.\n",
          plan.cpu_cores, format_bytes(plan.host_bytes));
      break;
  }
}

}  // namespace

int run_devices(const DevicesOptions& options) {
  engine::DeviceSelection selection;
  selection.sim_devices = options.sim;
  selection.sim_bytes = parse_bytes(options.sim_memory, "--sim-memory");
  selection.sim_link.bytes_per_s = options.sim_link_gbps * 1e9;
  if (!options.memory_cap.empty())
    selection.memory_cap = parse_bytes(options.memory_cap, "--memory-cap");
  engine::DevicePlan plan = engine::plan_devices(selection);
  nlohmann::json j = to_json(plan);
  if (!options.json) print_text(plan);
  if (!options.disk.empty()) {
    const std::uint64_t bytes = parse_bytes(options.disk_bytes, "--disk-bytes");
    const std::vector<offload::FaultRule> faults = test_faults_from_env().io;
    if (!options.json)
      fmt::print("Measuring {} (writing and reading {})...\n", options.disk, format_bytes(bytes));
    const offload::DiskSpeed d =
        offload::measure_disk(options.disk, bytes, offload::BackendKind::kAuto,
                              offload::kDiskRequestBytes, offload::kDiskQueueDepth, faults);
    // Plans with hardware.offload_dir on this drive use it from now on (engine/disk_speeds.h).
    const bool remembered =
        engine::remember_disk_speed(options.disk, d.read_bytes_per_s, d.write_bytes_per_s);
    j["disk"] = {{"dir", options.disk},
                 {"remembered", remembered},
                 {"read_bytes_per_s", d.read_bytes_per_s},
                 {"write_bytes_per_s", d.write_bytes_per_s},
                 {"backend", d.backend},
                 {"backend_note", d.backend_note},
                 {"direct", d.direct},
                 {"direct_note", d.direct_note},
                 {"bytes", d.bytes}};
    if (!options.json) {
      fmt::print(
          "Offload folder {}: read {:.2f} GB/s, write {:.2f} GB/s (sequential, {} of {} "
          "requests, {} in flight)\n",
          options.disk, d.read_bytes_per_s / 1e9, d.write_bytes_per_s / 1e9, format_bytes(d.bytes),
          format_bytes(d.request_bytes), d.queue_depth);
      fmt::print("  I/O backend: {}{}\n", d.backend,
                 d.backend_note.empty() ? "" : " (" + d.backend_note + ")");
      fmt::print("  O_DIRECT: {}\n", d.direct ? "yes" : "no (" + d.direct_note + ")");
      fmt::print("  For planning: hardware.disk_speed = \"{:.1f}GB\"{}\n", d.read_bytes_per_s / 1e9,
                 remembered ? " (remembered: plans with hardware.offload_dir on this drive use it)"
                            : "");
    }
  }
  if (options.json) fmt::print("{}\n", j.dump(2));
  return 0;
}

}  // namespace rondo::cli
