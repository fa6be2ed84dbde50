#include "gui/model/run_state.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

#include <QRegularExpression>

#include "gui/model/units.h"

namespace rondo::gui {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// What a known field may hold; anything else makes the line malformed. Missing fields are
// allowed except where required (an event without them cannot be placed).
enum class Expect {
  Number,     // number or null (non-finite numbers are written as null)
  Int,        // required integer that fits int64
  IntOpt,     // integer, null or missing
  UIntOpt,    // non-negative integer, null or missing
  String,     // string, null or missing
  StringReq,  // required string
};
struct Rule {
  std::string_view key;
  Expect expect;
};
struct TypeRules {
  std::string_view type;
  std::initializer_list<Rule> rules;
};

const TypeRules kRules[] = {
    {"step",
     {{"step", Expect::Int},
      {"steps_total", Expect::IntOpt},
      {"loss", Expect::Number},
      {"lr", Expect::Number},
      {"grad_norm", Expect::Number},
      {"tokens_per_s", Expect::Number},
      {"eta_s", Expect::Number},
      {"tokens", Expect::IntOpt}}},
    {"span",
     {{"device", Expect::Int},
      {"step", Expect::Int},
      {"stage", Expect::String},
      {"first_layer", Expect::IntOpt},
      {"end_layer", Expect::IntOpt},
      {"start", Expect::Number},
      {"end", Expect::Number}}},
    {"device",
     {{"device", Expect::Int},
      {"name", Expect::String},
      {"bytes_in_use", Expect::UIntOpt},
      {"bytes_peak", Expect::UIntOpt},
      {"bytes_cap", Expect::UIntOpt},
      {"busy_fraction", Expect::Number},
      {"bytes_h2d", Expect::UIntOpt},
      {"bytes_d2h", Expect::UIntOpt}}},
    {"eval", {{"step", Expect::Int}, {"loss", Expect::Number}, {"tokens", Expect::IntOpt}}},
    {"sample", {{"step", Expect::Int}, {"prompt", Expect::String}, {"text", Expect::String}}},
    {"plan",
     {{"plan", Expect::String},
      {"devices", Expect::IntOpt},
      {"microbatches", Expect::IntOpt},
      {"predicted_step_s", Expect::Number},
      {"predicted_idle_fraction", Expect::Number},
      {"partitioner", Expect::String}}},
    {"run_start",
     {{"run_dir", Expect::String},
      {"model", Expect::String},
      {"method", Expect::String},
      {"steps_total", Expect::IntOpt},
      {"config", Expect::String},
      {"resumed_from", Expect::IntOpt},
      {"rank", Expect::IntOpt},
      {"ranks", Expect::IntOpt}}},
    {"checkpoint", {{"step", Expect::Int}, {"path", Expect::String}, {"bytes", Expect::UIntOpt}}},
    {"load", {{"layers_done", Expect::Int}, {"layers_total", Expect::Int}}},
    {"warning", {{"message", Expect::String}}},
    {"error", {{"message", Expect::String}}},
    {"run_end",
     {{"status", Expect::StringReq},
      {"steps", Expect::IntOpt},
      {"seconds", Expect::Number},
      {"export_path", Expect::String}}},
};

// What a line breaking a rule is told, after the field's name; indexed by Expect.
const char* const kExpectation[] = {
    "a number or null",                // Number
    "an integer",                      // Int
    "an integer or null",              // IntOpt
    "a non-negative integer or null",  // UIntOpt
    "a string or null",                // String
    "a string",                        // StringReq
};
static_assert(std::size(kExpectation) == static_cast<std::size_t>(Expect::StringReq) + 1);

bool fits(const JsonLine& line, const Rule& rule) {
  const JsonLine::Kind k = line.kind(rule.key);
  const bool absent = k == JsonLine::Missing || k == JsonLine::Null;
  switch (rule.expect) {
    case Expect::Number:
      return absent || k == JsonLine::Integer || k == JsonLine::Number;
    case Expect::Int:
      return k == JsonLine::Integer && line.integer(rule.key).has_value();
    case Expect::IntOpt:
      return absent || (k == JsonLine::Integer && line.integer(rule.key).has_value());
    case Expect::UIntOpt:
      return absent || (k == JsonLine::Integer && line.unsignedInteger(rule.key).has_value());
    case Expect::String:
      return absent || k == JsonLine::String;
    case Expect::StringReq:
      return k == JsonLine::String;
  }
  return false;
}

int intField(const JsonLine& line, std::string_view key) {
  auto v = line.integer(key);
  if (!v) return 0;
  return static_cast<int>(std::clamp<std::int64_t>(*v, INT_MIN, INT_MAX));
}

}  // namespace

