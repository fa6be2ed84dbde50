// The stages of a tokenizer's pipeline as data — pieces of text with their byte offsets, the
// normaliser, pre-tokenizer and decoder steps, added tokens, the post-processor's template — and
// Tokenizer::Impl, which holds one pipeline. Internal to rondo_models: tokenizer.cpp runs the
// stages, tokenizer_json.cpp builds them from a tokenizer.json; nothing else includes it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "models/regex.h"
#include "models/tokenizer.h"
#include "models/tokenizer_bpe.h"

namespace rondo::models {

// ---------------------------------------------------------------------------------------------
// Pieces of text with per-byte original offsets. See Note [Byte offsets] in tokenizer.cpp.

struct Piece {
  std::string text;
  std::vector<std::uint32_t> orig;  // per byte of text: offset of its source char in the input
  std::int32_t token = -1;          // an added token already recognised (text is its match)
  // Without offsets (Tokenizer::encode) `orig` stays empty and only what the stages read of it
  // is kept: how many leading bytes come from the input's first character (tag 0), which
  // Metaspace's prepend_scheme "first" asks. See tag_at() in tokenizer.cpp.
  bool tracked = true;
  std::size_t zero_prefix = 0;
};

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

// A post-processor template item: a special token's ids, or the sequence.
struct PostItem {
  bool sequence = false;
  std::vector<std::int32_t> ids;
};

// ---------------------------------------------------------------------------------------------
// One pipeline, built by Tokenizer::from_json / from_spec and immutable afterwards (Tokenizer
// shares it between threads).

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

  // Once `added` and the normaliser are set: the matchers, ids and texts of the added tokens.
  void finish_added();
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
  void split_added(Piece p, const AddedMatcher& matcher, std::vector<Piece>& out) const;

  // Offsets (16 bytes a token) only when asked for: encode() of a long text needs the ids alone.
  Encoding encode(std::string_view text, bool add_special_tokens, bool with_offsets) const;
};

}  // namespace rondo::models
