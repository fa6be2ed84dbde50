#include "engine/checkpoint_format.h"

#include <charconv>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "kernels/checksum.h"
#include "kernels/error.h"
#include "models/mapped_file.h"

namespace rondo::engine {
namespace checkpoint_format {

// The checksum of "meta" as state.json records it: XXH3-64 of its compact JSON (nlohmann writes
// objects with sorted keys and numbers in their shortest round-trip form, so parsing and dumping
// again gives the same text).
std::string meta_checksum(const nlohmann::json& meta) {
  const std::string text = meta.dump();
  return kernels::hex64(kernels::xxh3(text.data(), text.size()));
}

// The step a folder named "step-N" holds; nullopt for any other name.
std::optional<std::int64_t> step_of_folder(const std::string& name) {
  if (!name.starts_with("step-")) return std::nullopt;
  const std::string digits = name.substr(5);
  std::int64_t step = -1;
  auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (err != std::errc() || end != digits.data() + digits.size() || step < 0 ||
      std::to_string(step) != digits)
    return std::nullopt;
  return step;
}

// state.json's text, at most kMaxStateBytes.
std::string read_state_text(const std::string& path) {
  return models::read_text_file(path, "a checkpoint's state.json, a few kilobytes", kMaxStateBytes);
}

std::vector<std::string> state_problems(const std::string& text, const std::string& folder_name,
                                        nlohmann::json& state) {
  try {
    state = nlohmann::json::parse(text);
  } catch (
      const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number too large
    state = nlohmann::json();
    return {std::string(kStateFile) + " is not valid JSON (" + e.what() +
            ") — the checkpoint is damaged"};
  }
  if (!state.is_object() || state.value("format", nlohmann::json()) != kFormat)
    return {std::string(kStateFile) +
            " is valid JSON but not a Rondo checkpoint's (no \"format\": \"" + kFormat + "\")"};
  const nlohmann::json version = state.value("version", nlohmann::json());
  if (!version.is_number_integer() || version.get<int>() < kOldestVersion ||
      version.get<int>() > kVersion)
    return {"checkpoint version " + version.dump() + ", this Rondo reads versions " +
            std::to_string(kOldestVersion) + " to " + std::to_string(kVersion) +
            " — resume with the Rondo that wrote it"};
  if (!state.contains("meta"))
    return {std::string(kStateFile) + " has no \"meta\" — the checkpoint is damaged"};

  std::vector<std::string> problems;
  const nlohmann::json& meta = state["meta"];
  if (version.get<int>() >= 2) {
    const nlohmann::json sum = state.value("meta_xxh3_64", nlohmann::json());
    if (!sum.is_string() || sum.get<std::string>() != meta_checksum(meta))
      problems.push_back(std::string(kStateFile) +
                         ": \"meta\" does not match its checksum (edited or damaged)");
  }
  // Cross-checks: the step against the folder's name, the optimizer's step against the step.
  const auto step = meta.is_object() ? meta.find("step") : meta.end();
  if (meta.is_object() && step != meta.end()) {
    if (!step->is_number_integer()) {
      problems.push_back(std::string(kStateFile) + ": \"step\" is not an integer");
    } else {
      const auto named = step_of_folder(folder_name);
      if (named && *named != step->get<std::int64_t>())
        problems.push_back(std::string(kStateFile) + " says step " + step->dump() +
                           " but the folder is " + folder_name);
      const auto opt = meta.find("optimizer_step");
      if (opt != meta.end() && (!opt->is_number_integer() || opt->get<std::int64_t>() < 0 ||
                                opt->get<std::int64_t>() > step->get<std::int64_t>()))
        problems.push_back(std::string(kStateFile) + ": optimizer step " + opt->dump() +
                           " is not within 0.." + step->dump() + " (the step)");
    }
  }
  return problems;
}

}  // namespace checkpoint_format

namespace {

namespace fs = std::filesystem;
using namespace checkpoint_format;

bool path_exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(p, ec));
}

// The final name without a trailing slash ("run/ckpt/step-40/" names the folder step-40).
fs::path folder_path(const std::string& dir) {
  if (dir.empty()) throw Error("checkpoint folder: empty path");
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  return p;
}

}  // namespace

std::vector<std::string> checkpoint_problems(const std::string& dir, bool* damaged) {
  bool own = true;  // what `damaged` reports
  const auto done = [&](std::vector<std::string> problems) {
    if (damaged) *damaged = own && !problems.empty();
    return problems;
  };
  const fs::path folder = folder_path(dir);
  const fs::path state_path = folder / kStateFile;
  const fs::path tensors_path = folder / kTensorsFile;

  if (!path_exists(folder)) {
    own = false;
    return done({"no such checkpoint folder"});
  }
  if (!path_exists(state_path))
    return done({std::string("not a Rondo checkpoint (no ") + kStateFile +
                 "; a folder without it is one whose writing did not finish)"});
  nlohmann::json state;
  std::string text;
  try {
    text = read_state_text(state_path.string());
  } catch (const Error& e) {
    std::error_code ec;  // too large: damaged; else unreadable now (an I/O error, no permission)
    own = fs::file_size(state_path, ec) > kMaxStateBytes && !ec;
    return done({e.what()});
  }
  std::vector<std::string> problems = state_problems(text, folder.filename().string(), state);
  // Nothing more to check in a state.json that is not ours or has no "meta".
  if (!state.is_object() || state.value("format", nlohmann::json()) != kFormat ||
      !state.contains("meta") || !state.contains("version") ||
      !state["version"].is_number_integer())
    return done(problems);
  const int version = state["version"].get<int>();
  if (version > kVersion) own = false;  // a newer Rondo's: sound, for all this one can tell
  if (version < kOldestVersion || version > kVersion) return done(problems);
  if (!path_exists(tensors_path)) {
    problems.push_back(std::string("no ") + kTensorsFile + " next to " + kStateFile +
                       " — the checkpoint is damaged");
    return done(problems);
  }
  if (version >= 2) {
    const nlohmann::json files = state.value("files", nlohmann::json());
    const nlohmann::json rec =
        files.is_object() ? files.value(kTensorsFile, nlohmann::json()) : nlohmann::json();
    if (!rec.is_object() || !rec.value("bytes", nlohmann::json()).is_number_unsigned() ||
        !rec.value("xxh3_64", nlohmann::json()).is_string()) {
      problems.push_back(std::string(kStateFile) + " does not record the size and checksum of " +
                         kTensorsFile + " — the checkpoint is damaged");
    } else {
      kernels::FileDigest d;
      try {
        d = kernels::file_xxh3(tensors_path.string());
      } catch (const Error& e) {  // unreadable (EIO, no permission, ...): fall back, keep it
        problems.push_back(e.what());
        own = false;
        return done(problems);
      }
      const auto bytes = rec["bytes"].get<std::uint64_t>();
      if (d.bytes != bytes)
        problems.push_back(std::string(kTensorsFile) + " holds " + std::to_string(d.bytes) +
                           " bytes, " + kStateFile + " records " + std::to_string(bytes) +
                           " (truncated or replaced)");
      else if (kernels::hex64(d.xxh3) != rec["xxh3_64"].get<std::string>())
        problems.push_back(std::string(kTensorsFile) + " does not match its checksum (XXH3-64 " +
                           kernels::hex64(d.xxh3) + ", recorded " +
                           rec["xxh3_64"].get<std::string>() + "): its bytes changed on disk");
    }
  }
  return done(problems);
}

}  // namespace rondo::engine
