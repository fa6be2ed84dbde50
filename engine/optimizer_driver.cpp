// The optimizer thread (optimizer_driver.h): gradients in, exact norm, loss scale, AdamW layer by
// layer, each layer handed back to the loaders on the board as soon as it is written.
#include "engine/optimizer_driver.h"

#include <algorithm>
#include <cmath>

#include "engine/events.h"
#include "kernels/error.h"

namespace rondo::engine {

void LossScaler::after_step(bool finite) {
  if (!options_.enabled) return;
  if (!finite) {
    scale_ = std::max(scale_ / 2, options_.min_scale);
    good_steps_ = 0;
  } else if (++good_steps_ >= options_.growth_interval) {
    scale_ *= 2;
    good_steps_ = 0;
  }
}

void DeviceReports::emit(EngineParts& parts) {
  EventSink* sink = parts.options.events;
  if (!sink) return;
  const double t = sink->now();
  for (std::size_t d = 0; d < parts.devices(); ++d) {
    DeviceContext& dc = *parts.devs[d];
    const kernels::MemoryStats mem = dc.dev->memory();
    const kernels::TrafficStats tr = dc.dev->traffic();
    double busy;
    {
      std::lock_guard<std::mutex> lk(dc.busy_mutex);
      busy = dc.busy_s - dc.busy_reported_s;
      dc.busy_reported_s = dc.busy_s;
    }
    sink->emit(DeviceEvent{.device = static_cast<int>(d),
                           .name = dc.dev->info().name,
                           .bytes_in_use = mem.bytes_in_use,
                           .bytes_peak = mem.bytes_peak,
                           .bytes_cap = mem.bytes_cap,
                           .busy_fraction = t > last_t_ ? std::min(1.0, busy / (t - last_t_)) : 0,
                           .bytes_h2d = tr.bytes_h2d,
                           .bytes_d2h = tr.bytes_d2h});
  }
  last_t_ = t;
}

OptimizerDriver::OptimizerDriver(EngineParts& parts, Board& board, const JobList& jobs,
                                 int forward_jobs, Optimizer& optimizer, LossScaler& scaler,
                                 DeviceReports& reports, std::int64_t steps_done)
    : parts_(parts),
      board_(board),
      jobs_(jobs),
      forward_jobs_(forward_jobs),
      optimizer_(optimizer),
      scaler_(scaler),
      reports_(reports),
      steps_done_(steps_done),
      last_step_end_(std::chrono::steady_clock::now()) {}

void OptimizerDriver::run(std::int64_t steps) {
  for (std::int64_t s = 0; s < steps; ++s) {
    guarded(board_, "step " + std::to_string(steps_done_ + s + 1) + ", optimizer", [&] {
      if (parts_.options.one_step_stale) publish_stale(s);
      StepResult res = step(s);
      reports_.emit(parts_);
      const auto now = std::chrono::steady_clock::now();
      res.seconds = std::chrono::duration<double>(now - last_step_end_).count();
      last_step_end_ = now;
      board_.add_result(res);
      board_.drop_step(s);
    });
    if (board_.failed() || board_.stopped(s)) return;
  }
}

StepResult OptimizerDriver::step(std::int64_t s) {
  const auto J = static_cast<std::int64_t>(jobs_.size());
  const offload::LayerStore& store = parts_.store;
  const EngineOptions& options = parts_.options;
  // The gradient norm's sums of squares, layer by layer as the gradients land: off the critical
  // path except for the last job's layers.
  std::vector<double> partial(store.layers(), 0.0);
  for (std::int64_t j = forward_jobs_; j < J; ++j) {
    std::shared_ptr<JobRun> r = board_.wait_enqueued(s * J + j, s);
    r->done_down->synchronize();
    if (board_.failed()) throw Aborted{};
    const JobSpec& js = jobs_[static_cast<std::size_t>(j)];
    // Gradients on NVMe: summed by the gradient writer as they went to the drive (Note
    // [Gradients on NVMe] in offload/transfer.cpp), bit for bit this sum.
    for (int l = js.range.begin; l < js.range.end; ++l) {
      const auto ul = static_cast<std::size_t>(l);
      if (store.grad_bytes(ul).bytes == 0) continue;
      partial[ul] = store.grad_tier(ul) == offload::Tier::kNvme
                        ? parts_.transfers->gradients_written(l)
                        : optimizer_.partial_sum_squares(ul);
    }
    board_.consumed(s * J + j);
  }
  // Every job of the step has been enqueued, so its data is on the board until drop_step.
  const std::shared_ptr<StepData> data = board_.step(s);
  RONDO_ASSERT(data);
  const std::int64_t step_no = steps_done_ + s + 1;
  if (options.probe) options.probe->gradients_in(step_no);
  const models::ModelConfig& config = parts_.config;
  StepResult res;
  res.step = step_no;
  res.tokens = data->in.tokens;
  res.targets = data->in.targets;
  res.attention_per_document = data->per_document_passes;
  res.attention_masked = data->masked_passes;
  res.loss = static_cast<double>(*data->loss->as<float>()) /
             static_cast<double>(std::max<std::int64_t>(data->in.targets, 1));
  if (config.output_router_logits)
    for (const auto& routing : data->routing)
      res.loss += config.router_aux_loss_coef * models::router_aux_loss(config, *routing) /
                  static_cast<double>(data->routing.size());
  res.loss_scale = data->loss_scale;
  optimizer_.set_grad_unscale(1.0 / data->loss_scale);
  const double norm = optimizer_.begin_step(&partial);
  res.grad_norm = norm;
  const bool finite = std::isfinite(norm);
  if (!finite && !options.loss_scaling.enabled)
    throw Error("the gradient norm is " + std::to_string(norm) + " (loss " +
                std::to_string(res.loss) +
                "): training diverged; lower the learning rate or enable clipping");
  // The next step's scale is decided before any of its jobs can start (they wait for the version
  // bumps below).
  scaler_.after_step(finite);
  board_.scale_decided(s, scaler_.scale());
  if (!finite) {
    optimizer_.discard_step();
    res.skipped = true;
    board_.every_layer_updated(s);
  } else {
    if (options.lr) optimizer_.set_lr(options.lr(step_no));
    for (std::size_t l = 0; l < store.layers(); ++l) {
      optimizer_.update_layer(l, /*write_stream=*/!options.one_step_stale);
      board_.layer_updated(l, s);
    }
  }
  return res;
}

void OptimizerDriver::publish_stale(std::int64_t s) {
  // Only for a step that will run: loaders may upload a step before it is handed out, and a stop
  // leaves the streaming copies as the next step must find them (θ_{s-1}).
  board_.wait_handed_out(s);
  for (std::size_t l = 0; l < parts_.store.layers(); ++l) {
    auto streams = [&](int j) {
      const auto& st = jobs_[static_cast<std::size_t>(j)].streamed;
      return std::find(st.begin(), st.end(), static_cast<int>(l)) != st.end();
    };
    std::size_t needed = 0;
    for (std::size_t j = 0; j < jobs_.size(); ++j)
      needed += streams(static_cast<int>(j));
    for (auto& r : board_.wait_uploads(s, needed, streams))
      r->weights_ready->synchronize();
    optimizer_.publish_layer(l);
    board_.layer_published(l, s);
  }
  board_.forget_uploads(s);
}

}  // namespace rondo::engine
