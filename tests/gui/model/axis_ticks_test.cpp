// Axis ranges and ticks of the monitor's charts: whole steps each labelled once (before, a fixed 5
// ticks labelled "%d" gave "0 0 1 2 3" for steps 0 to 3 and "1 1 1 1 2" for one step), a value
// axis with a span for a single point, and labels that tell every tick apart, learning rates in
// scientific notation.
#include <QRandomGenerator>
#include <QSet>
#include <QTest>
#include <cmath>
#include <limits>

#include "gui/model/axis_ticks.h"

using namespace rondo::gui;

namespace {

// 1, 2 or 5 × 10^k.
bool isNice(double interval) {
  const double k = std::floor(std::log10(interval) + 1e-9);
  const double m = interval / std::pow(10.0, k);
  return std::abs(m - 1) < 1e-9 || std::abs(m - 2) < 1e-9 || std::abs(m - 5) < 1e-9;
}

QString describe(const AxisTicks& t) {
  return QString("[%1, %2] every %3 (%4): %5")
      .arg(t.min, 0, 'g', 17)
      .arg(t.max, 0, 'g', 17)
      .arg(t.interval, 0, 'g', 17)
      .arg(t.format, tickLabels(t).join(' '));
}

}  // namespace

class AxisTicksTest : public QObject {
  Q_OBJECT
 private slots:
  void stepRangeHoldsEveryStep() {
    QCOMPARE(stepRange(1, 3), std::make_pair(1.0, 3.0));
    QCOMPARE(stepRange(0, 200), std::make_pair(0.0, 200.0));
    // One step: a step either side, not below 0.
    QCOMPARE(stepRange(1, 1), std::make_pair(0.0, 2.0));
    QCOMPARE(stepRange(0, 0), std::make_pair(0.0, 2.0));
    QCOMPARE(stepRange(500, 500), std::make_pair(499.0, 501.0));
    QCOMPARE(stepRange(NAN, NAN), std::make_pair(0.0, 1.0));
  }

  // Few steps: a tick at every step.
  void fewStepsTickEveryStep_data() {
    QTest::addColumn<int>("steps");
    QTest::addColumn<QStringList>("labels");
    QTest::addRow("1") << 1 << QStringList{"0", "1", "2"};
    QTest::addRow("2") << 2 << QStringList{"1", "2"};
    QTest::addRow("3") << 3 << QStringList{"1", "2", "3"};
    QTest::addRow("5") << 5 << QStringList{"1", "2", "3", "4", "5"};
    QTest::addRow("8") << 8 << QStringList{"1", "2", "3", "4", "5", "6", "7", "8"};
  }

  void fewStepsTickEveryStep() {
    QFETCH(int, steps);
    QFETCH(QStringList, labels);
    const auto [lo, hi] = stepRange(1, steps);
    const AxisTicks t = stepTicks(lo, hi, 8);
    QCOMPARE(t.interval, 1.0);
    QCOMPARE(tickLabels(t), labels);
  }

  // Many steps: round intervals, at most the ticks asked for.
  void manyStepsTickRoundIntervals() {
    AxisTicks t = stepTicks(1, 12, 8);
    QCOMPARE(tickLabels(t), (QStringList{"2", "4", "6", "8", "10", "12"}));
    t = stepTicks(1, 200, 8);
    QCOMPARE(t.interval, 50.0);
    QCOMPARE(tickLabels(t), (QStringList{"50", "100", "150", "200"}));
    t = stepTicks(0, 12345, 8);
    QCOMPARE(tickLabels(t), (QStringList{"0", "2000", "4000", "6000", "8000", "10000", "12000"}));
    t = stepTicks(1, 200, 2);  // a narrow chart
    QCOMPARE(tickLabels(t), (QStringList{"100", "200"}));
    t = stepTicks(1, 3, 2);
    QCOMPARE(tickLabels(t), (QStringList{"2"}));
    t = stepTicks(0, 1'000'000, 5);
    QCOMPARE(tickLabels(t), (QStringList{"0", "500000", "1000000"}));
  }

  // Any step range and tick budget: whole, distinct, increasing steps inside the range, at most
  // maxTicks of them, on a 1-2-5 interval.
  void stepTicksAreWholeAndDistinct() {
    const quint32 seed = QRandomGenerator::global()->generate();
    QRandomGenerator rng(seed);
    for (int i = 0; i < 20000; ++i) {
      const qint64 first = rng.bounded(0, i % 2 ? 100 : 2'000'000);
      const qint64 last = first + rng.bounded(0, i % 3 ? 50 : 3'000'000);
      const int maxTicks = rng.bounded(1, 12);
      const auto [lo, hi] = stepRange(first, last);
      const AxisTicks t = stepTicks(lo, hi, maxTicks);
      const QString what = QString("seed %1: %2").arg(seed).arg(describe(t));
      QVERIFY2(t.interval >= 1 && t.interval == std::floor(t.interval) && isNice(t.interval),
               qPrintable(what));
      const QList<double> values = tickValues(t);
      const QStringList labels = tickLabels(t);
      QVERIFY2(!values.isEmpty() && values.size() <= std::max(maxTicks, 2), qPrintable(what));
      QVERIFY2(QSet<QString>(labels.begin(), labels.end()).size() == labels.size(),
               qPrintable(what));
      for (int j = 0; j < values.size(); ++j) {
        QVERIFY2(values[j] == std::floor(values[j]), qPrintable(what));
        QVERIFY2(values[j] >= lo && values[j] <= hi, qPrintable(what));
        QCOMPARE(labels[j], QString::number(static_cast<qint64>(values[j])));
      }
      // A budget of 5 or more shows at least 2 ticks when there are 2 steps to show (with less,
      // an interval 2.5 times the next finer one may hold a single tick: 2..8 by 5).
      if (maxTicks >= 5 && last > first) QVERIFY2(values.size() >= 2, qPrintable(what));
    }
  }

