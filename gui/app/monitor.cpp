#include "gui/app/monitor.h"

#include <QChart>
#include <QChartView>
#include <QDir>
#include <QFileInfo>
#include <QFontMetricsF>
#include <QGridLayout>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLineSeries>
#include <QListView>
#include <QLocale>
#include <QProgressBar>
#include <QPushButton>
#include <QRegularExpression>
#include <QScrollArea>
#include <QSplitter>
#include <QTabWidget>
#include <QTableWidget>
#include <QTimer>
#include <QVBoxLayout>
#include <QValueAxis>
#include <climits>
#include <cmath>
#include <csignal>

#include "gui/app/chat_panel.h"
#include "gui/app/export_dialog.h"
#include "gui/app/format.h"
#include "gui/app/rondo_cli.h"
#include "gui/app/timeline_view.h"
#include "gui/model/axis_ticks.h"
#include "gui/model/event_tail.h"
#include "gui/model/run_folder.h"
#include "gui/model/run_state.h"
#include "gui/model/series.h"

namespace rondo::gui {
namespace {

const char* const kStopTip =
    "Finish the steps under way, write a checkpoint, then end; click again to end at once";

QString num(double v, int prec = 4) {
  return std::isfinite(v) ? QString::number(v, 'g', prec) : QStringLiteral("–");
}

// A speed as people read one: whole tokens/s in groups ("1,204"), one decimal under 100 ("71.0").
QString rate(double v) {
  if (!std::isfinite(v)) return QStringLiteral("–");
  return v >= 100 ? QLocale().toString(std::llround(v)) : QLocale().toString(v, 'f', 1);
}

QString eta(double s) {
  if (!std::isfinite(s) || s < 0) return "–";
  const qint64 t = static_cast<qint64>(s + 0.5);
  return t >= 3600 ? QString("%1h%2m").arg(t / 3600).arg(t / 60 % 60, 2, 10, QChar('0'))
                   : QString("%1m%2s").arg(t / 60).arg(t % 60, 2, 10, QChar('0'));
}

// A line `rondo train` printed, in the GUI's words where it gives advice for a terminal: the
// command to resume is File ▸ Resume a stopped run here, and Ctrl-C is the Stop button.
QString inGuiWords(QString line) {
  static const QRegularExpression resume(R"(`rondo train --resume ([^`]+)`)");
  line.replace(resume, R"(File ▸ Resume a stopped run (`rondo train --resume \1`))");
  line.replace("(Ctrl-C again to exit at once)", "(Stop now ends at once)");
  return line;
}

QChart* makeChart(const QString& title, std::initializer_list<QLineSeries*> series) {
  auto* chart = new QChart;
  chart->setTitle(title);
  chart->legend()->setVisible(series.size() > 1);
  // Beside the plot, not above it: above, it took the height the step axis needs for its labels
  // (they were elided to "...").
  chart->legend()->setAlignment(Qt::AlignRight);
  chart->setMargins(QMargins(4, 4, 4, 4));
  // Ticks at the multiples of an interval fill() chooses (axis_ticks.h), not a fixed count: five
  // ticks over steps 0..3 labelled "%d" read "0 0 1 2 3".
  auto* x = new QValueAxis;
  x->setTitleText("step");
  auto* y = new QValueAxis;
  for (QValueAxis* a : {x, y}) {
    a->setTickType(QValueAxis::TicksDynamic);
    a->setTickAnchor(0);
  }
  chart->addAxis(x, Qt::AlignBottom);
  chart->addAxis(y, Qt::AlignLeft);
  for (QLineSeries* s : series) {
    chart->addSeries(s);
    s->attachAxis(x);
    s->attachAxis(y);
  }
  return chart;
}

QValueAxis* valueAxis(QChart* chart, Qt::Orientation o) {
  const QList<QAbstractAxis*> axes = chart->axes(o);
  return axes.isEmpty() ? nullptr : qobject_cast<QValueAxis*>(axes.first());
}

// The pixels along `a` its labels have: the plot's width or height (a guess before the chart is
// first laid out).
double axisLength(QChart* chart, const QValueAxis* a) {
  const QRectF plot = chart->plotArea();
  if (a->orientation() == Qt::Horizontal) return plot.width() >= 40 ? plot.width() : 400;
  return plot.height() >= 40 ? plot.height() : 120;
}

// Whether the labels of `t` fit `length` pixels along `a` with `gap` pixels between them (the
// step axis elides a label wider than its share of the axis to "...").
bool fits(const QValueAxis* a, const AxisTicks& t, double length, double gap) {
  const QFontMetricsF fm(a->labelsFont());
  const QStringList labels = tickLabels(t);
  double extent = 0;
  for (const QString& l : labels)
    extent = std::max(extent,
                      a->orientation() == Qt::Horizontal ? fm.horizontalAdvance(l) : fm.height());
  return labels.size() * (extent + gap) <= length;
}

// A comfortable gap between labels: two digits across, half a label's height up the value axis.
double comfortableGap(const QValueAxis* a) {
  const QFontMetricsF fm(a->labelsFont());
  return a->orientation() == Qt::Horizontal ? 2 * fm.horizontalAdvance('0') : fm.height() / 2;
}

// The most ticks over [lo, hi] whose labels fit `a` comfortably: at most 8 steps, 6 values.
AxisTicks fitted(QChart* chart, const QValueAxis* a, double lo, double hi) {
  const bool steps = a->orientation() == Qt::Horizontal;
  const double length = axisLength(chart, a), gap = comfortableGap(a);
  AxisTicks t;
  for (int n = steps ? 8 : 6; n >= 2; --n) {
    t = steps ? stepTicks(lo, hi, n) : valueTicks(lo, hi, n);
    if (fits(a, t, length, gap)) break;
  }
  return t;
}

AxisTicks current(const QValueAxis* a) {
  AxisTicks t;
  t.min = a->min();
  t.max = a->max();
  t.interval = a->tickInterval();
  t.format = a->labelFormat();
  return t;
}

// Range, interval and label format together, every time: what the axis draws is t's labels and
// no others. The coarser interval goes first, so that no moment pairs a wide range with a fine
// interval (a run of 100000 steps after one of 10: 100000 tick labels, briefly).
void apply(QValueAxis* a, const AxisTicks& t) {
  const bool coarser = t.interval >= a->tickInterval();
  if (coarser) a->setTickInterval(t.interval);
  a->setRange(t.min, t.max);
  if (!coarser) a->setTickInterval(t.interval);
  a->setLabelFormat(t.format);
}

// After the plot area changed (the window resized, the first layout): new ticks when the labels
// would now collide, or twice as many fit. Not for every pixel: the ticks move the plot area in
// turn (the value axis's labels take its width), and must not see-saw.
void refitTicks(QChart* chart) {
  for (Qt::Orientation o : {Qt::Horizontal, Qt::Vertical}) {
    QValueAxis* a = valueAxis(chart, o);
    if (!a) continue;
    const AxisTicks now = current(a);
    const AxisTicks want = fitted(chart, a, now.min, now.max);
    if (want.interval == now.interval && want.format == now.format) continue;
    const bool crowded = !fits(a, now, axisLength(chart, a), 2);
    if (crowded || tickValues(want).size() >= 2 * tickValues(now).size()) apply(a, want);
  }
}

// One line of a chart: its points from `series`, drawn as dots too when `dots` (or when there is
// a single point, which a line alone does not show).
struct Line {
  QLineSeries* line;
  const Series* series;
  bool dots = false;
};

// Fills each line from its series, decimated to about the chart's width, and fits the axes to all
// of them (the lines of one chart share axes).
void fill(QChart* chart, std::initializer_list<Line> all) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  const int width = std::max(200, static_cast<int>(chart->plotArea().width()));
  for (const Line& l : all) {
    const Series* s = l.series;
    if (s->isEmpty()) {
      l.line->clear();
      continue;
    }
    x0 = std::min(x0, s->minX());
    x1 = std::max(x1, s->maxX());
    y0 = std::min(y0, s->minY());
    y1 = std::max(y1, s->maxY());
  }
  for (const Line& l : all) {
    if (l.series->isEmpty()) continue;
    const QList<QPointF> shown = l.series->decimated(x0, x1, width);
    l.line->setPointsVisible(l.dots || shown.size() == 1);
    l.line->replace(shown);
  }
  // Nothing yet (a run just opened): 0..1, not the axes of the run shown before.
  const auto [xLo, xHi] = std::isfinite(x0) ? stepRange(x0, x1) : std::pair(0.0, 1.0);
  const auto [yLo, yHi] = std::isfinite(y0) ? valueRange(y0, y1) : std::pair(0.0, 1.0);
  if (QValueAxis* x = valueAxis(chart, Qt::Horizontal)) apply(x, fitted(chart, x, xLo, xHi));
  if (QValueAxis* y = valueAxis(chart, Qt::Vertical)) apply(y, fitted(chart, y, yLo, yHi));
}

}  // namespace

