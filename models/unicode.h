// UTF-8 and Unicode normalisation helpers for the tokenizer and chat templates (and the config
// reader's UTF-8 check). Normalisation carries a tag per code point (the tokenizer's original byte
// offset) so that a composed character keeps the tag of its first part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rondo::models::unicode {

// Length of the UTF-8 sequence that starts with `lead` (1 for a stray continuation byte).
inline std::size_t char_len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? (lead < 0xC0 ? 1 : 2) : lead < 0xF0 ? 3 : 4;
}

// The code point at s[i] (s valid UTF-8); advances i past it.
char32_t next(std::string_view s, std::size_t& i);

// Start of the character that ends just before byte `end` (end > floor): steps back over
// continuation bytes, never below `floor`.
inline std::size_t prev_start(std::string_view s, std::size_t end, std::size_t floor = 0) {
  std::size_t c = end - 1;
  while (c > floor && (static_cast<unsigned char>(s[c]) & 0xC0) == 0x80)
    --c;
  return c;
}

// [b, e) narrowed past the code points `drop` holds for: from the left when `left`, from the
// right when `right` (Python's str.strip() with drop = python_space). b and e are char boundaries.
template <class Pred>
std::pair<std::size_t, std::size_t> strip(std::string_view s, std::size_t b, std::size_t e,
                                          bool left, bool right, Pred drop) {
  if (left)
    while (b < e) {
      std::size_t i = b;
      if (!drop(next(s, i))) break;
      b = i < e ? i : e;  // a truncated sequence at the end must not carry b past e
    }
  if (right)
    while (e > b) {
      const std::size_t c = prev_start(s, e, b);
      std::size_t i = c;
      if (!drop(next(s, i))) break;
      e = c;
    }
  return {b, e};
}
void append(std::string& out, char32_t cp);

// Offset of the first byte that is not part of valid UTF-8, or std::string_view::npos.
std::size_t find_invalid(std::string_view s);

// Valid UTF-8 with each maximal invalid subsequence replaced by U+FFFD (Rust's from_utf8_lossy).
std::string lossy(std::string_view bytes);

// Unicode White_Space (what Rust's char::is_whitespace and Python's str.strip() use, bar the
// ASCII separators 0x1C-0x1F that Python also strips: see `python_space`).
bool is_white_space(char32_t cp);
bool python_space(char32_t cp);  // Python str.isspace(): White_Space plus 0x1C-0x1F

// Canonical decomposition + ordering (NFD) and composition (NFC), in place; `tags` runs parallel
// to `cps`.
void nfd(std::vector<char32_t>& cps, std::vector<std::uint32_t>& tags);
void nfc(std::vector<char32_t>& cps, std::vector<std::uint32_t>& tags);

// True when NFC and NFD leave `s` unchanged for certain (every code point below U+0300).
bool below_combining(std::string_view s);

}  // namespace rondo::models::unicode
