// Reads a run's events.jsonl into a RunState: everything there at open() in one go (the file is
// mapped, so a finished 100,000-step run loads in a fraction of a second), then what is appended,
// polled every 200 ms while following. Used by the monitor, for live runs and finished ones.
//
//   EventTail tail(&state);
//   if (!tail.open(info.eventsPath, &error)) showError(error);
//   ...  // when the rondo process has exited: tail.finish(); if it died, state.markInterrupted()
#pragma once

#include <QFile>
#include <QObject>
#include <QString>
#include <QTimer>

namespace rondo::gui {

class RunState;

class EventTail : public QObject {
  Q_OBJECT
 public:
  static constexpr int kPollMs = 200;

  explicit EventTail(RunState* state, QObject* parent = nullptr);

  // Resets the state, reads what the file holds now, then follows it (setFollowing(true)).
  // False, with the reason in *error, when the file cannot be opened or read.
  bool open(const QString& path, QString* error = nullptr);
  // Reads what was appended since the last read. A file that shrank (replaced by a new run) is
  // read again from the start into a reset state.
  void poll();
  void setFollowing(bool on);
  bool isFollowing() const { return m_timer.isActive(); }
  // The writer is done: reads the rest, parses a last line without '\n', stops following.
  void finish();
  void close();

  QString path() const { return m_file.fileName(); }
  bool isOpen() const { return m_file.isOpen(); }
  qint64 bytesRead() const { return m_offset; }

 private:
  bool readFrom(qint64 size, bool mapped, QString* error);

  RunState* m_state;
  QFile m_file;
  qint64 m_offset = 0;
  QTimer m_timer;
};

}  // namespace rondo::gui
