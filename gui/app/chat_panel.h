// The monitor's Chat tab: talks to a run's trained weights through `rondo chat RUN --jsonl` (its
// newest checkpoint, or the one chosen), started on the first message and kept across turns, so
// the conversation carries over; replies stream in as they are generated. Reset clears the
// conversation. A chat that cannot start (no checkpoint yet) says why in the tab.
//
// Sampling (temperature, 0 = greedy; top-p; max new tokens; seed) is set above the transcript.
// `rondo chat --jsonl` takes its sampling as flags only, so a change applies from the next
// message by restarting the chat with the new flags: the transcript stays shown, the model's
// context starts anew (the status line and a note in the transcript say so).
//
// "Compare with the base model" sends each message also to a second `rondo chat BASE --jsonl`,
// BASE being the run's [model] path, with the same sampling flags, and shows its replies beside
// the tuned ones.
#pragma once

#include <QProcess>
#include <QString>
#include <QStringList>
#include <QVector>
#include <QWidget>

class QCheckBox;
class QComboBox;
class QDoubleSpinBox;
class QLabel;
class QLineEdit;
class QPushButton;
class QSpinBox;
class QTextBrowser;

namespace rondo::gui {

class ChatPanel : public QWidget {
  Q_OBJECT
 public:
  explicit ChatPanel(QWidget* parent = nullptr);
  ~ChatPanel() override;

  // The run to talk to; ends a chat with another run (its conversation is kept on screen).
  void setRun(const QString& runDir);
  // Sends a message (or a /command), starting the chat first if it is not running; with compare
  // on, to the base model too.
  void send(const QString& text);
  void reset();
  QString transcript() const;  // the conversation as plain text, "You: ..." / "Model: ..."
  QString statusText() const;
  bool chatting() const;
  qint64 processId() const { return m_tuned.proc ? m_tuned.proc->processId() : 0; }  // 0: no chat

  // The base model's side (compare on): the same, for the second chat.
  QString baseTranscript() const;
  qint64 baseProcessId() const { return m_base.proc ? m_base.proc->processId() : 0; }
  QString baseModel() const { return m_baseModel; }  // the run's [model] path; "" if unknown
  // What the next chats start with: rondo's arguments (sampling, checkpoint) as set now.
  QStringList arguments() const;
  QStringList baseArguments() const;
  // Lists the run's checkpoints again in the checkpoint choice (it also does when opened).
  void refreshCheckpoints();

 signals:
  void replied(const QString& text);      // a whole reply
  void failed(const QString& why);        // the chat could not start or ended with an error
  void baseReplied(const QString& text);  // the same, of the base model's chat
  void baseFailed(const QString& why);

 private:
  struct Entry {
    QString who;  // "you", "model", "note", "error"
    QString text;
    bool open = false;  // a reply still streaming
  };
  // One chat child and its transcript: the tuned run's, or the base model's.
  struct Side {
    bool base = false;
    QProcess* proc = nullptr;
    bool ready = false;
    QStringList pending;   // sent before the model was loaded
    QStringList settings;  // the sampling (and checkpoint) flags `proc` runs with
    QByteArray stderrText;
    QString name;  // its title: "Tuned (step 12)", "Base (model)"
    QVector<Entry> entries;
    QTextBrowser* view = nullptr;
    QLabel* title = nullptr;
    QWidget* column = nullptr;  // title and view
  };
  QStringList samplingArgs() const;
  QStringList settingsOf(const Side& s) const;
  QString settingsSummary(const Side& s) const;
  void readRunConfig();
  void setIdleTitles();
  void settingsChanged();
  void setComparing(bool on);
  void sendTo(Side& s, const QString& text);
  void start(Side& s);
  void stop(Side& s);
  static bool running(const Side& s);
  void readOutput(Side& s);
  void onFinished(Side& s, int code, QProcess::ExitStatus status);
  void write(Side& s, const QString& text);
  void render(Side& s);
  static QString transcriptOf(const Side& s);

  QString m_run;
  QString m_baseModel;   // the run's [model] path
  QString m_chatFormat;  // the run's [data] chat_format, which the base chat must render with too
  Side m_tuned, m_base;
  QLineEdit* m_input;
  QPushButton* m_send;
  QPushButton* m_reset;
  QDoubleSpinBox* m_temperature;
  QDoubleSpinBox* m_topP;
  QSpinBox* m_maxTokens;
  QSpinBox* m_seed;
  QComboBox* m_checkpoint;
  QCheckBox* m_compare;
  QLabel* m_status;
};

}  // namespace rondo::gui
