// Tokenizer pipeline, stage by stage as in Hugging Face `tokenizers`:
//   1. split out added tokens that match the raw text (special ones, `normalized: false`),
//   2. normalise each remaining piece, split out added tokens that match normalised text,
//   3. pre-tokenise (Split regexes, ByteLevel, Metaspace, ...),
//   4. BPE each pre-token (merges by rank, cached per word),
//   5. post-process (BOS/EOS templates).
// Decoding runs the decoder steps over the token strings.
//
// Note [Byte offsets]: every piece of text carries, per byte, the offset in the caller's text of
// the character it came from (`Piece::orig`). Normalisers and pre-tokenizers keep it aligned, so
// each token knows the range of input it covers. Chat templates turn that into an exact loss mask
// while the ids stay those of tokenizing the whole rendered string, as transformers does.
#include "models/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "kernels/error.h"
#include "models/mapped_file.h"
#include "models/tokenizer_config.h"
#include "models/unicode.h"

namespace rondo::models {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Regexes (PCRE2, UTF + UCP). tokenizer.json patterns are written for Oniguruma; the one
// difference that matters for the families' patterns is `\s`: Oniguruma's is Unicode White_Space,
// PCRE2's adds U+180E. rewrite_for_pcre2 spells \s out as White_Space.

constexpr const char* kWhiteSpaceClass = R"(\t\n\x0B\f\r\x{85}\p{Z})";

std::string rewrite_for_pcre2(const std::string& pattern) {
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char n = pattern[i + 1];
      if (n == 's') {
        out += in_class ? std::string(kWhiteSpaceClass) : "[" + std::string(kWhiteSpaceClass) + "]";
      } else if (n == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpaceClass) + "]";
      } else {
        out += c;
        out += n;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' or '^]' right after '[' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) : pattern_(pattern), where_(where) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    const std::string rewritten = rewrite_for_pcre2(pattern);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw Error(where + ": regex " + json(pattern).dump() + " does not compile (" +
                  reinterpret_cast<const char*>(msg) + " at offset " + std::to_string(err_offset) +
                  ")");
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end), left to right, each passed to `f(begin, end)` as it is
  // found (a long text's matches are never all held); an empty match advances one character.
  template <typename F>
  void for_each(std::string_view s, F&& f) const {
    MatchData md(code_);
    std::size_t pos = 0;
    while (pos <= s.size()) {
      if (!match(s, pos, 0, md)) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const std::size_t b = ov[0], e = ov[1];
      if (e == b) {
        if (b >= s.size()) break;
        pos = b + unicode::char_len(static_cast<unsigned char>(s[b]));
        continue;
      }
      pos = e;
      f(b, e);
    }
  }

  // Whether a match starts at s[0] (one anchored attempt, not a scan).
  bool matches_at_start(std::string_view s) const {
    MatchData md(code_);
    return match(s, 0, PCRE2_ANCHORED, md);
  }

 private:
  // Match data sized for the pattern, freed on every path out (an emplace_back may throw).
  class MatchData {
   public:
    explicit MatchData(const pcre2_code* code)
        : md_(pcre2_match_data_create_from_pattern(code, nullptr)) {
      RONDO_ASSERT(md_ != nullptr);
    }
    ~MatchData() { pcre2_match_data_free(md_); }
    MatchData(const MatchData&) = delete;
    MatchData& operator=(const MatchData&) = delete;
    pcre2_match_data* get() const { return md_; }

   private:
    pcre2_match_data* md_;
  };

  // One match attempt from byte `pos`: true when found (ovector in md), false for no match.
  // JIT unless it runs out of stack or `options` needs the interpreter (PCRE2_ANCHORED does).
  bool match(std::string_view s, std::size_t pos, std::uint32_t options,
             const MatchData& md) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    int rc = jit_ && options == 0
                 ? pcre2_jit_match(code_, subject, s.size(), pos, 0, md.get(), nullptr)
                 : PCRE2_ERROR_JIT_BADOPTION;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_JIT_BADOPTION)
      rc = pcre2_match(code_, subject, s.size(), pos, options | PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      // Named by where it came from (the tokenizer.json and the JSON path), so that every caller
      // (training data, generate, chat) says which file's pattern gave up.
      throw Error(where_ + ": regex " + json(pattern_).dump() +
                  " failed on this text: " + reinterpret_cast<const char*>(msg) +
                  (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
                           rc == PCRE2_ERROR_HEAPLIMIT
                       ? " (PCRE2's backtracking limit; a very long run of one kind of character?)"
                       : ""));
    }
    return true;
  }

  std::string pattern_;
  std::string where_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------
// Pieces of text with per-byte original offsets. See Note [Byte offsets].

struct Piece {
  std::string text;
  std::vector<std::uint32_t> orig;  // per byte of text: offset of its source char in the input
  std::int32_t token = -1;          // an added token already recognised (text is its match)
};

Piece slice(const Piece& p, std::size_t b, std::size_t e) {
  Piece out;
  out.text = p.text.substr(b, e - b);
  out.orig.assign(p.orig.begin() + static_cast<std::ptrdiff_t>(b),
                  p.orig.begin() + static_cast<std::ptrdiff_t>(e));
  return out;
}

// Appends `s` to `out`, every byte tagged `tag`.
void push(Piece& out, std::string_view s, std::uint32_t tag) {
  out.text.append(s);
  out.orig.insert(out.orig.end(), s.size(), tag);
}

// Replaces every match [b, e) with `content`; inserted bytes take the tag of the first replaced
// byte. `for_each_match(f)` calls f(b, e) for each match of p.text, left to right.
template <typename ForEachMatch>
Piece replace_ranges(const Piece& p, ForEachMatch&& for_each_match, const std::string& content) {
  Piece out;
  std::size_t prev = 0;
  for_each_match([&](std::size_t b, std::size_t e) {
    out.text.append(p.text, prev, b - prev);
    out.orig.insert(out.orig.end(), p.orig.begin() + static_cast<std::ptrdiff_t>(prev),
                    p.orig.begin() + static_cast<std::ptrdiff_t>(b));
    push(out, content, p.orig[b]);
    prev = e;
  });
  out.text.append(p.text, prev, std::string::npos);
  out.orig.insert(out.orig.end(), p.orig.begin() + static_cast<std::ptrdiff_t>(prev), p.orig.end());
  return out;
}

// Each occurrence [begin, end) of `lit` in `s`, left to right, non-overlapping, to `f`.
template <typename F>
void for_each_literal(std::string_view s, std::string_view lit, F&& f) {
  if (lit.empty()) return;
  for (std::size_t pos = s.find(lit); pos != std::string_view::npos; pos = s.find(lit, pos)) {
    f(pos, pos + lit.size());
    pos += lit.size();
  }
}

// A pattern of Split / Replace: a literal string or a regex.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;
  // Each match [begin, end) in `s` to `f(begin, end)`, left to right.
  template <typename F>
  void for_each(std::string_view s, F&& f) const {
    if (regex)
      regex->for_each(s, f);
    else
      for_each_literal(s, literal, f);
  }
};

// ---------------------------------------------------------------------------------------------
// Normalisers.

struct NormPrepend {
  std::string prepend;
};
struct NormReplace {
  Pattern pattern;
  std::string content;
};
struct NormUnicode {
  bool compose;  // NFC, else NFD
};
struct NormStrip {
  bool left, right;
};
using NormStep = std::variant<NormPrepend, NormReplace, NormUnicode, NormStrip>;

