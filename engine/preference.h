// Preference objectives (DPO, IPO, ORPO, SimPO) as TRL 1.16 defines them
// (docs/preference-reference.md; docs/preference.md for users): the pairwise loss of one
// microbatch from its sequences' log-probabilities, and what that loss asks of each target
// token's cross-entropy, so that the fused head's backward (models::head_forward_backward with
// token weights) carries it. Pure torch math on the device the tail runs on; no threads.
//
// A preference microbatch holds pairs: sequence 2p is pair p's chosen answer (its prompt
// before it), 2p + 1 the rejected one, each a document of a row. Per target position the
// microbatch says which sequence's completion it scores (or -1) and whether it counts in the
// chosen answers' NLL term (ORPO; SimPO with an SFT weight).
//
//   at::Tensor ce = models::head_token_losses(config, norm, lm_head, h, targets);
//   PreferenceTerms t = preference_terms(options, ce, seq, nll, reference, /*with_grad=*/true);
//   // t.loss: this microbatch's loss; t.token_coef: d loss / d ce, per token
#pragma once

#include <ATen/core/Tensor.h>

#include "engine/objective.h"

namespace rondo::engine {

struct PreferenceTerms {
  at::Tensor loss;            // () fp32: the microbatch's loss
  at::Tensor token_coef;      // like the targets, fp32: d loss / d (each target's cross-entropy)
  at::Tensor metrics;         // (kPreferenceMetrics) fp32: the microbatch's means
  at::Tensor sequence_logps;  // (2P) fp32: each sequence's summed completion log-probability
};

// From each target's cross-entropy `ce` (the shape of the targets, 0 where there is none), the
// sequence each position scores `seq` (int64, -1: none), the NLL positions `nll` (fp32 0/1;
// undefined: none) and the reference's summed log-probabilities `reference` (2P fp32; DPO). With
// `with_grad`, token_coef; otherwise undefined (evaluation, the reference pass).
PreferenceTerms preference_terms(const PreferenceOptions& options, const at::Tensor& ce,
                                 const at::Tensor& seq, const at::Tensor& nll,
                                 const at::Tensor& reference, bool with_grad);

}  // namespace rondo::engine
