#include "gui/app/main_window.h"

#include <QCloseEvent>
#include <QDir>
#include <QFileDialog>
#include <QMenuBar>
#include <QMessageBox>
#include <QStackedWidget>
#include <QStatusBar>

#include "gui/app/monitor.h"
#include "gui/app/runs_dialog.h"
#include "gui/app/wizard.h"
#include "gui/model/run_state.h"

namespace rondo::gui {

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent) {
  setWindowTitle("Rondo");
  resize(1100, 860);
  m_stack = new QStackedWidget;
  m_wizard = new SetupWizard;
  m_wizard->setWindowFlags(Qt::Widget);
  m_monitor = new MonitorWidget;
  m_stack->addWidget(m_wizard);
  m_stack->addWidget(m_monitor);
  setCentralWidget(m_stack);

  QMenu* file = menuBar()->addMenu("&File");
  file->addAction("&New run…", this, &MainWindow::showWizard);
  file->addAction("&Open run folder…", this, [this] {
    const QString dir = QFileDialog::getExistingDirectory(this, "Open a run folder");
    if (dir.isEmpty()) return;
    QString error;
    if (!openRun(dir, &error)) QMessageBox::warning(this, "Not a run folder", error);
  });
  file->addAction("&Resume a stopped run…", this, [this] {
    const QString dir = QFileDialog::getExistingDirectory(this, "Resume a run folder");
    if (dir.isEmpty()) return;
    m_stack->setCurrentWidget(m_monitor);
    QString error;
    if (!m_monitor->launch({}, dir, &error))
      QMessageBox::critical(this, "Cannot resume", error);
    else
      addRecentRun(dir);
  });
  file->addAction("R&uns…", QKeySequence("Ctrl+R"), this, [this] { showRuns(); });
  file->addSeparator();
  file->addAction("&Quit", this, &QWidget::close);

  connect(m_wizard, &SetupWizard::startRequested, this,
          [this](const QString& config, const QString& runDir) {
            m_stack->setCurrentWidget(m_monitor);
            QString error;
            if (!m_monitor->launch(config, runDir, &error))
              QMessageBox::critical(this, "Cannot start the run", error);
            else
              addRecentRun(runDir);
          });
  connect(m_wizard, &QWizard::rejected, this, [this] {
    if (m_monitor->childRunning() || !m_monitor->state()->runDir().isEmpty())
      m_stack->setCurrentWidget(m_monitor);
  });
  connect(m_monitor, &MonitorWidget::finished, this,
          [this](const QString& status) { statusBar()->showMessage("Run " + status); });
}

bool MainWindow::openRun(const QString& dir, QString* error) {
  if (!m_monitor->attach(dir, error)) return false;
  addRecentRun(dir);
  m_stack->setCurrentWidget(m_monitor);
  return true;
}

void MainWindow::closeEvent(QCloseEvent* event) {
  if (m_monitor->childRunning()) {
    event->ignore();
    if (m_closing) {  // closed again while the checkpoint is being written
      const auto answer = QMessageBox::question(
          this, "Writing a checkpoint",
          "The run is finishing its step and writing a checkpoint; the window closes when it is "
          "done. Stop it now instead? (The steps since the last checkpoint are lost.)",
          QMessageBox::Yes | QMessageBox::No, QMessageBox::No);
      if (answer == QMessageBox::Yes) m_monitor->stop();  // the second request: it ends at once
      return;
    }
    const auto answer = QMessageBox::question(
        this, "A run is going",
        "Stop the run and save a checkpoint before closing? It can be resumed later from the "
        "File menu (Resume a stopped run).",
        QMessageBox::Yes | QMessageBox::Cancel, QMessageBox::Yes);
    if (answer == QMessageBox::Yes) closeAfterStopping();
    return;
  }
  event->accept();
}

void MainWindow::closeAfterStopping() {
  if (m_closing || !m_monitor->childRunning()) return;
  m_closing = true;
  m_stack->setCurrentWidget(m_monitor);
  statusBar()->showMessage(
      "Stopping: finishing the steps under way and writing a checkpoint; the window closes when "
      "it is saved");
  connect(m_monitor, &MonitorWidget::finished, this, &QWidget::close, Qt::SingleShotConnection);
  m_monitor->stopAndSave();
}

RunsDialog* MainWindow::showRuns() {
  auto* runs = new RunsDialog({QDir::current().filePath("runs")}, recentRuns(), this);
  runs->setAttribute(Qt::WA_DeleteOnClose);
  connect(runs, &RunsDialog::openRequested, this, [this, runs](const QString& dir) {
    QString error;
    if (!openRun(dir, &error))
      QMessageBox::warning(this, "Cannot open the run", error);
    else
      runs->close();
  });
  runs->show();
  return runs;
}

void MainWindow::showWizard() {
  m_wizard->restart();
  m_stack->setCurrentWidget(m_wizard);
}

}  // namespace rondo::gui