Piece normalize_unicode(Piece p, bool compose) {
  if (unicode::below_combining(p.text)) return p;
  std::vector<char32_t> cps;
  std::vector<std::uint32_t> tags;
  for (std::size_t i = 0; i < p.text.size();) {
    const std::uint32_t tag = p.orig[i];
    cps.push_back(unicode::next(p.text, i));
    tags.push_back(tag);
  }
  if (compose)
    unicode::nfc(cps, tags);
  else
    unicode::nfd(cps, tags);
  Piece out;
  for (std::size_t k = 0; k < cps.size(); ++k) {
    const std::size_t before = out.text.size();
    unicode::append(out.text, cps[k]);
    out.orig.insert(out.orig.end(), out.text.size() - before, tags[k]);
  }
  return out;
}

// Takes `p` by value: a step that changes nothing (the common case on plain text) moves it through.
Piece apply_norm(const NormStep& step, Piece p) {
  if (auto* s = std::get_if<NormPrepend>(&step)) {
    if (p.text.empty()) return p;
    Piece out;
    push(out, s->prepend, p.orig[0]);
    out.text += p.text;
    out.orig.insert(out.orig.end(), p.orig.begin(), p.orig.end());
    return out;
  }
  if (auto* s = std::get_if<NormReplace>(&step))
    return replace_ranges(
        p, [&](auto&& f) { s->pattern.for_each(p.text, f); }, s->content);
  if (auto* s = std::get_if<NormUnicode>(&step)) return normalize_unicode(std::move(p), s->compose);
  const auto& strip = std::get<NormStrip>(step);
  const auto [b, e] =
      unicode::strip(p.text, 0, p.text.size(), strip.left, strip.right, unicode::is_white_space);
  if (b == 0 && e == p.text.size()) return p;
  return slice(p, b, e);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers.

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreSplit {
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};
struct PreByteLevel {
  bool add_prefix_space = false;
  bool use_regex = true;
};
enum class PrependScheme { kFirst, kAlways, kNever };
struct PreMetaspace {
  std::string replacement = "\xE2\x96\x81";  // ▁
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};
using PreStep = std::variant<PreSplit, PreByteLevel, PreMetaspace>;

// Cuts a text of `size` bytes as NormalizedString::split does with `behavior`: `for_each_match(g)`
// calls g(begin, end) for each match, left to right, non-overlapping; each non-empty piece
// [begin, end) goes to `f` as soon as it is known (at most one piece is held back, for the merging
// behaviours), so a long text never holds its list of matches or pieces.
template <typename ForEachMatch, typename F>
void for_each_cut(std::size_t size, ForEachMatch&& for_each_match, SplitBehavior behavior,
                  bool invert, F&& f) {
  // The text is a sequence of spans, each a match or the text between two; `pending` is a cut
  // that the next span may still extend.
  bool have = false, pending_match = false;
  std::size_t pb = 0, pe = 0;
  auto flush = [&] {
    if (have && pe > pb) f(pb, pe);
    have = false;
  };
  auto hold = [&](std::size_t b, std::size_t e, bool match) {
    flush();
    have = true, pb = b, pe = e, pending_match = match;
  };
  bool prev_match = false;
  auto span = [&](std::size_t b, std::size_t e, bool match) {
    match = match != invert;
    switch (behavior) {
      case SplitBehavior::kIsolated:
        f(b, e);
        break;
      case SplitBehavior::kRemoved:
        if (!match) f(b, e);
        break;
      case SplitBehavior::kMergedWithPrevious:  // a match joins the piece before it
        if (match && !prev_match && have)
          pe = e;
        else
          hold(b, e, match);
        break;
      case SplitBehavior::kMergedWithNext:  // a match joins the piece after it
        if (have && pending_match && !match) {
          pe = e;
          flush();
        } else {
          flush();
          if (match)
            hold(b, e, match);
          else
            f(b, e);
        }
        break;
      case SplitBehavior::kContiguous:  // runs of matches, and of non-matches, are one piece
        if (have && match == pending_match)
          pe = e;
        else
          hold(b, e, match);
        break;
    }
    prev_match = match;
  };
  std::size_t prev = 0;
  for_each_match([&](std::size_t b, std::size_t e) {
    if (prev != b) span(prev, b, false);
    span(b, e, true);
    prev = e;
  });
  if (prev != size) span(prev, size, false);
  flush();
}

// GPT-2's byte <-> printable character table: printable Latin-1 bytes map to themselves, the
// others to U+0100 onwards in byte order.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<char32_t, std::uint8_t> to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      unicode::append(to_char[static_cast<std::size_t>(b)], cp);
      to_byte[cp] = static_cast<std::uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

const Regex& gpt2_regex() {
  static const Regex re(std::string(kSplitRegexGpt2), "ByteLevel pre-tokenizer");
  return re;
}

Piece byte_level_map(const Piece& p) {
  const ByteMap& bm = byte_map();
  Piece out;
  out.text.reserve(p.text.size() * 2);
  out.orig.reserve(p.text.size() * 2);
  for (std::size_t i = 0; i < p.text.size(); ++i)
    push(out, bm.to_char[static_cast<unsigned char>(p.text[i])], p.orig[i]);
  return out;
}

// One pre-tokenizer step on `p`: each resulting piece goes to `f`, in order, as soon as it is cut
// (the pieces of a long text are never all held at once; see Tokenizer's encode).
template <typename F>
void apply_pre(const PreStep& step, Piece p, F&& f) {
  if (auto* s = std::get_if<PreSplit>(&step)) {
    for_each_cut(
        p.text.size(), [&](auto&& g) { s->pattern.for_each(p.text, g); }, s->behavior, s->invert,
        [&](std::size_t b, std::size_t e) { f(slice(p, b, e)); });
    return;
  }
  if (auto* s = std::get_if<PreByteLevel>(&step)) {
    if (s->add_prefix_space && !p.text.empty() && p.text[0] != ' ') {
      Piece q;
      push(q, " ", p.orig[0]);
      q.text += p.text;
      q.orig.insert(q.orig.end(), p.orig.begin(), p.orig.end());
      p = std::move(q);
    }
    if (!s->use_regex) {
      f(byte_level_map(p));
      return;
    }
    for_each_cut(
        p.text.size(), [&](auto&& g) { gpt2_regex().for_each(p.text, g); },
        SplitBehavior::kIsolated, false,
        [&](std::size_t b, std::size_t e) { f(byte_level_map(slice(p, b, e))); });
    return;
  }
  const auto& ms = std::get<PreMetaspace>(step);
  const bool at_origin = !p.orig.empty() && p.orig[0] == 0;
  Piece q = replace_ranges(
      p, [&](auto&& g) { for_each_literal(p.text, " ", g); }, ms.replacement);
  const bool starts = q.text.compare(0, ms.replacement.size(), ms.replacement) == 0;
  const bool prepend = !starts && (ms.prepend_scheme == PrependScheme::kAlways ||
                                   (ms.prepend_scheme == PrependScheme::kFirst && at_origin));
  if (prepend && !q.text.empty()) {
    Piece r;
    push(r, ms.replacement, q.orig[0]);
    r.text += q.text;
    r.orig.insert(r.orig.end(), q.orig.begin(), q.orig.end());
    q = std::move(r);
  }
  if (!ms.split) {
    if (!q.text.empty()) f(std::move(q));
    return;
  }
  // Every replacement char is its own match; MergedWithNext glues each to what follows.
  for_each_cut(
      q.text.size(), [&](auto&& g) { for_each_literal(q.text, ms.replacement, g); },
      SplitBehavior::kMergedWithNext, false,
      [&](std::size_t b, std::size_t e) { f(slice(q, b, e)); });
}

// ---------------------------------------------------------------------------------------------
// Decoders.

struct DecByteLevel {};
struct DecReplace {
  Pattern pattern;
  std::string content;
};
struct DecByteFallback {};
struct DecFuse {};
struct DecStrip {
  char32_t content = ' ';
  std::size_t start = 0, stop = 0;
};
struct DecMetaspace {
  std::string replacement = "\xE2\x96\x81";
  PrependScheme prepend_scheme = PrependScheme::kAlways;
};
using DecStep =
    std::variant<DecByteLevel, DecReplace, DecByteFallback, DecFuse, DecStrip, DecMetaspace>;

// "<0xAB>" -> 0xAB (Rust's u8::from_str_radix accepts an optional '+').
std::optional<std::uint8_t> byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (t[3] == '+' && lo >= 0) return static_cast<std::uint8_t>(lo);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<std::uint8_t>(hi * 16 + lo);
}

