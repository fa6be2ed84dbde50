// The Runs window on real runs: two short `rondo train` runs that differ in their learning rate
// and one stopped before it started, listed with their status, steps and losses (checked against
// each run's own events.jsonl); Compare names the setting that differs; Open shows a run in the
// monitor and remembers it among the recent runs.
#include <QJsonDocument>
#include <QJsonObject>
#include <QLabel>
#include <QPushButton>
#include <QSettings>
#include <QSignalSpy>
#include <QTableWidget>
#include <QTest>

#include "gui/app/main_window.h"
#include "gui/app/monitor.h"
#include "gui/app/rondo_cli.h"
#include "gui/app/runs_dialog.h"
#include "gui/model/run_state.h"
#include "test_support.h"

using namespace rondo::gui;

class Runs : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  QString m_dir;

  // A finished run of the fixture's model in runs/<name> at learning rate `lr`; "" or why not.
  QString train(const QString& name, const QString& lr) {
    return test::trainRun(m_dir, "runs/" + name,
                          {{"data", "validation_split = 0.2"},
                           {"training", "steps = 3\nlr = " + lr},
                           {"eval", "every = 3"}});
  }

  // The last event of `type` in a run's events.jsonl, read here on its own.
  QJsonObject lastEvent(const QString& run, const QString& type) {
    QFile f(m_dir + "/runs/" + run + "/events.jsonl");
    f.open(QIODevice::ReadOnly);
    QJsonObject last;
    for (const QByteArray& l : f.readAll().split('\n')) {
      const QJsonObject e = QJsonDocument::fromJson(l).object();
      if (e["type"].toString() == type) last = e;
    }
    return last;
  }

 private slots:
  void initTestCase() {
    const QString error = test::writeFixtureIn(m_tmp, &m_dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    // The recent runs go to this test's own settings, not the user's.
    QSettings::setDefaultFormat(QSettings::IniFormat);
    QSettings::setPath(QSettings::IniFormat, QSettings::UserScope, m_dir + "/settings");
    QCoreApplication::setOrganizationName("rondo-test");
    for (const auto& [name, lr] : {std::pair{"slow-lr", "0.001"}, std::pair{"fast-lr", "0.01"}}) {
      const QString error = train(name, lr);
      QVERIFY2(error.isEmpty(), qPrintable(error));
    }
    QDir().mkpath(m_dir + "/runs/never-started");
    QFile::copy(m_dir + "/runs/slow-lr/config.toml", m_dir + "/runs/never-started/config.toml");
    QDir().mkpath(m_dir + "/runs/not-a-run");
  }

  void listsAndComparesRuns() {
    RunsDialog d({m_dir + "/runs"}, {});
    d.resize(960, 560);
    d.show();
    QVERIFY(QTest::qWaitForWindowExposed(&d));
    auto* table = d.findChild<QTableWidget*>("runsTable");
    QCOMPARE(table->rowCount(), 3);  // not-a-run is left out
    QStringList names;
    for (int r = 0; r < 3; ++r)
      names << table->item(r, 0)->text();
    // Most recently active first; the one never started last.
    QCOMPARE(names, QStringList({"fast-lr", "slow-lr", "never-started"}));
    for (int r = 0; r < 2; ++r) {
      const QString run = names[r];
      QCOMPARE(table->item(r, 3)->text(), QString("completed"));
      QCOMPARE(table->item(r, 4)->text(), QString("3 of 3"));
      QCOMPARE(table->item(r, 2)->text(), QString("lora"));
      QCOMPARE(table->item(r, 5)->text(),
               QString::number(lastEvent(run, "step")["loss"].toDouble(), 'f', 4));
      QCOMPARE(table->item(r, 6)->text(),
               QString::number(lastEvent(run, "eval")["loss"].toDouble(), 'f', 4));
    }
    QCOMPARE(table->item(2, 3)->text(), QString("not started"));
    // Compare: on only with two selected; it names the learning rate, and only that.
    QVERIFY(!d.findChild<QPushButton*>("compareButton")->isEnabled());
    table->selectRow(0);
    table->selectionModel()->select(table->model()->index(1, 0),
                                    QItemSelectionModel::Select | QItemSelectionModel::Rows);
    QVERIFY(d.findChild<QPushButton*>("compareButton")->isEnabled());
    d.findChild<QPushButton*>("compareButton")->click();
    auto* diff = d.findChild<QTableWidget*>("differences");
    QCOMPARE(diff->rowCount(), 1);
    QCOMPARE(diff->item(0, 0)->text(), QString("training.lr"));
    QCOMPARE(diff->item(0, 1)->text(), QString("0.01"));
    QCOMPARE(diff->item(0, 2)->text(), QString("0.001"));
    const QString summary = d.findChild<QLabel*>("compareSummary")->text();
    QVERIFY2(
        summary.contains("fast-lr: completed, step 3") && summary.contains("1 setting differs"),
        qPrintable(summary));
    test::screenshot(&d, "runs_compare");
  }

  // From the window: File ▸ Runs… lists ./runs, Open shows the run in the monitor and puts it
  // first among the recent runs, which the next Runs window lists even outside ./runs.
  void opensARunFromTheWindow() {
    MainWindow win;
    win.show();
    QVERIFY(QTest::qWaitForWindowExposed(&win));
    const QString cwd = QDir::currentPath();
    QVERIFY(QDir::setCurrent(m_dir));
    RunsDialog* runs = win.showRuns();
    QDir::setCurrent(cwd);
    auto* table = runs->findChild<QTableWidget*>("runsTable");
    QVERIFY(table->rowCount() >= 2);
    int slow = -1;
    for (int r = 0; r < table->rowCount(); ++r)
      if (table->item(r, 0)->text() == "slow-lr") slow = r;
    QVERIFY(slow >= 0);
    table->selectRow(slow);
    runs->findChild<QPushButton*>("openButton")->click();
    QCOMPARE(win.monitor()->state()->runDir(), m_dir + "/runs/slow-lr");
    QCOMPARE(recentRuns().value(0), m_dir + "/runs/slow-lr");
    RunsDialog elsewhere({m_dir + "/nowhere"}, recentRuns());
    QCOMPARE(elsewhere.runs().size(), 1);
    QCOMPARE(elsewhere.runs()[0].dir, m_dir + "/runs/slow-lr");
  }
};

QTEST_MAIN(Runs)
#include "runs_test.moc"
