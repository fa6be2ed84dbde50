// Everything the monitor shows about one run, built from its event stream (docs/events.md) as
// the bytes arrive. Every step is kept (charts decimate on read); spans and device events are
// parsed only for what is kept, which is what lets a 100,000-step run load in a fraction of a
// second. Fed by EventTail; read by the rondo-gui monitor.
//
//   RunState state;
//   QObject::connect(&state, &RunState::changed, chart, &Chart::refresh);
//   state.feed(bytes);  // any split, even mid-line
#pragma once

#include <QByteArray>
#include <QByteArrayView>
#include <QList>
#include <QMap>
#include <QObject>
#include <QString>
#include <string_view>
#include <utility>
#include <vector>

#include "gui/model/item_models.h"
#include "gui/model/json_line.h"
#include "gui/model/series.h"

namespace rondo::gui {

// The schedule a plan describes ("F[0,15) F[15,31) T[31,32) B[25,31) B[0,25) M=4 stage", as in
// the plan event and `rondo plan --json`) in words, with its predicted step time (when positive);
// the description itself when it is not of that form.
QString scheduleInWords(const QString& plan, qint64 devices, double stepSeconds);

class RunState : public QObject {
  Q_OBJECT
 public:
  explicit RunState(QObject* parent = nullptr);

  void reset();  // forget everything

  // Bytes of events.jsonl as they arrive; a partial last line waits for the rest. Lines that are
  // not events of schema version 1 are skipped and counted (malformedLines, unknownVersionLines).
  void feed(QByteArrayView bytes);
  void finishInput();  // end of input: a final line without '\n' is parsed

  // "empty" (nothing yet), "running" (run_start, no run_end), "completed", "stopped", "failed"
  // (from run_end), "interrupted" (markInterrupted() on a running run: the process died, or a
  // finished file has no run_end). A later run_start (a resume) makes it "running" again.
  QString status() const { return m_status; }
  void markInterrupted();

  QString runDir() const { return m_runDir; }
  QString model() const { return m_model; }
  QString method() const { return m_method; }
  QString configToml() const { return m_configToml; }
  QString plan() const { return m_plan; }  // the plan in use (latest plan event)
  // Its predicted peak memory per device (bytes, by device index); empty before a plan event.
  QList<double> plannedPeaks() const { return m_plannedPeaks; }
  QString errorMessage() const { return m_errorMessage; }  // latest error event of this run
  QString exportPath() const { return m_exportPath; }

  qint64 stepsTotal() const { return m_stepsTotal; }
  qint64 lastStep() const { return m_lastStep; }  // 0 before the first step
  // Loading the model before the first step (`load` events): layers loaded and in all; loading()
  // while the latest run (or resume) has loaded some but not all and trained no step yet.
  qint64 layersLoaded() const { return m_layersLoaded; }
  qint64 layersTotal() const { return m_layersTotal; }
  bool loading() const {
    return m_status == QLatin1String("running") && m_layersTotal > 0 &&
           m_layersLoaded < m_layersTotal;
  }
  qint64 resumedFrom() const { return m_resumedFrom; }
  // Data parallel (docs/distributed.md): this stream's rank and how many ranks share the run, as
  // the latest run_start says (0 and 1 for one process; a resume may change them).
  int rank() const { return m_rank; }
  int ranks() const { return m_ranks; }

  // NaN when unknown. Elapsed adds up the segments of a resumed run.
  double lastLoss() const { return m_lastLoss; }
  double lastEvalLoss() const { return m_lastEvalLoss; }
  double lastLr() const { return m_lastLr; }
  double lastGradNorm() const { return m_lastGradNorm; }
  double tokensPerSecond() const { return m_tokensPerSecond; }
  double etaSeconds() const { return m_etaSeconds; }
  double elapsedSeconds() const;

  int malformedLines() const { return m_malformedLines; }
  // The first malformed line: where and what, e.g. `line 12: "step" of a step event must be an
  // integer`; empty when there is none.
  QString firstMalformed() const { return m_firstMalformed; }
  int unknownVersionLines() const { return m_unknownVersionLines; }
  qint64 linesRead() const { return m_linesRead; }  // complete lines, blank and bad ones included

