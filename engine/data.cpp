#include "engine/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "engine/preference_data.h"
#include "kernels/error.h"

namespace rondo::engine {
namespace {

// nlohmann's parse error in a reader's words: "[json.exception.parse_error.101] parse error at
// line 1, column 13: syntax error while parsing object - unexpected end of input; expected '}'"
// becomes "at column 13: unexpected end of input; expected '}'" (a JSONL example is one line).
std::string plain_json_error(std::string what) {
  if (what.starts_with("[json.exception.")) what.erase(0, what.find("] ") + 2);
  if (what.starts_with("parse error ")) what.erase(0, 12);
  if (what.starts_with("at line 1, column")) what.erase(3, 8);
  if (const std::size_t syntax = what.find("syntax error while parsing ");
      syntax != std::string::npos) {
    const std::size_t dash = what.find(" - ", syntax);
    if (dash != std::string::npos) what.erase(syntax, dash + 3 - syntax);
  }
  return what;
}

using nlohmann::json;

// The examples of a data file, each at most `max` bytes held, one at a time: the lines of a JSONL
// file, or the elements of a file holding one JSON array ("[{...}, {...}]", told by its first
// character). A longer example is reported (too_long) and its bytes are read past without being
// kept, so a file of one endless line (/dev/zero) costs `max` bytes. A UTF-8 byte order mark at
// the start is skipped.
class ExampleReader {
 public:
  ExampleReader(const std::string& path, std::uint64_t max) : path_(path), max_(max) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw Error(path + ": cannot open the data file: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw Error(path + ": cannot read the data file: " + std::strerror(err));
    }
    const char* kind = S_ISDIR(st.st_mode)                          ? "a folder"
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                       : S_ISSOCK(st.st_mode)                       ? "a socket"
                                                                    : nullptr;
    if (kind != nullptr) {
      ::close(fd_);
      throw Error(path + " is " + kind +
                  ", not a data file; give a JSONL file (one example per line) or a JSON file "
                  "holding a list of examples");
    }
    try {
      fill();
      if (end_ >= 3 && std::memcmp(buf_.data(), "\xEF\xBB\xBF", 3) == 0) pos_ = 3;
      // A JSON array: its first character, after white space, is '['. White space read past to
      // find it (more than a block of it, or a pipe's short reads) is consumed, its lines counted.
      std::int64_t newlines = 0;
      for (bool found = false; !found;) {
        for (; pos_ < end_; ++pos_) {
          const char c = buf_[pos_];
          if (c == '\n') ++newlines;
          if (c != ' ' && c != '\t' && c != '\r' && c != '\n') {
            array_ = c == '[';
            found = true;
            break;
          }
        }
        if (!found && (eof_ || !fill())) break;
      }
      line_ = array_ ? 1 + newlines : newlines;
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  ~ExampleReader() { ::close(fd_); }
  ExampleReader(const ExampleReader&) = delete;
  ExampleReader& operator=(const ExampleReader&) = delete;

  bool array() const { return array_; }
  // Whether the last example's end was read (false: a too-long one left at once, its length so
  // far).
  bool ended() const { return ended_; }

  // The next example's text into `text` (a JSONL line without its '\n'), the line it starts on
  // into `line`; false at the end. `too_long` says it was longer than the limit (then `text` is
  // empty and `length` is what was read of it): with `read_past` the rest of it is read and
  // dropped, else next() returns at once (the caller stops; an endless line is never read to its
  // end). A JSON array that breaks off or lacks a comma is an Error: nothing after it can be
  // trusted.
  bool next(std::string& text, bool& too_long, std::uint64_t& length, std::int64_t& line,
            bool read_past) {
    text.clear();
    too_long = false;
    length = 0;
    ended_ = true;
    return array_ ? next_element(text, too_long, length, line, read_past)
                  : next_line(text, too_long, length, line, read_past);
  }

 private:
  // Appends one byte of an example, or counts it past the limit.
  void put(std::string& text, char c, bool& too_long, std::uint64_t& length) {
    ++length;
    if (too_long) return;
    if (length > max_) {
      too_long = true;
      std::string().swap(text);
      return;
    }
    text.push_back(c);
  }

  bool next_line(std::string& text, bool& too_long, std::uint64_t& length, std::int64_t& line,
                 bool read_past) {
    line = ++line_;
    for (;;) {
      if (pos_ == end_) {
        if (eof_ || !fill()) return length > 0;
      }
      const char* begin = buf_.data() + pos_;
      const char* nl = static_cast<const char*>(std::memchr(begin, '\n', end_ - pos_));
      const std::size_t n = nl ? static_cast<std::size_t>(nl - begin) : end_ - pos_;
      length += n;
      if (!too_long && length > max_) {
        too_long = true;
        std::string().swap(text);
        if (!read_past) {
          ended_ = nl != nullptr;
          pos_ += n;
          return true;
        }
      }
      if (!too_long) text.append(begin, n);
      pos_ += n;
      if (nl) {
        ++pos_;
        return true;
      }
    }
  }

  int get() {
    if (pos_ == end_ && (eof_ || !fill())) return -1;
    const int c = static_cast<unsigned char>(buf_[pos_++]);
    if (c == '\n') ++line_;
    return c;
  }
  int skip_space() {
    for (;;) {
      const int c = get();
      if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return c;
    }
  }
  [[noreturn]] void broken(const std::string& what) const {
    throw Error(path_ + ":" + std::to_string(line_) + ": " + what);
  }
  static std::string shown(int c) {
    return c < 0x20 || c > 0x7e ? "byte " + std::to_string(c) : "'" + std::string(1, char(c)) + "'";
  }

  bool next_element(std::string& text, bool& too_long, std::uint64_t& length, std::int64_t& line,
                    bool read_past) {
    if (done_) return false;
    int c = skip_space();
    if (!started_) {
      started_ = true;  // c is the '[' the constructor saw
      c = skip_space();
    } else if (c == ',') {
      c = skip_space();
    } else if (c != ']') {
      broken(c < 0 ? "the file ends inside the JSON list (no closing ']'): is it cut short?"
                   : "expected ',' or ']' after example " + std::to_string(count_) + ", found " +
                         shown(c));
    }
    if (c == ']') {  // the end (after a trailing comma too, as many writers leave one)
      done_ = true;
      if (skip_space() != -1) broken("more after the JSON list's closing ']'");
      return false;
    }
    if (c < 0) broken("the file ends inside the JSON list (no closing ']'): is it cut short?");
    ++count_;
    line = line_;
    // To the end of the value: the bracket that closes an object or a list; the closing quote of
    // a bare string; white space or punctuation after a bare number or word (bare values are no
    // examples, said later; a missing comma after one is still found by the caller).
    const bool bare = c != '{' && c != '[';
    int depth = 0;
    bool in_string = false, escape = false;
    for (;; c = get()) {
      if (c < 0)
        broken("the file ends inside example " + std::to_string(count_) + ": is it cut short?");
      if (bare && !in_string && length > 0 && ends_bare_word(c)) {
        --pos_;  // the separator (or what follows) is the caller's
        if (c == '\n') --line_;
        break;
      }
      put(text, static_cast<char>(c), too_long, length);
      if (in_string) {
        if (escape) {
          escape = false;
        } else if (c == '\\') {
          escape = true;
        } else if (c == '"') {
          in_string = false;
          if (bare) break;
        }
      } else if (c == '"') {
        in_string = true;
      } else if (!bare && (c == '{' || c == '[')) {
        ++depth;
      } else if (!bare && (c == '}' || c == ']') && --depth <= 0) {
        if (depth < 0) broken("a '" + std::string(1, char(c)) + "' that closes nothing");
        break;
      }
      if (too_long && !read_past) {
        ended_ = false;
        return true;
      }
    }
    return true;
  }

  static bool ends_bare_word(int c) {
    return c == ',' || c == ']' || c == '}' || c == '[' || c == '{' || c == '"' || c == ' ' ||
           c == '\t' || c == '\r' || c == '\n';
  }

  bool fill() {
    pos_ = end_ = 0;
    for (;;) {
      const ssize_t n = ::read(fd_, buf_.data(), buf_.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(path_ + ": cannot read the data file: " + std::strerror(errno));
      if (n == 0) eof_ = true;
      end_ = static_cast<std::size_t>(n);
      return n > 0;
    }
  }

  std::string path_;
  std::uint64_t max_;
  int fd_ = -1;
  std::vector<char> buf_ = std::vector<char>(1 << 16);
  std::size_t pos_ = 0, end_ = 0;
  bool eof_ = false;
  bool ended_ = true;
  bool array_ = false, started_ = false, done_ = false;
  std::int64_t line_ = 0;   // lines begun (JSONL) or '\n's read + 1 (a JSON list)
  std::int64_t count_ = 0;  // elements of a JSON list begun
};

// A record may hold pairs and a supervised layout's fields both (UltraFeedback's `messages`
// beside `chosen` and `rejected`): the pair for a preference objective, the other for sft.
DataFormat detect(const json& j, Objective objective) {
  const bool pair = is_preference_pair(j);
  if (pair && objective != Objective::kSft) return DataFormat::kPreference;
  if (j.contains("messages")) return DataFormat::kChat;
  if (j.contains("conversations")) return DataFormat::kShareGpt;
  if (j.contains("instruction") || j.contains("output")) return DataFormat::kAlpaca;
  if (j.contains("text")) return DataFormat::kText;
  return pair ? DataFormat::kPreference : DataFormat::kAuto;
}

// Moves the string out of `j` (a long text is not copied: the line is parsed once, then left).
std::string string_field(json& j, const char* key, bool required) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) throw Error(std::string("no '") + key + "' field");
    return "";
  }
  if (!j[key].is_string()) throw Error(std::string("'") + key + "' must be a string");
  return std::move(j[key].get_ref<std::string&>());
}

// The turns of a conversation: `list_key` holds objects with a role (`role_key`) and a text
// (`text_key`); `role_of` maps a role as written to system, user or assistant ("" = not one:
// `roles` lists the accepted ones).
template <typename RoleOf>
void append_turns(json& j, const char* list_key, const char* role_key, const char* text_key,
                  RoleOf role_of, const char* roles, std::vector<models::ChatMessage>& out) {
  const std::string shape =
      std::string("{\"") + role_key + "\": string, \"" + text_key + "\": string}";
  if (!j.contains(list_key) || !j[list_key].is_array())
    throw Error(std::string("'") + list_key + "' must be a list of " + shape);
  json& list = j[list_key];
  for (std::size_t i = 0; i < list.size(); ++i) {
    json& m = list[i];
    const std::string where = std::string(list_key) + "[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains(role_key) || !m[role_key].is_string() ||
        !m.contains(text_key) || !m[text_key].is_string())
      throw Error(where + " must be " + shape);
    const std::string& written = m[role_key].get_ref<const std::string&>();
    const std::string role = role_of(written);
    if (role.empty()) throw Error(where + "." + role_key + " is '" + written + "' (" + roles + ")");
    out.push_back({role, std::move(m[text_key].get_ref<std::string&>())});
  }
}

