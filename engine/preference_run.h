// A preference run's parts that the session (session.cpp) calls: the engine's options from the
// config, the step's metrics for events, and DPO's reference log-probabilities: computed once,
// before step 1, by a forward pass of the starting weights over every pair (LoRA: the adapters as
// they start; full: the weights as loaded), kept in the run folder (reference_logps.safetensors,
// with the data's fingerprint) and read back by a resume, so that a resumed run uses exactly the
// reference the uninterrupted one did. No second copy of the model is held for it.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine/batching.h"
#include "engine/engine.h"
#include "engine/train_config.h"

namespace rondo::engine {

PreferenceOptions preference_options(const TrainConfig& c);

// The metrics `objective` reports, by TRL's names, from a step's means (or an evaluation's sums
// over `count` microbatches).
std::vector<std::pair<std::string, double>> preference_metrics(
    Objective objective, const std::array<double, kPreferenceMetrics>& values, double count = 1);

// The row positions DPO's reference pass scores before step 1 (every row of `train` and of
// `validation`); 0 for another objective or without data.
std::int64_t reference_tokens(const TrainConfig& c, const Batcher* train,
                              const Batcher* validation);

// DPO: gives `train` (and `validation`, when there is one) their reference log-probabilities.
// A run that has not begun (`fresh`) computes them with `evaluate` (the engine's forward pass
// over microbatches: Engine::evaluate; every rank computes all of them) and, when `write` (rank
// 0), writes them to `run_dir` with `fingerprint` (the training and validation data's); a resumed
// one reads them back, and refuses (Error) when the file is missing or was written for other
// data. The pass goes in parts (rows of `seq_len` tokens), so that a large data set's inputs are
// not all built at once. `log` says what it does, and how far a long pass is.
void prepare_reference(const std::filesystem::path& run_dir, const std::string& fingerprint,
                       bool fresh, bool write, Batcher& train, Batcher* validation,
                       std::int64_t seq_len,
                       const std::function<EvalResult(std::vector<Microbatch>)>& evaluate,
                       const std::function<void(const std::string&)>& log);

}  // namespace rondo::engine
