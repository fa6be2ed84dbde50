// The monitor's charts as drawn, headless (charts_*.png in the build folder): the axes' labels
// read off each chart's scene. They are whole steps, each once and under its own tick (before: "0 0
// 1 2 3" for steps 0 to 3, "1 1 1 1 2" for one step, "1 3 6 9 12" at 1, 3.75, 6.5, 9.25 and 12);
// one point gives a value axis with a span and readable labels (before: "…"); opening another run
// changes every label (before: old labels were once left beside the new ones); and with the Chat
// tab open, or the monitor narrow, every chart fits its view, its "step" title whole (before: cut
// off at the bottom).
#include <QAbstractScrollArea>
#include <QChart>
#include <QChartView>
#include <QDir>
#include <QFile>
#include <QGraphicsTextItem>
#include <QHash>
#include <QLabel>
#include <QSet>
#include <QTabWidget>
#include <QTemporaryDir>
#include <QTest>
#include <QValueAxis>
#include <algorithm>
#include <cmath>

#include "gui/app/chat_panel.h"
#include "gui/app/monitor.h"
#include "gui/model/run_state.h"
#include "test_support.h"
#include "tests/gui/model/event_writer.h"

using namespace rondo::gui;

namespace {

// What a chart shows around its plot area, in scene coordinates.
struct Drawn {
  QRectF plot;
  QList<QPair<QString, QRectF>> xLabels;  // text, where; left to right
  QStringList yLabels;                    // bottom to top
  QStringList xTitles;                    // text below the plot that is not a number
};

void collectText(QGraphicsItem* item, QList<QGraphicsTextItem*>& out) {
  for (QGraphicsItem* child : item->childItems()) {
    if (!child->isVisible()) continue;
    if (auto* text = dynamic_cast<QGraphicsTextItem*>(child)) out.append(text);
    collectText(child, out);
  }
}

Drawn drawn(QChart* chart) {
  Drawn d;
  d.plot = chart->mapRectToScene(chart->plotArea());
  QList<QGraphicsTextItem*> texts;
  collectText(chart, texts);
  QList<QPair<double, QString>> ys;
  for (QGraphicsTextItem* t : texts) {
    const QString s = t->toPlainText();
    if (s.isEmpty()) continue;
    const QPointF c = t->sceneBoundingRect().center();
    if (c.y() > d.plot.bottom() && c.x() <= d.plot.right() + 40) {
      bool number = false;
      s.toDouble(&number);
      if (number)
        d.xLabels.append({s, t->sceneBoundingRect()});
      else
        d.xTitles.append(s);
    } else if (c.x() < d.plot.left() && c.y() <= d.plot.bottom() + 2) {
      ys.append({-c.y(), s});
    }
  }
  std::sort(d.xLabels.begin(), d.xLabels.end(),
            [](const auto& a, const auto& b) { return a.second.x() < b.second.x(); });
  std::sort(ys.begin(), ys.end());
  for (const auto& [y, s] : ys)
    d.yLabels.append(s);
  return d;
}

QString describe(const Drawn& d) {
  QStringList xs;
  for (const auto& [s, r] : d.xLabels)
    xs.append(QString("%1@%2").arg(s).arg(r.center().x() - d.plot.left(), 0, 'f', 1));
  return QString("x [%1] y [%2] titles [%3] plot %4 wide")
      .arg(xs.join(' '), d.yLabels.join(' '), d.xTitles.join(' '))
      .arg(d.plot.width());
}

QValueAxis* axis(QChart* chart, Qt::Orientation o) {
  const QList<QAbstractAxis*> axes = chart->axes(o);
  return axes.isEmpty() ? nullptr : qobject_cast<QValueAxis*>(axes.first());
}

// Writes a finished run of `steps` steps into <dir>/<name>; returns its folder.
QString writeRun(const QString& dir, const QString& name, long long steps,
                 bool preference = false) {
  const QString run = dir + "/" + name;
  QDir().mkpath(run);
  QFile f(run + "/events.jsonl");
  if (!f.open(QIODevice::WriteOnly)) return {};
  test::RunSpec spec;
  spec.steps = steps;
  spec.preference = preference;
  spec.evalEvery = preference ? std::max(1ll, steps / 4) : 0;
  f.write(test::generateRun(spec));
  return run;
}

// The chart views a run shows: a supervised run's four, a preference run's six.
QList<QChartView*> shownViews(MonitorWidget& m) {
  QList<QChartView*> views;
  for (QChartView* v : m.findChildren<QChartView*>())
    if (!v->isHidden()) views << v;
  return views;
}

}  // namespace

