// The launcher's variables as a rank's place (engine::RankEnv, docs/distributed.md): torchrun's
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), else Slurm's
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master from MASTER_ADDR or the first host of
// SLURM_STEP_NODELIST / SLURM_JOB_NODELIST, the port from MASTER_PORT or 29500), else none. The
// variables come through `getenv` (std::getenv in `rondo`, a map in tests).
//
//   std::optional<engine::RankEnv> env = rank_env([](const char* n) { return std::getenv(n); });
#pragma once

#include <functional>
#include <optional>

#include "engine/ranks.h"

namespace rondo::cli {

// Throws Error naming the variable that is malformed or missing.
std::optional<engine::RankEnv> rank_env(const std::function<const char*(const char*)>& getenv);

}  // namespace rondo::cli
