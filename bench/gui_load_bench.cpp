// gui_load_bench: how fast the monitor opens a long run and decimates its charts, as ratios
// against baselines measured in the same run (never wall-clock limits: these machines are shared).
//
//  (a) opening a recorded 100,000-step run (2 devices, 5 spans a step: ~800k lines) with EventTail
//      against reading the same file's bytes and counting its lines (the floor any reader pays).
//  (b) decimating 10^6 points to 2,000 (min/max per bucket) against one plain pass summing them.
//
//   gui_load_bench [--repeat 5]     (best of N for each figure)
#include <QCoreApplication>
#include <QElapsedTimer>
#include <QFile>
#include <QRandomGenerator>
#include <QTemporaryDir>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../tests/gui/model/event_writer.h"
#include "gui/model/event_tail.h"
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
  std::printf("| Series::decimated | %.2f | %.1f |\n", decimate_ms, decimate_ms / pass_ms);
  return 0;
}
