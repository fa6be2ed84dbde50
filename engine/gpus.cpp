#include "engine/gpus.h"

#include <algorithm>
#include <cctype>

namespace rondo::engine {

const std::vector<GpuSpec>& gpu_table() {
  constexpr std::uint64_t GB = 1000ull * 1000 * 1000, GiB = 1ull << 30;
  // Dense bf16 with fp32 accumulation, from NVIDIA's datasheets and architecture whitepapers
  // (the GeForce cards run fp32-accumulate at half their fp16-accumulate rate).
  static const std::vector<GpuSpec> table = {
      {"RTX 3090", 24 * GiB, 71.0, 4, 16, 8, 6},   {"RTX 4090", 24 * GiB, 165.2, 4, 16, 8, 9},
      {"RTX 5090", 32 * GiB, 209.5, 5, 16, 12, 0}, {"RTX A6000", 48 * GiB, 154.8, 4, 16, 8, 6},
      {"L40S", 48 * GiB, 362.1, 4, 16, 8, 9},      {"A100", 80 * GiB, 312.0, 4, 16, 8, 0},
      {"H100", 80 * GiB, 756.0, 5, 16, 9, 0},  // the PCIe card (the SXM one: 989)
      {"H200", 141 * GB, 989.4, 5, 16, 9, 0},
  };
  return table;
}

namespace {
std::string key(std::string s) {
  std::string out;
  for (char c : s)
    if (!std::isspace(static_cast<unsigned char>(c)))
      out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  for (const char* prefix : {"nvidia", "geforce"})
    if (out.rfind(prefix, 0) == 0) out.erase(0, std::string(prefix).size());
  return out;
}
}  // namespace

const GpuSpec* find_gpu(const std::string& name) {
  const std::string k = key(name);
  for (const GpuSpec& g : gpu_table())
    if (key(g.name) == k) return &g;
  // "A6000" for "RTX A6000", "4090" for "RTX 4090".
  for (const GpuSpec& g : gpu_table()) {
    const std::string gk = key(g.name);
    if (!k.empty() && gk.size() > k.size() && gk.compare(gk.size() - k.size(), k.size(), k) == 0)
      return &g;
  }
  return nullptr;
}

std::string gpu_names() {
  std::string out;
  for (const GpuSpec& g : gpu_table())
    out += (out.empty() ? "" : ", ") + std::string(g.name);
  return out;
}

double pcie_bytes_per_s(int gen, int width) {
  // Raw GB/s per lane after line coding: 8b/10b for gen 1-2, 128b/130b from gen 3.
  static const double per_lane[] = {0, 0.25e9, 0.5e9, 0.985e9, 1.969e9, 3.938e9, 7.877e9};
  if (gen < 1 || gen > 6 || width < 1) return 0;
  return per_lane[gen] * width * 0.8;
}

}  // namespace rondo::engine
