// Export a finished or stopped run through `rondo export`: which checkpoint (the newest unless
// an older one is chosen), the formats that apply to the run (a LoRA adapter for PEFT or
// llama.cpp, a merged Hugging Face folder, a merged GGUF and its type), where to write it (the
// folder the CLI would choose, or one browsed to; never one that holds files), progress while it
// is written (a merged model: the share written, from the CLI's "writing FILE: N%" lines; an
// adapter, written at once: busy) and where it went, or why it failed.
#pragma once

#include <QDialog>
#include <QProcess>
#include <QString>

class QComboBox;
class QLabel;
class QLineEdit;
class QProgressBar;
class QPushButton;

namespace rondo::gui {

class ExportDialog : public QDialog {
  Q_OBJECT
 public:
  explicit ExportDialog(const QString& runDir, QWidget* parent = nullptr);
  ~ExportDialog() override;

  // Runs the export chosen (the Export button); false, saying why in resultText(), when it did
  // not start (an output folder that holds files, an export under way).
  bool start();
  bool running() const;
  void reject() override;  // not while an export is being written
  QString resultText() const;
  QString writtenPath() const { return m_written; }  // after a successful export
  // The folder `rondo export` writes to when given no --out, for the chosen format and checkpoint.
  QString defaultOut() const;

 signals:
  void done(bool ok);

 private:
  void readProgress();
  void onFinished(int code, QProcess::ExitStatus status);
  void updateChoices();
  void browse();
  void setBusy(bool busy);

  QString m_run;
  bool m_lora = true, m_ggufBase = false;
  QProcess* m_proc = nullptr;
  QByteArray m_err;        // the export's stderr so far
  qsizetype m_parsed = 0;  // how much of it readProgress has read, in whole lines
  QString m_written;
  QString m_shownDefault;  // the default m_out showed last: replaced when the choices change
  QComboBox* m_checkpoint;
  QComboBox* m_format;
  QComboBox* m_type;
  QLineEdit* m_out;
  QPushButton* m_browse;
  QProgressBar* m_progress;
  QLabel* m_result;
  QPushButton* m_export;
};

}  // namespace rondo::gui
