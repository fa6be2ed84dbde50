// Tokenizer units: hand-built tokenizer.json files whose ids can be worked out by hand, errors that
// name the file and the JSON path, round trips on fresh random text, concurrent encoding. The
// comparison with the `tokenizers` library itself is tests/oracle/test_tokenizer.py.
#include "models/tokenizer.h"
#include "models/unicode.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/error.h"

namespace rondo::models {
namespace {

using nlohmann::json;

// GPT-2's published byte-to-character table, written out here from its definition.
std::vector<std::string> gpt2_byte_chars() {
  std::vector<std::string> out(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    unicode::append(out[static_cast<std::size_t>(b)], keep ? static_cast<char32_t>(b) : next++);
  }
  return out;
}

// A byte-level BPE: the 256 byte characters (ids 0..255), then merges h+e, he+l, hel+l, hell+o,
// Ġ+w, Ġw+o (ids 256..261), and the special token <|end|> (262).
json byte_level_json() {
  json vocab = json::object();
  const auto chars = gpt2_byte_chars();
  for (int b = 0; b < 256; ++b)
    vocab[chars[static_cast<std::size_t>(b)]] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"he", "l"}, {"hel", "l"}, {"hell", "o"}, {"\xC4\xA0", "w"}, {"\xC4\xA0w", "o"}};
  json merge_list = json::array();
  int id = 256;
  for (auto& [a, b] : merges) {
    vocab[a + b] = id++;
    merge_list.push_back(a + " " + b);
  }
  json j;
  j["added_tokens"] = {{{"id", 262},
                        {"content", "<|end|>"},
                        {"single_word", false},
                        {"lstrip", false},
                        {"rstrip", false},
                        {"normalized", false},
                        {"special", true}}};
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}};
  return j;
}

