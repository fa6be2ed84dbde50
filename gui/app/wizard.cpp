#include "gui/app/wizard.h"

#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QFormLayout>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QJsonArray>
#include <QLabel>
#include <QLineEdit>
#include <QListWidget>
#include <QLocale>
#include <QPlainTextEdit>
#include <QPushButton>
#include <QRadioButton>
#include <QRegularExpression>
#include <QSaveFile>
#include <QScopeGuard>
#include <QScrollArea>
#include <QSpinBox>
#include <QTableWidget>
#include <QTemporaryDir>
#include <QTextEdit>
#include <QVBoxLayout>
#include <algorithm>
#include <functional>

#include "gui/app/advanced_settings.h"
#include "gui/app/format.h"
#include "gui/app/rondo_cli.h"

namespace rondo::gui {
namespace {

constexpr int kPreviewLines = 2000;         // lines of a data file the data page reads
constexpr qint64 kCheckpointedSteps = 100;  // a run this long checkpoints at each quarter too
constexpr qint64 kValidatedExamples = 20;   // data this large holds some out for validation

// The first runs/run-N under the current folder that holds nothing yet (no folder or an empty
// one, and no run-N.toml beside it): a fresh wizard never proposes a folder holding a run.
QString freeRunFolder() {
  for (int n = 1;; ++n) {
    const QString dir = QDir::current().filePath(QString("runs/run-%1").arg(n));
    const QDir d(dir);
    if ((!d.exists() || d.isEmpty()) && !QFileInfo::exists(dir + ".toml")) return dir;
  }
}

// A page whose completeness and initialisation are the wizard's to decide.
class HookPage : public QWizardPage {
 public:
  std::function<bool()> complete;
  std::function<void()> init;
  bool isComplete() const override { return complete ? complete() : true; }
  void initializePage() override {
    if (init) init();
  }
  void changed() { emit completeChanged(); }
};

// The form of a page, in a frame that scrolls: a page never makes the window taller or wider than
// a small screen (1024x700) allows.
QFormLayout* scrolledForm(QWizardPage* page) {
  auto* area = new QScrollArea;
  area->setWidgetResizable(true);
  area->setFrameShape(QFrame::NoFrame);
  auto* body = new QWidget;
  area->setWidget(body);
  auto* outer = new QVBoxLayout(page);
  outer->setContentsMargins(0, 0, 0, 0);
  outer->addWidget(area);
  // The rows at the top, the room left below them (not spread between them).
  auto* column = new QVBoxLayout(body);
  auto* form = new QFormLayout;
  column->addLayout(form);
  column->addStretch(1);
  return form;
}

QString list(const QStringList& items) {
  QStringList q;
  for (const QString& s : items)
    q << tomlString(s);
  return "[" + q.join(", ") + "]";
}

QString fmtNumber(double v) {
  QString s = QString::number(v, 'g', 10);
  if (!s.contains('.') && !s.contains('e') && !s.contains("inf") && !s.contains("nan")) s += ".0";
  return s;
}

QSpinBox* spin(const char* name, int lo, int hi, int value) {
  auto* s = new QSpinBox;
  s->setObjectName(name);
  s->setRange(lo, hi);
  s->setValue(value);
  return s;
}

// A combo box whose items show a text and hold the config's word for it as their data.
QComboBox* valueCombo(const char* name,
                      std::initializer_list<std::pair<const char*, const char*>> items) {
  auto* c = new QComboBox;
  c->setObjectName(name);
  for (const auto& [value, text] : items)
    c->addItem(text, value);
  return c;
}

// The examples of a data file of which `rondo data` read the first kPreviewLines lines, finding
// `read` examples there: as many again for each as many bytes as those lines took.
double estimatedExamples(const QString& path, double read) {
  QFile f(path);
  if (!f.open(QIODevice::ReadOnly)) return read;
  qint64 bytes = 0;
  for (int i = 0; i < kPreviewLines && !f.atEnd(); ++i)
    bytes += f.readLine().size();
  return bytes > 0 ? read * static_cast<double>(f.size()) / static_cast<double>(bytes) : read;
}

// What a field the wizard may fill holds (SetupWizard::setDefault).
QVariant fieldValue(QWidget* field) {
  if (auto* s = qobject_cast<QSpinBox*>(field)) return s->value();
  if (auto* d = qobject_cast<QDoubleSpinBox*>(field)) return d->value();
  if (auto* t = qobject_cast<QPlainTextEdit*>(field)) return t->toPlainText();
  return {};
}

// What an objective needs and does, for the line under the Data page's choice.
QString objectiveNote(const QString& objective) {
  if (objective == "dpo")
    return "Needs pairs: a prompt with a chosen and a rejected answer ({prompt, chosen, "
           "rejected}, strings or chat messages). Compares with the starting model, whose scores "
           "are computed once before step 1 (no second copy in memory): start from a supervised "
           "result (LoRA: lora.init_adapter on the Advanced page; full: its merged folder).";
  if (objective == "orpo")
    return "Needs pairs ({prompt, chosen, rejected}). No reference model: the chosen answer's own "
           "loss plus an odds-ratio term, so it can start from a base model.";
  if (objective == "simpo")
    return "Needs pairs ({prompt, chosen, rejected}). No reference model: the length-normalised "
           "score of the chosen answer must beat the rejected one's by a margin (gamma).";
  return "Needs one answer per example (text, alpaca, chat or ShareGPT): next-token loss on the "
         "answers.";
}

}  // namespace

QString WizardConfig::toToml() const {
  const QString exportFormat = method == "lora" ? "adapter" : "merged";
  // The sections in the CLI's order, the pages' keys first, then the Advanced page's changes.
  QList<QPair<QString, QStringList>> sections = {
      {"model",
       {"path = " + tomlString(modelPath), "dtype = " + tomlString(modelDtype),
        "quantize = " + tomlString(quantize)}},
      {"data",
       {"train = " + tomlString(dataPath), "format = " + tomlString(dataFormat),
        QString("train_on_everything = ") + (trainOnEverything ? "true" : "false"),
        QString("skip_bad_lines = ") + (skipBadLines ? "true" : "false"),
        "validation_split = " + fmtNumber(validationSplit),
        "seq_len = " + QString::number(seqLen)}},
      {"lora",
       {"rank = " + QString::number(loraRank), "alpha = " + fmtNumber(loraAlpha),
        "targets = " + list(loraTargets), "dropout = " + fmtNumber(loraDropout),
        QString("rslora = ") + (rslora ? "true" : "false")}},
      {"training",
       {"method = " + tomlString(method), "objective = " + tomlString(objective),
        "steps = " + QString::number(steps), "epochs = " + fmtNumber(epochs),
        "batch_rows = " + QString::number(batchRows), "grad_accum = " + QString::number(gradAccum),
        "lr = " + fmtNumber(lr), "schedule = " + tomlString(schedule),
        "warmup_steps = " + QString::number(warmupSteps)}},
      {"checkpoint", {"every = " + QString::number(checkpointEvery)}},
      {"preference", {}},
      {"eval",
       {"every = " + QString::number(evalEvery), "sample_every = " + QString::number(sampleEvery),
        "prompts = " + list(prompts)}},
      {"hardware",
       {"sim_devices = " + QString::number(simDevices), "memory_cap = " + tomlString(memoryCap),
        "host_memory = " + tomlString(hostMemory), "offload_dir = " + tomlString(offloadDir)}},
      {"output", {"run_dir = " + tomlString(runDir)}}};
  bool exports = false;
  for (const auto& [key, value] : advanced) {
    for (auto& [section, lines] : sections)
      if (key.section('.', 0, 0) == section) lines << key.section('.', 1) + " = " + value;
    exports = exports || key == "output.exports";
  }
  if (!exports) sections.back().second << "exports = " + list({exportFormat});
  // A supervised run has no [preference] section (unless the Advanced page sets a key of it).
  for (auto& [section, lines] : sections)
    if (section == "preference" && objective != "sft") lines.prepend("beta = " + fmtNumber(beta));
  QString t = "# Written by rondo-gui; run it with `rondo train <this file>`.\n";
  for (const auto& [section, lines] : sections)
    if (!lines.isEmpty()) t += "\n[" + section + "]\n" + lines.join("\n") + "\n";
  return t;
}

QSet<QString> WizardConfig::pageKeys() {
  QSet<QString> keys;
  QString section;
  for (const QString& line : WizardConfig().toToml().split('\n')) {
    if (line.startsWith('['))
      section = line.mid(1, line.indexOf(']') - 1);
    else if (line.contains(" = "))
      keys.insert(section + "." + line.section(" = ", 0, 0));
  }
  keys.remove("output.exports");   // written by default, and the Advanced page's to change
  keys.insert("preference.beta");  // the Data page's, written for a preference objective
  return keys;
}

SetupWizard::SetupWizard(QWidget* parent) : QWizard(parent) {
  setWindowTitle("Rondo — new fine-tuning run");
  setObjectName("setupWizard");
  setWizardStyle(QWizard::ClassicStyle);
  setOption(QWizard::NoBackButtonOnStartPage);
  setButtonText(QWizard::FinishButton, "Start");

  // ---- Model ----
  auto* model = new HookPage;
  model->setTitle("Step 1 of 7: Model");
  model->setSubTitle("A Hugging Face folder or a GGUF file on this machine.");
  m_modelPath = new QLineEdit;
  m_modelPath->setObjectName("modelPath");
  auto* browseFolder = new QPushButton("Folder…");
  auto* browseFile = new QPushButton("GGUF file…");
  m_dtype = new QComboBox;
  m_dtype->setObjectName("modelDtype");
  m_dtype->addItems({"bf16", "fp16", "fp32"});
  m_dtype->setToolTip(
      "The precision the weights are streamed and computed in; the trained copies and the "
      "optimizer stay in fp32. bf16 halves the traffic and memory of fp32.");
  m_modelInfo = new QLabel("Pick a model to see its family, size and dtype.");
  m_modelInfo->setObjectName("modelInfo");
  m_modelInfo->setWordWrap(true);
  m_modelInfo->setTextInteractionFlags(Qt::TextSelectableByMouse);
  {
    auto* row = new QHBoxLayout;
    row->addWidget(m_modelPath, 1);
    row->addWidget(browseFolder);
    row->addWidget(browseFile);
    auto* form = scrolledForm(model);
    form->addRow("Model", row);
    form->addRow("Train in", m_dtype);
    form->addRow(m_modelInfo);
  }
  connect(browseFolder, &QPushButton::clicked, this, [this] {
    QString d = QFileDialog::getExistingDirectory(this, "Model folder");
    if (!d.isEmpty()) m_modelPath->setText(d), refreshModel();
  });
  connect(browseFile, &QPushButton::clicked, this, [this] {
    QString f = QFileDialog::getOpenFileName(this, "GGUF model", {}, "GGUF (*.gguf)");
    if (!f.isEmpty()) m_modelPath->setText(f), refreshModel();
  });
  connect(m_modelPath, &QLineEdit::editingFinished, this, &SetupWizard::refreshModel);
  model->complete = [this] { return m_modelOk; };
  setPage(ModelPage, model);

  // ---- Data ----
  auto* data = new HookPage;
  data->setTitle("Step 2 of 7: Data");
  data->setSubTitle(
      "What to learn, and from what: JSONL or a JSON list of text, alpaca "
      "(instruction/input/output), chat (messages) or ShareGPT (conversations) examples, or of "
      "preference pairs (prompt/chosen/rejected).");
  m_dataPath = new QLineEdit;
  m_dataPath->setObjectName("dataPath");
  auto* browseData = new QPushButton("File…");
  m_dataFormat = new QComboBox;
  m_dataFormat->setObjectName("dataFormat");
  m_dataFormat->addItems({"auto", "text", "alpaca", "chat", "sharegpt", "preference"});
  m_objective = valueCombo("objective",
                           {{"sft", "Supervised (SFT): answer like the examples"},
                            {"dpo", "DPO: prefer the chosen answer to the rejected one"},
                            {"orpo", "ORPO: learn the chosen answers and prefer them, in one run"},
                            {"simpo", "SimPO: prefer the chosen answer, no reference model"}});
  m_objectiveNote = new QLabel;
  m_objectiveNote->setObjectName("objectiveNote");
  m_objectiveNote->setWordWrap(true);
  m_beta = new QDoubleSpinBox;
  m_beta->setObjectName("preferenceBeta");
  m_beta->setRange(0.001, 100);
  m_beta->setDecimals(3);
  m_beta->setSingleStep(0.05);
  m_beta->setValue(0.1);
  m_beta->setToolTip(
      "How strongly the preference counts: DPO's and ORPO's beta (TRL's default 0.1); SimPO's "
      "reward scale (2 to 10 is usual). The other settings are on the Advanced page "
      "([preference])");
  m_trainOnEverything = new QCheckBox("Train on prompts too, not only on the replies");
  m_trainOnEverything->setObjectName("trainOnEverything");
  m_skipBadLines = new QCheckBox("Skip bad lines (and count them) instead of stopping");
  m_skipBadLines->setObjectName("skipBadLines");
  m_skipBadLines->setToolTip(
      "A line that is not valid JSON or lacks the format's fields stops the run unless checked");
  m_validationSplit = new QDoubleSpinBox;
  m_validationSplit->setObjectName("validationSplit");
  m_validationSplit->setRange(0, 0.5);
  m_validationSplit->setSingleStep(0.05);
  m_validationSplit->setDecimals(3);
  m_validationSplit->setToolTip(
      "The share of examples held out for a validation loss: a tenth of a small set, about a "
      "hundred examples of a large one, unless you set it (none under 20 examples)");
  m_dataStats = new QLabel("Pick a file to see its format and token statistics.");
  m_dataStats->setObjectName("dataStats");
  m_dataStats->setWordWrap(true);
  m_dataPreview = new QTextEdit;
  m_dataPreview->setObjectName("dataPreview");
  m_dataPreview->setReadOnly(true);
  m_dataPreview->setMinimumHeight(120);
  {
    auto* row = new QHBoxLayout;
    row->addWidget(m_dataPath, 1);
    row->addWidget(browseData);
    auto* form = scrolledForm(data);
    form->addRow("Objective", m_objective);
    form->addRow("", m_objectiveNote);
    form->addRow("Beta", m_beta);
    form->addRow("Training file", row);
    form->addRow("Format", m_dataFormat);
    form->addRow("", m_trainOnEverything);
    form->addRow("", m_skipBadLines);
    form->addRow("Validation share", m_validationSplit);
    form->addRow(m_dataStats);
    m_previewTitle = new QLabel;
    form->addRow(m_previewTitle);
    form->addRow(m_dataPreview);
  }
  connect(browseData, &QPushButton::clicked, this, [this] {
    QString f = QFileDialog::getOpenFileName(this, "Training data", {},
                                             "JSONL or a JSON list (*.jsonl *.json)");
    if (!f.isEmpty()) m_dataPath->setText(f), refreshData();
  });
  connect(m_dataPath, &QLineEdit::editingFinished, this, &SetupWizard::refreshData);
  connect(m_dataFormat, &QComboBox::currentTextChanged, this, &SetupWizard::refreshData);
  connect(m_trainOnEverything, &QCheckBox::toggled, this, &SetupWizard::refreshData);
  // What the objective needs, and the fields that mean nothing for it, at once (the data is read
  // again after).
  const auto showObjective = [this] {
    const QString objective = m_objective->currentData().toString();
    const bool pairs = objective != "sft";
    m_beta->setEnabled(pairs);
    m_trainOnEverything->setEnabled(!pairs);  // a pair's loss is on its answers
    m_objectiveNote->setText(objectiveNote(objective));
    m_previewTitle->setText(
        !pairs ? "First example — trained text in green, masked text in grey:"
        : objective == "orpo"
            ? "First pair — the answers scored: the chosen one in green, the rejected one in red "
              "(ORPO's NLL term also trains on the chosen answer's prompt, in grey):"
            : "First pair — the answers scored: the chosen one in green, the rejected one in red; "
              "the prompt in grey:");
  };
  showObjective();
  connect(m_objective, &QComboBox::currentIndexChanged, this, showObjective);
  connect(m_objective, &QComboBox::currentIndexChanged, this, &SetupWizard::refreshData);
  data->complete = [this] { return m_dataOk; };
  data->init = [this] {
    if (!m_dataPath->text().isEmpty()) refreshData();
  };
  setPage(DataPage, data);

  // ---- Method ----
  auto* method = new HookPage;
  method->setTitle("Step 3 of 7: Method");
  method->setSubTitle("LoRA adapters on a frozen base, or every weight.");
  m_lora = new QRadioButton("LoRA");
  m_lora->setObjectName("methodLora");
  m_lora->setChecked(true);
  m_full = new QRadioButton("Full fine-tuning");
  m_full->setObjectName("methodFull");
  m_rank = spin("loraRank", 1, 4096, 16);
  m_rank->setToolTip(
      "The adapters' inner size: more rank, more capacity and memory (8 to 64 is usual)");
  m_alpha = new QDoubleSpinBox;
  m_alpha->setObjectName("loraAlpha");
  m_alpha->setRange(0.01, 1e6);
  m_alpha->setValue(32);
  m_alpha->setToolTip(
      "The adapters' output is scaled by alpha / rank: twice the rank is a common choice");
  m_quantize = valueCombo(
      "quantize", {{"auto", "auto: a GGUF or MXFP4 base stays as stored when host memory is short"},
                   {"none", "not quantised (the training dtype)"},
                   {"nf4", "NF4, 4 bits (QLoRA)"},
                   {"int8", "int8"},
                   {"gguf", "a GGUF file's own block types"}});
  m_quantize->setToolTip(
      "How the frozen base is kept and streamed to the GPUs: 4 bits take about a quarter of the "
      "memory and link traffic of bf16, at a small cost in accuracy");
  m_loraDropout = new QDoubleSpinBox;
  m_loraDropout->setObjectName("loraDropout");
  m_loraDropout->setRange(0, 0.9);
  m_loraDropout->setSingleStep(0.05);
  m_loraDropout->setToolTip("Dropout on the adapters' input while training (0: none)");
  m_rslora = new QCheckBox("rsLoRA: scale by alpha / sqrt(rank) instead of alpha / rank");
  m_rslora->setObjectName("loraRslora");
  m_rslora->setToolTip("Keeps the adapters' effect steady at high ranks");
  auto* targets = new QGridLayout;  // five a row: the page fits a narrow window
  for (const char* t : {"all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                        "up_proj", "down_proj", "gate"}) {
    auto* c = new QCheckBox(t);
    c->setObjectName(QString("target_") + t);
    c->setChecked(QString(t) == "all-linear");
    if (QString(t) == "gate")
      c->setToolTip("A mixture of experts' router: frozen unless checked");
    else if (QString(t) == "all-linear")
      c->setToolTip(
          "Every projection; on GPT-OSS the attention alone (check gate_proj, up_proj "
          "and down_proj for its experts, as PEFT names them)");
    targets->addWidget(c, static_cast<int>(m_targets.size()) / 5,
                       static_cast<int>(m_targets.size()) % 5);
    m_targets << c;
  }
  {
    auto* form = scrolledForm(method);
    form->addRow(m_lora);
    form->addRow(m_full);
    form->addRow("Frozen base", m_quantize);
    form->addRow("Rank", m_rank);
    form->addRow("Alpha", m_alpha);
    form->addRow("LoRA dropout", m_loraDropout);
    form->addRow("", m_rslora);
    form->addRow("Targets", targets);
  }
  auto loraOn = [this] {
    for (QWidget* w :
         std::initializer_list<QWidget*>{m_rank, m_alpha, m_loraDropout, m_rslora, m_quantize})
      w->setEnabled(m_lora->isChecked());
    for (QCheckBox* c : m_targets)
      c->setEnabled(m_lora->isChecked());
  };
  connect(m_lora, &QRadioButton::toggled, this, loraOn);
  method->complete = [this] {
    if (!m_lora->isChecked()) return true;
    for (QCheckBox* c : m_targets)
      if (c->isChecked()) return true;
    return false;
  };
  for (QCheckBox* c : m_targets)
    connect(c, &QCheckBox::toggled, method, &HookPage::changed);
  setPage(MethodPage, method);

  // ---- Hardware ----
  auto* hw = new HookPage;
  hw->setTitle("Step 4 of 7: Hardware");
  hw->setSubTitle("The devices Rondo found, and how much of them a run may use.");
  m_devices = new QListWidget;
  m_devices->setObjectName("devices");
  m_devices->setMaximumHeight(110);
  m_simDevices = spin("simDevices", 0, 64, 0);
  m_simDevices->setToolTip("Simulated GPUs on the CPU, to try a multi-GPU schedule without GPUs");
  m_memoryCap = new QLineEdit;
  m_memoryCap->setObjectName("memoryCap");
  m_memoryCap->setPlaceholderText("whole device, or e.g. 24GB");
  m_hostMemory = new QLineEdit;
  m_hostMemory->setObjectName("hostMemory");
  m_hostMemory->setPlaceholderText("what the OS reports free, or e.g. 64GB");
  m_nvmeDir = new QLineEdit;
  m_nvmeDir->setObjectName("nvmeDir");
  m_nvmeDir->setPlaceholderText("none: all training state in host memory");
  m_nvmeDir->setToolTip(
      "A folder on a fast drive for what the host memory budget cannot hold (frozen weights, "
      "optimizer state, activation checkpoints); the plan says how much goes there");
  auto* browseNvme = new QPushButton("Folder…");
  {
    auto* form = scrolledForm(hw);
    form->addRow("Devices", m_devices);
    form->addRow("Simulated GPUs", m_simDevices);
    form->addRow("GPU memory cap", m_memoryCap);
    form->addRow("Host memory budget", m_hostMemory);
    auto* row = new QHBoxLayout;
    row->addWidget(m_nvmeDir, 1);
    row->addWidget(browseNvme);
    form->addRow("NVMe folder", row);
  }
  connect(browseNvme, &QPushButton::clicked, this, [this] {
    const QString d = QFileDialog::getExistingDirectory(this, "NVMe folder");
    if (!d.isEmpty()) m_nvmeDir->setText(d);
  });
  hw->init = [this] { refreshDevices(); };
  // The list shows what a run would use: the simulated devices when there are some.
  connect(m_simDevices, &QSpinBox::valueChanged, this, &SetupWizard::refreshDevices);
  setPage(HardwarePage, hw);

  // ---- Training ----
  auto* tr = new HookPage;
  tr->setTitle("Step 5 of 7: Training");
  tr->setSubTitle("How long, how fast, and where the run folder goes.");
  m_steps = spin("steps", 0, 10000000, 0);
  m_steps->setToolTip("0: from the number of epochs");
  m_epochs = new QDoubleSpinBox;
  m_epochs->setObjectName("epochs");
  m_epochs->setRange(0.01, 1e6);
  m_epochs->setValue(1);
  m_lr = new QLineEdit("2e-4");
  m_lr->setObjectName("lr");
  m_lr->setToolTip(
      "The peak step size: 1e-4 to 3e-4 is usual for LoRA, about a tenth of that for full "
      "fine-tuning");
  m_schedule = new QComboBox;
  m_schedule->setObjectName("schedule");
  m_schedule->addItems({"cosine", "linear", "constant"});
  m_warmup = spin("warmupSteps", 0, 10000000, 0);
  m_seqLen = spin("seqLen", 2, 1 << 20, 1024);
  m_seqLen->setToolTip(
      "Tokens per row: longer examples are cut there, shorter ones packed together; device "
      "memory grows with it");
  m_batchRows = spin("batchRows", 1, 65536, 1);
  m_batchRows->setToolTip("Sequences a device processes at once (training.batch_rows)");
  m_gradAccum = spin("gradAccum", 1, 65536, 1);
  m_gradAccum->setToolTip(
      "Batches whose gradients add up before each optimizer step (training.grad_accum)");
  m_effectiveBatch = new QLabel;
  m_effectiveBatch->setObjectName("effectiveBatch");
  m_checkpointEvery = spin("checkpointEvery", 0, 10000000, 0);
  m_evalEvery = spin("evalEvery", 0, 10000000, 0);
  m_sampleEvery = spin("sampleEvery", 0, 10000000, 0);
  // Filled in on the Review page from the run's length until changed here.
  m_checkpointEvery->setToolTip(
      "0: only at the end (stopping writes one too); a run of 100 steps or more gets one at each "
      "quarter unless you set it");
  m_evalEvery->setToolTip(
      "The loss on the examples held out (Validation share, Data page), about ten times a run "
      "unless you set it; 0: never");
  m_sampleEvery->setToolTip(
      "Text the model writes for each sample prompt, about five times a run unless you set it; "
      "0: never");
  m_prompts = new QPlainTextEdit;
  m_prompts->setObjectName("prompts");
  m_prompts->setPlaceholderText("One prompt per line, for sample generations");
  m_prompts->setToolTip("The data's first prompt unless you write your own");
  m_prompts->setMaximumHeight(70);
  m_runDir = new QLineEdit(freeRunFolder());
  m_runDir->setObjectName("runDir");
  {
    auto* form = scrolledForm(tr);
    form->addRow("Steps", m_steps);
    form->addRow("Epochs (when steps is 0)", m_epochs);
    form->addRow("Learning rate", m_lr);
    form->addRow("Schedule", m_schedule);
    form->addRow("Warmup steps", m_warmup);
    form->addRow("Sequence length", m_seqLen);
    form->addRow("Batch size", m_batchRows);
    form->addRow("Gradient accumulation", m_gradAccum);
    form->addRow("", m_effectiveBatch);
    form->addRow("Checkpoint every (steps)", m_checkpointEvery);
    form->addRow("Validation loss every", m_evalEvery);
    form->addRow("Samples every", m_sampleEvery);
    form->addRow("Sample prompts", m_prompts);
    form->addRow("Run folder", m_runDir);
  }
  tr->complete = [this] {
    bool ok = false;
    const double lr = m_lr->text().toDouble(&ok);
    return ok && lr > 0 && lr < 1 && !m_runDir->text().trimmed().isEmpty();
  };
  auto effective = [this] {
    const qint64 rows = static_cast<qint64>(m_batchRows->value()) * m_gradAccum->value();
    m_effectiveBatch->setText(
        QString("Effective batch: %1 sequences of up to %2 tokens per optimizer step")
            .arg(QLocale().toString(rows), QLocale().toString(m_seqLen->value())));
  };
  for (QSpinBox* s : {m_batchRows, m_gradAccum, m_seqLen})
    connect(s, &QSpinBox::valueChanged, this, effective);
  effective();
  connect(m_lr, &QLineEdit::textChanged, tr, &HookPage::changed);
  connect(m_runDir, &QLineEdit::textChanged, tr, &HookPage::changed);
  setPage(TrainingPage, tr);

  // ---- Advanced ----
  auto* adv = new HookPage;
  adv->setTitle("Step 6 of 7: Every other setting");
  adv->setSubTitle("Optimizer, evaluation, checkpoints, drives, exports: the defaults are sound.");
  m_advanced = new AdvancedSettings(WizardConfig::pageKeys());
  {
    auto* area = new QScrollArea;
    area->setWidgetResizable(true);
    area->setFrameShape(QFrame::NoFrame);
    area->setWidget(m_advanced);
    auto* outer = new QVBoxLayout(adv);
    outer->setContentsMargins(0, 0, 0, 0);
    outer->addWidget(area);
  }
  auto* advError = new QLabel;  // one label, shown while the list cannot be had
  advError->setWordWrap(true);
  advError->hide();
  m_advanced->layout()->addWidget(advError);
  adv->init = [this, advError] {
    QString error;
    const bool loaded = m_advanced->load(&error);
    advError->setText("<span style='color:#b00020'>" + error.toHtmlEscaped() + "</span>");
    advError->setVisible(!loaded);
  };
  setPage(AdvancedPage, adv);

  // ---- Review ----
  auto* review = new HookPage;
  review->setTitle("Step 7 of 7: Review");
  review->setSubTitle("What the run needs and how long it will take, before anything starts.");
  m_verdict = new QLabel;
  m_verdict->setObjectName("planVerdict");
  QFont big = m_verdict->font();
  big.setPointSize(big.pointSize() + 4);
  big.setBold(true);
  m_verdict->setFont(big);
  m_verdict->setSizePolicy(QSizePolicy::Maximum, QSizePolicy::Fixed);
  m_planDevices = new QTableWidget(0, 4);
  m_planDevices->setObjectName("planDevices");
  m_planDevices->setHorizontalHeaderLabels({"", "Needs", "Has", "Use"});
  m_planDevices->horizontalHeader()->setSectionResizeMode(0, QHeaderView::Stretch);
  m_planDevices->verticalHeader()->hide();
  m_planDevices->setEditTriggers(QAbstractItemView::NoEditTriggers);
  m_planDevices->setVerticalScrollBarPolicy(Qt::ScrollBarAlwaysOff);
  m_speed = new QLabel;
  m_speed->setObjectName("planSpeed");
  m_speed->setWordWrap(true);
  m_fix = new QPushButton;
  m_fix->setObjectName("applyFix");
  m_fix->setSizePolicy(QSizePolicy::Maximum, QSizePolicy::Fixed);
  m_fix->hide();
  m_problems = new QLabel;
  m_problems->setObjectName("planProblems");
  m_problems->setWordWrap(true);
  m_problems->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_command = new QLineEdit;
  m_command->setObjectName("cliCommand");
  m_command->setReadOnly(true);
  auto* save = new QPushButton("Save config…");
  {
    auto* form = scrolledForm(review);
    form->addRow("Verdict", m_verdict);
    form->addRow(m_planDevices);
    form->addRow(m_speed);
    form->addRow(m_fix);
    form->addRow(m_problems);
    form->addRow("Command", m_command);
    form->addRow(save);
  }
  connect(m_fix, &QPushButton::clicked, this, &SetupWizard::applyFix);
  connect(save, &QPushButton::clicked, this, [this] {
    const QString f =
        QFileDialog::getSaveFileName(this, "Save config", configPath(), "TOML (*.toml)");
    if (f.isEmpty()) return;
    QSaveFile out(f);
    if (out.open(QIODevice::WriteOnly)) {
      out.write(config().toToml().toUtf8());
      out.commit();
    }
  });
  review->init = [this, review] {
    refreshReview();
    review->changed();
  };
  // Start only a run the plan says fits (or fits tightly): not one it cannot plan or fit.
  review->complete = [this] {
    const QString v = m_verdict->text();
    return v == "fits" || v == "tight";
  };
  setPage(ReviewPage, review);

  // The fields filled from the data and the plan until the user sets them, as they start.
  for (QWidget* field : std::initializer_list<QWidget*>{m_validationSplit, m_prompts, m_evalEvery,
                                                        m_sampleEvery, m_checkpointEvery})
    m_defaults[field] = fieldValue(field);
}

bool SetupWizard::setDefault(QWidget* field, const QVariant& value) {
  const QVariant now = fieldValue(field);
  if (m_defaults.value(field) != now) return false;  // the user's
  if (auto* s = qobject_cast<QSpinBox*>(field))
    s->setValue(value.toInt());
  else if (auto* d = qobject_cast<QDoubleSpinBox*>(field))
    d->setValue(value.toDouble());
  else if (auto* t = qobject_cast<QPlainTextEdit*>(field))
    t->setPlainText(value.toString());
  m_defaults[field] = fieldValue(field);  // as the field holds it (a spin box rounds)
  return m_defaults[field] != now;
}

bool SetupWizard::setCheckDefaults(qint64 steps) {
  auto every = [&](qint64 times) {
    return static_cast<int>(std::clamp<qint64>((steps + times - 1) / times, 1, 10000000));
  };
  bool validation = m_validationSplit->value() > 0;
  for (const auto& [key, value] : m_advanced->changed())
    validation |= key == "data.validation" && value != "\"\"";
  // About ten validation losses and five samples over the run; a long run checkpoints at each
  // quarter too (a stop, or the run's end, always does).
  setDefault(m_evalEvery, validation ? every(10) : 0);
  setDefault(m_sampleEvery, m_prompts->toPlainText().trimmed().isEmpty() ? 0 : every(5));
  return setDefault(m_checkpointEvery, steps >= kCheckpointedSteps ? every(4) : 0);
}

QString SetupWizard::checksText() const {
  auto steps = [](int n) { return n == 1 ? QString("step") : QString("%1 steps").arg(n); };
  QStringList checks;
  if (m_evalEvery->value() > 0)
    checks << "the validation loss every " + steps(m_evalEvery->value());
  if (m_sampleEvery->value() > 0 && !m_prompts->toPlainText().trimmed().isEmpty())
    checks << "a sample of each prompt every " + steps(m_sampleEvery->value());
  checks << (m_checkpointEvery->value() > 0
                 ? "a checkpoint every " + steps(m_checkpointEvery->value()) + " and at the end"
                 : QString("a checkpoint at the end (and when you stop it)"));
  return "During the run: " + checks.join(", ") + " (Training page).";
}

WizardConfig SetupWizard::config() const {
  WizardConfig c;
  c.modelPath = m_modelPath->text().trimmed();
  c.modelDtype = m_dtype->currentText();
  // The frozen base's form is LoRA's; a full run trains the base (the CLI refuses a quantised one).
  c.quantize = m_lora->isChecked() ? m_quantize->currentData().toString() : QString("auto");
  c.skipBadLines = m_skipBadLines->isChecked();
  c.dataPath = m_dataPath->text().trimmed();
  c.dataFormat = m_dataFormat->currentText();
  c.objective = m_objective->currentData().toString();
  c.beta = m_beta->value();
  c.trainOnEverything = m_trainOnEverything->isChecked() && c.objective == "sft";
  c.validationSplit = m_validationSplit->value();
  c.seqLen = m_seqLen->value();
  c.method = m_lora->isChecked() ? "lora" : "full";
  c.loraRank = m_rank->value();
  c.loraAlpha = m_alpha->value();
  c.loraDropout = m_loraDropout->value();
  c.rslora = m_rslora->isChecked();
  c.loraTargets.clear();
  for (QCheckBox* t : m_targets)
    if (t->isChecked()) c.loraTargets << t->text();
  // all-linear covers the attention everywhere; the MLP names stay (on GPT-OSS all-linear does
  // not reach the experts) and so does the router, which all-linear never adapts.
  if (c.loraTargets.contains("all-linear"))
    for (const char* t : {"q_proj", "k_proj", "v_proj", "o_proj"})
      c.loraTargets.removeAll(t);
  c.steps = m_steps->value();
  c.epochs = m_epochs->value();
  c.batchRows = m_batchRows->value();
  c.gradAccum = m_gradAccum->value();
  c.lr = m_lr->text().toDouble();
  c.schedule = m_schedule->currentText();
  c.warmupSteps = m_warmup->value();
  c.checkpointEvery = m_checkpointEvery->value();
  c.evalEvery = m_evalEvery->value();
  c.sampleEvery = m_sampleEvery->value();
  for (const QString& p : m_prompts->toPlainText().split('\n', Qt::SkipEmptyParts))
    if (!p.trimmed().isEmpty()) c.prompts << p.trimmed();
  c.simDevices = m_simDevices->value();
  c.memoryCap = m_memoryCap->text().trimmed();
  c.hostMemory = m_hostMemory->text().trimmed();
  c.offloadDir = m_nvmeDir->text().trimmed();
  c.advanced = m_advanced->changed();
  c.runDir = QDir::cleanPath(m_runDir->text().trimmed());
  return c;
}

bool SetupWizard::setSetting(const QString& key, const QString& value) {
  const auto combo = [&](QComboBox* c, int at) {
    if (at < 0) return false;
    c->setCurrentIndex(at);
    return true;
  };
  const auto number = [&](QSpinBox* s) {
    bool ok = false;
    const int v = value.toInt(&ok);
    if (ok) s->setValue(v);
    return ok;
  };
  if (key == "model.quantize") return combo(m_quantize, m_quantize->findData(value));
  if (key == "model.dtype") return combo(m_dtype, m_dtype->findText(value));
  if (key == "training.method") {
    (value == "full" ? m_full : m_lora)->setChecked(true);
    return value == "full" || value == "lora";
  }
  if (key == "training.objective") return combo(m_objective, m_objective->findData(value));
  if (key == "training.batch_rows") return number(m_batchRows);
  if (key == "training.grad_accum") return number(m_gradAccum);
  if (key == "data.seq_len") return number(m_seqLen);
  if (key == "training.steps") return number(m_steps);
  if (key == "training.epochs") {
    bool ok = false;
    const double v = value.toDouble(&ok);
    if (ok) m_epochs->setValue(v);
    return ok;
  }
  for (auto [k, line] : {std::pair{"hardware.offload_dir", m_nvmeDir},
                         std::pair{"hardware.host_memory", m_hostMemory},
                         std::pair{"hardware.memory_cap", m_memoryCap}})
    if (key == k) {
      line->setText(value);
      return true;
    }
  return m_advanced->load() && m_advanced->setValue(key, value);
}

void SetupWizard::applyFix() {
  // A copy: setting a field may run the CLI (the Advanced page's list) in a nested event loop.
  const QJsonObject set = m_fixSet;
  QStringList unset;
  for (auto it = set.begin(); it != set.end(); ++it)
    if (!setSetting(it.key(), it.value().toString())) unset << it.key();
  refreshReview();
  if (!unset.isEmpty())
    m_problems->setText(m_problems->text() + "\n• The wizard has no field for " + unset.join(", ") +
                        "; set it in a saved config (Save config…)");
  if (auto* p = static_cast<HookPage*>(page(ReviewPage))) p->changed();
}

QString SetupWizard::configPath() const {
  return QDir::cleanPath(m_runDir->text().trimmed()) + ".toml";
}

QString SetupWizard::commandLine() const {
  return RondoCli::program() + " train " + configPath();
}

void SetupWizard::refreshModel() {
  if (m_busy) return;
  m_busy = true;
  const auto done = qScopeGuard([this] { m_busy = false; });
  const QString path = m_modelPath->text().trimmed();
  m_modelOk = false;
  if (path.isEmpty()) {
    m_modelInfo->setText("Pick a model to see its family, size and dtype.");
  } else {
    QString error;
    QJsonObject j = RondoCli::runJson({"inspect", path, "--json"}, &error);
    if (j.isEmpty()) {
      m_modelInfo->setText("<span style='color:#b00020'>" + error.toHtmlEscaped() + "</span>");
    } else {
      m_modelOk = true;
      const double params = j["params"].toDouble();
      m_modelInfo->setText(
          QString("<b>%1</b> (%2): %3 M parameters, %4 layers, hidden %5, vocabulary %6; stored "
                  "as %7 (%8)")
              .arg(j["family"].toString(), j["architecture"].toString())
              .arg(params / 1e6, 0, 'f', 1)
              .arg(j["num_layers"].toInt())
              .arg(j["hidden_size"].toInt())
              .arg(j["vocab_size"].toInt())
              .arg(j["dtypes"].toString(), j["format"].toString()));
    }
  }
  if (auto* p = static_cast<HookPage*>(page(ModelPage))) p->changed();
}

void SetupWizard::refreshData() {
  if (m_busy) return;
  m_busy = true;
  const auto done = qScopeGuard([this] { m_busy = false; });
  const QString file = m_dataPath->text().trimmed();
  m_dataOk = false;
  m_dataPreview->clear();
  const QString objective = m_objective->currentData().toString();
  const bool pairs = objective != "sft";
  if (file.isEmpty() || m_modelPath->text().trimmed().isEmpty()) {
    m_dataStats->setText("Pick a file to see its format and token statistics.");
  } else {
    // The first lines are enough to show the format and an example; a large file would keep
    // the page waiting (the run itself reads them all).
    QStringList args = {"data",        file,
                        "--model",     m_modelPath->text().trimmed(),
                        "--format",    m_dataFormat->currentText(),
                        "--max-lines", QString::number(kPreviewLines),
                        "--json"};
    if (m_trainOnEverything->isChecked() && !pairs) args << "--train-on-everything";
    if (pairs) {
      // Tokens per sequence as the run will cut them: preference.max_length, or half a row.
      qint64 maxLength = std::max(2, m_seqLen->value() / 2);
      for (const auto& [key, value] : m_advanced->changed())
        if (key == "preference.max_length" && value.toLongLong() > 0)
          maxLength = value.toLongLong();
      args << "--objective" << objective << "--max-length" << QString::number(maxLength);
    }
    QString error;
    QJsonObject j = RondoCli::runJson(args, &error);
    if (j.isEmpty()) {
      m_dataStats->setText("<span style='color:#b00020'>" + error.toHtmlEscaped() + "</span>");
    } else {
      m_dataOk = true;
      m_dataStats->setText(
          "<b>" + j["format"].toString() + "</b>: " + j["stats"].toString().toHtmlEscaped() +
          (j["partial"].toBool()
               ? QString(" (the first %1 lines; the run reads them all)").arg(kPreviewLines)
               : QString()));
      // A pair shows its two sequences one after the other, each with its token count.
      const QJsonObject example = j["example"].toObject();
      const qint64 chosen = example["chosen_tokens"].toInteger();
      QString html = "<pre style='white-space:pre-wrap'>";
      if (chosen > 0) html += QString("<b>Chosen</b> (%1 tokens)\n").arg(chosen);
      bool rejected = false;
      for (const QJsonValue& v : example["pieces"].toArray()) {
        const QJsonObject p = v.toObject();
        if (p["rejected"].toBool() && !rejected) {
          rejected = true;
          html += QString("\n\n<b>Rejected</b> (%1 tokens)\n")
                      .arg(example["tokens"].toInteger() - chosen);
        }
        html += QString("<span style='color:%1'>%2</span>")
                    .arg(!p["trained"].toBool() ? "#8a8a8a"
                         : rejected             ? "#b00020"
                                                : "#1b7f3b",
                         p["text"].toString().toHtmlEscaped());
      }
      m_dataPreview->setHtml(html + "</pre>");
      // Unless the user set them: some examples held out for a validation loss (a tenth of a
      // small set, about a hundred of a large one), and the first example's prompt for samples.
      const double examples = j["partial"].toBool()
                                  ? estimatedExamples(file, j["examples"].toDouble())
                                  : j["examples"].toDouble();
      setDefault(m_validationSplit,
                 examples < kValidatedExamples ? 0.0 : std::clamp(100 / examples, 0.001, 0.1));
      setDefault(m_prompts, j["first_prompt"].toString());
    }
  }
  if (auto* p = static_cast<HookPage*>(page(DataPage))) p->changed();
}

void SetupWizard::refreshDevices() {
  if (m_busy) return;
  m_busy = true;
  const auto done = qScopeGuard([this] { m_busy = false; });
  m_devices->clear();
  QString error;
  QStringList args = {"devices", "--json"};
  if (m_simDevices->value() > 0) args << "--sim" << QString::number(m_simDevices->value());
  QJsonObject j = RondoCli::runJson(args, &error);
  if (j.isEmpty()) {
    m_devices->addItem("Could not list devices: " + error);
    return;
  }
  for (const QJsonValue& v : j["devices"].toArray()) {
    const QJsonObject d = v.toObject();
    m_devices->addItem(
        QString("%1 — %2").arg(d["name"].toString(), bytesText(d["bytes_cap"].toDouble())));
  }
  if (j["mode"].toString() == "sim")
    m_devices->addItem(
        QString("%1 simulated on the CPU (Simulated GPUs)").arg(m_simDevices->value()));
  else if (j["mode"].toString() != "cuda")
    m_devices->addItem("No CUDA GPU: " + j["why_no_gpu"].toString());
}

bool SetupWizard::start(QString* error) {
  const WizardConfig c = config();
  const QString path = configPath();
  QDir().mkpath(QFileInfo(path).absolutePath());
  QSaveFile out(path);
  if (!out.open(QIODevice::WriteOnly) || out.write(c.toToml().toUtf8()) < 0 || !out.commit()) {
    if (error) *error = "cannot write " + path + ": " + out.errorString();
    return false;
  }
  emit startRequested(path, c.runDir);
  return true;
}

void SetupWizard::accept() {
  QString error;
  if (!start(&error)) {
    m_problems->setText("<span style='color:#b00020'>" + error.toHtmlEscaped() + "</span>");
    return;
  }
  QWizard::accept();
}

}  // namespace rondo::gui
