#include "driver.h"

#include <cstdio>
#include <exception>
#include <map>
#include <string>

namespace rondo::oracle {
namespace {
struct Entry {
  const char* usage;
  Command command;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> commands;
  return commands;
}
}  // namespace

RegisterCommand::RegisterCommand(const char* name, const char* usage, Command command) {
  registry()[name] = {usage, command};
}

}  // namespace rondo::oracle

int main(int argc, char** argv) {
  auto& commands = rondo::oracle::registry();
  if (argc < 2 || commands.count(argv[1]) == 0) {
    std::fprintf(stderr, "usage: rondo_oracle_driver <command> ...\ncommands:\n");
    for (auto& [name, entry] : commands)
      std::fprintf(stderr, "  %s %s\n", name.c_str(), entry.usage);
    return 2;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    return commands[argv[1]].command(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