class Charts : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;

  // Shows the run in `m`, waits for it to be read and the charts to be laid out.
  bool show(MonitorWidget& m, const QString& run) {
    QString error;
    if (!m.attach(run, &error)) return false;
    if (!QTest::qWaitFor([&] { return m.state()->status() == "completed"; }, 10000)) return false;
    m.refresh();
    QTest::qWait(50);  // the charts lay themselves out on posted events
    return true;
  }

  // Every chart's step axis: whole steps, each once, under its tick; `steps` among them when
  // there are at most 5 steps.
  void checkStepLabels(MonitorWidget& m, int steps) {
    const QList<QChartView*> views = shownViews(m);
    QCOMPARE(views.size(), m.state()->isPreference() ? 6 : 4);
    for (QChartView* v : views) {
      QChart* chart = v->chart();
      const Drawn d = drawn(chart);
      const QString what = chart->title() + ": " + describe(d);
      QValueAxis* x = axis(chart, Qt::Horizontal);
      QVERIFY2(d.xLabels.size() >= 2, qPrintable(what));
      QSet<qint64> seen;
      double last = -INFINITY;
      QRectF previous;
      for (const auto& [text, rect] : d.xLabels) {
        bool ok = false;
        const double value = text.toDouble(&ok);
        QVERIFY2(ok && value == std::floor(value), qPrintable(what));
        QVERIFY2(!seen.contains(static_cast<qint64>(value)), qPrintable(what));
        seen.insert(static_cast<qint64>(value));
        QVERIFY2(value > last, qPrintable(what));
        last = value;
        QVERIFY2(value >= x->min() && value <= x->max(), qPrintable(what));
        // The label sits under the tick of its value.
        const double at =
            d.plot.left() + (value - x->min()) / (x->max() - x->min()) * d.plot.width();
        QVERIFY2(std::abs(rect.center().x() - at) <= 2, qPrintable(what));
        // Apart from the one before (the rectangles hold a few pixels of margin).
        QVERIFY2(previous.isNull() || previous.right() - 8 < rect.left(), qPrintable(what));
        previous = rect;
      }
      if (steps <= 5)
        for (int s = 1; s <= steps; ++s)
          QVERIFY2(seen.contains(s), qPrintable(what));
      // Every whole step the axis ticks is labelled, and nothing else is: no label is left over
      // from a range before (its value would be off its place, or one too many).
      QCOMPARE(x->tickType(), QValueAxis::TicksDynamic);
      QVERIFY2(x->tickInterval() >= 1 && x->tickInterval() == std::floor(x->tickInterval()),
               qPrintable(what));
      QSet<qint64> ticked;
      for (double t = std::ceil(x->min() / x->tickInterval()) * x->tickInterval(); t <= x->max();
           t += x->tickInterval())
        ticked.insert(static_cast<qint64>(t));
      QVERIFY2(seen == ticked, qPrintable(what));
      // The value axis: a span, and labels that are numbers, not elided.
      QValueAxis* y = axis(chart, Qt::Vertical);
      QVERIFY2(y->max() > y->min(), qPrintable(what));
      QVERIFY2(d.yLabels.size() >= 2, qPrintable(what));
      for (const QString& s : d.yLabels) {
        bool ok = false;
        s.toDouble(&ok);
        QVERIFY2(ok, qPrintable(what));
      }
      QVERIFY2(QSet<QString>(d.yLabels.begin(), d.yLabels.end()).size() == d.yLabels.size(),
               qPrintable(what));
    }
  }

  // Every chart view is whole on screen: inside its parents and under no other widget (a layout
  // short of its minimum height lays its widgets out over one another); its chart fits it, the
  // title of the step axis drawn whole.
  void checkTitlesFit(MonitorWidget& m) {
    const QList<QWidget*> all = m.findChildren<QWidget*>();
    for (QChartView* v : shownViews(m)) {
      const QRect r(v->mapTo(&m, QPoint()), v->size());
      for (QWidget* w = v; w != &m; w = w->parentWidget()) {
        // What a scroll area holds may be larger than its viewport: it scrolls (the monitor's
        // panes below the buttons, on a screen smaller than their minimum).
        const auto* area = qobject_cast<QAbstractScrollArea*>(w->parentWidget()->parentWidget());
        if (area && area->viewport() == w->parentWidget()) continue;
        QVERIFY2(w->parentWidget()->rect().contains(w->geometry()),
                 qPrintable(QString("%1 in %2")
                                .arg(w->metaObject()->className(),
                                     w->parentWidget()->metaObject()->className())));
      }
      for (QWidget* o : all) {
        if (o == v || !o->isVisible() || o->isAncestorOf(v) || v->isAncestorOf(o)) continue;
        const QRect ro(o->mapTo(&m, QPoint()), o->size());
        QVERIFY2(!r.intersects(ro), qPrintable(QString("a chart view at %1,%2 %3x%4 and a %5 at "
                                                       "%6,%7 %8x%9")
                                                   .arg(r.x())
                                                   .arg(r.y())
                                                   .arg(r.width())
                                                   .arg(r.height())
                                                   .arg(o->metaObject()->className())
                                                   .arg(ro.x())
                                                   .arg(ro.y())
                                                   .arg(ro.width())
                                                   .arg(ro.height())));
      }
    }
    for (QChartView* v : shownViews(m)) {
      QChart* chart = v->chart();
      const Drawn d = drawn(chart);
      const QString what = QString("%1: chart %2x%3 in a %4x%5 view; %6")
                               .arg(chart->title())
                               .arg(chart->size().width())
                               .arg(chart->size().height())
                               .arg(v->viewport()->width())
                               .arg(v->viewport()->height())
                               .arg(describe(d));
      QVERIFY2(chart->size().height() <= v->viewport()->height() + 0.5, qPrintable(what));
      QVERIFY2(chart->size().width() <= v->viewport()->width() + 0.5, qPrintable(what));
      QVERIFY2(d.xTitles == QStringList{"step"}, qPrintable(what));
    }
  }

 private slots:
  void initTestCase() { QVERIFY(m_tmp.isValid()); }

  void fewAndManySteps_data() {
    QTest::addColumn<int>("steps");
    QTest::addColumn<bool>("preference");  // with the margin and accuracy charts
    for (int steps : {1, 2, 3, 5, 12, 200, 12345})
      QTest::addRow("%d", steps) << steps << false;
    for (int steps : {3, 12, 200})
      QTest::addRow("%d preference", steps) << steps << true;
  }

  void fewAndManySteps() {
    QFETCH(int, steps);
    QFETCH(bool, preference);
    MonitorWidget m;
    m.resize(1100, 860);
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    const QString name = QString(preference ? "preference-%1" : "run-%1").arg(steps);
    QVERIFY(show(m, writeRun(m_tmp.path(), name, steps, preference)));
    test::screenshot(
        &m, QString(preference ? "charts_%1_steps_preference" : "charts_%1_steps").arg(steps));
    QCOMPARE(m.state()->isPreference(), preference);
    checkStepLabels(m, steps);
    if (preference) checkTitlesFit(m);
  }

  // One monitor, one run after another (File, Open run folder): 200 steps, then 3, then 1, then
  // 200 again; every label is the new run's.
  void anotherRunReplacesEveryLabel() {
    MonitorWidget m;
    m.resize(1100, 860);
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    // The second is a preference run: its charts come, and go again with the next run.
    for (int steps : {200, 3, 1, 200}) {
      QVERIFY(show(m, writeRun(m_tmp.path(), QString("again-%1").arg(steps), steps, steps == 3)));
      checkStepLabels(m, steps);
      if (QTest::currentTestFailed()) return;
    }
  }

  // Wide, at its narrowest, then wide again: after each the step labels are whole steps under
  // their ticks, apart, none elided (the ticks are fitted again when the plot area changes).
  void resizingKeepsTheLabelsApart() {
    MonitorWidget m;
    m.resize(1600, 860);
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    QVERIFY(show(m, writeRun(m_tmp.path(), "resized", 200)));
    checkStepLabels(m, 200);
    if (QTest::currentTestFailed()) return;
    m.resize(m.minimumSizeHint());
    QTest::qWait(100);
    test::screenshot(&m, "charts_narrowest");
    checkStepLabels(m, 200);
    if (QTest::currentTestFailed()) return;
    m.resize(1600, 860);
    QTest::qWait(100);
    checkStepLabels(m, 200);
  }

  // One step: every chart's value axis has a span with the value well inside it (before: the
  // value at the bottom of 0..1.2 for a learning rate, "…" for labels on the loss), and labels
  // that are distinct numbers.
  void singlePointHasAValueSpan() {
    MonitorWidget m;
    m.resize(1100, 860);
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    QVERIFY(show(m, writeRun(m_tmp.path(), "single", 1)));
    const RunState& s = *m.state();
    const QHash<QString, double> values = {{"Loss", s.loss().maxY()},
                                           {"Learning rate", s.lr().maxY()},
                                           {"Gradient norm (before clipping)", s.gradNorm().maxY()},
                                           {"Tokens/s", s.throughput().maxY()}};
    for (QChartView* v : shownViews(m)) {
      QChart* chart = v->chart();
      QValueAxis* y = axis(chart, Qt::Vertical);
      const Drawn d = drawn(chart);
      const double value = values.value(chart->title(), NAN);
      const QString what = QString("%1: %2 in [%3, %4]; %5")
                               .arg(chart->title())
                               .arg(value)
                               .arg(y->min())
                               .arg(y->max())
                               .arg(describe(d));
      QVERIFY2(y->max() > y->min(), qPrintable(what));
      const double at = (value - y->min()) / (y->max() - y->min());
      QVERIFY2(at > 0.2 && at < 0.8, qPrintable(what));
      QVERIFY2(d.yLabels.size() >= 2, qPrintable(what));
      for (const QString& l : d.yLabels) {
        bool ok = false;
        l.toDouble(&ok);
        QVERIFY2(ok, qPrintable(what));
      }
      QVERIFY2(QSet<QString>(d.yLabels.begin(), d.yLabels.end()).size() == d.yLabels.size(),
               qPrintable(what));
    }
  }

  // The Chat tab open (its word-wrapped status asks for height) in the default window and in
  // the smallest the monitor allows: the charts still fit their views.
  void titlesFitWithChatOpenAndNarrow_data() {
    QTest::addColumn<QSize>("size");
    QTest::addRow("1100x860") << QSize(1100, 860);
    QTest::addRow("smallest") << QSize(1, 1);  // the monitor's minimum size, once laid out
  }

  void titlesFitWithChatOpenAndNarrow() {
    QFETCH(QSize, size);
    MonitorWidget m;
    m.resize(size);
    m.show();
    QVERIFY(QTest::qWaitForWindowExposed(&m));
    QVERIFY(show(m, writeRun(m_tmp.path(), "chat-" + QString::number(size.width()), 200)));
    m.findChild<QTabWidget*>()->setCurrentWidget(m.chatPanel());
    // As after a few turns: a status line that wraps.
    m.chatPanel()
        ->findChild<QLabel*>("chatStatus")
        ->setText(
            "Replied in 0.2 s (100 tokens). The newest checkpoint of a run folder with a long path "
            "name that wraps onto a second and a third line when the window is narrow.");
    QTest::qWait(50);
    m.refresh();
    QTest::qWait(50);
    test::screenshot(&m, QString("charts_chat_%1x%2").arg(m.width()).arg(m.height()));
    checkTitlesFit(m);
    if (QTest::currentTestFailed()) return;
    checkStepLabels(m, 200);
  }
};

QTEST_MAIN(Charts)
#include "charts_test.moc"
