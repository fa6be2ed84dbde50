// The range and ticks of the monitor's chart axes, without widgets. A tick is a whole multiple of
// the interval (1, 2 or 5 × 10^k; QValueAxis::TicksDynamic with anchor 0), so labels are round
// numbers, each once: the step axis ticks whole steps only; a value axis labels with as many
// decimals as its interval needs, in scientific notation for learning rates (2.0e-04). Fixed
// tick counts labelled "%d" drew 0.75 as "0" ("0 0 1 2 3"); one point got a range the labels
// could not tell apart.
//
//   const auto [lo, hi] = stepRange(series.minX(), series.maxX());
//   AxisTicks t = stepTicks(lo, hi, 8);  // axis->setRange(t.min, t.max); setTickInterval(...)
//   QStringList shown = tickLabels(t);   // what the axis draws
#pragma once

#include <QString>
#include <QStringList>
#include <utility>

namespace rondo::gui {

struct AxisTicks {
  double min = 0, max = 1;  // the range shown
  double interval = 1;      // ticks at the multiples of interval in [min, max]
  QString format = "%.0f";  // printf format of one label (QValueAxis::setLabelFormat)
};

// The range of a step axis showing steps first..last: exactly those, or for a single step one
// step either side (not below 0), so that the point is inside the axis.
std::pair<double, double> stepRange(double first, double last);
// The range of a value axis showing lo..hi: 5% of the span more each side, not below 0 when lo is
// not; a single value (lo == hi) ±5% of it, ±1 when it is 0. Non-finite input gives 0..1.
std::pair<double, double> valueRange(double lo, double hi);

// Ticks on a step axis over [min, max]: whole steps, the smallest interval of 1, 2, 5 × 10^k
// steps that puts at most maxTicks ticks in the range (maxTicks below 1 counts as 1).
AxisTicks stepTicks(double min, double max, int maxTicks);
// Ticks on a value axis over [min, max]: the smallest interval of 1, 2, 5 × 10^k that puts at
// most maxTicks (at least 2) ticks in the range; "%.Nf" with the decimals the interval needs, or
// "%.Ne" when the values are below 0.01 or from 10^7 (N: the digits that tell ticks apart). When
// that leaves a single tick, the range grows by less than an interval, to a second one.
AxisTicks valueTicks(double min, double max, int maxTicks);

// The tick values in [t.min, t.max], computed as QValueAxis does (first tick, then + interval).
QList<double> tickValues(const AxisTicks& t);
// Their labels, formatted as QValueAxis does (printf, t.format).
QStringList tickLabels(const AxisTicks& t);

}  // namespace rondo::gui