// Appends a ByteLevel token's bytes (its characters mapped back through ByteMap; a token with a
// character outside the map is taken as it is).
void append_byte_level(std::string& bytes, const std::string& t) {
  const ByteMap& bm = byte_map();
  const std::size_t start = bytes.size();
  for (std::size_t i = 0; i < t.size();) {
    auto it = bm.to_byte.find(unicode::next(t, i));
    if (it == bm.to_byte.end()) {
      bytes.resize(start);
      bytes += t;
      return;
    }
    bytes += static_cast<char>(it->second);
  }
}

std::vector<std::string> apply_dec(const DecStep& step, std::vector<std::string> tokens) {
  if (std::holds_alternative<DecByteLevel>(step)) {
    std::string bytes;
    for (const std::string& t : tokens)
      append_byte_level(bytes, t);
    return {unicode::lossy(bytes)};
  }
  if (auto* s = std::get_if<DecReplace>(&step)) {
    for (std::string& t : tokens) {
      Piece p;
      push(p, t, 0);
      t = replace_ranges(
              p, [&](auto&& f) { s->pattern.for_each(p.text, f); }, s->content)
              .text;
    }
    return tokens;
  }
  if (std::holds_alternative<DecByteFallback>(step)) {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (unicode::find_invalid(pending) == std::string::npos)
        out.push_back(pending);
      else
        for (std::size_t k = 0; k < pending.size(); ++k)
          out.emplace_back("\xEF\xBF\xBD");
      pending.clear();
    };
    for (std::string& t : tokens) {
      if (auto b = byte_token(t)) {
        pending += static_cast<char>(*b);
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    return out;
  }
  if (std::holds_alternative<DecFuse>(step)) {
    std::string all;
    for (const std::string& t : tokens)
      all += t;
    return {all};
  }
  if (auto* s = std::get_if<DecStrip>(&step)) {
    for (std::string& t : tokens) {
      std::vector<char32_t> cps;
      for (std::size_t i = 0; i < t.size();)
        cps.push_back(unicode::next(t, i));
      std::size_t b = 0, e = cps.size();
      for (std::size_t i = 0; i < s->start && i < cps.size() && cps[i] == s->content; ++i)
        b = i + 1;
      for (std::size_t i = 0; i < s->stop && i < cps.size(); ++i) {
        const std::size_t idx = cps.size() - i - 1;
        if (cps[idx] != s->content) break;
        e = idx;
      }
      std::string out;
      for (std::size_t k = b; k < e; ++k)
        unicode::append(out, cps[k]);
      t = out;
    }
    return tokens;
  }
  const auto& ms = std::get<DecMetaspace>(step);
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    std::string out;
    const std::string& t = tokens[k];
    for (std::size_t pos = 0; pos < t.size();) {
      if (t.compare(pos, ms.replacement.size(), ms.replacement) == 0) {
        if (!(k == 0 && ms.prepend_scheme != PrependScheme::kNever)) out += ' ';
        pos += ms.replacement.size();
      } else {
        out += t[pos++];
      }
    }
    tokens[k] = out;
  }
  return tokens;
}

// ---------------------------------------------------------------------------------------------
// Added tokens: leftmost-longest matching as aho-corasick does, then single_word / lstrip /
// rstrip as `tokenizers`' AddedVocabulary::find_matches.

struct AddedToken {
  std::string content;
  std::int32_t id = -1;
  bool special = false, lstrip = false, rstrip = false, single_word = false, normalized = true;
};

class AddedMatcher {
 public:
  void add(std::string pattern, std::size_t token_index) {
    if (pattern.empty()) return;
    by_first_[static_cast<unsigned char>(pattern[0])].push_back(patterns_.size());
    patterns_.push_back({std::move(pattern), token_index});
  }
  void finish() {
    for (auto& list : by_first_)
      std::stable_sort(list.begin(), list.end(), [&](std::size_t a, std::size_t b) {
        return patterns_[a].text.size() > patterns_[b].text.size();
      });
  }
  bool empty() const { return patterns_.empty(); }
  // (begin, end, token index), non-overlapping, leftmost-longest.
  std::vector<std::array<std::size_t, 3>> find_all(std::string_view s) const {
    std::vector<std::array<std::size_t, 3>> out;
    for (std::size_t pos = 0; pos < s.size();) {
      bool found = false;
      for (std::size_t k : by_first_[static_cast<unsigned char>(s[pos])]) {
        const auto& pat = patterns_[k];
        if (s.compare(pos, pat.text.size(), pat.text) == 0) {
          out.push_back({pos, pos + pat.text.size(), pat.token});
          pos += pat.text.size();
          found = true;
          break;
        }
      }
      if (!found) ++pos;
    }
    return out;
  }

 private:
  struct Pat {
    std::string text;
    std::size_t token;
  };
  std::vector<Pat> patterns_;
  std::array<std::vector<std::size_t>, 256> by_first_;
};

// Rust regex \w (what `tokenizers` uses for single_word): Alphabetic, marks, decimal digits,
// connector punctuation, joiners.
const Regex& word_char_regex() {
  static const Regex re(R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", "added tokens");
  return re;
}
bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  const std::size_t n = unicode::char_len(static_cast<unsigned char>(s[0]));
  return word_char_regex().matches_at_start(s.substr(0, n));
}
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  return word_char_regex().matches_at_start(s.substr(unicode::prev_start(s, s.size())));
}

// ---------------------------------------------------------------------------------------------
// BPE.

