// Chat template units: recognition of the families' templates, the errors for unknown ones, and
// masks that cover exactly the replies (checked by decoding the masked tokens). The comparison
// with transformers is tests/oracle/test_chat_template.py.
#include "models/chat_template.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "kernels/error.h"
#include "tests/support/tiny_tokenizer.h"

namespace rondo::models {
namespace {

using nlohmann::json;

using test::kAllMarkers;
using test::tiny_tokenizer;

std::string masked_text(const Tokenizer& tok, const RenderedChat& r) {
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i < r.ids.size(); ++i)
    if (r.loss_mask[i]) ids.push_back(r.ids[i]);
  return tok.decode(ids);
}

TEST(ChatTemplate, RecognisesTheFamilies) {
  ChatTemplate t = recognise_chat_template(
      "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by "
      "Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
      "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
      "'<|im_end|>\\n'}}{% endfor %}",
      "qwen/tokenizer_config.json");
  EXPECT_EQ(t.format, ChatFormat::kChatML);
  EXPECT_EQ(t.default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_FALSE(t.thinking);
  t = recognise_chat_template("{{ '<|im_start|>' + m.role + '\\n<think>\\n' }}", "x");
  EXPECT_TRUE(t.thinking);
  EXPECT_EQ(t.default_system, "");
  EXPECT_EQ(recognise_chat_template("{{ '<|start_header_id|>' }}", "x").format,
            ChatFormat::kLlama3);
  t = recognise_chat_template("{{ '[INST] ' + message['content'] + ' [/INST]' }}", "x");
  EXPECT_EQ(t.format, ChatFormat::kMistral);
  EXPECT_TRUE(t.mistral_v1);
  t = recognise_chat_template("{{- \"[INST] \" + message[\"content\"] + \"[/INST]\" }}", "x");
  EXPECT_FALSE(t.mistral_v1);
}

TEST(ChatTemplate, DefaultSystemPrompts) {
  // 200 000 characters: std::regex recursed once per character here and overflowed the stack.
  std::string prompt;
  for (int i = 0; i < 20000; ++i)
    prompt += "Be helpful";
  ChatTemplate t =
      recognise_chat_template("{{ '<|im_start|>system\\n" + prompt + "<|im_end|>\\n' }}", "x");
  EXPECT_EQ(t.default_system, prompt);
  // The first "<|im_start|>system" is followed by an expression (a quote or '+' before
  // <|im_end|>), the second by a literal with a real newline.
  t = recognise_chat_template(
      "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>' }}"
      "{{ '<|im_start|>system\nBe brief.\\tOK<|im_end|>' }}",
      "x");
  EXPECT_EQ(t.default_system, "Be brief.\tOK");
  for (const char* none : {"<|im_start|>system\\nno end in sight", "<|im_start|>systemX<|im_end|>",
                           "<|im_start|>system\\n{{ x }}<|im_end|>", "<|im_start|>system"}) {
    t = recognise_chat_template(none, "x");
    EXPECT_EQ(t.default_system, "") << none;
  }
}

// An explicit format on a tokenizer without its marker tokens would render the markers as plain
// text, which the model never saw: an error naming the tokenizer and the marker.
TEST(ChatTemplate, AFormatNeedsItsMarkerTokens) {
  const std::vector<ChatMessage> conv = {{"user", "Hi"}, {"assistant", "Hello"}};
  auto error = [&](const Tokenizer& tok, const char* format) {
    try {
      render_chat(tok, chat_template_from_name(format), conv);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const Tokenizer llama3 =
      tiny_tokenizer({"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
  std::string msg = error(llama3, "chatml");
  EXPECT_NE(msg.find("tiny: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("'chatml' needs <|im_start|> as a token"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not have it"), std::string::npos) << msg;
  EXPECT_NE(msg.find("use its own"), std::string::npos) << msg;
  EXPECT_NE(error(llama3, "mistral").find("needs [INST] as a token"), std::string::npos);
  EXPECT_EQ(error(llama3, "llama3"), "(no error)");

  const Tokenizer chatml = tiny_tokenizer({"<|im_start|>", "<|im_end|>"});
  EXPECT_NE(error(chatml, "llama3").find("needs <|start_header_id|> as a token"),
            std::string::npos);
  EXPECT_EQ(error(chatml, "chatml"), "(no error)");
  EXPECT_EQ(error(chatml, "qwen3"), "(no error)");
  // Mistral v0.1's own tokenizer has no [INST] token: its markers are text.
  EXPECT_EQ(error(chatml, "mistral-v1"), "(no error)");

  // In the vocabulary, but tokenized like text.
  const Tokenizer plain = tiny_tokenizer({"<|im_end|>"}, {"<|im_start|>"});
  msg = error(plain, "chatml");
  EXPECT_NE(msg.find("<|im_start|> as a token, and this tokenizer does not split it out of text"),
            std::string::npos)
      << msg;
}

TEST(ChatTemplate, UnknownTemplatesSayHowToChoose) {
  for (const char* jinja : {"{% for m in messages %}### {{ m.content }}{% endfor %}",
                            "[INST] <<SYS>>\\n{{ system }}<</SYS>>"}) {
    try {
      recognise_chat_template(jinja, "model/tokenizer_config.json");
      FAIL() << jinja;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("model/tokenizer_config.json"), std::string::npos) << msg;
      EXPECT_NE(msg.find("--chat-format chatml|"), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(chat_template_from_name("vicuna"), Error);
  EXPECT_EQ(chat_template_from_name("llama3").format, ChatFormat::kLlama3);
  // Llama 3.1/3.2/3.3's dated header is rendered (tests/oracle/test_chat_template.py).
  const ChatTemplate dated = recognise_chat_template(
      "<|start_header_id|>system<|end_header_id|>Cutting Knowledge Date", "x");
  EXPECT_EQ(dated.format, ChatFormat::kLlama3);
  EXPECT_EQ(dated.llama_date, "26 Jul 2024");
  EXPECT_EQ(chat_template_from_name("llama3.1").llama_date, "26 Jul 2024");
}

TEST(ChatTemplate, LoadsFromTokenizerConfigOrItsAbsence) {
  char dir[] = "/tmp/rondo_chat_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string cfg = std::string(dir) + "/tokenizer_config.json";
  std::ofstream(cfg) << json{{"chat_template",
                              json::array(
                                  {{{"name", "default"}, {"template", "<|start_header_id|>"}}})}}
                            .dump();
  EXPECT_EQ(load_chat_template(cfg).format, ChatFormat::kLlama3);
  std::ofstream(cfg) << "{}";
  try {
    load_chat_template(cfg);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no chat_template"), std::string::npos) << e.what();
  }
  std::ofstream(std::string(dir) + "/chat_template.jinja") << "{{ '[INST] ' + x + '[/INST]' }}";
  EXPECT_EQ(load_chat_template(cfg).format, ChatFormat::kMistral);
  std::remove((std::string(dir) + "/chat_template.jinja").c_str());
  std::remove(cfg.c_str());
  rmdir(dir);
}

TEST(ChatTemplate, MaskCoversExactlyTheReplies) {
  const Tokenizer tok = tiny_tokenizer();
  const std::vector<ChatMessage> conv = {{"system", "Be kind."},
                                         {"user", "Hi!"},
                                         {"assistant", "Hello, friend."},
                                         {"user", "Bye"},
                                         {"assistant", "See you."}};
  ChatTemplate chatml = chat_template_from_name("chatml");
  RenderedChat r = render_chat(tok, chatml, conv);
  ASSERT_EQ(r.ids.size(), r.loss_mask.size());
  EXPECT_EQ(masked_text(tok, r), "Hello, friend.<|im_end|>See you.<|im_end|>");
  EXPECT_EQ(tok.decode(r.ids), r.text);

  RenderedChat g = render_chat(tok, chatml, {{"user", "Hi!"}}, true);
  EXPECT_EQ(g.text, "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(masked_text(tok, g), "");

  RenderedChat l = render_chat(tok, chat_template_from_name("llama3"),
                               {{"user", "  Hi!  "}, {"assistant", "\n Hello. \n"}});
  EXPECT_EQ(l.text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>");
  EXPECT_EQ(masked_text(tok, l), "Hello.<|eot_id|>");
}

TEST(ChatTemplate, RejectsUnsupportedRolesAndMistralOrder) {
  const Tokenizer tok = tiny_tokenizer();
  // Invalid UTF-8 is refused even where Llama 3's trim would cut it off ("\xC9" alone would read
  // as a tab).
  for (const char* content : {"Hi \xC9", "\xC9", "ok\xE2\x82"}) {
    try {
      render_chat(tok, chat_template_from_name("llama3"), {{"user", "a"}, {"assistant", content}});
      ADD_FAILURE() << "invalid UTF-8 was rendered";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("chat message 1: content is not valid UTF-8"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(render_chat(tok, chat_template_from_name("chatml"), {{"tool", "x"}}), Error);
  EXPECT_THROW(render_chat(tok, chat_template_from_name("chatml"), {}), Error);
  try {
    render_chat(tok, chat_template_from_name("mistral"), {{"user", "a"}, {"user", "b"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alternate"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rondo::models
