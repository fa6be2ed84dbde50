#include "gui/model/run_history.h"

#include <sys/file.h>

#include <QDir>
#include <QFile>
#include <QFileInfo>
#include <QJsonDocument>
#include <QJsonObject>
#include <QSet>
#include <algorithm>
#include <cerrno>

#include "gui/model/run_folder.h"

namespace rondo::gui {
namespace {

// How much of the end of events.jsonl is read for the last step, eval and run_end: a step's
// events (step, a device event per device, spans) are a few KiB, so this holds many steps.
constexpr qint64 kTail = 256 * 1024;

// Whether `rondo train` holds the run's lock. The holder writes "PID COMMAND" into it right after
// locking; an export or a chat of a writable run holds it too, and does not make the run
// running (a killed run being exported is still interrupted). An empty text is a holder that has
// not written it yet: a trainer just started, as likely as not.
bool trainerHoldsLock(const QString& dir) {
  QFile file(QDir(dir).filePath("rondo.lock"));
  if (!file.open(QIODevice::ReadOnly)) return false;
  const bool held = ::flock(file.handle(), LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  if (!held) return false;
  const QByteArray holder = file.readAll();
  return holder.trimmed().isEmpty() || holder.contains("rondo train");
}

// config.toml as Rondo writes it (one `key = value` per line under `[section]`): "section.key" to
// the value's text.
QMap<QString, QString> readConfig(const QString& path) {
  QMap<QString, QString> out;
  QFile f(path);
  if (!f.open(QIODevice::ReadOnly)) return out;
  QString section;
  for (const QByteArray& raw : f.readAll().split('\n')) {
    const QString line = QString::fromUtf8(raw).trimmed();
    if (line.isEmpty() || line.startsWith('#')) continue;
    if (line.startsWith('[') && line.endsWith(']')) {
      section = line.mid(1, line.size() - 2).trimmed();
      continue;
    }
    const qsizetype eq = line.indexOf('=');
    if (eq <= 0) continue;
    out.insert(section + "." + line.left(eq).trimmed(), line.mid(eq + 1).trimmed());
  }
  return out;
}

QString unquoted(QString v) {
  if (v.size() >= 2 && v.startsWith('"') && v.endsWith('"')) v = v.mid(1, v.size() - 2);
  return v;
}

}  // namespace

RunSummary summarizeRun(const QString& dir) {
  RunSummary s;
  const RunFolderInfo info = inspectRunFolder(dir);
  s.dir = QFileInfo(dir).absoluteFilePath();
  if (!info.isRun) return s;
  s.status = "not started";
  if (!info.configPath.isEmpty()) {
    s.config = readConfig(info.configPath);
    s.model = unquoted(s.config.value("model.path"));
    s.method = unquoted(s.config.value("training.method"));
  }
  QFile events(info.eventsPath);
  if (info.eventsPath.isEmpty() || !events.open(QIODevice::ReadOnly)) {
    if (trainerHoldsLock(dir)) s.status = "running";
    return s;
  }
  // The first line: the run's start.
  const QJsonObject first = QJsonDocument::fromJson(events.readLine()).object();
  if (first["type"].toString() == "run_start") {
    s.started = QDateTime::fromString(first["time"].toString(), Qt::ISODateWithMs);
    s.stepsTotal = first["steps_total"].toInteger();
    if (s.model.isEmpty()) s.model = first["model"].toString();
    if (s.method.isEmpty()) s.method = first["method"].toString();
  }
  // The tail: its complete lines, the last of each kind that matters.
  const qint64 size = events.size();
  events.seek(std::max<qint64>(0, size - kTail));
  QList<QByteArray> lines = events.readAll().split('\n');
  if (size > kTail && !lines.isEmpty()) lines.removeFirst();  // cut in the middle
  QString end;  // the status of a run_end after the last run_start
  for (const QByteArray& l : lines) {
    if (l.trimmed().isEmpty()) continue;
    const QJsonObject e = QJsonDocument::fromJson(l).object();
    if (e.isEmpty()) continue;  // the line being written
    const QString type = e["type"].toString();
    const QDateTime time = QDateTime::fromString(e["time"].toString(), Qt::ISODateWithMs);
    if (time.isValid()) s.ended = time;
    if (type == "run_start") {
      end.clear();
      s.stepsTotal = e["steps_total"].toInteger();
    } else if (type == "step") {
      s.stepsDone = e["step"].toInteger();
      s.stepsTotal = e["steps_total"].toInteger();
      if (e["loss"].isDouble()) s.lastLoss = e["loss"].toDouble();
    } else if (type == "eval" && e["loss"].isDouble()) {
      s.lastEvalLoss = e["loss"].toDouble();
    } else if (type == "run_end") {
      end = e["status"].toString();
      s.stepsDone = e["steps"].toInteger();
    }
  }
  if (!end.isEmpty())
    s.status = end;
  else if (trainerHoldsLock(dir))
    s.status = "running";
  else if (size > 0)
    s.status = "interrupted";  // killed: no run_end, and no process holds the run
  return s;
}

QList<RunSummary> findRuns(const QStringList& roots, const QStringList& extra) {
  QStringList dirs;
  for (const QString& root : roots) {
    if (inspectRunFolder(root).isRun) dirs << root;
    for (const QFileInfo& sub :
         QDir(root).entryInfoList(QDir::Dirs | QDir::NoDotAndDotDot, QDir::Name))
      if (inspectRunFolder(sub.filePath()).isRun) dirs << sub.filePath();
  }
  dirs << extra;
  QList<RunSummary> out;
  QSet<QString> seen;
  for (const QString& d : dirs) {
    const QString abs = QFileInfo(d).absoluteFilePath();
    if (seen.contains(abs)) continue;
    seen.insert(abs);
    RunSummary s = summarizeRun(abs);
    if (!s.status.isEmpty()) out << s;
  }
  // Most recently active first; runs not started (no events) last.
  std::stable_sort(out.begin(), out.end(), [](const RunSummary& a, const RunSummary& b) {
    const QDateTime ta = a.ended.isValid() ? a.ended : a.started;
    const QDateTime tb = b.ended.isValid() ? b.ended : b.started;
    return ta.isValid() && (!tb.isValid() || ta > tb);
  });
  return out;
}

QList<ConfigDifference> configDifferences(const QMap<QString, QString>& a,
                                          const QMap<QString, QString>& b) {
  QStringList keys = a.keys() + b.keys();
  keys.removeDuplicates();
  std::sort(keys.begin(), keys.end());
  QList<ConfigDifference> out;
  for (const QString& k : keys)
    if (k != "output.run_dir" && a.value(k) != b.value(k)) out.append({k, a.value(k), b.value(k)});
  return out;
}

}  // namespace rondo::gui