struct BpeModel {
  std::unordered_map<std::string, std::int32_t> vocab;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges;  // rank, id
  std::int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  std::array<std::int32_t, 256> byte_ids{};  // <0xXX> ids, -1 when missing

  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }

  // A word's tokens: id and the byte range of the word it covers.
  struct Tok {
    std::int32_t id;
    std::uint32_t begin, end;
  };

  std::vector<Tok> tokenize(const std::string& w) const {
    std::vector<Tok> out;
    if (w.empty()) return out;
    if (ignore_merges) {
      auto it = vocab.find(w);
      if (it != vocab.end()) return {{it->second, 0, static_cast<std::uint32_t>(w.size())}};
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      auto it = cache_.find(w);
      if (it != cache_.end()) return it->second;
    }
    out = merge_word(w);
    if (w.size() < 256) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (cache_.size() >= 10000) cache_.clear();
      cache_.emplace(w, out);
    }
    return out;
  }

 private:
  struct Symbol {
    std::int32_t id;
    std::int64_t prev, next;
    std::uint32_t begin, end;  // byte range in the word; end == begin marks a merged-away symbol
  };

  std::vector<Tok> merge_word(const std::string& w) const {
    std::vector<Symbol> sym;
    auto add = [&](std::int32_t id, std::uint32_t b, std::uint32_t e) {
      const auto n = static_cast<std::int64_t>(sym.size());
      sym.push_back({id, n - 1, n + 1, b, e});
    };
    Tok unk{-1, 0, 0};  // pending unknown (id -1 = none), fused or not
    for (std::size_t i = 0; i < w.size();) {
      const std::size_t start = i;
      unicode::next(w, i);
      std::string s = w.substr(start, i - start);
      if (start != 0 && !continuing_subword_prefix.empty()) s = continuing_subword_prefix + s;
      if (i == w.size() && !end_of_word_suffix.empty()) s += end_of_word_suffix;
      const auto b = static_cast<std::uint32_t>(start), e = static_cast<std::uint32_t>(i);
      auto it = vocab.find(s);
      if (it != vocab.end()) {
        if (unk.id >= 0) add(unk.id, unk.begin, unk.end), unk.id = -1;
        add(it->second, b, e);
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (unsigned char c : s)
          all = all && byte_ids[c] >= 0;
        if (all) {
          // As `tokenizers`: byte tokens do not flush a pending unknown.
          for (unsigned char c : s)
            add(byte_ids[c], b, e);
          continue;
        }
      }
      if (unk_id >= 0) {
        if (unk.id >= 0 && fuse_unk) {
          unk.end = e;
        } else {
          if (unk.id >= 0) add(unk.id, unk.begin, unk.end);
          unk = Tok{unk_id, b, e};
        }
      }
    }
    if (unk.id >= 0) add(unk.id, unk.begin, unk.end);
    if (!sym.empty()) sym.back().next = -1;

    // Merge by (rank, position), as `tokenizers`' Word::merge_all.
    struct Merge {
      std::size_t pos;
      std::int32_t rank, id;
      bool operator<(const Merge& o) const {  // priority_queue pops the largest: invert
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Merge> queue;
    for (std::size_t k = 0; k + 1 < sym.size(); ++k) {
      auto it = merges.find(key(sym[k].id, sym[k + 1].id));
      if (it != merges.end()) queue.push({k, it->second.first, it->second.second});
    }
    while (!queue.empty()) {
      const Merge top = queue.top();
      queue.pop();
      Symbol& cur = sym[top.pos];
      if (cur.end == cur.begin || cur.next < 0) continue;
      const auto next_pos = static_cast<std::size_t>(cur.next);
      const Symbol right = sym[next_pos];
      auto it = merges.find(key(cur.id, right.id));
      if (it == merges.end() || it->second.second != top.id) continue;
      cur.id = top.id;
      cur.end = right.end;
      cur.next = right.next;
      sym[next_pos].end = sym[next_pos].begin;  // removed
      if (right.next >= 0 && static_cast<std::size_t>(right.next) < sym.size())
        sym[static_cast<std::size_t>(right.next)].prev = static_cast<std::int64_t>(top.pos);
      if (cur.prev >= 0) {
        const auto prev = static_cast<std::size_t>(cur.prev);
        auto m = merges.find(key(sym[prev].id, cur.id));
        if (m != merges.end()) queue.push({prev, m->second.first, m->second.second});
      }
      if (cur.next >= 0 && static_cast<std::size_t>(cur.next) < sym.size()) {
        auto m = merges.find(key(cur.id, sym[static_cast<std::size_t>(cur.next)].id));
        if (m != merges.end()) queue.push({top.pos, m->second.first, m->second.second});
      }
    }
    std::vector<Tok> out;
    for (const Symbol& s : sym)
      if (s.end != s.begin) out.push_back({s.id, s.begin, s.end});
    return out;
  }

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<Tok>> cache_;
};

// A post-processor template item: a special token's ids, or the sequence.
struct PostItem {
  bool sequence = false;
  std::vector<std::int32_t> ids;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string source;
  TokenizerKind kind = TokenizerKind::kByteLevelBpe;
  std::vector<AddedToken> added;
  AddedMatcher raw_matcher, normalized_matcher;
  std::vector<NormStep> normalizer;
  std::vector<PreStep> pre_tokenizer;
  BpeModel model;
  std::vector<std::string> id_to_token;  // model vocabulary and added tokens; "" = unused id
  std::vector<bool> id_used;
  std::unordered_map<std::string, std::int32_t> added_by_content;
  std::unordered_set<std::int32_t> special_ids;
  std::unordered_set<std::int32_t> skip_ids;  // special tokens decode(skip_special_tokens) drops
  std::vector<PostItem> post;                 // empty = nothing added
  bool has_decoder = false;
  std::vector<DecStep> decoder;
  std::optional<std::int32_t> bos, eos;

  void finish_added() {
    for (std::size_t k = 0; k < added.size(); ++k) {
      const AddedToken& t = added[k];
      added_by_content[t.content] = t.id;
      if (t.special) special_ids.insert(t.id);
      std::string text = t.content;
      if (!t.normalized) {
        raw_matcher.add(t.content, k);
      } else {
        Piece p;
        push(p, t.content, 0);
        for (const NormStep& s : normalizer)
          p = apply_norm(s, std::move(p));
        text = p.text;
        normalized_matcher.add(p.text, k);
      }
      // As `tokenizers`: a normalised added token decodes from its normalised text, and decode
      // skips a special token by its text, which a normaliser may have changed.
      set_id(t.id, text);
      if (t.special && text == t.content) skip_ids.insert(t.id);
    }
    raw_matcher.finish();
    normalized_matcher.finish();
  }
  void set_id(std::int32_t id, const std::string& token) {
    const auto i = static_cast<std::size_t>(id);
    if (i >= id_to_token.size()) {
      id_to_token.resize(i + 1);
      id_used.resize(i + 1, false);
    }
    id_to_token[i] = token;
    id_used[i] = true;
  }

  // Splits `p` on added tokens found by `matcher`, as AddedVocabulary::find_matches.
  // A piece without added tokens is moved, not copied (the whole of a long text is one).
  void split_added(Piece p, const AddedMatcher& matcher, std::vector<Piece>& out) const {
    const auto matches =
        matcher.empty() ? std::vector<std::array<std::size_t, 3>>{} : matcher.find_all(p.text);
    if (matches.empty()) {
      if (!p.text.empty()) out.push_back(std::move(p));
      return;
    }
    const std::string& s = p.text;
    std::size_t start_offset = 0;
    for (const auto& m : matches) {
      std::size_t start = m[0], stop = m[1];
      const AddedToken& t = added[m[2]];
      if (t.single_word) {
        const bool start_space =
            start == 0 || !ends_with_word(std::string_view(s).substr(0, start));
        const bool stop_space =
            stop == s.size() || !starts_with_word(std::string_view(s).substr(stop));
        if (!start_space || !stop_space) continue;
      }
      // lstrip takes the white space before the token (but not text already cut off), rstrip
      // the white space after it.
      if (t.lstrip)
        start = std::max(unicode::strip(s, 0, start, false, true, unicode::is_white_space).second,
                         start_offset);
      if (t.rstrip)
        stop = unicode::strip(s, stop, s.size(), true, false, unicode::is_white_space).first;
      if (start_offset < start) out.push_back(slice(p, start_offset, start));
      Piece tok = slice(p, start, stop);
      tok.token = t.id;
      out.push_back(std::move(tok));
      start_offset = stop;
    }
    if (start_offset < s.size()) out.push_back(slice(p, start_offset, s.size()));
  }

  // Offsets (16 bytes a token) only when asked for: encode() of a long text needs the ids alone.
  Encoding encode(std::string_view text, bool add_special_tokens, bool with_offsets) const {
    const std::size_t bad = unicode::find_invalid(text);
    if (bad != std::string_view::npos)
      throw Error(source + ": text to encode is not valid UTF-8 (byte " + std::to_string(bad) +
                  " of " + std::to_string(text.size()) + ")");
    Encoding enc;
    auto emit = [&](std::int32_t id, std::size_t b, std::size_t e) {
      enc.ids.push_back(id);
      if (with_offsets) enc.offsets.emplace_back(b, e);
    };
    // End of the input character that starts at byte `o`.
    auto char_end = [&](std::uint32_t o) {
      return o + unicode::char_len(static_cast<unsigned char>(text[o]));
    };
    Piece whole;
    whole.text.assign(text);
    whole.orig.resize(text.size());
    for (std::size_t i = 0; i < text.size();) {
      const std::size_t n = unicode::char_len(static_cast<unsigned char>(text[i]));
      std::fill_n(whole.orig.begin() + static_cast<std::ptrdiff_t>(i), n,
                  static_cast<std::uint32_t>(i));
      i += n;
    }
    // Pieces are moved from stage to stage: a long text is held about twice (a normaliser's input
    // and output), never once per stage.
    std::vector<Piece> stage1;
    split_added(std::move(whole), raw_matcher, stage1);
    for (Piece& p1 : stage1) {
      if (p1.token >= 0) {
        emit(p1.token, p1.orig.front(), char_end(p1.orig.back()));
        continue;
      }
      Piece normalized = std::move(p1);
      for (const NormStep& s : normalizer)
        normalized = apply_norm(s, std::move(normalized));
      std::vector<Piece> stage2;
      split_added(std::move(normalized), normalized_matcher, stage2);
      for (Piece& p2 : stage2) {
        if (p2.token >= 0) {
          emit(p2.token, p2.orig.front(), char_end(p2.orig.back()));
          continue;
        }
        // Depth first: each word goes through the remaining pre-tokenizer steps and the model as
        // soon as it is cut, so a long text costs its bytes and cut list, not a Piece per word.
        auto pre = [&](auto& self, Piece w, std::size_t k) -> void {
          if (k == pre_tokenizer.size()) {
            for (const BpeModel::Tok& t : model.tokenize(w.text))
              emit(t.id, w.orig[t.begin], char_end(w.orig[t.end - 1]));
            return;
          }
          apply_pre(pre_tokenizer[k], std::move(w),
                    [&](Piece q) { self(self, std::move(q), k + 1); });
        };
        pre(pre, std::move(p2), 0);
      }
    }
    if (add_special_tokens && !post.empty()) {
      Encoding out;
      for (const PostItem& item : post) {
        if (item.sequence) {
          out.ids.insert(out.ids.end(), enc.ids.begin(), enc.ids.end());
          if (with_offsets)
            out.offsets.insert(out.offsets.end(), enc.offsets.begin(), enc.offsets.end());
        } else {
          for (std::int32_t id : item.ids) {
            out.ids.push_back(id);
            if (with_offsets) out.offsets.emplace_back(0, 0);
          }
        }
      }
      return out;
    }
    return enc;
  }
};

namespace {

// ---------------------------------------------------------------------------------------------
// tokenizer.json parsing. Every error names the file and the JSON path of the construct.

struct Parser {
  const std::string& source;
  // Ids run 0 .. id_limit - 1: model.vocab and added_tokens cannot hold more distinct ids than
  // they have entries, so a larger id is a corrupt file (and would size id_to_token by it).
  std::int64_t id_limit = 0;

  [[noreturn]] void fail(const std::string& path, const std::string& msg) const {
    throw Error(source + ": " + path + ": " + msg);
  }
  const json& field(const json& obj, const std::string& path, const char* key) const {
    if (!obj.is_object() || !obj.contains(key))
      fail(path, std::string("missing field '") + key + "'");
    return obj.at(key);
  }
  std::string str(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_string()) fail(path + "." + key, "expected a string, got " + v.dump());
    return v.get<std::string>();
  }
  bool flag(const json& obj, const std::string& path, const char* key, bool fallback) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    if (!obj.at(key).is_boolean()) fail(path + "." + key, "expected true or false");
    return obj.at(key).get<bool>();
  }
  std::string type_of(const json& obj, const std::string& path) const {
    if (!obj.is_object()) fail(path, "expected an object, got " + obj.dump().substr(0, 80));
    return str(obj, path, "type");
  }
  const json& list(const json& obj, const std::string& path, const char* key) const {
    const json& v = field(obj, path, key);
    if (!v.is_array()) fail(path + "." + key, "expected a list");
    return v;
  }

  // A JSON integer >= 0 as the number it is: get<std::int32_t>() would truncate 5000000000 to
  // 705032704 and wrap 4294967295 to -1.
  static std::optional<std::uint64_t> non_negative(const json& v) {
    if (v.is_number_unsigned()) return v.get<std::uint64_t>();
    if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
      return static_cast<std::uint64_t>(v.get<std::int64_t>());
    return std::nullopt;
  }

  // A token id in 0 .. id_limit - 1, checked before narrowing.
  std::int32_t token_id(const json& v, const std::string& path) const {
    const auto id = non_negative(v);
    if (!id) fail(path, "expected a token id (an integer >= 0), got " + v.dump());
    if (*id >= static_cast<std::uint64_t>(id_limit))
      fail(path, "id " + std::to_string(*id) + " is outside 0.." + std::to_string(id_limit - 1) +
                     " (model.vocab and added_tokens hold " + std::to_string(id_limit) +
                     " entries); the file is corrupt");
    return static_cast<std::int32_t>(*id);
  }

  // An id the post-processor adds: it must be a token of the vocabulary or added_tokens (both are
  // parsed by then), or decode and chat templates would meet an id without a token.
  std::int32_t used_id(const json& v, const std::string& path, const Tokenizer::Impl& t) const;

  Pattern pattern(const json& obj, const std::string& path) const {
    const json& p = field(obj, path, "pattern");
    Pattern out;
    if (p.is_object() && p.contains("String") && p.at("String").is_string()) {
      out.literal = p.at("String").get<std::string>();
    } else if (p.is_object() && p.contains("Regex") && p.at("Regex").is_string()) {
      out.regex = std::make_shared<Regex>(p.at("Regex").get<std::string>(),
                                          source + ": " + path + ".pattern");
    } else {
      fail(path + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}, got " + p.dump());
    }
    return out;
  }

  void normalizer(const json& n, const std::string& path, std::vector<NormStep>& out) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "normalizers");
      for (std::size_t i = 0; i < items.size(); ++i)
        normalizer(items[i], path + ".normalizers[" + std::to_string(i) + "]", out);
    } else if (type == "Prepend") {
      out.push_back(NormPrepend{str(n, path, "prepend")});
    } else if (type == "Replace") {
      out.push_back(NormReplace{pattern(n, path), str(n, path, "content")});
    } else if (type == "NFC" || type == "NFD") {
      out.push_back(NormUnicode{type == "NFC"});
    } else if (type == "Strip") {
      out.push_back(
          NormStrip{flag(n, path, "strip_left", true), flag(n, path, "strip_right", true)});
    } else {
      fail(path + ".type", "normalizer '" + type +
                               "' is not supported (supported: Sequence, Prepend, Replace, NFC, "
                               "NFD, Strip)");
    }
  }

  PrependScheme scheme(const json& n, const std::string& path) const {
    if (n.contains("prepend_scheme") && !n.at("prepend_scheme").is_null()) {
      const std::string s = str(n, path, "prepend_scheme");
      if (s == "first") return PrependScheme::kFirst;
      if (s == "always") return PrependScheme::kAlways;
      if (s == "never") return PrependScheme::kNever;
      fail(path + ".prepend_scheme", "'" + s + "' is not one of first, always, never");
    }
    return flag(n, path, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
  }

  std::string replacement(const json& n, const std::string& path) const {
    const std::string r = n.contains("replacement") ? str(n, path, "replacement") : "\xE2\x96\x81";
    std::size_t i = 0;
    if (r.empty() || (unicode::next(r, i), i != r.size()))
      fail(path + ".replacement", "must be one character, got " + json(r).dump());
    return r;
  }

  void pre_tokenizer(const json& n, const std::string& path, std::vector<PreStep>& out) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "pretokenizers");
      for (std::size_t i = 0; i < items.size(); ++i)
        pre_tokenizer(items[i], path + ".pretokenizers[" + std::to_string(i) + "]", out);
    } else if (type == "Split") {
      PreSplit s;
      s.pattern = pattern(n, path);
      const std::string b = str(n, path, "behavior");
      if (b == "Removed")
        s.behavior = SplitBehavior::kRemoved;
      else if (b == "Isolated")
        s.behavior = SplitBehavior::kIsolated;
      else if (b == "MergedWithPrevious")
        s.behavior = SplitBehavior::kMergedWithPrevious;
      else if (b == "MergedWithNext")
        s.behavior = SplitBehavior::kMergedWithNext;
      else if (b == "Contiguous")
        s.behavior = SplitBehavior::kContiguous;
      else
        fail(path + ".behavior", "'" + b +
                                     "' is not one of Removed, Isolated, MergedWithPrevious, "
                                     "MergedWithNext, Contiguous");
      s.invert = flag(n, path, "invert", false);
      out.push_back(std::move(s));
    } else if (type == "ByteLevel") {
      out.push_back(
          PreByteLevel{flag(n, path, "add_prefix_space", false), flag(n, path, "use_regex", true)});
    } else if (type == "Metaspace") {
      out.push_back(
          PreMetaspace{replacement(n, path), scheme(n, path), flag(n, path, "split", true)});
    } else if (type == "Digits") {
      PreSplit s;
      s.pattern.regex = std::make_shared<Regex>(R"(\p{N})", source + ": " + path);
      s.behavior = flag(n, path, "individual_digits", false) ? SplitBehavior::kIsolated
                                                             : SplitBehavior::kContiguous;
      out.push_back(std::move(s));
    } else {
      fail(path + ".type", "pre-tokenizer '" + type +
                               "' is not supported (supported: Sequence, Split, ByteLevel, "
                               "Metaspace, Digits)");
    }
  }

  void decoder(const json& n, const std::string& path, std::vector<DecStep>& out) const {
    const std::string type = type_of(n, path);
    if (type == "Sequence") {
      const json& items = list(n, path, "decoders");
      for (std::size_t i = 0; i < items.size(); ++i)
        decoder(items[i], path + ".decoders[" + std::to_string(i) + "]", out);
    } else if (type == "ByteLevel") {
      out.push_back(DecByteLevel{});
    } else if (type == "Replace") {
      out.push_back(DecReplace{pattern(n, path), str(n, path, "content")});
    } else if (type == "ByteFallback") {
      out.push_back(DecByteFallback{});
    } else if (type == "Fuse") {
      out.push_back(DecFuse{});
    } else if (type == "Strip") {
      const std::string c = str(n, path, "content");
      std::size_t i = 0;
      if (c.empty() || (unicode::next(c, i), i != c.size()))
        fail(path + ".content", "must be one character");
      std::size_t j = 0;
      const json& start = field(n, path, "start");
      const json& stop = field(n, path, "stop");
      if (!start.is_number_unsigned() || !stop.is_number_unsigned())
        fail(path, "start and stop must be non-negative integers");
      out.push_back(
          DecStrip{unicode::next(c, j), start.get<std::size_t>(), stop.get<std::size_t>()});
    } else if (type == "Metaspace") {
      out.push_back(DecMetaspace{replacement(n, path), scheme(n, path)});
    } else {
      fail(path + ".type", "decoder '" + type +
                               "' is not supported (supported: Sequence, ByteLevel, Replace, "
                               "ByteFallback, Fuse, Strip, Metaspace)");
    }
  }

  // Template items of a post-processor (ids only: type ids and pairs do not matter here).
  void post_processor(const json& n, const std::string& path, Tokenizer::Impl& t) const {
    if (n.is_null()) return;
    const std::string type = type_of(n, path);
    auto special = [&](const std::string& content, const std::string& where) {
      auto id = t.added_by_content.find(content);
      if (id != t.added_by_content.end()) return id->second;
      auto v = t.model.vocab.find(content);
      if (v != t.model.vocab.end()) return v->second;
      fail(where, "token " + json(content).dump() + " is not in the vocabulary");
    };
    if (type == "Sequence") {
      const json& items = list(n, path, "processors");
      for (std::size_t i = 0; i < items.size(); ++i)
        post_processor(items[i], path + ".processors[" + std::to_string(i) + "]", t);
    } else if (type == "ByteLevel") {
      // Offsets only; ids unchanged.
    } else if (type == "TemplateProcessing") {
      const json& single = list(n, path, "single");
      const json& specials = n.contains("special_tokens") ? n.at("special_tokens") : json::object();
      std::vector<PostItem> items;
      for (std::size_t i = 0; i < single.size(); ++i) {
        const std::string where = path + ".single[" + std::to_string(i) + "]";
        const json& item = single[i];
        if (item.contains("Sequence")) {
          items.push_back({true, {}});
        } else if (item.contains("SpecialToken")) {
          const std::string id = str(item.at("SpecialToken"), where + ".SpecialToken", "id");
          PostItem p;
          if (specials.contains(id) && specials.at(id).contains("ids")) {
            const std::string ids_path = path + ".special_tokens." + id + ".ids";
            const json& ids = specials.at(id).at("ids");
            if (!ids.is_array()) fail(ids_path, "expected a list of token ids");
            for (std::size_t k = 0; k < ids.size(); ++k)
              p.ids.push_back(used_id(ids[k], ids_path + "[" + std::to_string(k) + "]", t));
          } else {
            p.ids.push_back(special(id, where));
          }
          items.push_back(std::move(p));
        } else {
          fail(where, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
      t.post = std::move(items);
    } else if (type == "RobertaProcessing" || type == "BertProcessing") {
      auto token = [&](const char* key) {
        const json& v = field(n, path, key);
        if (!v.is_array() || v.size() != 2 || !v[0].is_string())
          fail(path + "." + key, "expected [token, id]");
        return used_id(v[1], path + "." + key + "[1]", t);
      };
      t.post = {{false, {token("cls")}}, {true, {}}, {false, {token("sep")}}};
    } else {
      fail(path + ".type", "post-processor '" + type +
                               "' is not supported (supported: Sequence, ByteLevel, "
                               "TemplateProcessing, RobertaProcessing, BertProcessing)");
    }
  }

  void model(const json& m, Tokenizer::Impl& t) const {
    const std::string type = type_of(m, "model");
    if (type != "BPE") fail("model.type", "model '" + type + "' is not supported (supported: BPE)");
    if (m.contains("dropout") && !m.at("dropout").is_null() &&
        !(m.at("dropout").is_number() && m.at("dropout").get<double>() == 0.0))
      fail("model.dropout", "BPE dropout makes encoding random; set it to null for inference");
    const json& vocab = field(m, "model", "vocab");
    if (!vocab.is_object()) fail("model.vocab", "expected an object {token: id}");
    BpeModel& bpe = t.model;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      const std::int32_t id = token_id(it.value(), "model.vocab." + it.key());
      bpe.vocab[it.key()] = id;
      t.set_id(id, it.key());
    }
    auto opt_str = [&](const char* key) {
      return m.contains(key) && !m.at(key).is_null() ? str(m, "model", key) : std::string();
    };
    bpe.continuing_subword_prefix = opt_str("continuing_subword_prefix");
    bpe.end_of_word_suffix = opt_str("end_of_word_suffix");
    const json& merges = list(m, "model", "merges");
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const json& e = merges[i];
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail("model.merges[" + std::to_string(i) + "]",
               "expected \"left right\" with one space, got " + e.dump());
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        fail("model.merges[" + std::to_string(i) + "]", "expected \"a b\" or [\"a\", \"b\"]");
      }
      add_merge(bpe, a, b, static_cast<std::int32_t>(i), "model.merges[" + std::to_string(i) + "]");
    }
    bpe.fuse_unk = flag(m, "model", "fuse_unk", false);
    bpe.byte_fallback = flag(m, "model", "byte_fallback", false);
    bpe.ignore_merges = flag(m, "model", "ignore_merges", false);
    const std::string unk = opt_str("unk_token");
    if (!unk.empty()) {
      auto it = bpe.vocab.find(unk);
      if (it == bpe.vocab.end())
        fail("model.unk_token", "unknown token " + json(unk).dump() + " is not in model.vocab");
      bpe.unk_id = it->second;
    }
    fill_byte_ids(bpe);
  }

  void add_merge(BpeModel& bpe, const std::string& a, const std::string& b, std::int32_t rank,
                 const std::string& where) const {
    auto ia = bpe.vocab.find(a), ib = bpe.vocab.find(b);
    if (ia == bpe.vocab.end() || ib == bpe.vocab.end())
      fail(where, "merge of " + json(a).dump() + " and " + json(b).dump() +
                      ": a part is not in the vocabulary");
    std::string joined = a;
    if (!bpe.continuing_subword_prefix.empty() &&
        b.compare(0, bpe.continuing_subword_prefix.size(), bpe.continuing_subword_prefix) == 0)
      joined += b.substr(bpe.continuing_subword_prefix.size());
    else
      joined += b;
    auto ij = bpe.vocab.find(joined);
    if (ij == bpe.vocab.end())
      fail(where, "merge result " + json(joined).dump() + " is not in the vocabulary");
    bpe.merges.emplace(BpeModel::key(ia->second, ib->second), std::make_pair(rank, ij->second));
  }

  static void fill_byte_ids(BpeModel& bpe) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      auto it = bpe.vocab.find(name);
      bpe.byte_ids[static_cast<std::size_t>(b)] = it == bpe.vocab.end() ? -1 : it->second;
    }
  }

  void added_tokens(const json& list_json, Tokenizer::Impl& t) const {
    if (list_json.is_null()) return;
    if (!list_json.is_array()) fail("added_tokens", "expected a list");
    for (std::size_t i = 0; i < list_json.size(); ++i) {
      const std::string path = "added_tokens[" + std::to_string(i) + "]";
      const json& a = list_json[i];
      AddedToken tok;
      tok.id = token_id(field(a, path, "id"), path + ".id");
      tok.content = str(a, path, "content");
      tok.special = flag(a, path, "special", false);
      tok.lstrip = flag(a, path, "lstrip", false);
      tok.rstrip = flag(a, path, "rstrip", false);
      tok.single_word = flag(a, path, "single_word", false);
      tok.normalized = flag(a, path, "normalized", !tok.special);
      t.added.push_back(std::move(tok));
    }
  }
};

