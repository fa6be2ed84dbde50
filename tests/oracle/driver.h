// rondo_oracle_driver: Rondo's side of the oracle tests. Each driver_*.cpp registers subcommands
// that read inputs from files and write outputs to files, which pytest compares with the
// independent references. A failure prints "error: ..." and exits 1 (tests of malformed input
// check that message).
#pragma once

#include <string>
#include <vector>

namespace rondo::oracle {

using Command = int (*)(const std::vector<std::string>& args);

struct RegisterCommand {
  RegisterCommand(const char* name, const char* usage, Command command);
};

}  // namespace rondo::oracle
