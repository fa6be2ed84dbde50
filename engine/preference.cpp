// Preference objectives' loss per microbatch (preference.h). The formulas are TRL 1.16's, cited
// in docs/preference-reference.md §3-§6.
#include "engine/preference.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include "kernels/error.h"

namespace rondo::engine {

namespace {

// log(1 - exp(x)) for x < 0, as TRL's ORPO computes it (stable on both sides of -ln 2).
at::Tensor log1mexp(const at::Tensor& x) {
  return at::where(x.gt(-std::log(2.0)), at::log(-at::expm1(x)), at::log1p(-at::exp(x)));
}

// -(1 - eps) log sigmoid(z) - eps log sigmoid(-z): the sigmoid loss with conservative labels.
at::Tensor sigmoid_loss(const at::Tensor& z, double eps) {
  at::Tensor l = -at::log_sigmoid(z);
  if (eps != 0) l = (1 - eps) * l - eps * at::log_sigmoid(-z);
  return l;
}

}  // namespace

PreferenceTerms preference_terms(const PreferenceOptions& o, const at::Tensor& ce,
                                 const at::Tensor& seq, const at::Tensor& nll,
                                 const at::Tensor& reference, bool with_grad) {
  RONDO_ASSERT(o.pairs() && reference.defined() && reference.size(0) % 2 == 0);
  const std::int64_t S = reference.size(0);
  const at::Tensor flat_seq = seq.reshape({-1});
  const at::Tensor flat_ce = ce.reshape({-1});
  const at::Tensor scored = flat_seq.ge(0);
  const at::Tensor index = at::where(scored, flat_seq, at::zeros_like(flat_seq));
  const at::TensorOptions fopts = reference.options();
  // Per sequence: summed completion log-probabilities and the number of completion tokens.
  at::Tensor sums = at::zeros({S}, fopts).index_add_(0, index, -flat_ce * scored);
  at::Tensor counts = at::zeros({S}, fopts).index_add_(0, index, scored.to(at::kFloat));
  counts = counts.clamp_min(1);
  // The chosen answers' NLL: a token mean over the microbatch (TRL's CrossEntropyLoss()).
  at::Tensor nll_mask, nll_value = at::zeros({}, fopts);
  if (o.nll_term() && nll.defined()) {
    nll_mask = nll.reshape({-1}).to(at::kFloat);
    const at::Tensor n = nll_mask.sum().clamp_min(1);
    nll_mask = nll_mask / n;
    nll_value = (flat_ce * nll_mask).sum();
  }

  c10::AutoGradMode grad(with_grad);
  at::Tensor logps = sums.detach().requires_grad_(with_grad);
  const at::Tensor lc = logps.slice(0, 0, S, 2), lr = logps.slice(0, 1, S, 2);
  const at::Tensor nc = counts.slice(0, 0, S, 2), nr = counts.slice(0, 1, S, 2);
  const double beta = o.beta;
  at::Tensor per_pair, reward_c, reward_r, shown_c = lc, shown_r = lr;
  at::Tensor extra = at::zeros({}, fopts);  // the NLL term's value, added to the mean
  at::Tensor metrics = at::zeros({kPreferenceMetrics}, fopts);
  switch (o.objective) {
    case Objective::kDpo: {
      const at::Tensor sc = lc - reference.slice(0, 0, S, 2);
      const at::Tensor sr = lr - reference.slice(0, 1, S, 2);
      per_pair = o.dpo_loss == DpoLoss::kIpo ? at::pow(sc / nc - sr / nr - 1.0 / (2.0 * beta), 2)
                                             : sigmoid_loss(beta * (sc - sr), o.label_smoothing);
      reward_c = beta * sc;
      reward_r = beta * sr;
      break;
    }
    case Objective::kOrpo: {
      const at::Tensor ac = lc / nc, ar = lr / nr;
      const at::Tensor log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar));
      const at::Tensor ratio = at::log_sigmoid(log_odds);
      per_pair = -beta * ratio;
      extra = nll_value;
      reward_c = beta * ac;
      reward_r = beta * ar;
      shown_c = ac;
      shown_r = ar;
      metrics[kNllLoss] = nll_value.detach();
      metrics[kLogOddsRatio] = ratio.detach().mean();
      metrics[kLogOddsChosen] = log_odds.detach().mean();
      break;
    }
    case Objective::kSimpo: {
      const at::Tensor ac = lc / nc, ar = lr / nr;
      per_pair = sigmoid_loss(beta * (ac - ar) - o.gamma, o.label_smoothing);
      if (o.nll_term()) extra = o.sft_weight * nll_value;
      reward_c = beta * ac;
      reward_r = beta * ar;
      shown_c = ac;
      shown_r = ar;
      metrics[kNllLoss] = nll_value.detach();
      break;
    }
    case Objective::kSft:
      break;
  }
  at::Tensor loss = per_pair.mean() + extra;
  metrics[kRewardsChosen] = reward_c.detach().mean();
  metrics[kRewardsRejected] = reward_r.detach().mean();
  metrics[kRewardsAccuracies] = reward_c.detach().gt(reward_r.detach()).to(at::kFloat).mean();
  metrics[kRewardsMargins] = (reward_c - reward_r).detach().mean();
  metrics[kLogpsChosen] = shown_c.detach().mean();
  metrics[kLogpsRejected] = shown_r.detach().mean();

  PreferenceTerms t;
  t.metrics = metrics;
  t.sequence_logps = sums;
  if (with_grad) {
    loss.backward();
    // logp = -ce per token: d loss / d ce = -d loss / d (its sequence's sum); plus the NLL term.
    at::Tensor coef = -logps.grad().index_select(0, index) * scored;
    if (nll_mask.defined())
      coef = coef + nll_mask * (o.objective == Objective::kOrpo ? 1.0 : o.sft_weight);
    t.token_coef = coef.view(ce.sizes());
  }
  t.loss = loss.detach();
  return t;
}

}  // namespace rondo::engine
