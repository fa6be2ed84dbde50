// The setup wizard: model, data, method, hardware, training, every other setting (built from the
// CLI's own list of keys), review. Each page asks the rondo CLI what it needs (`inspect --json`,
// `data --json`, `devices --json`, `train --help-config --json`, `plan --json`); the review page
// shows the plan's verdict as a badge, what the run needs against what each device, host memory
// and the disk have, the predicted speed and time, a button that applies a change the plan found
// to make it fit, and the equivalent command. Start writes the config next to the run folder and
// emits startRequested. Every page scrolls, so the window fits a 1024x700 screen. Widgets that
// tests fill have object names (modelPath, dataPath, runDir, ...).
#pragma once

#include <QHash>
#include <QJsonObject>
#include <QList>
#include <QPair>
#include <QSet>
#include <QString>
#include <QStringList>
#include <QVariant>
#include <QWizard>

class QCheckBox;
class QComboBox;
class QDoubleSpinBox;
class QLabel;
class QLineEdit;
class QListWidget;
class QPlainTextEdit;
class QPushButton;
class QRadioButton;
class QSpinBox;
class QTableWidget;
class QTextEdit;

namespace rondo::gui {

class AdvancedSettings;

// What the wizard sets, as config.toml spells it (docs/training.md).
struct WizardConfig {
  QString modelPath, modelDtype = "bf16", quantize = "auto";
  QString dataPath, dataFormat = "auto";
  QString objective = "sft";  // training.objective: sft, dpo, orpo or simpo
  double beta = 0.1;          // preference.beta (a preference objective's)
  bool trainOnEverything = false, skipBadLines = false;
  double validationSplit = 0;
  qint64 seqLen = 1024;
  QString method = "lora";
  int loraRank = 16;
  double loraAlpha = 32;
  double loraDropout = 0;
  bool rslora = false;
  QStringList loraTargets = {"all-linear"};
  qint64 steps = 0;
  double epochs = 1;
  qint64 batchRows = 1;
  int gradAccum = 1;
  double lr = 2e-4;
  QString schedule = "cosine";
  qint64 warmupSteps = 0;
  qint64 checkpointEvery = 0, evalEvery = 0, sampleEvery = 0;
  QStringList prompts;
  int simDevices = 0;
  QString memoryCap, hostMemory, offloadDir;
  QString runDir;
  QList<QPair<QString, QString>> advanced;  // the Advanced page's changes: key, TOML value

  QString toToml() const;
  // The keys the pages set (what toToml writes, but output.exports): the Advanced page lists the
  // rest.
  static QSet<QString> pageKeys();
};

class SetupWizard : public QWizard {
  Q_OBJECT
 public:
  enum Page {
    ModelPage,
    DataPage,
    MethodPage,
    HardwarePage,
    TrainingPage,
    AdvancedPage,
    ReviewPage
  };
  explicit SetupWizard(QWidget* parent = nullptr);

  WizardConfig config() const;
  // Where start() writes the config: next to the run folder, "<run_dir>.toml".
  QString configPath() const;
  // The command that does what Start does.
  QString commandLine() const;
  // Writes the config and emits startRequested; false (with `error`) if it cannot be written.
  bool start(QString* error = nullptr);
  // The last review: `rondo plan --json` (empty before the review page was shown).
  QJsonObject planResult() const { return m_plan; }
  // Sets a config key (as `--set key=value` spells it) in the field that holds it, on whichever
  // page; false for a key no field holds.
  bool setSetting(const QString& key, const QString& value);
  // Applies the first change the last plan found to make the run fit, and plans again.
  void applyFix();

  // Page refreshes (the pages call them when their fields change; tests call them directly).
  void refreshModel();
  void refreshData();
  void refreshDevices();
  void refreshReview();

 signals:
  void startRequested(const QString& configPath, const QString& runDir);

 protected:
  void accept() override;

 private:
  // Model
  QLineEdit* m_modelPath;
  QComboBox* m_dtype;
  QComboBox* m_quantize;
  QLabel* m_modelInfo;
  bool m_modelOk = false;
  // Data
  QLineEdit* m_dataPath;
  QComboBox* m_dataFormat;
  QCheckBox* m_trainOnEverything;
  QCheckBox* m_skipBadLines;
  QDoubleSpinBox* m_validationSplit;
  QLabel* m_dataStats;
  QTextEdit* m_dataPreview;
  QLabel* m_previewTitle;
  QComboBox* m_objective;   // training.objective, its value as item data
  QLabel* m_objectiveNote;  // what the objective needs and does
  QDoubleSpinBox* m_beta;
  bool m_dataOk = false;
  // Method
  QRadioButton* m_lora;
  QRadioButton* m_full;
  QSpinBox* m_rank;
  QDoubleSpinBox* m_alpha;
  QDoubleSpinBox* m_loraDropout;
  QCheckBox* m_rslora;
  QList<QCheckBox*> m_targets;
  // Hardware
  QListWidget* m_devices;
  QSpinBox* m_simDevices;
  QLineEdit* m_memoryCap;
  QLineEdit* m_hostMemory;
  QLineEdit* m_nvmeDir;
  // Training
  QSpinBox* m_steps;
  QDoubleSpinBox* m_epochs;
  QLabel* m_effectiveBatch;
  QLineEdit* m_lr;
  QComboBox* m_schedule;
  QSpinBox* m_warmup;
  QSpinBox* m_seqLen;
  QSpinBox* m_batchRows;
  QSpinBox* m_gradAccum;
  QSpinBox* m_checkpointEvery;
  QSpinBox* m_evalEvery;
  QSpinBox* m_sampleEvery;
  QPlainTextEdit* m_prompts;
  QLineEdit* m_runDir;
  AdvancedSettings* m_advanced;
  // Review
  QLabel* m_verdict;
  QTableWidget* m_planDevices;
  QLabel* m_speed;
  QLabel* m_problems;
  QPushButton* m_fix;
  QJsonObject m_fixSet;  // the change m_fix applies: key -> value
  QLineEdit* m_command;
  QJsonObject m_plan;
  bool m_busy = false;  // a CLI call is running (its event loop may deliver another trigger)

  // Fields the wizard fills from what it learns (the data, the plan) for as long as the user has
  // not changed them: each one's value as last set so (its initial value at first).
  QHash<QWidget*, QVariant> m_defaults;
  // Sets `field` (a spin box or a text box) to `value` unless the user changed it; true when its
  // value changed.
  bool setDefault(QWidget* field, const QVariant& value);
  // The validation loss, samples and checkpoints every so many of the run's `steps`, in the
  // fields the user has not set; true when the checkpoints changed (the disk the plan counts).
  bool setCheckDefaults(qint64 steps);
  // "the validation loss every 3 steps, a sample every 6, …": the checks the run makes.
  QString checksText() const;
};

}  // namespace rondo::gui