MonitorWidget::MonitorWidget(QWidget* parent) : QWidget(parent) {
  setObjectName("monitor");
  m_state = new RunState(this);
  m_tail = new EventTail(m_state, this);
  m_openTimer = new QTimer(this);
  m_openTimer->setInterval(200);
  connect(m_openTimer, &QTimer::timeout, this, &MonitorWidget::tryOpenEvents);
  m_refreshTimer = new QTimer(this);
  m_refreshTimer->setSingleShot(true);
  m_refreshTimer->setInterval(250);
  connect(m_refreshTimer, &QTimer::timeout, this, &MonitorWidget::refresh);
  connect(m_state, &RunState::changed, this, &MonitorWidget::scheduleRefresh);
  // A run this monitor launched ends when its process does (onChildFinished); a resumed run's file
  // also holds the earlier run's run_end, read while the new one is still going.
  connect(m_state, &RunState::runEnded, this, [this](const QString& status) {
    refresh();
    if (!childRunning()) emit finished(status);
  });

  m_title = new QLabel("No run");
  m_title->setObjectName("runTitle");
  QFont f = m_title->font();
  f.setBold(true);
  m_title->setFont(f);
  m_status = new QLabel;
  m_status->setObjectName("runStatus");
  m_status->setTextInteractionFlags(Qt::TextSelectableByMouse);
  m_progress = new QProgressBar;
  m_progress->setObjectName("runProgress");
  m_progress->setRange(0, 1);
  m_progress->setValue(0);
  m_banner = new QLabel;
  m_banner->setObjectName("errorBanner");
  m_banner->setWordWrap(true);
  m_banner->setStyleSheet("background:#fde7e9; color:#8a0012; padding:6px");
  m_banner->hide();
  m_stop = new QPushButton("Stop");
  m_stop->setObjectName("stopButton");
  m_stop->setToolTip(kStopTip);
  m_stopSave = new QPushButton("Stop and save");
  m_stopSave->setObjectName("stopSaveButton");
  m_stopSave->setToolTip(
      "Finish the steps under way, write a checkpoint, then end (resumable from the File menu)");
  m_stop->setEnabled(false);
  m_stopSave->setEnabled(false);
  connect(m_stop, &QPushButton::clicked, this, &MonitorWidget::stop);
  connect(m_stopSave, &QPushButton::clicked, this, &MonitorWidget::stopAndSave);
  m_export = new QPushButton("Export…");
  m_export->setObjectName("exportButton");
  m_export->setToolTip(
      "Write the newest checkpoint as a LoRA adapter (PEFT or llama.cpp), a merged Hugging Face "
      "folder or a merged GGUF");
  m_export->setEnabled(false);
  connect(m_export, &QPushButton::clicked, this, &MonitorWidget::exportRun);

  m_loss = new QLineSeries;
  m_loss->setName("training loss");
  m_eval = new QLineSeries;
  m_eval->setName("validation loss");
  m_lr = new QLineSeries;
  m_norm = new QLineSeries;
  m_speed = new QLineSeries;
  m_lossChart = makeChart("Loss", {m_loss, m_eval});
  m_lrChart = makeChart("Learning rate", {m_lr});
  m_normChart = makeChart("Gradient norm (before clipping)", {m_norm});
  m_speedChart = makeChart("Tokens/s", {m_speed});
  // A preference run's: the reward margin (chosen minus rejected) and the accuracy (the share of
  // pairs whose chosen answer scores higher), training and validation, as TRL logs them.
  auto named = [](const char* name) {
    auto* l = new QLineSeries;
    l->setName(name);
    return l;
  };
  m_margin = named("training");
  m_evalMargin = named("validation");
  m_accuracy = named("training");
  m_evalAccuracy = named("validation");
  m_marginChart = makeChart("Reward margin (chosen − rejected)", {m_margin, m_evalMargin});
  m_accuracyChart = makeChart("Preference accuracy", {m_accuracy, m_evalAccuracy});
  auto* chartsPane = new QWidget;
  auto* charts = new QGridLayout(chartsPane);
  charts->setContentsMargins(0, 0, 0, 0);
  int i = 0;
  for (QChart* c :
       {m_lossChart, m_lrChart, m_normChart, m_speedChart, m_marginChart, m_accuracyChart}) {
    auto* view = new QChartView(c);
    view->setRenderHint(QPainter::Antialiasing);
    // Room for the chart's title, a plot with three value labels, the step axis and its title.
    view->setMinimumSize(240, 170);
    charts->addWidget(view, i / 2, i % 2);
    connect(
        c, &QChart::plotAreaChanged, this, [c] { refitTicks(c); }, Qt::QueuedConnection);
    if (c == m_marginChart) m_marginView = view;
    if (c == m_accuracyChart) m_accuracyView = view;
    ++i;
  }
  m_marginView->setObjectName("marginChart");
  m_accuracyView->setObjectName("accuracyChart");
  m_marginView->hide();  // until a run's events carry preference metrics
  m_accuracyView->hide();

  m_devices = new QTableWidget(0, 6);
  m_devices->setObjectName("deviceTable");
  m_devices->setHorizontalHeaderLabels({"Device", "In use after the step", "Peak (planned)", "Cap",
                                        "Busy", "Link (host→dev / dev→host)"});
  m_devices->horizontalHeaderItem(1)->setToolTip(
      "What the device holds between steps: the memory it works in during a step is freed by then");
  m_devices->horizontalHeaderItem(2)->setToolTip(
      "The most the device has held in this run, and the plan's prediction for it");
  m_devices->horizontalHeader()->setStretchLastSection(true);
  m_devices->verticalHeader()->hide();
  m_devices->setMaximumHeight(120);
  m_timeline = new TimelineView;
  m_timeline->setModel(m_state->timeline());
  m_samples = new QListView;
  m_samples->setObjectName("samples");
  m_samples->setModel(m_state->samples());
  m_samples->setWordWrap(true);
  m_log = new QListView;
  m_log->setObjectName("log");
  m_log->setModel(m_state->log());
  m_ranks = new QTableWidget(0, 6);
  m_ranks->setObjectName("rankTable");
  m_ranks->setHorizontalHeaderLabels(
      {"Rank", "Status", "Step", "Loss", "Tokens/s", "Device peak (largest)"});
  m_ranks->horizontalHeaderItem(3)->setToolTip(
      "Every rank reports the loss of the whole step (summed over the ranks), so they agree");
  m_ranks->horizontalHeader()->setStretchLastSection(true);
  m_ranks->verticalHeader()->hide();
  m_ranks->hide();  // a tab only for a run on several ranks
  auto* tabs = new QTabWidget;
  m_tabs = tabs;
  tabs->addTab(m_samples, "Samples");
  tabs->addTab(m_log, "Log");
  m_chat = new ChatPanel;
  tabs->addTab(m_chat, "Chat");

  auto* top = new QHBoxLayout;
  auto* labels = new QVBoxLayout;
  labels->addWidget(m_title);
  labels->addWidget(m_status);
  labels->addWidget(m_progress);
  top->addLayout(labels, 1);
  top->addWidget(m_export);
  top->addWidget(m_stopSave);
  top->addWidget(m_stop);
  // A splitter, not a box layout: the Chat tab's wrapped status line asks for its height for the
  // width (height-for-width), which a box layout grants even below the other widgets' minimum
  // heights; the charts' rows then overlapped and their step titles were cut off. A splitter
  // keeps every pane at its minimum, and the user can trade chart height for the tabs'.
  auto* panes = new QSplitter(Qt::Vertical);
  panes->setObjectName("monitorPanes");
  panes->setChildrenCollapsible(false);
  panes->addWidget(chartsPane);
  panes->addWidget(m_devices);
  panes->addWidget(m_timeline);
  panes->addWidget(tabs);
  panes->setStretchFactor(0, 3);
  panes->setStretchFactor(1, 0);
  panes->setStretchFactor(2, 1);
  panes->setStretchFactor(3, 1);
  // Below the title and the buttons, the panes scroll when the window is smaller than their
  // minimum (a 1024x700 screen, an error banner): the buttons stay in view.
  auto* body = new QWidget;
  auto* column = new QVBoxLayout(body);
  column->setContentsMargins(0, 0, 0, 0);
  column->addWidget(m_banner);
  column->addWidget(panes, 1);
  auto* scroll = new QScrollArea;
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  scroll->setWidget(body);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(top);
  layout->addWidget(scroll, 1);
}

