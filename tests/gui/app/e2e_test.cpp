// End to end: the main window's wizard filled in, its Start button clicked, a real tiny
// `rondo train` run as the child process, followed by the monitor until `run_end`.
#include <QAbstractButton>
#include <QLabel>
#include <QLineEdit>
#include <QLineSeries>
#include <QSpinBox>
#include <QTest>

#include "gui/app/main_window.h"
#include "gui/app/monitor.h"
#include "gui/app/wizard.h"
#include "gui/model/run_state.h"
#include "test_support.h"

using namespace rondo::gui;

class EndToEnd : public QObject {
  Q_OBJECT
 private slots:
  void wizardStartRunsToTheEnd() {
    QTemporaryDir tmp;
    QVERIFY(tmp.isValid());
    const QString dir = tmp.path();
    const QString error = test::writeFixture(dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));

    MainWindow win;
    win.show();
    QVERIFY(QTest::qWaitForWindowExposed(&win));
    SetupWizard* w = win.wizard();
    test::pickModelAndData(w, dir);
    w->next();
    w->findChild<QSpinBox*>("loraRank")->setValue(4);
    w->next();
    w->next();
    w->findChild<QSpinBox*>("steps")->setValue(5);
    w->findChild<QSpinBox*>("seqLen")->setValue(64);
    w->findChild<QSpinBox*>("checkpointEvery")->setValue(2);
    w->findChild<QLineEdit*>("lr")->setText("0.01");
    w->findChild<QLineEdit*>("runDir")->setText(dir + "/e2e-run");
    w->next();  // every other setting: the defaults
    w->next();
    QCOMPARE(w->currentId(), static_cast<int>(SetupWizard::ReviewPage));
    QCOMPARE(w->findChild<QLabel*>("planVerdict")->text(), QString("fits"));

    w->button(QWizard::FinishButton)->click();  // Start
    MonitorWidget* m = win.monitor();
    QVERIFY(m->isVisible());
    QTRY_COMPARE_WITH_TIMEOUT(m->state()->status(), QString("completed"), 180000);
    QCOMPARE(m->state()->lastStep(), 5);
    QCOMPARE(m->state()->stepsTotal(), 5);
    QTRY_VERIFY(!m->childRunning());
    m->refresh();
    QCOMPARE(m->lossSeries()->count(), 5);
    QVERIFY(QFile::exists(dir + "/e2e-run/adapter/adapter_model.safetensors"));
    QVERIFY(QFile::exists(dir + "/e2e-run.toml"));
    test::screenshot(&win, "e2e_monitor");
  }
};

QTEST_MAIN(EndToEnd)
#include "e2e_test.moc"
