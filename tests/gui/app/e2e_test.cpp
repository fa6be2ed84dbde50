// End to end: the main window's wizard filled in, its Start button clicked, a real tiny
// `rondo train` run as the child process, followed by the monitor until `run_end`; a supervised
// run, and a DPO run set up on the Data page whose monitor charts its margin and accuracy.
#include <QAbstractButton>
#include <QChartView>
#include <QCheckBox>
#include <QComboBox>
#include <QDoubleSpinBox>
#include <QLabel>
#include <QLineEdit>
#include <QLineSeries>
#include <QSpinBox>
#include <QTest>
#include <QTextEdit>
#include <cmath>

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

  void wizardSetsUpADpoRunAndTheMonitorChartsIt() {
    QTemporaryDir tmp;
    QVERIFY(tmp.isValid());
    const QString dir = tmp.path();
    const QString error = test::writeFixture(dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    // Sixteen pairs in TRL's standard layout: a prompt, a preferred and a rejected answer.
    QFile pairs(dir + "/pairs.jsonl");
    QVERIFY(pairs.open(QIODevice::WriteOnly));
    const char* qa[][3] = {
        {"sky?", "blue", "green"},       {"grass?", "green", "red"}, {"snow?", "white", "black"},
        {"night?", "dark", "bright"},    {"sun?", "hot", "cold"},    {"ice?", "cold", "warm"},
        {"cat?", "meow", "woof"},        {"dog?", "woof", "moo"},    {"2+2?", "four", "five"},
        {"1+1?", "two", "three"},        {"sea?", "salty", "sweet"}, {"lemon?", "sour", "sweet"},
        {"fire?", "hot", "cold"},        {"coal?", "black", "pink"}, {"milk?", "white", "purple"},
        {"hi", "hello there", "go away"}};
    for (const auto& p : qa)
      pairs.write(QString(R"({"prompt": "%1", "chosen": " %2", "rejected": " %3"})"
                          "\n")
                      .arg(p[0], p[1], p[2])
                      .toUtf8());
    pairs.close();

    MainWindow win;
    win.show();
    QVERIFY(QTest::qWaitForWindowExposed(&win));
    SetupWizard* w = win.wizard();
    w->findChild<QLineEdit*>("modelPath")->setText(dir + "/model");
    w->refreshModel();
    w->next();
    // The Data page: the objective, with what it needs, then the pairs and a preview of one.
    auto* objective = w->findChild<QComboBox*>("objective");
    auto* note = w->findChild<QLabel*>("objectiveNote");
    QVERIFY2(note->text().contains("one answer per example"), qPrintable(note->text()));
    QVERIFY(!w->findChild<QDoubleSpinBox*>("preferenceBeta")->isEnabled());
    objective->setCurrentIndex(objective->findData("dpo"));
    QVERIFY2(note->text().contains("pairs") && note->text().contains("chosen"),
             qPrintable(note->text()));
    QVERIFY(w->findChild<QDoubleSpinBox*>("preferenceBeta")->isEnabled());
    // A pair's loss is on its answers: "train on prompts too" means nothing for it.
    QVERIFY(!w->findChild<QCheckBox*>("trainOnEverything")->isEnabled());
    w->findChild<QLineEdit*>("dataPath")->setText(dir + "/pairs.jsonl");
    w->refreshData();
    const QString stats = w->findChild<QLabel*>("dataStats")->text();
    QVERIFY2(stats.contains("preference") && stats.contains("16 pairs"), qPrintable(stats));
    const QString preview = w->findChild<QTextEdit*>("dataPreview")->toHtml();
    for (const char* part : {"Chosen", "Rejected", "sky?", "blue", "green", "#1b7f3b", "#b00020"})
      QVERIFY2(preview.contains(part), qPrintable(QString(part) + " not in " + preview));
    QVERIFY(w->currentPage()->isComplete());
    w->findChild<QDoubleSpinBox*>("validationSplit")->setValue(0.25);
    test::screenshot(w, "wizard_2_data_preference");
    // Supervised training refuses pairs, and says what to set.
    objective->setCurrentIndex(objective->findData("sft"));
    QVERIFY(!w->currentPage()->isComplete());
    QVERIFY2(w->findChild<QLabel*>("dataStats")->text().contains("dpo, orpo or simpo"),
             qPrintable(w->findChild<QLabel*>("dataStats")->text()));
    objective->setCurrentIndex(objective->findData("dpo"));
    QVERIFY(w->currentPage()->isComplete());
    w->next();
    w->findChild<QSpinBox*>("loraRank")->setValue(4);
    w->next();
    w->next();
    w->findChild<QSpinBox*>("steps")->setValue(6);
    w->findChild<QSpinBox*>("seqLen")->setValue(64);
    w->findChild<QSpinBox*>("batchRows")->setValue(2);
    w->findChild<QLineEdit*>("lr")->setText("0.01");
    w->findChild<QLineEdit*>("runDir")->setText(dir + "/dpo-run");
    const QString toml = w->config().toToml();
    QVERIFY2(toml.contains("objective = \"dpo\"") && toml.contains("[preference]\nbeta = 0.1"),
             qPrintable(toml));
    w->next();
    w->next();
    QCOMPARE(w->currentId(), static_cast<int>(SetupWizard::ReviewPage));
    QCOMPARE(w->findChild<QLabel*>("planVerdict")->text(), QString("fits"));
    // The plan's time includes DPO's pass over the pairs before step 1.
    const QString speed = w->findChild<QLabel*>("planSpeed")->text();
    QVERIFY2(speed.contains("DPO's reference pass"), qPrintable(speed));

    w->button(QWizard::FinishButton)->click();  // Start
    MonitorWidget* m = win.monitor();
    QTRY_COMPARE_WITH_TIMEOUT(m->state()->status(), QString("completed"), 180000);
    QTRY_VERIFY(!m->childRunning());
    m->refresh();
    // Margin and accuracy, each step's and the validation pairs' (before step 1 and after).
    QVERIFY(m->marginView()->isVisible() && m->accuracyView()->isVisible());
    QCOMPARE(m->marginSeries()->count(), 6);
    QCOMPARE(m->accuracySeries()->count(), 6);
    QVERIFY(m->state()->evalMargin().size() >= 2);
    // Step 1's margin is 0 (to rounding): the policy is its own reference until the first
    // update. Training on these pairs then makes the chosen answers the likelier ones.
    QVERIFY(std::abs(m->state()->margin().at(0).y()) < 1e-4);
    QVERIFY2(m->state()->margin().last().y() > 0, qPrintable(m->statusText()));
    QVERIFY2(m->statusText().contains("margin") && m->statusText().contains("accuracy"),
             qPrintable(m->statusText()));
    test::screenshot(&win, "monitor_preference");
    // A supervised run's monitor shows no preference charts (the test above's run is one).
  }
};

QTEST_MAIN(EndToEnd)
#include "e2e_test.moc"
