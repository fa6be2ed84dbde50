// The Qt item models behind the monitor's views: the pipeline timeline (the most recent spans),
// the samples, and the log. RunState owns one of each and is the only writer; they append in
// batches and drop their oldest rows beyond their capacity. Included by run_state.h.
//
//   QTableView view;  view.setModel(state.timeline());  // rows arrive as the run goes
#pragma once

#include <QAbstractListModel>
#include <QAbstractTableModel>
#include <QList>
#include <QString>
#include <QStringList>

namespace rondo::gui {

struct DeviceStatus {
  int device = 0;
  QString name;
  quint64 bytesInUse = 0, bytesPeak = 0, bytesCap = 0;
  double busyFraction = 0;  // share of the time since the previous device event spent computing
  quint64 bytesH2d = 0, bytesD2h = 0;  // totals since the run (or its resume) started
};

struct SampleItem {
  qint64 step = 0;
  QString prompt, text;
};

struct SpanItem {
  int device = 0;
  qint64 step = 0;
  QString stage;                     // F0, T, B2 ...
  int firstLayer = 0, endLayer = 0;  // layers [firstLayer, endLayer)
  double start = 0, end = 0;         // run clock, seconds
};

struct CheckpointItem {
  qint64 step = 0;
  QString path;
  quint64 bytes = 0;
};

// The pipeline timeline: the last capacity() spans, ordered by arrival.
class TimelineModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Column { Device, Step, Stage, FirstLayer, EndLayer, Start, End, ColumnCount };
  static constexpr int kDefaultCapacity = 20000;

  explicit TimelineModel(QObject* parent = nullptr);

  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation orientation,
                      int role = Qt::DisplayRole) const override;

  const QList<SpanItem>& spans() const { return m_spans; }
  int deviceCount() const { return m_deviceCount; }  // max device index + 1 seen since clear()
  double timeStart() const { return m_timeStart; }   // over the kept spans; NaN when none
  double timeEnd() const { return m_timeEnd; }
  int capacity() const { return m_capacity; }
  void setCapacity(int spans);  // drops the oldest spans beyond it

  // Writers (RunState): appends in arrival order, evicting the oldest beyond capacity().
  void appendSpans(QList<SpanItem> spans);
  void clear();

 private:
  void updateRange();

  QList<SpanItem> m_spans;
  int m_capacity = kDefaultCapacity;
  int m_deviceCount = 0;
  double m_timeStart;
  double m_timeEnd;
};

// The sample events, oldest first. DisplayRole: "step N: prompt → text".
class SamplesModel : public QAbstractListModel {
  Q_OBJECT
 public:
  enum Role { StepRole = Qt::UserRole + 1, PromptRole, TextRole };

  explicit SamplesModel(QObject* parent = nullptr);

  int rowCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QHash<int, QByteArray> roleNames() const override;

  const QList<SampleItem>& samples() const { return m_samples; }

  // Writers (RunState).
  void appendSamples(const QList<SampleItem>& samples);
  void removeAfterStep(qint64 step);  // a resumed run repeats the later samples
  void clear();

 private:
  QList<SampleItem> m_samples;
};

// Lines for people: warnings, errors, checkpoints, run start and end, plan changes, and the
// process output the app appends. Keeps the last kCapacity lines.
class LogModel : public QAbstractListModel {
  Q_OBJECT
 public:
  static constexpr int kCapacity = 10000;

  explicit LogModel(QObject* parent = nullptr);

  int rowCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;

  void appendLine(const QString& line);
  void appendLines(const QStringList& lines);
  QStringList lastLines(int n) const;  // oldest first
  const QStringList& lines() const { return m_lines; }
  void clear();

 private:
  QStringList m_lines;
};

}  // namespace rondo::gui
