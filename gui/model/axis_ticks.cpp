#include "gui/model/axis_ticks.h"

#include <algorithm>
#include <cmath>

namespace rondo::gui {
namespace {

// More ticks than any axis asks for: a guard on the loops below, never reached by stepTicks or
// valueTicks (their interval puts at most maxTicks in the range).
constexpr qsizetype kTickCap = 10000;

// m × 10^k, correctly rounded (5e-05 is 5 / 10^5: 5 × 1e-05 is not the nearest double).
double nice(int m, int k) {
  return k >= 0 ? m * std::pow(10.0, k) : m / std::pow(10.0, -k);
}

qsizetype countTicks(double min, double max, double interval) {
  AxisTicks t;
  t.min = min;
  t.max = max;
  t.interval = interval;
  return tickValues(t).size();
}

// The smallest interval m × 10^k (m in 1, 2, 5; k >= minExponent) with 1 to maxTicks ticks in
// [min, max]; its exponent in *k. When none has (a budget of 1 over 82..84), the coarsest one
// that has ticks at all.
double smallestInterval(double min, double max, int maxTicks, int minExponent, int* k) {
  // Below span / (maxTicks + 1) every interval has more than maxTicks multiples in the range.
  const double span = max - min;
  const double lower = span / (maxTicks + 1);
  int e = lower > 0 ? static_cast<int>(std::floor(std::log10(lower))) : minExponent;
  e = std::max(e, minExponent);
  double fallback = nice(1, e);
  *k = e;
  // Beyond 10 spans an interval has at most one multiple in the range, and so has every larger
  // one: nothing new to find.
  for (; nice(1, e) <= 10 * span; ++e)
    for (int m : {1, 2, 5}) {
      const double interval = nice(m, e);
      const qsizetype n = countTicks(min, max, interval);
      if (n >= 1 && n <= maxTicks) {
        *k = e;
        return interval;
      }
      if (n >= 1) {
        fallback = interval;
        *k = e;
      }
    }
  return fallback;
}

}  // namespace

std::pair<double, double> stepRange(double first, double last) {
  if (!std::isfinite(first) || !std::isfinite(last)) return {0, 1};
  if (last < first) std::swap(first, last);
  if (last > first) return {first, last};
  const double lo = std::max(0.0, first - 1);
  return {lo, lo + 2};
}

std::pair<double, double> valueRange(double lo, double hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) return {0, 1};
  if (hi < lo) std::swap(lo, hi);
  // Equal, or too close for a double to hold ticks between them: the value with room around it.
  const double mag = std::max(std::abs(lo), std::abs(hi));
  if (hi - lo <= 1e-12 * mag || hi == lo) {
    const double pad = lo == 0 ? 1 : 0.05 * std::abs(lo);
    return {lo - pad, lo + pad};
  }
  const double pad = 0.05 * (hi - lo);
  // A learning rate or a loss is never below 0: no negative ticks under it.
  return {lo >= 0 ? std::max(0.0, lo - pad) : lo - pad, hi + pad};
}

AxisTicks stepTicks(double min, double max, int maxTicks) {
  AxisTicks t;
  if (!std::isfinite(min) || !std::isfinite(max) || !(max > min)) return t;
  t.min = min;
  t.max = max;
  int k = 0;
  t.interval = smallestInterval(min, max, std::max(maxTicks, 1), 0, &k);
  t.format = QStringLiteral("%.0f");
  return t;
}

AxisTicks valueTicks(double min, double max, int maxTicks) {
  AxisTicks t;
  if (!std::isfinite(min) || !std::isfinite(max) || !(max > min)) return t;
  t.min = min;
  t.max = max;
  int k = 0;
  // Down to the span's own scale less a few digits: a double has ~16 digits, and a span of 1e-12
  // of its values (valueRange gives at least 5% of them) never needs more.
  const int floorExponent = static_cast<int>(std::floor(std::log10(max - min))) - 3;
  t.interval = smallestInterval(min, max, std::max(maxTicks, 2), floorExponent, &k);
  // One tick says nothing of the scale: the range grows to the next multiple on the side nearer
  // one, for a second tick.
  const QList<double> values = tickValues(t);
  if (values.size() == 1) {
    // A hair past the multiple: exactly at it, rounding may put the first tick an interval on.
    const double hair = 1e-9 * t.interval;
    const double below = values[0] - t.interval - hair, above = values[0] + t.interval + hair;
    if (min - below <= above - max)
      t.min = below;
    else
      t.max = above;
  }
  const double mag = std::max(std::abs(min), std::abs(max));
  if ((mag > 0 && mag < 1e-2) || mag >= 1e7) {
    // Digits after the point: from the largest value's exponent down to the interval's.
    const int e = static_cast<int>(std::floor(std::log10(mag)));
    t.format = QStringLiteral("%.%1e").arg(std::max(0, e - k));
  } else {
    t.format = QStringLiteral("%.%1f").arg(std::max(0, -k));
  }
  return t;
}

QList<double> tickValues(const AxisTicks& t) {
  QList<double> out;
  if (!(t.interval > 0) || !(t.max > t.min) || !std::isfinite(t.max - t.min)) return out;
  // As QValueAxis (ChartValueAxisX::calculateLayout): the first multiple at or after min, then
  // adding the interval, so that a tick here is a tick there.
  const double anchor = 0;
  double v = anchor - std::floor((anchor - t.min) / t.interval) * t.interval;
  for (; v <= t.max && out.size() < kTickCap; v += t.interval)
    out.append(v);
  return out;
}

QStringList tickLabels(const AxisTicks& t) {
  QStringList out;
  const QByteArray format = t.format.toLatin1();
  for (double v : tickValues(t))
    out.append(QString::asprintf(format.constData(), v));
  return out;
}

}  // namespace rondo::gui
