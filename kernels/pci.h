// What the operating system says about a PCI device's link: generation and width, read from sysfs
// (the CUDA runtime does not tell). Used to describe CUDA devices; 0 means unknown.
#pragma once

#include <string>

namespace rondo::kernels {

struct PciLink {
  int gen = 0, width = 0;          // current (drops when the GPU idles)
  int gen_max = 0, width_max = 0;  // what the slot and card can do
};

// "16.0 GT/s PCIe" -> 4; "8 GT/s" -> 3; unknown text -> 0.
int pcie_gen_from_speed(const std::string& speed);
// bus_id as "0000:01:00.0" (any case). Missing files give zeros.
PciLink read_pci_link(const std::string& bus_id, const std::string& sysfs_root = "/sys");

}  // namespace rondo::kernels
