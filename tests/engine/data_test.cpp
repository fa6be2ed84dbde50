// JSONL training data: format detection, what each format becomes (tokens and loss mask), and
// the errors a user meets — each naming the file and the line.
#include "engine/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kernels/error.h"
#include "tests/support/tiny_tokenizer.h"

namespace rondo::engine {
namespace {

std::string write(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

std::string masked_text(const models::Tokenizer& tok, const Example& e, bool trained) {
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < e.ids.size(); ++i)
    if (e.loss_mask[i] == trained) ids.push_back(e.ids[i]);
  return tok.decode(ids);
}

std::string error_of(const std::string& path, DataOptions o = {}) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  try {
    load_jsonl(path, tok, models::chat_template_from_name("chatml"), o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Data, EachFormatIsDetectedAndMaskedAsItSays) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");

  Dataset text = load_jsonl(
      write("t.jsonl", "{\"text\": \"Hello world\"}\n\n{\"text\": \"Bye\"}\n"), tok, chatml, {});
  EXPECT_EQ(text.format, DataFormat::kText);
  ASSERT_EQ(text.examples.size(), 2u);
  std::vector<std::int32_t> want = tok.encode("Hello world");
  want.push_back(*tok.eos_id());
  EXPECT_EQ(text.examples[0].ids, want);
  EXPECT_EQ(masked_text(tok, text.examples[0], false), "");  // everything trained

  Dataset alpaca =
      load_jsonl(write("a.jsonl", R"({"instruction": "Add", "input": "2 2", "output": "Four"})"
                                  "\n"),
                 tok, chatml, {});
  EXPECT_EQ(alpaca.format, DataFormat::kAlpaca);
  const Example& a = alpaca.examples.at(0);
  EXPECT_NE(masked_text(tok, a, true).find("Four"), std::string::npos);
  EXPECT_EQ(masked_text(tok, a, true).find("Add"), std::string::npos) << "prompt trained";
  EXPECT_NE(masked_text(tok, a, false).find("Add\n\n2 2"), std::string::npos);

  Dataset chat = load_jsonl(
      write("c.jsonl",
            R"({"messages": [{"role": "system", "content": "Be brief"}, )"
            R"({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
            "\n"),
      tok, chatml, {});
  EXPECT_EQ(chat.format, DataFormat::kChat);
  EXPECT_NE(masked_text(tok, chat.examples[0], true).find("Yo"), std::string::npos);
  EXPECT_EQ(masked_text(tok, chat.examples[0], true).find("Hi"), std::string::npos);
  Dataset all = load_jsonl(chat.path, tok, chatml, {.train_on_everything = true});
  EXPECT_EQ(all.trained_tokens(), all.tokens());
  EXPECT_LT(chat.trained_tokens(), chat.tokens());

  EXPECT_NE(alpaca.stats_text().find("1 examples (alpaca)"), std::string::npos)
      << alpaca.stats_text();
}

TEST(Data, BadLinesNameTheFileAndLine) {
  const std::string bad = write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \n");
  EXPECT_NE(error_of(bad).find(bad + ":2: not valid JSON"), std::string::npos) << error_of(bad);
  const std::string missing = write(
      "missing.jsonl", "{\"instruction\": \"a\", \"output\": \"b\"}\n{\"instruction\": \"x\"}\n");
  EXPECT_NE(error_of(missing).find(missing + ":2: no 'output' field"), std::string::npos)
      << error_of(missing);
  const std::string role =
      write("role.jsonl",
            R"({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})"
            "\n");
  EXPECT_NE(error_of(role).find(role + ":1: messages[1].role is 'tool'"), std::string::npos)
      << error_of(role);
  const std::string unknown = write("unknown.jsonl", "{\"prompt\": \"a\"}\n");
  EXPECT_NE(error_of(unknown).find(unknown + ":1: no 'text', 'instruction'/'output' or 'messages'"),
            std::string::npos)
      << error_of(unknown);
  const std::string number = write("number.jsonl", "{\"text\": 7}\n");
  EXPECT_NE(error_of(number).find(":1: 'text' must be a string"), std::string::npos);
}

TEST(Data, SkippingCountsAndEmptyDataIsAnError) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");
  const std::string mixed =
      write("mixed.jsonl", "{\"text\": \"a\"}\nnot json\n{\"text\": 3}\n{\"text\": \"b\"}\n");
  Dataset d = load_jsonl(mixed, tok, chatml, {.skip_bad_lines = true});
  EXPECT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.skipped, 2);
  EXPECT_EQ(d.lines, 4);
  ASSERT_EQ(d.skipped_reasons.size(), 2u);
  EXPECT_NE(d.skipped_reasons[0].find(mixed + ":2:"), std::string::npos);
  EXPECT_NE(d.stats_text().find("2 bad lines skipped"), std::string::npos) << d.stats_text();

  const std::string empty = write("empty.jsonl", "\n  \n");
  EXPECT_NE(error_of(empty).find(empty + ": no examples (the file is empty)"), std::string::npos)
      << error_of(empty);
  const std::string all_bad = write("allbad.jsonl", "x\ny\n");
  EXPECT_NE(error_of(all_bad, {.skip_bad_lines = true}).find("no examples (2 bad lines skipped"),
            std::string::npos)
      << error_of(all_bad, {.skip_bad_lines = true});
  EXPECT_NE(error_of("/nonexistent/d.jsonl").find("/nonexistent/d.jsonl: cannot open"),
            std::string::npos);
}

// A line over data.max_line: its length when its end was read, else what was read of it; skipped
// (and counted) under skip_bad_lines, the next line read as usual.
TEST(Data, ALineOverTheLimitSaysHowLongItIs) {
  const std::string text(3000, 'a');
  const std::string line = "{\"text\": \"" + text + "\"}";  // 3012 bytes
  const std::string path = write("long.jsonl", line + "\n{\"text\": \"b\"}\n");
  const std::string e = error_of(path, {.max_line_bytes = 1024});
  EXPECT_NE(e.find(path + ":1: a line of 3012 bytes, more than 1.00 KiB (data.max_line)"),
            std::string::npos)
      << e;
  // Longer than the reader's 64 KiB buffer: left as soon as it is over the limit.
  const std::string huge = write("huge.jsonl", std::string(200000, 'x'));
  const std::string h = error_of(huge, {.max_line_bytes = 1024});
  EXPECT_NE(h.find(huge + ":1: a line of more than 1.00 KiB (data.max_line; 65536 bytes read "
                          "without finding its end)"),
            std::string::npos)
      << h;
  const models::Tokenizer tok = test::tiny_tokenizer();
  Dataset d = load_jsonl(path, tok, models::chat_template_from_name("chatml"),
                         {.skip_bad_lines = true, .max_line_bytes = 1024});
  EXPECT_EQ(d.examples.size(), 1u);
  EXPECT_EQ(d.skipped, 1);
}

}  // namespace
}  // namespace rondo::engine
