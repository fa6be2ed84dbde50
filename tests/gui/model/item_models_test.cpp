// The item models under QAbstractItemModelTester while events arrive: live appends, eviction at
// capacity, the removals of a resumed run, and resets.
#include <QAbstractItemModelTester>
#include <QTest>

#include "event_writer.h"
#include "gui/model/run_state.h"

using namespace rondo::gui;
using namespace rondo::gui::test;

class ItemModelsTest : public QObject {
  Q_OBJECT
 private slots:
  void modelsStayConsistentWhileFeeding() {
    RunState state;
    state.timeline()->setCapacity(23);
    QAbstractItemModelTester timelineTester(state.timeline(),
                                            QAbstractItemModelTester::FailureReportingMode::QtTest);
    QAbstractItemModelTester samplesTester(state.samples(),
                                           QAbstractItemModelTester::FailureReportingMode::QtTest);
    QAbstractItemModelTester logTester(state.log(),
                                       QAbstractItemModelTester::FailureReportingMode::QtTest);
    RunSpec spec;
    spec.steps = 40;
    spec.evalEvery = 5;
    spec.checkpointEvery = 10;
    spec.runEnd = false;
    const QByteArray bytes = generateRun(spec);
    // Line by line (live), then a block that alone overflows the timeline.
    const qsizetype half = bytes.indexOf("\"step\":20,");
    qsizetype pos = 0;
    while (pos < half) {
      const qsizetype nl = bytes.indexOf('\n', pos);
      state.feed(QByteArrayView(bytes).sliced(pos, nl + 1 - pos));
      pos = nl + 1;
      QVERIFY(state.timeline()->rowCount() <= 23);
      if (QTest::currentTestFailed()) return;
    }
    state.feed(QByteArrayView(bytes).sliced(pos));
    QCOMPARE(state.timeline()->rowCount(), 23);
    QCOMPARE(state.timeline()->spans().last().step, 40);
    QCOMPARE(state.samples()->rowCount(), 9);
    QCOMPARE(state.timeline()->headerData(TimelineModel::Stage, Qt::Horizontal).toString(),
             QStringLiteral("Stage"));
    QCOMPARE(state.timeline()->columnCount(), int(TimelineModel::ColumnCount));
    const QModelIndex sample = state.samples()->index(1);
    QCOMPARE(sample.data(SamplesModel::StepRole).toLongLong(), 5);
    QCOMPARE(sample.data(SamplesModel::PromptRole).toString(),
             QStringLiteral("What is the capital of France?"));

    // A resume drops the samples after the checkpoint and restarts the timeline.
    RunSpec resumed = spec;
    resumed.firstStep = 21;
    resumed.resumedFrom = 20;
    resumed.steps = 22;
    state.feed(generateRun(resumed));
    QCOMPARE(state.samples()->rowCount(), 5);  // 0, 5, 10, 15, 20
    QCOMPARE(state.timeline()->rowCount(), 10);
    state.timeline()->setCapacity(4);
    QCOMPARE(state.timeline()->rowCount(), 4);
    QCOMPARE(state.timeline()->spans().last().step, 22);

    // The log keeps its last LogModel::kCapacity lines.
    const int before = state.log()->rowCount();
    for (int i = 0; i < 300; ++i)
      state.log()->appendLine(QStringLiteral("output %1").arg(i));
    QCOMPARE(state.log()->rowCount(), before + 300);
    QStringList many;
    for (int i = 0; i < LogModel::kCapacity - 100; ++i)
      many.append(QStringLiteral("line %1").arg(i));
    state.log()->appendLines(many);
    QCOMPARE(state.log()->rowCount(), LogModel::kCapacity);
    QCOMPARE(state.log()->lastLines(2),
             (QStringList{QStringLiteral("line %1").arg(LogModel::kCapacity - 102),
                          QStringLiteral("line %1").arg(LogModel::kCapacity - 101)}));
    many.append(many);
    state.log()->appendLines(many);  // more than the whole capacity at once
    QCOMPARE(state.log()->rowCount(), LogModel::kCapacity);
    QCOMPARE(state.log()->lastLines(1).first(), many.last());
    QCOMPARE(state.log()->lastLines(0), QStringList());

    state.reset();
    QCOMPARE(state.timeline()->rowCount(), 0);
    QCOMPARE(state.samples()->rowCount(), 0);
    QCOMPARE(state.log()->rowCount(), 0);
  }
};

QTEST_GUILESS_MAIN(ItemModelsTest)
#include "item_models_test.moc"
