// EventTail follows a growing events.jsonl (the writer's lines may arrive in pieces) and reads a
// finished one; inspectRunFolder tells a run folder from anything else, and says why.
#include <QDir>
#include <QFile>
#include <QSignalSpy>
#include <QTemporaryDir>
#include <QTest>

#include "event_writer.h"
#include "gui/model/event_tail.h"
#include "gui/model/run_folder.h"
#include "gui/model/run_state.h"

using namespace rondo::gui;
using namespace rondo::gui::test;

namespace {

void appendTo(const QString& path, QByteArrayView bytes) {
  QFile f(path);
  QVERIFY(f.open(QIODevice::WriteOnly | QIODevice::Append));
  QCOMPARE(f.write(bytes.data(), bytes.size()), bytes.size());
}

}  // namespace

class EventTailTest : public QObject {
  Q_OBJECT
 private slots:
  void followsALiveRun() {
    QTemporaryDir dir;
    const QString path = dir.filePath(QStringLiteral("events.jsonl"));
    RunSpec spec;
    spec.steps = 50;
    spec.evalEvery = 25;
    const QByteArray bytes = generateRun(spec);
    const qsizetype runEndAt = bytes.lastIndexOf("{\"t\"");

    appendTo(path, {});
    RunState state;
    EventTail tail(&state);
    QSignalSpy ended(&state, &RunState::runEnded);
    QString error;
    QVERIFY2(tail.open(path, &error), qPrintable(error));
    QVERIFY(tail.isFollowing());
    QCOMPARE(state.status(), QStringLiteral("empty"));

    // The writer appends in pieces that end anywhere, the reader polls in between.
    qsizetype pos = 0;
    int polls = 0;
    while (pos < runEndAt) {
      const qsizetype n = std::min<qsizetype>(runEndAt - pos, 777);
      appendTo(path, QByteArrayView(bytes).sliced(pos, n));
      pos += n;
      tail.poll();
      ++polls;
      QCOMPARE(state.status(), QStringLiteral("running"));
    }
    QVERIFY(polls > 10);
    QCOMPARE(state.loss().size(), 50);
    QCOMPARE(state.loss().last(), QPointF(50, lossAt(50)));
    QCOMPARE(tail.bytesRead(), runEndAt);
    tail.poll();  // nothing new
    QCOMPARE(ended.count(), 0);

    appendTo(path, QByteArrayView(bytes).sliced(runEndAt));
    tail.poll();
    QCOMPARE(state.status(), QStringLiteral("completed"));
    QCOMPARE(ended.count(), 1);
    QCOMPARE(state.malformedLines(), 0);
    QCOMPARE(state.samples()->rowCount(), 3);
  }

  void aDeadProcessIsInterrupted() {
    QTemporaryDir dir;
    const QString path = dir.filePath(QStringLiteral("events.jsonl"));
    RunSpec spec;
    spec.steps = 10;
    spec.runEnd = false;
    QByteArray bytes = generateRun(spec);
    Line(bytes, "step", 99).num("loss", 0.5).integer("step", 11).end();
    bytes.chop(1);  // the last line was written without its newline, then the process died
    appendTo(path, bytes);
    RunState state;
    EventTail tail(&state);
    QVERIFY(tail.open(path));
    QCOMPARE(state.lastStep(), 10);
    tail.finish();
    QVERIFY(!tail.isFollowing());
    QCOMPARE(state.lastStep(), 11);
    QCOMPARE(state.status(), QStringLiteral("running"));
    state.markInterrupted();
    QCOMPARE(state.status(), QStringLiteral("interrupted"));
  }

  void aReplacedFileIsReadAgain() {
    QTemporaryDir dir;
    const QString path = dir.filePath(QStringLiteral("events.jsonl"));
    RunSpec spec;
    spec.steps = 30;
    appendTo(path, generateRun(spec));
    RunState state;
    EventTail tail(&state);
    QVERIFY(tail.open(path));
    QCOMPARE(state.loss().size(), 30);
    QVERIFY(QFile::remove(path));
    spec.steps = 3;
    spec.runEnd = false;
    appendTo(path, generateRun(spec));
    tail.poll();
    QCOMPARE(state.loss().size(), 3);
    QCOMPARE(state.status(), QStringLiteral("running"));
  }

  void openFailsWithAReason() {
    RunState state;
    EventTail tail(&state);
    QString error;
    QVERIFY(!tail.open(QStringLiteral("/nonexistent/run/events.jsonl"), &error));
    QVERIFY2(error.contains(QStringLiteral("/nonexistent/run/events.jsonl")), qPrintable(error));
    QVERIFY(!tail.isFollowing());
    tail.poll();  // harmless when closed
  }

  void inspectsRunFolders() {
    QTemporaryDir dir;
    const QString run = dir.filePath(QStringLiteral("run"));
    QVERIFY(QDir().mkpath(run));
    appendTo(run + QStringLiteral("/events.jsonl"), "{}\n");
    appendTo(run + QStringLiteral("/config.toml"), "[model]\n");
    RunFolderInfo info = inspectRunFolder(run);
    QVERIFY(info.isRun);
    QVERIFY(info.why.isEmpty());
    QCOMPARE(info.eventsPath, QDir(run).absoluteFilePath(QStringLiteral("events.jsonl")));
    QCOMPARE(info.configPath, QDir(run).absoluteFilePath(QStringLiteral("config.toml")));

    // A run that is configured but has not started yet.
    QVERIFY(QFile::remove(run + QStringLiteral("/events.jsonl")));
    info = inspectRunFolder(run);
    QVERIFY(info.isRun);
    QVERIFY(info.eventsPath.isEmpty());

    const QString empty = dir.filePath(QStringLiteral("empty"));
    QVERIFY(QDir().mkpath(empty));
    info = inspectRunFolder(empty);
    QVERIFY(!info.isRun);
    QCOMPARE(info.why,
             empty + QStringLiteral(" has no events.jsonl or config.toml: not a Rondo run folder"));

    info = inspectRunFolder(dir.filePath(QStringLiteral("missing")));
    QVERIFY(!info.isRun);
    QCOMPARE(info.why, dir.filePath(QStringLiteral("missing")) + QStringLiteral(" does not exist"));

    info = inspectRunFolder(run + QStringLiteral("/config.toml"));
    QVERIFY(!info.isRun);
    QVERIFY2(info.why.contains(QStringLiteral("is a file, not a folder")), qPrintable(info.why));
  }
};

QTEST_GUILESS_MAIN(EventTailTest)
#include "event_tail_test.moc"