// A SentencePiece-style BPE: <unk> <s> </s>, bytes <0x00>..<0xFF> (ids 3..258), ▁ a b ab ▁ab.
json sentencepiece_json(bool byte_fallback) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int id = 3;
  if (byte_fallback)
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      vocab[name] = id++;
    }
  for (const char* t : {"\xE2\x96\x81", "a", "b", "ab",
                        "\xE2\x96\x81"
                        "ab"})
    vocab[t] = id++;
  json j;
  j["added_tokens"] = json::array();
  for (int i = 0; i < 3; ++i)
    j["added_tokens"].push_back({{"id", i},
                                 {"content", i == 0   ? "<unk>"
                                             : i == 1 ? "<s>"
                                                      : "</s>"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}}}};
  j["pre_tokenizer"] = nullptr;
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
  j["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
        {{"type", "ByteFallback"}},
        {{"type", "Fuse"}},
        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  j["model"] = {{"type", "BPE"},        {"vocab", vocab},   {"merges", {"a b", "\xE2\x96\x81 ab"}},
                {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", byte_fallback}};
  return j;
}

std::string error_of(const json& j, const std::string& source = "dir/tokenizer.json") {
  try {
    Tokenizer::from_json(j.dump(), source);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Tokenizer, ByteLevelMergesByRank) {
  const Tokenizer t = Tokenizer::from_json(byte_level_json().dump(), "test");
  // "hello": h+e, he+l, hel+l, hell+o -> "hello" (259).
  EXPECT_EQ(t.encode("hello"), (std::vector<std::int32_t>{259}));
  // " wow": the regex keeps the space with the word: Ġw+o -> Ġwo (261), then w.
  EXPECT_EQ(t.encode(" wow"), (std::vector<std::int32_t>{261, 'w'}));
  // Special tokens are split out before anything else.
  EXPECT_EQ(t.encode("hello<|end|>hello"), (std::vector<std::int32_t>{259, 262, 259}));
  EXPECT_TRUE(t.is_special(262));
  EXPECT_FALSE(t.is_special(259));
  EXPECT_EQ(t.decode({259, 262, 261}, false), "hello<|end|> wo");
  EXPECT_EQ(t.decode({259, 262, 261}, true), "hello wo");
  EXPECT_EQ(t.vocab_size(), 263);
  EXPECT_EQ(t.token_to_id("<|end|>"), 262);
  EXPECT_EQ(t.id_to_token(256), "he");
  EXPECT_FALSE(t.id_to_token(9999).has_value());
  EXPECT_EQ(t.kind(), TokenizerKind::kByteLevelBpe);
}

TEST(Tokenizer, ByteLevelRoundTripsRandomText) {
  const Tokenizer t = Tokenizer::from_json(byte_level_json().dump(), "test");
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<char32_t> pool = {'h', 'e',  'l',    'o',     'w',    ' ',    '\n', '\t',  '1',
                                      '!', 0xE9, 0x4E16, 0x1F600, 0x0301, 0x200D, 0xA0, 0x3000};
  for (int n = 0; n < 300; ++n) {
    std::string s;
    const int len = static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i)
      unicode::append(s, pool[rng() % pool.size()]);
    const std::vector<std::int32_t> ids = t.encode(s);
    ASSERT_EQ(t.decode(ids), s) << "seed " << seed;
    // Offsets cover the text in order.
    const auto enc = t.encode_with_offsets(s);
    std::size_t prev = 0;
    for (auto [b, e] : enc.offsets) {
      ASSERT_LE(b, e);
      ASSERT_LE(e, s.size());
      ASSERT_GE(e, prev) << "seed " << seed;
      prev = e;
    }
  }
}

// encode() keeps no per-byte offsets (a long text would cost 4 bytes a byte more), only which
// leading bytes come from the input's first character; the ids are encode_with_offsets()'s, on a
// byte-level tokenizer, a SentencePiece one with a Prepend normaliser, and one with Metaspace's
// prepend_scheme "first" (which asks whether a piece starts the input), added tokens first,
// inside and last.
TEST(Tokenizer, IdsWithoutOffsetsAreTheSame) {
  json metaspace = sentencepiece_json(true);
  metaspace["normalizer"] = nullptr;
  metaspace["pre_tokenizer"] = {{"type", "Metaspace"},
                                {"replacement", "\xE2\x96\x81"},
                                {"prepend_scheme", "first"},
                                {"split", false}};
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<std::string> pool = {"a",   "b", "ab", " ",  "  ", "\xC3\xA9", "\n",
                                         "<s>", "x", "1",  "\t", "ba", "<|end|>"};
  for (const json& j : {byte_level_json(), sentencepiece_json(true), metaspace}) {
    const Tokenizer t = Tokenizer::from_json(j.dump(), "test");
    for (int n = 0; n < 400; ++n) {
      std::string s;
      const int len = static_cast<int>(rng() % 12);
      for (int i = 0; i < len; ++i)
        s += pool[rng() % pool.size()];
      for (bool special : {false, true})
        ASSERT_EQ(t.encode(s, special), t.encode_with_offsets(s, special).ids)
            << "seed " << seed << ", text '" << s << "'";
    }
  }
}

TEST(Tokenizer, SentencePieceByteFallbackAndBos) {
  const Tokenizer t = Tokenizer::from_json(sentencepiece_json(true).dump(), "test");
  const std::int32_t ab_word = *t.token_to_id(
      "\xE2\x96\x81"
      "ab");
  // "ab ab" -> ▁ab▁ab; merges a+b then ▁+ab.
  EXPECT_EQ(t.encode("ab ab"), (std::vector<std::int32_t>{ab_word, ab_word}));
  EXPECT_EQ(t.encode("ab", true), (std::vector<std::int32_t>{1, ab_word}));
  EXPECT_EQ(t.bos_id(), 1);
  // "é" is not in the vocabulary: its two UTF-8 bytes.
  const std::vector<std::int32_t> e = t.encode("\xC3\xA9");
  ASSERT_EQ(e.size(), 3u);  // ▁, <0xC3>, <0xA9>
  EXPECT_EQ(t.id_to_token(e[1]), "<0xC3>");
  EXPECT_EQ(t.id_to_token(e[2]), "<0xA9>");
  EXPECT_EQ(t.decode(e), "\xC3\xA9");
  // A lone byte that is not UTF-8 decodes to U+FFFD.
  EXPECT_EQ(t.decode({*t.token_to_id("<0xC3>")}), "\xEF\xBF\xBD");
  EXPECT_EQ(t.kind(), TokenizerKind::kSentencePieceBpe);
}

TEST(Tokenizer, SentencePieceUnknownsAreFused) {
  const Tokenizer t = Tokenizer::from_json(sentencepiece_json(false).dump(), "test");
  // "xyz" is unknown: one fused <unk> after ▁.
  EXPECT_EQ(t.encode("xyz"), (std::vector<std::int32_t>{*t.token_to_id("\xE2\x96\x81"), 0}));
}

TEST(Tokenizer, RejectsInvalidUtf8) {
  const Tokenizer t = Tokenizer::from_json(byte_level_json().dump(), "dir/tokenizer.json");
  try {
    t.encode("ok\xC3(");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8 (byte 2"), std::string::npos) << e.what();
  }
}

// A pattern that backtracks without end hits PCRE2's limit: the error names the tokenizer.json
// and the pattern, whoever called encode (training data, generate, chat).
TEST(Tokenizer, ARegexThatGivesUpNamesItsFile) {
  json j = byte_level_json();
  j["pre_tokenizer"] = {{"type", "Split"},
                        {"pattern", {{"Regex", "(a|aa)+$"}}},
                        {"behavior", "Isolated"},
                        {"invert", false}};
  const Tokenizer t = Tokenizer::from_json(j.dump(), "dir/tokenizer.json");
  try {
    t.encode(std::string(200, 'a') + "!");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("dir/tokenizer.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(a|aa)+$"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit"), std::string::npos) << msg;
  }
}

TEST(Tokenizer, EncodesConcurrently) {
  const Tokenizer t = Tokenizer::from_json(byte_level_json().dump(), "test");
  const std::string text = "hello wow hello\nhello, world! <|end|> hello";
  const std::vector<std::int32_t> want = t.encode(text);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      for (int i = 0; i < 200; ++i)
        if (t.encode(text + std::string(static_cast<std::size_t>(i % 7), ' ')).size() < want.size())
          ++bad[static_cast<std::size_t>(k)];
    });
  for (auto& th : threads)
    th.join();
  for (int b : bad)
    EXPECT_EQ(b, 0);
}

TEST(Tokenizer, ErrorsNameFileAndJsonPath) {
  json j = byte_level_json();
  j["model"]["type"] = "WordPiece";
  std::string e = error_of(j);
  EXPECT_NE(e.find("dir/tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(e.find("model.type"), std::string::npos) << e;
  EXPECT_NE(e.find("'WordPiece' is not supported (supported: BPE)"), std::string::npos) << e;

  j = byte_level_json();
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}};
  e = error_of(j);
  EXPECT_NE(e.find("normalizer.normalizers[1].type"), std::string::npos) << e;
  EXPECT_NE(e.find("Lowercase"), std::string::npos) << e;
  EXPECT_NE(e.find("supported:"), std::string::npos) << e;

  j = byte_level_json();
  j["model"]["merges"][0] = "h zz";
  e = error_of(j);
  EXPECT_NE(e.find("model.merges[0]"), std::string::npos) << e;

  j = byte_level_json();
  j["pre_tokenizer"] = {{"type", "Split"},
                        {"pattern", {{"Regex", "(unclosed"}}},
                        {"behavior", "Isolated"},
                        {"invert", false}};
  e = error_of(j);
  EXPECT_NE(e.find("pre_tokenizer.pattern"), std::string::npos) << e;
  EXPECT_NE(e.find("does not compile"), std::string::npos) << e;

  j = byte_level_json();
  j["model"]["dropout"] = 0.1;
  EXPECT_NE(error_of(j).find("model.dropout"), std::string::npos);

  j = byte_level_json();
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_NE(error_of(j).find("decoder.type"), std::string::npos);

  EXPECT_NE(error_of(json::array()).find("dir/tokenizer.json"), std::string::npos);
  try {
    Tokenizer::from_json("{not json", "x/tokenizer.json");
    FAIL();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("x/tokenizer.json: not valid JSON"), std::string::npos);
  }
  try {
    Tokenizer::from_file("/nonexistent/tokenizer.json");
    FAIL();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("/nonexistent/tokenizer.json"), std::string::npos);
  }
}

