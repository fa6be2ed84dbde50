// Writes event lines the way engine/events.cpp does (common members t, time, type, v first, then
// the event's own members in key order; numbers shortest round-trip, so a reader gets the exact
// doubles back), and whole realistic runs. Used by the gui model tests.
#pragma once

#include <QByteArray>
#include <QString>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <string_view>

namespace rondo::gui::test {

inline void appendNumber(QByteArray& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr - buf);
}

inline void appendInt(QByteArray& out, long long v) {
  char buf[32];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, r.ptr - buf);
}

inline void appendString(QByteArray& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        out += c;
    }
  }
  out += '"';
}

// One event line under construction: Line(out, "step", t).num("loss", 3.2).integer("step", 4).end()
class Line {
 public:
  Line(QByteArray& out, const char* type, double t) : m_out(out) {
    m_out += "{\"t\":";
    appendNumber(m_out, t);
    m_out += ",\"time\":\"2026-12-03T00:11:05.129Z\",\"type\":\"";
    m_out += type;
    m_out += "\",\"v\":1";
  }
  Line& num(const char* key, double v) {
    key_(key);
    appendNumber(m_out, v);
    return *this;
  }
  Line& integer(const char* key, long long v) {
    key_(key);
    appendInt(m_out, v);
    return *this;
  }
  Line& str(const char* key, std::string_view v) {
    key_(key);
    appendString(m_out, v);
    return *this;
  }
  Line& raw(const char* key, const char* json) {
    key_(key);
    m_out += json;
    return *this;
  }
  void end() { m_out += "}\n"; }

 private:
  void key_(const char* key) {
    m_out += ",\"";
    m_out += key;
    m_out += "\":";
  }
  QByteArray& m_out;
};

// The values the generated run has at each step, so tests can check them exactly.
inline double lossAt(long long step) {
  return 0.5 + 3.5 * std::exp(-step / 2000.0) + 0.05 * std::sin(step * 0.7);
}
inline double lrAt(long long step) {
  return 2e-3 * (0.5 + 0.5 * std::cos(step * 1e-4));
}
inline double gradNormAt(long long step) {
  return 1.0 + 0.25 * std::cos(step * 0.3);
}
inline double tokensPerSecondAt(long long step) {
  return 1800.0 + (step % 17);
}
inline double evalLossAt(long long step) {
  return lossAt(step) + 0.125;
}

struct RunSpec {
  long long steps = 100;      // steps written (1..steps)
  long long stepsTotal = 0;   // 0 = steps
  long long firstStep = 1;    // > 1 for a resumed segment
  long long resumedFrom = 0;  // run_start's resumed_from
  int devices = 2;
  int spansPerStep = 5;     // per step, spread over the devices
  long long evalEvery = 0;  // also at step 0 when > 0 (and firstStep == 1)
  long long checkpointEvery = 0;
  bool runEnd = true;
  const char* status = "completed";
  bool preference = false;  // steps and evaluations carry a preference run's metrics
};

// A preference run's metrics at a step (docs/events.md): the margin rising, the accuracy too.
inline std::string preferenceMetricsAt(long long step) {
  return "{\"rewards/margins\":" + std::to_string(0.05 * static_cast<double>(step)) +
         ",\"rewards/accuracies\":" + std::to_string(std::min(1.0, 0.5 + 0.01 * step)) + "}";
}

inline void writeRunStart(QByteArray& out, const RunSpec& spec) {
  Line(out, "run_start", 1.5e-05)
      .str("config", "[model]\npath = \"/models/tiny.gguf\"\n\n[training]\nmethod = \"lora\"\n")
      .str("method", "lora")
      .str("model", "/models/tiny.gguf")
      .integer("resumed_from", spec.resumedFrom)
      .str("run_dir", "/tmp/run \"quoted\"")
      .integer("steps_total", spec.stepsTotal ? spec.stepsTotal : spec.steps)
      .end();
}

