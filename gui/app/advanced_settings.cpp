#include "gui/app/advanced_settings.h"

#include <QCheckBox>
#include <QFormLayout>
#include <QJsonArray>
#include <QLabel>
#include <QLineEdit>

#include "gui/app/format.h"
#include "gui/app/rondo_cli.h"

namespace rondo::gui {
namespace {

// A default as the row shows it: lists comma-separated, numbers as the CLI prints them.
QString shown(const QJsonValue& v) {
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isDouble()) return QString::number(v.toDouble(), 'g', 12);
  if (v.isArray()) {
    QStringList items;
    for (const QJsonValue& e : v.toArray())
      items << e.toString();
    return items.join(", ");
  }
  return v.toString();
}

}  // namespace

AdvancedSettings::AdvancedSettings(QSet<QString> handled, QWidget* parent)
    : QWidget(parent), m_handled(std::move(handled)) {
  m_form = new QFormLayout(this);
  auto* intro = new QLabel(
      "Every other setting, with its default. Hover over one for what it does; only the ones you "
      "change go into the config.");
  intro->setWordWrap(true);
  m_form->addRow(intro);
}

bool AdvancedSettings::load(QString* error) {
  if (m_loaded) return true;
  QString why;
  const QJsonObject j = RondoCli::runJson({"train", "--help-config", "--json"}, &why);
  if (j.isEmpty()) {
    if (error) *error = "cannot list the settings: " + why;
    return false;
  }
  for (const QJsonValue& v : j["keys"].toArray()) {
    const QJsonObject k = v.toObject();
    const QString key = k["key"].toString();
    if (m_handled.contains(key)) continue;
    Row row;
    row.type = k["type"].toString();
    row.defaultText = shown(k["default"]);
    QWidget* w;
    if (row.type == "bool") {
      row.check = new QCheckBox;
      row.check->setChecked(k["default"].toBool());
      connect(row.check, &QCheckBox::toggled, this, &AdvancedSettings::edited);
      w = row.check;
    } else {
      row.line = new QLineEdit(row.defaultText);
      if (row.type == "list") row.line->setPlaceholderText("comma-separated");
      connect(row.line, &QLineEdit::textChanged, this, &AdvancedSettings::edited);
      w = row.line;
    }
    w->setObjectName("adv_" + key);
    w->setToolTip(k["help"].toString() + " (default: " +
                  (row.defaultText.isEmpty() ? QString("none") : row.defaultText) + ")");
    auto* label = new QLabel(key);
    label->setToolTip(w->toolTip());
    m_form->addRow(label, w);
    m_order << key;
    m_rows.insert(key, row);
  }
  m_loaded = true;
  return true;
}

bool AdvancedSettings::setValue(const QString& key, const QString& value) {
  if (!m_rows.contains(key)) return false;
  const Row& r = m_rows[key];
  if (r.check)
    r.check->setChecked(value == "true");
  else
    r.line->setText(value);
  return true;
}

QString AdvancedSettings::value(const QString& key) const {
  if (!m_rows.contains(key)) return {};
  const Row& r = m_rows[key];
  return r.check ? QString(r.check->isChecked() ? "true" : "false") : r.line->text().trimmed();
}

QList<QPair<QString, QString>> AdvancedSettings::changed() const {
  QList<QPair<QString, QString>> out;
  for (const QString& key : m_order) {
    const Row& r = m_rows[key];
    const QString v = value(key);
    if (v == r.defaultText) continue;
    QString toml;
    if (r.type == "bool") {
      toml = v;
    } else if (r.type == "integer" || r.type == "number") {
      bool ok = false;
      v.toDouble(&ok);
      toml = ok ? v : tomlString(v);  // not a number: the CLI says "expected a number, got ..."
    } else if (r.type == "list") {
      QStringList items;
      for (const QString& s : v.split(',', Qt::SkipEmptyParts))
        if (!s.trimmed().isEmpty()) items << tomlString(s.trimmed());
      toml = "[" + items.join(", ") + "]";
    } else {
      toml = tomlString(v);
    }
    out.append({key, toml});
  }
  return out;
}

}  // namespace rondo::gui
