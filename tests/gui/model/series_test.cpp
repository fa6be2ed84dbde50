// Series: min/max bookkeeping, truncation for resumed runs, and decimation that keeps spikes.
#include <QRandomGenerator>
#include <QTest>
#include <cmath>
#include <limits>

#include "gui/model/series.h"

using rondo::gui::Series;

class SeriesTest : public QObject {
  Q_OBJECT
 private slots:
  void emptyIsNaN() {
    Series s;
    QVERIFY(s.isEmpty());
    QCOMPARE(s.size(), 0);
    QVERIFY(std::isnan(s.minX()) && std::isnan(s.maxY()) && std::isnan(s.last().x()));
    QVERIFY(s.decimated(0, 10, 100).isEmpty());
  }

  void minMaxSkipNonFinite() {
    Series s;
    s.append(1, std::numeric_limits<double>::quiet_NaN());
    QCOMPARE(s.size(), 1);
    QVERIFY(std::isnan(s.minY()));
    s.append(2, 3.5);
    s.append(3, -1.25);
    s.append(4, std::numeric_limits<double>::quiet_NaN());
    s.append(5, 7.0);
    QCOMPARE(s.size(), 5);
    QCOMPARE(s.minX(), 1.0);
    QCOMPARE(s.maxX(), 5.0);
    QCOMPARE(s.minY(), -1.25);
    QCOMPARE(s.maxY(), 7.0);
    // The NaN points leave gaps: they are not drawn.
    const QList<QPointF> all = s.decimated(0, 10, 100);
    QCOMPARE(all, (QList<QPointF>{{2, 3.5}, {3, -1.25}, {5, 7.0}}));
  }

  void truncateFromDropsTheTail() {
    Series s;
    for (int i = 1; i <= 10; ++i)
      s.append(i, i == 9 ? 100.0 : i);
    QCOMPARE(s.maxY(), 100.0);
    s.truncateFrom(8);
    QCOMPARE(s.size(), 7);
    QCOMPARE(s.last(), QPointF(7, 7));
    QCOMPARE(s.maxY(), 7.0);  // the spike went with its step
    s.truncateFrom(100);      // nothing at or after 100
    QCOMPARE(s.size(), 7);
    // Appending an x below the last one replaces from there on.
    s.append(5, 0.5);
    QCOMPARE(s.size(), 5);
    QCOMPARE(s.last(), QPointF(5, 0.5));
    QCOMPARE(s.minY(), 0.5);
    s.clear();
    QVERIFY(s.isEmpty());
    QVERIFY(std::isnan(s.maxY()));
  }

  void decimatedReturnsEverythingThatFits() {
    Series s;
    for (int i = 0; i < 50; ++i)
      s.append(i, i * i);
    QList<QPointF> all = s.decimated(-1, 100, 50);
    QCOMPARE(all.size(), 50);
    QList<QPointF> part = s.decimated(10, 19, 1000);  // inclusive range
    QCOMPARE(part.size(), 10);
    QCOMPARE(part.first(), QPointF(10, 100));
    QCOMPARE(part.last(), QPointF(19, 361));
  }

  // Every bucket's min and max survive, in x order: a one-step spike is never averaged away.
  void decimatedKeepsSpikesAndBounds() {
    const quint32 seed = QRandomGenerator::global()->generate();
    QRandomGenerator rng(seed);
    Series s;
    const int n = 1'000'003;  // not a multiple of the bucket count
    std::vector<double> ys(n);
    for (int i = 0; i < n; ++i) {
      ys[i] = rng.generateDouble();
      s.append(i + 1, ys[i]);
    }
    const int spikeAt = static_cast<int>(rng.bounded(n)), dipAt = static_cast<int>(rng.bounded(n));
    // Rebuild with the spike and dip in place.
    s.clear();
    ys[spikeAt] = 50.0;
    ys[dipAt] = -50.0;
    for (int i = 0; i < n; ++i)
      s.append(i + 1, ys[i]);

    const QList<QPointF> d = s.decimated(s.minX(), s.maxX(), 2000);
    QVERIFY2(d.size() <= 2000, qPrintable(QString::number(d.size())));
    QVERIFY2(d.size() >= 1900, qPrintable(QString::number(d.size())));
    bool hasSpike = false, hasDip = false;
    for (qsizetype i = 0; i < d.size(); ++i) {
      if (i > 0) QVERIFY(d[i].x() > d[i - 1].x());
      hasSpike |= d[i] == QPointF(spikeAt + 1, 50.0);
      hasDip |= d[i] == QPointF(dipAt + 1, -50.0);
    }
    QVERIFY2(hasSpike && hasDip, qPrintable(QStringLiteral("seed %1").arg(seed)));

    // Each output point is its bucket's min or max: check against a brute force over a zoomed
    // range.
    const double x0 = 1000, x1 = 21000;
    const QList<QPointF> z = s.decimated(x0, x1, 100);
    QCOMPARE(z.size(), 100);
    const int buckets = 50, count = 20001;
    for (int b = 0; b < buckets; ++b) {
      const int first = 999 + count * b / buckets, end = 999 + count * (b + 1) / buckets;
      auto [lo, hi] = std::minmax_element(ys.begin() + first, ys.begin() + end);
      QPointF pLo(double(lo - ys.begin()) + 1, *lo), pHi(double(hi - ys.begin()) + 1, *hi);
      QVERIFY2(z.contains(pLo) && z.contains(pHi), qPrintable(QStringLiteral("bucket %1").arg(b)));
    }
  }
};

QTEST_GUILESS_MAIN(SeriesTest)
#include "series_test.moc"
