#include "gui/app/chat_panel.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <QCheckBox>
#include <QComboBox>
#include <QDir>
#include <QDoubleSpinBox>
#include <QFile>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QJsonArray>
#include <QJsonDocument>
#include <QJsonObject>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QRegularExpression>
#include <QScrollBar>
#include <QSpinBox>
#include <QSplitter>
#include <QTextBrowser>
#include <QVBoxLayout>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <functional>
#include <utility>

#include "gui/app/rondo_cli.h"

namespace rondo::gui {

namespace {

// The checkpoint choice lists the run's checkpoints again each time it opens: a run that is
// training writes new ones while the tab is open.
class CheckpointBox : public QComboBox {
 public:
  std::function<void()> beforePopup;
  void showPopup() override {
    if (beforePopup) beforePopup();
    QComboBox::showPopup();
  }
};

// A TOML basic string's text without its escapes (cli/config_file.cpp's quote()).
QString unescape(const QString& s) {
  QString out;
  for (qsizetype i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const QChar c = s[++i];
    if (c == 'n')
      out += '\n';
    else if (c == 't')
      out += '\t';
    else if (c == 'r')
      out += '\r';
    else if (c == 'u' && i + 4 < s.size()) {
      out += QChar(s.mid(i + 1, 4).toUShort(nullptr, 16));
      i += 4;
    } else
      out += c;
  }
  return out;
}

// A string setting of a run as rondo resolved it into <run>/config.toml: one `key = "value"` a
// line under its [section]; "" when absent (a run whose config is not written yet).
QString runSetting(const QString& run, const QString& section, const QString& key) {
  QFile f(QDir(run).filePath("config.toml"));
  if (!f.open(QIODevice::ReadOnly)) return "";
  static const QRegularExpression pair(R"re(^([A-Za-z0-9_]+)\s*=\s*"((?:[^"\\]|\\.)*)")re");
  QString current;
  for (const QString& raw : QString::fromUtf8(f.readAll()).split('\n')) {
    const QString line = raw.trimmed();
    if (line.startsWith('[')) {
      current = line.mid(1, line.indexOf(']') - 1).trimmed();
      continue;
    }
    if (current != section) continue;
    const QRegularExpressionMatch m = pair.match(line);
    if (m.hasMatch() && m.captured(1) == key) return unescape(m.captured(2));
  }
  return "";
}

// Whether `rondo train` holds the run folder: it flocks <run>/rondo.lock and writes "<pid> rondo
// train..." into it (engine/run_lock.cpp). `rondo chat RUN` then keeps off the GPUs, whose memory
// the run planned for itself; the base model's chat knows nothing of the run, so it is told to
// (--cpu).
bool trainingHolds(const QString& run) {
  const QByteArray path = QFile::encodeName(QDir(run).filePath("rondo.lock"));
  const int fd = ::open(path.constData(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  int rc;
  do {
    rc = ::flock(fd, LOCK_SH | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  const bool held = rc != 0 && errno == EWOULDBLOCK;
  char buf[256];
  const ssize_t n = held ? ::pread(fd, buf, sizeof buf, 0) : 0;
  ::close(fd);  // releases a shared lock taken at once
  return n > 0 && QByteArray(buf, n).contains(" rondo train");
}

QWidget* labelled(const QString& label, QWidget* field) {
  auto* box = new QWidget;
  auto* row = new QHBoxLayout(box);
  row->setContentsMargins(0, 0, 0, 0);
  row->addWidget(new QLabel(label));
  row->addWidget(field);
  return box;
}

}  // namespace

ChatPanel::ChatPanel(QWidget* parent) : QWidget(parent) {
  m_base.base = true;
  for (Side* s : {&m_tuned, &m_base}) {
    s->view = new QTextBrowser;
    s->title = new QLabel;
    s->title->setStyleSheet("font-weight: bold");
    s->column = new QWidget;
    auto* column = new QVBoxLayout(s->column);
    column->setContentsMargins(0, 0, 0, 0);
    column->addWidget(s->title);
    column->addWidget(s->view, 1);
  }
  m_tuned.view->setObjectName("chatTranscript");
  m_tuned.title->setObjectName("chatTunedTitle");
  m_base.view->setObjectName("chatBaseTranscript");
  m_base.title->setObjectName("chatBaseTitle");

  m_temperature = new QDoubleSpinBox;
  m_temperature->setObjectName("chatTemperature");
  m_temperature->setRange(0, 5);
  m_temperature->setDecimals(2);
  m_temperature->setSingleStep(0.1);
  m_temperature->setSpecialValueText("0 (greedy)");
  m_temperature->setToolTip(
      "0 always takes the most likely token (the same reply each time); higher samples more "
      "freely");
  m_topP = new QDoubleSpinBox;
  m_topP->setObjectName("chatTopP");
  m_topP->setRange(0.01, 1);
  m_topP->setDecimals(2);
  m_topP->setSingleStep(0.05);
  m_topP->setValue(1);
  m_topP->setToolTip("Samples among the most likely tokens holding this much probability");
  m_maxTokens = new QSpinBox;
  m_maxTokens->setObjectName("chatMaxTokens");
  m_maxTokens->setRange(1, 1 << 20);  // rondo chat's own bounds
  m_maxTokens->setValue(256);
  m_maxTokens->setToolTip("The most tokens of one reply");
  m_seed = new QSpinBox;
  m_seed->setObjectName("chatSeed");
  m_seed->setRange(0, INT_MAX);
  m_seed->setToolTip("The same seed and settings sample the same replies");
  auto* checkpoint = new CheckpointBox;
  checkpoint->beforePopup = [this] { refreshCheckpoints(); };
  m_checkpoint = checkpoint;
  m_checkpoint->setObjectName("chatCheckpoint");
  m_checkpoint->addItem("Newest", QString());
  m_checkpoint->setSizeAdjustPolicy(QComboBox::AdjustToContents);
  m_compare = new QCheckBox("Compare with the base model");
  m_compare->setObjectName("chatCompareBase");
  m_compare->setToolTip(
      "Each message goes also to the run's base model, untrained, with the same sampling; its "
      "replies are shown beside the tuned ones (a second model in memory)");

  m_input = new QLineEdit;
  m_input->setObjectName("chatInput");
  m_input->setPlaceholderText(
      "Message the trained model (Enter sends; /system TEXT sets a "
      "system message)");
  m_send = new QPushButton("Send");
  m_send->setObjectName("chatSend");
  m_reset = new QPushButton("New conversation");
  m_reset->setObjectName("chatReset");
  m_status = new QLabel("Talks to the run's newest checkpoint.");
  m_status->setObjectName("chatStatus");
  m_status->setWordWrap(true);
  connect(m_send, &QPushButton::clicked, this, [this] {
    const QString text = m_input->text();
    if (text.trimmed().isEmpty()) return;
    m_input->clear();
    send(text);
  });
  connect(m_input, &QLineEdit::returnPressed, m_send, &QPushButton::click);
  connect(m_reset, &QPushButton::clicked, this, &ChatPanel::reset);
  for (QDoubleSpinBox* b : {m_temperature, m_topP})
    connect(b, &QDoubleSpinBox::valueChanged, this, &ChatPanel::settingsChanged);
  for (QSpinBox* b : {m_maxTokens, m_seed})
    connect(b, &QSpinBox::valueChanged, this, &ChatPanel::settingsChanged);
  connect(m_checkpoint, &QComboBox::currentIndexChanged, this, &ChatPanel::settingsChanged);
  connect(m_compare, &QCheckBox::toggled, this, &ChatPanel::setComparing);

  // Two rows: all in one would be wider than the monitor at its narrowest (a sideways scroll bar
  // under its panes).
  auto* sampling = new QHBoxLayout;
  sampling->addWidget(labelled("Temperature", m_temperature));
  sampling->addWidget(labelled("Top-p", m_topP));
  sampling->addWidget(labelled("Max new tokens", m_maxTokens));
  sampling->addWidget(labelled("Seed", m_seed));
  sampling->addStretch(1);
  auto* weights = new QHBoxLayout;
  weights->addWidget(labelled("Checkpoint", m_checkpoint));
  weights->addWidget(m_compare);
  weights->addStretch(1);
  auto* views = new QSplitter(Qt::Horizontal);
  views->setChildrenCollapsible(false);
  views->addWidget(m_tuned.column);
  views->addWidget(m_base.column);
  auto* row = new QHBoxLayout;
  row->addWidget(m_input, 1);
  row->addWidget(m_send);
  row->addWidget(m_reset);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(sampling);
  layout->addLayout(weights);
  layout->addWidget(views, 1);
  layout->addLayout(row);
  layout->addWidget(m_status);
  setComparing(false);
  settingsChanged();
}

ChatPanel::~ChatPanel() {
  // The chats end at the end of their input; both are told before either is waited for.
  for (Side* s : {&m_tuned, &m_base})
    if (running(*s)) {
      s->proc->disconnect(this);
      s->proc->closeWriteChannel();
    }
  for (Side* s : {&m_tuned, &m_base})
    if (running(*s) && !s->proc->waitForFinished(3000)) s->proc->kill();
}

void ChatPanel::setRun(const QString& runDir) {
  if (runDir == m_run) return;
  stop(m_tuned);
  stop(m_base);
  m_run = runDir;
  readRunConfig();
  {
    const QSignalBlocker block(m_checkpoint);  // another run's checkpoints: newest again
    m_checkpoint->setCurrentIndex(0);
    refreshCheckpoints();
  }
  setIdleTitles();
  m_status->setText("Talks to the newest checkpoint of " + QDir::cleanPath(runDir) + ".");
}

void ChatPanel::readRunConfig() {
  m_baseModel = runSetting(m_run, "model", "path");
  m_chatFormat = runSetting(m_run, "data", "chat_format");
}

void ChatPanel::refreshCheckpoints() {
  QVector<QPair<qint64, QString>> found;
  static const QRegularExpression name("^step-(\\d+)$");
  const QStringList dirs =
      m_run.isEmpty() ? QStringList()
                      : QDir(m_run + "/checkpoints").entryList(QDir::Dirs | QDir::NoDotAndDotDot);
  for (const QString& d : dirs) {
    const QRegularExpressionMatch m = name.match(d);
    if (m.hasMatch()) found.push_back({m.captured(1).toLongLong(), d});
  }
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
  const QString chosen = m_checkpoint->currentData().toString();
  {
    const QSignalBlocker block(m_checkpoint);
    while (m_checkpoint->count() > 1)
      m_checkpoint->removeItem(1);
    for (const auto& f : found)
      m_checkpoint->addItem(f.second, f.second);
    m_checkpoint->setCurrentIndex(std::max(0, m_checkpoint->findData(chosen)));
  }
  if (m_checkpoint->currentData().toString() != chosen) {
    settingsChanged();
    m_status->setText(chosen + " is no longer in the run folder: the newest checkpoint is chosen.");
  }
}

bool ChatPanel::chatting() const {
  return running(m_tuned);
}

bool ChatPanel::running(const Side& s) {
  return s.proc && s.proc->state() != QProcess::NotRunning;
}

QString ChatPanel::statusText() const {
  return m_status->text();
}

QStringList ChatPanel::samplingArgs() const {
  return {"-n",      QString::number(m_maxTokens->value()),
          "-t",      QString::number(m_temperature->value()),
          "--top-p", QString::number(m_topP->value()),
          "--seed",  QString::number(m_seed->value())};
}

QStringList ChatPanel::settingsOf(const Side& s) const {
  const QString checkpoint = m_checkpoint->currentData().toString();
  if (s.base || checkpoint.isEmpty()) return samplingArgs();
  return samplingArgs() << "--checkpoint" << checkpoint;
}

QStringList ChatPanel::arguments() const {
  return QStringList{"chat", m_run, "--jsonl"} + settingsOf(m_tuned);
}

QStringList ChatPanel::baseArguments() const {
  QStringList a{"chat", m_baseModel, "--jsonl"};
  // The tuned chat renders with the run's chat format; the base must see the same prompt.
  if (!m_chatFormat.isEmpty()) a << "--chat-format" << m_chatFormat;
  if (trainingHolds(m_run)) a << "--cpu";
  return a + settingsOf(m_base);
}

QString ChatPanel::settingsSummary(const Side& s) const {
  QString text = m_temperature->value() > 0 ? QString("temperature %1, top-p %2, seed %3")
                                                  .arg(m_temperature->value())
                                                  .arg(m_topP->value())
                                                  .arg(m_seed->value())
                                            : QString("greedy");
  text += QString(", at most %1 new tokens").arg(m_maxTokens->value());
  const QString checkpoint = m_checkpoint->currentData().toString();
  if (!s.base) text += ", " + (checkpoint.isEmpty() ? "the newest checkpoint" : checkpoint);
  return text;
}

void ChatPanel::setIdleTitles() {
  if (!running(m_tuned)) {
    QString checkpoint = m_checkpoint->currentData().toString();
    m_tuned.name = "Tuned (" +
                   (checkpoint.isEmpty() ? "newest checkpoint" : checkpoint.replace('-', ' ')) +
                   ")";
    m_tuned.title->setText(m_tuned.name);
  }
  if (!running(m_base)) {
    m_base.name =
        m_baseModel.isEmpty() ? "Base" : "Base (" + QFileInfo(m_baseModel).fileName() + ")";
    m_base.title->setText(m_base.name);
    m_base.title->setToolTip(m_baseModel);
  }
}

void ChatPanel::settingsChanged() {
  // Top-p and the seed only steer sampling; greedy decoding has none.
  m_topP->setEnabled(m_temperature->value() > 0);
  m_seed->setEnabled(m_temperature->value() > 0);
  setIdleTitles();
  const bool restarts = (running(m_tuned) && m_tuned.settings != settingsOf(m_tuned)) ||
                        (running(m_base) && m_base.settings != settingsOf(m_base));
  if (restarts)
    m_status->setText(
        "New settings (" + settingsSummary(m_tuned) +
        ") apply from your next message, which restarts the chat: the conversation context "
        "restarts there (the turns above stay shown, but the model no longer sees them).");
  else if (chatting())
    m_status->setText("The chat goes on with its settings (" + settingsSummary(m_tuned) + ").");
}

void ChatPanel::setComparing(bool on) {
  m_base.column->setVisible(on);
  m_tuned.title->setVisible(on);  // one view alone needs no title
  if (!on) {
    stop(m_base);  // its model's memory back
    return;
  }
  readRunConfig();  // a run started from the GUI writes its config after setRun
  setIdleTitles();
  m_status->setText(m_baseModel.isEmpty()
                        ? "The run's base model is not known yet: its config.toml names none."
                        : "Each message goes also to the base model, " + m_baseModel +
                              ", with the same sampling.");
}

void ChatPanel::send(const QString& text) {
  if (m_run.isEmpty()) return;
  sendTo(m_tuned, text);
  if (!m_compare->isChecked()) return;
  if (m_baseModel.isEmpty()) readRunConfig();
  if (m_baseModel.isEmpty()) {
    m_base.entries.push_back({"error", "the run's config.toml names no base model ([model] path)"});
    render(m_base);
    return;
  }
  sendTo(m_base, text);
}

void ChatPanel::sendTo(Side& s, const QString& text) {
  if (running(s) && s.settings != settingsOf(s)) stop(s);  // new settings: a new chat with them
  const bool fresh = !running(s);
  // A new chat after earlier turns (new settings, compare turned on again, a chat that ended)
  // does not know them: the transcript says so where it starts.
  if (fresh && std::any_of(s.entries.begin(), s.entries.end(),
                           [](const Entry& e) { return e.who == "you"; }))
    s.entries.push_back({"note", "A new chat (" + settingsSummary(s) +
                                     "): the model does not see the turns above."});
  if (!text.startsWith('/')) s.entries.push_back({"you", text});
  render(s);
  if (fresh) start(s);
  if (s.ready)
    write(s, text);
  else if (running(s))
    s.pending << text;
}

void ChatPanel::reset() {
  for (Side* s : {&m_tuned, &m_base}) {
    s->entries.clear();
    s->title->setText(s->name);
    render(*s);
    if (running(*s) && s->ready) write(*s, "/reset");
  }
}

void ChatPanel::start(Side& s) {
  if (s.proc) s.proc->deleteLater();  // an earlier chat that ended
  QProcess* proc = s.proc = new QProcess(this);
  s.ready = false;
  s.stderrText.clear();
  s.pending.clear();
  s.settings = settingsOf(s);
  setIdleTitles();
  // Signals of a chat since replaced (stopped for new settings) are not this side's any more.
  Side* side = &s;
  connect(proc, &QProcess::readyReadStandardOutput, this, [this, side, proc] {
    if (side->proc == proc) readOutput(*side);
  });
  connect(proc, &QProcess::readyReadStandardError, this, [side, proc] {
    if (side->proc == proc) side->stderrText += proc->readAllStandardError();
  });
  connect(proc, &QProcess::finished, this,
          [this, side, proc](int code, QProcess::ExitStatus status) {
            if (side->proc == proc) onFinished(*side, code, status);
          });
  // A program that does not start emits no `finished`: the same ending, said so.
  connect(proc, &QProcess::errorOccurred, this, [this, side, proc](QProcess::ProcessError e) {
    if (e == QProcess::FailedToStart && side->proc == proc) {
      side->stderrText =
          ("cannot start " + RondoCli::program() + ": " + proc->errorString()).toUtf8();
      onFinished(*side, -1, QProcess::CrashExit);
    }
  });
  if (!s.base) m_status->setText("Loading the model and the checkpoint…");
  proc->start(RondoCli::program(), s.base ? baseArguments() : arguments());
}

void ChatPanel::stop(Side& s) {
  if (!s.proc) return;
  s.proc->disconnect(this);
  if (s.proc->state() != QProcess::NotRunning) {
    s.proc->kill();  // a chat holds nothing to save
    s.proc->waitForFinished(3000);
  }
  s.proc->deleteLater();
  s.proc = nullptr;
  s.ready = false;
  s.pending.clear();
  if (!s.entries.isEmpty()) s.entries.back().open = false;  // a reply cut short stays as it was
}

void ChatPanel::write(Side& s, const QString& text) {
  // One JSON string per line: newlines in a message stay in it.
  QByteArray line = QJsonDocument(QJsonArray{text}).toJson(QJsonDocument::Compact);
  line = line.mid(1, line.size() - 2) + '\n';
  s.proc->write(line);
  if (!text.startsWith('/') && !s.base) m_status->setText("The model is answering…");
}

void ChatPanel::readOutput(Side& s) {
  // A slot of replied() may replace the chat (setRun): then what is left is not ours to read.
  QProcess* proc = s.proc;
  while (s.proc == proc && proc->canReadLine()) {
    const QJsonObject o = QJsonDocument::fromJson(proc->readLine()).object();
    const QString type = o.value("type").toString(), text = o.value("text").toString();
    if (type == "ready") {
      s.ready = true;
      if (!s.base) {
        m_status->setText("Talking to " + QDir::cleanPath(text) + ".");
        // The checkpoint rondo chose ("newest" may fall back past a damaged one).
        const QRegularExpressionMatch step =
            QRegularExpression("step-(\\d+)/?$").match(QDir::cleanPath(text));
        if (step.hasMatch()) s.name = "Tuned (step " + step.captured(1) + ")";
        s.title->setText(s.name);
      }
      for (const QString& p : std::exchange(s.pending, {}))
        write(s, p);
    } else if (type == "token") {
      if (s.entries.isEmpty() || !s.entries.back().open) s.entries.push_back({"model", "", true});
      s.entries.back().text += text;
      render(s);
    } else if (type == "reply") {
      if (s.entries.isEmpty() || !s.entries.back().open) s.entries.push_back({"model", "", true});
      s.entries.back().text = text;
      s.entries.back().open = false;
      const QString took = QString("%1 s (%2 tokens)")
                               .arg(o.value("seconds").toDouble(), 0, 'f', 1)
                               .arg(o.value("tokens").toInt());
      s.title->setText(s.name + " — replied in " + took);
      render(s);
      if (s.base) {
        emit baseReplied(text);
      } else {
        m_status->setText("Replied in " + took + ".");
        emit replied(text);
      }
    } else if (type == "info" || type == "error") {
      s.entries.push_back({type == "info" ? "note" : "error", text});
      if (!s.base)
        m_status->setText(type == "info" ? text : "The model could not answer: " + text);
      else if (type == "error")
        m_status->setText("The base model could not answer: " + text);
      render(s);
    }
  }
}

void ChatPanel::onFinished(Side& s, int code, QProcess::ExitStatus status) {
  s.ready = false;
  if (status == QProcess::NormalExit && code == 0) {
    if (!s.base) m_status->setText("The chat ended.");
    return;
  }
  // What rondo said last (its error line), else how it ended.
  QString why;
  for (const QByteArray& l : s.stderrText.split('\n'))
    if (!l.trimmed().isEmpty()) why = QString::fromUtf8(l.trimmed());
  if (why.isEmpty())
    why = status == QProcess::CrashExit ? "rondo chat crashed"
                                        : QString("rondo chat exited with status %1").arg(code);
  s.entries.push_back({"error", why});
  s.pending.clear();
  m_status->setText(
      (s.base ? "The base model's chat could not go on: " : "The chat could not go on: ") + why);
  render(s);
  if (s.base)
    emit baseFailed(why);
  else
    emit failed(why);
}

QString ChatPanel::transcriptOf(const Side& s) {
  QStringList out;
  for (const Entry& e : s.entries) {
    const QString who = e.who == "you"     ? "You"
                        : e.who == "model" ? "Model"
                        : e.who == "note"  ? "Note"
                                           : "Error";
    out << who + ": " + e.text;
  }
  return out.join('\n');
}

QString ChatPanel::transcript() const {
  return transcriptOf(m_tuned);
}

QString ChatPanel::baseTranscript() const {
  return transcriptOf(m_base);
}

void ChatPanel::render(Side& s) {
  QString html;
  for (const Entry& e : s.entries) {
    const QString text = e.text.toHtmlEscaped().replace('\n', "<br>");
    if (e.who == "you")
      html += "<p style='margin:6px 0'><b>You:</b> " + text + "</p>";
    else if (e.who == "model")
      html += "<p style='margin:6px 0 12px 0; color:#0b3d6b'><b>Model:</b> " + text + "</p>";
    else if (e.who == "note")
      html += "<p style='color:#666'><i>" + text + "</i></p>";
    else
      html += "<p style='color:#8a0012'><b>Error:</b> " + text + "</p>";
  }
  s.view->setHtml(html);
  s.view->verticalScrollBar()->setValue(s.view->verticalScrollBar()->maximum());
}

}  // namespace rondo::gui
