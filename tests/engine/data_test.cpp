// Training data (JSONL, or a JSON list): format detection, what each format becomes (tokens and
// loss mask), and the errors a user meets — each naming the file and the line.
#include "engine/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/preference_data.h"
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
    load_data(path, tok, models::chat_template_from_name("chatml"), o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Data, EachFormatIsDetectedAndMaskedAsItSays) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");

  Dataset text = load_data(write("t.jsonl", "{\"text\": \"Hello world\"}\n\n{\"text\": \"Bye\"}\n"),
                           tok, chatml, {});
  EXPECT_EQ(text.format, DataFormat::kText);
  ASSERT_EQ(text.examples.size(), 2u);
  std::vector<std::int32_t> want = tok.encode("Hello world");
  want.push_back(*tok.eos_id());
  EXPECT_EQ(text.examples[0].ids, want);
  EXPECT_EQ(masked_text(tok, text.examples[0], false), "");  // everything trained

  Dataset alpaca =
      load_data(write("a.jsonl", R"({"instruction": "Add", "input": "2 2", "output": "Four"})"
                                 "\n"),
                tok, chatml, {});
  EXPECT_EQ(alpaca.format, DataFormat::kAlpaca);
  const Example& a = alpaca.examples.at(0);
  EXPECT_NE(masked_text(tok, a, true).find("Four"), std::string::npos);
  EXPECT_EQ(masked_text(tok, a, true).find("Add"), std::string::npos) << "prompt trained";
  EXPECT_NE(masked_text(tok, a, false).find("Add\n\n2 2"), std::string::npos);

  Dataset chat = load_data(
      write("c.jsonl",
            R"({"messages": [{"role": "system", "content": "Be brief"}, )"
            R"({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
            "\n"),
      tok, chatml, {});
  EXPECT_EQ(chat.format, DataFormat::kChat);
  EXPECT_NE(masked_text(tok, chat.examples[0], true).find("Yo"), std::string::npos);
  EXPECT_EQ(masked_text(tok, chat.examples[0], true).find("Hi"), std::string::npos);
  Dataset all = load_data(chat.path, tok, chatml, {.train_on_everything = true});
  EXPECT_EQ(all.trained_tokens(), all.tokens());
  EXPECT_LT(chat.trained_tokens(), chat.tokens());

  EXPECT_NE(alpaca.stats_text().find("1 example (alpaca)"), std::string::npos)
      << alpaca.stats_text();

  // A sample prompt from the first example: its first user message (alpaca's instruction and
  // input, as the model reads them), or the start of a plain text.
  EXPECT_EQ(alpaca.first_prompt, "Add\n\n2 2");
  EXPECT_EQ(chat.first_prompt, "Hi");
  EXPECT_EQ(text.first_prompt, "Hello world");
  const std::string words =
      "Once upon a time there was a tiny model that wanted to learn a lot of "
      "things about the world and its people";
  Dataset story = load_data(write("s.jsonl", "{\"text\": \"" + words + "\"}\n"), tok, chatml, {});
  EXPECT_EQ(story.first_prompt, "Once upon a time there was a tiny model that");
  Dataset unspaced = load_data(write("u.jsonl", "{\"text\": \"" + std::string(500, 'x') + "\"}\n"),
                               tok, chatml, {});
  EXPECT_EQ(unspaced.first_prompt, std::string(160, 'x'));
}

TEST(Data, BadLinesNameTheFileAndLine) {
  const std::string bad = write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \n");
  // Where in the line and what the parser expected, in words: not nlohmann's exception name.
  EXPECT_NE(error_of(bad).find(bad + ":2: not valid JSON: at column 10: unexpected end of input"),
            std::string::npos)
      << error_of(bad);
  EXPECT_EQ(error_of(bad).find("json.exception"), std::string::npos) << error_of(bad);
  EXPECT_EQ(error_of(bad).find("syntax error while parsing"), std::string::npos) << error_of(bad);
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
  // The error lists the layouts Rondo reads, one line each.
  for (const char* needle :
       {":1: no 'text', 'instruction'/'output', 'messages' or 'conversations' field",
        "\n  text      {\"text\"", "\n  alpaca    {\"instruction\"", "\n  chat      {\"messages\"",
        "\n  sharegpt  {\"conversations\""})
    EXPECT_NE(error_of(unknown).find(needle), std::string::npos) << needle << error_of(unknown);
  const std::string number = write("number.jsonl", "{\"text\": 7}\n");
  EXPECT_NE(error_of(number).find(":1: 'text' must be a string"), std::string::npos);
}

