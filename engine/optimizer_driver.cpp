// The optimizer thread (optimizer_driver.h): gradients in, exact norm, loss scale, AdamW layer by
// layer, each layer handed back to the loaders on the board as soon as it is written.
#include "engine/optimizer_driver.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "engine/events.h"
#include "engine/ranks.h"
#include "engine/sharding.h"
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
      last_step_end_(std::chrono::steady_clock::now()) {
  if (!parts_.options.data_parallel.gradients) return;
  const offload::LayerStore& store = parts_.store;
  std::vector<std::size_t> bytes;
  for (std::size_t l = 0; l < store.layers(); ++l)
    bytes.push_back(store.grad_bytes(l).bytes);
  for (std::vector<int>& layers : gradient_buckets(bytes))
    buckets_.push_back({.layers = layers, .lowest = layers.back()});
  const std::vector<int>& owners = parts_.options.data_parallel.optimizer_owners;
  std::size_t group_bytes = 0;
  for (int l = 0; l < static_cast<int>(owners.size()); ++l) {
    const auto ul = static_cast<std::size_t>(l);
    const int owner = store.optimizer_chunks(ul) > 0 ? owners[ul] : -1;
    const bool pieces = owner >= 0 && store.tier(ul, offload::kStreamPart) == offload::Tier::kNvme;
    WeightGroup* last = weight_groups_.empty() ? nullptr : &weight_groups_.back();
    if (last && last->owner == owner && !pieces && !last->pieces &&
        (owner < 0 || group_bytes < kWeightGroupBytes)) {
      last->end = l + 1;
    } else {
      weight_groups_.push_back({.first = l, .end = l + 1, .owner = owner, .pieces = pieces});
      group_bytes = 0;
    }
    group_bytes += store.stream_bytes(ul, offload::kStreamPart).bytes;
  }
}

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
  Collective* ranks = options.data_parallel.gradients;
  // Data parallel: the next bucket to start, and those started (in order).
  std::size_t next_bucket = 0;
  struct InFlight {
    std::unique_ptr<Collective::Pending> sum;
    std::size_t bucket;
  };
  std::deque<InFlight> in_flight;
  auto finish_front = [&] {
    in_flight.front().sum->wait();
    for (int l : buckets_[in_flight.front().bucket].layers) {
      const auto ul = static_cast<std::size_t>(l);
      partial[ul] = optimizer_.partial_sum_squares(ul);  // data parallel: host memory only
    }
    in_flight.pop_front();
  };
  // A failure with sums in flight waits for them: their buffers are the store's gradients.
  struct Drain {
    std::deque<InFlight>& in_flight;
    ~Drain() {
      for (InFlight& f : in_flight)
        try {
          f.sum->wait();
        } catch (...) {
        }
    }
  } drain{in_flight};
  int landed_down_to = std::numeric_limits<int>::max();  // every layer from here up is in
  for (std::int64_t j = forward_jobs_; j < J; ++j) {
    std::shared_ptr<JobRun> r = board_.wait_enqueued(s * J + j, s);
    r->done_down->synchronize();
    if (board_.failed()) throw Aborted{};
    const JobSpec& js = jobs_[static_cast<std::size_t>(j)];
    // Gradients on NVMe: summed by the gradient writer as they went to the drive (Note
    // [Gradients on NVMe] in offload/transfer.cpp), bit for bit this sum.
    auto sum_squares = [&](int l) {
      const auto ul = static_cast<std::size_t>(l);
      partial[ul] = store.grad_tier(ul) == offload::Tier::kNvme
                        ? parts_.transfers->gradients_written(l)
                        : optimizer_.partial_sum_squares(ul);
    };
    if (ranks) {
      // Backward jobs hand layers over from the last to the first, on every rank whatever its
      // plan: a bucket is summed once its lowest layer is in.
      RONDO_ASSERT_MSG(js.range.end <= landed_down_to, "gradients landed out of order");
      landed_down_to = js.range.begin;
      for (; next_bucket < buckets_.size() && buckets_[next_bucket].lowest >= landed_down_to;
           ++next_bucket)
        in_flight.push_back({start_bucket(*ranks, buckets_[next_bucket], s), next_bucket});
      // Those already summed: their squares now, off the critical path.
      while (!in_flight.empty() && in_flight.front().sum->done())
        finish_front();
    } else {
      for (int l = js.range.begin; l < js.range.end; ++l)
        if (store.grad_bytes(static_cast<std::size_t>(l)).bytes > 0) sum_squares(l);
    }
    board_.consumed(s * J + j);
  }
  RONDO_ASSERT_MSG(!ranks || next_bucket == buckets_.size(),
                   "a bucket of gradients was not summed");
  while (!in_flight.empty())
    finish_front();
  // Every job of the step has been enqueued, so its data is on the board until drop_step.
  const std::shared_ptr<StepData> data = board_.step(s);
  RONDO_ASSERT(data);
  const std::int64_t step_no = steps_done_ + s + 1;
  if (options.probe) options.probe->gradients_in(step_no);
  const models::ModelConfig& config = parts_.config;
  StepResult res;
  res.step = step_no;
  res.attention_per_document = data->per_document_passes;
  res.attention_masked = data->masked_passes;
  // The loss sum, the router's auxiliary losses, the tokens and the preference metrics' sums,
  // over every rank.
  const float* values = data->loss->as<float>();
  double sums[3 + kPreferenceMetrics] = {static_cast<double>(values[0]), 0.0,
                                         static_cast<double>(data->in.tokens)};
  for (int k = 0; k < kPreferenceMetrics && data->pairs; ++k)
    sums[3 + k] = values[1 + k];
  if (config.output_router_logits)
    for (const auto& routing : data->routing)
      sums[1] += models::router_aux_loss(config, *routing);
  if (ranks)
    ranks->all_reduce_sum(sums, std::size(sums), "step " + std::to_string(step_no) + "'s loss");
  res.tokens = static_cast<std::int64_t>(sums[2]);
  res.targets = data->all_targets;
  res.loss = sums[0] / data->loss_denominator;
  for (int k = 0; k < kPreferenceMetrics; ++k)
    res.preference[static_cast<std::size_t>(k)] = sums[3 + k] / data->all_microbatches;
  if (config.output_router_logits)
    res.loss += config.router_aux_loss_coef * sums[1] / data->all_microbatches;
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
    if (!weight_groups_.empty()) {
      update_sharded(s);
    } else {
      for (std::size_t l = 0; l < store.layers(); ++l) {
        optimizer_.update_layer(l, /*write_stream=*/!options.one_step_stale);
        board_.layer_updated(l, s);
      }
    }
  }
  return res;
}

