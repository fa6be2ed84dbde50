// rondo-gui's window: the setup wizard, then the monitor of the run it starts; or the monitor of
// a run folder opened from the File menu or the command line (live or finished, started here or
// headless elsewhere).
#pragma once

#include <QMainWindow>

class QStackedWidget;

namespace rondo::gui {

class MonitorWidget;
class SetupWizard;

class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(QWidget* parent = nullptr);
  SetupWizard* wizard() const { return m_wizard; }
  MonitorWidget* monitor() const { return m_monitor; }
  bool openRun(const QString& dir, QString* error = nullptr);
  void showWizard();

 protected:
  void closeEvent(QCloseEvent* event) override;

 private:
  QStackedWidget* m_stack;
  SetupWizard* m_wizard;
  MonitorWidget* m_monitor;
};

}  // namespace rondo::gui
