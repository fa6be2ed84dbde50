#include "gui/model/json_line.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace rondo::gui {
namespace {

constexpr int kMaxDepth = 64;

inline bool isWs(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}
inline bool isDigit(char c) {
  return c >= '0' && c <= '9';
}
inline void skipWs(const char*& p, const char* end) {
  while (p != end && isWs(*p))
    ++p;
}

// p is just after the opening quote; on success p is just after the closing quote and body is
// what lies between. Rejects raw control characters and bad escapes, as JSON does.
bool scanString(const char*& p, const char* end, std::string_view* body) {
  const char* start = p;
  while (p != end) {
    unsigned char c = static_cast<unsigned char>(*p);
    if (c == '"') {
      if (body) *body = std::string_view(start, p - start);
      ++p;
      return true;
    }
    if (c < 0x20) return false;
    if (c == '\\') {
      ++p;
      if (p == end) return false;
      switch (*p) {
        case '"':
        case '\\':
        case '/':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
          ++p;
          break;
        case 'u':
          ++p;
          for (int i = 0; i < 4; ++i, ++p)
            if (p == end || !std::isxdigit(static_cast<unsigned char>(*p))) return false;
          break;
        default:
          return false;
      }
      continue;
    }
    ++p;
  }
  return false;
}

bool scanNumber(const char*& p, const char* end, bool* integer) {
  *integer = true;
  if (p != end && *p == '-') ++p;
  if (p == end) return false;
  if (*p == '0') {
    ++p;
  } else if (isDigit(*p)) {
    while (p != end && isDigit(*p))
      ++p;
  } else {
    return false;
  }
  if (p != end && *p == '.') {
    ++p;
    *integer = false;
    if (p == end || !isDigit(*p)) return false;
    while (p != end && isDigit(*p))
      ++p;
  }
  if (p != end && (*p == 'e' || *p == 'E')) {
    ++p;
    *integer = false;
    if (p != end && (*p == '+' || *p == '-')) ++p;
    if (p == end || !isDigit(*p)) return false;
    while (p != end && isDigit(*p))
      ++p;
  }
  return true;
}

bool scanLiteral(const char*& p, const char* end, std::string_view word) {
  if (static_cast<std::size_t>(end - p) < word.size()) return false;
  if (std::string_view(p, word.size()) != word) return false;
  p += word.size();
  return true;
}

bool scanValue(const char*& p, const char* end, int depth, JsonLine::Kind* kind,
               std::string_view* value);

// p is at '{' or '['; skips the whole container.
bool scanContainer(const char*& p, const char* end, int depth) {
  if (depth > kMaxDepth) return false;
  const bool object = *p == '{';
  const char close = object ? '}' : ']';
  ++p;
  skipWs(p, end);
  if (p != end && *p == close) {
    ++p;
    return true;
  }
  while (true) {
    skipWs(p, end);
    if (object) {
      if (p == end || *p != '"') return false;
      ++p;
      if (!scanString(p, end, nullptr)) return false;
      skipWs(p, end);
      if (p == end || *p != ':') return false;
      ++p;
      skipWs(p, end);
    }
    JsonLine::Kind kind;
    std::string_view value;
    if (!scanValue(p, end, depth + 1, &kind, &value)) return false;
    skipWs(p, end);
    if (p == end) return false;
    if (*p == ',') {
      ++p;
      continue;
    }
    if (*p == close) {
      ++p;
      return true;
    }
    return false;
  }
}

bool scanValue(const char*& p, const char* end, int depth, JsonLine::Kind* kind,
               std::string_view* value) {
  if (p == end) return false;
  const char* start = p;
  switch (*p) {
    case '"':
      ++p;
      *kind = JsonLine::String;
      return scanString(p, end, value);
    case '{':
    case '[':
      *kind = *p == '{' ? JsonLine::Object : JsonLine::Array;
      if (!scanContainer(p, end, depth)) return false;
      break;
    case 't':
      *kind = JsonLine::Bool;
      if (!scanLiteral(p, end, "true")) return false;
      break;
    case 'f':
      *kind = JsonLine::Bool;
      if (!scanLiteral(p, end, "false")) return false;
      break;
    case 'n':
      *kind = JsonLine::Null;
      if (!scanLiteral(p, end, "null")) return false;
      break;
    default: {
      bool integer;
      if (!scanNumber(p, end, &integer)) return false;
      *kind = integer ? JsonLine::Integer : JsonLine::Number;
      break;
    }
  }
  *value = std::string_view(start, p - start);
  return true;
}

void appendCodeUnit(QString& out, char16_t unit) {
  out.append(QChar(unit));
}

unsigned hex4(const char* p) {
  unsigned v = 0;
  for (int i = 0; i < 4; ++i) {
    char c = p[i];
    v <<= 4;
    if (c >= '0' && c <= '9')
      v |= c - '0';
    else if (c >= 'a' && c <= 'f')
      v |= c - 'a' + 10;
    else
      v |= c - 'A' + 10;
  }
  return v;
}

}  // namespace