TEST(Data, SkippingCountsAndEmptyDataIsAnError) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");
  const std::string mixed =
      write("mixed.jsonl", "{\"text\": \"a\"}\nnot json\n{\"text\": 3}\n{\"text\": \"b\"}\n");
  Dataset d = load_data(mixed, tok, chatml, {.skip_bad_lines = true});
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

// The same conversation as chat `messages`: what every other layout must give, id for id and mask
// for mask (the chat path itself is checked against transformers' apply_chat_template by
// tests/oracle/test_chat_template.py).
Example as_chat(const models::Tokenizer& tok, const std::string& system, const std::string& user,
                const std::string& assistant) {
  nlohmann::json messages = nlohmann::json::array();
  if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
  messages.push_back({{"role", "user"}, {"content", user}});
  messages.push_back({{"role", "assistant"}, {"content", assistant}});
  return load_data(write("as_chat.jsonl", nlohmann::json{{"messages", messages}}.dump() + "\n"),
                   tok, models::chat_template_from_name("chatml"), {})
      .examples.at(0);
}

void expect_same(const Example& got, const Example& want) {
  EXPECT_EQ(got.ids, want.ids);
  EXPECT_EQ(got.loss_mask, want.loss_mask);
}

// ShareGPT (`conversations` of from/value, with human/gpt/system and a top-level "system"), and a
// "system" beside alpaca's fields: each is the chat conversation it stands for.
TEST(Data, ShareGptAndSystemMessagesAreTheConversationsTheyStandFor) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");
  Dataset sg = load_data(
      write("sg.jsonl",
            R"({"conversations": [{"from": "system", "value": "Be brief"}, )"
            R"({"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]})"
            "\n"
            R"({"system": "Be kind", "conversations": [{"from": "human", "value": "Hey"}, )"
            R"({"from": "gpt", "value": "Hello"}]})"
            "\n"),
      tok, chatml, {});
  EXPECT_EQ(sg.format, DataFormat::kShareGpt);
  ASSERT_EQ(sg.examples.size(), 2u);
  expect_same(sg.examples[0], as_chat(tok, "Be brief", "Hi", "Yo"));
  expect_same(sg.examples[1], as_chat(tok, "Be kind", "Hey", "Hello"));
  EXPECT_NE(sg.stats_text().find("2 examples (sharegpt)"), std::string::npos) << sg.stats_text();

  Dataset alpaca = load_data(
      write("as.jsonl",
            R"({"system": "Be exact", "instruction": "Add", "input": "2 2", "output": "Four"})"
            "\n"),
      tok, chatml, {});
  expect_same(alpaca.examples.at(0), as_chat(tok, "Be exact", "Add\n\n2 2", "Four"));

  const std::string tool =
      write("tool.jsonl", R"({"conversations": [{"from": "tool", "value": "x"}]})"
                          "\n");
  EXPECT_NE(
      error_of(tool).find(tool + ":1: conversations[0].from is 'tool' (human, gpt or system)"),
      std::string::npos)
      << error_of(tool);
  const std::string shape = write("shape.jsonl", R"({"conversations": [{"from": "human"}]})"
                                                 "\n");
  EXPECT_NE(error_of(shape).find("conversations[0] must be {\"from\": string, \"value\": string}"),
            std::string::npos)
      << error_of(shape);
  const std::string none =
      write("none.jsonl", R"({"conversations": [{"from": "human", "value": "x"}]})"
                          "\n");
  EXPECT_NE(error_of(none).find("no assistant message"), std::string::npos) << error_of(none);
}

