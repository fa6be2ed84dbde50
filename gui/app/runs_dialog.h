// The Runs window: every run under the runs folder and those opened lately, each with its model,
// method, status, steps, last losses and when it last did something (gui/model/run_history.h);
// Open shows one in the monitor; Compare, with two selected, lists what differs between their
// configs beside their results. Widgets tests use are named (runsTable, compareButton,
// differences).
#pragma once

#include <QDialog>
#include <QList>
#include <QStringList>

#include "gui/model/run_history.h"

class QLabel;
class QPushButton;
class QTableWidget;

namespace rondo::gui {

class RunsDialog : public QDialog {
  Q_OBJECT
 public:
  // `roots`: folders whose sub-folders are runs (runs/); `recent`: run folders opened lately.
  RunsDialog(QStringList roots, QStringList recent, QWidget* parent = nullptr);
  void refresh();
  const QList<RunSummary>& runs() const { return m_runs; }
  // Shows what differs between the two selected runs; false when not exactly two are selected.
  bool compareSelected();

 signals:
  void openRequested(const QString& runDir);

 private:
  QStringList m_roots, m_recent;
  QList<RunSummary> m_runs;
  QTableWidget* m_table;
  QTableWidget* m_differences;
  QLabel* m_summary;
  QPushButton* m_open;
  QPushButton* m_compare;
};

// The recently opened run folders (QSettings "recentRuns", newest first, at most 20); add() puts
// one first.
QStringList recentRuns();
void addRecentRun(const QString& dir);

}  // namespace rondo::gui
