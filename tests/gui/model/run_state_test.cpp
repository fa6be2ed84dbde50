// RunState: events of every type read exactly, malformed lines skipped and counted, any chunking of
// the bytes giving the same state, resumed runs, and a real recorded run of `rondo demo`.
#include <QFile>
#include <QRandomGenerator>
#include <QSignalSpy>
#include <QTest>
#include <cmath>

#include "event_writer.h"
#include "gui/model/run_state.h"

using namespace rondo::gui;
using namespace rondo::gui::test;

namespace {

QString num(double v) {
  return QString::number(v, 'g', 17);
}

QString dumpSeries(const char* name, const Series& s) {
  QString out = QStringLiteral("%1[%2]:").arg(QLatin1String(name)).arg(s.size());
  for (qsizetype i = 0; i < s.size(); ++i)
    out += QStringLiteral(" %1=%2").arg(num(s.at(i).x()), num(s.at(i).y()));
  return out + u'\n';
}

// Everything a user could see, as text: two states are the same when their dumps are.
QString dump(RunState& s) {
  QString out;
  out += QStringList{s.status(),     s.runDir(), s.model(),        s.method(),
                     s.configToml(), s.plan(),   s.errorMessage(), s.exportPath()}
             .join(u'|') +
         u'\n';
  out += QStringLiteral("%1 %2 %3 | %4 %5 %6 %7 %8 %9 %10 | %11 %12 %13\n")
             .arg(s.stepsTotal())
             .arg(s.lastStep())
             .arg(s.resumedFrom())
             .arg(num(s.lastLoss()), num(s.lastEvalLoss()), num(s.lastLr()), num(s.lastGradNorm()),
                  num(s.tokensPerSecond()), num(s.etaSeconds()), num(s.elapsedSeconds()))
             .arg(s.malformedLines())
             .arg(s.unknownVersionLines())
             .arg(s.linesRead());
  out += dumpSeries("loss", s.loss()) + dumpSeries("eval", s.evalLoss()) +
         dumpSeries("lr", s.lr()) + dumpSeries("grad", s.gradNorm()) +
         dumpSeries("tps", s.throughput());
  for (const DeviceStatus& d : s.devices())
    out += QStringLiteral("device %1 %2 %3 %4 %5 %6 %7 %8\n")
               .arg(d.device)
               .arg(d.name)
               .arg(d.bytesInUse)
               .arg(d.bytesPeak)
               .arg(d.bytesCap)
               .arg(num(d.busyFraction))
               .arg(d.bytesH2d)
               .arg(d.bytesD2h);
  for (const CheckpointItem& c : s.checkpoints())
    out += QStringLiteral("checkpoint %1 %2 %3\n").arg(c.step).arg(c.path).arg(c.bytes);
  for (const SpanItem& sp : s.timeline()->spans())
    out += QStringLiteral("span %1 %2 %3 %4 %5 %6 %7\n")
               .arg(sp.device)
               .arg(sp.step)
               .arg(sp.stage)
               .arg(sp.firstLayer)
               .arg(sp.endLayer)
               .arg(num(sp.start), num(sp.end));
  out += QStringLiteral("timeline %1 %2 %3\n")
             .arg(s.timeline()->deviceCount())
             .arg(num(s.timeline()->timeStart()), num(s.timeline()->timeEnd()));
  for (const SampleItem& sa : s.samples()->samples())
    out += QStringLiteral("sample %1 %2 %3\n").arg(sa.step).arg(sa.prompt, sa.text);
  out += s.log()->lines().join(u'\n');
  return out;
}

// Lines no reader should accept, each with the reason; `good` lines around them must still count.
const char* const kBadLines[] = {
    "garbage here, not JSON at all",
    "{\"t\":1.0,\"time\":\"2026-12-03T00:11:05.129Z\",\"type\":\"step\",\"v\":1,\"loss\":"
    "3.",       // truncated
    "[1,2,3]",  // not an object
    "{\"t\":1.0,\"time\":\"2026-12-03T00:11:05.129Z\",\"v\":1,\"loss\":1.5,\"step\":3}",  // no type
    "{\"t\":1.0,\"type\":17,\"v\":1}",                                    // type not a string
    "{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":\"3.5\",\"step\":3}",  // string loss
    "{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5}",                 // step missing
    "{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5,\"step\":3.5}",    // step not integral
    "{\"t\":1.0,\"type\":\"span\",\"v\":1,\"device\":\"0\",\"end\":2,\"end_layer\":8,"
    "\"first_layer\":0,\"stage\":\"F0\",\"start\":1,\"step\":3}",
    "{\"t\":1.0,\"type\":\"device\",\"v\":1,\"bytes_in_use\":-5,\"device\":0,\"name\":"
    "\"x\"}",                         // negative bytes
    "{\"t\":1.0,\"type\":\"step\"}",  // no version
    "{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5,\"step\":3} trailing",
    "{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5,\"step\":3,}",
    "{\"t\":1.0,\"type\":\"sample\",\"v\":1,\"prompt\":\"a\\qb\",\"step\":3,\"text\":"
    "\"x\"}",                                                             // bad escape
    "{\"t\":1.0,\"type\":\"warning\",\"v\":1,\"message\":\"raw\ttab\"}",  // raw control
                                                                          // char
};
constexpr int kBadCount = sizeof kBadLines / sizeof kBadLines[0];

QByteArray readData(const char* name) {
  QFile f(QStringLiteral(RONDO_GUI_MODEL_DATA "/") + QLatin1String(name));
  if (!f.open(QIODevice::ReadOnly)) qFatal("cannot read test data %s", name);
  return f.readAll();
}

}  // namespace

