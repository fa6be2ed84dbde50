// The Chat tab's sampling controls, checkpoint choice and base-model comparison, against a real
// LoRA run of the tiny model (checkpoints step-2 and step-4). What the panel's chats were started
// with is read from /proc/PID/cmdline, and their replies are checked against `rondo chat --jsonl`
// run by the test itself with the same flags, not through the panel.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <QCheckBox>
#include <QComboBox>
#include <QDoubleSpinBox>
#include <QJsonArray>
#include <QJsonDocument>
#include <QJsonObject>
#include <QLabel>
#include <QRegularExpression>
#include <QSignalSpy>
#include <QSpinBox>
#include <QTest>
#include <QTextBrowser>

#include "gui/app/chat_panel.h"
#include "gui/app/rondo_cli.h"
#include "test_support.h"

using namespace rondo::gui;

namespace {

// A process's arguments as the kernel holds them (argv[0] first).
QStringList cmdline(qint64 pid) {
  QFile f(QString("/proc/%1/cmdline").arg(pid));
  if (pid <= 0 || !f.open(QIODevice::ReadOnly)) return {};
  QStringList out;
  for (const QByteArray& a : f.readAll().split('\0'))
    out << QString::fromUtf8(a);
  if (!out.isEmpty() && out.back().isEmpty()) out.removeLast();
  return out;
}

// The value after `name` in `args`; "" when it is not there.
QString flag(const QStringList& args, const QString& name) {
  const qsizetype i = args.indexOf(name);
  return i >= 0 && i + 1 < args.size() ? args[i + 1] : QString();
}

// `rondo chat ARGS --jsonl` run here, told `prompt` and then the end of its input: its "reply"
// line (text, tokens), or an object with "error".
QJsonObject directReply(const QStringList& args, const QString& prompt) {
  QProcess p;
  p.start(RondoCli::program(), QStringList{"chat"} + args + QStringList{"--jsonl"});
  if (!p.waitForStarted(10000)) return {{"error", "cannot start " + RondoCli::program()}};
  const QByteArray line = QJsonDocument(QJsonArray{prompt}).toJson(QJsonDocument::Compact);
  p.write(line.mid(1, line.size() - 2) + '\n');
  p.closeWriteChannel();
  if (!p.waitForFinished(120000)) return {{"error", "rondo chat did not end"}};
  for (const QByteArray& l : p.readAllStandardOutput().split('\n')) {
    const QJsonObject o = QJsonDocument::fromJson(l).object();
    if (o.value("type") == "reply") return o;
  }
  return {{"error", QString::fromUtf8(p.readAllStandardError())}};
}

}  // namespace

class Chat : public QObject {
  Q_OBJECT
  QTemporaryDir m_tmp;
  QString m_dir, m_run;

  // Waits for the panel's first reply; "" when none came (the status line says why).
  static QString firstReply(QSignalSpy& replied) {
    if (replied.isEmpty() && !replied.wait(120000)) return {};
    return replied.at(0).at(0).toString();
  }

 private slots:
  void initTestCase() {
    const QString error = test::writeFixtureIn(m_tmp, &m_dir);
    QVERIFY2(error.isEmpty(), qPrintable(error));
    // A LoRA run of 4 steps with a checkpoint every 2: step-2 and step-4 to choose from.
    m_run = m_dir + "/run";
    const QString trained = test::trainRun(
        m_dir, "run",
        {{"training", "steps = 4\nbatch_rows = 2\nlr = 0.01"}, {"checkpoint", "every = 2"}});
    QVERIFY2(trained.isEmpty(), qPrintable(trained));
    QVERIFY(QDir(m_run + "/checkpoints/step-2").exists());
    QVERIFY(QDir(m_run + "/checkpoints/step-4").exists());
  }

  // Max new tokens = 3: the chat is started with -n 3 and its reply is the 3-token reply that
  // `rondo chat -n 3` gives, where without the cap the same prompt goes on longer.
  void maxNewTokensBoundsTheReply() {
    ChatPanel p;
    p.setRun(m_run);
    auto* max = p.findChild<QSpinBox*>("chatMaxTokens");
    QVERIFY(max);
    QCOMPARE(max->value(), 256);  // what the tab asked for before it had the control
    max->setValue(3);
    QSignalSpy replied(&p, &ChatPanel::replied);
    p.send("sky?");
    const QString reply = firstReply(replied);
    QVERIFY2(!reply.isEmpty(), qPrintable(p.statusText()));
    QCOMPARE(flag(cmdline(p.processId()), "-n"), QString("3"));
    const QRegularExpressionMatch tokens =
        QRegularExpression(R"(\((\d+) tokens\))").match(p.statusText());
    QVERIFY2(tokens.hasMatch(), qPrintable(p.statusText()));
    QVERIFY2(tokens.captured(1).toInt() <= 3, qPrintable(p.statusText()));
    const QJsonObject capped = directReply({m_run, "-n", "3"}, "sky?");
    QVERIFY2(capped.contains("text"), qPrintable(capped.value("error").toString()));
    QCOMPARE(reply, capped["text"].toString());
    QVERIFY(capped["tokens"].toInt() <= 3);
    const QJsonObject full = directReply({m_run, "-n", "256"}, "sky?");
    QVERIFY2(full["tokens"].toInt() > 3, "the cap must be what cut the reply short");
    QVERIFY(full["text"].toString().startsWith(reply));
  }

