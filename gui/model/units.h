// Figures as the GUI writes them, in the model's log and the widgets alike: bytes ("1.50 GiB",
// binary units as the CLI writes them) and durations ("3 min").
#pragma once

#include <QString>

namespace rondo::gui {

inline QString bytesText(double b) {
  if (b >= 1024.0 * 1024 * 1024)
    return QString::number(b / (1024.0 * 1024 * 1024), 'f', 2) + " GiB";
  if (b >= 1024.0 * 1024) return QString::number(b / (1024.0 * 1024), 'f', 1) + " MiB";
  return QString::number(b / 1024.0, 'f', 1) + " KiB";
}

inline QString durationText(double s) {
  if (s < 1) return QString::number(s, 'g', 2) + " s";  // a step of a small model: "0.021 s"
  if (s < 90) return QString::number(s, 'f', 0) + " s";
  if (s < 5400) return QString::number(s / 60, 'f', 0) + " min";
  return QString::number(s / 3600, 'f', 1) + " h";
}

}  // namespace rondo::gui
