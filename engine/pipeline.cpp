// The pipeline's loaders and workers (pipeline.h). What they share goes through the board; what
// they move goes through offload::Transfers; the math of a microbatch is job_compute.cpp's.
#include "engine/pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "engine/events.h"
#include "engine/job_compute.h"
#include "engine/torch_device.h"
#include "kernels/cpu/openmp.h"

namespace rondo::engine {

struct Pipeline::JobTensors {
  std::map<int, std::vector<at::Tensor>> weights;  // by layer, spec order
  JobGradients grads;                              // jobs with a backward
};

Pipeline::Pipeline(EngineParts& parts, Board& board, const JobList& jobs, std::int64_t total_jobs,
                   std::int64_t steps_done, bool evaluating)
    : parts_(parts),
      board_(board),
      jobs_(jobs),
      total_jobs_(total_jobs),
      steps_done_(steps_done),
      evaluating_(evaluating) {}

std::string Pipeline::job_where(std::int64_t g) const {
  const JobSpec& js = jobs_[static_cast<std::size_t>(g) % jobs_.size()];
  const DeviceContext& d = *parts_.devs[static_cast<std::size_t>(g) % parts_.devices()];
  const std::int64_t s = g / static_cast<std::int64_t>(jobs_.size());
  return (evaluating_ ? "evaluation, batch " + std::to_string(s + 1)
                      : "step " + std::to_string(steps_done_ + s + 1)) +
         ", job " + js.name + " (layers " + std::to_string(js.range.begin) + "-" +
         std::to_string(js.range.end - 1) + ") on " + d.dev->info().name;
}

std::vector<int> Pipeline::checkpointed_in(LayerRange range) const {
  std::vector<int> out;
  for (int l : jobs_.checkpointed)
    if (l >= range.begin && l < range.end) out.push_back(l);
  return out;
}

// ---- loader ----

void Pipeline::release(std::int64_t g) {
  // A job of a step that will not run (stopping) is freed at the end of the segment.
  std::shared_ptr<JobRun> r = board_.wait_enqueued(g, g / static_cast<std::int64_t>(jobs_.size()));
  // (A device fault surfaces here, in the job it hit: a failed copy's stream reports it through
  // the events recorded after it.)
  for (auto* e :
       {r->weights_ready.get(), r->done_compute.get(), r->done_up.get(), r->done_down.get()})
    if (e) e->synchronize();
  if (r->grads_written) r->grads_written->wait();  // its NVMe-bound gradients left the device
  account(g, *r);
  r->weights.reset();
  r->buffers.clear();
  r->keep.clear();
  for (auto& h : r->staging)
    parts_.transfers->recycle(std::move(h));
  r->staging.clear();
  board_.released(g);
}

// Job g's device time, once its work has completed: the device's busy time, the re-planner's
// measurement, and its span on the event sink's clock.
void Pipeline::account(std::int64_t g, JobRun& r) {
  if (r.accounted || r.timing.empty() || evaluating_) return;
  r.accounted = true;
  const auto N = static_cast<std::int64_t>(parts_.devices()),
             J = static_cast<std::int64_t>(jobs_.size());
  const int d = static_cast<int>(g % N);
  DeviceContext& dc = *parts_.devs[static_cast<std::size_t>(d)];
  double busy = 0;
  for (auto& [start, end] : r.timing)
    busy += end->seconds_since(*start);
  {
    std::lock_guard<std::mutex> lk(dc.busy_mutex);
    dc.busy_s += busy;
  }
  const JobSpec& js = jobs_[static_cast<std::size_t>(g % J)];
  if (parts_.options.replan_every > 0)
    board_.add_measurement({static_cast<int>(g % J), d, busy, r.tokens});
  if (EventSink* sink = parts_.options.events)
    sink->emit(SpanEvent{.device = d,
                         .step = steps_done_ + g / J + 1,
                         .stage = js.name,
                         .first_layer = js.range.begin,
                         .end_layer = js.range.end,
                         .start = dc.clock_t + r.timing.front().first->seconds_since(*dc.clock),
                         .end = dc.clock_t + r.timing.back().second->seconds_since(*dc.clock)});
}

void Pipeline::account_remaining() {
  for (auto& [g, r] : board_.remaining_runs())
    if (r->enqueued) guarded(board_, "accounting " + job_where(g), [&] { account(g, *r); });
}

void Pipeline::loader(int d) {
  const auto N = static_cast<std::int64_t>(parts_.devices()),
             J = static_cast<std::int64_t>(jobs_.size());
  offload::Transfers& transfers = *parts_.transfers;
  for (std::int64_t g = d; g < total_jobs_; g += N) {
    guarded(board_, job_where(g), [&] {
      const JobSpec& js = jobs_[static_cast<std::size_t>(g % J)];
      // NVMe reads of the frozen weights can start before device memory frees up (the trained
      // ones only once the optimizer has written them, below).
      transfers.prefetch_weights(js.streamed, /*frozen_only=*/true);
      if (g - 2 * N >= 0) release(g - 2 * N);  // at most one stage prefetched behind the running
      const std::int64_t s = g / J;
      std::shared_ptr<JobRun> r = board_.wait_weights_current(g, s, js.streamed);
      r->weights = transfers.load_weights(d, js.streamed);
      r->weights_ready = r->weights->ready();
      // The previous job's host staging (NVMe reads) is not needed once its weights landed.
      if (g - N >= 0)
        if (std::shared_ptr<JobRun> prev = board_.find_run(g - N); prev && prev->weights)
          prev->weights->release_staging();
      // The first microbatch's checkpoints, if on the NVMe tier, start their way back (before
      // `loaded`: the job does not receive them yet).
      prefetch_checkpoints(js, s, 0);
      board_.loaded(s, static_cast<int>(g % J), r,
                    /*stale_upload=*/parts_.options.one_step_stale && !evaluating_);
    });
    if (board_.failed() || board_.stopped(g / J)) return;
  }
}

// ---- worker ----

// An input handed over by another job: a device tensor on `dc`, ready in compute-stream order.
at::Tensor Pipeline::receive(DeviceContext& dc, JobRun& r, HandoffKind kind, HandoffKey key) {
  std::shared_ptr<Handoff> h = board_.take(kind, key);
  offload::Transfers& transfers = *parts_.transfers;
  if (h->route == HandoffRoute::kSpill) h->host = transfers.unspill(h->spilled);
  if (h->route == HandoffRoute::kKeep) {
    RONDO_ASSERT(h->device == dc.dev);
    dc.compute->wait(*h->event);
    r.buffers.push_back(std::move(h->dev));
    return tensor_view(r.buffers.back().data(), h->sizes, parts_.act_dtype, dc.torch);
  }
  offload::Uploaded up =
      transfers.upload(dc.index, h->host, dense_bytes(h->sizes, parts_.act_dtype));
  dc.compute->wait(*up.ready);
  at::Tensor t = tensor_view(up.buffer.data(), h->sizes, parts_.act_dtype, dc.torch);
  r.buffers.push_back(std::move(up.buffer));
  if (h->route == HandoffRoute::kSpill) {
    // A checkpoint read back from the NVMe tier: its staging goes back to the pool once the
    // upload has landed (the read is done, so that is the copy's time only), not when the job is
    // released two jobs later, which would keep every microbatch's in host memory.
    up.ready->synchronize();
    transfers.recycle_unspilled(std::move(h->host.host));
  } else {
    r.staging.push_back(std::move(h->host.host));
  }
  return t;
}

// Starts reading back the checkpoints of microbatch m that backward job `js` of step s receives,
// where they are on the NVMe tier already; only the job's own worker (or its loader before the
// job starts) calls it, so no receive() of them runs meanwhile.
void Pipeline::prefetch_checkpoints(const JobSpec& js, std::int64_t s, int m) {
  if (!parts_.transfers->spills() || js.kind != JobKind::kBackward) return;
  for (auto& h : board_.published_checkpoints(s, checkpointed_in(js.range), m))
    if (h->route == HandoffRoute::kSpill) parts_.transfers->prefetch(h->spilled);
}

// Publishes `dev_buf` (written by compute work enqueued before this call) to the consumer: kept on
// the device when the consumer runs there, else downloaded to host staging memory (and, for a
// checkpoint with the NVMe tier on, written there).
void Pipeline::send(DeviceContext& dc, JobRun& r, HandoffKind kind, HandoffKey key,
                    kernels::DeviceBuffer dev_buf, std::vector<std::int64_t> sizes, bool keep) {
  offload::Transfers& transfers = *parts_.transfers;
  std::shared_ptr<Handoff> h = board_.handoff(kind, key);
  auto ev = dc.dev->create_event();
  dc.compute->record(*ev);
  h->route = keep                                                     ? HandoffRoute::kKeep
             : kind == HandoffKind::kCheckpoint && transfers.spills() ? HandoffRoute::kSpill
                                                                      : HandoffRoute::kDownload;
  if (h->route == HandoffRoute::kKeep) {
    h->device = dc.dev;
    h->event = std::move(ev);
    h->dev = std::move(dev_buf);
  } else {
    const std::size_t bytes = dense_bytes(sizes, parts_.act_dtype);
    offload::Staged staged = transfers.download(dc.index, dev_buf.data(), bytes, *ev);
    if (h->route == HandoffRoute::kSpill)
      h->spilled = transfers.spill(std::move(staged), bytes);
    else
      h->host = std::move(staged);
    r.buffers.push_back(std::move(dev_buf));
  }
  h->sizes = std::move(sizes);
  board_.publish(h);
}

void Pipeline::worker(int d) {
  const auto N = static_cast<std::int64_t>(parts_.devices()),
             J = static_cast<std::int64_t>(jobs_.size());
  for (std::int64_t g = d; g < total_jobs_; g += N) {
    guarded(board_, job_where(g), [&] { run_job(d, g); });
    if (board_.failed() || board_.stopped(g / J)) return;
  }
}

std::shared_ptr<DeviceInputs> Pipeline::inputs_on(DeviceContext& dc, StepData& step, JobRun& r) {
  std::lock_guard<std::mutex> lock(step.inputs_mu);
  std::shared_ptr<DeviceInputs>& have = step.on_device[dc.index];
  if (have) return have;
  auto in = std::make_shared<DeviceInputs>();
  offload::Uploaded up = parts_.transfers->upload_for(
      dc.index, *dc.compute, step.packed->data(), step.in.layout.bytes, offload::Cargo::kInputs);
  dc.compute->wait(*up.ready);
  r.keep.push_back(step.packed);
  in->buffer = std::move(up.buffer);
  in->mb = microbatch_views(in->buffer.data(), step.in.layout, dc.torch);
  have = in;
  return in;
}

void Pipeline::run_job(int d, std::int64_t g) {
  const auto J = static_cast<std::int64_t>(jobs_.size()),
             N = static_cast<std::int64_t>(parts_.devices());
  const std::int64_t s = g / J;
  const JobSpec& js = jobs_[static_cast<std::size_t>(g % J)];
  DeviceContext& dc = *parts_.devs[static_cast<std::size_t>(d)];
  auto [step, r] = board_.wait_loaded(g, s);
  const int M = static_cast<int>(step->in.mb.size());  // the plan's; an evaluation's last: fewer
  r->tokens = step->in.tokens;
  const std::shared_ptr<DeviceInputs> inputs = inputs_on(dc, *step, *r);
  dc.compute->wait(*r->weights_ready);

  // Weights and (for jobs with a backward) gradient accumulators.
  auto tensors = std::make_shared<JobTensors>();
  for (int l = js.range.begin; l < js.range.end; ++l)
    tensors->weights[l] = parts_.layer_weights(*r->weights, l, dc.torch);
  const bool backward = !forward_only(js.kind);
  if (backward) tensors->grads = job_gradients(parts_, dc, js.range, r->buffers);
  // The tail's values (the loss and the preference metrics summed over the microbatches on the
  // device; StepData::loss).
  float* loss_dev = nullptr;
  const std::size_t value_bytes = step->value_count() * sizeof(float);
  if (js.kind == JobKind::kTail || js.kind == JobKind::kEval) {
    r->buffers.push_back(dc.dev->allocate(value_bytes, dc.compute));
    loss_dev = static_cast<float*>(r->buffers.back().data());
    dc.compute->fill(loss_dev, 0, value_bytes);
  }

  const bool keep_output = (g + 1) % N == d && js.has_output;
  const int C = static_cast<int>(parts_.config.hidden_size);
  const std::vector<int> checkpointed = checkpointed_in(js.range);
  double loss_scale = 1;
  EngineProbe* probe = parts_.options.probe;

  for (int m = 0; m < M; ++m) {
    const Microbatch& mb = step->in.mb[static_cast<std::size_t>(m)];
    const std::vector<std::int64_t> act = {mb.batch.tokens.size(0), mb.batch.tokens.size(1), C};
    MicrobatchWork work{.job = &js,
                        .step = step.get(),
                        .inputs = &inputs->mb[static_cast<std::size_t>(m)],
                        .m = m,
                        .weights = &tensors->weights,
                        .grads = backward ? &tensors->grads.acc : nullptr,
                        .loss_dev = loss_dev,
                        .evaluating = evaluating_};
    // Inputs.
    prefetch_checkpoints(js, s, m + 1);
    const bool from_tokens = js.kind != JobKind::kBackward && js.range.begin == 0;
    if (!from_tokens) work.in = receive(dc, *r, HandoffKind::kOutput, {g - 1, 0, m});
    if (js.kind == JobKind::kBackward)
      for (int l : checkpointed)
        work.saved[l] = receive(dc, *r, HandoffKind::kCheckpoint, {s, l, m});
    // The fp16 loss scale of this step: the one the previous step's optimizer left. In exact mode
    // it is decided before this job's weights can be ready; in one-step-stale mode the weights
    // come earlier, so the tail waits for the decision (only the norm, not the update). Backward
    // jobs read what the tail set: they run after it (they take its output).
    if (m == 0 && backward) {
      if (js.kind == JobKind::kTail) step->loss_scale = board_.wait_scale(s);
      loss_scale = step->loss_scale / step->loss_denominator;
    }
    work.loss_scale = loss_scale;
    // Outputs.
    kernels::DeviceBuffer out_buf;
    if (js.has_output) {
      out_buf = dc.dev->allocate(dense_bytes(act, parts_.act_dtype), dc.compute);
      work.out = tensor_view(out_buf.data(), act, parts_.act_dtype, dc.torch);
    }
    std::map<int, kernels::DeviceBuffer> ckpt_out;
    if (js.kind == JobKind::kForward)
      for (int l : checkpointed)
        if (l >= 1) {
          kernels::DeviceBuffer b =
              dc.dev->allocate(dense_bytes(act, parts_.act_dtype), dc.compute);
          work.ckpt[l] = tensor_view(b.data(), act, parts_.act_dtype, dc.torch);
          ckpt_out.emplace(l, std::move(b));
        }

    const bool last = m == M - 1;
    const std::int64_t tokens = mb.batch.tokens.numel();
    auto run = [this, &dc, step, inputs, tensors, work, last, backward, probe, d, g, tokens] {
      if (board_.failed()) return;
      guarded(board_, job_where(g), [&] {
        const auto t0 = std::chrono::steady_clock::now();
        TorchStreamScope scope(*dc.compute);
        compute_microbatch(parts_, dc.torch, work);
        // f32 accumulators to the gradient dtype, for the download.
        if (last && backward) round_gradients(tensors->grads);
        if (probe)
          probe->computed(
              d, work.job->range, forward_only(work.job->kind), tokens,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      });
    };
    r->timing.emplace_back(dc.dev->create_event(kernels::EventTiming::kOn),
                           dc.dev->create_event(kernels::EventTiming::kOn));
    dc.compute->record(*r->timing.back().first);
    dc.compute->enqueue(std::move(run));
    dc.compute->record(*r->timing.back().second);
    // Hand on the output and the checkpoints.
    if (js.has_output)
      send(dc, *r, HandoffKind::kOutput, {g, 0, m}, std::move(out_buf), act, keep_output);
    for (auto& [l, b] : ckpt_out)
      send(dc, *r, HandoffKind::kCheckpoint, {s, l, m}, std::move(b), act, false);
  }

  // Several devices computing on this machine's cores: this one's OpenMP pool goes between its
  // jobs (Note [One OpenMP pool while the devices compute], kernels/cpu/openmp.cpp).
  if (dc.torch.is_cpu() && parts_.devices() > 1)
    dc.compute->enqueue([] { kernels::release_openmp_pool(); });

  // Gradients (and the tail's loss) down to the store, once per job — once the optimizer has
  // read the previous step's (Note [Engine synchronisation], 4, in board.cpp).
  offload::Transfers& transfers = *parts_.transfers;
  if (backward) board_.wait_gradients_read(tensors->grads.layer_ids(), s);
  if (backward || loss_dev) {
    auto ev = dc.dev->create_event();
    dc.compute->record(*ev);
    // The NVMe-bound gradients' buffers count down r->grads_written as the writer lets each go
    // (all wrapped first, so that one not handed over, on a failure, counts down as well).
    std::map<int, std::shared_ptr<void>> held;
    if (!tensors->grads.keep.empty()) {
      r->grads_written =
          std::make_shared<std::latch>(static_cast<std::ptrdiff_t>(tensors->grads.keep.size()));
      for (auto& [l, buffer] : tensors->grads.keep) {
        void* data = buffer->data();
        held[l] = std::shared_ptr<void>(
            data, [b = std::move(buffer), written = r->grads_written](void*) mutable {
              b.reset();
              written->count_down();
            });
      }
    }
    if (backward)
      for (auto& [l, data] : tensors->grads.layers) {
        auto h = held.find(l);
        transfers.download_gradients(d, l, data, *ev,
                                     h == held.end() ? nullptr : std::move(h->second));
      }
    if (loss_dev) transfers.download_value(d, step->loss->data(), loss_dev, value_bytes, *ev);
  }
  r->done_compute = dc.dev->create_event();
  r->done_up = dc.dev->create_event();
  r->done_down = dc.dev->create_event();
  dc.compute->record(*r->done_compute);
  transfers.activation_upload_stream(d).record(*r->done_up);
  transfers.download_stream(d).record(*r->done_down);
  board_.enqueued(g, backward,
                  js.kind == JobKind::kEval ? std::optional<std::int64_t>(s) : std::nullopt);
}

}  // namespace rondo::engine
