// Run history: what a run folder holds at a glance (model, method, status, steps, last losses,
// when it started and ended, its resolved config), the runs under a folder, and what differs
// between two runs' configs. Read from the folder's config.toml and the head and tail of its
// events.jsonl (a long run's file is not read whole), and from whether `rondo train` holds its
// lock: a run with no run_end whose lock no trainer holds was killed ("interrupted"), one whose
// lock a trainer holds is "running". Used by the GUI's Runs window.
//
//   for (const RunSummary& r : findRuns({"runs"}, recent)) table.add(r.dir, r.status, ...);
//   QList<ConfigDifference> d = configDifferences(a.config, b.config);
#pragma once

#include <QDateTime>
#include <QList>
#include <QMap>
#include <QString>
#include <QStringList>
#include <limits>

namespace rondo::gui {

struct RunSummary {
  QString dir;  // absolute
  QString model, method;
  // completed, stopped, interrupted, failed (from run_end); running (its lock is held);
  // interrupted (no run_end and nobody holds the lock: killed); not started (no events yet)
  QString status;
  qint64 stepsDone = 0, stepsTotal = 0;
  double lastLoss = std::numeric_limits<double>::quiet_NaN();
  double lastEvalLoss = std::numeric_limits<double>::quiet_NaN();
  QDateTime started, ended;       // the first run_start's and the last event's wall clock (UTC)
  QMap<QString, QString> config;  // "training.lr" -> "0.0002", as config.toml writes it
};

// Reads one run folder; a folder that is not a run gives status "" (see inspectRunFolder).
RunSummary summarizeRun(const QString& dir);

// The runs in `roots` (each root's sub-folders that are runs, and a root that is itself a run)
// and the folders in `extra` (recently opened ones), each once, most recently active first.
QList<RunSummary> findRuns(const QStringList& roots, const QStringList& extra = {});

struct ConfigDifference {
  QString key, a, b;  // "" where a config lacks the key
};
// The keys whose values differ, in key order; output.run_dir left out (it always differs).
QList<ConfigDifference> configDifferences(const QMap<QString, QString>& a,
                                          const QMap<QString, QString>& b);

}  // namespace rondo::gui
