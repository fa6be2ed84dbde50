// rondo-gui [RUN_FOLDER]: the setup wizard, or the monitor of a run folder (live or finished).
#include <QApplication>
#include <QCommandLineParser>
#include <QMessageBox>

#include "gui/app/main_window.h"

int main(int argc, char** argv) {
  QApplication app(argc, argv);
  QApplication::setApplicationName("rondo-gui");
  QApplication::setOrganizationName("rondo");  // where QSettings keeps the recent runs
  QCommandLineParser parser;
  parser.setApplicationDescription("Rondo: fine-tune large language models on the GPUs you own.");
  parser.addHelpOption();
  parser.addPositionalArgument("run", "A run folder to watch (live or finished)", "[run]");
  parser.process(app);
  rondo::gui::MainWindow window;
  if (!parser.positionalArguments().isEmpty()) {
    QString error;
    if (!window.openRun(parser.positionalArguments().first(), &error)) {
      QMessageBox::critical(nullptr, "Not a run folder", error);
      return 1;
    }
  }
  window.show();
  return app.exec();
}
