// The synchronisation board: everything the engine's threads hand each other while a segment runs
// — the steps handed out, each job's progress, the tensors passed from job to job, the layers'
// versions, the loss scale, the results — behind one mutex, reached only through the named calls
// below (Note [Engine synchronisation] in board.cpp gives the protocol and why it is safe). A
// failure anywhere is stored once and wakes every waiter, which then throws Aborted; a wait for a
// step that will not run (a stop) throws Stopped. Used by engine.cpp, pipeline.cpp and
// optimizer_driver.cpp; it owns no device memory and runs no work itself.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <latch>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/replan.h"
#include "engine/step_inputs.h"
#include "kernels/device.h"
#include "offload/host_arena.h"
#include "offload/transfer.h"

namespace rondo::engine {

struct Aborted {};  // thrown inside waits once another thread has failed
struct Stopped {};  // thrown inside waits for a step that will not run (request_stop)

// How a job's output or an activation checkpoint reaches the job that takes it.
enum class HandoffRoute {
  kKeep,      // stays in the producer's device memory: the consumer runs on the same device
  kDownload,  // down to host staging memory, up to the consumer's device
  kSpill,     // down to host staging, then to the NVMe tier until the consumer reads it back
};

// A tensor handed from one job to the next (or a checkpoint from a forward job to a backward
// one). Written by the producer before it is published, owned by the consumer once taken.
struct Handoff {
  bool published = false;  // under the board's lock (Board::publish, Board::take)
  HandoffRoute route = HandoffRoute::kKeep;
  kernels::Device* device = nullptr;      // kKeep: where the data is
  std::unique_ptr<kernels::Event> event;  // kKeep: the compute that wrote it is done
  kernels::DeviceBuffer dev;              // kKeep
  offload::Staged host;                   // kDownload (and kSpill once read back)
  offload::Spilled spilled;               // kSpill: on the NVMe tier
  std::vector<std::int64_t> sizes;
};

// What a handoff is: job g's output for microbatch m, or the checkpoint of layer l's input for
// microbatch m of step s.
enum class HandoffKind { kOutput, kCheckpoint };
struct HandoffKey {
  std::int64_t g_or_step = 0;
  int layer = 0;  // 0 for outputs
  int microbatch = 0;
  auto operator<=>(const HandoffKey&) const = default;
};

// A step's inputs on one device: every microbatch's, uploaded in one copy by the first job of the
// step that runs there, read by the step's later jobs on the device (same compute stream).
struct DeviceInputs {
  kernels::DeviceBuffer buffer;
  std::vector<MicrobatchInputs> mb;
};

// One step (or evaluation batch) while its jobs run: made by the main thread, read by the
// workers and the optimizer.
struct StepData {
  StepInputs in;
  std::int64_t step_no = 0;  // 1-based, across train() calls (an evaluation's batch number)
  // The step's target tokens and microbatches over every rank (EngineOptions::data_parallel; one
  // process: in.targets and in.mb.size()), and the global index of this rank's first microbatch.
  std::int64_t all_targets = 0;
  int all_microbatches = 0, first_microbatch = 0;
  // Every microbatch's inputs packed (in.layout) into host staging memory, page-locked where the
  // arena pins, so that the copies do not block; uploaded once per device that runs a job.
  std::shared_ptr<offload::HostBuffer> packed;
  // The step's jobs' microbatches whose attention ran per document, or under masks (StepResult).
  mutable std::atomic<std::int64_t> per_document_passes{0}, masked_passes{0};
  std::mutex inputs_mu;
  std::map<int, std::shared_ptr<DeviceInputs>> on_device;  // by device, under inputs_mu
  // What the step's loss is a mean over: its target tokens (all_targets), or its microbatches
  // (all_microbatches) for a preference objective.
  double loss_denominator = 1;
  // The tail's values (value_count() floats), downloaded into staging memory (a pageable
  // destination would block the worker until the tail's compute has finished): [0] the loss sum;
  // a step of preference pairs (`pairs`) then the preference metrics' sums, then, when an
  // evaluation asks for them (sequence_slots > 0), each microbatch's sequences' summed
  // log-probabilities. A supervised step's is the loss sum alone.
  std::shared_ptr<offload::HostBuffer> loss;
  bool pairs = false;
  int sequence_slots = 0;
  static constexpr std::size_t kStepValues = 1 + kPreferenceMetrics;
  std::size_t value_count() const {
    return pairs ? kStepValues + in.mb.size() * static_cast<std::size_t>(sequence_slots) : 1;
  }
  double loss_scale = 1;  // fp16 scale this step's backward uses (set by the tail)
  // MoE: each microbatch's routing, recorded by its forward and read by its backward.
  std::vector<std::shared_ptr<models::RoutingRecord>> routing;
};

// One job of the segment while it runs: loaded by its device's loader, run by its worker, its
// gradients read by the optimizer. Dropped from the board once released and consumed.
struct JobRun {
  // Loader -> worker.
  bool loaded = false;
  std::unique_ptr<offload::DeviceWeights> weights;
  std::shared_ptr<kernels::Event> weights_ready;  // outlives `weights` (one-step-stale waits)
  // Worker -> optimizer, loader.
  bool enqueued = false;
  // The loader has freed its buffers; the optimizer has read its gradients (set at once for a job
  // without any).
  bool released = false, consumed = false;
  std::unique_ptr<kernels::Event> done_compute, done_up, done_down;
  std::vector<kernels::DeviceBuffer> buffers;
  std::vector<offload::HostBuffer> staging;
  std::vector<std::shared_ptr<const void>> keep;  // host memory the job's copies read
  // Its gradients that go to the NVMe tier: counts down as the gradient writer has brought each
  // layer's down and let its device memory go (null: none). The loader waits for it with the
  // job's events before it treats the job's memory as free.
  std::shared_ptr<std::latch> grads_written;
  // Timing events around each microbatch's compute on the compute stream: the job's device time
  // (spans, busy shares, the re-planner's measurements), read once they have completed. Host
  // clocks would time the launches on a GPU, not the work.
  std::vector<std::pair<std::unique_ptr<kernels::Event>, std::unique_ptr<kernels::Event>>> timing;
  std::int64_t tokens = 0;
  bool accounted = false;
};

class Board {
 public:
  // ---- a segment ----
  // Everything reset for a segment over `layers` layers; the loss scale steps start with;
  // `training`: a stop (stop_early) applies to it, not to an evaluation.
  void begin_segment(std::size_t layers, double loss_scale, bool training);
  // Evaluation: no optimizer runs, every layer's streaming copy is as the last update left it.
  void open_every_layer();
  // After the threads have joined: the jobs still on the board (for their accounting), then
  // everything dropped.
  std::vector<std::pair<std::int64_t, std::shared_ptr<JobRun>>> remaining_runs();
  void end_segment();