// The start of a text: cut at the first space after `chars` bytes, or at a character's start
// 4 × `chars` in when no space comes by then.
std::string text_start(const std::string& text, std::size_t chars) {
  std::size_t end = text.find_first_of(" \n\t", std::min(chars, text.size()));
  if (end == std::string::npos || end > 4 * chars) {
    end = std::min(4 * chars, text.size());
    while (end > 0 && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80)
      --end;
  }
  return text.substr(0, end);
}

// `prompt`, when given, receives what a sample prompt from this example would be: its first user
// message, or the first words of a plain text.
Example to_example(json& j, DataFormat format, const models::Tokenizer& tok,
                   const models::ChatTemplate& tmpl, const DataOptions& o,
                   std::string* prompt = nullptr) {
  Example e;
  if (format == DataFormat::kText) {
    const std::string text = string_field(j, "text", true);
    if (prompt) *prompt = text_start(text, 40);
    e.ids = tok.encode(text);
    if (o.add_eos && tok.eos_id()) e.ids.push_back(*tok.eos_id());
    e.loss_mask.assign(e.ids.size(), 1);
    return e;
  }
  std::vector<models::ChatMessage> messages;
  // A "system" field beside the turns (alpaca, ShareGPT): the conversation's first message.
  auto system_field = [&] {
    std::string system = string_field(j, "system", false);
    if (!system.empty()) messages.push_back({"system", std::move(system)});
  };
  if (format == DataFormat::kAlpaca) {
    system_field();
    std::string user = string_field(j, "instruction", true);
    const std::string input = string_field(j, "input", false);
    if (!input.empty()) user += "\n\n" + input;
    messages.push_back({"user", std::move(user)});
    messages.push_back({"assistant", string_field(j, "output", true)});
  } else if (format == DataFormat::kShareGpt) {
    system_field();
    append_turns(
        j, "conversations", "from", "value",
        [](const std::string& from) -> std::string {
          if (from == "system") return "system";
          if (from == "human" || from == "user") return "user";
          if (from == "gpt" || from == "assistant" || from == "chatgpt" || from == "model")
            return "assistant";
          return "";
        },
        "human, gpt or system", messages);
  } else {
    append_turns(
        j, "messages", "role", "content",
        [](const std::string& role) -> std::string {
          return role == "system" || role == "user" || role == "assistant" ? role : "";
        },
        "system, user or assistant", messages);
  }
  if (format != DataFormat::kAlpaca && !o.train_on_everything &&
      std::none_of(messages.begin(), messages.end(),
                   [](const models::ChatMessage& m) { return m.role == "assistant"; }))
    throw Error("no assistant message: nothing to train on");
  if (prompt)
    for (const models::ChatMessage& m : messages)
      if (m.role == "user") {
        *prompt = m.content;
        break;
      }
  models::RenderedChat r = models::render_chat(tok, tmpl, messages);
  e.ids = std::move(r.ids);
  e.loss_mask = o.train_on_everything ? std::vector<std::uint8_t>(e.ids.size(), 1) : r.loss_mask;
  return e;
}