// Every id in a tokenizer.json lies below the number of vocab and added-token entries (263 here):
// a larger one is refused with the JSON path, never truncated, wrapped or used to size a table.
TEST(Tokenizer, RejectsIdsOutsideTheVocabulary) {
  auto expect_error = [](const json& j, const std::string& path, const std::string& detail) {
    const std::string e = error_of(j);
    EXPECT_NE(e.find("dir/tokenizer.json: " + path), std::string::npos) << e;
    EXPECT_NE(e.find(detail), std::string::npos) << e;
  };
  json j = byte_level_json();
  j["model"]["vocab"]["hello"] = 100000;
  expect_error(j, "model.vocab.hello", "id 100000 is outside 0..262");

  // 2^32 + 262 would truncate to the valid id 262; 2^32 - 1 would wrap to -1.
  j = byte_level_json();
  j["added_tokens"][0]["id"] = 4294967558u;
  expect_error(j, "added_tokens[0].id", "id 4294967558 is outside 0..262");
  j["added_tokens"][0]["id"] = 4294967295u;
  expect_error(j, "added_tokens[0].id", "id 4294967295 is outside 0..262");
  j["added_tokens"][0]["id"] = -1;
  expect_error(j, "added_tokens[0].id", "expected a token id");

  // Post-processor ids must be ids of tokens.
  j = sentencepiece_json(true);
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = {1, 9999};
  expect_error(j, "post_processor.special_tokens.<s>.ids[1]", "id 9999 is not the id of a token");
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = {5000000000};
  expect_error(j, "post_processor.special_tokens.<s>.ids[0]", "id 5000000000 is not the id");
  j = byte_level_json();
  j["post_processor"] = {
      {"type", "RobertaProcessing"}, {"cls", {"<|end|>", 262}}, {"sep", {"<|end|>", 263}}};
  expect_error(j, "post_processor.sep[1]", "id 263 is not the id of a token");
  j["post_processor"]["sep"] = {"<|end|>", 262};
  const Tokenizer t = Tokenizer::from_json(j.dump(), "dir/tokenizer.json");
  EXPECT_EQ(t.encode("hello", true), (std::vector<std::int32_t>{262, 259, 262}));
}

