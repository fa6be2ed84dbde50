// A compiled tokenizer.json pattern: PCRE2 (UTF + Unicode properties, JIT where it compiles) with
// Oniguruma's meaning of `\s`, which is what `tokenizers` runs. Owns its PCRE2 code and touches
// nothing else; errors name where the pattern came from. Used by the tokenizer (Split and Replace
// patterns, GPT-2's split, the word boundaries of added tokens). Internal to rondo_models.
//
//   Regex re(R"(\p{N})", "tokenizer.json: pre_tokenizer");
//   re.for_each("a1b22", [](std::size_t b, std::size_t e) { ... });  // [1, 2), [3, 4), [4, 5)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

// PCRE2's own types for 8-bit code units (pcre2_code, pcre2_match_data), which only regex.cpp
// includes pcre2.h to define.
struct pcre2_real_code_8;
struct pcre2_real_match_data_8;

namespace rondo::models {

class Regex {
 public:
  // Throws Error naming `where` and the pattern when it does not compile; `where` names it in
  // errors while matching too (the tokenizer.json and the JSON path).
  Regex(const std::string& pattern, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches [begin, end), left to right, each passed to `f(begin, end)` as it is
  // found (a long text's matches are never all held); an empty match advances one character.
  template <typename F>
  void for_each(std::string_view s, F&& f) const {
    MatchData md(code_);
    std::size_t pos = 0, begin = 0, end = 0;
    while (next(s, pos, md, begin, end))
      f(begin, end);
  }

  // Whether a match starts at s[0] (one anchored attempt, not a scan).
  bool matches_at_start(std::string_view s) const;

 private:
  // Match data sized for the pattern, freed on every path out (an emplace_back may throw).
  class MatchData {
   public:
    explicit MatchData(const pcre2_real_code_8* code);
    ~MatchData();
    MatchData(const MatchData&) = delete;
    MatchData& operator=(const MatchData&) = delete;
    pcre2_real_match_data_8* get() const { return md_; }

   private:
    pcre2_real_match_data_8* md_;
  };

  // The next non-empty match at or after `pos` into [begin, end), `pos` moved past it; false when
  // there is none.
  bool next(std::string_view s, std::size_t& pos, const MatchData& md, std::size_t& begin,
            std::size_t& end) const;
  // One match attempt from byte `pos`: true when found (ovector in md), false for no match.
  bool match(std::string_view s, std::size_t pos, std::uint32_t options, const MatchData& md) const;

  std::string pattern_;
  std::string where_;
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace rondo::models
