// The synchronisation board (board.h): the engine threads' hand-overs under one mutex, and how a
// failure in any of them becomes the run's error.
#include "engine/board.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "kernels/error.h"

namespace rondo::engine {

// Note [Engine synchronisation]
// Three kinds of thread share the host state; every hand-over between them is a host-side flag
// on the board (under its one mutex) plus a device event that orders the device work behind it.
//
// 1. Job to job (worker to worker). Job g's output for microbatch m is a Handoff published on the
//    board after the producer has enqueued the work and recorded an event behind it (on the
//    compute stream when the data stays on the device, on the download stream when it goes to
//    host staging memory). The consumer waits for the flag, then makes its stream wait for the
//    event before touching the data. The same for activation checkpoints, keyed by (step, layer,
//    microbatch). A Handoff is taken exactly once; the consumer owns its buffers from then on.
// 2. Optimizer to loaders (weights). versions_[l] counts the optimizer passes over layer l in
//    this segment; a loader uploads a job of step s only when every layer it streams (tied owners
//    included) has versions_ >= s (wait_weights_current). The optimizer bumps versions_[l] after
//    writing layer l's streaming copy (layer_updated). So an upload never reads a layer while the
//    optimizer writes it: the optimizer writes layer l for step s only after every job of step s
//    has finished (their gradients are all in), and every upload of step s happened before its
//    job's compute; the uploads of step s+1 wait for the bump.
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
//    upload of it in step s has completed (it waits for those jobs' weights_ready events:
//    wait_uploads) — and bumps versions_ (layer_published); then, once step s's gradients are in,
//    AdamW updates masters and moments only. Step s+1 thus runs on θ_s while θ_{s+1} is computed.
//    Gradients: a worker enqueues the download of layer l's gradients of step s only when
//    grads_consumed_[l] >= s (wait_gradients_read), i.e. after the optimizer has read step s-1's
//    (in exact mode this already holds by (2)).
// 5. Stopping (Engine::request_stop). Steps are handed to the threads two ahead of the newest
//    result. On a stop, the main thread hands out no more and sets stop_steps_ to the number of
//    steps begun (stop_early): a step is begun once a worker has taken one of its jobs or the
//    one-step-stale optimizer has started publishing for it (wait_to_begin, the only two ways a
//    step's work reaches the state — gradients downloaded or accumulated, streaming copies
//    written; loaders only upload), and both waits give up with Stopped for a step at or past
//    stop_steps_ under the same lock that counts it begun. Every other wait for work of such a
//    step (wait_step) then gives up too and its thread returns, while every step begun runs to its
//    update, so the store is left exactly as after its last step. In exact mode step s+1's jobs
//    load only once step s's update has written their layers, so a stop during step s ends after
//    it (the step handed out ahead of it never starts). Uploads already made for a later step are
//    freed with the segment's leftovers, after the devices are synchronised. In one-step-stale
//    mode the optimizer publishes θ_s to the streaming copies only once step s is handed out
//    (wait_handed_out), so a stop leaves them at θ_{s-1}, what the next step (after a resume)
//    must read.
// Device memory: a loader releases job k-2's buffers (after synchronising its events on the host,
// and waiting for the gradient writer to have brought its NVMe-bound gradients down: JobRun::
// grads_written) before it allocates job k's, so a device holds the running job and either the
// previous one (its downloads finishing) or the next one (prefetched), never both, and every byte
// the ledger counts as free is really idle. The planner counts the larger of the two (predict).
// Ordering inside a device is stream order; across devices and streams only the events above order
// anything.

template <typename Pred>
void Board::wait(std::unique_lock<std::mutex>& lock, Pred pred) {
  cv_.wait(lock, [&] { return failed_ || pred(); });
  if (failed_) throw Aborted{};
}

// The same for work of step s (0-based in the segment): throws Stopped when the run is stopping
// before step s and what it waits for has not happened.
template <typename Pred>
void Board::wait_step(std::unique_lock<std::mutex>& lock, std::int64_t s, Pred pred) {
  cv_.wait(lock, [&] { return failed_ || s >= stop_steps_ || pred(); });
  if (failed_) throw Aborted{};
  if (s >= stop_steps_ && !pred()) throw Stopped{};
}

template <typename Pred>
void Board::wait_to_begin(std::unique_lock<std::mutex>& lock, std::int64_t s, Pred pred) {
  cv_.wait(lock, [&] { return failed_ || s >= stop_steps_ || pred(); });
  if (failed_) throw Aborted{};
  if (s >= stop_steps_) throw Stopped{};
  begun_ = std::max(begun_, s + 1);
}

// ---- a segment ----

void Board::begin_segment(std::size_t layers, double loss_scale, bool training) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = false;
  error_ = nullptr;
  stop_steps_ = std::numeric_limits<std::int64_t>::max();
  begun_ = 0;
  training_ = training;
  handed_out_ = 0;
  scales_decided_ = 0;
  scale_ = loss_scale;
  versions_.assign(layers, 0);
  grads_consumed_.assign(layers, 0);
  loads_.clear();
  steps_.clear();
  runs_.clear();
  outputs_.clear();
  ckpts_.clear();
  results_.clear();
  evaluated_.clear();
}