  // Temperature, top-p, max new tokens and seed reach the chat as flags; a sampled reply is the
  // one `rondo chat` gives with the same flags (same seed). A change while chatting says in the
  // status line that the context restarts and applies at the next message, in a new chat; the
  // transcript stays.
  void samplingFlagsReachTheChild() {
    ChatPanel p;
    p.setRun(m_run);
    auto* temperature = p.findChild<QDoubleSpinBox*>("chatTemperature");
    auto* topP = p.findChild<QDoubleSpinBox*>("chatTopP");
    auto* max = p.findChild<QSpinBox*>("chatMaxTokens");
    auto* seed = p.findChild<QSpinBox*>("chatSeed");
    QVERIFY(temperature && topP && max && seed);
    QCOMPARE(temperature->value(), 0.0);  // greedy unless asked
    QVERIFY(!topP->isEnabled() && !seed->isEnabled());
    temperature->setValue(0.7);
    QVERIFY(topP->isEnabled() && seed->isEnabled());
    topP->setValue(0.9);
    max->setValue(8);
    seed->setValue(7);
    QSignalSpy replied(&p, &ChatPanel::replied);
    p.send("sky?");
    const QString first = firstReply(replied);
    QVERIFY2(!first.isEmpty(), qPrintable(p.statusText()));
    const qint64 pid = p.processId();
    const QStringList args = cmdline(pid);
    QCOMPARE(args.mid(1, 3), (QStringList{"chat", m_run, "--jsonl"}));
    QCOMPARE(flag(args, "-t"), QString("0.7"));
    QCOMPARE(flag(args, "--top-p"), QString("0.9"));
    QCOMPARE(flag(args, "-n"), QString("8"));
    QCOMPARE(flag(args, "--seed"), QString("7"));
    QVERIFY(!args.contains("--checkpoint"));  // the newest
    QCOMPARE(args.mid(1), p.arguments());
    const QJsonObject want =
        directReply({m_run, "-n", "8", "-t", "0.7", "--top-p", "0.9", "--seed", "7"}, "sky?");
    QVERIFY2(want.contains("text"), qPrintable(want.value("error").toString()));
    QCOMPARE(first, want["text"].toString());

    temperature->setValue(0);
    QVERIFY2(p.statusText().contains("context restarts"), qPrintable(p.statusText()));
    QCOMPARE(p.processId(), pid);  // not before the next message
    p.send("hi");
    QVERIFY2(replied.wait(120000), qPrintable(p.statusText()));
    QVERIFY(p.chatting());
    QVERIFY(p.processId() != pid);
    QCOMPARE(flag(cmdline(p.processId()), "-t"), QString("0"));
    // A new chat: its reply is the greedy first turn's, without "sky?" before it.
    const QJsonObject fresh = directReply({m_run, "-n", "8"}, "hi");
    QCOMPARE(replied.at(1).at(0).toString(), fresh["text"].toString());
    const QString transcript = p.transcript();
    QVERIFY2(transcript.startsWith("You: sky?\nModel: " + first + "\nNote: A new chat (greedy, "),
             qPrintable(transcript));
    QVERIFY2(transcript.endsWith("\nYou: hi\nModel: " + fresh["text"].toString()),
             qPrintable(transcript));
  }

