// Whether a folder is a Rondo run (it has config.toml or events.jsonl), and if not, a sentence
// saying why that the GUI shows as is. Used by the monitor's "open run" and the recent-runs list.
//
//   RunFolderInfo info = inspectRunFolder(dir);
//   if (!info.isRun) showError(info.why); else tail.open(info.eventsPath);
#pragma once

#include <QString>

namespace rondo::gui {

struct RunFolderInfo {
  bool isRun = false;
  QString why;         // when not a run: what is missing, naming the path
  QString eventsPath;  // dir/events.jsonl when it exists, else empty (a run not started yet)
  QString configPath;  // dir/config.toml when it exists, else empty
};

RunFolderInfo inspectRunFolder(const QString& dir);

}  // namespace rondo::gui
