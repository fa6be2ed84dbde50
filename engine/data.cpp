#include "engine/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace rondo::engine {
namespace {

using nlohmann::json;

// Lines of a file, each at most `max` bytes held: a longer one is reported (too_long) and its bytes
// are read past without being kept, so a file of one endless line (/dev/zero) costs `max` bytes.
class LineReader {
 public:
  LineReader(const std::string& path, std::uint64_t max) : path_(path), max_(max) {
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
                  ", not a data file; give a JSONL file (one example per line)");
    }
  }
  ~LineReader() { ::close(fd_); }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // Whether the last line's end was read (false: a too-long line left at once, its length so far).
  bool ended() const { return ended_; }

  // The next line without its '\n' into `line`; false at the end of the file. `too_long` says the
  // line was longer than the limit (then `line` is empty and `length` is what was read of it):
  // with `read_past` the rest of it is read and dropped, else next() returns at once (the caller
  // stops; an endless line is never read to its end).
  bool next(std::string& line, bool& too_long, std::uint64_t& length, bool read_past) {
    line.clear();
    too_long = false;
    length = 0;
    ended_ = true;
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
        line.clear();
        line.shrink_to_fit();
        if (!read_past) {
          ended_ = nl != nullptr;
          pos_ += n;
          return true;
        }
      }
      if (!too_long) line.append(begin, n);
      pos_ += n;
      if (nl) {
        ++pos_;
        return true;
      }
    }
  }

 private:
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
};

DataFormat detect(const json& j) {
  if (j.contains("messages")) return DataFormat::kChat;
  if (j.contains("instruction") || j.contains("output")) return DataFormat::kAlpaca;
  if (j.contains("text")) return DataFormat::kText;
  return DataFormat::kAuto;
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

Example to_example(json& j, DataFormat format, const models::Tokenizer& tok,
                   const models::ChatTemplate& tmpl, const DataOptions& o) {
  Example e;
  if (format == DataFormat::kText) {
    const std::string text = string_field(j, "text", true);
    e.ids = tok.encode(text);
    if (o.add_eos && tok.eos_id()) e.ids.push_back(*tok.eos_id());
    e.loss_mask.assign(e.ids.size(), 1);
    return e;
  }
  std::vector<models::ChatMessage> messages;
  if (format == DataFormat::kAlpaca) {
    std::string user = string_field(j, "instruction", true);
    const std::string input = string_field(j, "input", false);
    if (!input.empty()) user += "\n\n" + input;
    messages = {{"user", user}, {"assistant", string_field(j, "output", true)}};
  } else {
    if (!j.contains("messages") || !j["messages"].is_array())
      throw Error("'messages' must be a list of {\"role\", \"content\"}");
    for (std::size_t i = 0; i < j["messages"].size(); ++i) {
      json& m = j["messages"][i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
          !m.contains("content") || !m["content"].is_string())
        throw Error(where + " must be {\"role\": string, \"content\": string}");
      const std::string role = m["role"];
      if (role != "system" && role != "user" && role != "assistant")
        throw Error(where + ".role is '" + role + "' (system, user or assistant)");
      messages.push_back({role, std::move(m["content"].get_ref<std::string&>())});
    }
    if (std::none_of(messages.begin(), messages.end(),
                     [](const models::ChatMessage& m) { return m.role == "assistant"; }) &&
        !o.train_on_everything)
      throw Error("no assistant message: nothing to train on");
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
    n += std::count(e.loss_mask.begin(), e.loss_mask.end(), std::uint8_t{1});
  return n;
}

std::string Dataset::stats_text() const {
  std::size_t lo = SIZE_MAX, hi = 0;
  for (const Example& e : examples) {
    lo = std::min(lo, e.ids.size());
    hi = std::max(hi, e.ids.size());
  }
  const std::int64_t n = static_cast<std::int64_t>(examples.size());
  std::string s = with_commas(n) + " examples (" + to_string(format) + "), " +
                  with_commas(tokens()) + " tokens, " + with_commas(trained_tokens()) + " trained";
  if (n > 0)
    s += "; length " + with_commas(static_cast<std::int64_t>(lo)) + ".." +
         with_commas(static_cast<std::int64_t>(hi)) + ", mean " + with_commas(tokens() / n);
  if (skipped > 0)
    s += "; " + with_commas(skipped) + (skipped == 1 ? " bad line skipped" : " bad lines skipped");
  return s;
}

Dataset load_jsonl(const std::string& path, const models::Tokenizer& tokenizer,
                   const models::ChatTemplate& chat_template, const DataOptions& options) {
  LineReader in(path, options.max_line_bytes);
  Dataset d;
  d.path = path;
  d.format = options.format;
  std::string line;
  bool too_long = false;
  std::uint64_t length = 0;
  for (std::int64_t number = 1; in.next(line, too_long, length, options.skip_bad_lines); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!too_long && line.find_first_not_of(" \t") == std::string::npos) continue;
    if (options.max_lines > 0 && d.lines == options.max_lines) {
      d.partial = true;
      break;
    }
    ++d.lines;
    try {
      if (too_long)
        throw Error(
            (in.ended() ? "a line of " + std::to_string(length) + " bytes, more than "
                        : "a line of more than ") +
            format_bytes(options.max_line_bytes) + " (data.max_line" +
            (in.ended() ? std::string()
                        : "; " + std::to_string(length) + " bytes read without finding its end") +
            "): not one example per line? raise data.max_line if such long examples are meant");
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        throw Error(std::string("not valid JSON (") + e.what() + ")");
      }
      // A long line is let go once parsed (its text lives on in `j`); short ones keep the buffer.
      if (line.capacity() > (std::size_t{1} << 20)) std::string().swap(line);
      if (!j.is_object()) throw Error("not a JSON object");
      if (d.format == DataFormat::kAuto) {
        d.format = detect(j);
        if (d.format == DataFormat::kAuto)
          throw Error(
              "no 'text', 'instruction'/'output' or 'messages' field: cannot tell the "
              "format (choose one with the data format setting)");
      }
      Example e = to_example(j, d.format, tokenizer, chat_template, options);
      if (e.ids.empty()) throw Error("no tokens");
      // Held for the whole run: no growth slack (up to half of a long example's ids).
      e.ids.shrink_to_fit();
      e.loss_mask.shrink_to_fit();
      d.examples.push_back(std::move(e));
    } catch (const Error& e) {
      const std::string what = path + ":" + std::to_string(number) + ": " + e.what();
      if (!options.skip_bad_lines) throw Error(what);
      ++d.skipped;
      if (d.skipped_reasons.size() < 5) d.skipped_reasons.push_back(what);
    }
  }
  if (d.examples.empty())
    throw Error(path + ": no examples" +
                (d.skipped ? " (" + std::to_string(d.skipped) +
                                 " bad lines skipped; the first: " + d.skipped_reasons[0] + ")"
                           : std::string(d.lines ? "" : " (the file is empty)")));
  return d;
}

DataFormat data_format_from(const std::string& name) {
  for (DataFormat f :
       {DataFormat::kAuto, DataFormat::kText, DataFormat::kAlpaca, DataFormat::kChat})
    if (name == to_string(f)) return f;
  throw Error("data format '" + name + "' is not one of auto, text, alpaca, chat");
}

}  // namespace rondo::engine
