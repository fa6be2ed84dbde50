// The event stream: one JSON object per line (events.jsonl, or stdout with `--events -`), the one
// contract between the engine and every front end (docs/architecture.md §8; schema in
// docs/events.md). Every event carries the schema version "v", its "type", "t" (seconds since the
// run started, on a monotonic clock) and "time" (wall clock, UTC, ISO 8601). Thread-safe: workers,
// the optimizer and the session emit concurrently; each line is written whole and flushed, so a
// reader tailing the file (the GUI) never sees half an event.
//
//   auto sink = engine::EventSink::open(run_dir + "/events.jsonl");
//   sink->emit(engine::StepEvent{.step = 1, .steps_total = 100, .loss = 2.31, ...});
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace rondo::engine {

inline constexpr int kEventSchemaVersion = 1;

struct RunStartEvent {
  std::string run_dir;
  std::string model;
  std::string method;  // "lora" or "full"
  std::int64_t steps_total = 0;
  std::string config_toml;        // the resolved config, as written to config.toml
  std::int64_t resumed_from = 0;  // resuming: the step of the checkpoint it continues from
  int rank = 0, ranks = 1;        // data parallel: this process's rank and how many run
};

struct PlanEvent {
  std::string plan;  // Plan::describe()
  int devices = 0;
  int microbatches = 0;
  double predicted_step_s = 0;  // predict(): steady-state step time
  double predicted_idle_fraction = 0;
  std::vector<std::uint64_t> predicted_peak_bytes;  // per device
  std::string partitioner;                          // "ours" or "reference"
  // Predicted bytes per step: over the links (weights as stored, activations, gradients) and
  // the NVMe tier.
  double predicted_bytes_up = 0, predicted_bytes_down = 0;
  double predicted_nvme_read = 0, predicted_nvme_write = 0;
  std::string placement_json;  // where state lives and how it is kept (a JSON object), or ""
};

struct StepEvent {
  std::int64_t step = 0;  // 1-based, after the optimizer step
  std::int64_t steps_total = 0;
  double loss = 0;  // mean over the step's target tokens (preference: over its microbatches)
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double tokens_per_s = 0;
  double eta_s = 0;
  std::int64_t tokens = 0;  // target tokens in the step
  // A preference objective's metrics by TRL's names ("rewards/margins", ...): "metrics" in JSON.
  std::vector<std::pair<std::string, double>> metrics;
};

struct EvalEvent {
  std::int64_t step = 0;
  double loss = 0;  // validation loss
  std::int64_t tokens = 0;
  std::vector<std::pair<std::string, double>> metrics;  // as StepEvent's
};

struct SampleEvent {
  std::int64_t step = 0;
  std::string prompt;
  std::string text;
};

struct DeviceEvent {
  int device = 0;
  std::string name;
  std::uint64_t bytes_in_use = 0;
  std::uint64_t bytes_peak = 0;
  std::uint64_t bytes_cap = 0;
  double busy_fraction = 0;     // since the previous device event
  std::uint64_t bytes_h2d = 0;  // totals since the run started
  std::uint64_t bytes_d2h = 0;
};

// One stage job on one device, for the pipeline timeline.
struct SpanEvent {
  int device = 0;
  std::int64_t step = 0;
  std::string stage;  // "F0", "T", "B2"
  int first_layer = 0, end_layer = 0;
  double start = 0, end = 0;  // seconds since the run started
};

// Loading the model into the host state (and NVMe tier) before the first step, layer by layer.
struct LoadEvent {
  std::int64_t layers_done = 0;
  std::int64_t layers_total = 0;
};

struct CheckpointEvent {
  std::int64_t step = 0;
  std::string path;
  std::uint64_t bytes = 0;
};

struct MessageEvent {  // type "warning" or "error"
  std::string message;
};

struct RunEndEvent {
  std::string status;  // "completed", "stopped" (by the user), "failed"
  std::int64_t steps = 0;
  double seconds = 0;
  std::string export_path;  // "" when nothing was exported
  // Host memory: the process's peak resident size (the kernel's VmHWM), the budget the arena
  // kept to and the most it held, and the process's own overhead outside the budget
  // (Note [Host budget]); 0 when unknown.
  std::uint64_t host_peak_bytes = 0, host_budget_bytes = 0, host_arena_peak_bytes = 0,
                host_overhead_bytes = 0;
  // The NVMe tier, when the run had one: its I/O backend and the bytes it moved.
  std::string nvme_backend;
  std::uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0;
};

class EventSink {
 public:
  // Appends to `path` ("-" = stdout). Throws Error naming the path if it cannot be opened.
  static std::unique_ptr<EventSink> open(const std::string& path);
  ~EventSink();
  EventSink(const EventSink&) = delete;
  EventSink& operator=(const EventSink&) = delete;

  void emit(const RunStartEvent& e);
  void emit(const PlanEvent& e);
  void emit(const StepEvent& e);
  void emit(const EvalEvent& e);
  void emit(const SampleEvent& e);
  void emit(const DeviceEvent& e);
  void emit(const SpanEvent& e);
  void emit(const CheckpointEvent& e);
  void emit(const LoadEvent& e);
  void warning(const std::string& message);
  void error(const std::string& message);
  void emit(const RunEndEvent& e);

  // Seconds since this sink was opened (the run's clock, as in "t" and span times).
  double now() const;

 private:
  EventSink(int fd, bool owned);
  // Adds "v", "type", "t", "time" to `fields` (a JSON object's members, already serialised
  // without braces) and writes the line.
  void write(const char* type, const std::string& fields);

  int fd_;  // O_APPEND for a file; each line goes out in one write() (a reader tailing the file
            // sees whole lines, but for the last one while it is written)
  bool owned_;
  std::mutex mutex_;
  std::int64_t start_ns_;  // steady clock
};

}  // namespace rondo::engine
