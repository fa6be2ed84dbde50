#include "kernels/error.h"

#include <cctype>
#include <cmath>
#include <cstdio>

namespace rondo {

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::string text =
      std::string("internal error: ") + expr + " failed at " + file + ":" + std::to_string(line);
  if (!msg.empty()) text += ": " + msg;
  text += " (this is a bug in Rondo; please report it)";
  throw InternalError(text);
}

std::string join_problems(const std::string& head, const std::vector<std::string>& problems) {
  std::string text = head;
  for (const std::string& p : problems)
    text += "\n  - " + p;
  return text;
}

std::string format_bytes(std::uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", value, kUnits[unit]);
  return buf;
}

std::uint64_t parse_bytes(const std::string& text, const std::string& what) {
  auto fail = [&]() -> std::uint64_t {
    throw Error("invalid " + what + " '" + text +
                "': expected a number with an optional unit, e.g. 24GB, 512MiB, 4096");
  };
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
    ++i;
  std::size_t start = i;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.'))
    ++i;
  if (i == start) return fail();
  double number = 0;
  try {
    number = std::stod(text.substr(start, i - start));
  } catch (const std::exception&) {
    return fail();
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
    ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(text[i])));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i])))
    ++i;
  if (i != text.size()) return fail();
  double scale = 1;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else {
    static const char kPrefixes[] = "KMGTP";
    std::size_t p = std::string(kPrefixes).find(unit[0]);
    std::string rest = unit.substr(1);
    if (p == std::string::npos || !(rest.empty() || rest == "B" || rest == "IB")) return fail();
    scale = std::pow(1024.0, static_cast<double>(p + 1));
  }
  double bytes = number * scale;
  if (!(bytes >= 0) || bytes > 1.8e19) return fail();
  return static_cast<std::uint64_t>(std::llround(bytes));
}

}  // namespace rondo
