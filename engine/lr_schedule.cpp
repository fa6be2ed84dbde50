#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace rondo::engine {

const char* to_string(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kConstant:
      return "constant";
    case LrScheduleKind::kLinear:
      return "linear";
    case LrScheduleKind::kCosine:
      return "cosine";
  }
  return "?";
}

double LrSchedule::at(std::int64_t step) const {
  const double s = static_cast<double>(std::max<std::int64_t>(step, 1) - 1);  // scheduler count
  const double w = static_cast<double>(warmup_steps), n = static_cast<double>(total_steps);
  if (s < w) return lr * s / std::max(1.0, w);
  double factor = 1;
  switch (kind) {
    case LrScheduleKind::kConstant:
      break;
    case LrScheduleKind::kLinear:
      factor = std::max(0.0, (n - s) / std::max(1.0, n - w));
      break;
    case LrScheduleKind::kCosine: {
      const double progress = (s - w) / std::max(1.0, n - w);
      factor = std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
      factor = factor * (1 - min_lr_ratio) + min_lr_ratio;
      break;
    }
  }
  return lr * factor;
}

std::vector<std::string> LrSchedule::problems() const {
  std::vector<std::string> out;
  if (!(lr > 0) || !std::isfinite(lr)) out.push_back("learning rate must be positive");
  if (warmup_steps < 0) out.push_back("warmup steps must not be negative");
  if (total_steps < 1) out.push_back("total steps must be at least 1");
  if (warmup_steps > total_steps)
    out.push_back("warmup steps (" + std::to_string(warmup_steps) + ") exceed the total steps (" +
                  std::to_string(total_steps) + ")");
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1)) out.push_back("min_lr_ratio must be in [0, 1]");
  if (min_lr_ratio > 0 && kind != LrScheduleKind::kCosine)
    out.push_back("min_lr_ratio applies to the cosine schedule only");
  return out;
}

LrScheduleKind schedule_kind(const std::string& name) {
  return name == "constant" ? LrScheduleKind::kConstant
         : name == "linear" ? LrScheduleKind::kLinear
                            : LrScheduleKind::kCosine;
}

}  // namespace rondo::engine
