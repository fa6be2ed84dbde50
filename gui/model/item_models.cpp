#include "gui/model/item_models.h"

#include <algorithm>
#include <limits>

namespace rondo::gui {
namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}

// ---- TimelineModel

TimelineModel::TimelineModel(QObject* parent)
    : QAbstractTableModel(parent), m_timeStart(kNaN), m_timeEnd(kNaN) {}

int TimelineModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : static_cast<int>(m_spans.size());
}

int TimelineModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : ColumnCount;
}

QVariant TimelineModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid))
    return {};
  if (role != Qt::DisplayRole) return {};
  const SpanItem& s = m_spans[index.row()];
  switch (index.column()) {
    case Device:
      return s.device;
    case Step:
      return s.step;
    case Stage:
      return s.stage;
    case FirstLayer:
      return s.firstLayer;
    case EndLayer:
      return s.endLayer;
    case Start:
      return s.start;
    case End:
      return s.end;
    default:
      return {};
  }
}

QVariant TimelineModel::headerData(int section, Qt::Orientation orientation, int role) const {
  if (orientation != Qt::Horizontal || role != Qt::DisplayRole) return {};
  switch (section) {
    case Device:
      return tr("Device");
    case Step:
      return tr("Step");
    case Stage:
      return tr("Stage");
    case FirstLayer:
      return tr("First layer");
    case EndLayer:
      return tr("End layer");
    case Start:
      return tr("Start (s)");
    case End:
      return tr("End (s)");
    default:
      return {};
  }
}

void TimelineModel::setCapacity(int spans) {
  m_capacity = std::max(spans, 1);
  const int excess = static_cast<int>(m_spans.size()) - m_capacity;
  if (excess > 0) {
    beginRemoveRows({}, 0, excess - 1);
    m_spans.remove(0, excess);
    endRemoveRows();
    updateRange();
  }
}

void TimelineModel::appendSpans(QList<SpanItem> spans) {
  if (spans.isEmpty()) return;
  for (const SpanItem& s : spans)
    m_deviceCount = std::max(m_deviceCount, s.device + 1);
  if (spans.size() >= m_capacity) {
    // The batch alone fills the model: one reset instead of a removal and an insertion.
    beginResetModel();
    spans.remove(0, spans.size() - m_capacity);
    m_spans = std::move(spans);
    endResetModel();
  } else {
    const int excess = static_cast<int>(m_spans.size() + spans.size()) - m_capacity;
    if (excess > 0) {
      beginRemoveRows({}, 0, excess - 1);
      m_spans.remove(0, excess);
      endRemoveRows();
    }
    const int first = static_cast<int>(m_spans.size());
    beginInsertRows({}, first, first + static_cast<int>(spans.size()) - 1);
    m_spans.append(spans);
    endInsertRows();
  }
  updateRange();
}

void TimelineModel::clear() {
  beginResetModel();
  m_spans.clear();
  m_deviceCount = 0;
  endResetModel();
  updateRange();
}

void TimelineModel::updateRange() {
  m_timeStart = m_timeEnd = kNaN;
  for (const SpanItem& s : m_spans) {
    if (!(s.start >= m_timeStart)) m_timeStart = s.start;
    if (!(s.end <= m_timeEnd)) m_timeEnd = s.end;
  }
}

// ---- SamplesModel

SamplesModel::SamplesModel(QObject* parent) : QAbstractListModel(parent) {}

int SamplesModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : static_cast<int>(m_samples.size());
}

QVariant SamplesModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid))
    return {};
  const SampleItem& s = m_samples[index.row()];
  switch (role) {
    case Qt::DisplayRole:
      return QStringLiteral("step %1: %2 → %3").arg(s.step).arg(s.prompt, s.text);
    case StepRole:
      return s.step;
    case PromptRole:
      return s.prompt;
    case TextRole:
      return s.text;
    default:
      return {};
  }
}

QHash<int, QByteArray> SamplesModel::roleNames() const {
  QHash<int, QByteArray> names = QAbstractListModel::roleNames();
  names.insert(StepRole, "step");
  names.insert(PromptRole, "prompt");
  names.insert(TextRole, "text");
  return names;
}

void SamplesModel::appendSamples(const QList<SampleItem>& samples) {
  if (samples.isEmpty()) return;
  const int first = static_cast<int>(m_samples.size());
  beginInsertRows({}, first, first + static_cast<int>(samples.size()) - 1);
  m_samples.append(samples);
  endInsertRows();
}

void SamplesModel::removeAfterStep(qint64 step) {
  // Rows are removed in contiguous runs, from the end so the indices ahead stay valid.
  int row = static_cast<int>(m_samples.size()) - 1;
  while (row >= 0) {
    if (m_samples[row].step <= step) {
      --row;
      continue;
    }
    int last = row;
    while (row > 0 && m_samples[row - 1].step > step)
      --row;
    beginRemoveRows({}, row, last);
    m_samples.remove(row, last - row + 1);
    endRemoveRows();
    --row;
  }
}

void SamplesModel::clear() {
  beginResetModel();
  m_samples.clear();
  endResetModel();
}

// ---- LogModel

LogModel::LogModel(QObject* parent) : QAbstractListModel(parent) {}

int LogModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : static_cast<int>(m_lines.size());
}

QVariant LogModel::data(const QModelIndex& index, int role) const {
  if (!checkIndex(index, CheckIndexOption::IndexIsValid | CheckIndexOption::ParentIsInvalid))
    return {};
  if (role != Qt::DisplayRole) return {};
  return m_lines[index.row()];
}

void LogModel::appendLine(const QString& line) {
  appendLines(QStringList{line});
}

void LogModel::appendLines(const QStringList& lines) {
  if (lines.isEmpty()) return;
  if (lines.size() >= kCapacity) {
    beginResetModel();
    m_lines = lines.mid(lines.size() - kCapacity);
    endResetModel();
    return;
  }
  const int excess = static_cast<int>(m_lines.size() + lines.size()) - kCapacity;
  if (excess > 0) {
    beginRemoveRows({}, 0, excess - 1);
    m_lines.remove(0, excess);
    endRemoveRows();
  }
  const int first = static_cast<int>(m_lines.size());
  beginInsertRows({}, first, first + static_cast<int>(lines.size()) - 1);
  m_lines.append(lines);
  endInsertRows();
}

QStringList LogModel::lastLines(int n) const {
  if (n <= 0) return {};
  return m_lines.mid(std::max<qsizetype>(0, m_lines.size() - n));
}

void LogModel::clear() {
  beginResetModel();
  m_lines.clear();
  endResetModel();
}

}  // namespace rondo::gui
