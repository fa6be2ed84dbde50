// One event line of events.jsonl, parsed and validated whole by simdjson (its DOM parser: the
// fastest kept library here, docs/measurements/gui_json.md), then read member by member. What a
// getter returns (the string views too) lives in the parser: valid until the next parse().
// Used by RunState.
//
//   JsonLine line;
//   if (!line.parse(bytes)) report(line.error());
//   else if (line.isNumeric("loss")) plot(line.number("loss"));
#pragma once

#include <QList>
#include <QString>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

namespace rondo::gui {

class JsonLine {
 public:
  enum Kind : std::uint8_t { Missing, Null, Bool, Integer, Number, String, Array, Object };
  // Integer is a number without fraction or exponent that fits int64 or uint64; Number any other.

  JsonLine();
  ~JsonLine();
  JsonLine(const JsonLine&) = delete;
  JsonLine& operator=(const JsonLine&) = delete;

  // One JSON object (surrounding whitespace allowed); false for anything else, with the reason in
  // error(). Lenient where the hand-written reader before it was: invalid UTF-8, and \u escapes of
  // lone surrogates, are read as U+FFFD instead of failing the line.
  bool parse(std::string_view text);
  QString error() const;  // why the last parse() failed, for a person

  Kind kind(std::string_view key) const;  // of the first member with that key
  bool isNumeric(std::string_view key) const {
    Kind k = kind(key);
    return k == Integer || k == Number;
  }
  // The member's value as a number (NaN when null, missing, or not a number).
  double number(std::string_view key) const;
  // A number inside an object member: {"metrics": {"rewards/margins": 0.5}} gives 0.5 for
  // ("metrics", "rewards/margins"); NaN when either is missing or not what it should be.
  double number(std::string_view object, std::string_view key) const;
  // An integer member; nullopt when missing, not an integer, or out of range.
  std::optional<std::int64_t> integer(std::string_view key) const;
  std::optional<std::uint64_t> unsignedInteger(std::string_view key) const;
  // A string member, unescaped; empty when not a string.
  QString string(std::string_view key) const;
  std::string_view stringView(std::string_view key) const;  // the same, as UTF-8 bytes
  // An array member's numbers (an element that is not a number is NaN); empty when not an array.
  QList<double> numbers(std::string_view key) const;

 private:
  // simdjson.h is 31,000 lines: it stays out of the headers that include this one.
  struct Impl;
  std::unique_ptr<Impl> m_impl;
};

}  // namespace rondo::gui