// Note [Sharded updates]
// Each rank updates the layers it owns and the new streaming copies go out from their owners, in
// layer order, as broadcasts started without waiting: a rank starts the broadcasts of the layers
// others own at once (its receiving side), and those of its own layers as each group is updated,
// so that while one rank updates its run of layers the others update theirs. The process group
// runs the broadcasts in the order every rank started them, so no rank waits on a broadcast whose
// owner is waiting for a later one. Each layer is handed back to the next step's loaders as its
// broadcast completes (in order), as the unsharded loop hands it back as its update ends. Trained
// copies on the NVMe tier go a weight piece at a time, read on the owner and written on the
// others, blocking (the owner's update of that layer is then on every rank's path).
void OptimizerDriver::update_sharded(std::int64_t s) {
  offload::LayerStore& store = parts_.store;
  Collective& ranks = *parts_.options.data_parallel.gradients;
  const int me = ranks.rank();
  const std::string at_step = " at step " + std::to_string(steps_done_ + s + 1);
  struct InFlight {
    std::unique_ptr<Collective::Pending> sent;  // null: nothing to wait for
    const WeightGroup* group;
  };
  std::deque<InFlight> in_flight;
  // A failure with broadcasts in flight waits for them: their buffers are the store's copies.
  struct Drain {
    std::deque<InFlight>& in_flight;
    ~Drain() {
      for (InFlight& f : in_flight)
        try {
          if (f.sent) f.sent->wait();
        } catch (...) {
        }
    }
  } drain{in_flight};
  auto finish_front = [&] {
    if (in_flight.front().sent) in_flight.front().sent->wait();
    const WeightGroup& g = *in_flight.front().group;
    for (int l = g.first; l < g.end; ++l)
      board_.layer_updated(static_cast<std::size_t>(l), s);
    in_flight.pop_front();
  };
  for (const WeightGroup& g : weight_groups_) {
    if (g.owner == me)
      for (int l = g.first; l < g.end; ++l)
        optimizer_.update_layer(static_cast<std::size_t>(l));
    const std::string what = "the new weights of layer" +
                             (g.end - g.first == 1 ? " " + std::to_string(g.first)
                                                   : "s " + std::to_string(g.first) + " to " +
                                                         std::to_string(g.end - 1)) +
                             " from rank " + std::to_string(g.owner) + at_step;
    std::unique_ptr<Collective::Pending> sent;
    if (g.pieces) {
      const auto l = static_cast<std::size_t>(g.first);
      for (std::size_t k = 0; k < store.pieces(l, offload::kStreamPart); ++k) {
        offload::HostBuffer piece = g.owner == me ? store.read_piece(l, offload::kStreamPart, k)
                                                  : store.piece_buffer(l, offload::kStreamPart, k);
        ranks.broadcast(piece.data(), store.piece_size(l, offload::kStreamPart, k), g.owner, what);
        if (g.owner != me) store.write_piece(l, offload::kStreamPart, k, std::move(piece));
      }
    } else if (g.owner >= 0) {
      // Host-resident trained copies of consecutive layers lie back to back in the store.
      const offload::ByteRange low =
          store.stream_bytes(static_cast<std::size_t>(g.first), offload::kStreamPart);
      const offload::ByteRange high =
          store.stream_bytes(static_cast<std::size_t>(g.end - 1), offload::kStreamPart);
      std::size_t sum = 0;
      for (int l = g.first; l < g.end; ++l)
        sum += store.stream_bytes(static_cast<std::size_t>(l), offload::kStreamPart).bytes;
      const auto bytes = static_cast<std::size_t>(high.data - low.data) + high.bytes;
      RONDO_ASSERT_MSG(low.data && sum == bytes,
                       "a group's streaming copies are not back to back in the store");
      sent = ranks.start_broadcast(low.data, bytes, g.owner, what);
    }
    in_flight.push_back({std::move(sent), &g});
    while (!in_flight.empty() && (!in_flight.front().sent || in_flight.front().sent->done()))
      finish_front();
  }
  while (!in_flight.empty())
    finish_front();
}