bool JsonLine::parse(std::string_view text) {
  m_members.clear();
  const char* p = text.data();
  const char* end = p + text.size();
  skipWs(p, end);
  if (p == end || *p != '{') return false;
  ++p;
  skipWs(p, end);
  if (p != end && *p == '}') {
    ++p;
  } else {
    while (true) {
      skipWs(p, end);
      if (p == end || *p != '"') return false;
      ++p;
      Member m;
      if (!scanString(p, end, &m.key)) return false;
      skipWs(p, end);
      if (p == end || *p != ':') return false;
      ++p;
      skipWs(p, end);
      if (!scanValue(p, end, 1, &m.kind, &m.value)) return false;
      m_members.push_back(m);
      skipWs(p, end);
      if (p == end) return false;
      if (*p == ',') {
        ++p;
        continue;
      }
      if (*p == '}') {
        ++p;
        break;
      }
      return false;
    }
  }
  skipWs(p, end);
  return p == end;
}

const JsonLine::Member* JsonLine::find(std::string_view key) const {
  for (const Member& m : m_members)
    if (m.key == key) return &m;
  return nullptr;
}

JsonLine::Kind JsonLine::kind(std::string_view key) const {
  const Member* m = find(key);
  return m ? m->kind : Missing;
}

double JsonLine::number(std::string_view key) const {
  const Member* m = find(key);
  if (!m || (m->kind != Integer && m->kind != Number))
    return std::numeric_limits<double>::quiet_NaN();
  double v = 0;
  auto [ptr, ec] = std::from_chars(m->value.data(), m->value.data() + m->value.size(), v);
  if (ec == std::errc::result_out_of_range) {
    // Only a literal beyond ±1.8e308 (or a tiny one) gets here: keep its sign and magnitude class.
    bool negative = m->value.front() == '-';
    std::string_view exp = m->value.substr(m->value.find_first_of("eE") + 1);
    bool tiny = !exp.empty() && exp.front() == '-';
    double mag = tiny ? 0.0 : std::numeric_limits<double>::infinity();
    return negative ? -mag : mag;
  }
  if (ec != std::errc()) return std::numeric_limits<double>::quiet_NaN();
  return v;
}

std::optional<std::int64_t> JsonLine::integer(std::string_view key) const {
  const Member* m = find(key);
  if (!m || m->kind != Integer) return std::nullopt;
  std::int64_t v = 0;
  auto [ptr, ec] = std::from_chars(m->value.data(), m->value.data() + m->value.size(), v);
  if (ec != std::errc()) return std::nullopt;
  return v;
}

std::optional<std::uint64_t> JsonLine::unsignedInteger(std::string_view key) const {
  const Member* m = find(key);
  if (!m || m->kind != Integer || m->value.front() == '-') return std::nullopt;
  std::uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(m->value.data(), m->value.data() + m->value.size(), v);
  if (ec != std::errc()) return std::nullopt;
  return v;
}

std::string_view JsonLine::rawString(std::string_view key) const {
  const Member* m = find(key);
  return m && m->kind == String ? m->value : std::string_view();
}

std::string_view JsonLine::raw(std::string_view key) const {
  const Member* m = find(key);
  return m ? m->value : std::string_view();
}

QString JsonLine::string(std::string_view key) const {
  const Member* m = find(key);
  if (!m || m->kind != String) return {};
  return unescape(m->value);
}

QString JsonLine::unescape(std::string_view body) {
  if (body.find('\\') == std::string_view::npos)
    return QString::fromUtf8(body.data(), static_cast<qsizetype>(body.size()));
  QString out;
  out.reserve(static_cast<qsizetype>(body.size()));
  const char* p = body.data();
  const char* end = p + body.size();
  while (p != end) {
    const char* run = p;
    while (p != end && *p != '\\')
      ++p;
    // Escapes are ASCII, so a run between them never splits a UTF-8 sequence.
    if (p != run) out.append(QString::fromUtf8(run, p - run));
    if (p == end) break;
    ++p;  // the backslash; scanString guaranteed a valid escape follows
    char c = *p++;
    switch (c) {
      case 'b':
        out.append(QChar(u'\b'));
        break;
      case 'f':
        out.append(QChar(u'\f'));
        break;
      case 'n':
        out.append(QChar(u'\n'));
        break;
      case 'r':
        out.append(QChar(u'\r'));
        break;
      case 't':
        out.append(QChar(u'\t'));
        break;
      case 'u': {
        unsigned unit = hex4(p);
        p += 4;
        if (unit >= 0xD800 && unit <= 0xDBFF) {
          // A high surrogate is only kept with the low one that must follow it.
          if (end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            unsigned low = hex4(p + 2);
            if (low >= 0xDC00 && low <= 0xDFFF) {
              appendCodeUnit(out, static_cast<char16_t>(unit));
              appendCodeUnit(out, static_cast<char16_t>(low));
              p += 6;
              break;
            }
          }
          out.append(QChar(QChar::ReplacementCharacter));
        } else if (unit >= 0xDC00 && unit <= 0xDFFF) {
          out.append(QChar(QChar::ReplacementCharacter));
        } else {
          appendCodeUnit(out, static_cast<char16_t>(unit));
        }
        break;
      }
      default:  // '"', '\\', '/'
        out.append(QLatin1Char(c));
        break;
    }
  }
  return out;
}

}  // namespace rondo::gui