// A .json file holding a list of examples (what many datasets ship): the same examples as the
// JSONL file, errors named by the line the example starts on and its place in the list, a byte
// order mark skipped, and a list that breaks off refused as such.
TEST(Data, AJsonListIsReadExampleByExample) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");
  const std::string a = R"({"instruction": "Add", "output": "Four [4], {ok}"})";
  const std::string b = R"({"instruction": "Say \"]\"", "input": "x,y", "output": "]"})";
  Dataset jsonl = load_data(write("l.jsonl", a + "\n" + b + "\n"), tok, chatml, {});
  Dataset list =
      load_data(write("l.json", "\xEF\xBB\xBF[\n  " + a + ",\n  " + b + "\n]\n"), tok, chatml, {});
  EXPECT_TRUE(list.json_list);
  EXPECT_EQ(list.format, DataFormat::kAlpaca);
  ASSERT_EQ(list.examples.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i)
    expect_same(list.examples[i], jsonl.examples.at(i));
  EXPECT_NE(list.stats_text().find("2 examples (alpaca, from a JSON list)"), std::string::npos)
      << list.stats_text();
  // More white space before the '[' than one read holds: still a list, lines still counted.
  Dataset spaced = load_data(
      write("s.json", std::string(70000, ' ') + "\n\n[" + a + ",\n" + b + "]"), tok, chatml, {});
  EXPECT_TRUE(spaced.json_list);
  ASSERT_EQ(spaced.examples.size(), 2u);
  const std::string spaced_bad =
      write("sb.json", std::string(70000, ' ') + "\n\n[" + a + ",\n{\"instruction\": 3}]");
  EXPECT_NE(error_of(spaced_bad).find(spaced_bad + ":4 (example 2):"), std::string::npos)
      << error_of(spaced_bad);
  // One line, no spaces, a trailing comma.
  Dataset tight = load_data(write("t.json", "[" + a + "," + b + ",]"), tok, chatml, {});
  ASSERT_EQ(tight.examples.size(), 2u);
  expect_same(tight.examples[1], jsonl.examples[1]);

  const std::string bad = write("bad.json", "[\n" + a + ",\n\n{\"instruction\": 3}\n]");
  EXPECT_NE(error_of(bad).find(bad + ":4 (example 2): 'instruction' must be a string"),
            std::string::npos)
      << error_of(bad);
  Dataset skipped = load_data(bad, tok, chatml, {.skip_bad_lines = true});
  EXPECT_EQ(skipped.examples.size(), 1u);
  EXPECT_NE(skipped.stats_text().find("1 bad example skipped"), std::string::npos)
      << skipped.stats_text();
  for (const auto& [text, what] : std::vector<std::pair<std::string, std::string>>{
           {"[" + a + ",\n" + b, ":2: the file ends inside the JSON list (no closing ']')"},
           {"[" + a + ", {\"instruction\": \"cut", ":1: the file ends inside example 2"},
           {"[" + a + "\n" + b + "]", ":2: expected ',' or ']' after example 1, found '{'"},
           {"[\"a\" " + a + "]", ":1: expected ',' or ']' after example 1, found '{'"},
           {"[7\n" + a + "]", ":2: expected ',' or ']' after example 1, found '{'"},
           {"[" + a + "] x", ":1: more after the JSON list's closing ']'"},
           {"[]", ": no examples (the list is empty)"},
           {"[" + a + ", 7]", ":1 (example 2): not a JSON object"}}) {
    const std::string path = write("broken.json", text);
    EXPECT_NE(error_of(path, {.skip_bad_lines = what.find("example 2)") == std::string::npos})
                  .find(path + what),
              std::string::npos)
        << text << "\n"
        << error_of(path);
  }
  // data.max_line bounds one example of a list too; skipped, the next one is read.
  const std::string big = "{\"text\": \"" + std::string(3000, 'a') + "\"}";
  const std::string longer = write("long.json", "[" + big + ", {\"text\": \"b\"}]");
  EXPECT_NE(error_of(longer, {.max_line_bytes = 1024})
                .find(longer + ":1 (example 1): an example of more than 1.00 KiB"),
            std::string::npos)
      << error_of(longer, {.max_line_bytes = 1024});
  Dataset rest = load_data(longer, tok, chatml, {.skip_bad_lines = true, .max_line_bytes = 1024});
  EXPECT_EQ(rest.examples.size(), 1u);
  EXPECT_EQ(rest.skipped, 1);
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
  Dataset d = load_data(path, tok, models::chat_template_from_name("chatml"),
                        {.skip_bad_lines = true, .max_line_bytes = 1024});
  EXPECT_EQ(d.examples.size(), 1u);
  EXPECT_EQ(d.skipped, 1);
}

}  // namespace
}  // namespace rondo::engine

