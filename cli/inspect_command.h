// `rondo inspect <model>`: family, dimensions, parameter count, stored dtype, bytes per layer.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace rondo::cli {

struct InspectOptions {
  std::string model;
  bool json = false;
  long long seq_len = 4096;
};

void add_inspect_options(CLI::App& command, InspectOptions& options);
int run_inspect(const InspectOptions& options);

}  // namespace rondo::cli
