// rondo-gui's window: the setup wizard, then the monitor of the run it starts; or the monitor of
// a run folder opened from the File menu or the command line (live or finished, started here or
// headless elsewhere).
#pragma once

#include <QMainWindow>

class QStackedWidget;

namespace rondo::gui {

class MonitorWidget;
class RunsDialog;
class SetupWizard;

class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(QWidget* parent = nullptr);
  SetupWizard* wizard() const { return m_wizard; }
  MonitorWidget* monitor() const { return m_monitor; }
  bool openRun(const QString& dir, QString* error = nullptr);
  void showWizard();
  // The Runs window (File ▸ Runs…): the runs under ./runs and those opened lately; opening one
  // shows it in the monitor.
  RunsDialog* showRuns();
  // Closing while a run goes, once the user said yes: asks the run to stop and save, and closes
  // the window when it has ended (the window stays, saying so, until then).
  void closeAfterStopping();
  bool closing() const { return m_closing; }

 protected:
  void closeEvent(QCloseEvent* event) override;

 private:
  QStackedWidget* m_stack;
  SetupWizard* m_wizard;
  MonitorWidget* m_monitor;
  bool m_closing = false;
};

}  // namespace rondo::gui
