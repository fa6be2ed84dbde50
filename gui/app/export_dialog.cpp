#include "gui/app/export_dialog.h"

#include <QComboBox>
#include <QDialogButtonBox>
#include <QDir>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QHBoxLayout>
#include <QLabel>
#include <QLineEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QRegularExpression>
#include <QStandardItemModel>
#include <QVBoxLayout>
#include <algorithm>
#include <initializer_list>
#include <utility>
#include <vector>

#include "gui/app/rondo_cli.h"

namespace rondo::gui {

ExportDialog::ExportDialog(const QString& runDir, QWidget* parent)
    : QDialog(parent), m_run(runDir) {
  setWindowTitle("Export " + QDir(runDir).dirName());
  // What applies: the method and the base, from the run's resolved config.
  QFile cfg(QDir(runDir).filePath("config.toml"));
  if (cfg.open(QIODevice::ReadOnly)) {
    const QString text = QString::fromUtf8(cfg.readAll());
    m_lora = !text.contains(
        QRegularExpression(R"(^\s*method\s*=\s*"full")", QRegularExpression::MultilineOption));
    const QRegularExpressionMatch path =
        QRegularExpression(R"re(^\s*path\s*=\s*"([^"]*)")re", QRegularExpression::MultilineOption)
            .match(text);
    m_ggufBase = path.hasMatch() && path.captured(1).endsWith(".gguf", Qt::CaseInsensitive);
  }

  // The run's step-N folders, newest first: what exists. Whether one passes its checks is the
  // CLI's to say (it names the damage and the checkpoints that are there).
  m_checkpoint = new QComboBox;
  m_checkpoint->setObjectName("exportCheckpoint");
  static const QRegularExpression stepName(R"(^step-(\d+)$)");
  std::vector<std::pair<qint64, QString>> steps;
  for (const QString& name :
       QDir(QDir(runDir).filePath("checkpoints")).entryList(QDir::Dirs | QDir::NoDotAndDotDot)) {
    const QRegularExpressionMatch m = stepName.match(name);
    if (m.hasMatch()) steps.emplace_back(m.captured(1).toLongLong(), name);
  }
  std::sort(steps.rbegin(), steps.rend());
  for (std::size_t i = 0; i < steps.size(); ++i)
    m_checkpoint->addItem(QString("step %1%2").arg(steps[i].first).arg(i == 0 ? " (newest)" : ""),
                          steps[i].second);
  if (steps.empty()) {  // the CLI says so when asked
    m_checkpoint->addItem("none yet", QString());
    m_checkpoint->setEnabled(false);
  }

  m_format = new QComboBox;
  m_format->setObjectName("exportFormat");
  m_format->addItem("LoRA adapter for transformers / peft (PEFT folder)", "adapter");
  m_format->addItem("LoRA adapter for llama.cpp (GGUF, --lora)", "gguf-adapter");
  m_format->addItem("Merged model, Hugging Face folder (transformers)", "merged");
  m_format->addItem("Merged model, GGUF (llama.cpp, Ollama, LM Studio)", "gguf");
  auto* items = qobject_cast<QStandardItemModel*>(m_format->model());
  for (int i = 0; i < m_format->count(); ++i) {
    const QString f = m_format->itemData(i).toString();
    items->item(i)->setEnabled(f == "adapter" || f == "gguf-adapter" ? m_lora : true);
  }
  m_format->setCurrentIndex(m_lora ? 0 : 2);
  m_type = new QComboBox;
  m_type->setObjectName("exportType");
  m_type->addItem("Q8_0 (8-bit; keeps what a LoRA learned)", "q8_0");
  m_type->addItem("Q4_K_M (4-bit mix, the usual download)", "q4_k_m");
  m_type->addItem("F16", "f16");
  m_type->addItem("BF16", "bf16");
  m_type->addItem("F32", "f32");
  m_type->addItem("As the base file", "base");
  // Only a GGUF base has types of its own to keep.
  qobject_cast<QStandardItemModel*>(m_type->model())
      ->item(m_type->count() - 1)
      ->setEnabled(m_ggufBase);
  m_out = new QLineEdit;
  m_out->setObjectName("exportOut");
  m_out->setPlaceholderText("default: a folder export-<format>-step-N in the run folder");
  m_browse = new QPushButton("Folder…");
  m_browse->setObjectName("exportBrowse");
  m_progress = new QProgressBar;
  m_progress->setObjectName("exportProgress");
  m_progress->setRange(0, 100);
  m_progress->setValue(0);
  m_progress->setTextVisible(true);
  m_result = new QLabel;
  m_result->setObjectName("exportResult");
  m_result->setWordWrap(true);
  m_result->setTextInteractionFlags(Qt::TextSelectableByMouse);

  auto* form = new QFormLayout;
  form->addRow("Checkpoint", m_checkpoint);
  form->addRow("Format", m_format);
  form->addRow("GGUF type", m_type);
  auto* outRow = new QHBoxLayout;
  outRow->addWidget(m_out, 1);
  outRow->addWidget(m_browse);
  form->addRow("Output folder", outRow);
  auto* buttons = new QDialogButtonBox(QDialogButtonBox::Close);
  m_export = buttons->addButton("Export", QDialogButtonBox::AcceptRole);
  m_export->setObjectName("exportStart");
  disconnect(buttons, &QDialogButtonBox::accepted, nullptr, nullptr);
  connect(m_export, &QPushButton::clicked, this, &ExportDialog::start);
  connect(buttons, &QDialogButtonBox::rejected, this, &QDialog::reject);
  connect(m_format, &QComboBox::currentIndexChanged, this, &ExportDialog::updateChoices);
  connect(m_checkpoint, &QComboBox::currentIndexChanged, this, &ExportDialog::updateChoices);
  connect(m_browse, &QPushButton::clicked, this, &ExportDialog::browse);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(form);
  layout->addWidget(m_progress);
  layout->addWidget(m_result);
  layout->addWidget(buttons);
  updateChoices();
  resize(560, 0);
}

ExportDialog::~ExportDialog() {
  if (running()) {  // closing waits for the export (reject() keeps the dialog open until then)
    m_proc->disconnect(this);
    m_proc->waitForFinished(-1);
  }
}

void ExportDialog::reject() {
  // Stopping an export midway would leave its temporary file behind: the dialog stays until it
  // ends.
  if (running()) {
    m_result->setText("Still exporting: this closes once the export is written.");
    return;
  }
  QDialog::reject();
}

bool ExportDialog::running() const {
  return m_proc && m_proc->state() != QProcess::NotRunning;
}

QString ExportDialog::resultText() const {
  return m_result->text();
}

QString ExportDialog::defaultOut() const {
  const QString step = m_checkpoint->currentData().toString();
  if (step.isEmpty()) return QString();
  // As cli/train_command.cpp names it: <run>/export-<format>-step-N.
  return QDir(m_run).filePath("export-" + m_format->currentData().toString() + "-" + step);
}

void ExportDialog::updateChoices() {
  m_type->setEnabled(m_format->currentData().toString() == "gguf" && !running());
  // The folder shown follows the format and checkpoint until one of the user's own is given.
  const QString out = m_out->text().trimmed();
  if (out.isEmpty() || out == m_shownDefault) m_out->setText(defaultOut());
  m_shownDefault = defaultOut();
}

void ExportDialog::browse() {
  const QString now = m_out->text().trimmed();
  const QString dir = QFileDialog::getExistingDirectory(
      this, "Export into", now.isEmpty() ? m_run : QFileInfo(now).absolutePath());
  if (dir.isEmpty()) return;
  // An empty folder (one made in the file dialog) is written into; one that holds files gets the
  // export's own folder inside it, named as the CLI names it, rather than a refusal.
  const QString name = QFileInfo(defaultOut()).fileName();
  const bool empty = QDir(dir).isEmpty(QDir::AllEntries | QDir::NoDotAndDotDot | QDir::Hidden);
  m_out->setText(empty || name.isEmpty() ? dir : QDir(dir).filePath(name));
}

void ExportDialog::setBusy(bool busy) {
  for (QWidget* w : std::initializer_list<QWidget*>{m_export, m_format, m_out, m_browse})
    w->setEnabled(!busy);
  m_checkpoint->setEnabled(!busy && !m_checkpoint->currentData().toString().isEmpty());
  updateChoices();
  if (busy) m_type->setEnabled(false);
}

bool ExportDialog::start() {
  if (running()) return false;
  const QString format = m_format->currentData().toString();
  const QString step = m_checkpoint->currentData().toString();
  const QString out = m_out->text().trimmed();
  // The CLI writes its files into a folder that exists, replacing those of the same name and
  // leaving the rest: two exports mixed in one folder. Refused here, before anything runs.
  const QFileInfo target(out.isEmpty() ? defaultOut() : out);
  if (!target.filePath().isEmpty() && target.exists()) {
    if (!target.isDir()) {
      m_result->setText(target.filePath() + " is a file: choose a folder to export into.");
      return false;
    }
    if (!QDir(target.filePath())
             .isEmpty(QDir::AllEntries | QDir::NoDotAndDotDot | QDir::Hidden | QDir::System)) {
      m_result->setText(target.filePath() +
                        " already holds files: choose an empty or new folder (Folder…), or "
                        "remove what is there.");
      return false;
    }
  }
  QStringList args = {"export", m_run, "--format", format};
  if (!step.isEmpty()) args << "--checkpoint" << step;
  if (format == "gguf") args << "--type" << m_type->currentData().toString();
  // Left as the default, the CLI names the folder itself (and says so when it cannot write there).
  if (!out.isEmpty() && out != defaultOut()) args << "--out" << out;
  delete m_proc;
  m_proc = new QProcess(this);
  m_err.clear();
  m_parsed = 0;
  m_written.clear();
  connect(m_proc, &QProcess::readyReadStandardError, this, &ExportDialog::readProgress);
  connect(m_proc, &QProcess::finished, this, &ExportDialog::onFinished);
  connect(m_proc, &QProcess::errorOccurred, this, [this](QProcess::ProcessError e) {
    if (e != QProcess::FailedToStart) return;
    m_err = ("cannot start " + RondoCli::program() + ": " + m_proc->errorString()).toUtf8();
    onFinished(-1, QProcess::CrashExit);
  });
  m_progress->setRange(0, 0);  // busy until a share is known (an adapter: until it is written)
  m_result->setText(step.isEmpty() ? QString("Exporting…")
                                   : QString("Exporting %1 as %2…").arg(step, format));
  setBusy(true);  // before start(): a program that cannot start ends the export within it
  m_proc->start(RondoCli::program(), args);
  return true;
}

void ExportDialog::readProgress() {
  m_err += m_proc->readAllStandardError();
  // A merged model: "rondo: writing FILE: N%" at each tenth written (cli/train_command.cpp). Each
  // whole line once, in order: the bar follows every share printed, however the pipe splits them.
  static const QRegularExpression share(R"(^rondo: writing (.*): (\d+)%$)");
  const QString step = m_checkpoint->currentData().toString();
  for (qsizetype end; (end = m_err.indexOf('\n', m_parsed)) >= 0; m_parsed = end + 1) {
    const QRegularExpressionMatch m =
        share.match(QString::fromUtf8(m_err.mid(m_parsed, end - m_parsed)).trimmed());
    if (!m.hasMatch()) continue;
    m_result->setText(
        QString("Writing %1%2: %3%")
            .arg(m.captured(1), step.isEmpty() ? "" : " from " + step, m.captured(2)));
    m_progress->setRange(0, 100);
    m_progress->setValue(m.captured(2).toInt());  // after the line, which goes with it
  }
}

void ExportDialog::onFinished(int code, QProcess::ExitStatus status) {
  readProgress();
  QString last;
  for (const QByteArray& l : m_err.split('\n'))
    if (!l.trimmed().isEmpty()) last = QString::fromUtf8(l.trimmed());
  const bool ok = status == QProcess::NormalExit && code == 0;
  m_progress->setRange(0, 100);
  m_progress->setValue(ok ? 100 : 0);
  if (ok) {
    static const QRegularExpression to(R"(\(step \d+\) to (.*)$)");
    const QRegularExpressionMatch m = to.match(last);
    m_written = m.hasMatch() ? m.captured(1) : QString();
    m_result->setText("Exported to " + m_written);
  } else {
    if (last.startsWith("rondo: error: ")) last = last.mid(14);
    m_result->setText(
        "The export failed: " +
        (last.isEmpty() ? QString("rondo export exited with status %1").arg(code) : last));
  }
  setBusy(false);
  emit done(ok);
}

}  // namespace rondo::gui
