// Every config key no other wizard page sets, built from `rondo train --help-config --json`: a new
// setting in the CLI is reachable here without a widget of its own. One row per key (a check box
// for true/false, a line for the rest: numbers as typed, lists comma-separated), its help as the
// tooltip; only the rows changed from their defaults go into the config. Widgets are named
// "adv_<key>" (adv_training.optimizer).
#pragma once

#include <QList>
#include <QMap>
#include <QPair>
#include <QSet>
#include <QString>
#include <QStringList>
#include <QWidget>

class QCheckBox;
class QFormLayout;
class QLineEdit;

namespace rondo::gui {

class AdvancedSettings : public QWidget {
  Q_OBJECT
 public:
  // `handled`: the keys other pages set, left out here.
  explicit AdvancedSettings(QSet<QString> handled, QWidget* parent = nullptr);
  // Asks the CLI for its keys once (later calls return at once); false, with `error`, if it could
  // not.
  bool load(QString* error = nullptr);
  bool has(const QString& key) const { return m_rows.contains(key); }
  // Sets a row as `--set key=value` spells it; false for a key that is not here.
  bool setValue(const QString& key, const QString& value);
  QString value(const QString& key) const;
  // The rows changed from their defaults, each as key and TOML value, in the CLI's order.
  QList<QPair<QString, QString>> changed() const;

 signals:
  void edited();

 private:
  struct Row {
    QString type;         // string, bool, integer, number, list
    QString defaultText;  // as value() spells it
    QCheckBox* check = nullptr;
    QLineEdit* line = nullptr;
  };
  QSet<QString> m_handled;
  QStringList m_order;
  QMap<QString, Row> m_rows;
  QFormLayout* m_form;
  bool m_loaded = false;
};

}  // namespace rondo::gui