namespace rondo::engine {
namespace {

// Preference pairs: the implicit prompt is the common start (a space before the divergence goes
// to the answers, as TRL's extract_prompt), the answers alone are scored, ORPO's NLL covers the
// chosen sequence whole, and the errors name the file, the line and what is wrong.
TEST(Data, PreferencePairsSplitTheirPromptAndScoreTheAnswers) {
  const models::Tokenizer tok = test::tiny_tokenizer();
  const auto chatml = models::chat_template_from_name("chatml");
  const std::string path = write("p.jsonl", R"({"chosen": "Sky is blue", "rejected": "Sky is red"})"
                                            "\n");
  for (Objective o : {Objective::kDpo, Objective::kOrpo, Objective::kSimpo}) {
    Dataset d = load_data(path, tok, chatml, {.objective = o, .max_length = 64});
    EXPECT_EQ(d.format, DataFormat::kPreference);
    ASSERT_EQ(d.examples.size(), 1u);
    const Example& e = d.examples[0];
    ASSERT_GT(e.second, 0);
    std::vector<std::int32_t> chosen, rejected, nll;
    for (std::size_t i = 0; i < e.ids.size(); ++i) {
      if (e.loss_mask[i] & kAnswerToken)
        (static_cast<std::int32_t>(i) < e.second ? chosen : rejected).push_back(e.ids[i]);
      if (e.loss_mask[i] & kNllToken) nll.push_back(e.ids[i]);
    }
    // " blue" / " red": the space before them belongs to the answers; the tiny tokenizer has an
    // EOS, which every objective ends string answers with.
    EXPECT_EQ(tok.decode(chosen, true), " blue") << to_string(o);
    EXPECT_EQ(tok.decode(rejected, true), " red") << to_string(o);
    const std::vector<std::int32_t> first(e.ids.begin(), e.ids.begin() + e.second);
    if (o == Objective::kOrpo) {
      EXPECT_EQ(nll, first);  // prompt and answer
    }
    if (o == Objective::kDpo) {
      EXPECT_TRUE(nll.empty());
    }
  }
  EXPECT_NE(error_of(path).find("p.jsonl:1: a preference pair"), std::string::npos)
      << error_of(path);
  const std::string sft = write("s.jsonl", R"({"text": "hi"})"
                                           "\n");
  EXPECT_NE(error_of(sft, {.objective = Objective::kDpo}).find("s.jsonl:1: not a preference pair"),
            std::string::npos);
  const std::string bad = write("b.jsonl", R"({"prompt": "Q", "chosen": 3, "rejected": "x"})"
                                           "\n");
  EXPECT_NE(error_of(bad, {.objective = Objective::kOrpo})
                .find("b.jsonl:1: 'chosen' must be a string or a list of messages"),
            std::string::npos)
      << error_of(bad, {.objective = Objective::kOrpo});

  // TRL's edge: answers that differ from their first character, the chosen one ending in a space
  // (Python's chosen[-1]), split each before its own last character.
  const std::string edge = write("edge.jsonl", R"({"chosen": "Ax ", "rejected": "Bcd"})"
                                               "\n");
  {
    const Example e =
        load_data(edge, tok, chatml, {.objective = Objective::kDpo, .max_length = 64}).examples[0];
    std::vector<std::int32_t> rejected;
    for (std::size_t i = static_cast<std::size_t>(e.second); i < e.ids.size(); ++i)
      if (e.loss_mask[i] & kAnswerToken) rejected.push_back(e.ids[i]);
    EXPECT_EQ(tok.decode(rejected, true), "d");  // prompt "Ax", rejected "Bcd"[-1:]
  }
  // A record with a chat and a pair (UltraFeedback's layout) is a chat to supervised training and
  // a pair to a preference objective.
  const std::string both = write(
      "both.jsonl",
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],)"
      R"( "chosen": "Sky is blue", "rejected": "Sky is red"})"
      "\n");
  EXPECT_EQ(load_data(both, tok, chatml, {}).format, DataFormat::kChat);
  EXPECT_EQ(load_data(both, tok, chatml, {.objective = Objective::kDpo, .max_length = 64}).format,
            DataFormat::kPreference);
  // A supervised format set for a preference objective is named as the cause.
  const std::string chat_set =
      error_of(both, {.format = DataFormat::kChat, .objective = Objective::kDpo});
  EXPECT_NE(chat_set.find("data.format is chat: training.objective dpo trains on preference pairs"),
            std::string::npos)
      << chat_set;
  // Every prompt filling max_length: the pairs are dropped, and the error says why.
  const std::string dropped = error_of(path, {.objective = Objective::kDpo, .max_length = 2});
  EXPECT_NE(dropped.find("p.jsonl: every pair was dropped (1): each prompt fills "
                         "preference.max_length (2 tokens"),
            std::string::npos)
      << dropped;
}

}  // namespace
}  // namespace rondo::engine