class RunStateTest : public QObject {
  Q_OBJECT
 private slots:
  void startsEmpty() {
    RunState s;
    QCOMPARE(s.status(), QStringLiteral("empty"));
    QVERIFY(std::isnan(s.lastLoss()) && std::isnan(s.elapsedSeconds()));
    QCOMPARE(s.linesRead(), 0);
  }

  void generatedRunIsReadExactly() {
    RunSpec spec;
    spec.steps = 300;
    spec.evalEvery = 100;
    spec.checkpointEvery = 150;
    QByteArray bytes = generateRun(spec);
    Line(bytes, "warning", 30.5).str("message", "disk is 91% full").end();
    RunState s;
    QSignalSpy changed(&s, &RunState::changed), ended(&s, &RunState::runEnded);
    s.feed(bytes);
    QCOMPARE(changed.count(), 1);
    QCOMPARE(ended.count(), 1);
    QCOMPARE(ended.at(0).at(0).toString(), QStringLiteral("completed"));

    QCOMPARE(s.malformedLines(), 0);
    QCOMPARE(s.unknownVersionLines(), 0);
    QCOMPARE(s.linesRead(), bytes.count('\n'));
    QCOMPARE(s.status(), QStringLiteral("completed"));
    QCOMPARE(s.runDir(), QStringLiteral("/tmp/run \"quoted\""));
    QCOMPARE(s.model(), QStringLiteral("/models/tiny.gguf"));
    QCOMPARE(s.method(), QStringLiteral("lora"));
    QVERIFY(s.configToml().startsWith(QStringLiteral("[model]\npath = \"/models/tiny.gguf\"\n")));
    QCOMPARE(s.plan(), QStringLiteral(
                           "F[0,15) F[15,31) T[31,32) B[25,31) B[17,25) B[9,17) B[0,9) M=4 stage"));
    // The plan's predicted peak per device, to show beside each device's measured one.
    QCOMPARE(s.plannedPeaks(), QList<double>({739232768.0, 739232768.0}));
    QCOMPARE(s.exportPath(), QStringLiteral("/tmp/run/adapter"));
    QCOMPARE(s.stepsTotal(), 300);
    QCOMPARE(s.lastStep(), 300);
    QCOMPARE(s.resumedFrom(), 0);

    QCOMPARE(s.loss().size(), 300);
    for (int step = 1; step <= 300; ++step) {
      QCOMPARE(s.loss().at(step - 1), QPointF(step, lossAt(step)));
      QCOMPARE(s.lr().at(step - 1).y(), lrAt(step));
      QCOMPARE(s.gradNorm().at(step - 1).y(), gradNormAt(step));
      QCOMPARE(s.throughput().at(step - 1).y(), tokensPerSecondAt(step));
    }
    QCOMPARE(s.lastLoss(), lossAt(300));
    QCOMPARE(s.lastLr(), lrAt(300));
    QCOMPARE(s.lastGradNorm(), gradNormAt(300));
    QCOMPARE(s.tokensPerSecond(), tokensPerSecondAt(300));
    QCOMPARE(s.etaSeconds(), 0.0);
    QCOMPARE(s.evalLoss().size(), 4);
    for (int i = 0; i < 4; ++i)
      QCOMPARE(s.evalLoss().at(i), QPointF(100 * i, evalLossAt(100 * i)));
    QCOMPARE(s.lastEvalLoss(), evalLossAt(300));
    QCOMPARE(s.elapsedSeconds(), 30.5);  // the warning's t, the last event

    const QList<DeviceStatus> devices = s.devices();
    QCOMPARE(devices.size(), 2);
    QCOMPARE(devices[1].device, 1);
    QCOMPARE(devices[1].name, QStringLiteral("NVIDIA GeForce RTX 3090"));
    QCOMPARE(devices[1].bytesInUse, 555887617ull);
    QCOMPARE(devices[1].bytesPeak, 679101700ull + 300);
    QCOMPARE(devices[1].bytesCap, 25275973632ull);
    QCOMPARE(devices[1].busyFraction, 0.5 + 0.001 * 300);
    QCOMPARE(devices[1].bytesH2d, 300ull * 1553767680ull);
    QCOMPARE(devices[1].bytesD2h, 300ull * 26615812ull);

    const QList<CheckpointItem> cps = s.checkpoints();
    QCOMPARE(cps.size(), 2);
    QCOMPARE(cps[1].step, 300);
    QCOMPARE(cps[1].path, QStringLiteral("/tmp/run/checkpoints/step-300"));
    QCOMPARE(cps[1].bytes, 58788481ull);

    TimelineModel* tl = s.timeline();
    QCOMPARE(tl->rowCount(), 1500);
    QCOMPARE(tl->deviceCount(), 2);
    const SpanItem& last = tl->spans().last();
    QCOMPARE(last.step, 300);
    QCOMPARE(last.stage, QStringLiteral("B0"));
    QCOMPARE(last.device, 0);
    QCOMPARE(last.firstLayer, 0);
    QCOMPARE(last.endLayer, 8);
    QCOMPARE(last.end - last.start, (last.start + 0.01) - last.start);
    QCOMPARE(tl->timeStart(), 2.0);
    QCOMPARE(tl->timeEnd(), tl->spans().last().end);
    QCOMPARE(tl->data(tl->index(1499, TimelineModel::Stage)).toString(), QStringLiteral("B0"));

    QCOMPARE(s.samples()->rowCount(), 4);
    QCOMPARE(s.samples()->samples()[2].step, 200);
    QCOMPARE(s.samples()->samples()[2].text, QString::fromUtf8("Paris \xe2\x80\x94 \\o/"));
    QCOMPARE(s.samples()->data(s.samples()->index(0)).toString(),
             QString::fromUtf8(
                 "step 0: What is the capital of France? \xe2\x86\x92 Paris \xe2\x80\x94 \\o/"));

    const QStringList log = s.log()->lines();
    QCOMPARE(log.size(), 7);
    QCOMPARE(log[0], QStringLiteral("run started: /models/tiny.gguf (lora), 300 steps"));
    // The schedule in words (the plan event's own description is for the timeline's stages).
    QCOMPARE(log[1],
             QStringLiteral("schedule (ours): the model's 32 layers in 2 forward stages and "
                            "4 backward stages (and the head), 4 batches per optimizer "
                            "step, taking turns on 2 devices; about 1 s per step "
                            "predicted"));
    // Bytes in the binary units the rest of the GUI and the CLI write (58,788,481 B).
    QCOMPARE(log[2],
             QStringLiteral("checkpoint at step 150: /tmp/run/checkpoints/step-150 (56.1 MiB)"));
    QCOMPARE(log[4], QStringLiteral("run completed after 300 steps in 32.0 s"));
    QCOMPARE(log[5], QStringLiteral("exported to /tmp/run/adapter"));
    QCOMPARE(log[6], QStringLiteral("warning: disk is 91% full"));
    // A plan with sequence tiling says so.
    QCOMPARE(scheduleInWords("F[0,2) T[2,4) B[0,2) M=1 stage tile=4096", 1, 0),
             QStringLiteral("the model's 4 layers in 1 forward stage and 1 backward stage (and "
                            "the head), 1 batch per optimizer step, the MLPs over tiles of 4096 "
                            "tokens (a long sequence), taking turns on 1 device"));
  }

