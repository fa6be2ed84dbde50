#include "engine/engine.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "engine/estimate.h"
#include "engine/events.h"
#include "engine/optimizer.h"
#include "engine/state.h"
#include "engine/torch_device.h"
#include "kernels/error.h"
#include "models/attention_masks.h"
#include "offload/process_heap.h"
#include "offload/transfer.h"

namespace rondo::engine {

// Note [Engine synchronisation]
// Three kinds of thread share the host state; every hand-over between them is a host-side flag
// under one mutex (Impl::mu_) plus a device event that orders the device work behind it.
//
// 1. Job to job (worker to worker). Job g's output for microbatch m is a Handoff published under
//    the mutex after the producer has enqueued the work and recorded an event behind it (on the
//    compute stream when the data stays on the device, on the download stream when it goes to
//    host staging memory). The consumer waits for the flag, then makes its stream wait for the
//    event before touching the data. The same for activation checkpoints, keyed by (step, layer,
//    microbatch). A Handoff is consumed exactly once; the consumer owns its buffers from then on.
// 2. Optimizer to loaders (weights). versions_[l] counts the optimizer passes over layer l in
//    this train() call; a loader uploads a job of step s only when every layer it streams
//    (tied owners included) has versions_ >= s. The optimizer bumps versions_[l] after writing
//    layer l's streaming copy. So an upload never reads a layer while the optimizer writes it:
//    the optimizer writes layer l for step s only after every job of step s has finished (their
//    gradients are all in), and every upload of step s happened before its job's compute; the
//    uploads of step s+1 wait for the bump.
// 3. Workers to the optimizer (gradients). A job downloads its layers' gradients into the store
//    and records done_down behind them; it then sets `enqueued`. The optimizer waits for the flag
//    of every backward-bearing job of step s and synchronises done_down; only then does it read
//    the gradients. The next writes to those gradient buffers are step s+1's downloads, which come
//    from jobs whose weights waited for the optimizer's bump of the same layers (2), i.e. after
//    the optimizer read them (or, on the CPU device in exact mode, step s+1's own accumulation
//    there: EngineOptions::share_trained_state). A download (or a job's accumulation) writes the
//    whole of a layer's gradient region, so the optimizer does not clear it (zeroing them after
//    the update would be a second pass over every gradient byte, serial between two steps).
// 4. One-step-stale mode. The optimizer's pass for step s first publishes, layer by layer in
//    forward order, the master (θ_s) to the streaming copy — for each layer only once every
//    upload of it in step s has completed (it waits for those jobs' weights_ready events) — and
//    bumps versions_; then, once step s's gradients are in, AdamW updates masters and moments
//    only. Step s+1 thus runs on θ_s while θ_{s+1} is computed. Gradients: a worker enqueues the
//    download of layer l's gradients of step s only when grads_consumed_[l] >= s, i.e. after the
//    optimizer has read step s-1's (in exact mode this already holds by (2)).
// 5. Stopping (request_stop). Steps are handed to the threads (steps_) two ahead of the newest
//    result. On a stop, the main thread hands out no more and sets stop_steps_ to the number
//    handed out; every wait for work of a later step (wait_step) then gives up with Stopped and
//    its thread returns, while every step already handed out runs to its update, so the store is
//    left exactly as after its last step. Uploads already made for a later step are freed with the
//    segment's leftovers, after the devices are synchronised. In one-step-stale mode the
//    optimizer publishes θ_s to the streaming copies only once step s is handed out, so a stop
//    leaves them at θ_{s-1}, what the next step (after a resume) must read.
// Device memory: a loader releases job k-2's buffers (after synchronising its events on the host)
// before it allocates job k's, so a device holds the running job and at most one prefetched one,
// and every byte the ledger counts as free is really idle. Ordering inside a device is stream
// order; across devices and streams only the events above order anything.

namespace {

// Note [One OpenMP pool while the devices compute]
// torch's CPU kernels run their parallel loops on OpenMP (GNU libgomp in the torch wheel), which
// keeps a pool of worker threads per thread that started a parallel region: the main thread's
// (made while it loaded the model) and each device's compute thread's. libgomp counts every
// pooled thread, and when it counts more than the machine has CPUs it stops spinning between
// regions (100 spins instead of ~3 ms) and puts its threads to sleep on a futex after each one:
// on this project's 2-core machine the CPU device's two compute threads then slept and were woken
// about 2000 times a second each, and 20% of the cores sat idle during a training step (the same
// block, measured on the main thread alone, kept both busy). So:
// - While the engine runs, the calling thread only waits: its pool is released first (OpenMP 5's
//   omp_pause_resource_all: the pool's threads exit), and its own parallel regions run on it
//   alone until the engine returns (it still prepares each step's inputs, whose rotary tables
//   alone would make a new pool).
// - Simulated GPUs compute on the same cores, each on a thread of its own: each releases its pool
//   after every job, so that only devices computing at the same moment hold one.
// The calls are looked up at run time: an OpenMP runtime without them (or none) is left as it is.
struct OpenMpApi {
  int (*pause)(int) = reinterpret_cast<int (*)(int)>(::dlsym(RTLD_DEFAULT,
                                                             "omp_pause_resource_all"));
  int (*get_max_threads)() = reinterpret_cast<int (*)()>(::dlsym(RTLD_DEFAULT,
                                                                 "omp_get_max_threads"));
  void (*set_num_threads)(int) = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT,
                                                                         "omp_set_num_threads"));
};

const OpenMpApi& openmp() {
  static const OpenMpApi api;
  return api;
}

// Releases the calling thread's OpenMP pool, if it has one (outside any parallel region).
void release_openmp_pool() {
  if (openmp().pause) openmp().pause(/*omp_pause_soft: the threads go, the runtime stays*/ 1);
}

// The calling thread's OpenMP pool released, and its parallel regions on it alone, for the scope.
class QuietCallerOpenMp {
 public:
  QuietCallerOpenMp() {
    release_openmp_pool();
    if (openmp().get_max_threads && openmp().set_num_threads) {
      saved_ = openmp().get_max_threads();
      openmp().set_num_threads(1);
    }
  }
  ~QuietCallerOpenMp() {
    if (saved_ > 0) openmp().set_num_threads(saved_);
  }
  QuietCallerOpenMp(const QuietCallerOpenMp&) = delete;
  QuietCallerOpenMp& operator=(const QuietCallerOpenMp&) = delete;

 private:
  int saved_ = 0;
};

struct Aborted {};  // thrown inside waits once another thread has failed
struct Stopped {};  // thrown inside waits for a step that will not run (request_stop)

// kEval: evaluation's last job, forward through the tail's layers to the loss sum (no backward).
enum class JobKind { kForward, kTail, kBackward, kEval };

struct JobSpec {
  JobKind kind = JobKind::kForward;
  LayerRange range;
  std::string name;           // "F0", "T", "B1"
  std::vector<int> streamed;  // layers whose streaming copies the job needs (tied owners too)
  bool has_output = false;    // hands a tensor to the next job of the step
};

std::size_t elem_size(at::ScalarType t) {
  return c10::elementSize(t);
}

std::size_t nbytes(const std::vector<std::int64_t>& sizes, at::ScalarType t) {
  std::size_t n = elem_size(t);
  for (std::int64_t s : sizes)
    n *= static_cast<std::size_t>(s);
  return n;
}

at::Tensor view(void* data, const std::vector<std::int64_t>& sizes, at::ScalarType t,
                c10::Device device) {
  return at::from_blob(data, sizes, at::TensorOptions().dtype(t).device(device));
}

// A tensor handed from one job to the next (or a checkpoint from a forward job to a backward one).
struct Handoff {
  bool ready = false;
  kernels::Device* device = nullptr;      // where the data is; nullptr = host staging memory
  std::unique_ptr<kernels::Event> event;  // kept on the device: compute done
  kernels::DeviceBuffer dev;
  offload::Staged host;      // went through the host
  offload::Spilled spilled;  // a checkpoint on the NVMe tier (read back into `host` when received)
  std::vector<std::int64_t> sizes;
};

// One microbatch's inputs where a job runs: views into DeviceInputs::buffer. Its masks are built
// from `docs` on the device by each job's compute, for the microbatch it runs.
struct MicrobatchInputs {
  models::AttentionContext ctx;  // positions, cos, sin (no masks)
  at::Tensor tokens, targets;
  at::Tensor docs;         // packed rows' document ids (models::packed_doc_ids); undefined: none
  at::Tensor doc_offsets;  // their models::DocSpans::offsets_tensor(); undefined: none
};

// A step's inputs on one device: every microbatch's, uploaded in one copy by the first job of the
// step that runs there, read by the step's later jobs on the device (same compute stream).
struct DeviceInputs {
  kernels::DeviceBuffer buffer;
  std::vector<MicrobatchInputs> mb;
};

// Where one input tensor sits in StepData::packed (undefined tensors have no bytes).
struct PackedTensor {
  bool defined = false;
  std::size_t offset = 0;
  std::vector<std::int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};
// The tensors packed per microbatch, in this order. The masks are not among them: a (B, 1, T, T)
// mask per microbatch would cross the link (T bytes per token); the jobs build them.
enum InputSlot { kPositions, kCos, kSin, kDocs, kDocOffsets, kTokens, kTargets, kInputSlots };

struct StepData {
  std::vector<Microbatch> mb;
  std::int64_t tokens = 0, targets = 0;
  std::int64_t step_no = 0;  // 1-based, across train() calls
  // Every microbatch's inputs (tokens, targets, attention context), packed by the main thread
  // into one host staging buffer (page-locked where the arena pins, so the copies do not block)
  // and uploaded once per device that runs a job of the step; layout[m][slot] places them.
  std::shared_ptr<offload::HostBuffer> packed;
  std::vector<std::array<PackedTensor, kInputSlots>> layout;
  std::vector<models::DocSpans> spans;  // per microbatch: its packed rows' documents
  // The step's jobs' microbatches whose attention ran per document, or under masks (StepResult).
  mutable std::atomic<std::int64_t> per_document_passes{0}, masked_passes{0};
  std::mutex inputs_mu;
  std::map<int, std::shared_ptr<DeviceInputs>> on_device;  // by device, under inputs_mu
  // The tail's loss sum (one float), downloaded into staging memory: a pageable destination would
  // block the worker until the tail's compute has finished.
  std::shared_ptr<offload::HostBuffer> loss;
  double loss_scale = 1;  // fp16 scale this step's backward uses
  // MoE: each microbatch's routing, recorded by its forward and read by its backward.
  std::vector<std::shared_ptr<models::RoutingRecord>> routing;
};

struct DeviceCtx {
  kernels::Device* dev = nullptr;
  int index = 0;
  kernels::Stream* compute = nullptr;  // the copy streams are offload::Transfers'
  c10::Device torch = c10::Device(c10::DeviceType::CPU);
  std::mutex busy_mutex;
  double busy_s = 0, busy_reported_s = 0;  // device time in compute (timing events)
  double speed = 1;
  // A timing event recorded on the compute stream at the start of the segment, when the event
  // sink's clock read clock_t: device times become span times on the sink's clock.
  std::unique_ptr<kernels::Event> clock;
  double clock_t = 0;
};

struct JobRun {
  // Loader -> worker.
  bool loaded = false;
  std::unique_ptr<offload::DeviceWeights> weights;
  std::shared_ptr<kernels::Event> weights_ready;  // outlives `weights` (one-step-stale waits)
  // Worker -> optimizer, loader.
  bool enqueued = false;
  // The JobRun is dropped once both are true: the loader has freed its buffers, and the optimizer
  // has read its gradients (set at once for a forward job, which has none).
  bool released = false, consumed = false;
  std::unique_ptr<kernels::Event> done_compute, done_up, done_down;
  std::vector<kernels::DeviceBuffer> buffers;
  std::vector<offload::HostBuffer> staging;
  std::vector<std::shared_ptr<const void>> keep;  // host memory the job's copies read
  // Timing events around each microbatch's compute on the compute stream: the job's device time
  // (spans, busy shares, the re-planner's measurements), read once they have completed
  // (account()). Host clocks would time the launches on a GPU, not the work.
  std::vector<std::pair<std::unique_ptr<kernels::Event>, std::unique_ptr<kernels::Event>>> timing;
  std::int64_t tokens = 0;
  bool accounted = false;
};

}  // namespace