MonitorWidget::~MonitorWidget() {
  if (m_child && m_child->state() != QProcess::NotRunning) {
    m_child->disconnect(this);
    // Let it finish its step and checkpoint, however long that takes: ~QProcess would kill it.
    // Once asked (Stop, or the window's close), a second SIGINT would end it at once instead.
    if (!m_stopAsked) ::kill(static_cast<pid_t>(m_child->processId()), SIGINT);
    m_child->waitForFinished(-1);
  }
}

bool MonitorWidget::attach(const QString& runDir, QString* error) {
  const RunFolderInfo info = inspectRunFolder(runDir);
  if (!info.isRun) {
    if (error) *error = info.why;
    return false;
  }
  m_tail->close();
  m_state->reset();
  closeRanks();
  m_runDir = runDir;
  m_eventsPath =
      info.eventsPath.isEmpty() ? QDir(runDir).filePath("events.jsonl") : info.eventsPath;
  m_title->setText(QDir::cleanPath(runDir));
  m_banner->hide();
  m_chat->setRun(runDir);
  tryOpenEvents();
  if (!m_tail->isOpen()) m_openTimer->start();
  refresh();
  return true;
}

bool MonitorWidget::launch(const QString& configPath, const QString& runDir, QString* error,
                           const QStringList& extraArgs) {
  if (childRunning()) {
    if (error) *error = "a run is already going";
    return false;
  }
  m_tail->close();
  m_state->reset();
  closeRanks();
  m_runDir = runDir;
  m_eventsPath = QDir(runDir).filePath("events.jsonl");
  m_title->setText(QDir::cleanPath(runDir));
  m_banner->hide();
  m_chat->setRun(runDir);
  m_childFailed = false;
  delete m_child;
  m_child = new QProcess(this);
  m_child->setProcessChannelMode(QProcess::MergedChannels);
  connect(m_child, &QProcess::readyReadStandardOutput, this, [this] {
    while (m_child->canReadLine()) {
      QString line = QString::fromUtf8(m_child->readLine()).trimmed();
      // The status line redraws itself with \r on a terminal; not here (not a terminal).
      if (!line.isEmpty()) m_state->log()->appendLine(inGuiWords(line));
    }
  });
  connect(m_child, &QProcess::finished, this, &MonitorWidget::onChildFinished);
  QStringList args = configPath.isEmpty() ? QStringList{"train", "--resume", runDir}
                                          : QStringList{"train", configPath};
  args << extraArgs;
  m_state->log()->appendLine("$ " + RondoCli::program() + " " + args.join(' '));
  m_child->start(RondoCli::program(), args);
  if (!m_child->waitForStarted(10000)) {
    if (error) *error = "cannot start " + RondoCli::program() + ": " + m_child->errorString();
    return false;
  }
  m_stopAsked = false;
  m_stop->setText("Stop");
  m_stop->setToolTip(kStopTip);
  m_stop->setEnabled(true);
  m_stopSave->setEnabled(true);
  m_openTimer->start();
  refresh();
  return true;
}