QString scheduleInWords(const QString& plan, qint64 devices, double stepSeconds) {
  static const QRegularExpression tail(R"(T\[(\d+),(\d+)\))"), batches(R"(M=(\d+))");
  const QRegularExpressionMatch t = tail.match(plan), m = batches.match(plan);
  if (!t.hasMatch() || !m.hasMatch()) return plan;
  const qint64 layers = t.captured(2).toLongLong(), forward = plan.count("F["),
               backward = plan.count("B["), perStep = m.captured(1).toLongLong();
  auto n = [](qint64 k, const char* one, const char* many) {
    return QString("%1 %2").arg(k).arg(k == 1 ? one : many);
  };
  QString words =
      QString("the model's %1 in %2 and %3 (and the head), %4 per optimizer step")
          .arg(n(layers, "layer", "layers"), n(forward, "forward stage", "forward stages"),
               n(backward, "backward stage", "backward stages"), n(perStep, "batch", "batches"));
  static const QRegularExpression tile(R"(tile=(\d+))");
  if (const QRegularExpressionMatch k = tile.match(plan); k.hasMatch())
    words += ", the MLPs over tiles of " + k.captured(1) + " tokens (a long sequence)";
  if (devices > 0) words += ", taking turns on " + n(devices, "device", "devices");
  if (std::isfinite(stepSeconds) && stepSeconds > 0)
    words += "; about " + durationText(stepSeconds) + " per step predicted";
  return words;
}

RunState::RunState(QObject* parent)
    : QObject(parent),
      m_timeline(new TimelineModel(this)),
      m_samples(new SamplesModel(this)),
      m_log(new LogModel(this)) {
  reset();
}

void RunState::reset() {
  m_partial.clear();
  m_ownedLines.clear();
  m_pendingSpans.clear();
  m_pendingDevices.clear();
  m_pendingSamples.clear();
  m_pendingLog.clear();
  m_pendingSignals.clear();
  m_changed = false;
  m_status = QStringLiteral("empty");
  m_layersLoaded = m_layersTotal = 0;
  m_runDir.clear();
  m_model.clear();
  m_method.clear();
  m_configToml.clear();
  m_plan.clear();
  m_plannedPeaks.clear();
  m_errorMessage.clear();
  m_exportPath.clear();
  m_stepsTotal = m_lastStep = m_resumedFrom = 0;
  m_rank = 0;
  m_ranks = 1;
  m_runStarts = 0;
  m_lastLoss = m_lastEvalLoss = m_lastLr = m_lastGradNorm = m_tokensPerSecond = m_etaSeconds = kNaN;
  m_lastT = kNaN;
  m_elapsedBase = 0;
  m_malformedLines = m_unknownVersionLines = 0;
  m_firstMalformed.clear();
  m_linesRead = 0;
  for (Series* s : {&m_loss, &m_evalLoss, &m_lr, &m_gradNorm, &m_throughput, &m_margin, &m_accuracy,
                    &m_evalMargin, &m_evalAccuracy})
    s->clear();
  m_devices.clear();
  m_checkpoints.clear();
  m_timeline->clear();
  m_samples->clear();
  m_log->clear();
}

