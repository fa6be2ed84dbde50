#include "gui/app/runs_dialog.h"

#include <QDir>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLocale>
#include <QPushButton>
#include <QSettings>
#include <QSplitter>
#include <QTableWidget>
#include <QVBoxLayout>
#include <cmath>

namespace rondo::gui {
namespace {

constexpr int kRecent = 20;
const char* const kCompareHint = "Select two runs and Compare to see what differs between them.";

QString lossText(double v) {
  return std::isfinite(v) ? QString::number(v, 'f', 4) : QString("—");
}

QString whenText(const RunSummary& r) {
  const QDateTime t = r.ended.isValid() ? r.ended : r.started;
  return t.isValid() ? QLocale().toString(t.toLocalTime(), QLocale::ShortFormat) : QString("—");
}

}  // namespace

QStringList recentRuns() {
  return QSettings().value("recentRuns").toStringList();
}

void addRecentRun(const QString& dir) {
  const QString abs = QFileInfo(dir).absoluteFilePath();
  QStringList list = recentRuns();
  list.removeAll(abs);
  list.prepend(abs);
  while (list.size() > kRecent)
    list.removeLast();
  QSettings().setValue("recentRuns", list);
}

RunsDialog::RunsDialog(QStringList roots, QStringList recent, QWidget* parent)
    : QDialog(parent), m_roots(std::move(roots)), m_recent(std::move(recent)) {
  setWindowTitle("Rondo — runs");
  resize(960, 560);
  m_table = new QTableWidget(0, 8);
  m_table->setObjectName("runsTable");
  m_table->setHorizontalHeaderLabels(
      {"Run", "Model", "Method", "Status", "Steps", "Loss", "Validation", "Last active"});
  m_table->horizontalHeader()->setSectionResizeMode(1, QHeaderView::Stretch);
  m_table->verticalHeader()->hide();
  m_table->setSelectionBehavior(QAbstractItemView::SelectRows);
  m_table->setSelectionMode(QAbstractItemView::ExtendedSelection);
  m_table->setEditTriggers(QAbstractItemView::NoEditTriggers);
  m_summary = new QLabel(kCompareHint);
  m_summary->setObjectName("compareSummary");
  m_summary->setWordWrap(true);
  m_differences = new QTableWidget(0, 3);
  m_differences->setObjectName("differences");
  m_differences->setHorizontalHeaderLabels({"Setting", "First", "Second"});
  m_differences->horizontalHeader()->setStretchLastSection(true);
  m_differences->verticalHeader()->hide();
  m_differences->setEditTriggers(QAbstractItemView::NoEditTriggers);
  m_open = new QPushButton("Open");
  m_open->setObjectName("openButton");
  m_compare = new QPushButton("Compare");
  m_compare->setObjectName("compareButton");
  auto* reload = new QPushButton("Refresh");
  auto* close = new QPushButton("Close");
  auto* buttons = new QHBoxLayout;
  buttons->addWidget(m_open);
  buttons->addWidget(m_compare);
  buttons->addStretch(1);
  buttons->addWidget(reload);
  buttons->addWidget(close);
  auto* lower = new QWidget;
  auto* lowerLayout = new QVBoxLayout(lower);
  lowerLayout->setContentsMargins(0, 0, 0, 0);
  lowerLayout->addWidget(m_summary);
  lowerLayout->addWidget(m_differences, 1);
  auto* split = new QSplitter(Qt::Vertical);
  split->addWidget(m_table);
  split->addWidget(lower);
  split->setStretchFactor(0, 2);
  split->setStretchFactor(1, 1);
  auto* layout = new QVBoxLayout(this);
  layout->addWidget(split, 1);
  layout->addLayout(buttons);

  auto selected = [this] { return m_table->selectionModel()->selectedRows().size(); };
  auto enable = [this, selected] {
    m_open->setEnabled(selected() == 1);
    m_compare->setEnabled(selected() == 2);
  };
  connect(m_table, &QTableWidget::itemSelectionChanged, this, enable);
  connect(m_open, &QPushButton::clicked, this, [this] {
    const auto rows = m_table->selectionModel()->selectedRows();
    if (rows.size() == 1) emit openRequested(m_runs[rows.first().row()].dir);
  });
  connect(m_table, &QTableWidget::cellDoubleClicked, this,
          [this](int row) { emit openRequested(m_runs[row].dir); });
  connect(m_compare, &QPushButton::clicked, this, &RunsDialog::compareSelected);
  connect(reload, &QPushButton::clicked, this, &RunsDialog::refresh);
  connect(close, &QPushButton::clicked, this, &QDialog::reject);
  refresh();
  enable();
}

void RunsDialog::refresh() {
  m_runs = findRuns(m_roots, m_recent);
  m_table->setRowCount(0);
  // A comparison of the rows before is gone with them.
  m_differences->setRowCount(0);
  m_summary->setText(kCompareHint);
  for (const RunSummary& r : m_runs) {
    const int row = m_table->rowCount();
    m_table->insertRow(row);
    const QString steps =
        r.stepsTotal > 0 ? QString("%1 of %2").arg(r.stepsDone).arg(r.stepsTotal) : QString("—");
    const QStringList cells = {
        QDir(r.dir).dirName(), QFileInfo(r.model).fileName(), r.method,   r.status, steps,
        lossText(r.lastLoss),  lossText(r.lastEvalLoss),      whenText(r)};
    for (int c = 0; c < cells.size(); ++c) {
      auto* item = new QTableWidgetItem(cells[c]);
      item->setToolTip(c == 0 ? r.dir : c == 1 ? r.model : cells[c]);
      m_table->setItem(row, c, item);
    }
  }
  m_table->resizeColumnsToContents();
  if (m_runs.isEmpty())
    m_summary->setText("No runs yet under " + m_roots.join(", ") +
                       ": start one from File ▸ New run, or open a run folder.");
}

bool RunsDialog::compareSelected() {
  auto rows = m_table->selectionModel()->selectedRows();
  if (rows.size() != 2) return false;
  std::sort(rows.begin(), rows.end(),
            [](const QModelIndex& a, const QModelIndex& b) { return a.row() < b.row(); });
  const RunSummary& a = m_runs[rows[0].row()];
  const RunSummary& b = m_runs[rows[1].row()];
  m_differences->setHorizontalHeaderLabels(
      {"Setting", QDir(a.dir).dirName(), QDir(b.dir).dirName()});
  m_differences->setRowCount(0);
  for (const ConfigDifference& d : configDifferences(a.config, b.config)) {
    const int row = m_differences->rowCount();
    m_differences->insertRow(row);
    m_differences->setItem(row, 0, new QTableWidgetItem(d.key));
    m_differences->setItem(row, 1, new QTableWidgetItem(d.a.isEmpty() ? "(not set)" : d.a));
    m_differences->setItem(row, 2, new QTableWidgetItem(d.b.isEmpty() ? "(not set)" : d.b));
  }
  m_differences->resizeColumnsToContents();
  auto result = [](const RunSummary& r) {
    return QString("%1: %2, step %3, loss %4, validation %5")
        .arg(QDir(r.dir).dirName(), r.status)
        .arg(r.stepsDone)
        .arg(lossText(r.lastLoss), lossText(r.lastEvalLoss));
  };
  const int n = m_differences->rowCount();
  m_summary->setText(result(a) + "\n" + result(b) + "\n" +
                     (n == 0 ? QString("Their configs are the same (the run folder aside).")
                             : QString("%1 setting%2 differ%3:")
                                   .arg(n)
                                   .arg(n == 1 ? "" : "s")
                                   .arg(n == 1 ? "s" : "")));
  return true;
}

}  // namespace rondo::gui