bool MonitorWidget::childRunning() const {
  return m_child && m_child->state() != QProcess::NotRunning;
}

void MonitorWidget::tryOpenEvents() {
  if (m_tail->isOpen()) {
    m_openTimer->stop();
    return;
  }
  if (!QFileInfo::exists(m_eventsPath)) return;
  if (m_tail->open(m_eventsPath)) {
    m_openTimer->stop();
    m_tail->setFollowing(true);
  }
}

// A stop is the CLI's own (SIGINT): the steps under way finish, a checkpoint is written and the
// run ends "stopped". Asked again, the CLI ends at once ("interrupted", no checkpoint): never a
// SIGKILL, which would leave no run_end and read as a crash.
void MonitorWidget::stop() {
  if (!childRunning()) return;
  if (m_stopAsked) {
    ::kill(static_cast<pid_t>(m_child->processId()), SIGINT);
    m_stop->setEnabled(false);
    m_state->log()->appendLine(
        "Ending at once: what was trained since the last checkpoint is lost.");
    return;
  }
  stopAndSave();
}

void MonitorWidget::stopAndSave() {
  if (childRunning() && !m_stopAsked) {
    ::kill(static_cast<pid_t>(m_child->processId()), SIGINT);
    m_stopAsked = true;
    m_stopSave->setEnabled(false);
    m_stop->setText("Stop now");
    m_stop->setToolTip(
        "End at once, without a checkpoint: what was trained since the last one "
        "is lost");
    m_state->log()->appendLine(
        "Stopping after the steps under way; a checkpoint follows (Stop now ends at once).");
  }
}