  void malformedLinesAreSkippedAndCounted() {
    RunSpec spec;
    spec.steps = 5;
    spec.runEnd = false;
    QByteArray good = generateRun(spec);
    // Bad lines between every pair of good lines, and good lines of unknown types and fields.
    QByteArray bytes;
    const QList<QByteArray> lines = good.split('\n');
    int badUsed = 0;
    for (const QByteArray& line : lines) {
      if (line.isEmpty()) continue;
      bytes += line + '\n';
      bytes += QByteArray(kBadLines[badUsed++ % kBadCount]) + '\n';
    }
    while (badUsed < kBadCount)
      bytes += QByteArray(kBadLines[badUsed++]) + '\n';
    bytes +=
        "{\"t\":9.0,\"time\":\"2026-12-03T00:11:05.129Z\",\"type\":\"step\",\"v\":2,\"loss\":1,"
        "\"step\":6}"
        "\n";
    bytes +=
        "{\"t\":9.0,\"type\":\"hologram\",\"v\":1,\"colour\":\"blue\"}"
        "\n";             // unknown type: ignored
    bytes += "\n  \r\n";  // blank lines: not events, not errors
    Line(bytes, "step", 9.5)
        .num("loss", 0.25)
        .num("mood", 3)
        .integer("step", 6)
        .raw("z", "{\"a\":[1,{}]}")
        .end();
    Line(bytes, "run_end", 10).str("status", "completed").integer("steps", 6).end();

    RunState s;
    s.feed(bytes);
    QCOMPARE(s.malformedLines(), badUsed);
    QCOMPARE(s.unknownVersionLines(), 1);
    QCOMPARE(s.linesRead(), bytes.count('\n'));
    QCOMPARE(s.status(), QStringLiteral("completed"));
    QCOMPARE(s.loss().size(), 6);
    for (int step = 1; step <= 5; ++step)
      QCOMPARE(s.loss().at(step - 1), QPointF(step, lossAt(step)));
    QCOMPARE(s.loss().at(5), QPointF(6, 0.25));  // unknown fields ignored
    QCOMPARE(s.timeline()->rowCount(), 25);      // the span with a string device is not among them
    QCOMPARE(s.devices().size(), 2);
    QCOMPARE(s.devices()[0].bytesInUse, 555887616ull);
    QCOMPARE(s.log()->lines().filter(QStringLiteral("warning")).size(), 0);
  }