void Board::open_every_layer() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(versions_.begin(), versions_.end(), std::numeric_limits<std::int64_t>::max());
}

std::vector<std::pair<std::int64_t, std::shared_ptr<JobRun>>> Board::remaining_runs() {
  std::lock_guard<std::mutex> lock(mu_);
  return {runs_.begin(), runs_.end()};
}

void Board::end_segment() {
  std::lock_guard<std::mutex> lock(mu_);
  runs_.clear();
  outputs_.clear();
  ckpts_.clear();
  steps_.clear();
  loads_.clear();
}

// ---- failure ----

void Board::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed_) {
    failed_ = true;
    error_ = error;
  }
  cv_.notify_all();
}

bool Board::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

std::exception_ptr Board::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Board::set_error_if_none(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_) error_ = error;
}

// ---- steps ----

void Board::hand_out(std::int64_t s, std::shared_ptr<StepData> step) {
  std::lock_guard<std::mutex> lock(mu_);
  steps_[s] = std::move(step);
  handed_out_ = s + 1;
  cv_.notify_all();
}

void Board::stop_early() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!training_) return;
  stop_steps_ = std::min(stop_steps_, begun_);
  cv_.notify_all();
}

void Board::stop_after(std::int64_t steps) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!training_) return;
  stop_steps_ = std::min(stop_steps_, steps);
  cv_.notify_all();
}

bool Board::stopped(std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  return s >= stop_steps_;
}

void Board::wait_handed_out(std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_to_begin(lock, s, [&] { return handed_out_ > s; });
}

std::shared_ptr<StepData> Board::step(std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = steps_.find(s);
  return it == steps_.end() ? nullptr : it->second;
}

void Board::drop_step(std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  steps_.erase(s);
  cv_.notify_all();
}

// ---- jobs ----

std::shared_ptr<JobRun> Board::wait_weights_current(std::int64_t g, std::int64_t s,
                                                    const std::vector<int>& layers) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_step(lock, s, [&] {
    for (int l : layers)
      if (versions_[static_cast<std::size_t>(l)] < s) return false;
    return true;
  });
  auto& r = runs_[g];
  if (!r) r = std::make_shared<JobRun>();
  return r;
}

std::shared_ptr<JobRun> Board::find_run(std::int64_t g) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(g);
  return it == runs_.end() ? nullptr : it->second;
}

void Board::loaded(std::int64_t s, int j, const std::shared_ptr<JobRun>& r, bool stale_upload) {
  std::lock_guard<std::mutex> lock(mu_);
  r->loaded = true;
  if (stale_upload) loads_[s].push_back({j, r});
  cv_.notify_all();
}

std::pair<std::shared_ptr<StepData>, std::shared_ptr<JobRun>> Board::wait_loaded(std::int64_t g,
                                                                                 std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_to_begin(lock, s, [&] { return steps_.count(s) && runs_.count(g) && runs_[g]->loaded; });
  return {steps_[s], runs_[g]};
}

void Board::enqueued(std::int64_t g, bool has_gradients,
                     std::optional<std::int64_t> evaluated_batch) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::shared_ptr<JobRun>& r = runs_.at(g);
  r->enqueued = true;
  r->consumed = !has_gradients;
  if (evaluated_batch) evaluated_.insert(*evaluated_batch);
  cv_.notify_all();
}

std::shared_ptr<JobRun> Board::wait_enqueued(std::int64_t g, std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_step(lock, s, [&] { return runs_.count(g) && runs_[g]->enqueued; });
  return runs_[g];
}

void Board::released(std::int64_t g) {
  set_and_drop(g, &JobRun::released);
}

void Board::consumed(std::int64_t g) {
  set_and_drop(g, &JobRun::consumed);
}

void Board::set_and_drop(std::int64_t g, bool JobRun::*flag) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = runs_.find(g);
  if (it == runs_.end()) return;
  JobRun& r = *it->second;
  r.*flag = true;
  if (r.released && r.consumed) runs_.erase(it);
}

// ---- layers ----

void Board::layer_published(std::size_t l, std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  versions_[l] = s + 1;
  cv_.notify_all();
}

void Board::layer_updated(std::size_t l, std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  versions_[l] = s + 1;
  grads_consumed_[l] = s + 1;
  cv_.notify_all();
}

