// The pipeline timeline: one row per device, one bar per stage job (from `span` events), coloured
// by kind (forward, tail, backward), over the most recent `window` seconds of the run.
#pragma once

#include <QWidget>

namespace rondo::gui {

class TimelineModel;

class TimelineView : public QWidget {
  Q_OBJECT
 public:
  explicit TimelineView(QWidget* parent = nullptr);
  void setModel(TimelineModel* model);
  void setWindow(double seconds) {
    m_window = seconds;
    update();
  }
  int barsDrawn() const { return m_barsDrawn; }  // in the last paint (tests)
  QSize sizeHint() const override { return {600, 140}; }

 protected:
  void paintEvent(QPaintEvent*) override;

 private:
  TimelineModel* m_model = nullptr;
  double m_window = 30;
  int m_barsDrawn = 0;
};

}  // namespace rondo::gui
