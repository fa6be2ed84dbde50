// The monitor: a run's loss and validation loss, learning rate, gradient norm and tokens/s charts,
// ETA, per-device memory, busy share and link traffic, the pipeline timeline, sample generations
// and a log — from the run's events.jsonl (gui/model), live or finished; a Chat tab that talks to
// the run's trained weights, and Export (a run that is not training). It can also launch
// `rondo train` as a child process and stop it (Stop: at once; Stop and save: the CLI finishes
// the step and writes a checkpoint). A failed child shows the `error` event and the last log lines.
#pragma once

#include <QPointer>
#include <QProcess>
#include <QString>
#include <QWidget>
#include <vector>

class QLabel;
class QListView;
class QProgressBar;
class QPushButton;
class QTableWidget;
class QTabWidget;
class QTimer;
class QChart;
class QChartView;
class QLineSeries;

namespace rondo::gui {

class ChatPanel;
class EventTail;
class RunState;
class TimelineView;

class MonitorWidget : public QWidget {
  Q_OBJECT
 public:
  explicit MonitorWidget(QWidget* parent = nullptr);
  ~MonitorWidget() override;

  // Follows a run folder (live or finished). False, with what is wrong, if it is not a run.
  bool attach(const QString& runDir, QString* error = nullptr);
  // Starts `rondo train <configPath>` and follows `runDir`. `extraArgs` are added to the command.
  bool launch(const QString& configPath, const QString& runDir, QString* error = nullptr,
              const QStringList& extraArgs = {});

  RunState* state() const { return m_state; }
  QLineSeries* lossSeries() const { return m_loss; }
  QLineSeries* evalSeries() const { return m_eval; }
  // A preference run's charts (hidden for a supervised one): reward margin, and accuracy.
  QChartView* marginView() const { return m_marginView; }
  QChartView* accuracyView() const { return m_accuracyView; }
  QLineSeries* marginSeries() const { return m_margin; }
  QLineSeries* accuracySeries() const { return m_accuracy; }
  TimelineView* timelineView() const { return m_timeline; }
  ChatPanel* chatPanel() const { return m_chat; }
  QString statusText() const;
  bool childRunning() const;
  void refresh();  // charts and labels now (normally at most every 250 ms)

 public slots:
  void stop();         // as stopAndSave; a second time, the CLI ends at once (no checkpoint)
  void stopAndSave();  // SIGINT: the CLI finishes the steps under way, checkpoints and exits
  void exportRun();    // the export dialog, for a run that is not training

 signals:
  void finished(const QString& status);  // the run ended (run_end read, or the child exited)

 private:
  void onChildFinished(int code, QProcess::ExitStatus status);
  void tryOpenEvents();
  void scheduleRefresh();
  // Data parallel: a Ranks tab, one row per rank, the ranks other than 0 read from their own
  // events (<run>/ranks/rank-r/events.jsonl, docs/distributed.md).
  void refreshRanks();
  void closeRanks();

  RunState* m_state;
  EventTail* m_tail;
  QString m_runDir, m_eventsPath;
  bool m_childFailed = false;  // the child exited with an error (maybe before any event)
  bool m_stopAsked = false;    // SIGINT sent once: the next Stop ends the child at once
  QProcess* m_child = nullptr;
  QTimer* m_openTimer;
  QTimer* m_refreshTimer;
  QLabel* m_title;
  QLabel* m_status;
  QLabel* m_banner;
  QProgressBar* m_progress;
  QPushButton* m_stop;
  QPushButton* m_stopSave;
  QPushButton* m_export;
  ChatPanel* m_chat;
  QChart* m_lossChart;
  QChart* m_lrChart;
  QChart* m_normChart;
  QChart* m_speedChart;
  QLineSeries* m_loss;
  QLineSeries* m_eval;
  QLineSeries* m_lr;
  QLineSeries* m_norm;
  QLineSeries* m_speed;
  QChart* m_marginChart;
  QChart* m_accuracyChart;
  QChartView* m_marginView;
  QChartView* m_accuracyView;
  QLineSeries *m_margin, *m_evalMargin, *m_accuracy, *m_evalAccuracy;
  QTableWidget* m_devices;
  QTableWidget* m_ranks;
  QTabWidget* m_tabs;
  std::vector<RunState*> m_rankStates;  // ranks 1, 2, ...
  std::vector<EventTail*> m_rankTails;
  TimelineView* m_timeline;
  QListView* m_samples;
  QListView* m_log;
};

}  // namespace rondo::gui
