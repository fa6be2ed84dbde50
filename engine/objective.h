// The training objective and a preference objective's settings (engine/preference.h computes
// the losses; engine/preference_data.h reads the pairs). No torch here: the data reader and its
// fuzz harness use it.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace rondo::engine {

enum class Objective { kSft, kDpo, kOrpo, kSimpo };
const char* to_string(Objective o);                 // "sft", "dpo", "orpo", "simpo"
Objective objective_from(const std::string& name);  // the reverse; throws Error for others

enum class DpoLoss { kSigmoid, kIpo };
const char* to_string(DpoLoss l);                // "sigmoid", "ipo"
DpoLoss dpo_loss_from(const std::string& name);  // the reverse; throws Error for others

struct PreferenceOptions {
  Objective objective = Objective::kSft;
  DpoLoss dpo_loss = DpoLoss::kSigmoid;
  double beta = 0.1;           // DPO's β (IPO's τ), ORPO's λ, SimPO's β
  double label_smoothing = 0;  // DPO sigmoid and SimPO: conservative labels (cDPO's ε)
  double gamma = 0.5;          // SimPO: the target margin (TRL's simpo_gamma)
  double sft_weight = 0;       // SimPO: weight of the chosen answers' NLL (TRL's cpo_alpha)
  bool pairs() const { return objective != Objective::kSft; }
  bool needs_reference() const { return objective == Objective::kDpo; }
  // The chosen answers' cross-entropy is part of the loss: ORPO always (over the prompt too, as
  // TRL's ORPOTrainer), SimPO with an SFT weight (over the answer only).
  bool nll_term() const {
    return objective == Objective::kOrpo || (objective == Objective::kSimpo && sft_weight != 0);
  }
  bool nll_over_prompt() const { return objective == Objective::kOrpo; }
};

// The metrics a preference step reports, in TRL's names and order; each is the mean over a
// microbatch's pairs, then over the step's microbatches (as TRL logs them).
enum PreferenceMetric {
  kRewardsChosen,
  kRewardsRejected,
  kRewardsAccuracies,
  kRewardsMargins,
  kLogpsChosen,
  kLogpsRejected,
  kNllLoss,
  kLogOddsRatio,
  kLogOddsChosen,
  kPreferenceMetrics
};
extern const std::array<const char*, kPreferenceMetrics> kPreferenceMetricNames;

// "margin 0.123, accuracy 0.75" from an event's metrics (by TRL's names), for a status line; ""
// when they have no margin (a supervised run's).
std::string preference_status(const std::vector<std::pair<std::string, double>>& metrics);
// The metrics `objective` reports (TRL's trainer for it logs these).
std::vector<PreferenceMetric> reported_metrics(Objective objective);

}  // namespace rondo::engine
