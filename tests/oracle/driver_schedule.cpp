// Driver subcommand for the learning-rate schedule oracle test.
//   lr-schedule <in.json> <out.json>
//     in.json: {"kind": "constant"|"linear"|"cosine", "lr", "warmup", "total", "min_lr_ratio"}
//     writes {"lr": [lr at step 1 .. total]}.
#include <fstream>
#include <nlohmann/json.hpp>

#include "driver.h"
#include "engine/lr_schedule.h"
#include "kernels/error.h"

namespace rondo::oracle {
namespace {

int lr_schedule(const std::vector<std::string>& args) {
  if (args.size() != 2) throw Error("usage: lr-schedule <in.json> <out.json>");
  nlohmann::json j;
  std::ifstream(args[0]) >> j;
  engine::LrSchedule s;
  const std::string kind = j["kind"];
  s.kind = kind == "constant" ? engine::LrScheduleKind::kConstant
           : kind == "linear" ? engine::LrScheduleKind::kLinear
                              : engine::LrScheduleKind::kCosine;
  s.lr = j["lr"];
  s.warmup_steps = j["warmup"];
  s.total_steps = j["total"];
  s.min_lr_ratio = j.value("min_lr_ratio", 0.0);
  const auto problems = s.problems();
  if (!problems.empty()) throw Error(join_problems("schedule:", problems));
  nlohmann::json out = {{"lr", nlohmann::json::array()}};
  for (std::int64_t step = 1; step <= s.total_steps; ++step)
    out["lr"].push_back(s.at(step));
  std::ofstream(args[1]) << out.dump();
  return 0;
}

RegisterCommand reg("lr-schedule", "<in.json> <out.json>", lr_schedule);

}  // namespace
}  // namespace rondo::oracle
