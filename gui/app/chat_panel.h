// The monitor's Chat tab: talks to a run's trained weights through `rondo chat RUN --jsonl` (its
// newest checkpoint), started on the first message and kept across turns, so the conversation
// carries over; replies stream in as they are generated. Reset clears the conversation. A chat
// that cannot start (no checkpoint yet) says why in the tab.
#pragma once

#include <QProcess>
#include <QString>
#include <QStringList>
#include <QVector>
#include <QWidget>

class QLabel;
class QLineEdit;
class QPushButton;
class QTextBrowser;

namespace rondo::gui {

class ChatPanel : public QWidget {
  Q_OBJECT
 public:
  explicit ChatPanel(QWidget* parent = nullptr);
  ~ChatPanel() override;

  // The run to talk to; ends a chat with another run (its conversation is kept on screen).
  void setRun(const QString& runDir);
  // Sends a message (or a /command), starting the chat first if it is not running.
  void send(const QString& text);
  void reset();
  QString transcript() const;  // the conversation as plain text, "You: ..." / "Model: ..."
  QString statusText() const;
  bool chatting() const;
  qint64 processId() const { return m_proc ? m_proc->processId() : 0; }  // 0: no chat

 signals:
  void replied(const QString& text);  // a whole reply
  void failed(const QString& why);    // the chat could not start or ended with an error

 private:
  struct Entry {
    QString who;  // "you", "model", "note", "error"
    QString text;
    bool open = false;  // a reply still streaming
  };
  void start();
  void readOutput();
  void onFinished(int code, QProcess::ExitStatus status);
  void write(const QString& text);
  void render();

  QString m_run;
  QProcess* m_proc = nullptr;
  bool m_ready = false;
  QStringList m_pending;  // sent before the model was loaded
  QByteArray m_stderr;
  QVector<Entry> m_entries;
  QTextBrowser* m_view;
  QLineEdit* m_input;
  QPushButton* m_send;
  QPushButton* m_reset;
  QLabel* m_status;
};

}  // namespace rondo::gui
