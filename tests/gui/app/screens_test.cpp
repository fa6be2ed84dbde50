// Every wizard page, the monitor, its Chat tab and the export dialog, rendered offscreen to PNG in
// the build folder (wizard_*.png, monitor.png, monitor_chat.png, export_dialog.png), with checks
// that they show something: labels filled from the real rondo CLI, the chart has points, the
// timeline has bars. Also: a folder that is not a run, and a child that fails before its run starts
// (its error and last log lines are shown).
#include <QCheckBox>
#include <QComboBox>
#include <QDoubleSpinBox>
#include <QJsonArray>
#include <QJsonDocument>
#include <QJsonObject>
#include <QLabel>
#include <QLineEdit>
#include <QLineSeries>
#include <QListWidget>
#include <QLocale>
#include <QPlainTextEdit>
#include <QProcess>
#include <QProgressBar>
#include <QPushButton>
#include <QRadioButton>
#include <QRegularExpression>
#include <QScopeGuard>
#include <QSignalSpy>
#include <QSpinBox>
#include <QStandardItemModel>
#include <QStatusBar>
#include <QTabWidget>
#include <QTableWidget>
#include <QTest>
#include <QTextEdit>
#include <cmath>
#include <memory>
#include <vector>

#include "../../support/free_port.h"
#include "gui/app/chat_panel.h"
#include "gui/app/export_dialog.h"
#include "gui/app/format.h"
#include "gui/app/main_window.h"
#include "gui/app/monitor.h"
#include "gui/app/rondo_cli.h"
#include "gui/app/timeline_view.h"
#include "gui/app/wizard.h"
#include "gui/model/run_state.h"
#include "test_support.h"

using namespace rondo::gui;

