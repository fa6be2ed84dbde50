// gui_load_bench: how fast the monitor opens a long run and decimates its charts, as ratios
// against baselines measured in the same run (never wall-clock limits: these machines are shared).
//
//  (a) opening a recorded 100,000-step run (2 devices, 5 spans a step: ~800k lines) with EventTail
//      against reading the same file's bytes and counting its lines (the floor any reader pays).
//  (b) decimating 10^6 points to 2,000 (min/max per bucket) against one plain pass summing them.
//  (c) the event parser alone on every line of (a): JsonLine (simdjson) against QJsonDocument, the
//      kept library it was chosen over (docs/measurements/gui_json.md).
//
//   gui_load_bench [--repeat 5]     (best of N for each figure)
#include <QCoreApplication>
#include <QElapsedTimer>
#include <QFile>
#include <QJsonDocument>
#include <QJsonObject>
#include <QRandomGenerator>
#include <QTemporaryDir>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "../tests/gui/model/event_writer.h"
#include "gui/model/event_tail.h"
#include "gui/model/json_line.h"
#include "gui/model/run_state.h"
#include "gui/model/series.h"

using namespace rondo::gui;

namespace {

template <typename F>
double best_ms(int repeat, F&& f) {
  double best = 1e300;
  for (int i = 0; i < repeat; ++i) {
    QElapsedTimer t;
    t.start();
    f();
    best = std::min(best, static_cast<double>(t.nsecsElapsed()) / 1e6);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  QCoreApplication app(argc, argv);
  int repeat = 5;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));

  test::RunSpec spec;
  spec.steps = 100'000;
  spec.devices = 2;
  spec.spansPerStep = 5;
  spec.evalEvery = 1000;
  spec.checkpointEvery = 10000;
  const QByteArray bytes = test::generateRun(spec);
  QTemporaryDir dir;
  const QString path = dir.filePath(QStringLiteral("events.jsonl"));
  {
    QFile f(path);
    if (!f.open(QIODevice::WriteOnly) || f.write(bytes) != bytes.size()) {
      std::fprintf(stderr, "gui_load_bench: cannot write %s\n", qPrintable(path));
      return 1;
    }
  }
  long long lines_seen = 0;
  const double read_ms = best_ms(repeat, [&] {
    QFile f(path);
    if (!f.open(QIODevice::ReadOnly)) std::abort();
    const QByteArray all = f.readAll();
    lines_seen = all.count('\n');
  });
  long long steps_seen = 0;
  const double open_ms = best_ms(repeat, [&] {
    RunState state;
    EventTail tail(&state);
    QString error;
    if (!tail.open(path, &error)) {
      std::fprintf(stderr, "gui_load_bench: %s\n", qPrintable(error));
      std::exit(1);
    }
    steps_seen = state.loss().size();
  });
  std::printf("(a) opening a recorded run: %lld lines, %.1f MB, %lld steps in the loss chart\n",
              lines_seen, bytes.size() / 1e6, steps_seen);
  std::printf("| what | ms (best of %d) | ratio |\n|---|---|---|\n", repeat);
  std::printf("| read the bytes, count lines | %.1f | 1.00 |\n", read_ms);
  std::printf("| EventTail::open (parse, charts, timeline) | %.1f | %.1f |\n\n", open_ms,
              open_ms / read_ms);

  Series s;
  QRandomGenerator rng(7);
  constexpr int n = 1'000'000;
  for (int i = 0; i < n; ++i)
    s.append(i + 1, rng.generateDouble());
  double sum = 0;
  const double pass_ms = best_ms(repeat, [&] {
    double acc = 0;
    for (qsizetype i = 0; i < s.size(); ++i)
      acc += s.at(i).y();
    sum += acc;
  });
  qsizetype shown = 0;
  const double decimate_ms =
      best_ms(repeat, [&] { shown = s.decimated(s.minX(), s.maxX(), 2000).size(); });
  std::printf("(b) decimating %d points to %lld for a chart (checksum %.3f)\n", n,
              static_cast<long long>(shown), sum);
  std::printf("| what | ms (best of %d) | ratio |\n|---|---|---|\n", repeat);
  std::printf("| one pass summing the points | %.2f | 1.00 |\n", pass_ms);
  std::printf("| Series::decimated | %.2f | %.1f |\n\n", decimate_ms, decimate_ms / pass_ms);

  // Each line parsed and its version read, as RunState starts every line.
  const auto eachLine = [&](auto&& parse) {
    long long ok = 0;
    const char* p = bytes.constData();
    const char* const end = p + bytes.size();
    while (p < end) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
      if (nl == nullptr) nl = end;
      ok += parse(std::string_view(p, static_cast<std::size_t>(nl - p)));
      p = nl + 1;
    }
    return ok;
  };
  JsonLine line;
  long long simdjson_ok = 0, qt_ok = 0;
  const double simdjson_ms = best_ms(repeat, [&] {
    simdjson_ok =
        eachLine([&](std::string_view l) { return line.parse(l) && line.isNumeric("v"); });
  });
  const double qt_ms = best_ms(repeat, [&] {
    qt_ok = eachLine([](std::string_view l) {
      const QJsonDocument doc = QJsonDocument::fromJson(
          QByteArray::fromRawData(l.data(), static_cast<qsizetype>(l.size())));
      return doc.isObject() && doc.object().value(QLatin1StringView("v")).isDouble();
    });
  });
  std::printf("(c) parsing each line alone: %lld lines, %lld and %lld of them events\n", lines_seen,
              simdjson_ok, qt_ok);
  std::printf("| what | ms (best of %d) | ns a line | ratio |\n|---|---|---|---|\n", repeat);
  std::printf("| JsonLine::parse (simdjson) | %.1f | %.0f | 1.00 |\n", simdjson_ms,
              simdjson_ms * 1e6 / lines_seen);
  std::printf("| QJsonDocument::fromJson | %.1f | %.0f | %.1f |\n", qt_ms, qt_ms * 1e6 / lines_seen,
              qt_ms / simdjson_ms);
  return 0;
}
