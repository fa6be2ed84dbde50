// `rondo devices`: what a run would train on, in words or as JSON (--json, for the GUI).
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
};

void add_devices_options(CLI::App& command, DevicesOptions& options);
int run_devices(const DevicesOptions& options);

}  // namespace rondo::cli
