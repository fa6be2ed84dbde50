#include "gui/app/export_dialog.h"

#include <QComboBox>
#include <QDialogButtonBox>
#include <QDir>
#include <QFile>
#include <QFormLayout>
#include <QLabel>
#include <QLineEdit>
#include <QProgressBar>
#include <QPushButton>
#include <QRegularExpression>
#include <QStandardItemModel>
#include <QVBoxLayout>

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
  form->addRow("Format", m_format);
  form->addRow("GGUF type", m_type);
  form->addRow("Output folder", m_out);
  auto* buttons = new QDialogButtonBox(QDialogButtonBox::Close);
  m_export = buttons->addButton("Export", QDialogButtonBox::AcceptRole);
  m_export->setObjectName("exportStart");
  disconnect(buttons, &QDialogButtonBox::accepted, nullptr, nullptr);
  connect(m_export, &QPushButton::clicked, this, &ExportDialog::start);
  connect(buttons, &QDialogButtonBox::rejected, this, &QDialog::reject);
  connect(m_format, &QComboBox::currentIndexChanged, this, &ExportDialog::updateChoices);
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

void ExportDialog::updateChoices() {
  m_type->setEnabled(m_format->currentData().toString() == "gguf" && !running());
}

void ExportDialog::start() {
  if (running()) return;
  const QString format = m_format->currentData().toString();
  QStringList args = {"export", m_run, "--format", format};
  if (format == "gguf") args << "--type" << m_type->currentData().toString();
  if (!m_out->text().trimmed().isEmpty()) args << "--out" << m_out->text().trimmed();
  delete m_proc;
  m_proc = new QProcess(this);
  m_err.clear();
  m_written.clear();
  connect(m_proc, &QProcess::readyReadStandardError, this, &ExportDialog::readProgress);
  connect(m_proc, &QProcess::finished, this, &ExportDialog::onFinished);
  connect(m_proc, &QProcess::errorOccurred, this, [this](QProcess::ProcessError e) {
    if (e != QProcess::FailedToStart) return;
    m_err = ("cannot start " + RondoCli::program() + ": " + m_proc->errorString()).toUtf8();
    onFinished(-1, QProcess::CrashExit);
  });
  m_progress->setRange(0, 0);  // busy until a share is known
  m_result->setText("Exporting…");
  m_export->setEnabled(false);
  m_format->setEnabled(false);
  m_type->setEnabled(false);
  m_proc->start(RondoCli::program(), args);
}

void ExportDialog::readProgress() {
  m_err += m_proc->readAllStandardError();
  static const QRegularExpression share(R"(writing .*: (\d+)%)");
  QRegularExpressionMatchIterator it = share.globalMatch(QString::fromUtf8(m_err));
  int last = -1;
  while (it.hasNext())
    last = it.next().captured(1).toInt();
  if (last >= 0) {
    m_progress->setRange(0, 100);
    m_progress->setValue(last);
  }
}

void ExportDialog::onFinished(int code, QProcess::ExitStatus status) {
  m_err += m_proc->readAllStandardError();
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
  m_export->setEnabled(true);
  m_format->setEnabled(true);
  updateChoices();
  emit done(ok);
}

}  // namespace rondo::gui
