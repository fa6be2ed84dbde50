// Byte sizes as users write them ("24GB"), and PCIe link figures read from sysfs.
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "kernels/error.h"
#include "kernels/pci.h"

namespace rondo {
namespace {

TEST(ParseBytes, BinaryUnitsWithOrWithoutB) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("1K"), 1024u);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull * 1024 * 1024);
  EXPECT_EQ(parse_bytes("24GB"), 24ull * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_bytes(" 24 gb "), 24ull * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_bytes("1.5G"), 3ull * 512 * 1024 * 1024);
  EXPECT_EQ(parse_bytes("2T"), 2ull << 40);
}

TEST(ParseBytes, RejectsWhatIsNotASizeAndNamesTheField) {
  for (const char* bad : {"", "GB", "24 XB", "24GBs", "-1", "1 2"}) {
    try {
      parse_bytes(bad, "device memory cap");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("device memory cap"), std::string::npos) << e.what();
    }
  }
}

TEST(FormatBytes, PicksTheUnit) {
  EXPECT_EQ(format_bytes(22), "22 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(24ull << 30), "24.00 GiB");
}

TEST(Pci, GenerationFromLinkSpeed) {
  EXPECT_EQ(kernels::pcie_gen_from_speed("2.5 GT/s PCIe"), 1);
  EXPECT_EQ(kernels::pcie_gen_from_speed("8.0 GT/s PCIe"), 3);
  EXPECT_EQ(kernels::pcie_gen_from_speed("16.0 GT/s PCIe"), 4);
  EXPECT_EQ(kernels::pcie_gen_from_speed("32.0 GT/s PCIe"), 5);
  EXPECT_EQ(kernels::pcie_gen_from_speed("Unknown"), 0);
}

TEST(Pci, ReadsTheLinkFromSysfs) {
  namespace fs = std::filesystem;
  fs::path root = fs::temp_directory_path() / ("rondo-sysfs-" + std::to_string(::getpid()));
  fs::path dev = root / "bus/pci/devices/0000:01:00.0";
  fs::create_directories(dev);
  std::ofstream(dev / "current_link_speed") << "8.0 GT/s PCIe\n";
  std::ofstream(dev / "max_link_speed") << "16.0 GT/s PCIe\n";
  std::ofstream(dev / "current_link_width") << "8\n";
  std::ofstream(dev / "max_link_width") << "16\n";
  kernels::PciLink link = kernels::read_pci_link("0000:01:00.0", root.string());
  EXPECT_EQ(link.gen, 3);
  EXPECT_EQ(link.gen_max, 4);
  EXPECT_EQ(link.width, 8);
  EXPECT_EQ(link.width_max, 16);
  kernels::PciLink none = kernels::read_pci_link("0000:02:00.0", root.string());
  EXPECT_EQ(none.gen, 0);
  EXPECT_EQ(none.width, 0);
  fs::remove_all(root);
}

}  // namespace
}  // namespace rondo