std::string with_commas(std::int64_t n) {
  const std::string digits = std::to_string(n);
  const std::size_t sign = n < 0 ? 1 : 0;
  std::string s = digits.substr(0, sign);
  for (std::size_t i = sign; i < digits.size(); ++i) {
    if (i > sign && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

}  // namespace

const char* to_string(DataFormat format) {
  switch (format) {
    case DataFormat::kAuto:
      return "auto";
    case DataFormat::kText:
      return "text";
    case DataFormat::kAlpaca:
      return "alpaca";
    case DataFormat::kChat:
      return "chat";
    case DataFormat::kShareGpt:
      return "sharegpt";
    case DataFormat::kPreference:
      return "preference";
  }
  return "?";
}

std::int64_t Dataset::tokens() const {
  std::int64_t n = 0;
  for (const Example& e : examples)
    n += static_cast<std::int64_t>(e.ids.size());
  return n;
}

std::int64_t Dataset::trained_tokens() const {
  std::int64_t n = 0;
  for (const Example& e : examples)
    n += std::count_if(e.loss_mask.begin(), e.loss_mask.end(),
                       [](std::uint8_t m) { return (m & kAnswerToken) != 0; });
  return n;
}

std::string Dataset::stats_text() const {
  std::size_t lo = SIZE_MAX, hi = 0;
  for (const Example& e : examples) {
    lo = std::min(lo, e.ids.size());
    hi = std::max(hi, e.ids.size());
  }
  const std::int64_t n = static_cast<std::int64_t>(examples.size());
  const bool pairs = format == DataFormat::kPreference;
  std::string s =
      with_commas(n) +
      (pairs ? (n == 1 ? " pair (" : " pairs (") : (n == 1 ? " example (" : " examples (")) +
      to_string(format) + (json_list ? ", from a JSON list" : "") + "), " + with_commas(tokens()) +
      " tokens, " + with_commas(trained_tokens()) + " trained";
  if (n > 0)
    s += "; length " + with_commas(static_cast<std::int64_t>(lo)) + ".." +
         with_commas(static_cast<std::int64_t>(hi)) + ", mean " + with_commas(tokens() / n);
  if (pairs_dropped > 0)
    s += "; " + with_commas(pairs_dropped) +
         (pairs_dropped == 1 ? " pair dropped (its prompt fills max_length)"
                             : " pairs dropped (their prompt fills max_length)");
  if (pairs_truncated > 0)
    s += "; " + with_commas(pairs_truncated) +
         (pairs_truncated == 1 ? " pair cut to max_length" : " pairs cut to max_length");
  if (skipped > 0)
    s += "; " + with_commas(skipped) +
         (json_list ? (skipped == 1 ? " bad example skipped" : " bad examples skipped")
                    : (skipped == 1 ? " bad line skipped" : " bad lines skipped"));
  return s;
}

Dataset load_data(const std::string& path, const models::Tokenizer& tokenizer,
                  const models::ChatTemplate& chat_template, const DataOptions& options) {
  ExampleReader in(path, options.max_line_bytes);
  Dataset d;
  d.path = path;
  d.format = options.format;
  d.json_list = in.array();
  std::string text;
  bool too_long = false;
  std::uint64_t length = 0;
  std::int64_t line = 0;
  for (std::int64_t number = 1; in.next(text, too_long, length, line, options.skip_bad_lines);
       ++number) {
    if (!in.array()) {
      if (!text.empty() && text.back() == '\r') text.pop_back();
      if (!too_long && text.find_first_not_of(" \t") == std::string::npos) {
        --number;
        continue;
      }
    }
    if (options.max_lines > 0 && d.lines == options.max_lines) {
      d.partial = true;
      break;
    }
    ++d.lines;
    try {
      if (too_long)
        throw Error(
            std::string(in.array() ? "an example" : "a line") +
            (in.ended() ? " of " + std::to_string(length) + " bytes, more than "
                        : " of more than ") +
            format_bytes(options.max_line_bytes) + " (data.max_line" +
            (in.ended() ? std::string()
                        : "; " + std::to_string(length) + " bytes read without finding its end") +
            "): not one example per line? raise data.max_line if such long examples are meant");
      json j;
      try {
        j = json::parse(text);
      } catch (const json::exception& e) {
        throw Error("not valid JSON: " + plain_json_error(e.what()));
      }
      // A long example is let go once parsed (its text lives on in `j`); short ones keep the
      // buffer.
      if (text.capacity() > (std::size_t{1} << 20)) std::string().swap(text);
      if (!j.is_object()) throw Error("not a JSON object");
      if (d.format == DataFormat::kAuto) {
        d.format = detect(j, options.objective);
        if (d.format == DataFormat::kAuto)
          throw Error(
              "no 'text', 'instruction'/'output', 'messages' or 'conversations' field: cannot "
              "tell the format. Rondo reads these (or choose one with the data format setting):\n"
              "  text      {\"text\": \"...\"}\n"
              "  alpaca    {\"instruction\": \"...\", \"input\": \"...\", \"output\": \"...\", "
              "\"system\": \"...\"}\n"
              "  chat      {\"messages\": [{\"role\": \"system\"|\"user\"|\"assistant\", "
              "\"content\": \"...\"}, ...]}\n"
              "  sharegpt  {\"conversations\": [{\"from\": \"system\"|\"human\"|\"gpt\", "
              "\"value\": \"...\"}, ...], \"system\": \"...\"}\n"
              "  preference {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...} (strings or "
              "lists of messages; for training.objective dpo, orpo or simpo)\n"
              "one example per line (JSONL), or a JSON file holding a list of them ('input' and "
              "'system' may be left out)");
      }
      const bool pairs = options.objective != Objective::kSft;
      if (pairs != (d.format == DataFormat::kPreference))
        throw Error(!pairs ? "a preference pair ('chosen' and 'rejected'): supervised training "
                             "(training.objective sft) needs one answer per example; set "
                             "training.objective to dpo, orpo or simpo to train on pairs"
                    : options.format != DataFormat::kAuto
                        ? std::string("data.format is ") + to_string(options.format) +
                              ": training.objective " + to_string(options.objective) +
                              " trains on preference pairs; set data.format to auto or preference"
                        : std::string("not a preference pair (no 'chosen' and 'rejected' fields): "
                                      "training.objective ") +
                              to_string(options.objective) +
                              " trains on pairs of a preferred and a rejected answer");
      std::string prompt;
      std::string* first = d.examples.empty() ? &prompt : nullptr;
      PairCounts counts{d.pairs_dropped, d.pairs_truncated};
      Example e = pairs ? preference_example(j, tokenizer, chat_template, options.objective,
                                             options.max_length, counts, first)
                        : to_example(j, d.format, tokenizer, chat_template, options, first);
      d.pairs_dropped = counts.dropped;
      d.pairs_truncated = counts.truncated;
      if (pairs && e.ids.empty()) continue;  // dropped (counted)
      if (e.ids.empty()) throw Error("no tokens");
      // Held for the whole run: no growth slack (up to half of a long example's ids).
      e.ids.shrink_to_fit();
      e.loss_mask.shrink_to_fit();
      if (d.examples.empty()) d.first_prompt = std::move(prompt);
      d.examples.push_back(std::move(e));
    } catch (const Error& e) {
      const std::string what =
          path + ":" + std::to_string(line) +
          (in.array() ? " (example " + std::to_string(number) + ")" : std::string()) + ": " +
          e.what();
      if (!options.skip_bad_lines) throw Error(what);
      ++d.skipped;
      if (d.skipped_reasons.size() < 5) d.skipped_reasons.push_back(what);
    }
  }
  if (d.examples.empty() && d.pairs_dropped > 0)
    throw Error(path + ": every pair was dropped (" + std::to_string(d.pairs_dropped) +
                "): each prompt fills preference.max_length (" +
                std::to_string(options.max_length) +
                " tokens a sequence); raise preference.max_length (and data.seq_len, which holds "
                "two sequences)");
  if (d.examples.empty())
    throw Error(path + ": no examples" +
                (d.skipped ? " (" + std::to_string(d.skipped) +
                                 (d.json_list ? " bad examples" : " bad lines") +
                                 " skipped; the first: " + d.skipped_reasons[0] + ")"
                           : std::string(d.lines       ? ""
                                         : d.json_list ? " (the list is empty)"
                                                       : " (the file is empty)")));
  return d;
}

DataFormat data_format_from(const std::string& name) {
  for (DataFormat f : kDataFormats)
    if (name == to_string(f)) return f;
  throw Error("data format '" + name +
              "' is not one of auto, text, alpaca, chat, sharegpt, preference");
}

}  // namespace rondo::engine
