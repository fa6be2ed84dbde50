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

namespace rondo::models {
namespace {

using nlohmann::json;

// Byte-level tokenizer with single-character tokens for printable ASCII plus Ġ, Ċ, and the
// ChatML / Llama 3 special tokens.
Tokenizer tiny_tokenizer() {
  json vocab = json::object();
  int id = 0;
  for (int c = 33; c < 127; ++c)
    vocab[std::string(1, static_cast<char>(c))] = id++;
  vocab["\xC4\xA0"] = id++;  // Ġ (space)
  vocab["\xC4\x8A"] = id++;  // Ċ (newline)
  json added = json::array();
  for (const char* s : {"<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"}) {
    added.push_back({{"id", id}, {"content", s}, {"special", true}, {"normalized", false}});
    vocab[s] = id++;
  }
  json j;
  j["added_tokens"] = added;
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}};
  j["decoder"] = {{"type", "ByteLevel"}};
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", "<|begin_of_text|>"}}}},
                                                 {{"Sequence", {{"id", "A"}}}}})}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}};
  return Tokenizer::from_json(j.dump(), "tiny");
}

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

TEST(ChatTemplate, UnknownTemplatesSayHowToChoose) {
  for (const char* jinja : {"{% for m in messages %}### {{ m.content }}{% endfor %}",
                            "[INST] <<SYS>>\\n{{ system }}<</SYS>>",
                            "<|start_header_id|>system<|end_header_id|>Cutting Knowledge Date"}) {
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
