// `rondo devices`: what a run would train on, in words or as JSON (--json, for the GUI); with
// --disk DIR, how fast that folder's drive reads and writes for the NVMe tier, and which I/O
// backend works there.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace rondo::cli {

struct DevicesOptions {
  bool json = false;
  int sim = 0;                      // --sim N
  std::string sim_memory = "24GB";  // --sim-memory
  double sim_link_gbps = 25;        // --sim-link, GB/s
  std::string memory_cap;           // --memory-cap, "" = whole device
  std::string disk;                 // --disk DIR: measure an offload folder's drive
  std::string disk_bytes = "1GiB";  // --disk-bytes: how much it writes and reads
};

void add_devices_options(CLI::App& command, DevicesOptions& options);
int run_devices(const DevicesOptions& options);

}  // namespace rondo::cli
