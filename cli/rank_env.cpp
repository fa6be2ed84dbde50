// The launcher's variables as a rank's place (rank_env.h).
#include "cli/rank_env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "kernels/error.h"

namespace rondo::cli {
namespace {

int int_var(const std::function<const char*(const char*)>& getenv, const char* name, int lo,
            int hi) {
  const char* v = getenv(name);
  if (!v) throw Error(std::string("the launcher did not set ") + name);
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi)
    throw Error(std::string(name) + "=\"" + v + "\": expected a whole number in " +
                std::to_string(lo) + ".." + std::to_string(hi));
  return static_cast<int>(x);
}

// "node[01-04,07],other" -> "node01"; "a,b" -> "a": the first host of a Slurm node list.
std::string first_slurm_host(const std::string& list) {
  std::string host;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const char c = list[i];
    if (c == ',') break;
    if (c == '[') {
      std::size_t j = i + 1;
      while (j < list.size() && std::isdigit(static_cast<unsigned char>(list[j])))
        host += list[j++];
      break;
    }
    host += c;
  }
  return host;
}

}  // namespace

std::optional<engine::RankEnv> rank_env(const std::function<const char*(const char*)>& getenv) {
  constexpr int kMaxRanks = 1 << 16;
  engine::RankEnv env;
  auto port = [&] {
    return getenv("MASTER_PORT") ? int_var(getenv, "MASTER_PORT", 1, 65535) : 29500;
  };
  if (getenv("RANK") || getenv("WORLD_SIZE")) {
    env.launcher = getenv("TORCHELASTIC_RUN_ID") ? "torchrun" : "RANK/WORLD_SIZE";
    env.world = int_var(getenv, "WORLD_SIZE", 1, kMaxRanks);
    env.rank = int_var(getenv, "RANK", 0, env.world - 1);
    env.local_rank = getenv("LOCAL_RANK") ? int_var(getenv, "LOCAL_RANK", 0, kMaxRanks) : 0;
    if (getenv("LOCAL_WORLD_SIZE"))
      env.local_world = int_var(getenv, "LOCAL_WORLD_SIZE", env.local_rank + 1, kMaxRanks);
    if (!getenv("MASTER_ADDR") && env.world > 1)
      throw Error("RANK and WORLD_SIZE are set but MASTER_ADDR is not: set it to rank 0's host");
    if (getenv("MASTER_ADDR")) env.master_addr = getenv("MASTER_ADDR");
    env.master_port = port();
    if (const char* a = getenv("TORCHELASTIC_USE_AGENT_STORE"))
      env.agent_store =
          std::string(a) == "True" || std::string(a) == "true" || std::string(a) == "1";
    if (getenv("TORCHELASTIC_RESTART_COUNT"))
      env.restart_count = int_var(getenv, "TORCHELASTIC_RESTART_COUNT", 0, kMaxRanks);
    return env;
  }
  if (getenv("SLURM_PROCID") && getenv("SLURM_NTASKS")) {
    env.launcher = "slurm";
    env.world = int_var(getenv, "SLURM_NTASKS", 1, kMaxRanks);
    env.rank = int_var(getenv, "SLURM_PROCID", 0, env.world - 1);
    env.local_rank = getenv("SLURM_LOCALID") ? int_var(getenv, "SLURM_LOCALID", 0, kMaxRanks) : 0;
    // SLURM_NTASKS_PER_NODE is a plain count only when --ntasks-per-node was given.
    if (const char* n = getenv("SLURM_NTASKS_PER_NODE");
        n && *n && std::string(n).find_first_not_of("0123456789") == std::string::npos)
      env.local_world = int_var(getenv, "SLURM_NTASKS_PER_NODE", env.local_rank + 1, kMaxRanks);
    if (getenv("MASTER_ADDR")) {
      env.master_addr = getenv("MASTER_ADDR");
    } else {
      const char* list = getenv("SLURM_STEP_NODELIST") ? getenv("SLURM_STEP_NODELIST")
                                                       : getenv("SLURM_JOB_NODELIST");
      if (!list && env.world > 1)
        throw Error(
            "Slurm's SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST "
            "is: set MASTER_ADDR to the first node's host name");
      if (list) env.master_addr = first_slurm_host(list);
    }
    env.master_port = port();
    if (getenv("SLURM_RESTART_COUNT"))
      env.restart_count = int_var(getenv, "SLURM_RESTART_COUNT", 0, kMaxRanks);
    return env;
  }
  return std::nullopt;
}

}  // namespace rondo::cli
