// The export dialog on a real run of the tiny model with checkpoints at steps 2 and 4 (issue 38
// item 9): the checkpoint chosen is the one written, byte for byte what `rondo export --checkpoint`
// writes; the output folder follows format and checkpoint, one typed or browsed to is used, and
// one that holds files is refused before anything runs; a merged export's bar moves through the
// shares the CLI prints, saying what it writes.
#include <QApplication>
#include <QComboBox>
#include <QDateTime>
#include <QFileDialog>
#include <QFileInfo>
#include <QLineEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QSignalSpy>
#include <QTest>
#include <QTimer>
#include <utility>
#include <vector>

#include "gui/app/export_dialog.h"
#include "gui/app/rondo_cli.h"
#include "test_support.h"

using namespace rondo::gui;

namespace {

QByteArray slurp(const QString& path) {
  QFile f(path);
  return f.open(QIODevice::ReadOnly) ? f.readAll() : QByteArray();
}

}  // namespace

class Export : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  QString m_dir, m_run;

  // Runs the dialog's export to its end; "" when it succeeded, else what it said.
  static QString exportWith(ExportDialog& d) {
    QSignalSpy done(&d, &ExportDialog::done);
    if (!d.start()) return "did not start: " + d.resultText();
    if (!done.wait(120000)) return "no end: " + d.resultText();
    return done.at(0).at(0).toBool() ? QString() : d.resultText();
  }

 private slots:
  void initTestCase() {
    const QString error = test::writeFixtureIn(m_tmp, &m_dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    m_run = m_dir + "/run";
    const QString trained =
        test::trainRun(m_dir, "run",
                       {{"training", "steps = 4\nbatch_rows = 2\nlr = 0.01\nwarmup_steps = 0"},
                        {"checkpoint", "every = 2\nkeep = 0"}});
    QVERIFY2(trained.isEmpty(), qPrintable(trained));
  }

  // The run's checkpoints, newest first; the older one chosen is the one exported (before: always
  // the newest, with no choice).
  void theCheckpointChosenIsTheOneWritten() {
    ExportDialog d(m_run);
    auto* ckpt = d.findChild<QComboBox*>("exportCheckpoint");
    QVERIFY(ckpt);
    QCOMPARE(ckpt->count(), 2);
    QCOMPARE(ckpt->itemText(0), QString("step 4 (newest)"));
    QCOMPARE(ckpt->itemText(1), QString("step 2"));
    auto* out = d.findChild<QLineEdit*>("exportOut");
    QCOMPARE(out->text(), m_run + "/export-adapter-step-4");
    ckpt->setCurrentIndex(1);
    QCOMPARE(out->text(), m_run + "/export-adapter-step-2");  // the default follows the choice

    QString error = exportWith(d);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QCOMPARE(d.writtenPath(), m_run + "/export-adapter-step-2");
    QCOMPARE(d.resultText(), "Exported to " + m_run + "/export-adapter-step-2");
    const QByteArray older = slurp(d.writtenPath() + "/adapter_model.safetensors");
    QVERIFY(!older.isEmpty());
    const CliResult cli =
        RondoCli::run({"export", m_run, "--checkpoint", "step-2", "--out", m_dir + "/cli-step-2"});
    QVERIFY2(cli.ok(), qPrintable(cli.error));
    QVERIFY(older == slurp(m_dir + "/cli-step-2/adapter_model.safetensors"));

    ckpt->setCurrentIndex(0);
    QCOMPARE(out->text(), m_run + "/export-adapter-step-4");
    error = exportWith(d);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QCOMPARE(d.writtenPath(), m_run + "/export-adapter-step-4");
    const QByteArray newest = slurp(d.writtenPath() + "/adapter_model.safetensors");
    QVERIFY(!newest.isEmpty());
    QVERIFY(older != newest);  // two steps more training
  }

  // A folder typed in is used; one browsed to is the folder itself when empty, else the export's
  // own folder inside it; one that holds files is refused, and nothing runs (before: exported into
  // it, among what was there).
  void theOutputFolderChosenIsUsedAndOneHoldingFilesIsRefused() {
    ExportDialog d(m_run);
    auto* out = d.findChild<QLineEdit*>("exportOut");
    auto* format = d.findChild<QComboBox*>("exportFormat");
    format->setCurrentIndex(format->findData("merged"));
    QCOMPARE(out->text(), m_run + "/export-merged-step-4");  // it follows the format too
    out->setText(m_dir + "/mine/merged");
    format->setCurrentIndex(format->findData("adapter"));
    QCOMPARE(out->text(), m_dir + "/mine/merged");  // the user's own stays
    format->setCurrentIndex(format->findData("merged"));
    QString error = exportWith(d);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QCOMPARE(d.writtenPath(), m_dir + "/mine/merged");
    QVERIFY(QFileInfo::exists(m_dir + "/mine/merged/model.safetensors"));

    // Now it holds files: refused before anything runs, saying so.
    QSignalSpy done(&d, &ExportDialog::done);
    const QDateTime before = QFileInfo(m_dir + "/mine/merged/model.safetensors").lastModified();
    QVERIFY(!d.start());
    QVERIFY(!d.running());
    QVERIFY2(d.resultText() == m_dir +
                                   "/mine/merged already holds files: choose an empty or new "
                                   "folder (Folder…), or remove what is there.",
             qPrintable(d.resultText()));
    QCOMPARE(done.count(), 0);
    QCOMPARE(QFileInfo(m_dir + "/mine/merged/model.safetensors").lastModified(), before);
    QVERIFY(d.findChild<QPushButton*>("exportStart")->isEnabled());
    // So is the default folder once an export is there (theCheckpointChosenIsTheOneWritten's).
    ExportDialog again(m_run);
    QVERIFY(!again.start());
    QVERIFY2(again.resultText().startsWith(m_run + "/export-adapter-step-4 already holds files"),
             qPrintable(again.resultText()));

    // Folder…: an empty folder is the output; one holding files gets export-<format>-step-N.
    auto browseTo = [&](const QString& dir) {
      QTimer::singleShot(0, &d, [dir] {
        auto* fd = qobject_cast<QFileDialog*>(QApplication::activeModalWidget());
        if (!fd) return;
        fd->setDirectory(dir);
        static_cast<QDialog*>(fd)->accept();  // QFileDialog::accept, protected there
      });
      d.findChild<QPushButton*>("exportBrowse")->click();
    };
    QVERIFY(QDir().mkpath(m_dir + "/empty"));
    browseTo(m_dir + "/empty");
    QCOMPARE(out->text(), m_dir + "/empty");
    browseTo(m_dir + "/mine");
    QCOMPARE(out->text(), m_dir + "/mine/export-merged-step-4");
    error = exportWith(d);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QVERIFY(QFileInfo::exists(m_dir + "/mine/export-merged-step-4/model.safetensors"));
  }

  // A merged export: the bar takes the shares `rondo export` prints as it writes each layer, in
  // order, with a line naming the file (before: busy, then full).
  void aMergedExportsBarFollowsTheShareWritten() {
    ExportDialog d(m_run);
    auto* format = d.findChild<QComboBox*>("exportFormat");
    format->setCurrentIndex(format->findData("merged"));
    d.findChild<QLineEdit*>("exportOut")->setText(m_dir + "/progress");
    auto* bar = d.findChild<QProgressBar*>("exportProgress");
    std::vector<std::pair<int, QString>> seen;  // each value, and the line shown with it
    connect(bar, &QProgressBar::valueChanged, &d,
            [&](int v) { seen.emplace_back(v, d.resultText()); });
    const QString error = exportWith(d);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    QVERIFY(!seen.empty() && seen.back().first == 100);
    int between = 0, last = -1;
    for (const auto& [v, line] : seen) {
      QVERIFY2(v >= last, qPrintable(QString("%1 after %2").arg(v).arg(last)));
      last = v;
      if (v == 0 || v == 100) continue;
      ++between;
      QCOMPARE(v % 10, 0);
      QCOMPARE(line,
               QString("Writing %1/progress/model.safetensors from step-4: %2%").arg(m_dir).arg(v));
    }
    QVERIFY2(between >= 2, qPrintable(QString("%1 values between 0 and 100").arg(between)));
    QCOMPARE(bar->value(), 100);
  }
};

QTEST_MAIN(Export)
#include "export_test.moc"
