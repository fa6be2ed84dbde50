// Streaming generated text: a multi-byte character that arrives byte by byte (byte-fallback
// tokens) is emitted once, whole, never as U+FFFD first.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "models/generate.h"

namespace rondo::models {
namespace {

// SentencePiece-style: <unk> <s> </s>, the 256 byte tokens, "▁", "a"; decoder as Llama 2's.
Tokenizer byte_fallback_tokenizer() {
  nlohmann::json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["\xE2\x96\x81"] = 259;
  vocab["a"] = 260;
  nlohmann::json j = {
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", nullptr},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", nlohmann::json::array()},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true}}}};
  return Tokenizer::from_json(j.dump(), "test tokenizer.json");
}

std::int32_t byte(unsigned char b) {
  return 3 + b;
}

TEST(TextStreamer, AMultiByteCharacterIsEmittedWholeOnItsLastByte) {
  Tokenizer tok = byte_fallback_tokenizer();
  TextStreamer s(tok);
  std::string out;
  out += s.push(260);  // "a"
  EXPECT_EQ(out, "a");
  // 日 = E6 97 A5, then 🎉 = F0 9F 8E 89: nothing may show until each is complete.
  EXPECT_EQ(s.push(byte(0xE6)), "");
  EXPECT_EQ(s.push(byte(0x97)), "");
  EXPECT_EQ(s.push(byte(0xA5)), "\xE6\x97\xA5");
  EXPECT_EQ(s.push(byte(0xF0)), "");
  EXPECT_EQ(s.push(byte(0x9F)), "");
  EXPECT_EQ(s.push(byte(0x8E)), "");
  EXPECT_EQ(s.push(byte(0x89)), "\xF0\x9F\x8E\x89");
  EXPECT_EQ(s.push(259), " ");  // "▁" decodes to a space away from the start
  EXPECT_EQ(s.push(260), "a");
  EXPECT_EQ(s.finish(), "");
}

TEST(TextStreamer, AnIncompleteSequenceAtTheEndIsShownByFinish) {
  Tokenizer tok = byte_fallback_tokenizer();
  TextStreamer s(tok);
  EXPECT_EQ(s.push(260), "a");
  EXPECT_EQ(s.push(byte(0xE6)), "");
  // What tokenizers' decode gives for it: one U+FFFD per byte.
  EXPECT_EQ(s.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(s.ids().size(), 2u);
}

}  // namespace
}  // namespace rondo::models
