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
//
// This file runs the stages; their types are in tokenizer_pipeline.h, the BPE model in
// tokenizer_bpe.cpp, the regexes in regex.cpp, and tokenizer.json reading in tokenizer_json.cpp.
// It touches only the text and the pipeline it is given. Used through Tokenizer (tokenizer.h).
#include "models/tokenizer.h"

#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <unordered_map>
#include <variant>

#include "kernels/error.h"
#include "models/tokenizer_bpe.h"
#include "models/tokenizer_pipeline.h"
#include "models/unicode.h"

namespace rondo::models {
namespace {

// ---------------------------------------------------------------------------------------------
// Pieces of text with per-byte original offsets. See Note [Byte offsets]. An untracked piece
// (encode without offsets) keeps no tags, 4 bytes a byte of text: only whether each byte's tag is
// 0 (its source is the input's first character), as the length of the run of such bytes that
// starts it. tag_at() reads either, and the stages see the same zero and non-zero tags, so the
// ids are the same tracked or not — as long as the tag-0 bytes lead their piece. They do except
// when a Unicode normaliser reorders the first character's combining marks behind another's;
// only a Split cutting between those marks, followed by Metaspace's "first", could then differ.

std::uint32_t tag_at(const Piece& p, std::size_t i) {
  return p.tracked ? p.orig[i] : (i < p.zero_prefix ? 0 : 1);
}

// An empty piece that tracks (or not) as `p` does.
Piece like(const Piece& p) {
  Piece out;
  out.tracked = p.tracked;
  return out;
}

// Appends `p`'s tags for its bytes [b, e) to `out` (whose text the caller extends by them).
void append_tags(Piece& out, const Piece& p, std::size_t b, std::size_t e) {
  if (out.tracked) {
    out.orig.insert(out.orig.end(), p.orig.begin() + static_cast<std::ptrdiff_t>(b),
                    p.orig.begin() + static_cast<std::ptrdiff_t>(e));
  } else if (out.zero_prefix == out.text.size() && b < p.zero_prefix) {
    out.zero_prefix += std::min(e, p.zero_prefix) - b;
  }
}

Piece slice(const Piece& p, std::size_t b, std::size_t e) {
  Piece out = like(p);
  append_tags(out, p, b, e);
  out.text = p.text.substr(b, e - b);
  return out;
}

// Appends `s` to `out`, every byte tagged `tag`.
void push(Piece& out, std::string_view s, std::uint32_t tag) {
  if (out.tracked)
    out.orig.insert(out.orig.end(), s.size(), tag);
  else if (tag == 0 && out.zero_prefix == out.text.size())
    out.zero_prefix += s.size();
  out.text.append(s);
}

// Replaces every match [b, e) with `content`; inserted bytes take the tag of the first replaced
// byte. `for_each_match(f)` calls f(b, e) for each match of p.text, left to right.
template <typename ForEachMatch>
Piece replace_ranges(const Piece& p, ForEachMatch&& for_each_match, const std::string& content) {
  Piece out = like(p);
  std::size_t prev = 0;
  for_each_match([&](std::size_t b, std::size_t e) {
    append_tags(out, p, prev, b);
    out.text.append(p.text, prev, b - prev);
    push(out, content, tag_at(p, b));
    prev = e;
  });
  append_tags(out, p, prev, p.text.size());
  out.text.append(p.text, prev, std::string::npos);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Normalisers.

Piece normalize_unicode(Piece p, bool compose) {
  if (unicode::below_combining(p.text)) return p;
  std::vector<char32_t> cps;
  std::vector<std::uint32_t> tags;
  for (std::size_t i = 0; i < p.text.size();) {
    const std::uint32_t tag = tag_at(p, i);
    cps.push_back(unicode::next(p.text, i));
    tags.push_back(tag);
  }
  if (compose)
    unicode::nfc(cps, tags);
  else
    unicode::nfd(cps, tags);
  Piece out = like(p);
  for (std::size_t k = 0; k < cps.size(); ++k) {
    std::string c;
    unicode::append(c, cps[k]);
    push(out, c, tags[k]);
  }
  return out;
}

// Takes `p` by value: a step that changes nothing (the common case on plain text) moves it through.
Piece apply_norm(const NormStep& step, Piece p) {
  if (auto* s = std::get_if<NormPrepend>(&step)) {
    if (p.text.empty()) return p;
    Piece out = like(p);
    push(out, s->prepend, tag_at(p, 0));
    append_tags(out, p, 0, p.text.size());
    out.text += p.text;
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
  Piece out = like(p);
  out.text.reserve(p.text.size() * 2);
  if (out.tracked) out.orig.reserve(p.text.size() * 2);
  for (std::size_t i = 0; i < p.text.size(); ++i)
    push(out, bm.to_char[static_cast<unsigned char>(p.text[i])], tag_at(p, i));
  return out;
}

// One pre-tokenizer step on `p`: each resulting piece goes to `f`, in order, as soon as it is cut
// (the pieces of a long text are never all held at once; see Tokenizer's encode).
template <typename F>
void apply_pre(const PreStep& step, Piece p, F&& f) {
  if (auto* s = std::get_if<PreSplit>(&step)) {
    // A piece the pattern leaves whole (Digits on text without digits: most text) moves on
    // instead of being copied: a long text would otherwise be held twice, its per-byte offsets
    // (4 bytes a byte) included. Only once the scan is over: a match over the whole text is
    // reported while the regex still reads it.
    bool scanning = true;
    for_each_cut(
        p.text.size(),
        [&](auto&& g) {
          s->pattern.for_each(p.text, g);
          scanning = false;
        },
        s->behavior, s->invert,
        [&](std::size_t b, std::size_t e) {
          if (!scanning && b == 0 && e == p.text.size())
            f(std::move(p));
          else
            f(slice(p, b, e));
        });
    return;
  }
  if (auto* s = std::get_if<PreByteLevel>(&step)) {
    if (s->add_prefix_space && !p.text.empty() && p.text[0] != ' ') {
      Piece q = like(p);
      push(q, " ", tag_at(p, 0));
      append_tags(q, p, 0, p.text.size());
      q.text += p.text;
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
  const bool at_origin = !p.text.empty() && tag_at(p, 0) == 0;
  Piece q = replace_ranges(
      p, [&](auto&& g) { for_each_literal(p.text, " ", g); }, ms.replacement);
  const bool starts = q.text.compare(0, ms.replacement.size(), ms.replacement) == 0;
  const bool prepend = !starts && (ms.prepend_scheme == PrependScheme::kAlways ||
                                   (ms.prepend_scheme == PrependScheme::kFirst && at_origin));
  if (prepend && !q.text.empty()) {
    Piece r = like(q);
    push(r, ms.replacement, tag_at(q, 0));
    append_tags(r, q, 0, q.text.size());
    r.text += q.text;
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
// Added tokens: word boundaries for single_word (the matching is AddedMatcher's).

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

}  // namespace

// ---------------------------------------------------------------------------------------------

void Tokenizer::Impl::finish_added() {
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

void Tokenizer::Impl::split_added(Piece p, const AddedMatcher& matcher,
                                  std::vector<Piece>& out) const {
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
      const bool start_space = start == 0 || !ends_with_word(std::string_view(s).substr(0, start));
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

Tokenizer::Encoding Tokenizer::Impl::encode(std::string_view text, bool add_special_tokens,
                                            bool with_offsets) const {
  const std::size_t bad = unicode::find_invalid(text);
  if (bad != std::string_view::npos)
    throw Error(source + ": text to encode is not valid UTF-8 (byte " + std::to_string(bad) +
                " of " + std::to_string(text.size()) + ")");
  Encoding enc;
  // Token `id` made of the bytes [b, e) of `w`: its offsets are the input characters they come
  // from (only read with offsets: without, `w` has no tags).
  auto emit = [&](std::int32_t id, const Piece& w, std::size_t b, std::size_t e) {
    enc.ids.push_back(id);
    if (!with_offsets) return;
    const std::uint32_t last = w.orig[e - 1];
    enc.offsets.emplace_back(w.orig[b],
                             last + unicode::char_len(static_cast<unsigned char>(text[last])));
  };
  // Without offsets the text is not tagged byte by byte (4 bytes a byte: most of what a long
  // line costs here); its first character is the first run of tag-0 bytes.
  Piece whole;
  whole.text.assign(text);
  whole.tracked = with_offsets;
  if (with_offsets) {
    whole.orig.resize(text.size());
    for (std::size_t i = 0; i < text.size();) {
      const std::size_t n = unicode::char_len(static_cast<unsigned char>(text[i]));
      std::fill_n(whole.orig.begin() + static_cast<std::ptrdiff_t>(i), n,
                  static_cast<std::uint32_t>(i));
      i += n;
    }
  } else if (!text.empty()) {
    whole.zero_prefix = unicode::char_len(static_cast<unsigned char>(text[0]));
  }
  // Pieces are moved from stage to stage: a long text is held about twice (a normaliser's input
  // and output), never once per stage.
  std::vector<Piece> stage1;
  split_added(std::move(whole), raw_matcher, stage1);
  for (Piece& p1 : stage1) {
    if (p1.token >= 0) {
      emit(p1.token, p1, 0, p1.text.size());
      continue;
    }
    Piece normalized = std::move(p1);
    for (const NormStep& s : normalizer)
      normalized = apply_norm(s, std::move(normalized));
    std::vector<Piece> stage2;
    split_added(std::move(normalized), normalized_matcher, stage2);
    for (Piece& p2 : stage2) {
      if (p2.token >= 0) {
        emit(p2.token, p2, 0, p2.text.size());
        continue;
      }
      // Depth first: each word goes through the remaining pre-tokenizer steps and the model as
      // soon as it is cut, so a long text costs its bytes and cut list, not a Piece per word.
      auto pre = [&](auto& self, Piece w, std::size_t k) -> void {
        if (k == pre_tokenizer.size()) {
          for (const BpeModel::Tok& t : model.tokenize(w.text))
            emit(t.id, w, t.begin, t.end);
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

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_spec(const TokenizerSpec& spec, const std::string& source) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  impl->kind = spec.kind;
  auto fail = [&](const std::string& path, const std::string& msg) {
    throw Error(source + ": " + path + ": " + msg);
  };
  const auto n = static_cast<std::int32_t>(spec.tokens.size());
  auto check_id = [&](std::int32_t id, const char* what) {
    if (id < -1 || id >= n)
      fail(what, "id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(n) +
                     " tokens");
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
    bpe.add_merge(spec.merges[i].first, spec.merges[i].second, static_cast<std::int32_t>(i), source,
                  "merges[" + std::to_string(i) + "]");
  const bool sp = spec.kind == TokenizerKind::kSentencePieceBpe;
  if (sp && spec.merges.empty()) {
    if (spec.scores.size() != spec.tokens.size())
      fail("scores", "SentencePiece tokenizers without merges need one score per token (" +
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
    bpe.fill_byte_ids();
    impl->pre_tokenizer.emplace_back(
        PreMetaspace{"\xE2\x96\x81",
                     spec.add_space_prefix ? PrependScheme::kFirst : PrependScheme::kNever, false});
    impl->has_decoder = true;
    impl->decoder = {DecReplace{Pattern{"\xE2\x96\x81", nullptr}, " "}, DecByteFallback{},
                     DecFuse{}, DecStrip{U' ', spec.add_space_prefix ? 1u : 0u, 0}};
  } else {
    bpe.ignore_merges = spec.ignore_merges;
    if (spec.nfc) impl->normalizer.emplace_back(NormUnicode{true});
    for (std::size_t i = 0; i < spec.split_regexes.size(); ++i)
      impl->pre_tokenizer.emplace_back(PreSplit{
          Pattern{"", std::make_shared<Regex>(spec.split_regexes[i], source + ": split_regexes[" +
                                                                         std::to_string(i) + "]")},
          SplitBehavior::kIsolated, false});
    impl->pre_tokenizer.emplace_back(
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