std::int32_t Parser::used_id(const json& v, const std::string& path,
                             const Tokenizer::Impl& t) const {
  const auto id = non_negative(v);
  if (!id) fail(path, "expected a token id (an integer >= 0), got " + v.dump());
  if (*id >= t.id_to_token.size() || !t.id_used[*id])
    fail(path, "id " + std::to_string(*id) + " is not the id of a token in model.vocab or " +
                   "added_tokens");
  return static_cast<std::int32_t>(*id);
}

// A token given in tokenizer_config.json as "<s>" or {"content": "<s>", ...}.
std::optional<std::string> config_token(const json& cfg, const char* key) {
  if (!cfg.contains(key)) return std::nullopt;
  const json& v = cfg.at(key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string())
    return v.at("content").get<std::string>();
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(source + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(source + ": expected a JSON object (a tokenizer.json)");
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  Parser p{source};
  if (!j.contains("model")) p.fail("model", "missing (is this a Hugging Face tokenizer.json?)");
  const json& m = j.at("model");
  std::size_t entries = 0;
  if (m.is_object() && m.contains("vocab") && m.at("vocab").is_object())
    entries += m.at("vocab").size();
  if (j.contains("added_tokens") && j.at("added_tokens").is_array())
    entries += j.at("added_tokens").size();
  p.id_limit = static_cast<std::int64_t>(
      std::min<std::size_t>(entries, std::numeric_limits<std::int32_t>::max()));
  p.model(m, *impl);
  if (j.contains("normalizer")) p.normalizer(j.at("normalizer"), "normalizer", impl->normalizer);
  if (j.contains("pre_tokenizer"))
    p.pre_tokenizer(j.at("pre_tokenizer"), "pre_tokenizer", impl->pre_tokenizer);
  if (j.contains("added_tokens")) p.added_tokens(j.at("added_tokens"), *impl);
  impl->finish_added();
  if (j.contains("post_processor"))
    p.post_processor(j.at("post_processor"), "post_processor", *impl);
  if (j.contains("decoder") && !j.at("decoder").is_null()) {
    impl->has_decoder = true;
    p.decoder(j.at("decoder"), "decoder", impl->decoder);
  }
  impl->kind = std::any_of(impl->pre_tokenizer.begin(), impl->pre_tokenizer.end(),
                           [](const PreStep& s) { return std::holds_alternative<PreByteLevel>(s); })
                   ? TokenizerKind::kByteLevelBpe
                   : TokenizerKind::kSentencePieceBpe;
  // BOS: the special token the template puts before the sequence.
  for (const PostItem& item : impl->post) {
    if (item.sequence) break;
    if (!item.ids.empty()) impl->bos = item.ids.front();
  }
  if (!impl->post.empty() && !impl->post.back().sequence && !impl->post.back().ids.empty())
    impl->eos = impl->post.back().ids.back();
  return Tokenizer(std::move(impl));
}

json read_tokenizer_config(const std::string& path) {
  json cfg;
  try {
    cfg = json::parse(read_text_file(path, "tokenizer config"));
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too large
    throw Error(path + ": not valid JSON: " + e.what());
  }
  if (!cfg.is_object()) throw Error(path + ": expected a JSON object (a tokenizer_config.json)");
  return cfg;
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  Tokenizer t = from_json(read_text_file(path, "tokenizer", kTokenizerFileLimit), path);
  // bos/eos from a tokenizer_config.json beside it.
  const std::size_t slash = path.find_last_of('/');
  const std::string config =
      (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
      "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(config, ec)) return t;
  const json cfg = read_tokenizer_config(config);
  auto impl = std::const_pointer_cast<Impl>(t.impl_);
  if (auto bos = config_token(cfg, "bos_token"))
    if (auto id = t.token_to_id(*bos)) impl->bos = *id;
  if (auto eos = config_token(cfg, "eos_token"))
    if (auto id = t.token_to_id(*eos)) impl->eos = *id;
  return t;
}

Tokenizer Tokenizer::from_spec(const TokenizerSpec& spec, const std::string& source) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  impl->kind = spec.kind;
  Parser p{source};
  const auto n = static_cast<std::int32_t>(spec.tokens.size());
  auto check_id = [&](std::int32_t id, const char* what) {
    if (id < -1 || id >= n)
      p.fail(what, "id " + std::to_string(id) + " is outside the vocabulary of " +
                       std::to_string(n) + " tokens");
  };
  check_id(spec.unk_id, "unk_id");
  check_id(spec.bos_id, "bos_id");
  check_id(spec.eos_id, "eos_id");
  BpeModel& bpe = impl->model;
  for (std::int32_t id = 0; id < n; ++id) {
    bpe.vocab.emplace(spec.tokens[static_cast<std::size_t>(id)], id);  // first id wins
    impl->set_id(id, spec.tokens[static_cast<std::size_t>(id)]);
  }
  for (std::size_t i = 0; i < spec.merges.size(); ++i)
    p.add_merge(bpe, spec.merges[i].first, spec.merges[i].second, static_cast<std::int32_t>(i),
                "merges[" + std::to_string(i) + "]");
  const bool sp = spec.kind == TokenizerKind::kSentencePieceBpe;
  if (sp && spec.merges.empty()) {
    if (spec.scores.size() != spec.tokens.size())
      p.fail("scores", "SentencePiece tokenizers without merges need one score per token (" +
                           std::to_string(spec.scores.size()) + " scores, " + std::to_string(n) +
                           " tokens)");
    // Every split of a token into two tokens is a merge, ranked by the token's score.
    std::vector<std::int32_t> order(static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i)
      order[static_cast<std::size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return spec.scores[static_cast<std::size_t>(a)] > spec.scores[static_cast<std::size_t>(b)];
    });
    // As transformers' SentencePiece conversion: tokens by descending score, and within a token
    // its splits by (left id, right id); each gets the next rank.
    std::int32_t rank = 0;
    for (std::int32_t id : order) {
      const std::string& tok = spec.tokens[static_cast<std::size_t>(id)];
      std::vector<std::pair<std::int32_t, std::int32_t>> splits;
      for (std::size_t cut = 1; cut < tok.size(); ++cut) {
        if ((static_cast<unsigned char>(tok[cut]) & 0xC0) == 0x80) continue;
        auto a = bpe.vocab.find(tok.substr(0, cut)), b = bpe.vocab.find(tok.substr(cut));
        if (a != bpe.vocab.end() && b != bpe.vocab.end()) splits.emplace_back(a->second, b->second);
      }
      std::sort(splits.begin(), splits.end());
      for (auto [a, b] : splits)
        bpe.merges.emplace(BpeModel::key(a, b), std::make_pair(rank++, bpe.vocab.at(tok)));
    }
  }
  if (sp) {
    bpe.byte_fallback = spec.byte_fallback;
    bpe.unk_id = spec.unk_id;
    bpe.fuse_unk = true;
    Parser::fill_byte_ids(bpe);
    impl->pre_tokenizer.push_back(
        PreMetaspace{"\xE2\x96\x81",
                     spec.add_space_prefix ? PrependScheme::kFirst : PrependScheme::kNever, false});
    impl->has_decoder = true;
    impl->decoder = {DecReplace{Pattern{"\xE2\x96\x81", nullptr}, " "}, DecByteFallback{},
                     DecFuse{}, DecStrip{U' ', spec.add_space_prefix ? 1u : 0u, 0}};
  } else {
    bpe.ignore_merges = spec.ignore_merges;
    if (spec.nfc) impl->normalizer.push_back(NormUnicode{true});
    for (std::size_t i = 0; i < spec.split_regexes.size(); ++i)
      impl->pre_tokenizer.push_back(PreSplit{
          Pattern{"", std::make_shared<Regex>(spec.split_regexes[i], source + ": split_regexes[" +
                                                                         std::to_string(i) + "]")},
          SplitBehavior::kIsolated, false});
    impl->pre_tokenizer.push_back(
        PreByteLevel{false, spec.split_regexes.empty() || spec.gpt2_split_after});
    impl->has_decoder = true;
    impl->decoder = {DecByteLevel{}};
  }
  auto add = [&](std::int32_t id, bool special, const char* what) {
    check_id(id, what);
    if (id < 0) return;
    AddedToken t;
    t.id = id;
    t.content = spec.tokens[static_cast<std::size_t>(id)];
    t.special = special;
    t.normalized = false;
    impl->added.push_back(std::move(t));
  };
  for (std::int32_t id : spec.special_ids)
    add(id, true, "special_ids");
  for (std::int32_t id : spec.added_ids)
    add(id, false, "added_ids");
  impl->finish_added();
  if (spec.bos_id >= 0) impl->bos = spec.bos_id;
  if (spec.eos_id >= 0) impl->eos = spec.eos_id;
  if ((spec.add_bos && spec.bos_id >= 0) || (spec.add_eos && spec.eos_id >= 0)) {
    if (spec.add_bos && spec.bos_id >= 0) impl->post.push_back({false, {spec.bos_id}});
    impl->post.push_back({true, {}});
    if (spec.add_eos && spec.eos_id >= 0) impl->post.push_back({false, {spec.eos_id}});
  }
  return Tokenizer(std::move(impl));
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens, /*with_offsets=*/false).ids;
}

