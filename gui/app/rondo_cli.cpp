#include "gui/app/rondo_cli.h"

#include <QCoreApplication>
#include <QCursor>
#include <QEventLoop>
#include <QFileInfo>
#include <QGuiApplication>
#include <QJsonDocument>
#include <QProcess>
#include <QStandardPaths>
#include <QTimer>

namespace rondo::gui {

QString RondoCli::program() {
  const QString env = qEnvironmentVariable("RONDO_BIN");
  if (!env.isEmpty()) return env;
  const QString dir = QCoreApplication::applicationDirPath();
  for (const QString& p : {dir + "/rondo", dir + "/../cli/rondo", dir + "/../../cli/rondo"})
    if (QFileInfo(p).isExecutable()) return QFileInfo(p).canonicalFilePath();
  const QString onPath = QStandardPaths::findExecutable("rondo");
  return onPath.isEmpty() ? QStringLiteral("rondo") : onPath;
}

CliResult RondoCli::run(const QStringList& args, int timeoutMs) {
  CliResult r;
  QProcess p;
  // The window stays live while rondo works (an event loop, not a blocking wait), with a busy
  // cursor; the caller guards against starting another call meanwhile.
  QEventLoop loop;
  QTimer timer;
  timer.setSingleShot(true);
  bool timedOut = false;
  QObject::connect(&p, &QProcess::finished, &loop, &QEventLoop::quit);
  QObject::connect(&p, &QProcess::errorOccurred, &loop, [&](QProcess::ProcessError e) {
    if (e == QProcess::FailedToStart) loop.quit();
  });
  QObject::connect(&timer, &QTimer::timeout, &loop, [&] {
    timedOut = true;
    p.kill();
  });
  QGuiApplication::setOverrideCursor(QCursor(Qt::WaitCursor));
  p.start(program(), args);
  timer.start(timeoutMs);
  if (p.state() != QProcess::NotRunning || p.error() != QProcess::FailedToStart) loop.exec();
  QGuiApplication::restoreOverrideCursor();
  if (p.error() == QProcess::FailedToStart) {
    r.error = QStringLiteral("cannot run %1: %2").arg(program(), p.errorString());
    return r;
  }
  if (p.state() != QProcess::NotRunning) p.waitForFinished(5000);
  if (timedOut) {
    r.error =
        QStringLiteral("rondo %1 took longer than %2 s").arg(args.value(0)).arg(timeoutMs / 1000);
    return r;
  }
  r.out = p.readAllStandardOutput();
  r.err = p.readAllStandardError();
  r.exitCode = p.exitStatus() == QProcess::NormalExit ? p.exitCode() : -1;
  if (!r.ok()) {
    QString text = QString::fromUtf8(r.err).trimmed();
    if (text.isEmpty()) text = QString::fromUtf8(r.out).trimmed();
    r.error = text.isEmpty()
                  ? QStringLiteral("rondo %1 failed (exit %2)").arg(args.value(0)).arg(r.exitCode)
                  : text;
  }
  return r;
}

QJsonObject RondoCli::runJson(const QStringList& args, QString* error, int timeoutMs) {
  CliResult r = run(args, timeoutMs);
  // `rondo plan --json` exits 3 for "does not fit" and still prints the estimate.
  QJsonParseError pe;
  const QJsonDocument doc = QJsonDocument::fromJson(r.out, &pe);
  if (doc.isObject() && (r.ok() || r.exitCode == 3)) {
    if (error) error->clear();
    return doc.object();
  }
  if (error)
    *error =
        r.error.isEmpty() ? QStringLiteral("rondo printed no JSON: ") + pe.errorString() : r.error;
  return {};
}

}  // namespace rondo::gui
