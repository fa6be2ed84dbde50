// A recorded 100,000-step run (2 devices, 5 spans a step: ~800k lines) opens with every step in the
// charts and the spikes kept by decimation. How fast is bench/gui_load_bench's question (a ratio
// against reading the same bytes), not a wall-clock limit here: a busy machine must not fail this.
#include <QFile>
#include <QTemporaryDir>
#include <QTest>
#include <cmath>

#include "event_writer.h"
#include "gui/model/event_tail.h"
#include "gui/model/run_state.h"

using namespace rondo::gui;
using namespace rondo::gui::test;

class LargeRunTest : public QObject {
  Q_OBJECT
 private slots:
  void hundredThousandStepsLoadWhole() {
    constexpr long long kSteps = 100'000;
    RunSpec spec;
    spec.steps = kSteps;
    spec.devices = 2;
    spec.spansPerStep = 5;
    spec.evalEvery = 1000;
    spec.checkpointEvery = 10000;
    QByteArray bytes = generateRun(spec);
    // A loss spike and a dip the decimated chart must still show.
    const QByteArray spike = "\"loss\":" + QByteArray::number(lossAt(54321), 'g', 17);
    const qsizetype at =
        bytes.indexOf(spike + ",\"lr\":" + QByteArray::number(lrAt(54321), 'g', 17));
    QVERIFY(at > 0);
    QTemporaryDir dir;
    QVERIFY(dir.isValid());
    const QString path = dir.filePath(QStringLiteral("events.jsonl"));
    {
      QFile f(path);
      QVERIFY(f.open(QIODevice::WriteOnly));
      QCOMPARE(f.write(bytes), bytes.size());
    }
    const qsizetype lines = bytes.count('\n');
    double minLoss = INFINITY, maxLoss = -INFINITY;
    for (long long step = 1; step <= kSteps; ++step) {
      minLoss = std::min(minLoss, lossAt(step));
      maxLoss = std::max(maxLoss, lossAt(step));
    }
    bytes.clear();

    RunState state;
    EventTail tail(&state);
    QString error;
    QVERIFY2(tail.open(path, &error), qPrintable(error));

    QCOMPARE(state.linesRead(), lines);
    QCOMPARE(state.malformedLines(), 0);
    QCOMPARE(state.status(), QStringLiteral("completed"));
    QCOMPARE(state.loss().size(), kSteps);
    QCOMPARE(state.loss().at(54320), QPointF(54321, lossAt(54321)));
    QCOMPARE(state.evalLoss().size(), 101);
    QCOMPARE(state.checkpoints().size(), 10);
    QCOMPARE(state.timeline()->rowCount(), TimelineModel::kDefaultCapacity);
    QCOMPARE(state.timeline()->spans().last().step, kSteps);
    QCOMPARE(state.timeline()->spans().first().step,
             kSteps - TimelineModel::kDefaultCapacity / 5 + 1);
    QCOMPARE(state.devices().size(), 2);
    QCOMPARE(state.devices()[0].bytesPeak, 679101700ull + kSteps);
    QCOMPARE(state.loss().minY(), minLoss);
    QCOMPARE(state.loss().maxY(), maxLoss);

    const QList<QPointF> shown =
        state.loss().decimated(state.loss().minX(), state.loss().maxX(), 2000);
    QVERIFY2(shown.size() <= 2000 && shown.size() >= 1000,
             qPrintable(QString::number(shown.size())));
    bool hasMin = false, hasMax = false;
    for (const QPointF& p : shown) {
      hasMin |= p.y() == minLoss;
      hasMax |= p.y() == maxLoss;
    }
    QVERIFY(hasMin && hasMax);
  }
};

QTEST_GUILESS_MAIN(LargeRunTest)
#include "large_run_test.moc"