Tokenizer::Encoding Tokenizer::encode_with_offsets(std::string_view text,
                                                   bool add_special_tokens) const {
  return impl_->encode(text, add_special_tokens, /*with_offsets=*/true);
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids,
                              bool skip_special_tokens) const {
  auto each_token = [&](auto&& f) {
    for (std::int32_t id : ids) {
      if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_to_token.size() ||
          !impl_->id_used[static_cast<std::size_t>(id)])
        continue;
      if (skip_special_tokens && impl_->skip_ids.count(id)) continue;
      f(impl_->id_to_token[static_cast<std::size_t>(id)]);
    }
  };
  // A decoder that starts with ByteLevel (GPT-2, Llama 3, Qwen) joins the tokens into one string
  // first: build that string straight from the ids, without a string per token (32 bytes and
  // more a token, the bulk of decoding a long text).
  std::vector<std::string> tokens;
  std::size_t first_step = 0;
  if (impl_->has_decoder && !impl_->decoder.empty() &&
      std::holds_alternative<DecByteLevel>(impl_->decoder.front())) {
    std::string bytes;
    each_token([&](const std::string& t) { append_byte_level(bytes, t); });
    tokens.push_back(unicode::lossy(bytes));
    first_step = 1;
  } else {
    tokens.reserve(ids.size());
    each_token([&](const std::string& t) { tokens.push_back(t); });
  }
  if (!impl_->has_decoder) {
    std::string out;
    for (std::size_t i = 0; i < tokens.size(); ++i)
      out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (std::size_t k = first_step; k < impl_->decoder.size(); ++k)
    tokens = apply_dec(impl_->decoder[k], std::move(tokens));
  std::string out;
  for (const std::string& t : tokens)
    out += t;
  return out;
}

std::int64_t Tokenizer::vocab_size() const {
  return static_cast<std::int64_t>(impl_->id_to_token.size());
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  auto a = impl_->added_by_content.find(key);
  if (a != impl_->added_by_content.end()) return a->second;
  auto v = impl_->model.vocab.find(key);
  if (v != impl_->model.vocab.end()) return v->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= impl_->id_to_token.size() ||
      !impl_->id_used[static_cast<std::size_t>(id)])
    return std::nullopt;
  return impl_->id_to_token[static_cast<std::size_t>(id)];
}

std::optional<std::int32_t> Tokenizer::bos_id() const {
  return impl_->bos;
}
std::optional<std::int32_t> Tokenizer::eos_id() const {
  return impl_->eos;
}
bool Tokenizer::is_special(std::int32_t id) const {
  return impl_->special_ids.count(id) > 0;
}
TokenizerKind Tokenizer::kind() const {
  return impl_->kind;
}
const std::string& Tokenizer::source() const {
  return impl_->source;
}

}  // namespace rondo::models
