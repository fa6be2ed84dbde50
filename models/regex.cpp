// The PCRE2 wrapper of regex.h: Oniguruma's \s spelled out for PCRE2, compilation (JIT where it
// compiles), matching with the interpreter as fallback, errors that name the pattern's source.
// Touches only PCRE2 and its own code and match data. Used by the tokenizer's pipeline.
#include "models/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "kernels/error.h"
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

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& where)
    : pattern_(pattern), where_(where) {
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

Regex::~Regex() {
  pcre2_code_free(code_);
}

Regex::MatchData::MatchData(const pcre2_code* code)
    : md_(pcre2_match_data_create_from_pattern(code, nullptr)) {
  RONDO_ASSERT(md_ != nullptr);
}

Regex::MatchData::~MatchData() {
  pcre2_match_data_free(md_);
}

bool Regex::next(std::string_view s, std::size_t& pos, const MatchData& md, std::size_t& begin,
                 std::size_t& end) const {
  while (pos <= s.size()) {
    if (!match(s, pos, 0, md)) return false;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
    const std::size_t b = ov[0], e = ov[1];
    if (e == b) {
      if (b >= s.size()) return false;
      pos = b + unicode::char_len(static_cast<unsigned char>(s[b]));
      continue;
    }
    pos = e;
    begin = b;
    end = e;
    return true;
  }
  return false;
}

bool Regex::matches_at_start(std::string_view s) const {
  MatchData md(code_);
  return match(s, 0, PCRE2_ANCHORED, md);
}

// JIT unless it runs out of stack or `options` needs the interpreter (PCRE2_ANCHORED does).
bool Regex::match(std::string_view s, std::size_t pos, std::uint32_t options,
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
    throw Error(
        where_ + ": regex " + json(pattern_).dump() +
        " failed on this text: " + reinterpret_cast<const char*>(msg) +
        (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT
             ? " (PCRE2's backtracking limit; a very long run of one kind of character?)"
             : ""));
  }
  return true;
}

}  // namespace rondo::models
