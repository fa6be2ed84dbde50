// Shared by the GUI widget tests: a tiny model folder and chat data in a temporary folder,
// screenshots saved to the build folder, and a check that an image is not blank.
#pragma once

#include <QCoreApplication>
#include <QDir>
#include <QFile>
#include <QFileInfo>
#include <QImage>
#include <QLineEdit>
#include <QMap>
#include <QProcess>
#include <QSet>
#include <QSpinBox>
#include <QString>
#include <QTemporaryDir>
#include <QWidget>

#include "gui/app/rondo_cli.h"
#include "gui/app/wizard.h"

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

// writeFixture into a test's temporary folder, whose path goes to `dir`; "" or what went wrong.
inline QString writeFixtureIn(const QTemporaryDir& tmp, QString* dir) {
  if (!tmp.isValid()) return "cannot make a temporary folder: " + tmp.errorString();
  *dir = tmp.path();
  return writeFixture(*dir);
}

// Writes <dir>/<name>.toml, a run of writeFixture's model and data: fp32, 64-token rows, LoRA
// rank 4, run folder <dir>/<name>, and the keys of `settings` added by section
// ({"training", "steps = 4\nlr = 0.01"}; one of the base's keys set there replaces it). Returns the
// config's path ("" when it cannot write it).
inline QString writeRunConfig(const QString& dir, const QString& name,
                              const QMap<QString, QString>& settings) {
  QMap<QString, QStringList> sections = {
      {"model", {QString("path = \"%1/model\"").arg(dir), "dtype = \"fp32\""}},
      {"data", {QString("train = \"%1/chat.jsonl\"").arg(dir), "seq_len = 64"}},
      {"lora", {"rank = 4"}},
      {"output", {QString("run_dir = \"%1/%2\"").arg(dir, name)}}};
  // A key set again replaces the base's (TOML refuses a key twice).
  for (auto it = settings.begin(); it != settings.end(); ++it)
    for (const QString& line : it.value().split('\n')) {
      QStringList& lines = sections[it.key()];
      const QString key = line.section('=', 0, 0).trimmed();
      lines.removeIf([&](const QString& l) { return l.section('=', 0, 0).trimmed() == key; });
      lines << line;
    }
  QString toml;
  for (auto it = sections.begin(); it != sections.end(); ++it)
    toml += "[" + it.key() + "]\n" + it.value().join('\n') + "\n";
  const QString path = dir + "/" + name + ".toml";
  QDir().mkpath(QFileInfo(path).absolutePath());
  QFile f(path);
  if (!f.open(QIODevice::WriteOnly) || f.write(toml.toUtf8()) < 0) return {};
  return path;
}

// writeRunConfig's run trained to its end by `rondo train`; "" when it did, else why not.
inline QString trainRun(const QString& dir, const QString& name,
                        const QMap<QString, QString>& settings) {
  const QString config = writeRunConfig(dir, name, settings);
  if (config.isEmpty()) return "cannot write the config of " + name;
  const CliResult r = RondoCli::run({"train", config});
  return r.ok() ? QString() : name + ": " + r.error;
}

// On a fresh wizard: writeFixture's model on the Model page, Next, its data on the Data page (the
// wizard stays there).
inline void pickModelAndData(SetupWizard* w, const QString& dir) {
  w->findChild<QLineEdit*>("modelPath")->setText(dir + "/model");
  w->refreshModel();
  w->next();
  w->findChild<QLineEdit*>("dataPath")->setText(dir + "/chat.jsonl");
  w->refreshData();
}

// On the Training page: the steps, rows of `seqLen` tokens and the run folder; then on to Review,
// past the Advanced page's defaults.
inline void trainingToReview(SetupWizard* w, int steps, int seqLen, const QString& runDir) {
  w->findChild<QSpinBox*>("steps")->setValue(steps);
  w->findChild<QSpinBox*>("seqLen")->setValue(seqLen);
  w->findChild<QLineEdit*>("runDir")->setText(runDir);
  w->next();
  w->next();
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