inline void writeEvalAndSamples(QByteArray& out, long long step, double t,
                                bool preference = false) {
  Line(out, "sample", t)
      .str("prompt", "What is the capital of France?")
      .integer("step", step)
      .str("text", "Paris \xe2\x80\x94 \\o/")
      .end();
  Line eval(out, "eval", t);
  eval.num("loss", evalLossAt(step)).integer("step", step).integer("tokens", 46);
  if (preference) eval.raw("metrics", preferenceMetricsAt(step).c_str());
  eval.end();
}

// A whole run (or a resumed segment): run_start, plan, then per step its spans, the step, one
// device event per device, and evals, samples and checkpoints at their intervals; run_end.
inline QByteArray generateRun(const RunSpec& spec) {
  QByteArray out;
  const long long total = spec.stepsTotal ? spec.stepsTotal : spec.steps;
  writeRunStart(out, spec);
  double t = 2.0;
  if (spec.evalEvery > 0 && spec.firstStep == 1) writeEvalAndSamples(out, 0, t, spec.preference);
  Line(out, "plan", t)
      .integer("devices", spec.devices)
      .integer("microbatches", 4)
      .str("partitioner", "ours")
      .str("plan", "F[0,15) F[15,31) T[31,32) B[25,31) B[17,25) B[9,17) B[0,9) M=4 stage")
      .num("predicted_idle_fraction", 0.125)
      .raw("predicted_peak_bytes", "[739232768,739232768]")
      .num("predicted_step_s", 1.0654084660581393)
      .end();
  static const char* kStages[] = {"F0", "F1", "T", "B1", "B0"};
  unsigned long long h2d = 0;
  for (long long step = spec.firstStep; step <= spec.steps; ++step) {
    for (int i = 0; i < spec.spansPerStep; ++i) {
      const double start = t + 0.01 * i;
      Line(out, "span", start + 0.01)
          .integer("device", i % spec.devices)
          .num("end", start + 0.01)
          .integer("end_layer", 8 * (i % 4) + 8)
          .integer("first_layer", 8 * (i % 4))
          .str("stage", kStages[i % 5])
          .num("start", start)
          .integer("step", step)
          .end();
    }
    t += 0.1;
    Line line(out, "step", t);
    line.num("eta_s", (total - step) * 0.1)
        .num("grad_norm", gradNormAt(step))
        .num("loss", lossAt(step))
        .num("lr", lrAt(step))
        .integer("step", step)
        .integer("steps_total", total)
        .integer("tokens", 512)
        .num("tokens_per_s", tokensPerSecondAt(step));
    if (spec.preference) line.raw("metrics", preferenceMetricsAt(step).c_str());
    line.end();
    h2d += 1553767680ull;
    for (int d = 0; d < spec.devices; ++d) {
      Line(out, "device", t)
          .num("busy_fraction", 0.5 + 0.001 * (step % 400))
          .integer("bytes_cap", 25275973632ll)
          .integer("bytes_d2h", static_cast<long long>(step) * 26615812ll)
          .integer("bytes_h2d", static_cast<long long>(h2d))
          .integer("bytes_in_use", 555887616ll + d)
          .integer("bytes_peak", 679101700ll + step)
          .integer("device", d)
          .str("name", d == 0 ? "NVIDIA GeForce RTX 4090" : "NVIDIA GeForce RTX 3090")
          .end();
    }
    if (spec.evalEvery > 0 && step % spec.evalEvery == 0)
      writeEvalAndSamples(out, step, t, spec.preference);
    if (spec.checkpointEvery > 0 && step % spec.checkpointEvery == 0) {
      QByteArray path = "/tmp/run/checkpoints/step-" + QByteArray::number(step);
      Line(out, "checkpoint", t)
          .integer("bytes", 58788481)
          .str("path", std::string_view(path.constData(), path.size()))
          .integer("step", step)
          .end();
    }
  }
  if (spec.runEnd) {
    Line(out, "run_end", t)
        .str("export_path", "/tmp/run/adapter")
        .num("seconds", t)
        .str("status", spec.status)
        .integer("steps", spec.steps)
        .end();
  }
  return out;
}

}  // namespace rondo::gui::test
