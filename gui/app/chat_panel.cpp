#include "gui/app/chat_panel.h"

#include <QDir>
#include <QHBoxLayout>
#include <QJsonArray>
#include <QJsonDocument>
#include <QJsonObject>
#include <QLabel>
#include <QLineEdit>
#include <QPushButton>
#include <QScrollBar>
#include <QTextBrowser>
#include <QVBoxLayout>

#include "gui/app/rondo_cli.h"

namespace rondo::gui {

ChatPanel::ChatPanel(QWidget* parent) : QWidget(parent) {
  m_view = new QTextBrowser;
  m_view->setObjectName("chatTranscript");
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
  auto* row = new QHBoxLayout;
  row->addWidget(m_input, 1);
  row->addWidget(m_send);
  row->addWidget(m_reset);
  auto* layout = new QVBoxLayout(this);
  layout->addWidget(m_view, 1);
  layout->addLayout(row);
  layout->addWidget(m_status);
}

ChatPanel::~ChatPanel() {
  if (m_proc && m_proc->state() != QProcess::NotRunning) {
    m_proc->disconnect(this);
    m_proc->closeWriteChannel();  // the chat ends at the end of its input
    if (!m_proc->waitForFinished(3000)) m_proc->kill();
  }
}

void ChatPanel::setRun(const QString& runDir) {
  if (runDir == m_run) return;
  if (m_proc) {
    m_proc->disconnect(this);
    m_proc->kill();
    m_proc->waitForFinished(3000);
    m_proc->deleteLater();
    m_proc = nullptr;
  }
  m_run = runDir;
  m_ready = false;
  m_pending.clear();
  m_status->setText("Talks to the newest checkpoint of " + QDir::cleanPath(runDir) + ".");
}

bool ChatPanel::chatting() const {
  return m_proc && m_proc->state() != QProcess::NotRunning;
}

QString ChatPanel::statusText() const {
  return m_status->text();
}

void ChatPanel::start() {
  if (m_proc) m_proc->deleteLater();  // an earlier chat that ended
  m_proc = new QProcess(this);
  m_ready = false;
  m_stderr.clear();
  connect(m_proc, &QProcess::readyReadStandardOutput, this, &ChatPanel::readOutput);
  connect(m_proc, &QProcess::readyReadStandardError, this,
          [this] { m_stderr += m_proc->readAllStandardError(); });
  connect(m_proc, &QProcess::finished, this, &ChatPanel::onFinished);
  // A program that does not start emits no `finished`: the same ending, said so.
  connect(m_proc, &QProcess::errorOccurred, this, [this](QProcess::ProcessError e) {
    if (e == QProcess::FailedToStart) {
      m_stderr = ("cannot start " + RondoCli::program() + ": " + m_proc->errorString()).toUtf8();
      onFinished(-1, QProcess::CrashExit);
    }
  });
  m_status->setText("Loading the model and the checkpoint…");
  m_proc->start(RondoCli::program(), {"chat", m_run, "--jsonl", "-n", "256"});
}

void ChatPanel::send(const QString& text) {
  if (m_run.isEmpty()) return;
  if (!text.startsWith('/')) m_entries.push_back({"you", text});
  render();
  if (!chatting()) start();
  if (m_ready)
    write(text);
  else
    m_pending << text;
}

void ChatPanel::reset() {
  m_entries.clear();
  render();
  if (chatting() && m_ready) write("/reset");
}

void ChatPanel::write(const QString& text) {
  // One JSON string per line: newlines in a message stay in it.
  QByteArray line = QJsonDocument(QJsonArray{text}).toJson(QJsonDocument::Compact);
  line = line.mid(1, line.size() - 2) + '\n';
  m_proc->write(line);
  if (!text.startsWith('/')) m_status->setText("The model is answering…");
}

void ChatPanel::readOutput() {
  while (m_proc->canReadLine()) {
    const QJsonObject o = QJsonDocument::fromJson(m_proc->readLine()).object();
    const QString type = o.value("type").toString(), text = o.value("text").toString();
    if (type == "ready") {
      m_ready = true;
      m_status->setText("Talking to " + QDir::cleanPath(text) + ".");
      for (const QString& p : std::exchange(m_pending, {}))
        write(p);
    } else if (type == "token") {
      if (m_entries.isEmpty() || !m_entries.back().open) m_entries.push_back({"model", "", true});
      m_entries.back().text += text;
      render();
    } else if (type == "reply") {
      if (m_entries.isEmpty() || !m_entries.back().open) m_entries.push_back({"model", "", true});
      m_entries.back().text = text;
      m_entries.back().open = false;
      m_status->setText(QString("Replied in %1 s (%2 tokens).")
                            .arg(o.value("seconds").toDouble(), 0, 'f', 1)
                            .arg(o.value("tokens").toInt()));
      render();
      emit replied(text);
    } else if (type == "info" || type == "error") {
      m_entries.push_back({type == "info" ? "note" : "error", text});
      m_status->setText(type == "info" ? text : "The model could not answer: " + text);
      render();
    }
  }
}

void ChatPanel::onFinished(int code, QProcess::ExitStatus status) {
  m_ready = false;
  if (status == QProcess::NormalExit && code == 0) {
    m_status->setText("The chat ended.");
    return;
  }
  // What rondo said last (its error line), else how it ended.
  QString why;
  for (const QByteArray& l : m_stderr.split('\n'))
    if (!l.trimmed().isEmpty()) why = QString::fromUtf8(l.trimmed());
  if (why.isEmpty())
    why = status == QProcess::CrashExit ? "rondo chat crashed"
                                        : QString("rondo chat exited with status %1").arg(code);
  m_entries.push_back({"error", why});
  m_pending.clear();
  m_status->setText("The chat could not go on: " + why);
  render();
  emit failed(why);
}

QString ChatPanel::transcript() const {
  QStringList out;
  for (const Entry& e : m_entries) {
    const QString& text = e.text;
    const QString who = e.who == "you"     ? "You"
                        : e.who == "model" ? "Model"
                        : e.who == "note"  ? "Note"
                                           : "Error";
    out << who + ": " + text;
  }
  return out.join('\n');
}

void ChatPanel::render() {
  QString html;
  for (const Entry& e : m_entries) {
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
  m_view->setHtml(html);
  m_view->verticalScrollBar()->setValue(m_view->verticalScrollBar()->maximum());
}

}  // namespace rondo::gui