void MonitorWidget::exportRun() {
  ExportDialog dialog(m_runDir, this);
  dialog.exec();
}

void MonitorWidget::onChildFinished(int code, QProcess::ExitStatus status) {
  if (m_child->bytesAvailable() > 0) {
    for (const QByteArray& l : m_child->readAll().split('\n'))
      if (!l.trimmed().isEmpty())
        m_state->log()->appendLine(inGuiWords(QString::fromUtf8(l).trimmed()));
  }
  tryOpenEvents();
  if (m_tail->isOpen()) m_tail->finish();  // everything it wrote before it ended
  m_stop->setEnabled(false);
  m_stopSave->setEnabled(false);
  const QString s = m_state->status();
  const bool ended = s == "completed" || s == "stopped" || s == "interrupted" || s == "failed";
  if (!ended) m_state->markInterrupted();
  // 128 + SIGINT or SIGTERM: a stop, not a failure.
  m_childFailed = status != QProcess::NormalExit || (code != 0 && code != 130 && code != 143);
  if (m_childFailed) {
    QString why = m_state->errorMessage();
    if (why.isEmpty()) why = QString("rondo train exited with status %1").arg(code);
    m_banner->setText("<b>The run failed:</b> " + why.toHtmlEscaped() + "<br><pre>" +
                      m_state->log()->lastLines(8).join('\n').toHtmlEscaped() + "</pre>");
    m_banner->show();
  }
  refresh();
  emit finished(m_childFailed ? QStringLiteral("failed") : m_state->status());
}

