#include "gui/model/series.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace rondo::gui {
namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}

void Series::append(double x, double y) {
  if (!m_x.empty() && x < m_x.back()) truncateFrom(x);
  m_x.push_back(x);
  m_y.push_back(y);
  if (std::isfinite(y)) {
    // NaN compares false, so the first finite y replaces the NaN start values.
    if (!(y >= m_minY)) m_minY = y;
    if (!(y <= m_maxY)) m_maxY = y;
  }
}

void Series::truncateFrom(double x) {
  auto it = std::lower_bound(m_x.begin(), m_x.end(), x);
  if (it == m_x.end()) return;
  std::size_t n = static_cast<std::size_t>(it - m_x.begin());
  m_x.resize(n);
  m_y.resize(n);
  recomputeY();
}

void Series::clear() {
  m_x.clear();
  m_y.clear();
  m_minY = m_maxY = kNaN;
}

void Series::recomputeY() {
  m_minY = m_maxY = kNaN;
  for (double y : m_y) {
    if (!std::isfinite(y)) continue;
    if (!(y >= m_minY)) m_minY = y;
    if (!(y <= m_maxY)) m_maxY = y;
  }
}

QPointF Series::last() const {
  if (m_x.empty()) return {kNaN, kNaN};
  return {m_x.back(), m_y.back()};
}

double Series::minX() const {
  return m_x.empty() ? kNaN : m_x.front();
}

double Series::maxX() const {
  return m_x.empty() ? kNaN : m_x.back();
}

QList<QPointF> Series::decimated(double x0, double x1, int maxPoints) const {
  QList<QPointF> out;
  if (m_x.empty() || !(x0 <= x1)) return out;
  const std::size_t i0 =
      static_cast<std::size_t>(std::lower_bound(m_x.begin(), m_x.end(), x0) - m_x.begin());
  const std::size_t i1 =
      static_cast<std::size_t>(std::upper_bound(m_x.begin(), m_x.end(), x1) - m_x.begin());
  if (i0 >= i1) return out;
  const std::size_t n = i1 - i0;
  maxPoints = std::max(maxPoints, 2);
  if (n <= static_cast<std::size_t>(maxPoints)) {
    out.reserve(static_cast<qsizetype>(n));
    for (std::size_t i = i0; i < i1; ++i)
      if (std::isfinite(m_y[i])) out.append(QPointF(m_x[i], m_y[i]));
    return out;
  }
  const std::size_t buckets = static_cast<std::size_t>(maxPoints / 2);
  out.reserve(static_cast<qsizetype>(2 * buckets));
  const double* y = m_y.data();
  for (std::size_t b = 0; b < buckets; ++b) {
    const std::size_t s = i0 + n * b / buckets;
    const std::size_t e = i0 + n * (b + 1) / buckets;
    std::size_t lo = e, hi = e;
    double yLo = std::numeric_limits<double>::infinity();
    double yHi = -std::numeric_limits<double>::infinity();
    for (std::size_t i = s; i < e; ++i) {
      const double v = y[i];
      if (!std::isfinite(v)) continue;
      if (v < yLo) yLo = v, lo = i;
      if (v > yHi) yHi = v, hi = i;
    }
    if (lo == e) continue;  // nothing finite in this bucket
    const std::size_t first = std::min(lo, hi), second = std::max(lo, hi);
    out.append(QPointF(m_x[first], m_y[first]));
    if (second != first) out.append(QPointF(m_x[second], m_y[second]));
  }
  return out;
}

}  // namespace rondo::gui