double RunState::elapsedSeconds() const {
  if (std::isnan(m_lastT)) return m_runStarts > 1 ? m_elapsedBase : kNaN;
  return m_elapsedBase + m_lastT;
}

void RunState::feed(QByteArrayView bytes) {
  const char* p = bytes.data();
  const char* const end = p + bytes.size();
  if (p == end) return;
  if (!m_partial.isEmpty()) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    if (nl == nullptr) {
      m_partial.append(p, end - p);
      return;
    }
    m_partial.append(p, nl - p);
    // The completed line moves to storage that outlives this call's pending views.
    m_ownedLines.push_back(std::move(m_partial));
    m_partial = QByteArray();
    const QByteArray& owned = m_ownedLines.back();
    processLine(Line(owned.constData(), static_cast<std::size_t>(owned.size())));
    p = nl + 1;
  }
  while (p < end) {
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', end - p));
    if (nl == nullptr) {
      m_partial = QByteArray(p, end - p);
      break;
    }
    processLine(Line(p, static_cast<std::size_t>(nl - p)));
    p = nl + 1;
  }
  flushPending();
  emitPending();
}

void RunState::finishInput() {
  if (m_partial.isEmpty()) return;
  m_ownedLines.push_back(std::move(m_partial));
  m_partial = QByteArray();
  const QByteArray& owned = m_ownedLines.back();
  processLine(Line(owned.constData(), static_cast<std::size_t>(owned.size())));
  flushPending();
  emitPending();
}

void RunState::markInterrupted() {
  if (m_status != QLatin1String("running")) return;
  m_status = QStringLiteral("interrupted");
  m_log->appendLine(tr("run interrupted: the process ended without finishing the run"));
  emit changed();
}

QString RunState::schemaProblem(std::string_view type) const {
  if (m_line.kind("t") != JsonLine::Missing && !m_line.isNumeric("t") &&
      m_line.kind("t") != JsonLine::Null)
    return tr("\"t\" must be a number or null");
  if (m_line.kind("time") != JsonLine::Missing && m_line.kind("time") != JsonLine::String)
    return tr("\"time\" must be a string");
  for (const TypeRules& rules : kRules) {
    if (rules.type != type) continue;
    for (const Rule& r : rules.rules)
      if (!fits(m_line, r))
        return tr("\"%1\" of a %2 event must be %3")
            .arg(QLatin1StringView(r.key.data(), static_cast<qsizetype>(r.key.size())),
                 QLatin1StringView(type.data(), static_cast<qsizetype>(type.size())),
                 QLatin1StringView(kExpectation[static_cast<int>(r.expect)]));
    return {};
  }
  return {};  // an unknown type: ignored, not malformed
}

void RunState::skipMalformed(const QString& what) {
  if (m_malformedLines++ == 0) m_firstMalformed = tr("line %1: %2").arg(m_linesRead).arg(what);
}

