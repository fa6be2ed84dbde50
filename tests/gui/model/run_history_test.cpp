// Run history: each status a run folder can be in (from run_end, from the lock, killed, not
// started), the last step and losses read from the tail of a long or resumed run, the runs under a
// folder most recently active first, and what differs between two configs.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <QDir>
#include <QFile>
#include <QTemporaryDir>
#include <QTest>
#include <cmath>

#include "event_writer.h"
#include "gui/model/run_history.h"

using namespace rondo::gui;
using rondo::gui::test::evalLossAt;
using rondo::gui::test::generateRun;
using rondo::gui::test::lossAt;
using rondo::gui::test::RunSpec;

class RunHistoryTest : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

  // A run folder `name` with these events (and a config.toml when `config` is not empty).
  QString writeRun(const QString& name, const QByteArray& events, const QByteArray& config = {}) {
    const QString dir = m_tmp.filePath(name);
    QDir().mkpath(dir);
    if (!events.isEmpty()) {
      QFile f(dir + "/events.jsonl");
      f.open(QIODevice::WriteOnly);
      f.write(events);
    }
    if (!config.isEmpty()) {
      QFile f(dir + "/config.toml");
      f.open(QIODevice::WriteOnly);
      f.write(config);
    }
    return dir;
  }

 private slots:
  void eachStatus() {
    RunSpec spec;
    spec.steps = 30;
    spec.evalEvery = 10;
    RunSummary s = summarizeRun(writeRun("completed", generateRun(spec)));
    QCOMPARE(s.status, QString("completed"));
    QCOMPARE(s.stepsDone, 30);
    QCOMPARE(s.stepsTotal, 30);
    QCOMPARE(s.lastLoss, lossAt(30));
    QCOMPARE(s.lastEvalLoss, evalLossAt(30));
    QCOMPARE(s.model, QString("/models/tiny.gguf"));  // from run_start: no config.toml here
    QCOMPARE(s.method, QString("lora"));
    QCOMPARE(s.started, QDateTime::fromString("2026-12-03T00:11:05.129Z", Qt::ISODateWithMs));

    spec.status = "stopped";
    QCOMPARE(summarizeRun(writeRun("stopped", generateRun(spec))).status, QString("stopped"));

    // No run_end: killed when nobody holds the lock, running while a trainer holds it.
    spec.runEnd = false;
    spec.stepsTotal = 100;
    s = summarizeRun(writeRun("killed", generateRun(spec)));
    QCOMPARE(s.status, QString("interrupted"));
    QCOMPARE(s.stepsDone, 30);
    QCOMPARE(s.stepsTotal, 100);
    const QString live = writeRun("live", generateRun(spec));
    const int fd = ::open(QFile::encodeName(live + "/rondo.lock").constData(),
                          O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    QVERIFY(fd >= 0);
    QCOMPARE(::flock(fd, LOCK_EX | LOCK_NB), 0);
    QCOMPARE(summarizeRun(live).status, QString("running"));  // locked, its text not written yet
    QCOMPARE(::pwrite(fd, "4242 rondo train --resume\n", 26, 0), 26);
    QCOMPARE(summarizeRun(live).status, QString("running"));
    // An export of a killed run holds the lock too: the run is still interrupted.
    QCOMPARE(::ftruncate(fd, 0), 0);
    QCOMPARE(::pwrite(fd, "4243 rondo export\n", 18, 0), 18);
    QCOMPARE(summarizeRun(live).status, QString("interrupted"));
    ::close(fd);  // the trainer is gone
    QCOMPARE(summarizeRun(live).status, QString("interrupted"));

    // A config and no events: not started; its model and method come from the config.
    s = summarizeRun(writeRun("new", {},
                              "[model]\npath = \"/m/Qwen3\"\n[training]\nmethod = "
                              "\"full\"\nlr = 1e-05\n"));
    QCOMPARE(s.status, QString("not started"));
    QCOMPARE(s.model, QString("/m/Qwen3"));
    QCOMPARE(s.method, QString("full"));
    QCOMPARE(s.config.value("training.lr"), QString("1e-05"));

    // Not a run.
    QDir().mkpath(m_tmp.filePath("empty"));
    QCOMPARE(summarizeRun(m_tmp.filePath("empty")).status, QString());
  }

  // A long run is read from its tail (its last step, not its first); a resumed run's file holds
  // the first segment's run_end (stopped) and then the resume's (completed).
  void longAndResumedRuns() {
    RunSpec spec;
    spec.steps = 4000;
    spec.spansPerStep = 10;
    const QByteArray events = generateRun(spec);
    QVERIFY(events.size() > 4 * 256 * 1024);
    RunSummary s = summarizeRun(writeRun("long", events));
    QCOMPARE(s.stepsDone, 4000);
    QCOMPARE(s.lastLoss, lossAt(4000));
    QCOMPARE(s.status, QString("completed"));

    RunSpec first;
    first.steps = 50;
    first.stepsTotal = 100;
    first.status = "stopped";
    RunSpec second = first;
    second.firstStep = 51;
    second.steps = 100;
    second.resumedFrom = 50;
    second.status = "completed";
    s = summarizeRun(writeRun("resumed", generateRun(first) + generateRun(second)));
    QCOMPARE(s.status, QString("completed"));
    QCOMPARE(s.stepsDone, 100);
    // A resume that was killed: the earlier segment's "stopped" does not count.
    second.runEnd = false;
    s = summarizeRun(writeRun("resumed-killed", generateRun(first) + generateRun(second)));
    QCOMPARE(s.status, QString("interrupted"));
  }

  void findsRunsOnceNewestFirst() {
    QTemporaryDir root;
    auto write = [&](const QString& name, const char* time, const QByteArray& status) {
      QDir().mkpath(root.filePath(name));
      QFile f(root.filePath(name + "/events.jsonl"));
      f.open(QIODevice::WriteOnly);
      f.write(QByteArray("{\"t\":0,\"time\":\"") + time +
              "\",\"type\":\"run_start\",\"v\":1,\"steps_total\":5}\n{\"t\":1,\"time\":\"" + time +
              "\",\"type\":\"run_end\",\"v\":1,\"status\":\"" + status + "\",\"steps\":5}\n");
    };
    write("a", "2026-12-01T10:00:00.000Z", "completed");
    write("b", "2026-12-03T10:00:00.000Z", "failed");
    write("c", "2026-12-02T10:00:00.000Z", "stopped");
    QDir().mkpath(root.filePath("not-a-run"));
    QFile(root.filePath("model.gguf")).open(QIODevice::WriteOnly);
    const QList<RunSummary> runs = findRuns({root.path()}, {root.filePath("a")});
    QStringList names;
    for (const RunSummary& r : runs)
      names << QDir(r.dir).dirName() + ":" + r.status;
    QCOMPARE(names, QStringList({"b:failed", "c:stopped", "a:completed"}));
  }

  void differencesBetweenConfigs() {
    const QMap<QString, QString> a = {{"training.lr", "0.0002"},
                                      {"lora.rank", "16"},
                                      {"output.run_dir", "\"runs/a\""},
                                      {"data.seq_len", "1024"}};
    const QMap<QString, QString> b = {{"training.lr", "0.0001"},
                                      {"lora.rank", "16"},
                                      {"output.run_dir", "\"runs/b\""},
                                      {"training.optimizer", "\"adamw_8bit\""}};
    const QList<ConfigDifference> d = configDifferences(a, b);
    QCOMPARE(d.size(), 3);
    QCOMPARE(d[0].key, QString("data.seq_len"));
    QCOMPARE(d[0].b, QString());
    QCOMPARE(d[1].key, QString("training.lr"));
    QCOMPARE(d[1].a, QString("0.0002"));
    QCOMPARE(d[1].b, QString("0.0001"));
    QCOMPARE(d[2].key, QString("training.optimizer"));
  }
};

QTEST_GUILESS_MAIN(RunHistoryTest)
#include "run_history_test.moc"