struct Engine::Impl {
  models::ModelConfig config;
  std::vector<models::LayerSpec> specs;
  offload::LayerStore& store;
  offload::HostArena& arena;
  Plan plan;
  EngineOptions options;
  std::vector<std::unique_ptr<DeviceCtx>> devs;
  std::vector<JobSpec> jobs;
  std::set<int> ckpt_layers;  // blocks whose inputs the forward saves for the backward
  Optimizer optimizer;
  std::unique_ptr<offload::Transfers> transfers;
  at::ScalarType act_dtype;
  double scale = 1;  // fp16 loss scale
  int good_steps = 0;
  std::int64_t steps_done = 0;
  bool plan_emitted = false;
  // Inside evaluate(): `jobs` are the evaluation's, no optimizer runs, nothing is timed.
  bool evaluating_ = false;

  // Per train() call, under mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  bool failed_ = false;
  std::exception_ptr error_;
  std::int64_t total_jobs_ = 0;
  // Steps of the segment that run: all, until a stop is requested; then those already handed to
  // the threads (Note [Engine synchronisation], 5).
  std::int64_t stop_steps_ = std::numeric_limits<std::int64_t>::max();
  std::atomic<bool> stop_requested_{false};
  std::int64_t handed_out_ = 0;      // steps of the segment in steps_ so far (erased ones included)
  std::int64_t scales_decided_ = 0;  // steps whose optimizer has set the next step's loss scale
  std::vector<std::int64_t> versions_;
  std::vector<std::int64_t> grads_consumed_;  // per layer: optimizer passes that read its gradients
  // One-step-stale mode: the jobs of each step with their uploads, for the optimizer to wait on.
  std::map<std::int64_t, std::vector<std::pair<int, std::shared_ptr<JobRun>>>> loads_;
  std::map<std::int64_t, std::shared_ptr<StepData>> steps_;
  std::map<std::int64_t, std::shared_ptr<JobRun>> runs_;
  std::map<std::tuple<std::int64_t, int, int>, std::shared_ptr<Handoff>> outputs_, ckpts_;
  // Measured job times since the last re-plan (under mu_).
  struct Measurement {
    int job = 0, device = 0;
    double seconds = 0;
    std::int64_t tokens = 0;
  };
  std::vector<Measurement> measured_;
  PlanInputs costs_;  // the costs the current plan was made from (options.plan_inputs, updated)
  std::vector<StepResult> results_;
  std::set<std::int64_t> evaluated_;  // evaluate(): batches whose last job has been enqueued
  std::chrono::steady_clock::time_point last_step_end_;
  double last_device_event_t_ = 0;  // optimizer thread only

  Impl(const models::ModelConfig& c, const std::vector<models::LayerSpec>& s,
       offload::LayerStore& st, offload::HostArena& a, Plan p, EngineOptions o)
      : config(c),
        specs(s),
        store(st),
        arena(a),
        plan(std::move(p)),
        options(std::move(o)),
        optimizer(st, options.adamw, options.max_grad_norm),
        act_dtype(scalar_type(st.stream_dtype())),
        scale(options.loss_scaling.enabled ? options.loss_scaling.initial_scale : 1.0) {
    // Every step overwrites the gradients (Note [Engine synchronisation], 3).
    optimizer.set_zero_grads(false);
  }

  // The CPU device works on the store's trained weights and gradients in place (exact mode).
  bool shares_trained() const { return options.share_trained_state && !options.one_step_stale; }
  // Whether every trained tensor of layer l gets its gradient written (not added) by a job's first
  // microbatch, so that its accumulators need no zeroing first: blocks (BlockRun::overwrite) and a
  // head of a norm and an LM head; not the embedding, whose rows are added (index_add_).
  bool overwrites_grads(int l) const {
    const models::LayerKind kind = specs[static_cast<std::size_t>(l)].kind;
    return kind == models::LayerKind::kBlock ||
           (kind == models::LayerKind::kHead &&
            specs[static_cast<std::size_t>(l)].params.size() <= 2);
  }