void MonitorWidget::scheduleRefresh() {
  if (!m_refreshTimer->isActive()) m_refreshTimer->start();
}

QString MonitorWidget::statusText() const {
  return m_status->text();
}

void MonitorWidget::refresh() {
  const RunState& s = *m_state;
  // A child that failed before its run wrote `run_end` (or anything) has failed all the same.
  QString status = s.status();
  if (m_childFailed && (status == "empty" || status == "interrupted")) status = "failed";
  // A finished run is "done", not "ETA 0m00s"; one that ended otherwise has no time left to show.
  const QString left = status == "completed" ? QString("done")
                       : status == "running" ? "ETA " + eta(s.etaSeconds())
                                             : QString("ETA –");
  const QLocale locale;  // steps with the user's thousands separators
  // The bar: the model loading (layers), then the run (steps).
  if (s.loading()) {
    status = QString("loading the model (%1 of %2 layers)")
                 .arg(locale.toString(s.layersLoaded()), locale.toString(s.layersTotal()));
    m_progress->setRange(0, static_cast<int>(s.layersTotal()));
    m_progress->setValue(static_cast<int>(s.layersLoaded()));
    m_progress->setFormat("Loading the model: %v of %m layers");
  } else if (s.stepsTotal() > 0) {
    m_progress->setRange(0, static_cast<int>(std::min<qint64>(s.stepsTotal(), INT_MAX)));
    m_progress->setValue(static_cast<int>(std::min(s.lastStep(), s.stepsTotal())));
    m_progress->setFormat(QString("%p% — step %1 of %2")
                              .arg(locale.toString(s.lastStep()), locale.toString(s.stepsTotal())));
  } else {
    m_progress->setRange(0, 1);
    m_progress->setValue(0);
    m_progress->setFormat("");
  }
  QString line =
      QString("%1 — step %2/%3, loss %4, validation %5, lr %6, grad norm %7, %8 tokens/s, %9")
          .arg(status)
          .arg(locale.toString(static_cast<qint64>(s.lastStep())))
          .arg(locale.toString(static_cast<qint64>(s.stepsTotal())))
          .arg(num(s.lastLoss()), num(s.lastEvalLoss()), num(s.lastLr(), 3),
               num(s.lastGradNorm(), 3), rate(s.tokensPerSecond()), left);
  if (s.isPreference() && !s.margin().isEmpty())
    line += QString("; margin %1, accuracy %2")
                .arg(num(s.margin().last().y(), 3), num(s.accuracy().last().y(), 3));
  if (s.malformedLines() > 0)
    line += QString(" (%1 malformed event lines skipped; the first, %2)")
                .arg(s.malformedLines())
                .arg(s.firstMalformed());
  m_status->setText(line);
  // Export what a run has checkpointed once it is not training.
  m_export->setEnabled(
      !m_runDir.isEmpty() && !childRunning() && s.status() != "running" &&
      !QDir(QDir(m_runDir).filePath("checkpoints")).entryList({"step-*"}, QDir::Dirs).isEmpty());
  if (!s.model().isEmpty())
    m_title->setText(QString("%1 — %2 on %3")
                         .arg(QDir::cleanPath(s.runDir().isEmpty() ? m_runDir : s.runDir()),
                              s.method(), s.model()));
  if (s.status() == "failed" && !s.errorMessage().isEmpty() && m_banner->isHidden()) {
    m_banner->setText("<b>The run failed:</b> " + s.errorMessage().toHtmlEscaped());
    m_banner->show();
  }
  fill(m_lossChart, {{m_loss, &s.loss()}, {m_eval, &s.evalLoss(), true}});
  fill(m_lrChart, {{m_lr, &s.lr()}});
  fill(m_normChart, {{m_norm, &s.gradNorm()}});
  fill(m_speedChart, {{m_speed, &s.throughput()}});
  const bool pairs = s.isPreference();
  m_marginView->setVisible(pairs);
  m_accuracyView->setVisible(pairs);
  if (pairs) {
    fill(m_marginChart, {{m_margin, &s.margin()}, {m_evalMargin, &s.evalMargin(), true}});
    fill(m_accuracyChart, {{m_accuracy, &s.accuracy()}, {m_evalAccuracy, &s.evalAccuracy(), true}});
  }
  const QList<DeviceStatus> devs = s.devices();
  const QList<double> planned = s.plannedPeaks();
  m_devices->setRowCount(static_cast<int>(devs.size()));
  for (int r = 0; r < devs.size(); ++r) {
    const DeviceStatus& d = devs[r];
    // The CPU device computes in host memory: what it counts are its buffers (the stage copies
    // of a GPU share the host's state here), while the plan's figure is all its work takes.
    const bool cpu = d.name == "cpu";
    const double plan = d.device >= 0 && d.device < planned.size() ? planned[d.device] : 0;
    const QStringList cells = {QString("%1 %2").arg(d.device).arg(d.name),
                               bytesText(static_cast<double>(d.bytesInUse)),
                               bytesText(static_cast<double>(d.bytesPeak)) +
                                   (plan <= 0 ? QString()
                                    : cpu     ? " (" + bytesText(plan) + " of host memory planned)"
                                              : " (" + bytesText(plan) + ")"),
                               bytesText(static_cast<double>(d.bytesCap)),
                               QString::number(100 * d.busyFraction, 'f', 0) + "%",
                               bytesText(static_cast<double>(d.bytesH2d)) + " / " +
                                   bytesText(static_cast<double>(d.bytesD2h))};
    for (int c = 0; c < cells.size(); ++c) {
      auto* item = new QTableWidgetItem(cells[c]);
      if (cpu && (c == 1 || c == 2))
        item->setToolTip(
            "The CPU device works in host memory: it counts only its own buffers here, while its "
            "tensors during a step come out of the host memory the plan counted for it");
      m_devices->setItem(r, c, item);
    }
  }
  for (int c = 0; c + 1 < m_devices->columnCount(); ++c)  // the last one stretches
    m_devices->resizeColumnToContents(c);
  m_timeline->update();
  refreshRanks();
}