  // The first malformed line is reported by its line number and what is wrong with it.
  void malformedLinesSayWhereAndWhat() {
    QByteArray good;
    Line(good, "step", 1).num("loss", 2.5).integer("step", 1).end();
    good += "\n";  // a blank line 2 still counts as a line
    for (int i = 0; i < kBadCount; ++i) {
      RunState s;
      s.feed(good + kBadLines[i] + '\n' + kBadLines[0] + '\n');
      QCOMPARE(s.malformedLines(), 2);
      QCOMPARE(s.loss().size(), 1);
      const QString first = s.firstMalformed();
      QVERIFY2(first.startsWith(QStringLiteral("line 3: ")) && first.size() > 20,
               qPrintable(QStringLiteral("%1 gives: %2").arg(kBadLines[i], first)));
    }
    const std::pair<const char*, const char*> cases[] = {
        {"[1,2,3]", "line 1: not a JSON object"},
        {"{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5,\"step\":3.5}",
         "line 1: \"step\" of a step event must be an integer"},
        {"{\"t\":1.0,\"type\":\"device\",\"v\":1,\"bytes_in_use\":-5,\"device\":0}",
         "line 1: \"bytes_in_use\" of a device event must be a non-negative integer or null"},
        {"{\"t\":1.0,\"type\":\"span\",\"v\":1,\"device\":-1,\"step\":3}",
         "line 1: \"device\" of a span event is out of range"},
        {"{\"t\":1.0,\"type\":\"step\"}", "line 1: no schema version (\"v\", a number)"},
        {"{\"t\":1.0,\"type\":17,\"v\":1}", "line 1: no event type (\"type\", a string)"},
    };
    for (const auto& [bad, expected] : cases) {
      RunState s;
      s.feed(QByteArray(bad) + '\n');
      QCOMPARE(s.firstMalformed(), QString::fromUtf8(expected));
    }
    RunState s;
    s.feed("{\"t\":1.0,\"type\":\"step\",\"v\":1,\"loss\":1.5,\"step\":3} trailing\n");
    QVERIFY2(s.firstMalformed().startsWith(QStringLiteral("line 1: not JSON (simdjson: ")),
             qPrintable(s.firstMalformed()));
    s.reset();
    QVERIFY(s.firstMalformed().isEmpty());
  }

