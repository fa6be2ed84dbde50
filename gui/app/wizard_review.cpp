// The wizard's Review page (SetupWizard::refreshReview): `rondo plan --json` on the config the
// pages make, shown as a badge, what the run needs against what it has, its speed and length, and
// the change that would make it fit, as a button.
#include <QDir>
#include <QFile>
#include <QHeaderView>
#include <QJsonArray>
#include <QLabel>
#include <QLineEdit>
#include <QLocale>
#include <QPushButton>
#include <QRegularExpression>
#include <QScopeGuard>
#include <QSpinBox>
#include <QTableWidget>
#include <QTemporaryDir>

#include "gui/app/format.h"
#include "gui/app/rondo_cli.h"
#include "gui/app/wizard.h"
#include "gui/model/run_state.h"

namespace rondo::gui {
namespace {

constexpr qint64 kFewSteps = 20;     // fewer optimizer steps than this: Review says it is few
constexpr qint64 kEnoughSteps = 30;  // and offers to train this long (the demo's 30 steps teach)

// A message from the CLI in the wizard's words: the temporary config it planned from is not
// named, and each config key becomes the field that sets it, with its page.
QString inWizardWords(QString text) {
  static const QRegularExpression tempConfig(R"([^\s:]*review\.toml(:\d+)*:\s*)");
  text.remove(tempConfig);
  static const std::pair<const char*, const char*> kFields[] = {
      {"model.path", "Model (Model page)"},
      {"model.dtype", "Train in (Model page)"},
      {"model.quantize", "Frozen base (Method page)"},
      {"data.skip_bad_lines", "Skip bad lines (Data page)"},
      {"data.train_on_everything", "Train on prompts too (Data page)"},
      {"data.validation_split", "Validation share (Data page)"},
      {"data.train", "Training file (Data page)"},
      {"data.format", "Format (Data page)"},
      {"data.seq_len", "Sequence length (Training page)"},
      {"lora.rank", "Rank (Method page)"},
      {"lora.alpha", "Alpha (Method page)"},
      {"lora.targets", "Targets (Method page)"},
      {"lora.dropout", "LoRA dropout (Method page)"},
      {"lora.rslora", "rsLoRA (Method page)"},
      {"training.method", "Method (Method page)"},
      {"training.steps", "Steps (Training page)"},
      {"training.epochs", "Epochs (Training page)"},
      {"training.batch_rows", "Batch size (Training page)"},
      {"training.grad_accum", "Gradient accumulation (Training page)"},
      {"training.lr", "Learning rate (Training page)"},
      {"training.schedule", "Schedule (Training page)"},
      {"training.warmup_steps", "Warmup steps (Training page)"},
      {"checkpoint.every", "Checkpoint every (Training page)"},
      {"eval.sample_every", "Samples every (Training page)"},
      {"eval.every", "Validation loss every (Training page)"},
      {"eval.prompts", "Sample prompts (Training page)"},
      {"hardware.sim_devices", "Simulated GPUs (Hardware page)"},
      {"hardware.memory_cap", "GPU memory cap (Hardware page)"},
      {"hardware.host_memory", "Host memory budget (Hardware page)"},
      {"hardware.offload_dir", "NVMe folder (Hardware page)"},
      {"output.run_dir", "Run folder (Training page)"},
  };
  for (const auto& [key, field] : kFields)
    text.replace(QRegularExpression("\\b" + QRegularExpression::escape(key) + "\\b"),
                 QString("\"%1\"").arg(field));
  return text;
}

}  // namespace

void SetupWizard::refreshReview() {
  if (m_busy) return;
  m_busy = true;
  const auto done = qScopeGuard([this] { m_busy = false; });
  // The verdict as a badge, in its colour (grey while planning or when there is none).
  auto badge = [this](const QString& text, const char* colour) {
    m_verdict->setText(text);
    m_verdict->setStyleSheet(
        QString("QLabel { background:%1; color:white; border-radius:4px; padding:2px 10px; }")
            .arg(colour));
  };
  m_command->setText(commandLine());
  m_planDevices->setRowCount(0);
  m_fix->hide();
  m_fixSet = {};
  m_speed->clear();
  m_speed->setToolTip({});
  m_problems->clear();
  badge("planning…", "#6b6b6b");
  m_verdict->repaint();  // planning takes seconds: say so before it starts
  QTemporaryDir tmp;
  const QString cfg = tmp.filePath("review.toml");
  QString error;
  auto plan = [&] {
    QFile f(cfg);
    if (!tmp.isValid() || !f.open(QIODevice::WriteOnly) ||
        f.write(config().toToml().toUtf8()) < 0) {
      error = "cannot write a temporary config";
      return false;
    }
    f.close();
    m_plan = RondoCli::runJson({"plan", cfg, "--json", "--max-seq-len"}, &error);
    return !m_plan.isEmpty();
  };
  // Validation, samples and checkpoints the user has not set follow the run's length; checkpoints
  // more often need more disk, so the plan is made again for them.
  if (plan() && setCheckDefaults(m_plan["steps"].toInteger())) plan();
  if (m_plan.isEmpty()) {
    badge("cannot plan", "#b00020");
    m_problems->setText("<span style='color:#b00020'>" + inWizardWords(error).toHtmlEscaped() +
                        "</span>");
    return;
  }
  // A new run goes into a new or empty folder (the CLI refuses one holding a run or other files):
  // Start stays off, and the note says what to do.
  const QString runDir = config().runDir;
  const bool folderTaken = QDir(runDir).exists() && !QDir(runDir).isEmpty();
  const QString verdict = folderTaken ? QString("folder in use") : m_plan["verdict"].toString();
  badge(verdict, verdict == "fits" ? "#1b7f3b" : verdict == "tight" ? "#b26a00" : "#b00020");
  // What the run needs against what it has: each device, host memory, the disk for checkpoints
  // and exports, and the NVMe folder when state goes there. A device the plan could not fit has
  // no figure ("—"), not 0 bytes.
  auto row = [this](const QString& what, double needs, double has) {
    const int r = m_planDevices->rowCount();
    m_planDevices->insertRow(r);
    const bool known = needs > 0;
    const bool over = known && has > 0 && needs > has;
    const QStringList cells = {
        what, known ? bytesText(needs) : QString("—"), has > 0 ? bytesText(has) : QString("—"),
        !known || has <= 0  ? QString("—")
        : needs < has / 100 ? QString("<1%")
                            : QString::number(100.0 * needs / has, 'f', 0) + "%"};
    for (int c = 0; c < cells.size(); ++c) {
      auto* item = new QTableWidgetItem(cells[c]);
      if (over) item->setForeground(QColor("#b00020"));
      m_planDevices->setItem(r, c, item);
    }
  };
  for (const QJsonValue& v : m_plan["devices"].toArray()) {
    const QJsonObject d = v.toObject();
    row(d["name"].toString(), d["peak_bytes"].toDouble(), d["cap_bytes"].toDouble());
  }
  const QJsonObject host = m_plan["host"].toObject();
  row("Host memory", host["needed_bytes"].toDouble(), host["available_bytes"].toDouble());
  const QJsonObject disk = m_plan["disk"].toObject();
  row("Disk (checkpoints, exports)", disk["needed_bytes"].toDouble(),
      disk["free_bytes"].toDouble());
  const QJsonObject placement = m_plan["placement"].toObject();
  if (placement["nvme_bytes"].toDouble() > 0)
    row("NVMe folder", placement["nvme_bytes"].toDouble(),
        placement["offload_free_bytes"].toDouble());
  m_planDevices->resizeColumnsToContents();
  // As tall as its rows: the figures, then what to do, without an empty frame between.
  int height = m_planDevices->horizontalHeader()->height() + 2 * m_planDevices->frameWidth();
  for (int r = 0; r < m_planDevices->rowCount(); ++r)
    height += m_planDevices->rowHeight(r);
  m_planDevices->setFixedHeight(height);
  // Steps and epochs, each in terms of the other: how long a pass over the data is.
  const QLocale locale;
  const qint64 steps = m_plan["steps"].toInteger();
  const qint64 perEpoch = m_plan["steps_per_epoch"].toInteger();
  const double epochs = perEpoch > 0 ? static_cast<double>(steps) / perEpoch : 0;
  const QString epochText = perEpoch > 0 ? QString(" (%1 epoch%2; one epoch is %3 step%4)")
                                               .arg(locale.toString(epochs, 'g', 3))
                                               .arg(epochs == 1 ? "" : "s")
                                               .arg(locale.toString(perEpoch))
                                               .arg(perEpoch == 1 ? "" : "s")
                                         : QString();
  const double tokensPerS = m_plan["tokens_per_s"].toDouble();
  if (tokensPerS > 0) {
    m_speed->setText(
        QString("About %1 tokens/s (estimated), %2 per step; %3 step%4%5 of %6 tokens: about %7.")
            .arg(locale.toString(tokensPerS, 'f', 0),
                 durationText(m_plan["step_seconds"].toDouble()), locale.toString(steps),
                 steps == 1 ? "" : "s", epochText,
                 locale.toString(m_plan["tokens_per_step"].toInteger()),
                 durationText(m_plan["seconds"].toDouble())));
    // DPO scores every pair once before step 1 (in the time above).
    if (const double ref = m_plan["reference"].toObject()["seconds"].toDouble(); ref > 0)
      m_speed->setText(m_speed->text() +
                       QString(" That includes DPO's reference pass: every pair scored once with "
                               "the starting weights before step 1, about %1.")
                           .arg(durationText(ref)));
    // The schedule in words, for those who want to know how the run is laid out.
    m_speed->setToolTip("Schedule: " + scheduleInWords(m_plan["plan"].toString(),
                                                       m_plan["devices"].toArray().size(), 0));
  } else {
    m_speed->setText(QString("%1 step%2%3; speed and time: not estimated, since nothing fits the "
                             "devices.")
                         .arg(locale.toString(steps), steps == 1 ? "" : "s", epochText));
  }
  // The first change the plan found that makes it fit, as a button that applies it.
  const QJsonArray fixes = m_plan["fixes"].toArray();
  if (!folderTaken && !fixes.isEmpty()) {
    const QJsonObject fix = fixes.first().toObject();
    m_fixSet = fix["set"].toObject();
    QStringList fields;
    for (auto it = m_fixSet.begin(); it != m_fixSet.end(); ++it)
      fields << inWizardWords(it.key()) + " = " + it.value().toString();
    m_fix->setText("Make it fit: " + fields.join(", "));
    m_fix->setToolTip(fix["why"].toString() + " (planned: the run fits with it)");
    m_fix->show();
  } else if (!folderTaken && steps > 0 && steps < kFewSteps && verdict != "does not fit") {
    // Too few steps to learn from: longer, in the field the user set it in (more epochs when the
    // steps come from them).
    const bool fromEpochs = m_steps->value() == 0 && perEpoch > 0;
    const qint64 epochsNeeded = fromEpochs ? (kEnoughSteps + perEpoch - 1) / perEpoch : 0;
    const QString key = fromEpochs ? "training.epochs" : "training.steps";
    const QString value = QString::number(fromEpochs ? epochsNeeded : kEnoughSteps);
    m_fixSet = {{key, value}};
    m_fix->setText("Train longer: " + inWizardWords(key) + " = " + value);
    m_fix->setToolTip(QString("About %1 optimizer steps instead of %2")
                          .arg(fromEpochs ? epochsNeeded * perEpoch : kEnoughSteps)
                          .arg(steps));
    m_fix->show();
  }
  QStringList notes;
  if (folderTaken)
    notes << "• " + runDir +
                 " already holds a run or other files: choose another Run folder (Training "
                 "page), or open that run from the File menu to resume it";
  for (const QJsonValue& v : m_plan["problems"].toArray())
    notes << "• " + inWizardWords(v.toString());
  // A run too short to learn from (the demo data's one epoch is 2 steps): say so, and what
  // gives more steps.
  if (steps > 0 && steps < kFewSteps)
    notes << QString("• Only %1 optimizer step%2: too few for the model to learn much. %3")
                 .arg(steps)
                 .arg(steps == 1 ? "" : "s")
                 .arg(m_steps->value() == 0
                          ? "More epochs, or a smaller batch size or gradient accumulation "
                            "(Training page), give more."
                          : "More steps (Training page) give more.");
  for (const QJsonValue& v : m_plan["warnings"].toArray())
    notes << "• " + inWizardWords(v.toString());
  notes << "• " + checksText();
  // How long rows could be, the rest as set: the question long-context users ask first.
  if (const qint64 longest = m_plan["longest_seq_len"].toInteger(); longest > 0)
    notes << QString("• Rows of up to %1 tokens fit%2 (Sequence length, Training page).")
                 .arg(QLocale().toString(longest), m_plan["longest_is_positions"].toBool()
                                                       ? QString(": all the model's positions")
                                                       : QString(" these devices and this memory"));
  m_problems->setText(notes.join("\n"));
}

}  // namespace rondo::gui
