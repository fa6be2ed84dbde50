// Names of the objectives and preference metrics (objective.h).
#include "engine/objective.h"

#include <fmt/format.h>

#include "kernels/error.h"

namespace rondo::engine {

const std::array<const char*, kPreferenceMetrics> kPreferenceMetricNames = {
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
    "logps/rejected", "nll_loss",         "log_odds_ratio",     "log_odds_chosen"};

std::string preference_status(const std::vector<std::pair<std::string, double>>& metrics) {
  double margin = 0, accuracy = 0;
  bool found = false;
  for (const auto& [name, value] : metrics) {
    if (name == kPreferenceMetricNames[kRewardsMargins]) margin = value, found = true;
    if (name == kPreferenceMetricNames[kRewardsAccuracies]) accuracy = value;
  }
  return found ? fmt::format("margin {:.3g}, accuracy {:.2f}", margin, accuracy) : "";
}

const char* to_string(Objective o) {
  switch (o) {
    case Objective::kSft:
      return "sft";
    case Objective::kDpo:
      return "dpo";
    case Objective::kOrpo:
      return "orpo";
    case Objective::kSimpo:
      return "simpo";
  }
  return "?";
}

Objective objective_from(const std::string& name) {
  for (Objective o : {Objective::kSft, Objective::kDpo, Objective::kOrpo, Objective::kSimpo})
    if (name == to_string(o)) return o;
  throw Error("training.objective is '" + name +
              "'; use \"sft\" (supervised: next-token loss), \"dpo\", \"orpo\" or \"simpo\" "
              "(preference pairs)");
}

const char* to_string(DpoLoss l) {
  return l == DpoLoss::kIpo ? "ipo" : "sigmoid";
}

DpoLoss dpo_loss_from(const std::string& name) {
  if (name == "sigmoid") return DpoLoss::kSigmoid;
  if (name == "ipo") return DpoLoss::kIpo;
  throw Error("preference.loss is '" + name + "'; use \"sigmoid\" (DPO) or \"ipo\"");
}

std::vector<PreferenceMetric> reported_metrics(Objective objective) {
  std::vector<PreferenceMetric> m = {kRewardsChosen,  kRewardsRejected, kRewardsAccuracies,
                                     kRewardsMargins, kLogpsChosen,     kLogpsRejected};
  if (objective == Objective::kOrpo) m.insert(m.end(), {kNllLoss, kLogOddsRatio, kLogOddsChosen});
  if (objective == Objective::kSimpo) m.push_back(kNllLoss);
  if (objective == Objective::kSft) m.clear();
  return m;
}

}  // namespace rondo::engine
