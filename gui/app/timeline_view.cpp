#include "gui/app/timeline_view.h"

#include <QPainter>
#include <algorithm>

#include "gui/model/run_state.h"

namespace rondo::gui {

TimelineView::TimelineView(QWidget* parent) : QWidget(parent) {
  setObjectName("timeline");
  setMinimumHeight(100);
  setAutoFillBackground(true);
}

void TimelineView::setModel(TimelineModel* model) {
  m_model = model;
  if (model) {
    connect(model, &QAbstractItemModel::rowsInserted, this, qOverload<>(&QWidget::update));
    connect(model, &QAbstractItemModel::modelReset, this, qOverload<>(&QWidget::update));
  }
  update();
}

void TimelineView::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), QColor("#fbfbfb"));
  m_barsDrawn = 0;
  const int labelW = 56;
  if (!m_model || m_model->spans().isEmpty()) {
    p.setPen(QColor("#777"));
    p.drawText(rect(), Qt::AlignCenter, "No stage jobs yet");
    return;
  }
  const int devices = std::max(1, m_model->deviceCount());
  const double t1 = m_model->timeEnd();
  const double t0 = std::max(m_model->timeStart(), t1 - m_window);
  const double span = std::max(t1 - t0, 1e-9);
  const int rowH = std::max(12, (height() - 20) / devices);
  const int w = width() - labelW - 6;
  p.setPen(QColor("#333"));
  for (int d = 0; d < devices; ++d)
    p.drawText(QRect(2, 4 + d * rowH, labelW - 4, rowH), Qt::AlignVCenter | Qt::AlignLeft,
               QString("dev %1").arg(d));
  for (const SpanItem& s : m_model->spans()) {
    if (s.end < t0) continue;
    const double a = std::max(s.start, t0);
    const int x0 = labelW + static_cast<int>((a - t0) / span * w);
    const int x1 = labelW + static_cast<int>((s.end - t0) / span * w);
    const QChar kind = s.stage.isEmpty() ? QChar('F') : s.stage[0];
    const QColor c = kind == 'T'   ? QColor("#7b4fb3")
                     : kind == 'B' ? QColor("#e08a2e")
                                   : QColor("#3a78c2");
    const QRect bar(x0, 4 + s.device * rowH + 2, std::max(1, x1 - x0), rowH - 4);
    p.fillRect(bar, c);
    if (bar.width() > 28) {
      p.setPen(Qt::white);
      p.drawText(bar, Qt::AlignCenter, s.stage);
    }
    ++m_barsDrawn;
  }
  p.setPen(QColor("#555"));
  p.drawText(QRect(labelW, height() - 16, w, 14), Qt::AlignRight,
             QString("the last %1 s of work on each device: blue the forward pass, purple the loss "
                     "(the model's head), orange the backward pass")
                 .arg(span, 0, 'f', 1));
}

}  // namespace rondo::gui