void RunState::processLine(Line line) {
  ++m_linesRead;
  m_changed = true;
  if (line.find_first_not_of(" \t\r") == Line::npos) return;  // a blank line is not an event
  if (!m_line.parse(line)) {
    skipMalformed(m_line.error());
    return;
  }
  if (!m_line.isNumeric("v")) {
    skipMalformed(tr("no schema version (\"v\", a number)"));
    return;
  }
  if (m_line.number("v") != 1) {
    ++m_unknownVersionLines;
    return;
  }
  if (m_line.kind("type") != JsonLine::String) {
    skipMalformed(tr("no event type (\"type\", a string)"));
    return;
  }
  const std::string_view type = m_line.stringView("type");
  if (const QString problem = schemaProblem(type); !problem.isEmpty()) {
    skipMalformed(problem);
    return;
  }
  const double t = m_line.number("t");

  // The most frequent types first.
  bool ok = true;
  if (type == "span") {
    ok = onSpan(line);
  } else if (type == "device") {
    ok = onDevice(line);
  } else if (type == "step") {
    onStep();
  } else if (type == "eval") {
    onEval();
  } else if (type == "sample") {
    onSample();
  } else if (type == "plan") {
    onPlan();
  } else if (type == "checkpoint") {
    onCheckpoint();
  } else if (type == "load") {
    onLoad();
  } else if (type == "warning") {
    m_pendingLog.append(tr("warning: %1").arg(m_line.string("message")));
  } else if (type == "error") {
    m_errorMessage = m_line.string("message");
    m_pendingLog.append(tr("error: %1").arg(m_errorMessage));
    m_pendingSignals.emplace_back(Signal::Error, m_errorMessage);
  } else if (type == "run_start") {
    onRunStart();
  } else if (type == "run_end") {
    onRunEnd();
  } else {
    return;  // unknown type: ignored
  }
  if (!ok) {
    skipMalformed(tr("\"device\" of a %1 event is out of range")
                      .arg(QLatin1StringView(type.data(), static_cast<qsizetype>(type.size()))));
    return;
  }
  if (std::isfinite(t)) m_lastT = t;
  if (m_status == QLatin1String("empty")) m_status = QStringLiteral("running");
}

void RunState::onRunStart() {
  const qint64 resumed = std::max<qint64>(0, m_line.integer("resumed_from").value_or(0));
  if (m_runStarts > 0 && std::isfinite(m_lastT)) m_elapsedBase += m_lastT;
  m_lastT = kNaN;
  ++m_runStarts;
  m_runDir = m_line.string("run_dir");
  m_model = m_line.string("model");
  m_method = m_line.string("method");
  m_configToml = m_line.string("config");
  if (auto total = m_line.integer("steps_total")) m_stepsTotal = *total;
  m_resumedFrom = resumed;
  m_rank = static_cast<int>(std::max<qint64>(0, m_line.integer("rank").value_or(0)));
  m_ranks = static_cast<int>(std::clamp<qint64>(m_line.integer("ranks").value_or(1), 1, 4096));
  m_layersLoaded = m_layersTotal = 0;  // a resume loads again
  m_status = QStringLiteral("running");
  m_errorMessage.clear();
  m_exportPath.clear();
  const QString logLine =
      resumed > 0 ? tr("run resumed from step %1 (%2, %3)").arg(resumed).arg(m_model, m_method)
                  : tr("run started: %1 (%2), %3 steps").arg(m_model, m_method).arg(m_stepsTotal);

  // The spans of an earlier segment are on another clock: the timeline restarts.
  m_pendingSpans.clear();
  flushPending();
  m_timeline->clear();
  if (m_runStarts > 1 || resumed > 0) {
    // The steps after the checkpoint come again (all of them when a run restarts from scratch).
    const qint64 cut = resumed > 0 ? resumed + 1 : 0;
    for (Series* s : {&m_loss, &m_evalLoss, &m_lr, &m_gradNorm, &m_throughput, &m_margin,
                      &m_accuracy, &m_evalMargin, &m_evalAccuracy})
      s->truncateFrom(static_cast<double>(cut));
    m_samples->removeAfterStep(cut - 1);
    m_lastStep = std::min(m_lastStep, resumed);
    auto lastOf = [this](const Series& s) {
      return !s.isEmpty() && s.last().x() == static_cast<double>(m_lastStep) ? s.last().y() : kNaN;
    };
    m_lastLoss = lastOf(m_loss);
    m_lastLr = lastOf(m_lr);
    m_lastGradNorm = lastOf(m_gradNorm);
    m_tokensPerSecond = lastOf(m_throughput);
    m_lastEvalLoss = m_evalLoss.isEmpty() ? kNaN : m_evalLoss.last().y();
    m_etaSeconds = kNaN;
  }
  m_pendingLog.append(logLine);
}

