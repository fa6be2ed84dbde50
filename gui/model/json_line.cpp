#include "gui/model/json_line.h"

#include <simdjson.h>

#include <cstring>
#include <limits>
#include <vector>

namespace rondo::gui {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The code unit of the four hex digits at p, or -1 when there are not four.
int hex4(const char* p, const char* end) {
  if (end - p < 4) return -1;
  int unit = 0;
  for (int i = 0; i < 4; ++i) {
    const char c = p[i];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    if (digit < 0) return -1;
    unit = unit * 16 + digit;
  }
  return unit;
}

// simdjson 3.0 rejects a \u escape of a surrogate that is not part of a pair, which JSON's grammar
// allows; the reader before it took one as U+FFFD. Rewrites each such escape to \ufffd in place
// (same length); true when there was one. Every backslash starts an escape, so `\\ud800` (an
// escaped backslash) is left alone.
bool replaceLoneSurrogates(char* p, char* end) {
  bool replaced = false;
  while (p < end) {
    if (*p != '\\') {
      ++p;
      continue;
    }
    if (end - p < 2 || p[1] != 'u') {
      p += 2;
      continue;
    }
    const int unit = hex4(p + 2, end);
    if (unit < 0) {  // not an escape simdjson accepts either: the line stays malformed
      p += 2;
      continue;
    }
    if (unit >= 0xD800 && unit <= 0xDBFF && end - p >= 12 && p[6] == '\\' && p[7] == 'u') {
      const int low = hex4(p + 8, end);
      if (low >= 0xDC00 && low <= 0xDFFF) {
        p += 12;  // a pair
        continue;
      }
    }
    if (unit >= 0xD800 && unit <= 0xDFFF) {
      std::memcpy(p + 2, "fffd", 4);
      replaced = true;
    }
    p += 6;
  }
  return replaced;
}

}  // namespace

struct JsonLine::Impl {
  struct Member {
    std::string_view key;  // unescaped, in the parser's string buffer
    simdjson::dom::element value;
  };
  simdjson::dom::parser parser;
  std::vector<char> padded;     // the line, then the SIMDJSON_PADDING bytes simdjson may read
  std::vector<Member> members;  // of the last line parsed, in order
  simdjson::error_code code = simdjson::SUCCESS;
  bool notObject = false;

  const simdjson::dom::element* find(std::string_view key) const {
    for (const Member& m : members)
      if (m.key == key) return &m.value;
    return nullptr;
  }

  // The caller's bytes may end at the end of a mapped file: simdjson reads a copy.
  std::size_t copy(std::string_view text) {
    if (padded.size() < text.size() + simdjson::SIMDJSON_PADDING)
      padded.resize(text.size() + simdjson::SIMDJSON_PADDING);
    std::memcpy(padded.data(), text.data(), text.size());
    return text.size();
  }

  bool parse(std::string_view text) {
    members.clear();
    notObject = false;
    std::size_t size = copy(text);
    simdjson::dom::element root;
    code = parser.parse(padded.data(), size, false).get(root);
    if (code == simdjson::UTF8_ERROR) {
      // Rare (the engine replaces bad bytes itself, docs/events.md): the slow path is fine.
      const QByteArray fixed =
          QString::fromUtf8(text.data(), static_cast<qsizetype>(text.size())).toUtf8();
      size = copy(std::string_view(fixed.constData(), static_cast<std::size_t>(fixed.size())));
      code = parser.parse(padded.data(), size, false).get(root);
    }
    if (code == simdjson::STRING_ERROR &&
        replaceLoneSurrogates(padded.data(), padded.data() + size))
      code = parser.parse(padded.data(), size, false).get(root);
    if (code != simdjson::SUCCESS) return false;
    simdjson::dom::object object;
    if (root.get_object().get(object) != simdjson::SUCCESS) {
      notObject = true;
      return false;
    }
    for (simdjson::dom::key_value_pair member : object)
      members.push_back({member.key, member.value});
    return true;
  }
};

JsonLine::JsonLine() : m_impl(std::make_unique<Impl>()) {}
JsonLine::~JsonLine() = default;

bool JsonLine::parse(std::string_view text) {
  return m_impl->parse(text);
}

QString JsonLine::error() const {
  if (m_impl->notObject) return QStringLiteral("not a JSON object");
  return QStringLiteral("not JSON (simdjson: %1)")
      .arg(QString::fromUtf8(simdjson::error_message(m_impl->code)));
}

JsonLine::Kind JsonLine::kind(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  if (!v) return Missing;
  switch (v->type()) {
    case simdjson::dom::element_type::NULL_VALUE:
      return Null;
    case simdjson::dom::element_type::BOOL:
      return Bool;
    case simdjson::dom::element_type::INT64:
    case simdjson::dom::element_type::UINT64:
      return Integer;
    case simdjson::dom::element_type::DOUBLE:
      return Number;
    case simdjson::dom::element_type::STRING:
      return String;
    case simdjson::dom::element_type::ARRAY:
      return Array;
    case simdjson::dom::element_type::OBJECT:
      return Object;
  }
  return Missing;
}

double JsonLine::number(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  double d = 0;
  if (!v || v->get_double().get(d) != simdjson::SUCCESS) return kNaN;
  return d;
}

double JsonLine::number(std::string_view object, std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(object);
  simdjson::dom::object o;
  double d = 0;
  if (!v || v->get_object().get(o) != simdjson::SUCCESS ||
      o.at_key(key).get_double().get(d) != simdjson::SUCCESS)
    return kNaN;
  return d;
}

std::optional<std::int64_t> JsonLine::integer(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  std::int64_t i = 0;
  if (!v || v->get_int64().get(i) != simdjson::SUCCESS) return std::nullopt;
  return i;
}

std::optional<std::uint64_t> JsonLine::unsignedInteger(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  std::uint64_t u = 0;
  if (!v || v->get_uint64().get(u) != simdjson::SUCCESS) return std::nullopt;
  return u;
}

std::string_view JsonLine::stringView(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  std::string_view s;
  if (!v || v->get_string().get(s) != simdjson::SUCCESS) return {};
  return s;
}

QList<double> JsonLine::numbers(std::string_view key) const {
  const simdjson::dom::element* v = m_impl->find(key);
  simdjson::dom::array a;
  QList<double> out;
  if (!v || v->get_array().get(a) != simdjson::SUCCESS) return out;
  for (simdjson::dom::element e : a) {
    double d = 0;
    out.append(e.get_double().get(d) == simdjson::SUCCESS ? d : kNaN);
  }
  return out;
}

QString JsonLine::string(std::string_view key) const {
  const std::string_view s = stringView(key);
  return QString::fromUtf8(s.data(), static_cast<qsizetype>(s.size()));
}

}  // namespace rondo::gui
