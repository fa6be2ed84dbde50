// One event line of events.jsonl parsed into views of its top-level members, without allocating:
// the fast path that lets a 100,000-step run load in well under a second. The views point into
// the caller's bytes, so a JsonLine is only valid while those bytes are. Used by RunState.
//
//   JsonLine line;
//   if (line.parse(bytes) && line.kind("loss") == JsonLine::Number) double loss =
//   line.number("loss");
#pragma once

#include <QString>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace rondo::gui {

class JsonLine {
 public:
  enum Kind : std::uint8_t { Missing, Null, Bool, Integer, Number, String, Array, Object };
  // Integer is a number token without fraction or exponent; Number any other number token.

  // Validates one JSON object (surrounding whitespace allowed) and records its top-level members.
  // False for anything else: not JSON, not an object, trailing bytes, nesting deeper than 64.
  bool parse(std::string_view text);

  Kind kind(std::string_view key) const;
  bool isNumeric(std::string_view key) const {
    Kind k = kind(key);
    return k == Integer || k == Number;
  }
  // The member's value: a number (NaN when null, missing, or not a number).
  double number(std::string_view key) const;
  // An integer member; nullopt when missing, not an integer token, or out of range.
  std::optional<std::int64_t> integer(std::string_view key) const;
  std::optional<std::uint64_t> unsignedInteger(std::string_view key) const;
  // A string member, unescaped (invalid UTF-8 becomes U+FFFD); empty when not a string.
  QString string(std::string_view key) const;
  // The raw bytes of a string member between its quotes, still escaped; empty when not a string.
  std::string_view rawString(std::string_view key) const;
  // The raw JSON text of any member's value.
  std::string_view raw(std::string_view key) const;

  // Decodes a JSON string body (between the quotes, already validated).
  static QString unescape(std::string_view body);

 private:
  struct Member {
    std::string_view key;    // raw, between the quotes
    std::string_view value;  // raw JSON text; for strings the body between the quotes
    Kind kind = Missing;
  };
  const Member* find(std::string_view key) const;

  std::vector<Member> m_members;
};

}  // namespace rondo::gui
