// A tiny byte-level tokenizer for tests: single-character tokens for printable ASCII plus Ġ and Ċ,
// the bos token <|begin_of_text|>, the eos token <|end_of_text|>, and the chat formats' markers
// as special added tokens. Header-only: used by the models and the engine tests.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/tokenizer.h"

namespace rondo::test {

inline const std::vector<std::string> kAllMarkers = {
    "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "[INST]",       "[/INST]"};

// Byte-level tokenizer with single-character tokens for printable ASCII plus Ġ, Ċ, the bos token
// <|begin_of_text|>, the eos token <|end_of_text|>, and `specials` as special added tokens;
// `plain` are vocabulary entries only (not split out of text).
// Its tokenizer.json.
inline nlohmann::json tiny_tokenizer_json(const std::vector<std::string>& specials = kAllMarkers,
                                          const std::vector<std::string>& plain = {}) {
  using nlohmann::json;
  json vocab = json::object();
  int id = 0;
  for (int c = 33; c < 127; ++c)
    vocab[std::string(1, static_cast<char>(c))] = id++;
  vocab["\xC4\xA0"] = id++;  // Ġ (space)
  vocab["\xC4\x8A"] = id++;  // Ċ (newline)
  for (const std::string& s : plain)
    vocab[s] = id++;
  json added = json::array();
  std::vector<std::string> all = {"<|begin_of_text|>", "<|end_of_text|>"};
  all.insert(all.end(), specials.begin(), specials.end());
  for (const std::string& s : all) {
    added.push_back({{"id", id}, {"content", s}, {"special", true}, {"normalized", false}});
    vocab[s] = id++;
  }
  json j;
  j["added_tokens"] = added;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}}}},
                              {{"Sequence", {{"id", "A"}}}},
                              {{"SpecialToken", {{"id", "<|end_of_text|>"}}}}})}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}};
  return j;
}

inline models::Tokenizer tiny_tokenizer(const std::vector<std::string>& specials = kAllMarkers,
                                        const std::vector<std::string>& plain = {}) {
  return models::Tokenizer::from_json(tiny_tokenizer_json(specials, plain).dump(), "tiny");
}

}  // namespace rondo::test
