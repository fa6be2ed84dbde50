#include "models/unicode.h"

#include <algorithm>

namespace rondo::models::unicode {
namespace {
#include "models/unicode_tables.inc"

constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr int kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr int kHangulNCount = kHangulVCount * kHangulTCount, kHangulSCount = 11172;

int ccc(char32_t cp) {
  if (cp < 0x300) return 0;
  auto it = std::lower_bound(std::begin(kUnicodeCcc), std::end(kUnicodeCcc), cp,
                             [](const std::uint32_t(&e)[2], char32_t v) { return e[0] < v; });
  return it != std::end(kUnicodeCcc) && (*it)[0] == cp ? static_cast<int>((*it)[1]) : 0;
}

void decompose_one(char32_t cp, std::uint32_t tag, std::vector<char32_t>& out,
                   std::vector<std::uint32_t>& tags) {
  if (cp >= kHangulS && cp < kHangulS + kHangulSCount) {
    const int s = static_cast<int>(cp - kHangulS);
    out.push_back(kHangulL + s / kHangulNCount);
    out.push_back(kHangulV + (s % kHangulNCount) / kHangulTCount);
    tags.insert(tags.end(), 2, tag);
    if (s % kHangulTCount != 0) {
      out.push_back(kHangulT + s % kHangulTCount);
      tags.push_back(tag);
    }
    return;
  }
  if (cp >= 0xC0) {
    auto it = std::lower_bound(std::begin(kUnicodeDecomp), std::end(kUnicodeDecomp), cp,
                               [](const std::uint32_t(&e)[3], char32_t v) { return e[0] < v; });
    if (it != std::end(kUnicodeDecomp) && (*it)[0] == cp) {
      for (std::uint32_t k = 0; k < (*it)[2]; ++k) {
        out.push_back(kUnicodeDecompPool[(*it)[1] + k]);
        tags.push_back(tag);
      }
      return;
    }
  }
  out.push_back(cp);
  tags.push_back(tag);
}

// The primary composite of (a, b), or 0.
char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV &&
      b < kHangulV + kHangulVCount)
    return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 &&
      b > kHangulT && b < kHangulT + kHangulTCount)
    return a + (b - kHangulT);
  auto key = [](char32_t x, char32_t y) { return (std::uint64_t(x) << 32) | y; };
  const std::uint64_t k = key(a, b);
  auto it = std::lower_bound(
      std::begin(kUnicodeCompose), std::end(kUnicodeCompose), k,
      [&](const std::uint32_t(&e)[3], std::uint64_t v) { return key(e[0], e[1]) < v; });
  return it != std::end(kUnicodeCompose) && key((*it)[0], (*it)[1]) == k ? (*it)[2] : 0;
}

}  // namespace

char32_t next(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  const std::size_t n = char_len(b0);
  char32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1F) : n == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (std::size_t k = 1; k < n && i + k < s.size(); ++k)
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

namespace {
// Length of the valid sequence at s[i], or 0 and in `bad` how many bytes form the maximal invalid
// subpart (at least 1).
std::size_t valid_at(std::string_view s, std::size_t i, std::size_t& bad) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  std::size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    bad = 1;
    return 0;
  }
  for (std::size_t k = 1; k < n; ++k) {
    if (i + k >= s.size()) {
      bad = k;
      return 0;
    }
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      bad = k;
      return 0;
    }
  }
  return n;
}
}  // namespace

std::size_t find_invalid(std::string_view s) {
  std::size_t i = 0, bad = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const std::size_t n = valid_at(s, i, bad);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0, bad = 0;
  while (i < s.size()) {
    const std::size_t n = valid_at(s, i, bad);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool python_space(char32_t c) {
  return is_white_space(c) || (c >= 0x1C && c <= 0x1F);
}

void nfd(std::vector<char32_t>& cps, std::vector<std::uint32_t>& tags) {
  std::vector<char32_t> out;
  std::vector<std::uint32_t> out_tags;
  out.reserve(cps.size());
  out_tags.reserve(cps.size());
  for (std::size_t i = 0; i < cps.size(); ++i)
    decompose_one(cps[i], tags[i], out, out_tags);
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (std::size_t i = 0; i < out.size();) {
    if (ccc(out[i]) == 0) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < out.size() && ccc(out[j]) != 0)
      ++j;
    if (j - i > 1) {
      std::vector<std::size_t> order(j - i);
      for (std::size_t k = 0; k < order.size(); ++k)
        order[k] = i + k;
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return ccc(out[a]) < ccc(out[b]); });
      std::vector<char32_t> c2;
      std::vector<std::uint32_t> t2;
      for (std::size_t k : order) {
        c2.push_back(out[k]);
        t2.push_back(out_tags[k]);
      }
      std::copy(c2.begin(), c2.end(), out.begin() + static_cast<std::ptrdiff_t>(i));
      std::copy(t2.begin(), t2.end(), out_tags.begin() + static_cast<std::ptrdiff_t>(i));
    }
    i = j;
  }
  cps.swap(out);
  tags.swap(out_tags);
}

void nfc(std::vector<char32_t>& cps, std::vector<std::uint32_t>& tags) {
  nfd(cps, tags);
  std::vector<char32_t> out;
  std::vector<std::uint32_t> out_tags;
  out.reserve(cps.size());
  out_tags.reserve(cps.size());
  std::ptrdiff_t starter = -1;
  int last_cc = 0;
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const char32_t c = cps[i];
    const int cc = ccc(c);
    if (starter >= 0) {
      const bool adjacent = static_cast<std::ptrdiff_t>(out.size()) - 1 == starter;
      const bool blocked = !adjacent && (last_cc == 0 || last_cc >= cc);
      if (!blocked) {
        if (char32_t p = compose_pair(out[static_cast<std::size_t>(starter)], c)) {
          out[static_cast<std::size_t>(starter)] = p;
          continue;
        }
      }
    }
    if (cc == 0) starter = static_cast<std::ptrdiff_t>(out.size());
    last_cc = cc;
    out.push_back(c);
    out_tags.push_back(tags[i]);
  }
  cps.swap(out);
  tags.swap(out_tags);
}

bool below_combining(std::string_view s) {
  // U+0300 is encoded as CC 80: every code point below it has a lead byte below 0xCC.
  for (char ch : s)
    if (static_cast<unsigned char>(ch) >= 0xCC) return false;
  return true;
}

}  // namespace rondo::models::unicode
