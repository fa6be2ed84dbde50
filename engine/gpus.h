// Common GPUs, for planning a run on a card that is not in this machine (`hardware.gpu`) and for
// the throughput the planner assumes of the cards it finds. Figures are the vendors' published
// ones: memory, dense bf16 tensor throughput with fp32 accumulation (no sparsity), and the PCIe
// link. The planner assumes half the dense peak is reached in training and 80% of the link's raw
// rate (pcie_bytes_per_s).
//
//   const engine::GpuSpec* g = engine::find_gpu("RTX 4090");   // case and spaces ignored
//   double link = engine::pcie_bytes_per_s(g->pcie_gen, g->pcie_width);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rondo::engine {

struct GpuSpec {
  const char* name;            // "RTX 4090"
  std::uint64_t memory_bytes;  // device memory
  double bf16_dense_tflops;    // tensor cores, fp32 accumulate, dense
  int pcie_gen, pcie_width;    // the card's host link
  int compute_major, compute_minor;
};

const std::vector<GpuSpec>& gpu_table();
// nullptr when unknown; matching ignores case, spaces and an "NVIDIA"/"GeForce" prefix, so
// "rtx4090" and "NVIDIA GeForce RTX 4090" both find the RTX 4090.
const GpuSpec* find_gpu(const std::string& name);
// "RTX 3090, RTX 4090, ..." for error messages.
std::string gpu_names();

// Usable bytes/s of one direction of a PCIe link: the raw rate per lane of the generation times
// the lanes, at 80% (protocol overhead and what copies reach in practice). 0 when unknown.
double pcie_bytes_per_s(int gen, int width);

}  // namespace rondo::engine