void MonitorWidget::closeRanks() {
  for (EventTail* t : m_rankTails)
    delete t;
  for (RunState* s : m_rankStates)
    delete s;
  m_rankTails.clear();
  m_rankStates.clear();
  if (const int tab = m_tabs->indexOf(m_ranks); tab >= 0) m_tabs->removeTab(tab);
  m_ranks->setRowCount(0);
}

void MonitorWidget::refreshRanks() {
  const int ranks = m_state->ranks();
  if (ranks <= 1 || m_runDir.isEmpty()) return;
  if (m_tabs->indexOf(m_ranks) < 0) m_tabs->insertTab(0, m_ranks, "Ranks");
  while (static_cast<int>(m_rankStates.size()) + 1 < ranks) {
    auto* state = new RunState(this);
    connect(state, &RunState::changed, this, &MonitorWidget::scheduleRefresh);
    m_rankStates.push_back(state);
    m_rankTails.push_back(new EventTail(state, this));
  }
  const QLocale locale;
  m_ranks->setRowCount(ranks);
  for (int r = 0; r < ranks; ++r) {
    RunState* s = m_state;
    if (r > 0) {
      s = m_rankStates[static_cast<std::size_t>(r - 1)];
      EventTail* tail = m_rankTails[static_cast<std::size_t>(r - 1)];
      const QString path = QDir(m_runDir).filePath(QString("ranks/rank-%1/events.jsonl").arg(r));
      if (!tail->isOpen() && QFileInfo::exists(path) && tail->open(path)) tail->setFollowing(true);
    }
    quint64 peak = 0;
    for (const DeviceStatus& d : s->devices())
      peak = std::max(peak, d.bytesPeak);
    const QStringList cells = {
        QString::number(r),
        s->status() == "empty" ? QString("not started") : s->status(),
        QString("%1/%2").arg(locale.toString(s->lastStep()), locale.toString(s->stepsTotal())),
        num(s->lastLoss()),
        rate(s->tokensPerSecond()),
        peak > 0 ? bytesText(static_cast<double>(peak)) : QString("–")};
    for (int c = 0; c < cells.size(); ++c)
      m_ranks->setItem(r, c, new QTableWidgetItem(cells[c]));
  }
  for (int c = 0; c + 1 < m_ranks->columnCount(); ++c)
    m_ranks->resizeColumnToContents(c);
}

}  // namespace rondo::gui
