// A training run from a TrainConfig, start to end: checks everything it can before allocating
// (config, files, data, sequence length, host memory, disk, device memory), then loads the model
// into the host store, trains with the engine, evaluates, samples, writes checkpoints and exports,
// and reports through the event stream (run folder layout: docs/architecture.md §8). A run stopped
// (request_stop) or killed continues exactly with `resume`: everything after a checkpoint is a
// pure function of what the checkpoint holds (see Note [Exact resume] in checkpoint.cpp).
//
//   engine::Session s(config, {.config_toml = text, .log = print_line});
//   std::puts(s.describe().c_str());
//   engine::SessionResult r = s.run();
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/estimate.h"
#include "engine/events.h"
#include "engine/ranks.h"
#include "engine/run_errors.h"  // rethrow_with_settings
#include "engine/train_config.h"
#include "offload/io_faults.h"

namespace rondo::engine {

// Where a run calls SessionOptions::on_fault_point, with the step it is at.
enum class FaultPoint : std::uint8_t {
  kAfterStep,     // step N's event is out; nothing after it (checkpoint, evaluation) has run
  kInCheckpoint,  // step N's checkpoint is written and synced under its temporary name, not renamed
};

struct SessionOptions {
  std::string config_toml;  // the resolved config, written to <run_dir>/config.toml
  bool resume = false;      // continue from the newest checkpoint of output.run_dir that passes
                            // its checks (engine::checkpoint_problems)
  std::string checkpoint;   // resuming: this one instead ("step-N" or its path)
  // Resuming with settings that do not change the training changed (where state lives, budgets,
  // devices, checkpoint.keep): config_toml replaces the run's config.toml once the run holds its
  // lock, so that later resumes keep them.
  bool resume_settings_changed = false;
  std::string events;                             // "" = <run_dir>/events.jsonl, "-" = stdout
  std::function<void(const std::string&)> log;    // progress lines for a person
  std::function<void(const StepEvent&)> on_step;  // after each step (status line)
  // `rondo plan`: a run that does not fit is reported by describe() and fits(), not thrown.
  bool plan_only = false;
  // `rondo plan --max-seq-len`: also the longest sequence that fits (RunEstimate::longest).
  bool find_longest = false;
  // `rondo plan --nodes N`: plan each of N ranks' share of a step and the gradients' sums across
  // them (RunEstimate::ranks; `ranks` below is for a run, which knows its ranks).
  int plan_ranks = 0;
  // `--dry-run`: look, change nothing. A resume takes no lock (a run training meanwhile may be
  // looked at), removes no stale temporaries and sets no damaged checkpoint aside (it names them);
  // run() is refused.
  bool dry_run = false;
  // Tests: overrides what the OS reports (0 = ask).
  std::uint64_t host_free = 0, disk_free = 0;
  // Tests: faults, passed in (the library reads no test variable; `rondo` builds them from
  // RONDO_FAULT_* in cli/test_faults.cpp). `io_faults` go to the NVMe tier's store
  // (offload/io_faults.h). `on_fault_point` is called at each FaultPoint the run passes; the
  // resume tests' hook SIGKILLs the process there, so that a resume meets a real crash.
  std::vector<offload::FaultRule> io_faults;
  std::function<void(FaultPoint, std::int64_t step)> on_fault_point;
  // Data parallelism (engine/ranks.h, docs/distributed.md): this process's place among the run's
  // ranks, connected; null = one process. Every rank runs the same config on its share of each
  // step (training.grad_accum microbatches a step over all ranks: a multiple of their number).
  // Rank 0 keeps the run folder as one process would (lock, config.toml, events, checkpoints,
  // validation, samples, exports); rank r > 0 writes only its events and its lock, under
  // <run_dir>/ranks/rank-r/, and resumes from the checkpoint rank 0 chose.
  Ranks* ranks = nullptr;
};

struct SessionResult {
  std::string status;      // "completed" or "stopped"
  std::int64_t steps = 0;  // the last step done
  double last_loss = 0;
  std::string export_path;  // the first export written ("" if none)
  std::string checkpoint;   // the last checkpoint written
};

class Session {
 public:
  // Validates the config, opens the model's headers, tokenizer and data, picks the devices and
  // the plan, and checks host memory and disk — allocates nothing large. Throws Error listing
  // every config problem, or naming the file (and line) or field at fault.
  Session(const TrainConfig& config, SessionOptions options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Data statistics, the plan and the estimate (for --dry-run and the start of a run).
  std::string describe() const;
  std::int64_t steps_total() const;
  bool fits() const;  // the estimate's verdict is "fits" or "tight"
  const RunEstimate& estimate() const;

  // Trains to the end, or until request_stop(); writes a checkpoint either way. On an error the
  // run ends with an `error` event and `run_end` failed, and the error is rethrown.
  SessionResult run();
  // Thread-safe: finish the steps under way, checkpoint, return. Not from a signal handler.
  void request_stop();
  // Thread-safe, for a process about to exit at once (a second Ctrl-C): while run() trains and
  // has not written its end, writes `run_end` with status "interrupted" and the last step done.
  // Not from a signal handler.
  void end_interrupted();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rondo::engine
