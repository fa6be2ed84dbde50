#include "gui/app/rondo_cli.h"

#include <QCoreApplication>
#include <QFileInfo>
#include <QJsonDocument>
#include <QProcess>
#include <QStandardPaths>

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
  p.start(program(), args);
  if (!p.waitForStarted(10000)) {
    r.error = QStringLiteral("cannot run %1: %2").arg(program(), p.errorString());
    return r;
  }
  if (!p.waitForFinished(timeoutMs)) {
    p.kill();
    p.waitForFinished(2000);
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