  void stringsAreUnescaped() {
    QByteArray bytes;
    bytes +=
        "{\"t\":1,\"type\":\"sample\",\"v\":1,\"prompt\":\"q\\\"\\\\\\/"
        "\\b\\f\\n\\r\\t\",\"step\":1,\"text\":\"\\u00e9\\u20ac\\ud83d\\ude00 \\ud800x \\udc00 "
        "ok\"}"
        "\n";
    bytes +=
        "{\"t\":1,\"type\":\"sample\",\"v\":1,\"prompt\":\"bad \xff "
        "utf8\",\"step\":2,\"text\":\"\xc3\xa9\"}\n";
    // An escaped backslash before "ud800" is not an escape of a surrogate.
    bytes +=
        "{\"t\":1,\"type\":\"sample\",\"v\":1,\"prompt\":\"\\\\ud800 \\udc00\",\"step\":3,"
        "\"text\":\"\\ud83d\"}\n";
    RunState s;
    s.feed(bytes);
    QCOMPARE(s.malformedLines(), 0);
    const QList<SampleItem>& samples = s.samples()->samples();
    QCOMPARE(samples.size(), 3);
    QCOMPARE(samples[2].prompt, QString::fromUtf8("\\ud800 \xef\xbf\xbd"));
    QCOMPARE(samples[2].text, QString::fromUtf8("\xef\xbf\xbd"));
    QCOMPARE(samples[0].prompt, QStringLiteral("q\"\\/\b\f\n\r\t"));
    QCOMPARE(
        samples[0].text,
        QString::fromUtf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80 \xef\xbf\xbdx \xef\xbf\xbd ok"));
    QCOMPARE(samples[1].prompt, QString::fromUtf8("bad \xef\xbf\xbd utf8"));
    QCOMPARE(samples[1].text, QString::fromUtf8("\xc3\xa9"));
  }

  void nullNumbersAreNaN() {
    QByteArray bytes;
    Line(bytes, "step", 1)
        .raw("grad_norm", "null")
        .raw("loss", "null")
        .num("lr", 1e-3)
        .integer("step", 1)
        .end();
    Line(bytes, "step", 2)
        .num("grad_norm", 2)
        .num("loss", 3)
        .num("lr", 1e-3)
        .integer("step", 2)
        .end();
    RunState s;
    s.feed(bytes);
    QCOMPARE(s.malformedLines(), 0);
    QCOMPARE(s.loss().size(), 2);  // the NaN step is kept: the chart shows a gap
    QVERIFY(std::isnan(s.loss().at(0).y()));
    QCOMPARE(s.loss().minY(), 3.0);
    QCOMPARE(s.lastLoss(), 3.0);
    QCOMPARE(s.status(), QStringLiteral("running"));
    QByteArray nan;
    Line(nan, "step", 3).raw("loss", "null").integer("step", 3).end();
    s.feed(nan);
    QVERIFY(std::isnan(s.lastLoss()));
  }

  void realDemoRunParses() {
    // Recorded from a real `rondo demo` (30 steps, 1 CPU device, eval and samples at 0 and 30).
    const QByteArray bytes = readData("demo_run.jsonl");
    RunState s;
    s.feed(bytes);
    s.finishInput();
    QCOMPARE(s.malformedLines(), 0);
    QCOMPARE(s.unknownVersionLines(), 0);
    QCOMPARE(s.status(), QStringLiteral("completed"));
    QCOMPARE(s.method(), QStringLiteral("lora"));
    QCOMPARE(s.stepsTotal(), 30);
    QCOMPARE(s.lastStep(), 30);
    QCOMPARE(s.loss().size(), 30);
    QCOMPARE(s.loss().at(0), QPointF(1, 3.9446114434136286));
    QCOMPARE(s.evalLoss().size(), 2);
    QCOMPARE(s.evalLoss().at(0), QPointF(0, 3.332491335661515));
    QCOMPARE(s.evalLoss().at(1), QPointF(30, 0.030019016369529392));
    const QList<SampleItem>& samples = s.samples()->samples();
    QCOMPARE(samples.size(), 4);
    QCOMPARE(samples[0].step, 0);
    QCOMPARE(samples[1].step, 0);
    QCOMPARE(samples[2].step, 30);
    QCOMPARE(samples[3].step, 30);
    QCOMPARE(samples[0].prompt, QStringLiteral("What is the capital of France?"));
    QCOMPARE(s.timeline()->rowCount(), 210);
    QCOMPARE(s.timeline()->deviceCount(), 1);
    QCOMPARE(s.devices().size(), 1);
    QCOMPARE(s.devices()[0].name, QStringLiteral("cpu"));
    QCOMPARE(s.checkpoints().size(), 1);
    QCOMPARE(s.checkpoints()[0].step, 30);
    QCOMPARE(s.exportPath(), QStringLiteral("/tmp/demo-run/adapter"));
    QVERIFY(s.configToml().contains(QStringLiteral("[training]")));
    QCOMPARE(s.elapsedSeconds(), 84.81975698500001);
  }

  // The bytes may be split anywhere, even inside a UTF-8 sequence: the state must not depend on it.
  void chunkedFeedingGivesTheSameState() {
    RunSpec spec;
    spec.steps = 120;
    spec.evalEvery = 40;
    spec.checkpointEvery = 60;
    spec.runEnd = false;
    QByteArray bytes = generateRun(spec);
    for (int i = 0; i < kBadCount; ++i)
      bytes += QByteArray(kBadLines[i]) + '\n';
    RunSpec resumed = spec;
    resumed.firstStep = 61;
    resumed.resumedFrom = 60;
    resumed.steps = 150;
    resumed.runEnd = true;
    bytes += generateRun(resumed);
    bytes +=
        "{\"t\":1,\"type\":\"sample\",\"v\":1,\"prompt\":\"é€😀\",\"step\":150,\"text\":\"no "
        "newline at the end\"}";

    RunState whole;
    whole.timeline()->setCapacity(100);
    whole.feed(bytes);
    whole.finishInput();
    const QString expected = dump(whole);
    QCOMPARE(whole.malformedLines(), kBadCount);
    // 0, 40 of the first segment (80, 120 are after its checkpoint), 80, 120 again, 150.
    QCOMPARE(whole.samples()->rowCount(), 5);

    const quint32 seed = QRandomGenerator::global()->generate();
    QRandomGenerator rng(seed);
    for (int round = 0; round < 3; ++round) {
      RunState chunked;
      chunked.timeline()->setCapacity(100);
      qsizetype pos = 0;
      while (pos < bytes.size()) {
        // One part of the stream byte by byte, the rest in random sizes up to a few lines.
        const bool byByte = pos > bytes.size() / 3 && pos < bytes.size() / 3 + 4000;
        const qsizetype n = std::min<qsizetype>(
            bytes.size() - pos, byByte ? 1 : 1 + rng.bounded(round == 0 ? 50 : 3000));
        chunked.feed(QByteArrayView(bytes.constData() + pos, n));
        pos += n;
      }
      chunked.finishInput();
      const QString got = dump(chunked);
      if (got != expected) {
        // Report the first line that differs.
        const QStringList a = got.split(u'\n'), b = expected.split(u'\n');
        qsizetype i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i])
          ++i;
        QVERIFY2(false,
                 qPrintable(QStringLiteral("seed %1, round %2: line %3 is\n%4\ninstead of\n%5")
                                .arg(seed)
                                .arg(round)
                                .arg(i)
                                .arg(a.value(i), b.value(i))));
      }
    }
  }

  void resumedRunReplacesRepeatedSteps() {
    QByteArray bytes;
    RunSpec first;
    first.steps = 7;
    first.stepsTotal = 10;
    first.evalEvery = 3;
    first.runEnd = false;
    bytes += generateRun(first);  // steps 1..7, evals at 0, 3, 6; the process died after step 7
    QByteArray second;
    RunSpec spec;
    spec.stepsTotal = 10;
    spec.resumedFrom = 6;
    spec.runEnd = true;
    writeRunStart(second, spec);
    for (int step = 7; step <= 10; ++step)
      Line(second, "step", step)
          .num("loss", 100.0 + step)
          .num("lr", 1e-3)
          .integer("step", step)
          .integer("steps_total", 10)
          .end();
    Line(second, "run_end", 12).str("status", "completed").integer("steps", 10).end();

    RunState s;
    s.feed(bytes);
    QCOMPARE(s.loss().size(), 7);
    QCOMPARE(s.evalLoss().size(), 3);
    QCOMPARE(s.samples()->rowCount(), 3);
    const double firstElapsed = s.elapsedSeconds();
    QVERIFY(firstElapsed > 0);
    s.feed(second);
    QCOMPARE(s.resumedFrom(), 6);
    QCOMPARE(s.status(), QStringLiteral("completed"));
    QCOMPARE(s.loss().size(), 10);
    for (int step = 1; step <= 6; ++step)
      QCOMPARE(s.loss().at(step - 1), QPointF(step, lossAt(step)));
    for (int step = 7; step <= 10; ++step)
      QCOMPARE(s.loss().at(step - 1), QPointF(step, 100.0 + step));
    QCOMPARE(s.lr().size(), 10);
    QCOMPARE(s.gradNorm().size(), 10);  // the resumed steps have no grad_norm: NaN, kept
    QVERIFY(std::isnan(s.gradNorm().at(7).y()));
    QCOMPARE(s.evalLoss().size(), 3);  // 0, 3, 6 are before the checkpoint
    QCOMPARE(s.lastStep(), 10);
    QCOMPARE(s.lastLoss(), 110.0);
    QCOMPARE(s.elapsedSeconds(), firstElapsed + 12);
    QCOMPARE(s.timeline()->rowCount(), 0);  // spans of the old process are on its own clock
    QVERIFY(s.log()->lines().contains(
        QStringLiteral("run resumed from step 6 (/models/tiny.gguf, lora)")));

    // A repeated step number without run_start also replaces (the same step written twice).
    QByteArray again;
    Line(again, "step", 13).num("loss", 1.5).integer("step", 9).end();
    s.feed(again);
    QCOMPARE(s.loss().size(), 9);
    QCOMPARE(s.loss().last(), QPointF(9, 1.5));
    again.clear();
    Line(again, "step", 14).num("loss", 1.25).integer("step", 9).end();
    s.feed(again);
    QCOMPARE(s.loss().size(), 9);
    QCOMPARE(s.loss().last(), QPointF(9, 1.25));
  }

  // A preference run's margin and accuracy from the `metrics` objects of its step and eval
  // events (docs/events.md); a supervised run has none; a resume replaces repeated steps.
  void preferenceMetricsAreCharted() {
    RunState sft;
    sft.feed(generateRun(RunSpec{}));
    QVERIFY(!sft.isPreference());
    QVERIFY(sft.margin().isEmpty() && sft.evalAccuracy().isEmpty());

    QByteArray bytes;
    RunSpec spec;
    spec.stepsTotal = 4;
    writeRunStart(bytes, spec);
    auto metrics = [](double margin, double accuracy) {
      return QStringLiteral(
                 R"({"rewards/chosen":0.5,"rewards/margins":%1,"rewards/accuracies":%2})")
          .arg(num(margin), num(accuracy))
          .toStdString();
    };
    Line(bytes, "eval", 1)
        .integer("step", 0)
        .num("loss", 0.69)
        .raw("metrics", metrics(0, 0).c_str())
        .end();
    for (int step = 1; step <= 4; ++step)
      Line(bytes, "step", 1 + step)
          .integer("step", step)
          .num("loss", 0.7 - 0.1 * step)
          .raw("metrics", metrics(0.25 * step, step >= 2 ? 1.0 : 0.5).c_str())
          .end();
    Line(bytes, "eval", 6)
        .integer("step", 4)
        .num("loss", 0.3)
        .raw("metrics", metrics(1.5, 0.75).c_str())
        .end();
    RunState s;
    s.feed(bytes);
    QVERIFY(s.isPreference());
    QCOMPARE(s.margin().size(), 4);
    QCOMPARE(s.margin().at(2), QPointF(3, 0.75));
    QCOMPARE(s.accuracy().at(0), QPointF(1, 0.5));
    QCOMPARE(s.accuracy().at(3), QPointF(4, 1.0));
    QCOMPARE(s.evalMargin().size(), 2);
    QCOMPARE(s.evalMargin().at(1), QPointF(4, 1.5));
    QCOMPARE(s.evalAccuracy().at(1), QPointF(4, 0.75));
    // A metric that is missing or not a number leaves no point (the step's earlier one, from
    // before a resume, is dropped all the same); the other still counts.
    QByteArray odd;
    Line(odd, "step", 7)
        .integer("step", 5)
        .num("loss", 0.2)
        .raw("metrics", R"({"rewards/margins":"x","rewards/accuracies":1})")
        .end();
    s.feed(odd);
    QCOMPARE(s.margin().size(), 4);
    QCOMPARE(s.accuracy().size(), 5);
    // Step 3 again (a resume from step 2): it and everything after are replaced.
    QByteArray again;
    Line(again, "step", 8)
        .integer("step", 3)
        .num("loss", 0.1)
        .raw("metrics", metrics(9, 0.25).c_str())
        .end();
    s.feed(again);
    QCOMPARE(s.margin().size(), 3);
    QCOMPARE(s.margin().last(), QPointF(3, 9));
    QCOMPARE(s.accuracy().last(), QPointF(3, 0.25));
  }

  void restartedRunStartsTheChartsAgain() {
    RunSpec spec;
    spec.steps = 20;
    spec.evalEvery = 10;
    QByteArray bytes = generateRun(spec);
    spec.steps = 4;
    bytes += generateRun(spec);  // `rondo train` again in the same folder, not resumed
    RunState s;
    s.feed(bytes);
    QCOMPARE(s.loss().size(), 4);
    QCOMPARE(s.evalLoss().size(), 1);  // step 0 of the new run
    QCOMPARE(s.samples()->rowCount(), 1);
    QCOMPARE(s.lastStep(), 4);
  }

  void signalsAndStatus() {
    RunState s;
    QSignalSpy changed(&s, &RunState::changed), ended(&s, &RunState::runEnded),
        errors(&s, &RunState::errorEvent);
    QByteArray bytes;
    RunSpec spec;
    spec.steps = 2;
    spec.runEnd = false;
    bytes = generateRun(spec);
    s.feed(QByteArrayView(bytes).first(bytes.size() - 5));  // ends mid-line
    QCOMPARE(changed.count(), 1);
    QCOMPARE(s.status(), QStringLiteral("running"));
    QCOMPARE(s.devices()[1].bytesPeak, 679101700ull + 1);  // step 2's line is not complete
    s.feed(QByteArrayView(bytes).sliced(bytes.size() - 5, 3));
    QCOMPARE(changed.count(), 1);  // still no complete line: nothing changed
    s.feed(QByteArrayView(bytes).last(2));
    QCOMPARE(changed.count(), 2);
    QCOMPARE(s.devices()[1].bytesPeak, 679101700ull + 2);

    QByteArray end;
    Line(end, "error", 5).str("message", "CUDA out of memory on device 1").end();
    Line(end, "run_end", 5).str("status", "failed").integer("steps", 2).end();
    s.feed(end);
    QCOMPARE(changed.count(), 3);
    QCOMPARE(errors.count(), 1);
    QCOMPARE(errors.at(0).at(0).toString(), QStringLiteral("CUDA out of memory on device 1"));
    QCOMPARE(ended.count(), 1);
    QCOMPARE(ended.at(0).at(0).toString(), QStringLiteral("failed"));
    QCOMPARE(s.status(), QStringLiteral("failed"));
    QCOMPARE(s.errorMessage(), QStringLiteral("CUDA out of memory on device 1"));
    s.markInterrupted();  // a finished run stays finished
    QCOMPARE(s.status(), QStringLiteral("failed"));

    s.reset();
    QCOMPARE(s.status(), QStringLiteral("empty"));
    QCOMPARE(s.loss().size(), 0);
    QCOMPARE(s.log()->rowCount(), 0);
    s.feed(bytes);
    s.markInterrupted();
    QCOMPARE(s.status(), QStringLiteral("interrupted"));
    QVERIFY(s.log()->lines().last().startsWith(QStringLiteral("run interrupted")));
  }

  // `load` events: loading() while some but not all layers are in and no step has run; a resume
  // loads again; a malformed one is skipped and counted.
  void loadingTheModel() {
    RunState s;
    QByteArray bytes;
    RunSpec spec;
    spec.steps = 0;
    spec.runEnd = false;
    writeRunStart(bytes, spec);
    s.feed(bytes);
    QVERIFY(!s.loading());
    QByteArray load;
    Line(load, "load", 1).integer("layers_done", 3).integer("layers_total", 32).end();
    s.feed(load);
    QVERIFY(s.loading());
    QCOMPARE(s.layersLoaded(), 3);
    QCOMPARE(s.layersTotal(), 32);
    load.clear();
    Line(load, "load", 2).integer("layers_done", 32).integer("layers_total", 32).end();
    Line(load, "load", 3).str("layers_done", "x").integer("layers_total", 32).end();
    s.feed(load);
    QVERIFY(!s.loading());
    QCOMPARE(s.layersLoaded(), 32);
    QCOMPARE(s.malformedLines(), 1);
    QByteArray resume;
    writeRunStart(resume, spec);
    Line(resume, "load", 1).integer("layers_done", 1).integer("layers_total", 32).end();
    s.feed(resume);
    QVERIFY(s.loading());
    QCOMPARE(s.layersLoaded(), 1);
  }

  void finishInputParsesTheLastLine() {
    QByteArray bytes;
    Line(bytes, "step", 1).num("loss", 2.5).integer("step", 1).end();
    bytes.chop(1);
    RunState s;
    s.feed(bytes);
    QCOMPARE(s.loss().size(), 0);
    s.finishInput();
    QCOMPARE(s.loss().size(), 1);
    QCOMPARE(s.lastLoss(), 2.5);
    s.finishInput();  // nothing left
    QCOMPARE(s.linesRead(), 1);
  }
};

QTEST_GUILESS_MAIN(RunStateTest)
#include "run_state_test.moc"