  // ---- failure and waiting ----

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      error_ = e;
    }
    cv_.notify_all();
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred pred) {
    cv_.wait(lock, [&] { return failed_ || pred(); });
    if (failed_) throw Aborted{};
  }
  // The same for work of step s (0-based in the segment): throws Stopped when the run is stopping
  // before step s (request_stop) and what it waits for has not happened.
  template <typename Pred>
  void wait_step(std::unique_lock<std::mutex>& lock, std::int64_t s, Pred pred) {
    cv_.wait(lock, [&] { return failed_ || s >= stop_steps_ || pred(); });
    if (failed_) throw Aborted{};
    if (s >= stop_steps_ && !pred()) throw Stopped{};
  }
  bool stopped(std::int64_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    return s >= stop_steps_;
  }
  // Runs `body`, turning an exception into the engine's failure, with `where` prepended.
  template <typename F>
  void guarded(const std::string& where, F&& body) {
    try {
      body();
    } catch (const Aborted&) {
    } catch (const Stopped&) {
    } catch (const kernels::OutOfMemory& e) {
      // The device's message already names the settings that lower memory; add the one that is
      // the engine's own.
      fail(std::make_exception_ptr(
          Error(where + ": " + e.what() + "; layer-grain recompute also lowers it")));
    } catch (const c10::OutOfMemoryError& e) {
      // Torch's own allocations (activations, attention and head temporaries) under the cap
      // (engine::torch_cuda_allocator): it had already released its cache and retried.
      fail(std::make_exception_ptr(
          Error(where + ": out of GPU memory in torch's allocations under the memory cap (" +
                first_line(e.what()) +
                "); use fewer rows per microbatch (training.batch_rows) and more microbatches "
                "(training.grad_accum), shorter sequences (data.seq_len) or a larger "
                "hardware.memory_cap")));
    } catch (const std::exception& e) {
      std::string what = e.what();
      if (what.find("does not have a deterministic implementation") != std::string::npos)
        what = first_line(what) +
               " (exact runs use deterministic kernels only; training.deterministic = false runs "
               "this op, and the run is then not bit-exact on GPUs)";
      fail(std::make_exception_ptr(Error(where + ": " + what)));
    }
  }
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

  std::string job_where(std::int64_t g) const {
    const JobSpec& js = jobs[g % jobs.size()];
    const DeviceCtx& d = *devs[g % devs.size()];
    const std::int64_t s = g / static_cast<std::int64_t>(jobs.size());
    return (evaluating_ ? "evaluation, batch " + std::to_string(s + 1)
                        : "step " + std::to_string(steps_done + s + 1)) +
           ", job " + js.name + " (layers " + std::to_string(js.range.begin) + "-" +
           std::to_string(js.range.end - 1) + ") on " + d.dev->info().name;
  }

  std::shared_ptr<JobRun> run_locked(std::int64_t g) {
    auto& r = runs_[g];
    if (!r) r = std::make_shared<JobRun>();
    return r;
  }
  static std::shared_ptr<Handoff> slot(
      std::map<std::tuple<std::int64_t, int, int>, std::shared_ptr<Handoff>>& map,
      std::tuple<std::int64_t, int, int> key) {
    auto& h = map[key];
    if (!h) h = std::make_shared<Handoff>();
    return h;
  }

  // ---- setup ----

  // The layers whose streaming copies a job over `r` needs: its own and their tied owners.
  std::vector<int> streamed(LayerRange r) const {
    std::set<int> layers;
    for (int l = r.begin; l < r.end; ++l) {
      layers.insert(l);
      for (const offload::TensorState& t : store.layer(l))
        if (t.tied) layers.insert(t.owner_layer);
    }
    return {layers.begin(), layers.end()};
  }

  // Training's jobs (forward stages, fused tail, backward stages) or, for evaluate(), the forward
  // stages and an evaluation job over the tail's layers.
  void build_jobs(bool evaluation = false) {
    const int F = static_cast<int>(plan.forward.size());
    auto add = [&](JobKind kind, LayerRange r, std::string name) {
      jobs.push_back({.kind = kind, .range = r, .name = std::move(name), .streamed = streamed(r)});
    };
    for (int i = 0; i < F; ++i)
      add(JobKind::kForward, plan.forward[i], "F" + std::to_string(i));
    if (evaluation) {
      add(JobKind::kEval, plan.tail, "E");
      for (JobSpec& js : jobs)
        js.has_output = js.kind == JobKind::kForward;
      return;  // no checkpoints: nothing runs backward
    }
    add(JobKind::kTail, plan.tail, "T");
    for (std::size_t i = 0; i < plan.backward.size(); ++i)
      add(JobKind::kBackward, plan.backward[i], "B" + std::to_string(i + 1));
    // Forward stages feed the next stage (or the tail); the tail and backward stages feed the
    // next backward stage unless they reach the prefix.
    for (JobSpec& js : jobs)
      js.has_output = js.kind == JobKind::kForward || js.range.begin > 0;
    ckpt_layers = plan.checkpointed_layers();
  }

  // ---- loader ----

  void release(std::int64_t g) {
    std::shared_ptr<JobRun> r;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A job of a step that will not run (stopping) is freed at the end of the segment.
      wait_step(lock, g / static_cast<std::int64_t>(jobs.size()),
                [&] { return runs_.count(g) && runs_[g]->enqueued; });
      r = runs_[g];
    }
    // (A device fault surfaces here, in the job it hit: a failed copy's stream reports it
    // through the events recorded after it.)
    for (auto* e :
         {r->weights_ready.get(), r->done_compute.get(), r->done_up.get(), r->done_down.get()})
      if (e) e->synchronize();
    account(g, *r);
    r->weights.reset();
    r->buffers.clear();
    r->keep.clear();
    for (auto& h : r->staging)
      transfers->recycle(std::move(h));
    r->staging.clear();
    std::lock_guard<std::mutex> lock(mu_);
    r->released = true;
    if (r->consumed) runs_.erase(g);
  }

  // Job g's device time, once its work has completed: the device's busy time, the re-planner's
  // measurement, and its span on the event sink's clock.
  void account(std::int64_t g, JobRun& r) {
    if (r.accounted || r.timing.empty() || evaluating_) return;
    r.accounted = true;
    const std::int64_t N = static_cast<std::int64_t>(devs.size()),
                       J = static_cast<std::int64_t>(jobs.size());
    const int d = static_cast<int>(g % N);
    DeviceCtx& dc = *devs[d];
    double busy = 0;
    for (auto& [start, end] : r.timing)
      busy += end->seconds_since(*start);
    {
      std::lock_guard<std::mutex> lk(dc.busy_mutex);
      dc.busy_s += busy;
    }
    const JobSpec& js = jobs[g % J];
    if (options.replan_every > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      measured_.push_back({static_cast<int>(g % J), d, busy, r.tokens});
    }
    if (EventSink* sink = options.events)
      sink->emit(SpanEvent{.device = d,
                           .step = steps_done + g / J + 1,
                           .stage = js.name,
                           .first_layer = js.range.begin,
                           .end_layer = js.range.end,
                           .start = dc.clock_t + r.timing.front().first->seconds_since(*dc.clock),
                           .end = dc.clock_t + r.timing.back().second->seconds_since(*dc.clock)});
  }

  void loader(int d) {
    const std::int64_t N = static_cast<std::int64_t>(devs.size()),
                       J = static_cast<std::int64_t>(jobs.size());
    for (std::int64_t g = d; g < total_jobs_; g += N) {
      guarded(job_where(g), [&] {
        const JobSpec& js = jobs[g % J];
        // NVMe reads of the frozen weights can start before device memory frees up (the trained
        // ones only once the optimizer has written them, below).
        transfers->prefetch_weights(js.streamed, /*frozen_only=*/true);
        if (g - 2 * N >= 0) release(g - 2 * N);  // at most one stage prefetched behind the running
        const std::int64_t s = g / J;
        std::shared_ptr<JobRun> r;
        {
          std::unique_lock<std::mutex> lock(mu_);
          wait_step(lock, s, [&] {
            for (int l : js.streamed)
              if (versions_[l] < s) return false;
            return true;
          });
          r = run_locked(g);
        }
        r->weights = transfers->load_weights(d, js.streamed);
        r->weights_ready = r->weights->ready();
        // The previous job's host staging (NVMe reads) is not needed once its weights landed.
        if (g - N >= 0) {
          std::shared_ptr<JobRun> prev;
          {
            std::lock_guard<std::mutex> lock(mu_);
            if (auto it = runs_.find(g - N); it != runs_.end()) prev = it->second;
          }
          if (prev && prev->weights) prev->weights->release_staging();
        }
        // The first microbatch's checkpoints, if on the NVMe tier, start their way back (before
        // `loaded`: the job does not receive them yet).
        prefetch_checkpoints(js, s, 0);
        std::lock_guard<std::mutex> lock(mu_);
        r->loaded = true;
        if (options.one_step_stale && !evaluating_)
          loads_[s].push_back({static_cast<int>(g % J), r});
        cv_.notify_all();
      });
      if (failed() || stopped(g / J)) return;
    }
  }

  // ---- worker ----

  // Layer l's weights among uploaded ones as device tensors, in spec order.
  std::vector<at::Tensor> layer_weights(const offload::DeviceWeights& weights, int l,
                                        c10::Device dev) const {
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < store.layer(l).size(); ++i)
      out.push_back(view(weights.tensor(l, i), specs[l].params[i].shape, act_dtype, dev));
    return out;
  }

  // An input handed over by another job: a device tensor on `dc`, ready in compute-stream order.
  using Slots = std::map<std::tuple<std::int64_t, int, int>, std::shared_ptr<Handoff>>;
  at::Tensor receive(DeviceCtx& dc, JobRun& r, Slots& slots, std::tuple<std::int64_t, int, int> key,
                     std::unique_lock<std::mutex>& lock) {
    std::shared_ptr<Handoff> h = slot(slots, key);
    wait(lock, [&] { return h->ready; });
    slots.erase(key);  // consumed once: this job owns its buffers from here
    lock.unlock();
    // (unspill() empties h->spilled.)
    const bool unspilled = static_cast<bool>(h->spilled);
    if (unspilled) h->host = transfers->unspill(h->spilled);
    at::Tensor t;
    if (h->device == dc.dev) {
      dc.compute->wait(*h->event);
      t = view(h->dev.data(), h->sizes, act_dtype, dc.torch);
      r.buffers.push_back(std::move(h->dev));
    } else {
      offload::Uploaded up = transfers->upload(dc.index, h->host, nbytes(h->sizes, act_dtype));
      dc.compute->wait(*up.ready);
      t = view(up.buffer.data(), h->sizes, act_dtype, dc.torch);
      r.buffers.push_back(std::move(up.buffer));
      if (unspilled) {
        // A checkpoint read back from the NVMe tier: its staging goes back to the pool once the
        // upload has landed (the read is done, so that is the copy's time only), not when the job
        // is released two jobs later, which would keep every microbatch's in host memory.
        up.ready->synchronize();
        transfers->recycle_unspilled(std::move(h->host.host));
      } else {
        r.staging.push_back(std::move(h->host.host));
      }
    }
    lock.lock();
    return t;
  }

  // Starts reading back the checkpoints of microbatch m that backward job `js` of step s receives,
  // where they are on the NVMe tier already; only the job's own worker (or its loader before the
  // job starts) calls it, so no receive() of them runs meanwhile.
  void prefetch_checkpoints(const JobSpec& js, std::int64_t s, int m) {
    if (!transfers->spills() || js.kind != JobKind::kBackward) return;
    std::vector<std::shared_ptr<Handoff>> spilled;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int l : ckpt_layers)
        if (l >= js.range.begin && l < js.range.end)
          if (auto it = ckpts_.find({s, l, m}); it != ckpts_.end() && it->second->ready)
            spilled.push_back(it->second);
    }
    for (auto& h : spilled)
      if (h->spilled) transfers->prefetch(h->spilled);
  }

  // Publishes `dev_buf` (written by compute work enqueued before this call) to the consumer:
  // kept on the device when the consumer runs there, else downloaded to host staging memory.
  void send(DeviceCtx& dc, JobRun& r, Slots& slots, std::tuple<std::int64_t, int, int> key,
            kernels::DeviceBuffer dev_buf, std::vector<std::int64_t> sizes, bool keep) {
    std::shared_ptr<Handoff> h;
    {
      std::lock_guard<std::mutex> lock(mu_);
      h = slot(slots, key);
    }
    auto ev = dc.dev->create_event();
    dc.compute->record(*ev);
    if (keep) {
      h->device = dc.dev;
      h->event = std::move(ev);
      h->dev = std::move(dev_buf);
    } else {
      h->device = nullptr;
      const std::size_t bytes = nbytes(sizes, act_dtype);
      offload::Staged staged = transfers->download(dc.index, dev_buf.data(), bytes, *ev);
      if (&slots == &ckpts_ && transfers->spills())
        h->spilled = transfers->spill(std::move(staged), bytes);
      else
        h->host = std::move(staged);
      r.buffers.push_back(std::move(dev_buf));
    }
    h->sizes = std::move(sizes);
    std::lock_guard<std::mutex> lock(mu_);
    h->ready = true;
    cv_.notify_all();
  }

  // EngineOptions::emulate_costs: how long `tokens` through `range` last at least on device d,
  // forward only or with the backward.
  double emulated_seconds(LayerRange range, bool forward_only, std::int64_t tokens, int d) const {
    if (options.emulate_costs.empty()) return 0;
    double s = 0;
    for (int l = range.begin; l < range.end; ++l) {
      const LayerCosts& c = options.emulate_costs.at(l);
      s += forward_only ? c.forward_s_per_token : c.forward_s_per_token + c.backward_s_per_token;
    }
    return s * static_cast<double>(tokens) / devs[d]->speed;
  }
  double job_emulated_seconds(const JobSpec& js, std::int64_t tokens, int d) const {
    return emulated_seconds(js.range, js.kind == JobKind::kForward || js.kind == JobKind::kEval,
                            tokens, d);
  }

  void worker(int d) {
    const std::int64_t N = static_cast<std::int64_t>(devs.size());
    const std::int64_t J = static_cast<std::int64_t>(jobs.size());
    for (std::int64_t g = d; g < total_jobs_; g += N) {
      guarded(job_where(g), [&] { run_job(d, g); });
      if (failed() || stopped(g / J)) return;
    }
  }

  void run_job(int d, std::int64_t g) {
    const std::int64_t J = static_cast<std::int64_t>(jobs.size()),
                       N = static_cast<std::int64_t>(devs.size());
    const std::int64_t s = g / J;
    const int j = static_cast<int>(g % J);
    const JobSpec& js = jobs[j];
    DeviceCtx& dc = *devs[d];
    std::unique_lock<std::mutex> lock(mu_);
    wait_step(lock, s, [&] { return steps_.count(s) && runs_.count(g) && runs_[g]->loaded; });
    std::shared_ptr<StepData> step = steps_[s];
    const int M = static_cast<int>(step->mb.size());  // the plan's; an evaluation's last: fewer
    std::shared_ptr<JobRun> r = runs_[g];
    lock.unlock();
    r->tokens = step->tokens;
    const std::shared_ptr<DeviceInputs> inputs = inputs_on(dc, *step, *r);
    dc.compute->wait(*r->weights_ready);

    // Weights and (for jobs with a backward) gradient accumulators.
    std::map<int, std::vector<at::Tensor>> w;
    for (int l = js.range.begin; l < js.range.end; ++l)
      w[l] = layer_weights(*r->weights, l, dc.torch);
    const bool backward = js.kind == JobKind::kTail || js.kind == JobKind::kBackward;
    const bool convert = store.grad_dtype() != kernels::FloatDType::kF32;
    std::map<int, std::vector<at::Tensor>> acc, out_grad;  // f32 accumulators, store-dtype views
    std::vector<std::pair<int, void*>>
        grad_buffers;  // layer, device gradient in the store's layout
    if (backward) {
      for (int l = js.range.begin; l < js.range.end; ++l) {
        const offload::ByteRange gr = store.grad_bytes(l);
        if (gr.bytes == 0) continue;
        const std::size_t gs = kernels::dtype_size(store.grad_dtype());
        // In place (EngineOptions::share_trained_state): the store's gradients are free to be
        // written, since this job's weights waited for the optimizer's pass over these layers
        // (Note [Engine synchronisation], 3), and are written before it reads them (done_down).
        std::uint8_t* gdata = gr.data;
        if (!shares_trained()) {
          r->buffers.push_back(dc.dev->allocate(gr.bytes, dc.compute));
          gdata = static_cast<std::uint8_t*>(r->buffers.back().data());
        }
        std::uint8_t* accp = gdata;
        if (convert) {
          r->buffers.push_back(dc.dev->allocate(gr.bytes / gs * 4, dc.compute));
          accp = static_cast<std::uint8_t*>(r->buffers.back().data());
        }
        // Blocks and the head write each gradient on the first microbatch and add on the next
        // (BlockRun::overwrite, head_grad); the embedding's rows are added into zeros.
        if (!overwrites_grads(l)) dc.compute->fill(accp, 0, convert ? gr.bytes / gs * 4 : gr.bytes);
        for (std::size_t i = 0; i < store.layer(l).size(); ++i) {
          const offload::TensorState& t = store.layer(l)[i];
          if (!t.trainable) {
            acc[l].emplace_back();
            out_grad[l].emplace_back();
            continue;
          }
          const std::size_t off = static_cast<const std::uint8_t*>(t.grad) - gr.data;
          const auto& shape = specs[l].params[i].shape;
          acc[l].push_back(view(accp + off / gs * (convert ? 4 : gs), shape, at::kFloat, dc.torch));
          out_grad[l].push_back(
              view(gdata + off, shape, scalar_type(store.grad_dtype()), dc.torch));
        }
        grad_buffers.push_back({l, gdata});
      }
    }
    // The tail's loss, summed over the microbatches on the device.
    float* loss_dev = nullptr;
    if (js.kind == JobKind::kTail || js.kind == JobKind::kEval) {
      r->buffers.push_back(dc.dev->allocate(sizeof(float), dc.compute));
      loss_dev = static_cast<float*>(r->buffers.back().data());
      dc.compute->fill(loss_dev, 0, sizeof(float));
    }

    const bool keep_output = (g + 1) % N == d && js.has_output;
    const int C = static_cast<int>(config.hidden_size);
    double loss_scale = 1;

    for (int m = 0; m < M; ++m) {
      const Microbatch& mb = step->mb[m];
      const std::vector<std::int64_t> act = {mb.batch.tokens.size(0), mb.batch.tokens.size(1), C};
      // Inputs.
      at::Tensor in;
      std::map<int, at::Tensor> saved;  // backward: checkpointed block inputs
      prefetch_checkpoints(js, s, m + 1);
      lock.lock();
      const bool from_tokens = js.kind != JobKind::kBackward && js.range.begin == 0;
      if (!from_tokens) in = receive(dc, *r, outputs_, {g - 1, m, 0}, lock);
      if (js.kind == JobKind::kBackward)
        for (int l : ckpt_layers)
          if (l >= js.range.begin && l < js.range.end)
            saved[l] = receive(dc, *r, ckpts_, {s, l, m}, lock);
      // The fp16 loss scale of this step: the one the previous step's optimizer left. In exact
      // mode it is decided before this job's weights can be ready; in one-step-stale mode the
      // weights come earlier, so the tail waits for the decision (only the norm, not the update).
      if (m == 0) {
        if (js.kind == JobKind::kTail) {
          wait_step(lock, s, [&] { return scales_decided_ >= s; });
          step->loss_scale = scale;
        }
        loss_scale =
            step->loss_scale / static_cast<double>(std::max<std::int64_t>(step->targets, 1));
      }
      lock.unlock();
      // Outputs.
      kernels::DeviceBuffer out_buf;
      at::Tensor out;
      if (js.has_output) {
        out_buf = dc.dev->allocate(nbytes(act, act_dtype), dc.compute);
        out = view(out_buf.data(), act, act_dtype, dc.torch);
      }
      std::map<int, std::pair<kernels::DeviceBuffer, at::Tensor>> ckpt_out;
      if (js.kind == JobKind::kForward)
        for (int l : ckpt_layers)
          if (l >= std::max(js.range.begin, 1) && l < js.range.end) {
            kernels::DeviceBuffer b = dc.dev->allocate(nbytes(act, act_dtype), dc.compute);
            at::Tensor t = view(b.data(), act, act_dtype, dc.torch);
            ckpt_out.emplace(l, std::make_pair(std::move(b), t));
          }

      const double emulate = job_emulated_seconds(js, mb.batch.tokens.numel(), d);
      std::map<int, at::Tensor> ckpt_views;
      for (auto& [l, bt] : ckpt_out)
        ckpt_views[l] = bt.second;
      const bool last = m == M - 1;
      auto work = [this, &dc, step, inputs, m, last, in, out, saved, ckpt_views, w, acc, out_grad,
                   loss_dev, loss_scale, emulate, g, &js, convert] {
        if (failed()) return;
        guarded(job_where(g), [&] {
          const auto t0 = std::chrono::steady_clock::now();
          TorchStreamScope scope(*dc.compute);
          compute(js, dc, *step, inputs->mb[m], m, in, out, saved, ckpt_views, w, acc, loss_dev,
                  loss_scale);
          if (last && convert)  // f32 accumulators to the gradient dtype, for the download
            for (auto& [l, views] : out_grad)
              for (std::size_t i = 0; i < views.size(); ++i)
                if (views[i].defined()) views[i].copy_(acc.at(l)[i]);
          const double spent =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (emulate > spent)
            std::this_thread::sleep_for(std::chrono::duration<double>(emulate - spent));
        });
      };
      r->timing.emplace_back(dc.dev->create_event(kernels::EventTiming::kOn),
                             dc.dev->create_event(kernels::EventTiming::kOn));
      dc.compute->record(*r->timing.back().first);
      dc.compute->enqueue(std::move(work));
      dc.compute->record(*r->timing.back().second);
      // Hand on the output and the checkpoints.
      if (js.has_output) send(dc, *r, outputs_, {g, m, 0}, std::move(out_buf), act, keep_output);
      for (auto& [l, bt] : ckpt_out)
        send(dc, *r, ckpts_, {s, l, m}, std::move(bt.first), act, false);
    }

    // Several devices computing on this machine's cores: this one's OpenMP pool goes between its
    // jobs (Note [One OpenMP pool while the devices compute]).
    if (dc.torch.is_cpu() && devs.size() > 1) dc.compute->enqueue([] { release_openmp_pool(); });

    // Gradients (and the tail's loss) down to the store, once per job — once the optimizer has
    // read the previous step's (Note [Engine synchronisation], 4).
    if (backward) {
      lock.lock();
      wait(lock, [&] {
        for (auto& [l, data] : grad_buffers)
          if (grads_consumed_[l] < s) return false;
        return true;
      });
      lock.unlock();
      auto ev = dc.dev->create_event();
      dc.compute->record(*ev);
      for (auto& [l, data] : grad_buffers)
        transfers->download_gradients(d, l, data, *ev);
      if (loss_dev) transfers->download_value(d, step->loss->data(), loss_dev, sizeof(float), *ev);
    } else if (loss_dev) {  // evaluation
      auto ev = dc.dev->create_event();
      dc.compute->record(*ev);
      transfers->download_value(d, step->loss->data(), loss_dev, sizeof(float), *ev);
    }
    r->done_compute = dc.dev->create_event();
    r->done_up = dc.dev->create_event();
    r->done_down = dc.dev->create_event();
    dc.compute->record(*r->done_compute);
    transfers->activation_upload_stream(d).record(*r->done_up);
    transfers->download_stream(d).record(*r->done_down);
    lock.lock();
    r->enqueued = true;
    r->consumed = !backward;
    if (js.kind == JobKind::kEval) evaluated_.insert(s);
    cv_.notify_all();
  }

  // The step's inputs on dc: uploaded by the first job of the step there, in one copy on the
  // compute stream (ahead of that job's compute), from the packed host buffer, which `r` keeps
  // alive until the copy is done.
  std::shared_ptr<DeviceInputs> inputs_on(DeviceCtx& dc, StepData& step, JobRun& r) {
    std::lock_guard<std::mutex> lock(step.inputs_mu);
    std::shared_ptr<DeviceInputs>& have = step.on_device[dc.index];
    if (have) return have;
    auto in = std::make_shared<DeviceInputs>();
    in->buffer = dc.dev->allocate(step.packed->bytes(), dc.compute);
    dc.compute->upload(in->buffer.data(), step.packed->data(), step.packed->bytes());
    r.keep.push_back(step.packed);
    auto view_of = [&](const PackedTensor& p) {
      if (!p.defined) return at::Tensor();
      return view(static_cast<std::uint8_t*>(in->buffer.data()) + p.offset, p.sizes, p.dtype,
                  dc.torch);
    };
    for (const auto& slots : step.layout) {
      MicrobatchInputs& mbi = in->mb.emplace_back();
      mbi.ctx.positions = view_of(slots[kPositions]);
      mbi.ctx.cos = view_of(slots[kCos]);
      mbi.ctx.sin = view_of(slots[kSin]);
      mbi.docs = view_of(slots[kDocs]);
      mbi.doc_offsets = view_of(slots[kDocOffsets]);
      mbi.tokens = view_of(slots[kTokens]);
      mbi.targets = view_of(slots[kTargets]);
    }
    have = in;
    return in;
  }

  std::int64_t head_chunk_tokens(c10::Device dev, std::int64_t vocab) const {
    return engine::head_chunk_tokens(options.head_chunk_tokens, vocab, dev.is_cpu());
  }

  // One microbatch of one job, on the device (runs in compute-stream order).
  void compute(const JobSpec& js, DeviceCtx& dc, const StepData& step, const MicrobatchInputs& mbi,
               int m, const at::Tensor& in, const at::Tensor& out,
               const std::map<int, at::Tensor>& saved, const std::map<int, at::Tensor>& ckpt,
               const std::map<int, std::vector<at::Tensor>>& w,
               const std::map<int, std::vector<at::Tensor>>& acc, float* loss_dev,
               double loss_scale) {
    const c10::Device dev = dc.torch;
    models::AttentionContext ctx = mbi.ctx;
    // How this microbatch's attention is limited, set here from its documents
    // (models/attention_masks.h): per document, or masks of the running microbatch only.
    models::limit_attention(ctx, config, mbi.docs, step.spans[static_cast<std::size_t>(m)], dev,
                            act_dtype, mbi.doc_offsets);
    if (!ctx.doc_offsets.empty())
      ++step.per_document_passes;
    else if (ctx.mask.defined() || ctx.window_mask.defined())
      ++step.masked_passes;
    // Training: attention and LoRA dropout (when the model has them) draw from this seed;
    // evaluation has none.
    if (!evaluating_) ctx.dropout_seed = dropout_seed(options.seed, step.step_no, m);
    // MoE: the first forward of a block records its routing, the backward's recompute replays
    // it; the router load-balancing loss (when the model asks for it) counts each microbatch
    // with weight 1 / M.
    if (!step.routing.empty()) {
      ctx.routing = step.routing[static_cast<std::size_t>(m)];
      ctx.record_routing = js.kind != JobKind::kBackward;
      // loss_scale is the fp16 scale over the step's targets (step.loss_scale itself may be
      // written by the loader of a later job meanwhile); the aux loss has the fp16 scale alone.
      if (config.output_router_logits && js.kind != JobKind::kForward)
        ctx.aux_loss_weight = loss_scale *
                              static_cast<double>(std::max<std::int64_t>(step.targets, 1)) *
                              config.router_aux_loss_coef / static_cast<double>(step.mb.size());
    }
    const at::Tensor& tokens = mbi.tokens;
    const int head = static_cast<int>(specs.size()) - 1;
    auto grads_of = [&](int l) -> std::vector<at::Tensor>* {
      auto it = acc.find(l);
      return it == acc.end() ? nullptr : const_cast<std::vector<at::Tensor>*>(&it->second);
    };
    auto block_runs = [&](int begin, int end) {
      std::vector<models::BlockRun> runs;
      for (int l = std::max(begin, 1); l < std::min(end, head); ++l)
        runs.push_back(
            {.spec = &specs[l], .weights = w.at(l), .grads = grads_of(l), .overwrite = m == 0});
      return runs;
    };
    // The head's gradients: written by the first microbatch, added by the next.
    auto head_grad = [m](at::Tensor& into, const at::Tensor& g) {
      m == 0 ? into.copy_(g) : into.add_(g);
    };
    auto embed_grad = [&](const at::Tensor& grad_x) {
      std::vector<at::Tensor>* g = grads_of(0);
      if (g && (*g)[0].defined()) models::embed_backward(tokens, grad_x, (*g)[0]);
    };
    const LayerRange range = js.range;
    switch (js.kind) {
      case JobKind::kForward: {
        c10::AutoGradMode no_grad(false);
        at::Tensor x = range.begin == 0 ? models::embed(w.at(0)[0], tokens) : in;
        for (int l = std::max(range.begin, 1); l < range.end; ++l) {
          auto it = ckpt.find(l);
          if (it != ckpt.end()) it->second.copy_(x);
          x = models::block_forward(config, models::BlockWeights::bind(specs[l], w.at(l)), x, ctx);
        }
        out.copy_(x);
        break;
      }
      case JobKind::kTail: {
        at::Tensor x;
        {
          c10::AutoGradMode no_grad(false);
          x = range.begin == 0 ? models::embed(w.at(0)[0], tokens) : in;
        }
        const at::Tensor& targets = mbi.targets;
        const std::vector<at::Tensor>& hw = w.at(head);
        std::vector<at::Tensor>* hg = grads_of(head);
        const bool lm_trainable = hg && (*hg)[1].defined();
        const std::int64_t chunk_tokens = head_chunk_tokens(dev, hw[1].size(0));
        at::Tensor gx = models::blocks_forward_backward(
            config, block_runs(range.begin, range.end), x, ctx, [&](const at::Tensor& h) {
              models::HeadGrads r = models::head_forward_backward(
                  config, hw[0], hw[1], h, targets, loss_scale, lm_trainable, chunk_tokens);
              at::from_blob(loss_dev, {}, at::TensorOptions().dtype(at::kFloat).device(dev))
                  .add_(r.loss_sum);
              if (hg && (*hg)[0].defined()) head_grad((*hg)[0], r.grad_norm.to(at::kFloat));
              if (lm_trainable) head_grad((*hg)[1], r.grad_lm_head);
              return r.grad_x;
            });
        c10::AutoGradMode no_grad(false);
        if (range.begin == 0)
          embed_grad(gx);
        else
          out.copy_(gx);
        break;
      }
      case JobKind::kEval: {
        c10::AutoGradMode no_grad(false);
        at::Tensor x = range.begin == 0 ? models::embed(w.at(0)[0], tokens) : in;
        for (int l = std::max(range.begin, 1); l < head; ++l)
          x = models::block_forward(config, models::BlockWeights::bind(specs[l], w.at(l)), x, ctx);
        const std::vector<at::Tensor>& hw = w.at(head);
        at::from_blob(loss_dev, {}, at::TensorOptions().dtype(at::kFloat).device(dev))
            .add_(models::head_loss_sum(config, hw[0], hw[1], x, mbi.targets,
                                        head_chunk_tokens(dev, hw[1].size(0))));
        break;
      }
      case JobKind::kBackward: {
        std::vector<at::Tensor> inputs;
        for (auto& [l, t] : saved)
          inputs.push_back(t);  // ascending layers
        at::Tensor g = in;
        std::vector<models::BlockRun> runs = block_runs(range.begin, range.end);
        if (!runs.empty()) g = models::blocks_backward(config, runs, inputs, ctx, g);
        c10::AutoGradMode no_grad(false);
        if (range.begin == 0)
          embed_grad(g);
        else
          out.copy_(g);
        break;
      }
    }
  }

  // ---- optimizer ----

  void optimizer_thread(std::int64_t steps) {
    const std::int64_t J = static_cast<std::int64_t>(jobs.size());
    const int F = static_cast<int>(plan.forward.size());
    for (std::int64_t s = 0; s < steps; ++s) {
      guarded("step " + std::to_string(steps_done + s + 1) + ", optimizer", [&] {
        if (options.one_step_stale) publish_stale(s);
        std::shared_ptr<StepData> step;
        // The gradient norm's sums of squares, layer by layer as the gradients land: off the
        // critical path except for the last job's layers.
        std::vector<double> partial(store.layers(), 0.0);
        for (std::int64_t j = F; j < J; ++j) {
          std::shared_ptr<JobRun> r;
          {
            std::unique_lock<std::mutex> lock(mu_);
            wait_step(lock, s,
                      [&] { return runs_.count(s * J + j) && runs_[s * J + j]->enqueued; });
            r = runs_[s * J + j];
            step = steps_[s];
          }
          r->done_down->synchronize();
          if (failed()) throw Aborted{};
          for (int l = jobs[j].range.begin; l < jobs[j].range.end; ++l)
            partial[l] = optimizer.partial_sum_squares(l);
          std::lock_guard<std::mutex> lock(mu_);
          r->consumed = true;
          if (r->released) runs_.erase(s * J + j);
        }
        const std::int64_t step_no = steps_done + s + 1;
        if (options.on_gradients) options.on_gradients(step_no);
        StepResult res;
        res.step = step_no;
        res.tokens = step->tokens;
        res.targets = step->targets;
        res.attention_per_document = step->per_document_passes;
        res.attention_masked = step->masked_passes;
        res.loss = static_cast<double>(*step->loss->as<float>()) /
                   static_cast<double>(std::max<std::int64_t>(step->targets, 1));
        if (config.output_router_logits)
          for (const auto& routing : step->routing)
            res.loss += config.router_aux_loss_coef * models::router_aux_loss(config, *routing) /
                        static_cast<double>(step->routing.size());
        res.loss_scale = step->loss_scale;
        optimizer.set_grad_unscale(1.0 / step->loss_scale);
        const double norm = optimizer.begin_step(&partial);
        res.grad_norm = norm;
        const LossScaling& ls = options.loss_scaling;
        const bool finite = std::isfinite(norm);
        if (!finite && !ls.enabled)
          throw Error("the gradient norm is " + std::to_string(norm) + " (loss " +
                      std::to_string(res.loss) +
                      "): training diverged; lower the learning rate or enable clipping");
        {
          // The next step's scale is decided before any of its jobs can start (they wait for
          // the version bumps below).
          std::lock_guard<std::mutex> lock(mu_);
          if (ls.enabled && !finite) {
            scale = std::max(scale / 2, ls.min_scale);
            good_steps = 0;
          } else if (ls.enabled && ++good_steps >= ls.growth_interval) {
            scale *= 2;
            good_steps = 0;
          }
          scales_decided_ = s + 1;
          cv_.notify_all();
        }
        if (!finite) {
          optimizer.discard_step();
          res.skipped = true;
          std::lock_guard<std::mutex> lock(mu_);
          for (std::size_t l = 0; l < store.layers(); ++l) {
            versions_[l] = s + 1;
            grads_consumed_[l] = s + 1;
          }
          cv_.notify_all();
        } else {
          if (options.lr) optimizer.set_lr(options.lr(step_no));
          for (std::size_t l = 0; l < store.layers(); ++l) {
            optimizer.update_layer(l, /*write_stream=*/!options.one_step_stale);
            std::lock_guard<std::mutex> lock(mu_);
            versions_[l] = s + 1;
            grads_consumed_[l] = s + 1;
            cv_.notify_all();
          }
        }
        emit_device_events();
        std::lock_guard<std::mutex> lock(mu_);
        const auto now = std::chrono::steady_clock::now();
        res.seconds = std::chrono::duration<double>(now - last_step_end_).count();
        last_step_end_ = now;
        results_.push_back(res);
        steps_.erase(s);
        cv_.notify_all();
      });
      if (failed() || stopped(s)) return;
    }
  }

  // One-step-stale mode, first half of the optimizer's pass for step s: each layer's master (θ_s)
  // goes to its streaming copy as soon as step s has finished uploading that layer.
  void publish_stale(std::int64_t s) {
    {
      // Only for a step that will run: loaders may upload a step before it is handed out, and a
      // stop leaves the streaming copies as the next step must find them (θ_{s-1}).
      std::unique_lock<std::mutex> lock(mu_);
      wait_step(lock, s, [&] { return handed_out_ > s; });
    }
    for (std::size_t l = 0; l < store.layers(); ++l) {
      std::vector<std::shared_ptr<JobRun>> uploads;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto streams = [&](int j) {
          const auto& st = jobs[j].streamed;
          return std::find(st.begin(), st.end(), static_cast<int>(l)) != st.end();
        };
        std::size_t needed = 0;
        for (std::size_t j = 0; j < jobs.size(); ++j)
          needed += streams(static_cast<int>(j));
        wait_step(lock, s, [&] {
          std::size_t have = 0;
          for (auto& [j, r] : loads_[s])
            have += streams(j);
          return have == needed;
        });
        for (auto& [j, r] : loads_[s])
          if (streams(j)) uploads.push_back(r);
      }
      for (auto& r : uploads)
        r->weights_ready->synchronize();
      optimizer.publish_layer(l);
      std::lock_guard<std::mutex> lock(mu_);
      versions_[l] = s + 1;
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    loads_.erase(s);
  }

  void emit_device_events() {
    if (!options.events) return;
    const double t = options.events->now();
    double& last_t = last_device_event_t_;
    for (std::size_t d = 0; d < devs.size(); ++d) {
      DeviceCtx& dc = *devs[d];
      const kernels::MemoryStats mem = dc.dev->memory();
      const kernels::TrafficStats tr = dc.dev->traffic();
      double busy;
      {
        std::lock_guard<std::mutex> lk(dc.busy_mutex);
        busy = dc.busy_s - dc.busy_reported_s;
        dc.busy_reported_s = dc.busy_s;
      }
      options.events->emit(
          DeviceEvent{.device = static_cast<int>(d),
                      .name = dc.dev->info().name,
                      .bytes_in_use = mem.bytes_in_use,
                      .bytes_peak = mem.bytes_peak,
                      .bytes_cap = mem.bytes_cap,
                      .busy_fraction = t > last_t ? std::min(1.0, busy / (t - last_t)) : 0,
                      .bytes_h2d = tr.bytes_h2d,
                      .bytes_d2h = tr.bytes_d2h});
    }
    last_t = t;
  }

  // ---- main thread ----

  // Host staging memory from the transfers' pool, back to it when the last user lets go.
  std::shared_ptr<offload::HostBuffer> staging(std::size_t bytes) {
    offload::Transfers* t = transfers.get();
    return std::shared_ptr<offload::HostBuffer>(new offload::HostBuffer(t->take_staging(bytes)),
                                                [t](offload::HostBuffer* b) {
                                                  t->recycle(std::move(*b));
                                                  delete b;
                                                });
  }

  // A step's data (for evaluate(), batch `step_no`'s: 1 to M microbatches, no routing records).
  std::shared_ptr<StepData> make_step(std::int64_t step_no, std::vector<Microbatch> mb) {
    const std::string where =
        (evaluating_ ? "evaluation batch " : "step ") + std::to_string(step_no);
    if (evaluating_ ? mb.empty() || static_cast<int>(mb.size()) > plan.microbatches
                    : static_cast<int>(mb.size()) != plan.microbatches)
      throw Error(where + ": " + std::to_string(mb.size()) + " microbatches given, the plan runs " +
                  std::to_string(plan.microbatches));
    auto step = std::make_shared<StepData>();
    std::vector<std::array<at::Tensor, kInputSlots>> inputs;
    for (std::size_t m = 0; m < mb.size(); ++m) {
      const std::string w = where + ", microbatch " + std::to_string(m);
      Microbatch& b = mb[m];
      if (!b.batch.tokens.defined() || b.batch.tokens.dim() != 2 || b.batch.tokens.numel() == 0)
        throw Error(w + ": tokens must be a non-empty (B, T) tensor");
      if (!b.targets.defined() || b.targets.sizes() != b.batch.tokens.sizes())
        throw Error(w + ": targets must have the tokens' shape");
      b.batch.tokens = b.batch.tokens.to(at::kCPU, at::kLong).contiguous();
      b.targets = b.targets.to(at::kCPU, at::kLong).contiguous();
      if (b.batch.doc_ids.defined()) b.batch.doc_ids = b.batch.doc_ids.to(at::kCPU, at::kLong);
      const std::int64_t lo = b.batch.tokens.min().item<std::int64_t>(),
                         hi = b.batch.tokens.max().item<std::int64_t>();
      if (lo < 0 || hi >= config.vocab_size)
        throw Error(w + ": token id " + std::to_string(lo < 0 ? lo : hi) +
                    " is outside the vocabulary (0.." + std::to_string(config.vocab_size - 1) +
                    ")");
      const models::AttentionContext ctx =
          models::attention_context_without_masks(config, b.batch, act_dtype);
      const at::Tensor docs = models::packed_doc_ids(b.batch);
      models::DocSpans& spans = step->spans.emplace_back(models::doc_spans(docs));
      inputs.push_back({ctx.positions, ctx.cos, ctx.sin, docs,
                        docs.defined() ? spans.offsets_tensor() : at::Tensor(), b.batch.tokens,
                        b.targets});
      if (config.num_experts > 0 && !evaluating_)
        step->routing.push_back(std::make_shared<models::RoutingRecord>());
      step->tokens += b.batch.tokens.numel();
      step->targets += b.targets.ne(-100).sum().item<std::int64_t>();
    }
    step->mb = std::move(mb);
    step->step_no = step_no;
    // Pack the inputs (each at a 256-byte boundary, as device kernels like them).
    std::size_t bytes = 0;
    for (auto& slots : inputs) {
      std::array<PackedTensor, kInputSlots>& layout = step->layout.emplace_back();
      for (int i = 0; i < kInputSlots; ++i) {
        if (!slots[i].defined()) continue;
        slots[i] = slots[i].contiguous();
        bytes = (bytes + 255) / 256 * 256;
        layout[i] = {.defined = true,
                     .offset = bytes,
                     .sizes = slots[i].sizes().vec(),
                     .dtype = slots[i].scalar_type()};
        bytes += slots[i].nbytes();
      }
    }
    step->packed = staging(bytes);
    for (std::size_t m = 0; m < inputs.size(); ++m)
      for (int i = 0; i < kInputSlots; ++i)
        if (inputs[m][i].defined())
          std::memcpy(step->packed->as<std::uint8_t>() + step->layout[m][i].offset,
                      inputs[m][i].data_ptr(), inputs[m][i].nbytes());
    step->loss = staging(sizeof(float));
    *step->loss->as<float>() = 0;
    return step;
  }

  void emit_plan(const char* partitioner) {
    if (!options.events || !options.plan_inputs) return;
    PlanPrediction p = predict(plan, costs_);
    options.events->emit(PlanEvent{.plan = plan.describe(),
                                   .devices = static_cast<int>(devs.size()),
                                   .microbatches = plan.microbatches,
                                   .predicted_step_s = p.step_time_s,
                                   .predicted_idle_fraction = p.idle_fraction,
                                   .predicted_peak_bytes = p.peak_bytes,
                                   .partitioner = partitioner,
                                   .predicted_bytes_up = p.bytes_up,
                                   .predicted_bytes_down = p.bytes_down,
                                   .predicted_nvme_read = p.bytes_nvme_read,
                                   .predicted_nvme_write = p.bytes_nvme_write,
                                   .placement_json = options.placement_json});
  }

  // Folds the measured job times into the per-layer costs; re-plans when a cost moved enough.
  // Between segments: no thread is running.
  void replan() {
    std::vector<Measurement> ms;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ms.swap(measured_);
    }
    const std::size_t L = costs_.layers.size();
    std::vector<double> f_sum(L, 0), f_n(L, 0), b_sum(L, 0), b_n(L, 0);
    for (const Measurement& m : ms) {
      const JobSpec& js = jobs[m.job];
      double predicted = 0;
      for (int l = js.range.begin; l < js.range.end; ++l) {
        const LayerCosts& c = costs_.layers[l];
        predicted += js.kind == JobKind::kForward ? c.forward_s_per_token
                                                  : c.forward_s_per_token + c.backward_s_per_token;
      }
      const double speed = costs_.devices.at(m.device).speed;
      predicted *= static_cast<double>(m.tokens) / (speed > 0 ? speed : 1);
      if (!(predicted > 0) || !(m.seconds > 0)) continue;
      const double ratio = m.seconds / predicted;  // the job's layers all took this much longer
      for (int l = js.range.begin; l < js.range.end; ++l) {
        f_sum[l] += ratio;
        f_n[l] += 1;
        if (js.kind != JobKind::kForward) {
          b_sum[l] += ratio;
          b_n[l] += 1;
        }
      }
    }
    bool moved = false;
    // Moves a cost half-way to what was measured (sum / n times it).
    auto update = [&](double& cost, double sum, double n) {
      if (n == 0) return;
      const double r = sum / n;
      moved = moved || std::abs(r - 1) > options.replan_threshold;
      cost *= 0.5 + 0.5 * r;
    };
    for (std::size_t l = 0; l < L; ++l) {
      update(costs_.layers[l].forward_s_per_token, f_sum[l], f_n[l]);
      update(costs_.layers[l].backward_s_per_token, b_sum[l], b_n[l]);
    }
    if (!moved) return;
    Plan next = plan_ours(costs_);
    if (next.describe() == plan.describe()) return;
    // Checkpoints on the NVMe tier have the space the first plan's need (the planner's); a plan
    // that saves more would keep the excess in host memory the planner did not count.
    if (transfers->spills() &&
        next.checkpointed_layers().size() > plan.checkpointed_layers().size())
      return;
    plan = std::move(next);
    transfers->clear_staging();  // sized for the old plan's stages
    jobs.clear();
    ckpt_layers.clear();
    build_jobs();
    emit_plan("ours, re-planned from measured timings");
  }

  std::vector<StepResult> train(std::int64_t steps, const BatchSource& batches,
                                const std::function<void(const StepResult&)>& on_step) {
    std::vector<StepResult> all;
    if (stop_requested_) return all;
    if (!plan_emitted) emit_plan(options.partitioner.c_str());
    plan_emitted = true;
    const bool replanning = options.replan_every > 0 && options.plan_inputs;
    while (steps > 0) {
      const std::int64_t n =
          replanning ? std::min<std::int64_t>(steps, options.replan_every) : steps;
      std::vector<StepResult> r = run_segment(n, batches, on_step);
      all.insert(all.end(), r.begin(), r.end());
      steps -= n;
      if (stop_requested_) break;
      if (steps > 0 && replanning) replan();
    }
    return all;
  }

  // The shared state reset for a segment of `total_jobs` jobs, and the devices' clocks read.
  void begin_segment(std::int64_t total_jobs) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      failed_ = false;
      error_ = nullptr;
      total_jobs_ = total_jobs;
      stop_steps_ = std::numeric_limits<std::int64_t>::max();
      handed_out_ = 0;
      scales_decided_ = 0;
      versions_.assign(store.layers(), 0);
      grads_consumed_.assign(store.layers(), 0);
      loads_.clear();
      steps_.clear();
      runs_.clear();
      outputs_.clear();
      ckpts_.clear();
      results_.clear();
      evaluated_.clear();
      last_step_end_ = std::chrono::steady_clock::now();
    }
    for (auto& dc : devs) {
      dc->clock = dc->dev->create_event(kernels::EventTiming::kOn);
      dc->compute->record(*dc->clock);
      dc->clock->synchronize();
      dc->clock_t = options.events ? options.events->now() : 0;
    }
  }

  // `steps` steps with the current plan, pipelined; every thread is joined at the end.
  std::vector<StepResult> run_segment(std::int64_t steps, const BatchSource& batches,
                                      const std::function<void(const StepResult&)>& on_step) {
    if (steps <= 0) return {};
    begin_segment(steps * static_cast<std::int64_t>(jobs.size()));
    std::vector<std::thread> threads;
    for (std::size_t d = 0; d < devs.size(); ++d) {
      threads.emplace_back([this, d] { loader(static_cast<int>(d)); });
      threads.emplace_back([this, d] { worker(static_cast<int>(d)); });
    }
    threads.emplace_back([this, steps] { optimizer_thread(steps); });

    std::vector<StepResult> out;
    std::int64_t published = 0;
    auto publish = [&](std::int64_t s) {
      published = s + 1;
      guarded("step " + std::to_string(steps_done + s + 1) + ", reading the batch", [&] {
        auto step = make_step(steps_done + s + 1, batches(steps_done + s + 1));
        std::lock_guard<std::mutex> lock(mu_);
        step->loss_scale = scale;
        steps_[s] = std::move(step);
        handed_out_ = s + 1;
        cv_.notify_all();
      });
    };
    publish(0);
    if (steps > 1) publish(1);
    for (std::int64_t s = 0; s < std::min(steps, published) && !failed(); ++s) {
      StepResult res;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return failed_ || static_cast<std::int64_t>(results_.size()) > s; });
        if (failed_) break;
        res = results_[s];
      }
      out.push_back(res);
      if (on_step) guarded("after step " + std::to_string(res.step), [&] { on_step(res); });
      if (stop_requested_ && published < steps) {
        std::lock_guard<std::mutex> lock(mu_);
        stop_steps_ = published;
        cv_.notify_all();
      } else if (s + 2 < steps) {
        publish(s + 2);
      }
    }
    for (auto& t : threads)
      t.join();
    end_segment();
    steps_done += static_cast<std::int64_t>(out.size());
    if (error_) std::rethrow_exception(error_);
    return out;
  }

  // After the segment's threads have joined: everything still on the devices waited for and
  // freed, the store flushed. A failure is left in error_.
  void end_segment() {
    // Everything still on the devices: wait for it, then free it. A device that failed reports
    // its error again on every later call (CUDA's errors are sticky); the run's error is the
    // first one, with the job it happened in, so these only speak when nothing has yet.
    auto synchronize_all = [&] {
      for (auto& dc : devs)
        try {
          dc->dev->synchronize();
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!error_)
            error_ = std::make_exception_ptr(Error(dc->dev->info().name + ": " + e.what()));
        }
    };
    synchronize_all();
    // The jobs whose loader did not get to release them (the last ones): their device time.
    if (!error_)
      for (auto& [g, r] : runs_)
        if (r->enqueued) guarded("accounting " + job_where(g), [&] { account(g, *r); });
    {
      std::lock_guard<std::mutex> lock(mu_);
      runs_.clear();
      outputs_.clear();
      ckpts_.clear();
      steps_.clear();
    }
    // The staging pool stays (page-locked, for the next segment's same sizes) unless the run
    // failed; a new plan's sizes replace it (replan()).
    if (error_) transfers->clear_staging();
    synchronize_all();  // stream-ordered releases done
    // NVMe write-backs done (and reads nobody took dropped): the store is as the last step left
    // it, for checkpoints and exports.
    try {
      store.flush();
    } catch (...) {
      if (!error_) error_ = std::current_exception();
    }
  }

  EvalResult evaluate(std::vector<Microbatch> microbatches) {
    EvalResult result;
    if (microbatches.empty()) return result;
    const auto M = static_cast<std::size_t>(plan.microbatches);
    const auto batches = static_cast<std::int64_t>((microbatches.size() + M - 1) / M);
    // The evaluation's jobs in place of training's for the segment.
    std::vector<JobSpec> train_jobs;
    std::set<int> train_ckpts;
    jobs.swap(train_jobs);
    ckpt_layers.swap(train_ckpts);
    evaluating_ = true;
    struct Restore {
      Impl* self;
      std::vector<JobSpec>& jobs;
      std::set<int>& ckpts;
      ~Restore() {
        self->jobs = std::move(jobs);
        self->ckpt_layers = std::move(ckpts);
        self->evaluating_ = false;
      }
    } restore{this, train_jobs, train_ckpts};
    build_jobs(/*evaluation=*/true);
    begin_segment(batches * static_cast<std::int64_t>(jobs.size()));
    {
      std::lock_guard<std::mutex> lock(mu_);
      // No optimizer runs: every layer's streaming copy is as the last update left it.
      versions_.assign(store.layers(), std::numeric_limits<std::int64_t>::max());
    }
    std::vector<std::thread> threads;
    for (std::size_t d = 0; d < devs.size(); ++d) {
      threads.emplace_back([this, d] { loader(static_cast<int>(d)); });
      threads.emplace_back([this, d] { worker(static_cast<int>(d)); });
    }
    // Batches of M microbatches (the last may hold fewer), handed out two ahead of the one whose
    // last job was enqueued, as training's steps are.
    std::vector<std::shared_ptr<offload::HostBuffer>> losses(static_cast<std::size_t>(batches));
    auto publish = [&](std::int64_t b) {
      guarded("evaluation batch " + std::to_string(b + 1) + ", reading the batch", [&] {
        std::vector<Microbatch> mb;
        for (std::size_t i = static_cast<std::size_t>(b) * M;
             i < std::min(static_cast<std::size_t>(b + 1) * M, microbatches.size()); ++i)
          mb.push_back(std::move(microbatches[i]));
        auto step = make_step(b + 1, std::move(mb));
        losses[static_cast<std::size_t>(b)] = step->loss;
        result.targets += step->targets;
        std::lock_guard<std::mutex> lock(mu_);
        steps_[b] = std::move(step);
        handed_out_ = b + 1;
        cv_.notify_all();
      });
    };
    publish(0);
    if (batches > 1) publish(1);
    for (std::int64_t b = 0; b < batches && !failed(); ++b) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return failed_ || evaluated_.count(b) > 0; });
        if (failed_) break;
        steps_.erase(b);  // every job of the batch has it already
      }
      if (b + 2 < batches) publish(b + 2);
    }
    for (auto& t : threads)
      t.join();
    end_segment();
    if (error_) std::rethrow_exception(error_);
    for (const auto& loss : losses)
      result.loss_sum += *loss->as<float>();
    return result;
  }

  // ---- generation ----

  // The KV cache of one block: `rows` rows of `slots` positions.
  std::uint64_t kv_bytes(std::int64_t rows, std::int64_t slots) const {
    return 2 * static_cast<std::uint64_t>(rows) * static_cast<std::uint64_t>(slots) *
           static_cast<std::uint64_t>(config.num_kv_heads * config.head_dim) *
           static_cast<std::uint64_t>(elem_size(act_dtype));
  }

  // Device bytes generation needs beyond the weights: the KV caches of `blocks` blocks, and the
  // prefill's largest temporaries (the blocks' activations, the attention scores of the plain
  // path, the last position's fp32 logits).
  std::uint64_t generation_bytes(std::int64_t rows, std::int64_t prompt, std::int64_t slots,
                                 std::int64_t blocks) const {
    const auto e = static_cast<std::uint64_t>(elem_size(act_dtype));
    const auto R = static_cast<std::uint64_t>(rows), P = static_cast<std::uint64_t>(prompt),
               S = static_cast<std::uint64_t>(slots);
    const std::uint64_t kv =
        static_cast<std::uint64_t>(std::max<std::int64_t>(blocks, 0)) * kv_bytes(rows, slots);
    const std::uint64_t wide = static_cast<std::uint64_t>(
        std::max<std::int64_t>(config.intermediate_size, config.moe_intermediate_size));
    const std::uint64_t acts =
        R * P * (6 * static_cast<std::uint64_t>(config.hidden_size) + 3 * wide) * e;
    const std::uint64_t scores = R * static_cast<std::uint64_t>(config.num_heads) * P * S * 4;
    return kv + acts + scores + R * static_cast<std::uint64_t>(config.vocab_size) * 4;
  }

  Generation generate(const std::vector<std::vector<std::int64_t>>& prompts,
                      const models::SamplingOptions& options, const GenerateSettings& settings) {
    const Residency residency = settings.residency;
    const auto& on_token = settings.on_token;
    Generation out;
    out.tokens.assign(prompts.size(), {});
    if (prompts.empty() || options.max_new_tokens <= 0) return out;
    const auto B = static_cast<std::int64_t>(prompts.size());
    std::int64_t P = 0;
    for (std::size_t b = 0; b < prompts.size(); ++b) {
      if (prompts[b].empty())
        throw Error("generate: prompt " + std::to_string(b + 1) + " of " + std::to_string(B) +
                    " is empty");
      for (std::int64_t t : prompts[b])
        if (t < 0 || t >= config.vocab_size)
          throw Error("generate: prompt " + std::to_string(b + 1) + ": token id " +
                      std::to_string(t) + " is outside the vocabulary (" +
                      std::to_string(config.vocab_size) + ")");
      P = std::max<std::int64_t>(P, static_cast<std::int64_t>(prompts[b].size()));
    }
    // Left-padded rows: every prompt ends at slot P - 1.
    std::vector<std::int64_t> pad(prompts.size());
    at::Tensor next = at::zeros({B, P}, at::kLong);
    for (std::int64_t b = 0; b < B; ++b) {
      const auto& p = prompts[static_cast<std::size_t>(b)];
      pad[static_cast<std::size_t>(b)] = P - static_cast<std::int64_t>(p.size());
      next[b]
          .narrow(0, pad[static_cast<std::size_t>(b)], static_cast<std::int64_t>(p.size()))
          .copy_(at::tensor(p, at::kLong));
    }

    // Resident on the first device when every weight (dequantised, tied ones once) and the
    // caches fit under its free memory; else the plan's stages, spread or streamed (below).
    const int L = static_cast<int>(specs.size());
    auto layer_bytes = [&](int l) {
      return static_cast<std::uint64_t>(specs[l].param_count()) * elem_size(act_dtype);
    };
    std::uint64_t weight_bytes = 0;
    for (int l = 0; l < L; ++l)
      weight_bytes += layer_bytes(l);
    const kernels::MemoryStats mem = devs[0]->dev->memory();
    std::uint64_t free = mem.bytes_cap > mem.bytes_in_use ? mem.bytes_cap - mem.bytes_in_use : 0;
    // A simulated device's (and the CPU device's) memory is host memory, whose cap may be all of
    // it: then at most half of what the OS has free.
    if (devs[0]->dev->info().kind == kernels::DeviceKind::kSim)
      free = std::min(free, host_memory_available() / 2);
    out.resident =
        residency == Residency::kResident ||
        (residency == Residency::kAuto &&
         weight_bytes + generation_bytes(B, P, P + options.max_new_tokens, config.num_layers) <=
             free);
    struct Stage {
      LayerRange range;
      int device = 0;
      std::vector<int> layers;
      std::unique_ptr<offload::DeviceWeights> weights;
    };
    std::vector<Stage> stages;
    if (!out.resident)
      for (const LayerRange& r : plan.forward)
        stages.push_back({.range = r});
    // A plan of one stage (the whole model in the tail) streams nothing either: it stays.
    out.resident = stages.empty();
    stages.push_back({.range = out.resident ? LayerRange{0, L} : plan.tail});
    for (std::size_t j = 0; j < stages.size(); ++j) {
      stages[j].device = static_cast<int>(j % devs.size());
      stages[j].layers = streamed(stages[j].range);
    }
    // Per device: the weights of its stages, its blocks (their KV caches) and its free memory
    // (simulated devices share host memory: at most their share of half of what the OS has).
    const std::size_t N = devs.size();
    std::vector<std::uint64_t> stage_bytes, device_bytes(N, 0), room(N, 0);
    std::vector<std::int64_t> device_blocks(N, 0);
    for (const Stage& st : stages) {
      std::uint64_t b = 0;
      for (int l : st.layers)
        b += layer_bytes(l);
      stage_bytes.push_back(b);
      device_bytes[static_cast<std::size_t>(st.device)] += b;
      for (int l = st.range.begin; l < st.range.end; ++l)
        device_blocks[static_cast<std::size_t>(st.device)] += l > 0 && l < L - 1;
    }
    for (std::size_t d = 0; d < N; ++d) {
      const kernels::MemoryStats m = devs[d]->dev->memory();
      room[d] = m.bytes_cap > m.bytes_in_use ? m.bytes_cap - m.bytes_in_use : 0;
      if (devs[d]->dev->info().kind == kernels::DeviceKind::kSim)
        room[d] = std::min(room[d], host_memory_available() / 2 / N);
    }
    const std::int64_t slots = P + options.max_new_tokens;
    // Spread: when every device holds all of its stages (stage j on device j mod N), their blocks'
    // caches and the prefill's temporaries, the stages stay where they are across tokens, loaded
    // once: a model larger than one device but not than all of them streams nothing.
    bool spread = residency == Residency::kSpread;
    if (residency == Residency::kAuto && !out.resident && N > 1 && stages.size() > 1) {
      spread = true;
      for (std::size_t d = 0; d < N; ++d)
        spread =
            spread && device_bytes[d] + generation_bytes(B, P, slots, device_blocks[d]) <= room[d];
    }
    out.spread = spread && !out.resident;
    // Streamed, the KV caches of every block a device runs pile up on it; when they would not fit
    // beside two stages of weights and the prefill's temporaries, they stay in host memory between
    // tokens instead (each block's cache goes up before the block runs and comes back after).
    std::vector<std::uint64_t> largest = stage_bytes;
    std::sort(largest.rbegin(), largest.rend());
    const std::uint64_t two_stages = largest[0] + (largest.size() > 1 ? largest[1] : 0);
    bool kv_host = settings.kv_caches == KvCaches::kHost;
    if (settings.kv_caches == KvCaches::kAuto && !out.resident && !out.spread)
      for (std::size_t d = 0; d < N; ++d)
        kv_host = kv_host || two_stages + generation_bytes(B, P, slots, device_blocks[d]) > room[d];
    out.kv_host = kv_host;

    const std::vector<std::int64_t>& stops =
        options.stop_tokens.empty() ? config.eos_token_ids : options.stop_tokens;
    std::vector<std::uint64_t> rng(prompts.size(), options.seed);
    std::vector<bool> finished(prompts.size(), false);
    // Prompt groups: with the stages on several devices the prompts split into groups (at most
    // one per device that runs a stage, and per prompt) that follow each other through the stages,
    // as training's microbatches do: while a device runs a stage for group g + 1, the next device
    // runs the next stage for group g, and the devices work together instead of one at a time. A
    // stage's weights serve every group before they go. A pass splits only when each group keeps
    // settings.min_group_tokens rows of tokens: below that a device's time goes to reading the
    // stage's weights, which each group would read again (a decoding pass of a few prompts stays
    // whole; their prefill splits). Resident (one stage): one group.
    // Not on CUDA yet: there a group's activations cross to the next device in a copy that torch
    // orders behind everything queued on both devices' current streams, which serialises the
    // groups (correct, but no faster than one group, and each group's matmuls are smaller); the
    // hand-over wants a stream of its own first (docs/engine.md).
    const std::size_t S = stages.size();
    const bool cuda = devs[0]->dev->info().kind == kernels::DeviceKind::kCuda;
    const auto most_groups = static_cast<std::int64_t>(
        !out.resident && !cuda && N > 1 && S > 1 ? std::min({N, S, prompts.size()}) : 1);
    auto groups_for = [&](std::int64_t tokens) {
      if (settings.groups > 0) return std::min<std::int64_t>(settings.groups, B);
      return std::clamp<std::int64_t>(tokens / std::max<std::int64_t>(settings.min_group_tokens, 1),
                                      1, most_groups);
    };
    // A group's rows of the batch, their padding, their KV caches (per layer) and what flows
    // between its stages. When a pass groups the prompts otherwise than the one before (the
    // decoding after a split prefill), each block's first run gathers its group's rows of the
    // caches from the previous groups, on its device. kv_host: each block's cache in host memory,
    // allocated for every slot at its first token (page-locked for a GPU), filled up to `offset`
    // (every block sees every position). Laid out position-major, (slots, rows, KV, D), so that the
    // positions so far are one contiguous block: it goes up in one copy straight from the
    // page-locked memory (a (rows, KV, slots, D) view of the first positions would be strided,
    // which torch first gathers into pageable memory), and the new positions come down into one;
    // the device lays them out as the block reads them.
    struct Group {
      std::int64_t row = 0, rows = 0;
      std::vector<std::int64_t> pad;
      std::vector<models::KvCache> caches;
      at::Tensor x, logits;
    };
    std::vector<Group> groups, previous;
    auto regroup = [&](std::int64_t G) {
      previous.clear();
      if (static_cast<std::int64_t>(groups.size()) == G) return;
      previous = std::move(groups);
      groups.assign(static_cast<std::size_t>(G), {});
      for (std::int64_t g = 0; g < G; ++g) {
        Group& grp = groups[static_cast<std::size_t>(g)];
        grp.row = g * B / G;
        grp.rows = (g + 1) * B / G - grp.row;
        grp.pad.assign(pad.begin() + grp.row, pad.begin() + grp.row + grp.rows);
        grp.caches.resize(static_cast<std::size_t>(L));
      }
      out.groups = std::max(out.groups, G);
    };
    // Layer l's keys or values for the rows of `grp`, from the previous groups' caches (rows along
    // `dim`: 0 on the device, 1 in host memory).
    auto gathered = [&](const Group& grp, int l, bool keys, std::int64_t dim) {
      std::vector<at::Tensor> parts;
      for (const Group& o : previous) {
        const std::int64_t a = std::max(o.row, grp.row),
                           b = std::min(o.row + o.rows, grp.row + grp.rows);
        const models::KvCache& c = o.caches[static_cast<std::size_t>(l)];
        if (a < b && c.k.defined())
          parts.push_back((keys ? c.k : c.v).narrow(dim, a - o.row, b - a));
      }
      return parts;
    };
    // Per token: each (stage, group)'s end on its device's compute stream, and its failure.
    std::vector<std::vector<std::unique_ptr<kernels::Event>>> done(S);
    std::vector<std::vector<std::exception_ptr>> errors(S);
    std::atomic<bool> failing{false};
    std::atomic<std::uint64_t> kv_up{0}, kv_down{0};
    // Streamed: a device holds the weights of at most two stages (the one running and the next);
    // `held` lists them oldest first, `pending` marks the loaded ones that have not run yet.
    std::vector<std::deque<std::size_t>> held(N);
    std::vector<bool> pending(S, false);
    const int head = L - 1;
    // Work still queued refers to the locals above: on the way out with an error, it ends first.
    struct Drain {
      std::vector<std::unique_ptr<DeviceCtx>>& devs;
      ~Drain() {
        for (auto& dc : devs)
          try {
            dc->compute->synchronize();
          } catch (...) {  // its error is the one being thrown, or follows from it
          }
      }
    } drain{devs};
    const bool streaming = !out.resident && !out.spread;
    auto load = [&](std::size_t j) {
      Stage& st = stages[j];
      if (st.weights) return;
      auto& on = held[static_cast<std::size_t>(st.device)];
      if (streaming && on.size() >= 2) {
        // Free the oldest stage that has run (waiting for its last group), if any has.
        for (auto it = on.begin(); it != on.end(); ++it)
          if (!pending[*it]) {
            if (!done[*it].empty()) done[*it].back()->synchronize();
            stages[*it].weights.reset();
            on.erase(it);
            break;
          }
      }
      st.weights = transfers->load_weights(st.device, st.layers);
      on.push_back(j);
      pending[j] = true;
    };
    auto rethrow_first = [&] {
      for (std::size_t j = 0; j < S; ++j)
        for (const std::exception_ptr& error : errors[j]) {
          if (!error) continue;
          const Stage& st = stages[j];
          const std::string where = "generating, layers " + std::to_string(st.range.begin) + "-" +
                                    std::to_string(st.range.end - 1) + " on " +
                                    devs[static_cast<std::size_t>(st.device)]->dev->info().name +
                                    ": ";
          try {
            std::rethrow_exception(error);
          } catch (const Error& e) {
            throw Error(where + e.what());
          } catch (const std::exception& e) {
            throw Error(where + first_line(e.what()));
          }
        }
    };

    std::int64_t offset = 0;
    for (std::int64_t produced = 0; produced < options.max_new_tokens; ++produced) {
      const std::int64_t count = next.size(1);
      regroup(groups_for(B * count));
      for (Group& grp : groups)
        grp.x = next.narrow(0, grp.row, grp.rows);
      for (std::size_t j = 0; j < S; ++j) {
        done[j].clear();
        errors[j].assign(groups.size(), nullptr);
      }
      for (std::size_t j = 0; j < S; ++j) {
        Stage& st = stages[j];
        DeviceCtx& dc = *devs[static_cast<std::size_t>(st.device)];
        load(j);
        dc.compute->wait(*st.weights->ready());
        // The previous stage's device, when another: its output comes from there.
        const int from = j > 0 && stages[j - 1].device != st.device ? stages[j - 1].device : -1;
        for (std::size_t g = 0; g < groups.size(); ++g) {
          if (from >= 0) dc.compute->wait(*done[j - 1][g]);
          dc.compute->enqueue([&, j, g, from, count, offset] {
            if (failing) return;  // a group before this one failed: the token is lost anyway
            Group& grp = groups[g];
            const auto t0 = std::chrono::steady_clock::now();
            try {
              // The copy from the previous device is ordered on that device's compute stream too.
              std::optional<TorchStreamScope> source;
              if (from >= 0) source.emplace(*devs[static_cast<std::size_t>(from)]->compute);
              TorchStreamScope scope(*dc.compute);
              c10::InferenceMode inference;
              const models::AttentionContext ctx =
                  models::make_decode_context(config, offset, count, act_dtype, dc.torch, grp.pad);
              at::Tensor h = grp.x.to(dc.torch);
              if (st.range.begin == 0)
                h = models::embed(layer_weights(*st.weights, 0, dc.torch)[0], h);
              for (int l = std::max(st.range.begin, 1); l < std::min(st.range.end, head); ++l) {
                models::KvCache& kept = grp.caches[static_cast<std::size_t>(l)];
                if (!kept.k.defined() && !previous.empty()) {
                  // (Of one group, the previous caches of the layer go once gathered: this
                  // layer's stage alone reads them, on this stream.)
                  const bool last_reader = groups.size() == 1;
                  if (!kv_host) {
                    kept.k = at::cat(gathered(grp, l, true, 0), 0);
                    kept.v = at::cat(gathered(grp, l, false, 0), 0);
                  } else {  // into page-locked memory again, for every slot
                    auto into = [&](bool keys) {
                      const std::vector<at::Tensor> parts = gathered(grp, l, keys, 1);
                      RONDO_ASSERT(!parts.empty());
                      at::Tensor all = at::empty(
                          {parts[0].size(0), grp.rows, parts[0].size(2), parts[0].size(3)},
                          parts[0].options().pinned_memory(dc.torch.is_cuda()));
                      at::cat_out(all, parts, 1);
                      return all;
                    };
                    kept.k = into(true);
                    kept.v = into(false);
                  }
                  if (last_reader)
                    for (Group& o : previous)
                      o.caches[static_cast<std::size_t>(l)] = {};
                }
                models::KvCache on_device;
                models::KvCache& cache = kv_host ? on_device : kept;
                const std::int64_t had = offset;
                if (kv_host && had > 0) {
                  // (The copy may run on in the stream: the block writes only later positions.)
                  auto up = [&](const at::Tensor& host) {
                    return host.narrow(0, 0, had)
                        .to(dc.torch, /*non_blocking=*/true)
                        .permute({1, 2, 0, 3})
                        .contiguous();
                  };
                  cache.k = up(kept.k);
                  cache.v = up(kept.v);
                  kv_up += cache.k.nbytes() + cache.v.nbytes();
                }
                h = models::block_forward(
                    config,
                    models::BlockWeights::bind(specs[l], layer_weights(*st.weights, l, dc.torch)),
                    h, ctx, &cache);
                if (kv_host) {  // only the new positions come down
                  if (!kept.k.defined()) {
                    const at::IntArrayRef s = cache.k.sizes();  // (rows, KV, positions, D)
                    const at::TensorOptions o =
                        cache.k.options().device(at::kCPU).pinned_memory(dc.torch.is_cuda());
                    kept.k = at::empty({slots, s[0], s[1], s[3]}, o);
                    kept.v = at::empty({slots, s[0], s[1], s[3]}, o);
                  }
                  // Into page-locked memory a GPU's copy runs on in the stream: the host reads
                  // it only through the next token's upload, later in the same stream.
                  auto down = [&](const at::Tensor& on_device, at::Tensor& host) {
                    const at::Tensor added =
                        on_device.narrow(2, had, count).permute({2, 0, 1, 3}).contiguous();
                    host.narrow(0, had, count).copy_(added, /*non_blocking=*/dc.torch.is_cuda());
                    kv_down += added.nbytes();
                  };
                  down(cache.k, kept.k);
                  down(cache.v, kept.v);
                }
              }
              if (st.range.end == L) {
                const std::vector<at::Tensor> hw = layer_weights(*st.weights, head, dc.torch);
                grp.logits =
                    models::head_logits(config, hw[0], hw[1], h.narrow(1, count - 1, 1)).squeeze(1);
              } else {
                grp.x = h;
              }
              const double emulate = emulated_seconds(st.range, true, grp.rows * count, st.device);
              const double spent =
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
              if (emulate > spent)
                std::this_thread::sleep_for(std::chrono::duration<double>(emulate - spent));
            } catch (...) {
              errors[j][g] = std::current_exception();
              failing = true;
            }
          });
          done[j].push_back(dc.dev->create_event());
          dc.compute->record(*done[j].back());
        }
        pending[j] = false;
        // Streamed: the next stages' uploads (the next token's first, after the last) overlap the
        // compute, one stage ahead on each other device (so every device's link works, and no
        // device holds more than its running stage and one more).
        if (!out.resident && S > 1)
          for (std::size_t k = 1; k < std::max<std::size_t>(2, N) && k < S; ++k)
            load((j + k) % S);
      }
      for (auto& dc : devs)
        dc->compute->synchronize();
      rethrow_first();
      std::vector<at::Tensor> parts;
      for (Group& grp : groups)
        parts.push_back(grp.logits.to(at::kCPU));
      const at::Tensor logits = parts.size() == 1 ? parts[0] : at::cat(parts);
      at::Tensor chosen = at::zeros({B, 1}, at::kLong);
      for (std::size_t b = 0; b < prompts.size(); ++b) {
        if (finished[b]) continue;
        const std::int64_t t =
            models::sample_token(logits[static_cast<std::int64_t>(b)], options, rng[b]);
        out.tokens[b].push_back(t);
        if (on_token) on_token(b, t);
        chosen[static_cast<std::int64_t>(b)][0] = t;
        finished[b] = std::find(stops.begin(), stops.end(), t) != stops.end();
      }
      if (std::all_of(finished.begin(), finished.end(), [](bool f) { return f; })) break;
      offset += count;
      next = chosen;
    }
    out.kv_bytes_up = kv_up;
    out.kv_bytes_down = kv_down;
    for (Stage& st : stages)
      st.weights.reset();  // the resident weights, or the next token's prefetched stages
    for (auto& dc : devs)
      dc->dev->synchronize();  // their stream-ordered release done
    return out;
  }
};

