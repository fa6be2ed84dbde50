// Shared by the GUI widget tests: a tiny model folder and chat data in a temporary folder,
// screenshots saved to the build folder, and a check that an image is not blank.
#pragma once

#include <QCoreApplication>
#include <QDir>
#include <QFile>
#include <QImage>
#include <QProcess>
#include <QSet>
#include <QString>
#include <QTemporaryDir>
#include <QWidget>

namespace rondo::gui::test {

// Writes <dir>/model (rondo_tiny_model) and <dir>/chat.jsonl; returns "" or what went wrong.
inline QString writeFixture(const QString& dir) {
  const QString tool = qEnvironmentVariable("RONDO_TINY_MODEL");
  if (tool.isEmpty()) return "RONDO_TINY_MODEL is not set (run through ctest)";
  QProcess p;
  p.start(tool, {dir + "/model"});
  if (!p.waitForFinished(60000) || p.exitCode() != 0)
    return "rondo_tiny_model failed: " + QString::fromUtf8(p.readAllStandardError());
  QFile f(dir + "/chat.jsonl");
  if (!f.open(QIODevice::WriteOnly)) return "cannot write chat.jsonl";
  const char* qa[][2] = {{"hi", "hello there"}, {"2+2?", "four"},   {"sky?", "blue"},
                         {"grass?", "green"},   {"cat?", "meow"},   {"dog?", "woof"},
                         {"snow?", "white"},    {"night?", "dark"}, {"sun?", "hot"},
                         {"ice?", "cold"}};
  for (auto& [q, a] : qa)
    f.write(QString("{\"messages\": [{\"role\": \"user\", \"content\": \"%1\"}, {\"role\": "
                    "\"assistant\", \"content\": \"%2\"}]}\n")
                .arg(q, a)
                .toUtf8());
  return "";
}

// Saves a PNG of the widget into the test's build folder; returns the image.
inline QImage screenshot(QWidget* w, const QString& name) {
  QCoreApplication::processEvents();  // layouts changed since the last event loop settle first
  QImage img = w->grab().toImage();
  const QString out = qEnvironmentVariable("RONDO_GUI_TEST_OUT", QDir::tempPath());
  img.save(out + "/" + name + ".png");
  return img;
}

// Distinct colours in the image (sampled): a blank widget has one or two.
inline int colours(const QImage& img) {
  QSet<QRgb> seen;
  for (int y = 0; y < img.height(); y += 2)
    for (int x = 0; x < img.width(); x += 2)
      seen.insert(img.pixel(x, y));
  return static_cast<int>(seen.size());
}

}  // namespace rondo::gui::test