  // ---- failure ----
  // The first failure wins; every waiter wakes and throws Aborted.
  void fail(std::exception_ptr error);
  bool failed();
  // The stored failure (null when none); set_error_if_none stores one after the threads joined.
  std::exception_ptr error();
  void set_error_if_none(std::exception_ptr error);

  // ---- steps ----
  // Step s (0-based in the segment) handed to the threads.
  void hand_out(std::int64_t s, std::shared_ptr<StepData> step);
  // A stop as soon as the state allows: the steps no thread has begun (no worker has taken a job
  // of them, the one-step-stale optimizer has not published for them) will not run, handed out or
  // not; the steps begun run to their update. Nothing in an evaluation.
  void stop_early();
  // Steps from `steps` on (0-based) will not run; those before it run to their update (data
  // parallel: every rank stops after the same step, begun or not).
  void stop_after(std::int64_t steps);
  bool stopped(std::int64_t s);
  // Blocks until step s is handed out (Stopped when it never will be).
  void wait_handed_out(std::int64_t s);
  std::shared_ptr<StepData> step(std::int64_t s);
  void drop_step(std::int64_t s);

  // ---- jobs ----
  // The loader of job g of step s: waits until every layer in `layers` has version >= s (the
  // optimizer has written it for step s), then the job's run.
  std::shared_ptr<JobRun> wait_weights_current(std::int64_t g, std::int64_t s,
                                               const std::vector<int>& layers);
  // The job's run if it is still on the board (else null).
  std::shared_ptr<JobRun> find_run(std::int64_t g);
  // The loader has enqueued the uploads of `r`, job j of step s; `stale_upload`: one-step-stale
  // mode records them for the optimizer's publishing.
  void loaded(std::int64_t s, int j, const std::shared_ptr<JobRun>& r, bool stale_upload);
  // The worker: waits for step s's data and job g's weights.
  std::pair<std::shared_ptr<StepData>, std::shared_ptr<JobRun>> wait_loaded(std::int64_t g,
                                                                            std::int64_t s);
  // The worker has enqueued all of job g's work; `has_gradients`: the optimizer reads some;
  // `evaluated_batch`: an evaluation's last job, of that batch.
  void enqueued(std::int64_t g, bool has_gradients, std::optional<std::int64_t> evaluated_batch);
  // Waits until job g (of step s) is enqueued.
  std::shared_ptr<JobRun> wait_enqueued(std::int64_t g, std::int64_t s);
  // The loader has freed job g's buffers / the optimizer has read its gradients; the run leaves
  // the board when both are done.
  void released(std::int64_t g);
  void consumed(std::int64_t g);

  // ---- layers ----
  // Layer l's streaming copy is current for step s + 1 (one-step-stale publishing).
  void layer_published(std::size_t l, std::int64_t s);
  // The optimizer's pass of step s over layer l is done: weights written, gradients read.
  void layer_updated(std::size_t l, std::int64_t s);
  // The same for every layer at once (a skipped step).
  void every_layer_updated(std::int64_t s);
  // A worker of step s, before it downloads gradients of `layers`: waits until the optimizer has
  // read step s - 1's.
  void wait_gradients_read(const std::vector<int>& layers, std::int64_t s);