// An invalid tokenizer_config.json beside a tokenizer.json is an error naming it, as it is for
// load_chat_template, not silently ignored (which would drop its bos/eos tokens).
TEST(Tokenizer, InvalidTokenizerConfigIsAnError) {
  char dir_template[] = "/tmp/rondo_tok_cfg_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  ASSERT_NE(dir, nullptr);
  const std::string tok_path = std::string(dir) + "/tokenizer.json";
  const std::string cfg_path = std::string(dir) + "/tokenizer_config.json";
  std::ofstream(tok_path) << sentencepiece_json(true).dump();
  std::ofstream(cfg_path) << R"({"eos_token": "<s>", )";
  try {
    Tokenizer::from_file(tok_path);
    ADD_FAILURE() << "an invalid tokenizer_config.json was ignored";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(cfg_path + ": not valid JSON"), std::string::npos)
        << e.what();
  }
  std::ofstream(cfg_path) << R"(["eos_token"])";
  EXPECT_THROW(Tokenizer::from_file(tok_path), Error);
  std::ofstream(cfg_path) << R"({"eos_token": {"content": "</s>"}})";
  EXPECT_EQ(Tokenizer::from_file(tok_path).eos_id(), 2);
  std::remove(cfg_path.c_str());
  EXPECT_FALSE(Tokenizer::from_file(tok_path).eos_id().has_value());
  std::remove(tok_path.c_str());
  rmdir(dir);
}

TEST(Tokenizer, FromSpecChecksIds) {
  TokenizerSpec spec;
  spec.tokens = {"a", "b", "ab"};
  spec.merges = {{"a", "b"}};
  spec.bos_id = 7;
  try {
    Tokenizer::from_spec(spec, "model.gguf");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.gguf: bos_id"), std::string::npos) << e.what();
  }
  spec.bos_id = -1;
  const Tokenizer t = Tokenizer::from_spec(spec, "model.gguf");
  EXPECT_EQ(t.encode("abab"), (std::vector<std::int32_t>{2, 2}));
}

}  // namespace
}  // namespace rondo::models
