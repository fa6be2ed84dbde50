#include "kernels/pci.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>

namespace rondo::kernels {

int pcie_gen_from_speed(const std::string& speed) {
  double gts = 0;
  try {
    gts = std::stod(speed);
  } catch (const std::exception&) {
    return 0;
  }
  // Transfer rate per lane for each generation.
  static constexpr double kRates[] = {2.5, 5.0, 8.0, 16.0, 32.0, 64.0, 128.0};
  for (int i = 0; i < 7; ++i)
    if (std::abs(gts - kRates[i]) < 0.01) return i + 1;
  return 0;
}

namespace {
std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (in) std::getline(in, line);
  return line;
}
int read_int(const std::string& path) {
  try {
    return std::stoi(read_line(path));
  } catch (const std::exception&) {
    return 0;
  }
}
}  // namespace

PciLink read_pci_link(const std::string& bus_id, const std::string& sysfs_root) {
  std::string id = bus_id;
  std::transform(id.begin(), id.end(), id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  std::string dir = sysfs_root + "/bus/pci/devices/" + id + "/";
  PciLink link;
  link.gen = pcie_gen_from_speed(read_line(dir + "current_link_speed"));
  link.gen_max = pcie_gen_from_speed(read_line(dir + "max_link_speed"));
  link.width = read_int(dir + "current_link_width");
  link.width_max = read_int(dir + "max_link_width");
  return link;
}

}  // namespace rondo::kernels