std::int64_t head_chunk_tokens(std::int64_t configured, std::int64_t vocab, bool cpu_backed) {
  if (!cpu_backed) return configured;
  return std::min(configured,
                  std::max<std::int64_t>(16, static_cast<std::int64_t>(offload::kHeapBlockLimit) /
                                                 2 / (std::max<std::int64_t>(vocab, 1) * 4)));
}

std::int64_t dropout_seed(std::uint64_t run_seed, std::int64_t step, int microbatch) {
  // splitmix64 of the three, kept non-negative (negative means "no dropout").
  std::uint64_t z = run_seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(step) * 4099 +
                    static_cast<std::uint64_t>(microbatch);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<std::int64_t>(z >> 1);
}

Engine::Engine(const models::ModelConfig& config, const std::vector<models::LayerSpec>& specs,
               offload::LayerStore& store, offload::HostArena& arena,
               std::vector<kernels::Device*> devices, Plan plan, EngineOptions options) {
  const int layers = static_cast<int>(specs.size());
  std::vector<std::string> problems = plan.problems(layers);
  if (static_cast<int>(store.layers()) != layers)
    problems.push_back("the store holds " + std::to_string(store.layers()) +
                       " layers, the model has " + std::to_string(layers));
  if (devices.empty()) problems.push_back("no devices");
  if (!options.emulate_costs.empty() && static_cast<int>(options.emulate_costs.size()) != layers)
    problems.push_back("emulate_costs must have one entry per layer");
  if (!options.emulate_speeds.empty() && options.emulate_speeds.size() != devices.size())
    problems.push_back("emulate_speeds must have one entry per device");
  if (!problems.empty()) throw Error(join_problems("The engine cannot run this plan:", problems));
  impl_ = std::make_unique<Impl>(config, specs, store, arena, std::move(plan), std::move(options));
  impl_->transfers = std::make_unique<offload::Transfers>(
      store, arena, devices,
      offload::TransferOptions{.max_chunk_bytes = impl_->options.max_chunk_bytes,
                               .spill_bytes = impl_->options.spill_checkpoint_bytes,
                               .share_frozen = impl_->options.share_frozen_weights,
                               .share_trained = impl_->shares_trained()});
  for (std::size_t d = 0; d < devices.size(); ++d) {
    auto dc = std::make_unique<DeviceCtx>();
    dc->dev = devices[d];
    dc->index = static_cast<int>(d);
    dc->compute = &dc->dev->create_stream("compute");
    dc->torch = torch_device(*dc->dev);
    if (!impl_->options.emulate_speeds.empty()) dc->speed = impl_->options.emulate_speeds[d];
    impl_->devs.push_back(std::move(dc));
  }
  if (impl_->options.plan_inputs) {
    impl_->costs_ = *impl_->options.plan_inputs;
    impl_->costs_.microbatches = impl_->plan.microbatches;
    impl_->costs_.grain = impl_->plan.grain;
    if (impl_->costs_.layers.size() != specs.size() ||
        impl_->costs_.devices.size() != devices.size())
      throw Error("engine: plan_inputs must describe the model's " + std::to_string(specs.size()) +
                  " layers and the " + std::to_string(devices.size()) + " devices");
  }
  impl_->build_jobs();
}

