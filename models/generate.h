// Text generation with a KV cache: greedy, or temperature + top-p sampling. Used for `rondo
// generate` and for samples during training (from the weights in training). One sequence at a
// time; token ids in, token ids out (the tokenizer is the caller's).
//
//   auto out = models::generate(model, prompt_ids, {.max_new_tokens = 64, .temperature = 0.7});
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "models/model.h"

namespace rondo::models {

struct SamplingOptions {
  std::int64_t max_new_tokens = 128;
  double temperature = 0;  // 0 = greedy (argmax)
  double top_p = 1.0;      // nucleus: sample among the most likely tokens holding top_p of the mass
  std::uint64_t seed = 0;  // sampling is reproducible for a given seed
  std::vector<std::int64_t> stop_tokens;  // empty = the config's eos tokens
};

// Returns the new tokens (without the prompt), stopping after a stop token (included) or
// max_new_tokens. `on_token` sees each new token as it is chosen; returning false stops early.
std::vector<std::int64_t> generate(const Model& model, const std::vector<std::int64_t>& prompt,
                                   const SamplingOptions& options,
                                   const std::function<bool(std::int64_t)>& on_token = {});

// Picks the next token from fp32 logits (V) as `options` says, using `rng_state` (advanced).
std::int64_t sample_token(const at::Tensor& logits, const SamplingOptions& options,
                          std::uint64_t& rng_state);

}  // namespace rondo::models
