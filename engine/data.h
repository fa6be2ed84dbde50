// Training data: a JSONL file (one example per line) or a JSON file holding a list of examples,
// each in one of four formats, detected from the first usable example or chosen:
//   text      {"text": "..."}                                    loss on every token
//   alpaca    {"instruction": "...", "input": "...", "output": "...", "system": "..."}   a user
//             turn (the instruction, then the input after a blank line when there is one) and the
//             assistant's output; "input" and "system" may be left out
//   chat      {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
//   sharegpt  {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...],
//              "system": "..."}   ("user", "assistant", "chatgpt" and "model" are taken too)
// and, for a preference objective (DataOptions::objective), TRL's preference pairs:
//   preference {"prompt": ..., "chosen": ..., "rejected": ...}   strings or lists of messages,
//              the prompt left out when it is the common start of both (preference_data.h)
// Alpaca, chat and ShareGPT examples go through the model's chat template; the loss covers the
// assistant replies only, unless train_on_everything. A bad example is an error naming the file
// and the line it starts on (or, with skip_bad_lines, is skipped and counted). data.max_line
// bounds one example (a line, or an element of the list).
//
//   engine::Dataset d = engine::load_data("data/train.jsonl", tok, tmpl, {});
//   std::printf("%s\n", d.stats_text().c_str());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/objective.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"

namespace rondo::engine {

enum class DataFormat { kAuto, kText, kAlpaca, kChat, kShareGpt, kPreference };
inline constexpr DataFormat kDataFormats[] = {DataFormat::kAuto,     DataFormat::kText,
                                              DataFormat::kAlpaca,   DataFormat::kChat,
                                              DataFormat::kShareGpt, DataFormat::kPreference};
// "auto", "text", "alpaca", "chat", "sharegpt", "preference"
const char* to_string(DataFormat format);
DataFormat data_format_from(const std::string& name);  // the reverse; throws Error for others

constexpr std::uint64_t kDefaultMaxLineBytes = 16ull << 20;

struct DataOptions {
  DataFormat format = DataFormat::kAuto;
  bool skip_bad_lines = false;       // count and skip them instead of stopping at the first
  bool train_on_everything = false;  // chat/alpaca: loss on prompts too
  bool add_eos = true;               // text: end each document with the tokenizer's EOS
  std::int64_t max_lines = 0;        // > 0: stop after this many non-empty lines (a preview)
  // A preference objective reads pairs (and only pairs), tokenised as TRL's trainer for it does,
  // each sequence at most max_length tokens (preference_data.h); kSft reads the other formats.
  Objective objective = Objective::kSft;
  std::int64_t max_length = 512;
  // The longest line read: a longer one is a bad line (an error naming the file and line, or
  // skipped with skip_bad_lines) and is never held in memory whole.
  std::uint64_t max_line_bytes = kDefaultMaxLineBytes;
};

struct Example {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> loss_mask;  // per token: 1 = its prediction is trained
  // A preference pair: ids are its chosen sequence then, from here, its rejected one; loss_mask's
  // bits are kAnswerToken and kNllToken (preference_data.h). 0: not a pair.
  std::int32_t second = 0;
};

struct Dataset {
  std::string path;
  DataFormat format = DataFormat::kAuto;  // as detected or chosen
  std::vector<Example> examples;
  std::int64_t lines = 0;                    // non-empty lines read
  std::int64_t skipped = 0;                  // bad lines skipped (skip_bad_lines)
  std::vector<std::string> skipped_reasons;  // the first few, "line 7: ..."
  bool partial = false;                      // max_lines stopped the reading before the end
  bool json_list = false;                    // a JSON file holding a list, not JSONL
  std::int64_t pairs_dropped = 0;            // preference pairs whose prompt fills max_length
  std::int64_t pairs_truncated = 0;          // preference pairs with a sequence cut to max_length
  // The first example's first user message (the first words of a plain text): a prompt whose
  // samples show what the training teaches.
  std::string first_prompt;

  std::int64_t tokens() const;
  std::int64_t trained_tokens() const;  // tokens under the loss mask (pairs: answer tokens)
  // "812 examples (alpaca), 91,204 tokens, 40,311 trained; length 12..1,024, mean 112; 3 bad
  // lines skipped"
  std::string stats_text() const;
};

// The chat template training data from `model_path` is rendered with: the model's own, or the
// named `chat_format` ("chatml", "llama3", ...). Plain-text data (format kText) needs none, so a
// model without a template is fine for it; for the others the error says what to set.
models::ChatTemplate training_chat_template(const std::string& model_path,
                                            const std::string& chat_format, DataFormat format);

// Throws Error "file:line: what" ("file:line (example N): what" in a JSON list) for a bad example
// (without skip_bad_lines), for a JSON list that breaks off, and when nothing usable is left
// ("no examples in ...").
Dataset load_data(const std::string& path, const models::Tokenizer& tokenizer,
                  const models::ChatTemplate& chat_template, const DataOptions& options);

}  // namespace rondo::engine