  // Compare with the base model: each message goes also to `rondo chat <base model>` with the
  // same flags, and both replies are shown side by side; at temperature 0 the base reply is the
  // one `rondo chat <model>` gives when run here.
  void compareShowsTheBaseBesideTheTuned() {
    ChatPanel p;
    p.resize(1000, 600);
    p.setRun(m_run);
    p.show();
    QVERIFY(QTest::qWaitForWindowExposed(&p));
    auto* compare = p.findChild<QCheckBox*>("chatCompareBase");
    QVERIFY(compare);
    auto* baseView = p.findChild<QTextBrowser*>("chatBaseTranscript");
    QVERIFY(baseView && !baseView->isVisible());
    QCOMPARE(p.baseModel(), m_dir + "/model");
    p.findChild<QSpinBox*>("chatMaxTokens")->setValue(8);
    compare->setChecked(true);
    QVERIFY(baseView->isVisible());
    QSignalSpy replied(&p, &ChatPanel::replied), baseReplied(&p, &ChatPanel::baseReplied);
    p.send("sky?");
    QVERIFY2(!firstReply(replied).isEmpty(), qPrintable(p.statusText()));
    QTRY_COMPARE_WITH_TIMEOUT(baseReplied.count(), 1, 120000);

    const QStringList baseArgs = cmdline(p.baseProcessId());
    QCOMPARE(baseArgs.mid(1, 3), (QStringList{"chat", m_dir + "/model", "--jsonl"}));
    QCOMPARE(flag(baseArgs, "-t"), QString("0"));
    QCOMPARE(flag(baseArgs, "-n"), QString("8"));
    QVERIFY(!baseArgs.contains("--cpu"));  // no run is training
    const QJsonObject base = directReply({m_dir + "/model", "-n", "8", "-t", "0"}, "sky?");
    const QJsonObject tuned = directReply({m_run, "-n", "8", "-t", "0"}, "sky?");
    QVERIFY2(base.contains("text") && tuned.contains("text"),
             qPrintable(base.value("error").toString() + tuned.value("error").toString()));
    QCOMPARE(p.baseTranscript(), "You: sky?\nModel: " + base["text"].toString());
    QCOMPARE(p.transcript(), "You: sky?\nModel: " + tuned["text"].toString());
    // Two models: otherwise the comparison above could pass with one chat shown twice.
    QVERIFY(base["text"].toString() != tuned["text"].toString());
    QVERIFY2(p.findChild<QLabel*>("chatTunedTitle")->text().startsWith("Tuned (step 4)"),
             qPrintable(p.findChild<QLabel*>("chatTunedTitle")->text()));
    QVERIFY2(p.findChild<QLabel*>("chatBaseTitle")->text().startsWith("Base (model)"),
             qPrintable(p.findChild<QLabel*>("chatBaseTitle")->text()));
    QVERIFY(test::colours(test::screenshot(&p, "chat_compare")) > 30);

    // Off: the base chat ends and its view goes.
    compare->setChecked(false);
    QVERIFY(!baseView->isVisible());
    QCOMPARE(p.baseProcessId(), 0);
    QVERIFY(p.chatting());
  }

  // While `rondo train` holds the run (its lock, flocked, naming it), the base chat keeps off the
  // GPUs as `rondo chat RUN` does (--cpu); not once the lock is let go.
  void baseChatKeepsOffATrainingRunsGpus() {
    ChatPanel p;
    p.setRun(m_run);
    QVERIFY(!p.baseArguments().contains("--cpu"));
    const QByteArray path = QFile::encodeName(m_run + "/rondo.lock");
    const int fd = ::open(path.constData(), O_RDWR | O_CLOEXEC);
    QVERIFY(fd >= 0);
    QCOMPARE(::flock(fd, LOCK_EX | LOCK_NB), 0);
    const QByteArray note = "4242 rondo train\n";
    QCOMPARE(::pwrite(fd, note.constData(), note.size(), 0), ssize_t(note.size()));
    const bool held = p.baseArguments().contains("--cpu");
    QVERIFY(::ftruncate(fd, 0) == 0);
    ::close(fd);
    QVERIFY(held);
    QVERIFY(!p.baseArguments().contains("--cpu"));
  }

  // An older checkpoint chosen goes to the chat as --checkpoint, and the reply is that
  // checkpoint's.
  void anOlderCheckpointIsPassed() {
    ChatPanel p;
    p.setRun(m_run);
    auto* box = p.findChild<QComboBox*>("chatCheckpoint");
    QVERIFY(box);
    QStringList items;
    for (int i = 0; i < box->count(); ++i)
      items << box->itemText(i);
    QCOMPARE(items, (QStringList{"Newest", "step-4", "step-2"}));
    box->setCurrentIndex(box->findData("step-2"));
    p.findChild<QSpinBox*>("chatMaxTokens")->setValue(8);
    QSignalSpy replied(&p, &ChatPanel::replied);
    p.send("sky?");
    const QString reply = firstReply(replied);
    QVERIFY2(!reply.isEmpty(), qPrintable(p.statusText()));
    QCOMPARE(flag(cmdline(p.processId()), "--checkpoint"), QString("step-2"));
    QVERIFY2(p.findChild<QLabel*>("chatTunedTitle")->text().startsWith("Tuned (step 2)"),
             qPrintable(p.findChild<QLabel*>("chatTunedTitle")->text()));
    const QJsonObject want = directReply({m_run, "--checkpoint", "step-2", "-n", "8"}, "sky?");
    QVERIFY2(want.contains("text"), qPrintable(want.value("error").toString()));
    QCOMPARE(reply, want["text"].toString());
  }
};

QTEST_MAIN(Chat)
#include "chat_test.moc"