  // One point, or all equal: a span around it and labels that differ (before: "…").
  void singleValueHasASpan_data() {
    QTest::addColumn<double>("value");
    QTest::addColumn<QString>("inLabels");
    QTest::addRow("loss") << 3.9 << "3.9";
    QTest::addRow("zero") << 0.0 << "0.0";
    QTest::addRow("lr") << 2e-4 << "2.00e-04";
    QTest::addRow("tokens/s") << 1800.0 << "1800";
    QTest::addRow("negative") << -2.5 << "-2.50";
    QTest::addRow("huge") << 3e9 << "3.0e+09";
  }

  void singleValueHasASpan() {
    QFETCH(double, value);
    QFETCH(QString, inLabels);
    const auto [lo, hi] = valueRange(value, value);
    QVERIFY(lo < value && value < hi);
    // ±5%, or ±1 around 0.
    const double pad = value == 0 ? 1 : 0.05 * std::abs(value);
    QCOMPARE(hi - value, pad);
    QCOMPARE(value - lo, pad);
    const AxisTicks t = valueTicks(lo, hi, 5);
    const QStringList labels = tickLabels(t);
    QVERIFY2(labels.size() >= 3 && labels.size() <= 5, qPrintable(describe(t)));
    QVERIFY2(QSet<QString>(labels.begin(), labels.end()).size() == labels.size(),
             qPrintable(describe(t)));
    QVERIFY2(labels.contains(inLabels), qPrintable(describe(t)));
  }

  void valueRangeHasMargins() {
    auto [lo, hi] = valueRange(2, 4);
    QCOMPARE(lo, 1.9);
    QCOMPARE(hi, 4.1);
    // Not below 0 for values that are not.
    std::tie(lo, hi) = valueRange(0, 2e-4);
    QCOMPARE(lo, 0.0);
    QCOMPARE(hi, 2.1e-4);
    std::tie(lo, hi) = valueRange(-1, 1);
    QCOMPARE(lo, -1.1);
    std::tie(lo, hi) = valueRange(NAN, 1);
    QCOMPARE(std::make_pair(lo, hi), std::make_pair(0.0, 1.0));
  }

  void valueLabelsFitTheirScale() {
    // A loss.
    AxisTicks t = valueTicks(1.7, 4.3, 6);
    QCOMPARE(t.format, QString("%.1f"));
    QCOMPARE(tickLabels(t), (QStringList{"2.0", "2.5", "3.0", "3.5", "4.0"}));
    // A warm-up to 2e-4: scientific, one digit more than the exponents need.
    t = valueTicks(0, 2.1e-4, 5);
    QCOMPARE(tickLabels(t), (QStringList{"0.0e+00", "5.0e-05", "1.0e-04", "1.5e-04", "2.0e-04"}));
    // Tokens/s that barely move.
    t = valueTicks(1799, 1817.8, 5);
    QCOMPARE(tickLabels(t), (QStringList{"1800", "1805", "1810", "1815"}));
    // A gradient norm near 1.
    t = valueTicks(0.95, 1.05, 5);
    QCOMPARE(tickLabels(t), (QStringList{"0.96", "0.98", "1.00", "1.02", "1.04"}));
  }

  // Any range: distinct labels (the format has the digits to tell ticks apart), values inside
  // the range, 2 to maxTicks of them.
  void valueTicksTellTicksApart() {
    const quint32 seed = QRandomGenerator::global()->generate();
    QRandomGenerator rng(seed);
    for (int i = 0; i < 20000; ++i) {
      const double scale = std::pow(10.0, rng.generateDouble() * 18 - 9);
      const double a = (rng.generateDouble() * 2 - (i % 4 ? 0 : 1)) * scale;
      const double b = i % 5 ? a + rng.generateDouble() * scale : a;  // every 5th: one value
      const int maxTicks = rng.bounded(2, 9);
      const auto [lo, hi] = valueRange(std::min(a, b), std::max(a, b));
      const AxisTicks t = valueTicks(lo, hi, maxTicks);
      // The range it shows holds the one asked for, grown by less than an interval if at all.
      QVERIFY(t.min <= lo && t.max >= hi && (t.min == lo || t.max == hi));
      QVERIFY(lo - t.min <= 1.001 * t.interval && t.max - hi <= 1.001 * t.interval);
      const QString what = QString("seed %1, %2..%3 by %4: %5")
                               .arg(seed)
                               .arg(a, 0, 'g', 17)
                               .arg(b, 0, 'g', 17)
                               .arg(maxTicks)
                               .arg(describe(t));
      QVERIFY2(hi > lo && isNice(t.interval), qPrintable(what));
      const QList<double> values = tickValues(t);
      const QStringList labels = tickLabels(t);
      QVERIFY2(values.size() >= 2 && values.size() <= maxTicks, qPrintable(what));
      QVERIFY2(QSet<QString>(labels.begin(), labels.end()).size() == labels.size(),
               qPrintable(what));
      for (double v : values)
        QVERIFY2(v >= t.min && v <= t.max, qPrintable(what));
      // Short labels, but for values that differ in their fifth digit or further.
      const double mag = std::max(std::abs(lo), std::abs(hi));
      for (const QString& l : labels) {
        bool ok = false;
        l.toDouble(&ok);
        QVERIFY2(ok && (l.size() <= 11 || hi - lo < 1e-2 * mag), qPrintable(what));
      }
    }
  }
};

QTEST_GUILESS_MAIN(AxisTicksTest)
#include "axis_ticks_test.moc"