std::unique_ptr<Collective::Pending> OptimizerDriver::start_bucket(Collective& ranks,
                                                                   const Bucket& bucket,
                                                                   std::int64_t s) {
  const offload::LayerStore& store = parts_.store;
  RONDO_ASSERT(store.grad_dtype() == kernels::FloatDType::kF32);  // as the engine makes the store
  // The store keeps the layers' gradients back to back, in layer order: a bucket of consecutive
  // layers is one buffer, summed in place.
  const offload::ByteRange low = store.grad_bytes(static_cast<std::size_t>(bucket.lowest));
  const offload::ByteRange high = store.grad_bytes(static_cast<std::size_t>(bucket.layers.front()));
  const auto bytes = static_cast<std::size_t>(high.data - low.data) + high.bytes;
  std::size_t sum = 0;
  for (int l : bucket.layers)
    sum += store.grad_bytes(static_cast<std::size_t>(l)).bytes;
  RONDO_ASSERT_MSG(sum == bytes, "a bucket's gradients are not back to back in the store");
  const std::vector<Collective::Floats> parts = {
      {reinterpret_cast<float*>(low.data), bytes / sizeof(float)}};
  return ranks.start_sum(
      parts, "the gradients of layer" +
                 (bucket.layers.size() == 1 ? " " + std::to_string(bucket.layers[0])
                                            : "s " + std::to_string(bucket.layers.front()) +
                                                  " to " + std::to_string(bucket.lowest)) +
                 " at step " + std::to_string(steps_done_ + s + 1));
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
