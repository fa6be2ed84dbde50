// Preference pairs from TRL's layouts (the data reader's part for DataFormat::kPreference; the
// reader itself is data.cpp's). One JSON object is one pair:
//   {"prompt": "...", "chosen": "...", "rejected": "..."}                      standard
//   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}       conversational
//   {"chosen": ..., "rejected": ...}   implicit prompt: the longest common start of the two
// A pair becomes one Example: the chosen sequence (prompt and answer) then the rejected one from
// Example::second; loss_mask bit kAnswerToken marks answer tokens (their log-probabilities are
// the pair's), bit kNllToken the tokens of the chosen answers' NLL term (ORPO: prompt and answer;
// SimPO: the answer).
//
// Tokenised as TRL 1.16's trainer for the objective does (docs/preference-reference.md §1-§2):
//   DPO: the prompt and each prompt + answer tokenised whole (a string prompt with the tokenizer's
//     special tokens, its EOS text appended to a string answer; messages through the chat
//     template), the prompt cut to the tokens both share; a pair whose prompt fills max_length is
//     dropped, longer sequences keep their first max_length tokens.
//   ORPO, SimPO: messages rendered to text first; each answer tokenised after its prompt, the
//     split moved back a token where the two merge; BOS put first and EOS last where missing;
//     answers cut to what max_length leaves after the prompt (a prompt that leaves nothing: the
//     pair is dropped, where TRL would divide by zero).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>

#include "engine/data.h"
#include "engine/objective.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"

namespace rondo::engine {

inline constexpr std::uint8_t kAnswerToken = 1, kNllToken = 2;

struct PairCounts {
  std::int64_t dropped = 0;    // pairs left out (their prompt fills max_length)
  std::int64_t truncated = 0;  // pairs with a sequence cut to max_length
};

// Whether `j` looks like a preference pair (has "chosen" and "rejected").
bool is_preference_pair(const nlohmann::json& j);

// The pair `j` as an Example (empty ids: dropped, counted in `counts`). `prompt`, when given,
// receives its prompt's last user message (or the prompt text). Throws Error saying what is wrong
// with the object.
Example preference_example(nlohmann::json& j, const models::Tokenizer& tok,
                           const models::ChatTemplate& tmpl, Objective objective,
                           std::int64_t max_length, PairCounts& counts,
                           std::string* prompt = nullptr);

}  // namespace rondo::engine
