#include "models/chat_template.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "kernels/error.h"
#include "models/mapped_file.h"
#include "models/tokenizer_config.h"
#include "models/unicode.h"

namespace rondo::models {
namespace {

constexpr const char* kChooseFormat =
    "choose a format explicitly with --chat-format chatml|qwen3|llama3|llama3.1|mistral|mistral-v1";
// The date Llama 3.1/3.2/3.3's templates write when they are given none.
constexpr const char* kLlamaDate = "26 Jul 2024";

bool contains(const std::string& s, std::string_view needle) {
  return s.find(needle) != std::string::npos;
}

// Jinja string-literal escapes (\n, \t, \', \", \\) to the characters they stand for.
std::string unescape(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char n = s[++i];
      out += n == 'n' ? '\n' : n == 't' ? '\t' : n == 'r' ? '\r' : n;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Python str.strip() without arguments (Unicode whitespace), as Jinja's `trim` filter.
std::string py_strip(const std::string& s) {
  const auto [b, e] = unicode::strip(s, 0, s.size(), true, true, unicode::python_space);
  return s.substr(b, e - b);
}

// Python str.strip('\n') and friends.
std::string strip_newlines(const std::string& s, bool left, bool right) {
  std::size_t b = 0, e = s.size();
  if (left)
    while (b < e && s[b] == '\n')
      ++b;
  if (right)
    while (e > b && s[e - 1] == '\n')
      --e;
  return s.substr(b, e - b);
}

// A system prompt written out in full, e.g. '<|im_start|>system\nYou are Qwen, ...<|im_end|>':
// the text after the first "<|im_start|>system" + newline (escaped or not) that reaches the next
// <|im_end|> without a quote, '+' or brace (which would make it an expression, not a literal).
// A find loop rather than std::regex: libstdc++'s regex recurses per character and overflows the
// stack on a long template.
std::optional<std::string> written_default_system(const std::string& jinja) {
  constexpr std::string_view kOpen = "<|im_start|>system", kClose = "<|im_end|>";
  for (std::size_t at = jinja.find(kOpen); at != std::string::npos;
       at = jinja.find(kOpen, at + 1)) {
    std::size_t b = at + kOpen.size();
    if (jinja.compare(b, 2, "\\n") == 0)
      b += 2;
    else if (jinja.compare(b, 1, "\n") == 0)
      b += 1;
    else
      continue;
    const std::size_t e = jinja.find(kClose, b);
    if (e == std::string::npos) return std::nullopt;  // no later start can reach one either
    const std::size_t expr = jinja.find_first_of("'\"+{}", b);
    if (expr == std::string::npos || expr > e) return jinja.substr(b, e - b);
  }
  return std::nullopt;
}

// Text with the byte ranges that belong to assistant replies.
struct Builder {
  std::string text;
  std::vector<std::pair<std::size_t, std::size_t>> assistant;
  void add(std::string_view s) { text += s; }
  void reply(std::string_view s) {
    assistant.emplace_back(text.size(), text.size() + s.size());
    text += s;
  }
};

// Before any rendering: Jinja's trim (py_strip) would cut an invalid byte at either end out of
// sight of the tokenizer's UTF-8 check.
void check_message(const ChatMessage& m, std::size_t i) {
  if (m.role != "system" && m.role != "user" && m.role != "assistant")
    throw Error("chat message " + std::to_string(i) + ": role '" + m.role +
                "' is not supported (supported: system, user, assistant)");
  const std::size_t bad = unicode::find_invalid(m.content);
  if (bad != std::string::npos)
    throw Error("chat message " + std::to_string(i) + ": content is not valid UTF-8 (byte " +
                std::to_string(bad) + " of " + std::to_string(m.content.size()) + ")");
}

std::string token_text(const Tokenizer& tok, std::optional<std::int32_t> id, const char* what) {
  if (!id)
    throw Error(tok.source() + ": the chat template needs the " + std::string(what) +
                " token, and the tokenizer has none (set " + what +
                "_token in tokenizer_config.json)");
  std::optional<std::string> text = tok.id_to_token(*id);
  if (!text)
    throw Error(tok.source() + ": the " + std::string(what) + " token id " + std::to_string(*id) +
                " is not a token of the tokenizer (set " + what +
                "_token in tokenizer_config.json to one of its tokens)");
  return *text;
}

// The marker tokens a format writes into the text. A tokenizer must have each as one token, or
// the markers would be tokenized as plain text and the model would never see its turn structure.
// Mistral v0.1 writes [INST] as plain text in its own model, so only its bos/eos are needed.
std::vector<std::string_view> markers(const ChatTemplate& t) {
  switch (t.format) {
    case ChatFormat::kChatML:
      return {"<|im_start|>", "<|im_end|>"};
    case ChatFormat::kLlama3:
      return {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case ChatFormat::kMistral:
      if (t.mistral_v1) return {};
      return {"[INST]", "[/INST]"};
  }
  return {};
}

void check_markers(const Tokenizer& tok, const ChatTemplate& t) {
  for (std::string_view marker : markers(t)) {
    const std::optional<std::int32_t> id = tok.token_to_id(marker);
    if (id && tok.encode(marker) == std::vector<std::int32_t>{*id}) continue;
    throw Error(tok.source() + ": chat format '" + to_string(t.format) + "' needs " +
                std::string(marker) + " as a token, and this tokenizer " +
                (id ? "does not split it out of text" : "does not have it") +
                ": the format's markers would be rendered as plain text. The model was not "
                "trained with this format; use its own (leave --chat-format unset to take it "
                "from the model's chat template)");
  }
}

void render_chatml(const ChatTemplate& t, const std::vector<ChatMessage>& ms, Builder& b) {
  std::size_t first = 0;
  if (ms[0].role == "system") {
    b.add("<|im_start|>system\n" + ms[0].content + "<|im_end|>\n");
    first = 1;
  } else if (!t.default_system.empty()) {
    b.add("<|im_start|>system\n" + t.default_system + "<|im_end|>\n");
  }
  // Qwen3: the last user turn; replies after it keep their reasoning.
  std::size_t last_query = ms.size() - 1;
  for (std::size_t i = ms.size(); i-- > 0;)
    if (ms[i].role == "user" &&
        !(ms[i].content.rfind("<tool_response>", 0) == 0 && ms[i].content.size() >= 16 &&
          ms[i].content.compare(ms[i].content.size() - 16, 16, "</tool_response>") == 0)) {
      last_query = i;
      break;
    }
  for (std::size_t i = first; i < ms.size(); ++i) {
    const ChatMessage& m = ms[i];
    if (m.role != "assistant") {
      b.add("<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n");
      continue;
    }
    b.add("<|im_start|>assistant\n");
    std::string content = m.content;
    if (t.thinking) {
      std::string reasoning;
      const std::size_t close = content.find("</think>");
      if (close != std::string::npos) {
        std::string before = strip_newlines(content.substr(0, close), false, true);
        const std::size_t open = before.rfind("<think>");
        if (open != std::string::npos) before = before.substr(open + 7);
        reasoning = strip_newlines(before, true, false);
        content = strip_newlines(content.substr(content.rfind("</think>") + 8), true, false);
      }
      if (i > last_query && (i + 1 == ms.size() || !reasoning.empty()))
        content = "<think>\n" + strip_newlines(reasoning, true, true) + "\n</think>\n\n" +
                  strip_newlines(content, true, false);
    }
    b.reply(content + "<|im_end|>");
    b.add("\n");
  }
}

void render_llama3(const Tokenizer& tok, const ChatTemplate& t, const std::vector<ChatMessage>& ms,
                   Builder& b) {
  b.add(token_text(tok, tok.bos_id(), "bos"));
  std::size_t first = 0;
  if (!t.llama_date.empty()) {
    // 3.1/3.2/3.3: the system header comes first whether or not there is a system message.
    std::string system;
    if (ms[0].role == "system") {
      system = py_strip(ms[0].content);
      first = 1;
    }
    b.add(
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
        "2023\nToday Date: " +
        t.llama_date + "\n\n" + system + "<|eot_id|>");
  }
  for (std::size_t i = first; i < ms.size(); ++i) {
    const ChatMessage& m = ms[i];
    b.add("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
    if (m.role == "assistant")
      b.reply(py_strip(m.content) + "<|eot_id|>");
    else
      b.add(py_strip(m.content) + "<|eot_id|>");
  }
}

void render_mistral(const Tokenizer& tok, const ChatTemplate& t, const std::vector<ChatMessage>& ms,
                    Builder& b) {
  std::size_t first = 0;
  std::optional<std::string> system;
  if (ms[0].role == "system") {
    if (t.mistral_v1)
      throw Error("chat: the Mistral v0.1 template supports only user and assistant roles");
    system = ms[0].content;
    first = 1;
  }
  for (std::size_t i = first; i < ms.size(); ++i) {
    if ((ms[i].role == "user") != ((i - first) % 2 == 0) || ms[i].role == "system")
      throw Error("chat message " + std::to_string(i) +
                  ": the Mistral template needs roles that alternate user/assistant/user/... "
                  "after an optional system message (got '" +
                  ms[i].role + "')");
  }
  const std::string eos = token_text(tok, tok.eos_id(), "eos");
  b.add(token_text(tok, tok.bos_id(), "bos"));
  for (std::size_t i = first; i < ms.size(); ++i) {
    const ChatMessage& m = ms[i];
    const bool last = i + 1 == ms.size();
    if (m.role == "user") {
      if (t.mistral_v1)
        b.add("[INST] " + m.content + " [/INST]");
      else if (last && system)
        b.add("[INST] " + *system + "\n\n" + m.content + "[/INST]");
      else
        b.add("[INST] " + m.content + "[/INST]");
    } else {
      b.reply(t.mistral_v1 ? m.content + eos : " " + py_strip(m.content) + eos);
    }
  }
}

}  // namespace

const char* to_string(ChatFormat format) {
  switch (format) {
    case ChatFormat::kChatML:
      return "chatml";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kMistral:
      return "mistral";
  }
  return "?";
}

ChatTemplate chat_template_from_name(std::string_view name) {
  ChatTemplate t;
  if (name == "chatml") {
    t.format = ChatFormat::kChatML;
  } else if (name == "qwen3") {
    t.format = ChatFormat::kChatML;
    t.thinking = true;
  } else if (name == "llama3") {
    t.format = ChatFormat::kLlama3;
  } else if (name == "llama3.1") {
    t.format = ChatFormat::kLlama3;
    t.llama_date = kLlamaDate;
  } else if (name == "mistral") {
    t.format = ChatFormat::kMistral;
  } else if (name == "mistral-v1") {
    t.format = ChatFormat::kMistral;
    t.mistral_v1 = true;
  } else {
    throw Error("chat format '" + std::string(name) +
                "' is not known (known: chatml, qwen3, llama3, llama3.1, mistral, mistral-v1)");
  }
  return t;
}

ChatTemplate recognise_chat_template(const std::string& jinja, const std::string& source) {
  auto unknown = [&](const std::string& why) {
    return Error(source + ": chat template not recognised (" + why + "); " + kChooseFormat);
  };
  ChatTemplate t;
  if (contains(jinja, "<|im_start|>")) {
    t.format = ChatFormat::kChatML;
    t.thinking = contains(jinja, "<think>");
    if (auto text = written_default_system(jinja)) t.default_system = unescape(*text);
    return t;
  }
  if (contains(jinja, "<|start_header_id|>")) {
    t.format = ChatFormat::kLlama3;
    if (contains(jinja, "Cutting Knowledge Date")) t.llama_date = kLlamaDate;
    return t;
  }
  if (contains(jinja, "[INST]")) {
    if (contains(jinja, "<<SYS>>"))
      throw unknown("a Llama 2 template, which Rondo does not render");
    t.format = ChatFormat::kMistral;
    if (contains(jinja, "' [/INST]'") || contains(jinja, "\" [/INST]\"")) {
      t.mistral_v1 = true;
    } else if (!contains(jinja, "\"[/INST]\"") && !contains(jinja, "'[/INST]'")) {
      throw unknown("an [INST] template of a Mistral version Rondo does not know");
    }
    return t;
  }
  throw unknown("no <|im_start|>, <|start_header_id|> or [INST] marker");
}

ChatTemplate load_chat_template(const std::string& tokenizer_config_path) {
  using nlohmann::json;
  const json cfg = read_tokenizer_config(tokenizer_config_path);
  if (cfg.contains("chat_template")) {
    const json& ct = cfg.at("chat_template");
    if (ct.is_string())
      return recognise_chat_template(ct.get<std::string>(), tokenizer_config_path);
    if (ct.is_array())
      for (const json& entry : ct)
        if (entry.is_object() && entry.value("name", "") == "default" &&
            entry.contains("template") && entry.at("template").is_string())
          return recognise_chat_template(entry.at("template").get<std::string>(),
                                         tokenizer_config_path + " (chat_template 'default')");
    throw Error(tokenizer_config_path +
                ": chat_template must be a string or a list with a 'default' entry; " +
                kChooseFormat);
  }
  const std::size_t slash = tokenizer_config_path.find_last_of('/');
  const std::string jinja_path =
      (slash == std::string::npos ? std::string() : tokenizer_config_path.substr(0, slash + 1)) +
      "chat_template.jinja";
  std::error_code ec;
  if (std::filesystem::exists(jinja_path, ec))
    return recognise_chat_template(read_text_file(jinja_path, "chat template"), jinja_path);
  throw Error(tokenizer_config_path +
              ": no chat_template (and no chat_template.jinja beside it); " + kChooseFormat);
}

RenderedChat render_chat(const Tokenizer& tokenizer, const ChatTemplate& tmpl,
                         const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  if (messages.empty()) throw Error("chat: a conversation needs at least one message");
  for (std::size_t i = 0; i < messages.size(); ++i)
    check_message(messages[i], i);
  check_markers(tokenizer, tmpl);  // before the bos/eos checks: a wrong format explains those too
  Builder b;
  switch (tmpl.format) {
    case ChatFormat::kChatML:
      render_chatml(tmpl, messages, b);
      if (add_generation_prompt) b.add("<|im_start|>assistant\n");
      break;
    case ChatFormat::kLlama3:
      render_llama3(tokenizer, tmpl, messages, b);
      if (add_generation_prompt) b.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatFormat::kMistral:
      // The prompt already ends with [/INST]: the reply follows directly.
      render_mistral(tokenizer, tmpl, messages, b);
      break;
  }
  RenderedChat r;
  const Tokenizer::Encoding enc = tokenizer.encode_with_offsets(b.text, false);
  r.ids = enc.ids;
  r.loss_mask.resize(enc.ids.size(), 0);
  // A token is in the loss when it overlaps a reply (see Note [Byte offsets] in tokenizer.cpp):
  // the same rule as transformers' assistant masks.
  std::size_t k = 0;
  for (std::size_t i = 0; i < enc.ids.size(); ++i) {
    const auto [tb, te] = enc.offsets[i];
    if (te <= tb) continue;
    while (k < b.assistant.size() && b.assistant[k].second <= tb)
      ++k;
    if (k < b.assistant.size() && b.assistant[k].first < te) r.loss_mask[i] = 1;
  }
  r.text = std::move(b.text);
  return r;
}

}  // namespace rondo::models