  // ---- one-step-stale uploads ----
  // The runs of step s's jobs for which `streams(j)` holds, once there are `needed` of them.
  std::vector<std::shared_ptr<JobRun>> wait_uploads(std::int64_t s, std::size_t needed,
                                                    const std::function<bool(int)>& streams);
  void forget_uploads(std::int64_t s);

  // ---- the loss scale ----
  // The optimizer of step s has decided step s + 1's scale.
  void scale_decided(std::int64_t s, double next_scale);
  // Step s's scale, once decided.
  double wait_scale(std::int64_t s);

  // ---- handoffs ----
  // The producer's handoff (made when absent); publish it once written.
  std::shared_ptr<Handoff> handoff(HandoffKind kind, HandoffKey key);
  void publish(const std::shared_ptr<Handoff>& h);
  // The consumer's: waits until it is published and takes it off the board.
  std::shared_ptr<Handoff> take(HandoffKind kind, HandoffKey key);
  // Checkpoints of step s, microbatch m, of layers in `layers` already published.
  std::vector<std::shared_ptr<Handoff>> published_checkpoints(std::int64_t s,
                                                              const std::vector<int>& layers,
                                                              int m);

  // ---- results ----
  void add_result(const StepResult& result);
  // Step s's result once in; nullopt when the segment failed first.
  std::optional<StepResult> wait_result(std::int64_t s);
  // Whether evaluation batch b's last job was enqueued before a failure.
  bool wait_evaluated(std::int64_t b);

  // ---- measurements (re-planning) ----
  void add_measurement(const Measurement& m);
  std::vector<Measurement> take_measurements();

 private:
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred pred);
  template <typename Pred>
  void wait_step(std::unique_lock<std::mutex>& lock, std::int64_t s, Pred pred);
  // The same for the waits that begin step s's work on the state (a worker taking a job, the
  // one-step-stale optimizer publishing): Stopped once the run stops before s even when `pred`
  // holds, and the step counts as begun when it returns.
  template <typename Pred>
  void wait_to_begin(std::unique_lock<std::mutex>& lock, std::int64_t s, Pred pred);
  // Sets a run's flag (released, consumed); the run leaves the board once both are set.
  void set_and_drop(std::int64_t g, bool JobRun::*flag);
  std::map<HandoffKey, std::shared_ptr<Handoff>>& handoffs(HandoffKind kind) {
    return kind == HandoffKind::kOutput ? outputs_ : ckpts_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
  std::exception_ptr error_;
  // Steps of the segment that run: all, until a stop; then those already handed out.
  std::int64_t stop_steps_ = std::numeric_limits<std::int64_t>::max();
  std::int64_t begun_ = 0;  // steps some thread has begun (wait_to_begin)
  bool training_ = false;
  std::int64_t handed_out_ = 0;         // steps handed out so far (dropped ones included)
  std::int64_t scales_decided_ = 0;     // steps whose optimizer has set the next step's loss scale
  double scale_ = 1;                    // the loss scale of step scales_decided_
  std::vector<std::int64_t> versions_;  // per layer: optimizer passes over its weights
  std::vector<std::int64_t> grads_consumed_;  // per layer: optimizer passes that read its grads
  // One-step-stale mode: each step's jobs with their uploads, for the optimizer to wait on.
  std::map<std::int64_t, std::vector<std::pair<int, std::shared_ptr<JobRun>>>> loads_;
  std::map<std::int64_t, std::shared_ptr<StepData>> steps_;
  std::map<std::int64_t, std::shared_ptr<JobRun>> runs_;
  std::map<HandoffKey, std::shared_ptr<Handoff>> outputs_, ckpts_;
  std::vector<StepResult> results_;
  std::set<std::int64_t> evaluated_;   // evaluation batches whose last job has been enqueued
  std::vector<Measurement> measured_;  // job times since the last re-plan
};

// The error a thread's exception becomes, with `where` (the job, the step) prepended: a device out
// of memory a DeviceMemoryError, an op without a deterministic implementation a
// NondeterministicOpError, anything else an Error.
std::exception_ptr describe_failure(const std::string& where, std::exception_ptr error);

// Runs `body`, turning an exception into the board's failure with `where` prepended (a device out
// of memory becomes DeviceMemoryError, a non-deterministic op NondeterministicOpError); Aborted
// and Stopped end it quietly.
template <typename F>
void guarded(Board& board, const std::string& where, F&& body) {
  try {
    body();
  } catch (const Aborted&) {
  } catch (const Stopped&) {
  } catch (...) {
    board.fail(describe_failure(where, std::current_exception()));
  }
}

}  // namespace rondo::engine
