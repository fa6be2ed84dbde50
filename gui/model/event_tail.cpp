#include "gui/model/event_tail.h"

#include <QFileInfo>
#include <algorithm>

#include "gui/model/run_state.h"

namespace rondo::gui {
namespace {
// Larger appends are read in pieces of this size, so a huge file never needs one huge buffer
// when it cannot be mapped.
constexpr qint64 kReadChunk = 64 << 20;
}  // namespace

EventTail::EventTail(RunState* state, QObject* parent) : QObject(parent), m_state(state) {
  m_timer.setInterval(kPollMs);
  connect(&m_timer, &QTimer::timeout, this, &EventTail::poll);
}

bool EventTail::open(const QString& path, QString* error) {
  close();
  m_state->reset();
  m_file.setFileName(path);
  if (!m_file.open(QIODevice::ReadOnly)) {
    if (error) *error = QStringLiteral("cannot open %1: %2").arg(path, m_file.errorString());
    return false;
  }
  if (!readFrom(m_file.size(), true, error)) {
    m_file.close();
    return false;
  }
  setFollowing(true);
  return true;
}

bool EventTail::readFrom(qint64 size, bool mapped, QString* error) {
  while (m_offset < size) {
    const qint64 n = size - m_offset;
    // Mapping avoids copying the bytes; RunState only looks at them during feed(). Only for the
    // bulk read at open(): QFile's idea of the size is stale once the file grows.
    if (uchar* map = mapped ? m_file.map(m_offset, n) : nullptr) {
      m_state->feed(QByteArrayView(reinterpret_cast<const char*>(map), n));
      m_file.unmap(map);
      m_offset += n;
      continue;
    }
    if (!m_file.seek(m_offset)) {
      if (error)
        *error = QStringLiteral("cannot read %1: %2").arg(m_file.fileName(), m_file.errorString());
      return false;
    }
    const QByteArray bytes = m_file.read(std::min(n, kReadChunk));
    if (bytes.isEmpty()) {
      if (error)
        *error = QStringLiteral("cannot read %1: %2").arg(m_file.fileName(), m_file.errorString());
      return false;
    }
    m_offset += bytes.size();
    m_state->feed(bytes);
  }
  return true;
}

void EventTail::poll() {
  if (!m_file.isOpen()) return;
  const qint64 size = QFileInfo(m_file.fileName()).size();
  if (size < m_offset) {
    // The file was truncated or replaced: a new run writes it from the start.
    m_offset = 0;
    m_state->reset();
    m_file.close();
    if (!m_file.open(QIODevice::ReadOnly)) return;
  }
  if (size > m_offset) readFrom(size, false, nullptr);
}

void EventTail::setFollowing(bool on) {
  if (on && m_file.isOpen())
    m_timer.start();
  else
    m_timer.stop();
}

void EventTail::finish() {
  poll();
  m_timer.stop();
  m_state->finishInput();
}

void EventTail::close() {
  m_timer.stop();
  if (m_file.isOpen()) m_file.close();
  m_offset = 0;
}

}  // namespace rondo::gui
