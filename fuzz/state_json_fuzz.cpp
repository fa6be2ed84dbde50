// A checkpoint's state.json: the input is its text, checked as found in a folder named step-4.
// The checks list problems (never throw); text that passes has the format, a readable version and
// a meta whose checksum matches.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/checkpoint_format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace cs = rondo::engine::checkpoint_format;
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json state;
  const std::vector<std::string> problems = cs::state_problems(text, "step-4", state);
  if (problems.empty()) {
    if (!state.is_object() || state.value("format", nlohmann::json()) != cs::kFormat ||
        !state.contains("meta"))
      __builtin_trap();
    if (state.at("version") == cs::kVersion &&
        state.at("meta_xxh3_64") != cs::meta_checksum(state.at("meta")))
      __builtin_trap();
  }
  (void)cs::step_of_folder(text.substr(0, 64));
  return 0;
}
