// Learning-rate schedules as Hugging Face's Trainer applies them: a linear warmup from 0, then
// constant, linear decay to 0, or a cosine decay (optionally to a floor of min_lr_ratio * lr).
// Step numbers are the optimizer's, 1-based; step 1 runs at the schedule's value for 0 (so with a
// warmup the first step has learning rate 0, exactly as transformers' schedulers give).
//
//   engine::LrSchedule s{.kind = engine::LrScheduleKind::kCosine, .lr = 2e-4, .warmup_steps = 10,
//                        .total_steps = 1000};
//   options.lr = [s](std::int64_t step) { return s.at(step); };
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rondo::engine {

enum class LrScheduleKind { kConstant, kLinear, kCosine };
const char* to_string(LrScheduleKind kind);  // "constant", "linear", "cosine"

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kCosine;
  double lr = 1e-4;               // peak learning rate
  std::int64_t warmup_steps = 0;  // linear from 0 to lr
  std::int64_t total_steps = 1;   // where linear and cosine reach their end
  double min_lr_ratio = 0;        // cosine only: the floor, as a share of lr

  double at(std::int64_t step) const;         // step >= 1
  std::vector<std::string> problems() const;  // every problem, for config validation
};

// training.schedule's name ("constant", "linear", else cosine) as a kind.
LrScheduleKind schedule_kind(const std::string& name);

}  // namespace rondo::engine