Engine::~Engine() = default;

std::vector<StepResult> Engine::train(std::int64_t steps, const BatchSource& batches,
                                      const std::function<void(const StepResult&)>& on_step) {
  const QuietCallerOpenMp quiet;
  return impl_->train(steps, batches, on_step);
}

EvalResult Engine::evaluate(std::vector<Microbatch> microbatches) {
  const QuietCallerOpenMp quiet;
  return impl_->evaluate(std::move(microbatches));
}

Generation Engine::generate(const std::vector<std::vector<std::int64_t>>& prompts,
                            const models::SamplingOptions& options,
                            const GenerateSettings& settings) {
  const QuietCallerOpenMp quiet;
  return impl_->generate(prompts, options, settings);
}

EngineState Engine::state() const {
  return {.steps_done = impl_->steps_done,
          .optimizer_step = impl_->optimizer.step(),
          .loss_scale = impl_->scale,
          .good_steps = impl_->good_steps};
}

void Engine::restore(const EngineState& state) {
  if (state.steps_done < 0 || state.optimizer_step < 0 || state.optimizer_step > state.steps_done ||
      !(state.loss_scale > 0) || state.good_steps < 0)
    throw Error("engine: cannot restore an inconsistent state (steps " +
                std::to_string(state.steps_done) + ", optimizer step " +
                std::to_string(state.optimizer_step) + ")");
  impl_->steps_done = state.steps_done;
  impl_->optimizer.set_step(state.optimizer_step);
  impl_->scale = state.loss_scale;
  impl_->good_steps = state.good_steps;
}

void Engine::request_stop() {
  impl_->stop_requested_ = true;
}

const Plan& Engine::plan() const {
  return impl_->plan;
}

double Engine::loss_scale() const {
  return impl_->scale;
}

offload::TransferStats Engine::transfer_stats() const {
  return impl_->transfers->stats();
}

}  // namespace rondo::engine
