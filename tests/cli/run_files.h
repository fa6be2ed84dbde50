// Reading what a run wrote, for the CLI tests: a file's bytes, the event stream, each step's loss.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace rondo::test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The events of an events.jsonl, in order. A last line without its newline is one the run is
// writing while a test polls the file (a reader may see a write() in progress): it is left out.
inline std::vector<nlohmann::json> events(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  const std::string text = slurp(p);
  for (std::size_t b = 0, e; (e = text.find('\n', b)) != std::string::npos; b = e + 1)
    if (e > b) out.push_back(nlohmann::json::parse(text.substr(b, e - b)));
  return out;
}

// The loss of each step, the last event for a step winning (a resumed run repeats the steps
// after its checkpoint).
inline std::map<std::int64_t, double> step_losses(const std::filesystem::path& events_path) {
  std::map<std::int64_t, double> out;
  for (const nlohmann::json& e : events(events_path))
    if (e["type"] == "step") out[e["step"].get<std::int64_t>()] = e["loss"].get<double>();
  return out;
}

}  // namespace rondo::test
