// Training checkpoints: the trainable host state of a run (fp32 masters, AdamW moments, and the
// streaming copies where they lag the masters) plus the caller's JSON (step, RNG, data position,
// scheduler, loss scale), so that a resume is bit-identical. A checkpoint is a folder
// run/checkpoints/step-N holding state.safetensors and state.json; state.json is written last, so
// a folder without it is never a checkpoint, and the folder appears under its final name only
// once complete (written as "<dir>.tmp", fsynced, renamed). Used by the engine's driver and CLI.
//
//   engine::write_checkpoint(run + "/checkpoints/step-40", store, specs, {{"step", 40}});
//   auto last = engine::list_checkpoints(run);  // by step ascending
//   nlohmann::json meta = engine::read_checkpoint(last.back().path, store, specs);
//   engine::prune_checkpoints(run, /*keep=*/3);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "engine/checkpoint_format.h"
#include "engine/plan.h"
#include "models/layers.h"
#include "models/safetensors.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// Writes `dir` atomically: everything goes to a sibling "<dir>.tmp" (removed first if a crash left
// one), each file and the folder fsynced, then renamed to `dir` (an existing `dir` is renamed to
// "<dir>.old" first and removed after) and the parent folder fsynced. A crash at any point leaves
// either the previous checkpoint or the new one complete, never a half one under the final name.
// Contents: state.safetensors with, for every owned (not tied) trainable tensor, "<name>" = fp32
// master, "<name>.exp_avg", "<name>.exp_avg_sq", and with `include_stream` "<name>.stream" = the
// streaming copy (one-step-stale training, where it lags the master); state.json =
// {"format": "rondo-checkpoint", "version": 2, "files": {"state.safetensors": {"bytes",
// "xxh3_64"}}, "meta_xxh3_64": XXH3-64 of meta's compact JSON, "meta": meta}. Returns the bytes
// written. Throws Error naming the path and the failed call. `before_rename`, if set, runs once
// everything is written and synced under the temporary name (fault-injection tests kill the process
// there).
std::uint64_t write_checkpoint(const std::string& dir, offload::LayerStore& store,
                               const std::vector<models::LayerSpec>& specs,
                               const nlohmann::json& meta, bool include_stream = false,
                               const std::function<void()>& before_rename = {});

// checkpoint_problems(dir): engine/checkpoint_format.h.

// Reads a checkpoint written by write_checkpoint into `store`, after checkpoint_problems (any
// problem is an Error naming the folder): masters, moments, the streaming
// copies (from "<name>.stream" when the checkpoint has them, else the master rounded to the store's
// streaming dtype exactly as the optimizer's update rounds it), gradients zeroed. Frozen tensors
// are not touched. Everything is validated before the store is: every trainable tensor present with
// its shape and dtype, no unknown tensor; the Error names the checkpoint and the tensors. Returns
// the caller's meta.
// `verified`: checkpoint_problems(dir) has just passed (choose_checkpoint, under the run lock),
// so the files are not hashed a second time.
nlohmann::json read_checkpoint(const std::string& dir, offload::LayerStore& store,
                               const std::vector<models::LayerSpec>& specs, bool verified = false);

struct CheckpointInfo {
  std::int64_t step = 0;
  std::string path;  // run_dir/checkpoints/step-N
};

// The complete checkpoints of a run folder (run_dir/checkpoints/step-N holding a state.json), by
// step ascending. "*.tmp" and "*.old" folders (a crash mid-write) and folders without state.json
// are not checkpoints. No checkpoints folder: none.
std::vector<CheckpointInfo> list_checkpoints(const std::string& run_dir);

// The checkpoint a resume continues from, or an export reads: the one `name` names ("step-N" or
// the path of one of the run's checkpoints) when it is not empty, else the newest that passes its
// checks (checkpoint_problems). Throws Error when `name` names none of them or one that fails its
// checks (both listing what the run has). `chosen` is empty when no checkpoint passes (or the run
// has none); `skipped` holds the newer ones that fail, newest first, with their problems.
struct SkippedCheckpoint {
  std::string path;
  std::vector<std::string> problems;
  bool damaged = true;  // its own content is bad (not an I/O error or a newer Rondo's)
};
struct CheckpointChoice {
  std::optional<CheckpointInfo> chosen;
  std::vector<SkippedCheckpoint> skipped;
};
CheckpointChoice choose_checkpoint(const std::string& run_dir, const std::string& name = "");

// The trained weights of a checkpoint's state.safetensors (its fp32 masters, by parameter name;
// moments and streaming copies left out): what exports and `rondo chat` use. Views of `state`'s
// mapping.
std::map<std::string, at::Tensor> checkpoint_weights(const models::SafetensorsFile& state);

// Removes all but the newest `keep` complete checkpoints (keep <= 0: keeps all), never the one
// at step `written` (the one just written: a newer folder left from before a resume must not
// push it out). Each goes in two moves: its state.json first (fsynced), so a crash mid-removal
// never leaves a half checkpoint that list_checkpoints would offer.
void prune_checkpoints(const std::string& run_dir, int keep,
                       std::optional<std::int64_t> written = std::nullopt);

// Moves a checkpoint that fails its checks out of the list, to "step-N.damaged" beside it
// ("step-N.damaged.2" and on if taken), kept for a look but never resumed from, counted by
// checkpoint.keep or pruned. Returns the new path.
std::string set_aside_checkpoint(const std::string& dir);

// The plan a checkpoint was trained with, in its state.json ("plan"): the stages, microbatches,
// grain and tile, the devices it ran on, and describe() for people. plan_from_json throws
// (nlohmann) on a malformed entry.
nlohmann::json plan_to_json(const Plan& p, std::size_t devices);
Plan plan_from_json(const nlohmann::json& j);

}  // namespace rondo::engine
