// A checkpoint's state.json (engine/checkpoint.h writes and reads checkpoints): its format, reading
// it within a size limit, the checksum of its "meta", the step a folder's name stands for, and the
// checks of its text. No torch and no store here, so that the state.json fuzz harness
// (fuzz/state_json_fuzz.cpp) builds from this file alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace rondo::engine::checkpoint_format {

inline constexpr const char* kFormat = "rondo-checkpoint";
// Version 2 records each file's size and XXH3-64 and a checksum of "meta" (version 1 had neither;
// it is still read: its structure is checked, its bytes cannot be).
inline constexpr int kVersion = 2;
inline constexpr int kOldestVersion = 1;
// state.json holds a few kilobytes; anything near this is not one Rondo wrote.
inline constexpr std::uint64_t kMaxStateBytes = 16ull << 20;
inline constexpr const char* kTensorsFile = "state.safetensors";
inline constexpr const char* kStateFile = "state.json";

// XXH3-64 of meta's compact JSON, as 16 hex digits (nlohmann writes objects with sorted keys and
// numbers in their shortest round-trip form, so parsing and dumping again gives the same text).
std::string meta_checksum(const nlohmann::json& meta);

// The step a folder named "step-N" holds; nullopt for any other name.
std::optional<std::int64_t> step_of_folder(const std::string& name);

// The file's text; Error naming it when it cannot be read or is larger than kMaxStateBytes.
std::string read_state_text(const std::string& path);

// The problems of a state.json's text found in a folder named `folder_name`: not JSON, not ours, a
// version this Rondo cannot read, no "meta", "meta" not matching its checksum, its step not the
// folder's, its optimizer step outside 0..step. Sets `state` to the parsed JSON when it parses.
std::vector<std::string> state_problems(const std::string& text, const std::string& folder_name,
                                        nlohmann::json& state);

}  // namespace rondo::engine::checkpoint_format

namespace rondo::engine {

// What is wrong with a checkpoint folder, found without a store and before any of it is used:
// state.json missing, too large, not JSON, not ours or of a version this Rondo cannot read; its
// "meta" not matching the recorded checksum; meta's "step" not the folder's step-N, its
// "optimizer_step" outside 0..step; state.safetensors missing, or its size or XXH3-64 not the ones
// recorded. Each problem is one sentence without the folder's name. Empty: the checkpoint is sound.
// (A version 1 checkpoint, written before checksums, is checked for all but its bytes.)
// `damaged` (if given) says whether the problems are the folder's own content (bytes, JSON,
// records that do not agree): false when it may be sound but cannot be read now (an I/O error,
// no permission) or was written by a newer Rondo.
std::vector<std::string> checkpoint_problems(const std::string& dir, bool* damaged = nullptr);

}  // namespace rondo::engine
