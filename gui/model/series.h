// A chart series (x = step) that keeps every point of a long run and hands the chart a decimated
// copy: per bucket its min and max, so a loss spike survives at any zoom. x never decreases:
// appending an x below the last one first drops the points from that x on (a resumed run).
//
//   Series loss;  loss.append(1, 3.9);  loss.append(2, 3.4);
//   QList<QPointF> shown = loss.decimated(loss.minX(), loss.maxX(), 2 * chartWidthPixels);
#pragma once

#include <QList>
#include <QPointF>
#include <limits>
#include <vector>

namespace rondo::gui {

class Series {
 public:
  // Non-finite y (a NaN loss, written as null) is kept — size() counts it — but left out of
  // min/max and of decimated(), where it leaves a gap.
  void append(double x, double y);
  void truncateFrom(double x);  // drops the points with x >= x
  void clear();

  qsizetype size() const { return static_cast<qsizetype>(m_x.size()); }
  bool isEmpty() const { return m_x.empty(); }
  QPointF last() const;  // (NaN, NaN) when empty
  QPointF at(qsizetype i) const { return {m_x[i], m_y[i]}; }

  // NaN when empty (or, for y, when no y is finite).
  double minX() const;
  double maxX() const;
  double minY() const { return m_minY; }
  double maxY() const { return m_maxY; }

  // The points with x in [x0, x1], all of them when at most maxPoints are finite; otherwise
  // maxPoints / 2 buckets of consecutive points, each giving its min and max in x order. One pass
  // over the points in range.
  QList<QPointF> decimated(double x0, double x1, int maxPoints) const;

 private:
  void recomputeY();

  std::vector<double> m_x;
  std::vector<double> m_y;
  double m_minY = std::numeric_limits<double>::quiet_NaN();
  double m_maxY = std::numeric_limits<double>::quiet_NaN();
};

}  // namespace rondo::gui
