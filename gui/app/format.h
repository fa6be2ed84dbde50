// Strings as TOML spells them; figures as the GUI writes them (gui/model/units.h).
#pragma once

#include <QString>

#include "gui/model/units.h"

namespace rondo::gui {

// A TOML basic string: quoted, with its quotes, backslashes and control characters escaped.
inline QString tomlString(const QString& s) {
  QString o = "\"";
  for (QChar c : s) {
    if (c == '"' || c == '\\')
      o += '\\', o += c;
    else if (c == '\n')
      o += "\\n";
    else if (c == '\t')
      o += "\\t";
    else
      o += c;
  }
  return o + "\"";
}

}  // namespace rondo::gui
