// Chat templates: a conversation rendered the way a family's Jinja `chat_template` renders it
// (ChatML/Qwen, Llama 3, Mistral [INST]), tokenized, with a loss mask that is 1 exactly on the
// tokens of assistant replies (their end-of-turn token included). Rondo does not run Jinja: it
// recognises which known template a tokenizer_config.json carries and renders that format
// natively; an unknown template is an error that says how to choose a format explicitly.
// Used by the data pipeline (chat datasets) and `rondo generate --chat`.
//
//   auto tok = models::Tokenizer::from_file(dir + "/tokenizer.json");
//   auto tmpl = models::load_chat_template(dir + "/tokenizer_config.json");
//   auto r = models::render_chat(tok, tmpl, {{"user", "Hi"}, {"assistant", "Hello!"}});
//   // r.ids: the tokens; r.loss_mask[i] == 1 for "Hello!" and the end-of-turn token
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/tokenizer.h"

namespace rondo::models {

enum class ChatFormat {
  kChatML,   // <|im_start|>role\n...<|im_end|>\n (Qwen2/2.5/3, SmolLM)
  kLlama3,   // <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> (Llama 3)
  kMistral,  // <s>[INST] ...[/INST] ...</s> (Mistral 7B Instruct)
};
const char* to_string(ChatFormat format);  // "chatml", "llama3", "mistral"

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// A recognised template: the format and the details in which the families' templates differ.
struct ChatTemplate {
  ChatFormat format = ChatFormat::kChatML;
  // ChatML: the system prompt the template inserts when the conversation has none ("" = none;
  // Qwen2.5: "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.").
  std::string default_system;
  // ChatML: Qwen3's <think> blocks (reasoning kept only on replies after the last user turn).
  bool thinking = false;
  // Mistral: v0.1 ("[INST] u [/INST]a</s>", no system role) rather than v0.3 ("[INST] u[/INST]
  // a</s>", the system prompt put before the last user message).
  bool mistral_v1 = false;
  // Llama 3.1, 3.2, 3.3: a system header always comes first, with "Cutting Knowledge Date:
  // December 2023" and "Today Date: <date>" before the system message (if any). "" = Llama 3's
  // plain headers. Rondo writes the templates' own fallback date, "26 Jul 2024", where 3.2's
  // template (in transformers) would write today's: training data must not change with the day.
  std::string llama_date;
};

// By name: "chatml", "qwen3" (ChatML with thinking), "llama3", "llama3.1" (the dated system
// header of 3.1, 3.2 and 3.3), "mistral" (v0.3), "mistral-v1".
// Throws Error listing the names.
ChatTemplate chat_template_from_name(std::string_view name);

// Recognises the Jinja source of a chat template; `source` names its file in errors. Throws
// Error naming the file and saying how to choose a format explicitly.
ChatTemplate recognise_chat_template(const std::string& jinja, const std::string& source);

// The chat_template of a tokenizer_config.json (a string, or the "default" entry of a list), or
// of a chat_template.jinja in the same folder.
ChatTemplate load_chat_template(const std::string& tokenizer_config_path);

struct RenderedChat {
  std::string text;                     // what the template renders
  std::vector<std::int32_t> ids;        // tokens of `text` (as tokenizing it whole)
  std::vector<std::uint8_t> loss_mask;  // per token: 1 = part of an assistant reply
};

// Renders, tokenizes and masks `messages`. add_generation_prompt appends the assistant header
// (for generation). Throws Error for roles the format does not support or, for Mistral, turns
// that do not alternate user/assistant, and when the tokenizer lacks a marker token of the
// format (<|im_start|>, <|start_header_id|>, [INST], ...): a format the model was not trained with.
RenderedChat render_chat(const Tokenizer& tokenizer, const ChatTemplate& tmpl,
                         const std::vector<ChatMessage>& messages,
                         bool add_generation_prompt = false);

}  // namespace rondo::models
