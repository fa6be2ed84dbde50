// Export a finished or stopped run (its newest checkpoint) through `rondo export`: the formats
// that apply to the run (a LoRA adapter for PEFT or llama.cpp, a merged Hugging Face folder, a
// merged GGUF and its type), where to write it, progress while it is written (GGUF: the share of
// tensors written) and where it went, or why it failed.
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

  void start();  // runs the export chosen (the Export button)
  bool running() const;
  void reject() override;  // not while an export is being written
  QString resultText() const;
  QString writtenPath() const { return m_written; }  // after a successful export

 signals:
  void done(bool ok);

 private:
  void readProgress();
  void onFinished(int code, QProcess::ExitStatus status);
  void updateChoices();

  QString m_run;
  bool m_lora = true, m_ggufBase = false;
  QProcess* m_proc = nullptr;
  QByteArray m_err;
  QString m_written;
  QComboBox* m_format;
  QComboBox* m_type;
  QLineEdit* m_out;
  QProgressBar* m_progress;
  QLabel* m_result;
  QPushButton* m_export;
};

}  // namespace rondo::gui
