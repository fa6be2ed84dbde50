// The TOML run config: the input is a config file's text. Reading it either throws rondo::Error
// (not TOML: file:line:column) or gives a config whose problems are listed; a config without
// problems converts back to TOML that reads again to the same text.
#include <cstdint>
#include <string>

#include "cli/config_file.h"
#include "kernels/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const rondo::cli::ConfigFile f = rondo::cli::read_config_text(text, "fuzz.toml", {});
    try {
      f.check();
    } catch (const rondo::Error&) {
      return 0;
    }
    const std::string again = rondo::cli::to_toml(f.config);
    const rondo::cli::ConfigFile g = rondo::cli::read_config_text(again, "again.toml", {});
    if (rondo::cli::to_toml(g.config) != again) __builtin_trap();
  } catch (const rondo::Error&) {
  }
  return 0;
}