  // x = step.
  const Series& loss() const { return m_loss; }
  const Series& evalLoss() const { return m_evalLoss; }
  const Series& lr() const { return m_lr; }
  const Series& gradNorm() const { return m_gradNorm; }
  const Series& throughput() const { return m_throughput; }  // tokens per second
  // A preference run's (docs/preference.md) reward margin (chosen minus rejected) and accuracy
  // (the share of pairs whose chosen answer has the higher reward), on the training steps and on
  // the validation pairs; empty for a supervised run.
  const Series& margin() const { return m_margin; }
  const Series& accuracy() const { return m_accuracy; }
  const Series& evalMargin() const { return m_evalMargin; }
  const Series& evalAccuracy() const { return m_evalAccuracy; }
  bool isPreference() const { return !m_margin.isEmpty() || !m_evalMargin.isEmpty(); }

  QList<DeviceStatus> devices() const { return m_devices.values(); }   // latest, by device index
  QList<CheckpointItem> checkpoints() const { return m_checkpoints; }  // by arrival

  TimelineModel* timeline() { return m_timeline; }
  SamplesModel* samples() { return m_samples; }
  LogModel* log() { return m_log; }

 signals:
  void changed();                        // after a feed() that changed something (once per feed)
  void runEnded(const QString& status);  // a run_end event was read
  void errorEvent(const QString& message);

 private:
  using Line = std::string_view;
  void processLine(Line line);
  void onRunStart();
  void onPlan();
  void onStep();
  void onEval();
  // Appends (x, y), replacing any points from x on; a NaN y (null or missing) as a gap, or not at
  // all unless `pointIfNaN`.
  static void put(Series& series, double x, double y, bool pointIfNaN = true);
  void putMetrics(Series& margin, Series& accuracy, double x);  // from the line's `metrics`
  void onSample();
  bool onDevice(Line line);
  bool onSpan(Line line);
  void onCheckpoint();
  void onLoad();
  void onRunEnd();
  void flushPending();
  void emitPending();
  QString schemaProblem(std::string_view type) const;  // empty when the fields fit the type
  void skipMalformed(const QString& what);

  JsonLine m_line;
  JsonLine m_scratch;    // flushPending()'s second parse of the kept spans and device events
  QByteArray m_partial;  // the start of a line whose '\n' has not arrived
  // Lines whose bytes are not in the caller's buffer (a completed partial line); the pending views
  // below may point into them until flushPending().
  std::vector<QByteArray> m_ownedLines;
  // Deferred within one feed(): spans and device events are parsed only for what is kept.
  std::vector<Line> m_pendingSpans;
  std::vector<std::pair<int, Line>> m_pendingDevices;  // the latest line per device
  QList<SampleItem> m_pendingSamples;
  QStringList m_pendingLog;
  enum class Signal { RunEnded, Error };
  std::vector<std::pair<Signal, QString>> m_pendingSignals;
  bool m_changed = false;

  QString m_status;
  QString m_runDir, m_model, m_method, m_configToml, m_plan, m_errorMessage, m_exportPath;
  QList<double> m_plannedPeaks;
  qint64 m_stepsTotal = 0, m_lastStep = 0, m_resumedFrom = 0;
  int m_rank = 0, m_ranks = 1;
  qint64 m_layersLoaded = 0, m_layersTotal = 0;
  int m_runStarts = 0;
  double m_lastLoss, m_lastEvalLoss, m_lastLr, m_lastGradNorm, m_tokensPerSecond, m_etaSeconds;
  double m_lastT;        // "t" of the latest event: the clock restarts with each run_start
  double m_elapsedBase;  // seconds of the segments before the latest run_start
  int m_malformedLines = 0, m_unknownVersionLines = 0;
  QString m_firstMalformed;
  qint64 m_linesRead = 0;
  Series m_loss, m_evalLoss, m_lr, m_gradNorm, m_throughput;
  Series m_margin, m_accuracy, m_evalMargin, m_evalAccuracy;
  QMap<int, DeviceStatus> m_devices;
  QList<CheckpointItem> m_checkpoints;
  TimelineModel* m_timeline;
  SamplesModel* m_samples;
  LogModel* m_log;
};

}  // namespace rondo::gui