void Board::every_layer_updated(std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(versions_.begin(), versions_.end(), s + 1);
  std::fill(grads_consumed_.begin(), grads_consumed_.end(), s + 1);
  cv_.notify_all();
}

void Board::wait_gradients_read(const std::vector<int>& layers, std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  wait(lock, [&] {
    for (int l : layers)
      if (grads_consumed_[static_cast<std::size_t>(l)] < s) return false;
    return true;
  });
}

// ---- one-step-stale uploads ----

std::vector<std::shared_ptr<JobRun>> Board::wait_uploads(std::int64_t s, std::size_t needed,
                                                         const std::function<bool(int)>& streams) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_step(lock, s, [&] {
    std::size_t have = 0;
    for (auto& [j, r] : loads_[s])
      have += streams(j);
    return have == needed;
  });
  std::vector<std::shared_ptr<JobRun>> out;
  for (auto& [j, r] : loads_[s])
    if (streams(j)) out.push_back(r);
  return out;
}

void Board::forget_uploads(std::int64_t s) {
  std::lock_guard<std::mutex> lock(mu_);
  loads_.erase(s);
}

// ---- the loss scale ----

void Board::scale_decided(std::int64_t s, double next_scale) {
  std::lock_guard<std::mutex> lock(mu_);
  scale_ = next_scale;
  scales_decided_ = s + 1;
  cv_.notify_all();
}

double Board::wait_scale(std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  wait_step(lock, s, [&] { return scales_decided_ >= s; });
  return scale_;
}

// ---- handoffs ----

std::shared_ptr<Handoff> Board::handoff(HandoffKind kind, HandoffKey key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& h = handoffs(kind)[key];
  if (!h) h = std::make_shared<Handoff>();
  return h;
}

void Board::publish(const std::shared_ptr<Handoff>& h) {
  std::lock_guard<std::mutex> lock(mu_);
  h->published = true;
  cv_.notify_all();
}

std::shared_ptr<Handoff> Board::take(HandoffKind kind, HandoffKey key) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& map = handoffs(kind);
  std::shared_ptr<Handoff>& entry = map[key];
  if (!entry) entry = std::make_shared<Handoff>();
  std::shared_ptr<Handoff> h = entry;
  wait(lock, [&] { return h->published; });
  map.erase(key);  // taken once: the consumer owns its buffers from here
  return h;
}

std::vector<std::shared_ptr<Handoff>> Board::published_checkpoints(std::int64_t s,
                                                                   const std::vector<int>& layers,
                                                                   int m) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Handoff>> out;
  for (int l : layers)
    if (auto it = ckpts_.find({s, l, m}); it != ckpts_.end() && it->second->published)
      out.push_back(it->second);
  return out;
}

// ---- results ----

void Board::add_result(const StepResult& result) {
  std::lock_guard<std::mutex> lock(mu_);
  results_.push_back(result);
  cv_.notify_all();
}

std::optional<StepResult> Board::wait_result(std::int64_t s) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    return failed_ || static_cast<std::int64_t>(results_.size()) > s || s >= stop_steps_;
  });
  if (failed_ || static_cast<std::int64_t>(results_.size()) <= s) return std::nullopt;
  return results_[static_cast<std::size_t>(s)];
}

bool Board::wait_evaluated(std::int64_t b) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return failed_ || evaluated_.count(b) > 0; });
  return !failed_;
}

// ---- measurements ----

void Board::add_measurement(const Measurement& m) {
  std::lock_guard<std::mutex> lock(mu_);
  measured_.push_back(m);
}

std::vector<Measurement> Board::take_measurements() {
  std::vector<Measurement> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(measured_);
  return out;
}

// ---- failures ----

std::exception_ptr describe_failure(const std::string& where, std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const kernels::OutOfMemory& e) {
    return std::make_exception_ptr(
        DeviceMemoryError(where + ": " + e.what() + "; layer-grain recompute also lowers it",
                          DeviceMemoryError::Whose::kEngineBuffers));
  } catch (const c10::OutOfMemoryError& e) {
    // Torch's own allocations (activations, attention and head temporaries) under the cap
    // (engine::torch_cuda_allocator): it had already released its cache and retried.
    const std::string what = e.what();
    return std::make_exception_ptr(DeviceMemoryError(
        where + ": out of GPU memory in torch's allocations under the memory cap (" +
            what.substr(0, what.find('\n')) + ")",
        DeviceMemoryError::Whose::kTorch));
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find("does not have a deterministic implementation") != std::string::npos)
      return std::make_exception_ptr(
          NondeterministicOpError(where + ": " + what.substr(0, what.find('\n'))));
    return std::make_exception_ptr(Error(where + ": " + what));
  } catch (...) {
    return std::make_exception_ptr(Error(where + ": an unknown error"));
  }
}

}  // namespace rondo::engine
