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
#include "models/tokenizer.h"

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

// Text of tokens as they are generated: each push() returns what became final with that token.
// An incomplete UTF-8 sequence decodes as U+FFFD (one per byte with byte-fallback tokenizers)
// until its last byte arrives, so trailing U+FFFD are held back; finish() returns the rest.
class TextStreamer {
 public:
  explicit TextStreamer(const Tokenizer& tokenizer, bool skip_special_tokens = true)
      : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}
  std::string push(std::int32_t id);
  std::string finish();
  const std::vector<std::int32_t>& ids() const { return ids_; }

 private:
  std::string advance(bool final);
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<std::int32_t> ids_;
  std::string shown_;  // returned so far
};

// Picks the next token from fp32 logits (V) as `options` says, using `rng_state` (advanced).
std::int64_t sample_token(const at::Tensor& logits, const SamplingOptions& options,
                          std::uint64_t& rng_state);

}  // namespace rondo::models