class Screens : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  QString m_dir;

 private slots:
  void initTestCase() {
    const QString error = test::writeFixtureIn(m_tmp, &m_dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));
  }

  void wizardPages() {
    SetupWizard w;
    w.resize(900, 720);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));

    // Model: family, size and dtype from `rondo inspect --json`.
    w.findChild<QLineEdit*>("modelPath")->setText(m_dir + "/model");
    w.refreshModel();
    const QString info = w.findChild<QLabel*>("modelInfo")->text();
    QVERIFY2(info.contains("llama") && info.contains("2 layers") && info.contains("F32"),
             qPrintable(info));
    QVERIFY(w.currentPage()->isComplete());
    QImage img = test::screenshot(&w, "wizard_1_model");
    QVERIFY(test::colours(img) > 8);

    // Data: the detected format, statistics, one example with trained and masked text.
    w.next();
    w.findChild<QLineEdit*>("dataPath")->setText(m_dir + "/chat.jsonl");
    w.refreshData();
    const QString stats = w.findChild<QLabel*>("dataStats")->text();
    QVERIFY2(stats.contains("chat") && stats.contains("10 examples"), qPrintable(stats));
    const QString preview = w.findChild<QTextEdit*>("dataPreview")->toHtml();
    QVERIFY2(preview.contains("#1b7f3b") && preview.contains("#8a8a8a"), qPrintable(preview));
    QVERIFY2(preview.contains("hello there"), qPrintable(preview));
    QVERIFY(w.currentPage()->isComplete());
    img = test::screenshot(&w, "wizard_2_data");
    QVERIFY(test::colours(img) > 8);

    // Method.
    w.next();
    w.findChild<QSpinBox*>("loraRank")->setValue(4);
    // LoRA dropout and rsLoRA are set here and reach the config.
    w.findChild<QDoubleSpinBox*>("loraDropout")->setValue(0.05);
    w.findChild<QCheckBox*>("loraRslora")->setChecked(true);
    QVERIFY(w.config().toToml().contains("dropout = 0.05\nrslora = true"));
    // The frozen base's form is LoRA's: a full run writes "auto" whatever the greyed box says
    // (the CLI refuses a quantised base to train).
    auto* quantize = w.findChild<QComboBox*>("quantize");
    quantize->setCurrentIndex(quantize->findData("nf4"));
    QVERIFY(w.config().toToml().contains("quantize = \"nf4\""));
    w.findChild<QRadioButton*>("methodFull")->setChecked(true);
    QVERIFY(!quantize->isEnabled());
    QVERIFY(w.config().toToml().contains("quantize = \"auto\""));
    w.findChild<QRadioButton*>("methodLora")->setChecked(true);
    quantize->setCurrentIndex(quantize->findData("auto"));
    w.findChild<QCheckBox*>("loraRslora")->setChecked(false);
    w.findChild<QDoubleSpinBox*>("loraDropout")->setValue(0);
    // all-linear absorbs the attention names; the experts' (GPT-OSS's all-linear leaves them
    // out) and the router's stay.
    for (const char* t : {"q_proj", "down_proj", "gate"})
      w.findChild<QCheckBox*>(QString("target_") + t)->setChecked(true);
    QVERIFY2(w.config().toToml().contains("targets = [\"all-linear\", \"down_proj\", \"gate\"]"),
             qPrintable(w.config().toToml()));
    for (const char* t : {"q_proj", "down_proj", "gate"})
      w.findChild<QCheckBox*>(QString("target_") + t)->setChecked(false);
    img = test::screenshot(&w, "wizard_3_method");
    QVERIFY(test::colours(img) > 8);

    // Hardware: the devices rondo found (here the CPU, or simulated GPUs on request).
    w.next();
    auto* devices = w.findChild<QListWidget*>("devices");
    QVERIFY(devices->count() > 0);
    // The list follows the number of simulated GPUs: two of them, and a line that says so.
    w.findChild<QSpinBox*>("simDevices")->setValue(2);
    QCOMPARE(devices->count(), 3);
    QVERIFY2(devices->item(0)->text().startsWith("sim0") &&
                 devices->item(1)->text().startsWith("sim1") &&
                 devices->item(2)->text().contains("2 simulated"),
             qPrintable(devices->item(0)->text()));
    img = test::screenshot(&w, "wizard_4_hardware");
    QVERIFY(test::colours(img) > 8);

    // Training.
    w.next();
    w.findChild<QSpinBox*>("steps")->setValue(6);
    w.findChild<QSpinBox*>("seqLen")->setValue(64);
    w.findChild<QLineEdit*>("lr")->setText("0.01");
    w.findChild<QLineEdit*>("runDir")->setText(m_dir + "/wizard-run");
    // The words users know, and the batch they add up to.
    w.findChild<QSpinBox*>("batchRows")->setValue(2);
    w.findChild<QSpinBox*>("gradAccum")->setValue(3);
    QCOMPARE(w.findChild<QLabel*>("effectiveBatch")->text(),
             QString("Effective batch: 6 sequences of up to 64 tokens per optimizer step"));
    w.findChild<QSpinBox*>("gradAccum")->setValue(1);
    QVERIFY(w.currentPage()->isComplete());
    img = test::screenshot(&w, "wizard_5_training");
    QVERIFY(test::colours(img) > 8);

    // Every other setting, from the CLI's own list of keys: none a page sets, each with its
    // default; a changed one goes into its section of the config, an unchanged one does not.
    w.next();
    QCOMPARE(w.currentId(), static_cast<int>(SetupWizard::AdvancedPage));
    QVERIFY(!w.findChild<QWidget*>("adv_training.lr"));  // on the Training page
    // Each key has one place: no Advanced row for a key a page writes (it would go into the
    // config twice, which TOML refuses).
    const QSet<QString> pageKeys = WizardConfig::pageKeys();
    QVERIFY(pageKeys.contains("hardware.offload_dir") && !pageKeys.contains("output.exports"));
    for (const QWidget* row : w.findChildren<QWidget*>(QRegularExpression("^adv_")))
      QVERIFY2(!pageKeys.contains(row->objectName().mid(4)), qPrintable(row->objectName()));
    auto* optimizer = w.findChild<QLineEdit*>("adv_training.optimizer");
    QVERIFY(optimizer);
    QCOMPARE(optimizer->text(), QString("adamw"));
    QVERIFY(w.findChild<QCheckBox*>("adv_data.pack")->isChecked());
    QVERIFY(!w.config().toToml().contains("weight_decay"));
    w.findChild<QLineEdit*>("adv_training.weight_decay")->setText("0.01");
    w.findChild<QCheckBox*>("adv_data.pack")->setChecked(false);
    const QString toml = w.config().toToml();
    QVERIFY2(toml.contains("warmup_steps = 0\nweight_decay = 0.01\n"), qPrintable(toml));
    QVERIFY2(toml.contains("seq_len = 64\npack = false\n"), qPrintable(toml));
    w.findChild<QLineEdit*>("adv_training.weight_decay")->setText("0");
    w.findChild<QCheckBox*>("adv_data.pack")->setChecked(true);
    QVERIFY(!w.config().toToml().contains("weight_decay"));
    img = test::screenshot(&w, "wizard_6_advanced");
    QVERIFY(test::colours(img) > 8);

    // Review: the verdict as a badge, what the run needs against what each device, host memory
    // and the disk have, speed and time, the command.
    w.next();
    QCOMPARE(w.findChild<QLabel*>("planVerdict")->text(), QString("fits"));
    auto* table = w.findChild<QTableWidget*>("planDevices");
    QCOMPARE(table->rowCount(), 4);  // two simulated GPUs, host memory, disk
    QCOMPARE(table->item(2, 0)->text(), QString("Host memory"));
    QCOMPARE(table->item(3, 0)->text(), QString("Disk (checkpoints, exports)"));
    for (int r = 0; r < 4; ++r)
      for (int c = 1; c < 4; ++c)
        QVERIFY2(
            table->item(r, c)->text() != "—" && !table->item(r, c)->text().startsWith("0"),
            qPrintable(
                QString("row %1, column %2: %3").arg(r).arg(c).arg(table->item(r, c)->text())));
    // It fits; but six steps teach little, and the button offers a run long enough to learn.
    auto* longer = w.findChild<QPushButton*>("applyFix");
    QVERIFY(!longer->isHidden());
    QCOMPARE(longer->text(), QString("Train longer: \"Steps (Training page)\" = 30"));
    const QString speed = w.findChild<QLabel*>("planSpeed")->text();
    QVERIFY2(speed.contains("tokens/s") && speed.contains("per step"), qPrintable(speed));
    QVERIFY2(!speed.contains("T[") && !speed.contains("M="), qPrintable(speed));  // no jargon
    // Steps in epochs: one epoch of the fixture's data is planResult()'s steps_per_epoch.
    const qint64 perEpoch = w.planResult()["steps_per_epoch"].toInteger();
    QVERIFY(perEpoch > 0);
    QVERIFY2(speed.contains(QString("6 steps (%1 epochs; one epoch is %2 steps)")
                                .arg(QLocale().toString(6.0 / perEpoch, 'g', 3))
                                .arg(perEpoch)),
             qPrintable(speed));
    QVERIFY(w.findChild<QLineEdit*>("cliCommand")
                ->text()
                .endsWith("train " + m_dir + "/wizard-run.toml"));
    QCOMPARE(w.planResult()["steps"].toInt(), 6);
    // Six steps teach a model little: Review says so, and what gives more.
    const QString notes = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(notes.contains("Only 6 optimizer steps: too few") &&
                 notes.contains("More steps (Training page)"),
             qPrintable(notes));
    // How long rows could be (rondo plan --max-seq-len): the tiny model's 512 positions.
    QVERIFY2(notes.contains("Rows of up to 512 tokens fit: all the model's positions"),
             qPrintable(notes));
    img = test::screenshot(&w, "wizard_7_review");
    QVERIFY(test::colours(img) > 8);
    longer->click();
    QCOMPARE(w.findChild<QSpinBox*>("steps")->value(), 30);
    QCOMPARE(w.planResult()["steps"].toInt(), 30);
    QVERIFY(longer->isHidden());
    QVERIFY(!w.findChild<QLabel*>("planProblems")->text().contains("too few"));
    QVERIFY(w.currentPage()->isComplete());  // it fits: Start is offered
    QVERIFY(w.button(QWizard::FinishButton)->isEnabled());
    // A run the plan cannot fit says so, with what to change.
    w.back();
    w.back();
    w.back();
    w.findChild<QLineEdit*>("hostMemory")->setText("64KB");
    w.next();
    w.next();
    w.next();
    QCOMPARE(w.findChild<QLabel*>("planVerdict")->text(), QString("does not fit"));
    // The host memory row shows what is short, in red.
    QVERIFY(table->item(2, 1)->foreground().color() == QColor("#b00020"));
    const QString problems = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(problems.contains("host memory: the run needs about"), qPrintable(problems));
    // Start is refused for a run that does not fit.
    QVERIFY(!w.currentPage()->isComplete());
    QVERIFY(!w.button(QWizard::FinishButton)->isEnabled());
    QVERIFY2(problems.contains("\"Host memory budget (Hardware page)\""), qPrintable(problems));

    test::screenshot(&w, "wizard_7_review_does_not_fit");

    // An error names the wizard's field, not the temporary config or its key.
    w.findChild<QLineEdit*>("hostMemory")->setText("");
    w.back();
    w.back();
    w.findChild<QSpinBox*>("seqLen")->setValue(100000);
    w.next();
    w.next();
    QCOMPARE(w.findChild<QLabel*>("planVerdict")->text(), QString("cannot plan"));
    // In red, not in the colour of the verdict before it.
    QVERIFY2(w.findChild<QLabel*>("planVerdict")->styleSheet().contains("#b00020"),
             qPrintable(w.findChild<QLabel*>("planVerdict")->styleSheet()));
    const QString error = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(error.contains("Sequence length (Training page)"), qPrintable(error));
    QVERIFY2(!error.contains("review.toml") && !error.contains("data.seq_len"), qPrintable(error));
    QVERIFY(!w.button(QWizard::FinishButton)->isEnabled());
  }

  void monitorOfARecordedRun() {
    // A real run, recorded: 2 simulated devices (spans on both), validation and samples.
    const QString run = m_dir + "/recorded";
    const QString trained = test::trainRun(
        m_dir, "recorded",
        {{"data", "validation_split = 0.2"},
         {"training", "steps = 12\nbatch_rows = 2\ngrad_accum = 2\nlr = 0.01"},
         {"eval", "every = 4\nsample_every = 6\nprompts = [\"sky?\"]\nsample_tokens = 8"},
         {"hardware", "sim_devices = 2"}});
    QVERIFY2(trained.isEmpty(), qPrintable(trained));

    MonitorWidget m;
    m.resize(1100, 860);
    QString error;
    QVERIFY2(m.attach(run, &error), qPrintable(error));
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    QTRY_COMPARE(m.state()->status(), QString("completed"));
    m.refresh();
    QImage img = test::screenshot(&m, "monitor");
    QVERIFY(test::colours(img) > 30);
    QCOMPARE(m.lossSeries()->count(), 12);
    QCOMPARE(m.evalSeries()->count(), 4);  // steps 0, 4, 8, 12
    QVERIFY(m.timelineView()->barsDrawn() > 0);
    // Each device's peak beside the plan's prediction for it (before: "Memory in use" between
    // steps, kilobytes, read as contradicting the plan's peak).
    auto* devices = m.findChild<QTableWidget*>("deviceTable");
    QCOMPARE(devices->horizontalHeaderItem(2)->text(), QString("Peak (planned)"));
    QVERIFY2(devices->item(0, 2)->text().contains(
                 " (" + bytesText(m.state()->plannedPeaks().value(0)) + ")"),
             qPrintable(devices->item(0, 2)->text()));
    QCOMPARE(m.state()->timeline()->deviceCount(), 2);
    QImage timeline = m.timelineView()->grab().toImage();
    QVERIFY(test::colours(timeline) > 4);
    QVERIFY2(m.statusText().contains("completed — step 12/12"), qPrintable(m.statusText()));
    // A finished run says "done", not "ETA 0m00s".
    QVERIFY2(m.statusText().endsWith(", done"), qPrintable(m.statusText()));
    // Tokens/s as a person reads a speed: whole and grouped from 100 up, one decimal below (not
    // "71.015").
    const double tps = m.state()->tokensPerSecond();
    const QString speed =
        tps >= 100 ? QLocale().toString(std::llround(tps)) : QLocale().toString(tps, 'f', 1);
    QVERIFY2(m.statusText().contains(", " + speed + " tokens/s,"), qPrintable(m.statusText()));
    QCOMPARE(m.state()->samples()->rowCount(), 3);  // steps 0, 6, 12
    // The run loaded its 4 layers (embedding, 2 blocks, head) before training; the bar is full.
    QCOMPARE(m.state()->layersLoaded(), 4);
    QCOMPARE(m.state()->layersTotal(), 4);
    auto* bar = m.findChild<QProgressBar*>("runProgress");
    QCOMPARE(bar->maximum(), 12);
    QCOMPARE(bar->value(), 12);

    // After the run: Export writes a merged folder with progress and says where; the Chat tab
    // talks to the trained weights across turns; a run with no checkpoint yet says so in the tab.
    QVERIFY(m.findChild<QPushButton*>("exportButton")->isEnabled());

    ExportDialog d(run);
    d.show();
    QVERIFY(QTest::qWaitForWindowExposed(&d));
    auto* format = d.findChild<QComboBox*>("exportFormat");
    auto* items = qobject_cast<QStandardItemModel*>(format->model());
    // A LoRA run: every format; a Hugging Face base has no GGUF types of its own to keep.
    for (const char* f : {"adapter", "gguf-adapter", "merged", "gguf"})
      QVERIFY2(items->item(format->findData(f))->isEnabled(), f);
    auto* type = d.findChild<QComboBox*>("exportType");
    QVERIFY(!qobject_cast<QStandardItemModel*>(type->model())
                 ->item(type->findData("base"))
                 ->isEnabled());
    format->setCurrentIndex(format->findData("merged"));
    QVERIFY(!d.findChild<QComboBox*>("exportType")->isEnabled());
    QSignalSpy done(&d, &ExportDialog::done);
    d.start();
    QVERIFY(d.running());
    QVERIFY(done.wait(120000));
    QVERIFY2(done.at(0).at(0).toBool(), qPrintable(d.resultText()));
    QVERIFY2(QFileInfo::exists(d.writtenPath() + "/model.safetensors"), qPrintable(d.resultText()));
    QCOMPARE(d.findChild<QProgressBar*>("exportProgress")->value(), 100);
    QVERIFY2(d.resultText().startsWith("Exported to " + run + "/export-merged-step-12"),
             qPrintable(d.resultText()));
    img = test::screenshot(&d, "export_dialog");
    QVERIFY(test::colours(img) > 8);

    ChatPanel* chat = m.chatPanel();
    m.findChild<QTabWidget*>()->setCurrentWidget(chat);
    QSignalSpy replied(chat, &ChatPanel::replied);
    chat->send("sky?");
    QVERIFY2(replied.wait(120000), qPrintable(chat->statusText()));
    const qint64 pid = chat->processId();
    chat->send("hi");
    QVERIFY2(replied.wait(120000), qPrintable(chat->statusText()));
    const QString transcript = chat->transcript();
    QVERIFY2(
        transcript.startsWith("You: sky?\nModel: ") && transcript.contains("\nYou: hi\nModel: "),
        qPrintable(transcript));
    // One chat process across turns (it keeps the conversation: tests/cli TrainCli.ChatTalks...).
    QVERIFY(chat->chatting());
    QCOMPARE(chat->processId(), pid);
    QVERIFY2(chat->statusText().startsWith("Replied in"), qPrintable(chat->statusText()));
    img = test::screenshot(&m, "monitor_chat");
    QVERIFY(test::colours(img) > 30);

    // A run that has not checkpointed yet: the tab says why.
    QDir().mkpath(m_dir + "/no-checkpoint");
    QFile::copy(run + "/config.toml", m_dir + "/no-checkpoint/config.toml");
    ChatPanel early;
    early.setRun(m_dir + "/no-checkpoint");
    QSignalSpy failed(&early, &ChatPanel::failed);
    early.send("hello");
    QVERIFY(failed.wait(60000));
    QVERIFY2(failed.at(0).at(0).toString().contains("no checkpoint yet"),
             qPrintable(failed.at(0).at(0).toString()));
    QVERIFY2(early.transcript().contains("Error: "), qPrintable(early.transcript()));
  }

  // A run that does not fit: Review offers the change the plan found (planned: it fits with it)
  // as a button, in the wizard's words; one click sets the field and the run fits.
  void monitorOfARunOnTwoRanks() {
    // A real data-parallel run: 2 ranks started as torchrun starts them, sharded optimizer state.
    // The monitor follows rank 0's folder and shows both ranks in a Ranks tab.
    const QString config =
        test::writeRunConfig(m_dir, "ranks",
                             {{"training", "steps = 6\nbatch_rows = 2\ngrad_accum = 2\nlr = 0.01"},
                              {"hardware", "sim_devices = 1"},
                              {"distributed", "shard_optimizer = true"}});
    QVERIFY(!config.isEmpty());
    const QString port = QString::number(rondo::test::free_port());
    std::vector<std::unique_ptr<QProcess>> ranks;
    for (int r = 0; r < 2; ++r) {
      auto p = std::make_unique<QProcess>();
      QProcessEnvironment env = QProcessEnvironment::systemEnvironment();
      env.insert("RANK", QString::number(r));
      env.insert("WORLD_SIZE", "2");
      env.insert("MASTER_ADDR", "127.0.0.1");
      env.insert("MASTER_PORT", port);
      p->setProcessEnvironment(env);
      p->setProcessChannelMode(QProcess::MergedChannels);
      p->start(RondoCli::program(), {"train", config});
      ranks.push_back(std::move(p));
    }
    for (int r = 0; r < 2; ++r) {
      QVERIFY(ranks[r]->waitForFinished(180000));
      QVERIFY2(ranks[r]->exitCode() == 0, ranks[r]->readAll().constData());
    }
    MonitorWidget m;
    m.resize(1100, 860);
    QString error;
    QVERIFY2(m.attach(m_dir + "/ranks", &error), qPrintable(error));
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    QTRY_COMPARE(m.state()->status(), QString("completed"));
    QCOMPARE(m.state()->ranks(), 2);
    auto* table = m.findChild<QTableWidget*>("rankTable");
    QVERIFY(table);
    QTRY_VERIFY(table->rowCount() == 2 && table->item(1, 1) &&
                table->item(1, 1)->text() == "completed");
    auto* tabs = m.findChild<QTabWidget*>();
    QVERIFY(tabs);
    tabs->setCurrentWidget(table);
    for (int r = 0; r < 2; ++r) {
      QCOMPARE(table->item(r, 0)->text(), QString::number(r));
      QCOMPARE(table->item(r, 2)->text(), QString("6/6"));
      QVERIFY2(table->item(r, 5)->text() != "–", qPrintable(table->item(r, 5)->text()));
    }
    // Every rank reports the loss of the whole step.
    QCOMPARE(table->item(1, 3)->text(), table->item(0, 3)->text());
    QImage img = test::screenshot(&m, "monitor_ranks");
    QVERIFY(test::colours(img) > 30);
    // Another run (one process) has no Ranks tab.
    QVERIFY(m.attach(m_dir + "/recorded", &error));
    QTRY_COMPARE(m.state()->status(), QString("completed"));
    m.refresh();
    QCOMPARE(tabs->indexOf(table), -1);
  }

  void reviewAppliesTheChangeThatMakesItFit() {
    SetupWizard w;
    w.resize(900, 720);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    test::pickModelAndData(&w, m_dir);
    w.findChild<QComboBox*>("modelDtype")->setCurrentText("fp32");
    w.next();
    w.next();
    w.findChild<QLineEdit*>("hostMemory")->setText("700KB");
    w.next();
    test::trainingToReview(&w, 4, 64, m_dir + "/fix-run");
    QCOMPARE(w.currentId(), static_cast<int>(SetupWizard::ReviewPage));
    QCOMPARE(w.findChild<QLabel*>("planVerdict")->text(), QString("does not fit"));
    auto* fix = w.findChild<QPushButton*>("applyFix");
    QVERIFY2(!fix->isHidden(), qPrintable(w.findChild<QLabel*>("planProblems")->text()));
    QVERIFY2(fix->text().startsWith("Make it fit: \"") && fix->text().contains(" page)\" = "),
             qPrintable(fix->text()));
    test::screenshot(&w, "wizard_7_review_make_it_fit");
    const QJsonObject set = w.planResult()["fixes"].toArray().first().toObject()["set"].toObject();
    QVERIFY(!w.button(QWizard::FinishButton)->isEnabled());
    fix->click();
    const QString verdict = w.findChild<QLabel*>("planVerdict")->text();
    QVERIFY2(verdict == "fits" || verdict == "tight", qPrintable(verdict));
    QVERIFY(w.button(QWizard::FinishButton)->isEnabled());
    // The fields hold the change: the config says it.
    const QString toml = w.config().toToml();
    for (auto it = set.begin(); it != set.end(); ++it)
      QVERIFY2(toml.contains(it.key().section('.', 1) + " = " + it.value().toString()) ||
                   toml.contains(it.key().section('.', 1) + " = \"" + it.value().toString()),
               qPrintable(it.key() + " in " + toml));
  }

  // Defaults that teach (before: validation, samples and checkpoints all off): data of 20 examples
  // or more holds some out for a validation loss, the data's first prompt is the sample prompt,
  // and the Review sets the validation loss, samples and (for a long run) checkpoints to follow
  // the run's length, saying so; a field the user set stays as set.
  void defaultsFollowTheDataAndTheRun() {
    QFile f(m_dir + "/forty.jsonl");
    QVERIFY(f.open(QIODevice::WriteOnly));
    for (int i = 0; i < 40; ++i)
      f.write(QString("{\"messages\": [{\"role\": \"user\", \"content\": \"What is %1 + 1?\"}, "
                      "{\"role\": \"assistant\", \"content\": \"It is %2.\"}]}\n")
                  .arg(i)
                  .arg(i + 1)
                  .toUtf8());
    f.close();
    SetupWizard w;
    w.resize(900, 720);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    w.findChild<QLineEdit*>("modelPath")->setText(m_dir + "/model");
    w.refreshModel();
    w.next();
    auto* share = w.findChild<QDoubleSpinBox*>("validationSplit");
    auto* prompts = w.findChild<QPlainTextEdit*>("prompts");
    // Ten examples: none held out; the prompt is the first example's question.
    w.findChild<QLineEdit*>("dataPath")->setText(m_dir + "/chat.jsonl");
    w.refreshData();
    QCOMPARE(share->value(), 0.0);
    QCOMPARE(prompts->toPlainText(), QString("hi"));
    // Forty: a tenth held out; the prompt follows the data while the user has not written one.
    w.findChild<QLineEdit*>("dataPath")->setText(m_dir + "/forty.jsonl");
    w.refreshData();
    QCOMPARE(share->value(), 0.1);
    QCOMPARE(prompts->toPlainText(), QString("What is 0 + 1?"));
    // 5,000 lines, of which the page reads the first 2,000: about a hundred held out of the
    // examples the whole file holds (estimated from its size), not a tenth of them.
    QFile big(m_dir + "/big.jsonl");
    QVERIFY(big.open(QIODevice::WriteOnly));
    for (int i = 0; i < 5000; ++i)
      big.write(QString("{\"messages\": [{\"role\": \"user\", \"content\": \"Say %1.\"}, "
                        "{\"role\": \"assistant\", \"content\": \"%1.\"}]}\n")
                    .arg(i % 10)
                    .toUtf8());
    big.close();
    w.findChild<QLineEdit*>("dataPath")->setText(m_dir + "/big.jsonl");
    w.refreshData();
    QCOMPARE(share->value(), 0.02);
    w.findChild<QLineEdit*>("dataPath")->setText(m_dir + "/forty.jsonl");
    w.refreshData();
    QCOMPARE(share->value(), 0.1);
    w.next();
    w.next();
    w.next();
    test::trainingToReview(&w, 120, 64, m_dir + "/defaults-run");
    QCOMPARE(w.currentId(), static_cast<int>(SetupWizard::ReviewPage));
    auto* eval = w.findChild<QSpinBox*>("evalEvery");
    auto* samples = w.findChild<QSpinBox*>("sampleEvery");
    auto* checkpoints = w.findChild<QSpinBox*>("checkpointEvery");
    QCOMPARE(eval->value(), 12);
    QCOMPARE(samples->value(), 24);
    QCOMPARE(checkpoints->value(), 30);
    QString notes = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(notes.contains("During the run: the validation loss every 12 steps, a sample of each "
                            "prompt every 24 steps, a checkpoint every 30 steps and at the end"),
             qPrintable(notes));
    const QString toml = w.config().toToml();
    QVERIFY2(toml.contains("validation_split = 0.1") && toml.contains("every = 30") &&
                 toml.contains("every = 12") && toml.contains("sample_every = 24") &&
                 toml.contains("prompts = [\"What is 0 + 1?\"]"),
             qPrintable(toml));
    // The user's own: kept when the run's length changes and when the data changes.
    eval->setValue(5);
    prompts->setPlainText("Who are you?");
    w.back();
    w.back();
    w.findChild<QSpinBox*>("steps")->setValue(40);
    w.next();
    w.next();
    QCOMPARE(eval->value(), 5);
    QCOMPARE(samples->value(), 8);
    QCOMPARE(checkpoints->value(), 0);  // under 100 steps: at the end only
    notes = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(notes.contains("a checkpoint at the end (and when you stop it)"), qPrintable(notes));
    w.refreshData();
    QCOMPARE(prompts->toPlainText(), QString("Who are you?"));
  }

  // On a 1000-pixel screen the whole window shows: its minimum size, on the wizard's pages and on
  // the monitor, is at most 1024x700 (before: about 1208x1021, Next and Start off-screen).
  void theWindowFitsASmallScreen() {
    MainWindow win;
    win.show();
    QVERIFY(QTest::qWaitForWindowExposed(&win));
    auto fits = [&](const char* where) {
      const QSize min = win.minimumSizeHint().expandedTo(win.minimumSize());
      QVERIFY2(min.width() <= 1024 && min.height() <= 700,
               qPrintable(QString("%1: %2x%3").arg(where).arg(min.width()).arg(min.height())));
    };
    SetupWizard* w = win.wizard();
    w->findChild<QLineEdit*>("modelPath")->setText(m_dir + "/model");
    w->refreshModel();
    fits("model page");
    w->next();
    w->findChild<QLineEdit*>("dataPath")->setText(m_dir + "/chat.jsonl");
    w->refreshData();
    for (const char* page : {"data page", "method page", "hardware page", "training page",
                             "advanced page", "review page"}) {
      fits(page);
      w->next();
    }
    win.resize(1024, 700);
    test::screenshot(&win, "window_1024x700_review");
    QString error;
    QVERIFY2(win.openRun(m_dir + "/recorded", &error), qPrintable(error));  // monitorOfARecordedRun
    fits("monitor");
    test::screenshot(&win, "window_1024x700_monitor");
  }

  void aFolderThatIsNotARunSaysSo() {
    MonitorWidget m;
    QString error;
    QVERIFY(!m.attach(m_dir + "/model", &error));
    QVERIFY2(error.contains(m_dir + "/model") && error.contains("not a Rondo run"),
             qPrintable(error));
  }

  // A fresh wizard proposes runs/run-N that holds nothing (before: always runs/run-1, holding a
  // finished run, with Review saying "fits" and Start on); a folder that holds a run, typed in,
  // keeps Start off on Review with a note saying what to do.
  void aFreshWizardNeverProposesAFolderHoldingARun() {
    const QString cwd = QDir::currentPath();
    QVERIFY(QDir::setCurrent(m_dir));
    const auto back = qScopeGuard([&] { QDir::setCurrent(cwd); });
    QVERIFY(QDir().mkpath("runs/run-1/checkpoints"));
    QFile(m_dir + "/runs/run-1/config.toml").open(QIODevice::WriteOnly);
    QFile(m_dir + "/runs/run-2.toml").open(QIODevice::WriteOnly);  // a config for run-2
    QVERIFY(QDir().mkpath("runs/run-3"));                          // empty: free
    SetupWizard w;
    w.resize(900, 720);
    w.show();
    QVERIFY(QTest::qWaitForWindowExposed(&w));
    QCOMPARE(w.findChild<QLineEdit*>("runDir")->text(), m_dir + "/runs/run-3");
    test::pickModelAndData(&w, m_dir);
    w.next();
    w.next();
    w.next();
    w.findChild<QSpinBox*>("seqLen")->setValue(64);
    w.findChild<QLineEdit*>("runDir")->setText(m_dir + "/runs/run-1");
    w.next();
    w.next();
    QCOMPARE(w.currentId(), static_cast<int>(SetupWizard::ReviewPage));
    QCOMPARE(w.findChild<QLabel*>("planVerdict")->text(), QString("folder in use"));
    QVERIFY(!w.currentPage()->isComplete());
    const QString notes = w.findChild<QLabel*>("planProblems")->text();
    QVERIFY2(notes.contains("runs/run-1 already holds a run"), qPrintable(notes));
  }

  // Starts in `m` a LoRA run of the fixture's model long enough to stop (`steps` steps of `rows`
  // rows of `seq` tokens, a checkpoint every 100) in `run`, and waits for its first step; "" when
  // it got there, else what went wrong.
  QString startLongRun(MonitorWidget& m, const QString& run, int steps, int rows, int seq) {
    const QString config = test::writeRunConfig(
        m_dir, run,
        {{"data", QString("seq_len = %1").arg(seq)},
         {"training",
          QString("steps = %1\nbatch_rows = %2\nwarmup_steps = 0").arg(steps).arg(rows)},
         {"checkpoint", "every = 100"}});
    if (config.isEmpty()) return "cannot write the config of " + run;
    m.resize(900, 700);
    QString error;
    if (!m.launch(config, m_dir + "/" + run, &error)) return error;
    if (!QTest::qWaitFor([&] { return m.state()->lastStep() >= 1; }, 120000))
      return "no step in 120 s";
    return "";
  }

  // Stop is the CLI's own stop: the steps under way finish, a checkpoint is written, the run reads
  // "stopped" and no failure banner shows (before: SIGKILL, "The run failed: rondo train exited
  // with status 9").
  void stopIsAStopNotACrash() {
    MonitorWidget m;
    const QString error = startLongRun(m, "stop-run", 400, 2, 64);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    m.findChild<QPushButton*>("stopButton")->click();
    QTRY_VERIFY_WITH_TIMEOUT(!m.childRunning(), 120000);
    m.refresh();
    QCOMPARE(m.state()->status(), QString("stopped"));
    QVERIFY2(m.statusText().startsWith("stopped"), qPrintable(m.statusText()));
    QVERIFY(m.findChild<QLabel*>("errorBanner")->isHidden());
    QVERIFY(QDir(m_dir + "/stop-run/checkpoints/step-" + QString::number(m.state()->lastStep()))
                .exists());
    // The CLI's advice in the GUI's words: the Stop button, and the File menu's resume.
    const QString log = m.state()->log()->lines().join('\n');
    QVERIFY2(!log.contains("Ctrl-C"), qPrintable(log));
    QVERIFY2(log.contains("(Stop now ends at once)"), qPrintable(log));
    QVERIFY2(log.contains("continue with File ▸ Resume a stopped run (`rondo train --resume "),
             qPrintable(log));
  }

  // Asked twice, Stop ends the run at once, without a checkpoint: "interrupted", still no
  // failure banner. Long steps, so that the second click lands inside the step the first lets
  // finish.
  void stopTwiceEndsAtOnce() {
    MonitorWidget m;
    const QString error = startLongRun(m, "stop-now-run", 100000, 128, 512);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QPushButton* stop = m.findChild<QPushButton*>("stopButton");
    stop->click();
    QCOMPARE(stop->text(), QString("Stop now"));
    QTest::qWait(100);  // the CLI has taken the first signal (two at once would merge)
    stop->click();
    QTRY_VERIFY_WITH_TIMEOUT(!m.childRunning(), 60000);
    m.refresh();
    QCOMPARE(m.state()->status(), QString("interrupted"));
    QVERIFY(m.findChild<QLabel*>("errorBanner")->isHidden());
  }

  // Closing the window after Stop and save (MainWindow's close asks for it, then the monitor is
  // destroyed): the monitor waits for the checkpoint. Before, its destructor sent a second SIGINT,
  // which ends the CLI at once, without the checkpoint the user had just asked for.
  // Closing the window with a run going (the user said yes to "stop and save"): the window stays,
  // saying why, until the checkpoint is written, then closes (before: it vanished at once while
  // the process ran on unseen for ~45 s).
  void closingAfterStopAndSaveKeepsTheCheckpoint() {
    {
      MainWindow win;
      win.show();
      QVERIFY(QTest::qWaitForWindowExposed(&win));
      const QString error = startLongRun(*win.monitor(), "close-run", 400, 2, 64);
      QVERIFY2(error.isEmpty(), qPrintable(error));
      win.closeAfterStopping();
      QVERIFY(win.isVisible());
      QVERIFY2(win.statusBar()->currentMessage().contains("closes when it is saved"),
               qPrintable(win.statusBar()->currentMessage()));
      QTRY_VERIFY_WITH_TIMEOUT(!win.isVisible(), 120000);
      QVERIFY(!win.monitor()->childRunning());
    }
    QFile events(m_dir + "/close-run/events.jsonl");
    QVERIFY(events.open(QIODevice::ReadOnly));
    const QList<QByteArray> lines = events.readAll().trimmed().split('\n');
    const QJsonObject end = QJsonDocument::fromJson(lines.last()).object();
    QCOMPARE(end["type"].toString(), QString("run_end"));
    QCOMPARE(end["status"].toString(), QString("stopped"));
    QVERIFY(QDir(m_dir + "/close-run/checkpoints/step-" + QString::number(end["steps"].toInteger()))
                .exists());
  }

  void aFailedChildShowsItsErrorAndLastLines() {
    QFile cfg(m_dir + "/broken.toml");
    QVERIFY(cfg.open(QIODevice::WriteOnly));
    cfg.write(
        QString("[model]\npath = \"%1/model\"\n[data]\nseq_len = 64\ntrain = \"%1/missing.jsonl\"\n"
                "[output]\nrun_dir = \"%1/broken-run\"\n")
            .arg(m_dir)
            .toUtf8());
    cfg.close();
    MonitorWidget m;
    m.resize(900, 700);
    QString error;
    QVERIFY2(m.launch(cfg.fileName(), m_dir + "/broken-run", &error), qPrintable(error));
    QTRY_VERIFY_WITH_TIMEOUT(!m.childRunning(), 60000);
    QLabel* banner = m.findChild<QLabel*>("errorBanner");
    QTRY_VERIFY(!banner->isHidden());
    QVERIFY2(banner->text().contains("missing.jsonl"), qPrintable(banner->text()));
    QCOMPARE(m.state()->status(), QString("empty"));  // it failed before its run started
    QVERIFY2(m.statusText().startsWith("failed"), qPrintable(m.statusText()));
    test::screenshot(&m, "monitor_failed");
  }
};

QTEST_MAIN(Screens)
#include "screens_test.moc"