void RunState::onPlan() {
  const QString plan = m_line.string("plan");
  m_plannedPeaks = m_line.numbers("predicted_peak_bytes");
  if (plan == m_plan) return;
  m_plan = plan;
  const QString partitioner = m_line.string("partitioner");
  const QString words = scheduleInWords(plan, m_line.integer("devices").value_or(0),
                                        m_line.number("predicted_step_s"));
  m_pendingLog.append(partitioner.isEmpty() ? tr("schedule: %1").arg(words)
                                            : tr("schedule (%1): %2").arg(partitioner, words));
}

void RunState::onStep() {
  const qint64 step = *m_line.integer("step");
  const double x = static_cast<double>(step);
  m_lastLoss = m_line.number("loss");
  m_lastLr = m_line.number("lr");
  m_lastGradNorm = m_line.number("grad_norm");
  m_tokensPerSecond = m_line.number("tokens_per_s");
  m_etaSeconds = m_line.number("eta_s");
  const std::pair<Series*, double> points[] = {{&m_loss, m_lastLoss},
                                               {&m_lr, m_lastLr},
                                               {&m_gradNorm, m_lastGradNorm},
                                               {&m_throughput, m_tokensPerSecond}};
  for (auto [series, y] : points)
    put(*series, x, y);
  putMetrics(m_margin, m_accuracy, x);
  m_lastStep = step;
  if (auto total = m_line.integer("steps_total")) m_stepsTotal = *total;
}

void RunState::onEval() {
  const double x = static_cast<double>(*m_line.integer("step"));
  m_lastEvalLoss = m_line.number("loss");
  put(m_evalLoss, x, m_lastEvalLoss);
  putMetrics(m_evalMargin, m_evalAccuracy, x);
}

void RunState::put(Series& series, double x, double y, bool pointIfNaN) {
  // A repeated step (a resumed run) replaces the earlier one and everything after it.
  if (!series.isEmpty() && series.maxX() >= x) series.truncateFrom(x);
  if (pointIfNaN || !std::isnan(y)) series.append(x, y);
}

void RunState::putMetrics(Series& margin, Series& accuracy, double x) {
  // A supervised run's events have no metrics: its preference series stay empty.
  for (auto [series, key] :
       {std::pair{&margin, "rewards/margins"}, std::pair{&accuracy, "rewards/accuracies"}})
    put(*series, x, m_line.number("metrics", key), false);
}

void RunState::onSample() {
  m_pendingSamples.append(
      SampleItem{*m_line.integer("step"), m_line.string("prompt"), m_line.string("text")});
}

bool RunState::onDevice(Line line) {
  const std::int64_t device = *m_line.integer("device");
  if (device < 0 || device > INT_MAX) return false;
  // Only the latest event per device is parsed further, at the end of the feed.
  for (auto& [d, l] : m_pendingDevices)
    if (d == device) {
      l = line;
      return true;
    }
  m_pendingDevices.emplace_back(static_cast<int>(device), line);
  return true;
}

bool RunState::onSpan(Line line) {
  const std::int64_t device = *m_line.integer("device");
  if (device < 0 || device > INT_MAX) return false;
  // Only the last capacity() spans are parsed further, at the end of the feed.
  m_pendingSpans.push_back(line);
  const std::size_t capacity = static_cast<std::size_t>(m_timeline->capacity());
  if (m_pendingSpans.size() >= 2 * capacity)
    m_pendingSpans.erase(m_pendingSpans.begin(), m_pendingSpans.end() - capacity);
  return true;
}

void RunState::onLoad() {
  m_layersLoaded = std::max<qint64>(0, m_line.integer("layers_done").value_or(0));
  m_layersTotal = std::max<qint64>(m_layersLoaded, m_line.integer("layers_total").value_or(0));
  m_changed = true;
}

