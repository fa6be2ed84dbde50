#include "gui/model/run_folder.h"

#include <QDir>
#include <QFileInfo>

namespace rondo::gui {

RunFolderInfo inspectRunFolder(const QString& dir) {
  RunFolderInfo info;
  const QFileInfo folder(dir);
  const QString shown = QDir::toNativeSeparators(dir);
  if (dir.isEmpty()) {
    info.why = QStringLiteral("no folder given: choose a Rondo run folder");
    return info;
  }
  if (!folder.exists()) {
    info.why = QStringLiteral("%1 does not exist").arg(shown);
    return info;
  }
  if (!folder.isDir()) {
    info.why = QStringLiteral(
                   "%1 is a file, not a folder: choose the run folder that holds "
                   "events.jsonl")
                   .arg(shown);
    return info;
  }
  const QDir d(folder.absoluteFilePath());
  const QFileInfo events(d.filePath(QStringLiteral("events.jsonl")));
  const QFileInfo config(d.filePath(QStringLiteral("config.toml")));
  if (events.isFile()) info.eventsPath = events.absoluteFilePath();
  if (config.isFile()) info.configPath = config.absoluteFilePath();
  info.isRun = !info.eventsPath.isEmpty() || !info.configPath.isEmpty();
  if (!info.isRun)
    info.why =
        QStringLiteral("%1 has no events.jsonl or config.toml: not a Rondo run folder").arg(shown);
  return info;
}

}  // namespace rondo::gui
