// The rondo CLI as the GUI runs it: where the binary is, and short synchronous calls whose JSON
// the wizard shows (inspect, data, devices, plan). Training runs are launched by the monitor.
#pragma once

#include <QByteArray>
#include <QJsonObject>
#include <QString>
#include <QStringList>

namespace rondo::gui {

struct CliResult {
  int exitCode = -1;  // -1: did not start or timed out
  QByteArray out, err;
  QString error;  // when it failed: the last line rondo printed, or why it did not run
  bool ok() const { return exitCode == 0; }
};

class RondoCli {
 public:
  // $RONDO_BIN, else `rondo` next to rondo-gui or in ../cli (the build tree), else from PATH.
  static QString program();
  static CliResult run(const QStringList& args, int timeoutMs = 120000);
  // run() and parse stdout as one JSON object; on failure `error` says why.
  static QJsonObject runJson(const QStringList& args, QString* error, int timeoutMs = 120000);
};

}  // namespace rondo::gui