void RunState::onCheckpoint() {
  CheckpointItem item{*m_line.integer("step"), m_line.string("path"),
                      m_line.unsignedInteger("bytes").value_or(0)};
  auto same = std::find_if(m_checkpoints.begin(), m_checkpoints.end(),
                           [&](const CheckpointItem& c) { return c.step == item.step; });
  if (same != m_checkpoints.end())
    *same = item;
  else
    m_checkpoints.append(item);
  m_pendingLog.append(tr("checkpoint at step %1: %2 (%3)")
                          .arg(item.step)
                          .arg(item.path, bytesText(static_cast<double>(item.bytes))));
}

void RunState::onRunEnd() {
  m_status = m_line.string("status");
  m_exportPath = m_line.string("export_path");
  const double seconds = m_line.number("seconds");
  const qint64 steps = m_line.integer("steps").value_or(m_lastStep);
  QString line = tr("run %1 after %2 steps").arg(m_status).arg(steps);
  if (std::isfinite(seconds)) line += tr(" in %1 s").arg(seconds, 0, 'f', 1);
  m_pendingLog.append(line);
  if (!m_exportPath.isEmpty()) m_pendingLog.append(tr("exported to %1").arg(m_exportPath));
  m_pendingSignals.emplace_back(Signal::RunEnded, m_status);
}

void RunState::flushPending() {
  JsonLine& scratch = m_scratch;  // m_line may still hold the line being processed (run_start)
  if (!m_pendingDevices.empty()) {
    for (const auto& [device, line] : m_pendingDevices) {
      if (!scratch.parse(line)) continue;  // cannot happen: parsed once already
      DeviceStatus d;
      d.device = device;
      d.name = scratch.string("name");
      d.bytesInUse = scratch.unsignedInteger("bytes_in_use").value_or(0);
      d.bytesPeak = scratch.unsignedInteger("bytes_peak").value_or(0);
      d.bytesCap = scratch.unsignedInteger("bytes_cap").value_or(0);
      d.busyFraction = scratch.number("busy_fraction");
      d.bytesH2d = scratch.unsignedInteger("bytes_h2d").value_or(0);
      d.bytesD2h = scratch.unsignedInteger("bytes_d2h").value_or(0);
      m_devices.insert(device, d);
    }
    m_pendingDevices.clear();
  }
  if (!m_pendingSpans.empty()) {
    const std::size_t capacity = static_cast<std::size_t>(m_timeline->capacity());
    const std::size_t first =
        m_pendingSpans.size() > capacity ? m_pendingSpans.size() - capacity : 0;
    QList<SpanItem> spans;
    spans.reserve(static_cast<qsizetype>(m_pendingSpans.size() - first));
    for (std::size_t i = first; i < m_pendingSpans.size(); ++i) {
      if (!scratch.parse(m_pendingSpans[i])) continue;
      SpanItem s;
      s.device = intField(scratch, "device");
      s.step = scratch.integer("step").value_or(0);
      s.stage = scratch.string("stage");
      s.firstLayer = intField(scratch, "first_layer");
      s.endLayer = intField(scratch, "end_layer");
      s.start = scratch.number("start");
      s.end = scratch.number("end");
      spans.append(std::move(s));
    }
    m_pendingSpans.clear();
    m_timeline->appendSpans(std::move(spans));
  }
  if (!m_pendingSamples.isEmpty()) {
    m_samples->appendSamples(m_pendingSamples);
    m_pendingSamples.clear();
  }
  if (!m_pendingLog.isEmpty()) {
    m_log->appendLines(m_pendingLog);
    m_pendingLog.clear();
  }
  m_ownedLines.clear();
}

void RunState::emitPending() {
  // Emitted after the state is complete, so a slot sees every line of this feed.
  const bool changedNow = std::exchange(m_changed, false);
  auto signalsNow = std::exchange(m_pendingSignals, {});
  if (changedNow) emit changed();
  for (const auto& [kind, text] : signalsNow) {
    if (kind == Signal::Error)
      emit errorEvent(text);
    else
      emit runEnded(text);
  }
}

}  // namespace rondo::gui
