// The engine's facade (engine.h) and its segment runner: a train() call runs segments of steps
// (re-planning between them from measured timings), evaluate() one segment of forward-only jobs;
// either way one loader and one worker thread per device (pipeline.h) and, for training, the
// optimizer thread (optimizer_driver.h), with the main thread handing steps out two ahead of the
// newest result. What the threads share is on the board (board.h); what lives across segments —
// the plan, the step count, the loss scaler — is here. Generation is generation.h's.
#include "engine/engine.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <thread>

#include "engine/board.h"
#include "engine/engine_parts.h"
#include "engine/events.h"
#include "engine/generation.h"
#include "engine/jobs.h"
#include "engine/model_store.h"
#include "engine/optimizer.h"
#include "engine/optimizer_driver.h"
#include "engine/pipeline.h"
#include "engine/ranks.h"
#include "engine/replan.h"
#include "engine/step_inputs.h"
#include "engine/torch_device.h"
#include "kernels/cpu/openmp.h"
#include "kernels/error.h"
#include "offload/process_heap.h"

namespace rondo::engine {

at::Tensor tensor_view(void* data, const std::vector<std::int64_t>& sizes, at::ScalarType dtype,
                       c10::Device device) {
  return at::from_blob(data, sizes, at::TensorOptions().dtype(dtype).device(device));
}

std::size_t dense_bytes(const std::vector<std::int64_t>& sizes, at::ScalarType dtype) {
  std::size_t n = c10::elementSize(dtype);
  for (std::int64_t s : sizes)
    n *= static_cast<std::size_t>(s);
  return n;
}

std::vector<at::Tensor> EngineParts::layer_weights(const offload::DeviceWeights& weights, int l,
                                                   c10::Device dev) const {
  std::vector<at::Tensor> out;
  const auto layer = static_cast<std::size_t>(l);
  for (std::size_t i = 0; i < store.layer(layer).size(); ++i)
    out.push_back(tensor_view(weights.tensor(l, i), specs[layer].params[i].shape, act_dtype, dev));
  return out;
}

struct Engine::Impl {
  EngineParts parts;
  Plan plan;
  JobList jobs;  // training's, for the current plan
  Optimizer optimizer;
  LossScaler scaler;
  DeviceReports reports;
  Board board;
  std::int64_t steps_done = 0;
  bool plan_emitted = false;
  std::atomic<bool> stop_requested{false};
  // Data parallel: whether the ranks have agreed to stop (agree_stop); main thread only.
  bool stop_agreed = false;

  Collective* ranks() const { return parts.options.data_parallel.steps; }
  // Whether to stop. On several ranks, whether any rank was asked to: every rank asks at the same
  // points (the start of train(), after each step), on the main thread, until they agree.
  bool agree_stop() {
    if (!ranks()) return stop_requested;
    if (!stop_agreed) {
      double asked = stop_requested ? 1 : 0;
      ranks()->all_reduce_sum(&asked, 1, "whether a rank was asked to stop");
      stop_agreed = asked > 0;
    }
    return stop_agreed;
  }
  // A stop decided so far, without asking the other ranks again.
  bool stop_decided() const { return ranks() ? stop_agreed : stop_requested.load(); }
  PlanInputs costs;  // the costs the current plan was made from (options.plan_inputs, updated)

  Impl(EngineParts p, Plan pl)
      : parts(std::move(p)),
        plan(std::move(pl)),
        optimizer(parts.store, parts.options.adamw, parts.options.max_grad_norm),
        scaler(parts.options.loss_scaling) {
    // Every step overwrites the gradients (Note [Engine synchronisation], 3, in board.cpp).
    optimizer.set_zero_grads(false);
    jobs = make_jobs(plan, parts.store, /*evaluation=*/false);
  }

  // Host staging memory from the transfers' pool, back to it when the last user lets go.
  std::shared_ptr<offload::HostBuffer> staging(std::size_t bytes) {
    offload::Transfers* t = parts.transfers.get();
    return std::shared_ptr<offload::HostBuffer>(new offload::HostBuffer(t->take_staging(bytes)),
                                                [t](offload::HostBuffer* b) {
                                                  t->recycle(std::move(*b));
                                                  delete b;
                                                });
  }

  // A step's data for the threads: its inputs checked, prepared and packed into staging memory
  // (for evaluation, batch `step_no`'s: 1 to M microbatches, no routing records).
  std::shared_ptr<StepData> make_step(std::int64_t step_no, std::vector<Microbatch> mb,
                                      bool evaluating) {
    const std::string where =
        (evaluating ? "evaluation batch " : "step ") + std::to_string(step_no);
    if (evaluating ? mb.empty() || static_cast<int>(mb.size()) > plan.microbatches
                   : static_cast<int>(mb.size()) != plan.microbatches)
      throw Error(where + ": " + std::to_string(mb.size()) + " microbatches given, the plan runs " +
                  std::to_string(plan.microbatches));
    auto step = std::make_shared<StepData>();
    step->in = prepare_step_inputs(parts.config, parts.act_dtype, where, std::move(mb));
    step->step_no = step_no;
    step->all_targets = step->in.targets;
    step->all_microbatches = static_cast<int>(step->in.mb.size());
    if (Collective* ranks = parts.options.data_parallel.steps; ranks && !evaluating) {
      double targets = static_cast<double>(step->in.targets);  // exact below 2^53
      ranks->all_reduce_sum(&targets, 1, where + "'s target count");
      step->all_targets = static_cast<std::int64_t>(targets);
      step->all_microbatches *= ranks->size();
      step->first_microbatch = ranks->rank() * static_cast<int>(step->in.mb.size());
    }
    if (parts.config.num_experts > 0 && !evaluating)
      for (std::size_t m = 0; m < step->in.mb.size(); ++m)
        step->routing.push_back(std::make_shared<models::RoutingRecord>());
    const bool pairs = parts.options.preference.pairs();
    for (const Microbatch& b : step->in.mb)
      if (b.pairs.seq.defined() != pairs)
        throw Error(where + ": " +
                    (pairs ? "a microbatch without preference pairs, for the objective '" +
                                 std::string(to_string(parts.options.preference.objective)) + "'"
                           : std::string("preference pairs, for a supervised objective")));
    step->loss_denominator = static_cast<double>(
        std::max<std::int64_t>(pairs ? step->all_microbatches : step->all_targets, 1));
    step->pairs = pairs;
    if (pairs && evaluating) step->sequence_slots = step->in.most_sequences;
    step->packed = staging(step->in.layout.bytes);
    pack_into(step->packed->data(), step->in.layout, step->in.tensors);
    step->loss = staging(step->value_count() * sizeof(float));
    *step->loss->as<float>() = 0;
    return step;
  }

  void emit_plan(const char* partitioner) {
    const EngineOptions& o = parts.options;
    if (!o.events || !o.plan_inputs) return;
    PlanPrediction p = predict(plan, costs);
    o.events->emit(PlanEvent{.plan = plan.describe(),
                             .devices = static_cast<int>(parts.devices()),
                             .microbatches = plan.microbatches,
                             .predicted_step_s = p.step_time_s,
                             .predicted_idle_fraction = p.idle_fraction,
                             .predicted_peak_bytes = p.peak_bytes,
                             .partitioner = partitioner,
                             .predicted_bytes_up = p.bytes_up,
                             .predicted_bytes_down = p.bytes_down,
                             .predicted_nvme_read = p.bytes_nvme_read,
                             .predicted_nvme_write = p.bytes_nvme_write,
                             .placement_json = o.placement_json});
  }

  // Between segments (no thread running): the measured job times folded into the costs, and the
  // plan switched when replan() says so.
  void replan_now() {
    std::optional<Plan> next = replan(costs, plan, jobs.jobs, board.take_measurements(),
                                      parts.options.replan_threshold, parts.transfers->spills());
    if (!next) return;
    plan = std::move(*next);
    parts.transfers->clear_staging();  // sized for the old plan's stages
    jobs = make_jobs(plan, parts.store, /*evaluation=*/false);
    emit_plan("ours, re-planned from measured timings");
  }

  // What a segment does beyond the threads: the data of step s, and on the main thread the wait
  // for step s to be done (false: the segment failed) and what follows it.
  struct Segment {
    const JobList* jobs = nullptr;
    std::int64_t steps = 0;  // steps (or evaluation batches) to run
    bool evaluating = false;
    std::function<std::shared_ptr<StepData>(std::int64_t s)> make;
    std::function<bool(std::int64_t s)> wait_done;
    std::function<void(std::int64_t s)> after;  // may request a stop
  };

  // Runs a segment: the devices' loaders and workers (and the optimizer when training) on threads
  // of their own, steps handed out two ahead of the newest done; every thread joined, every device
  // synchronised and the store flushed at the end. Returns the steps done; a failure is rethrown.
  std::int64_t run_segment(const Segment& seg) {
    if (seg.steps <= 0) return 0;
    const std::int64_t J = static_cast<std::int64_t>(seg.jobs->size());
    board.begin_segment(parts.store.layers(), scaler.scale(), !seg.evaluating);
    // A stop asked for before this segment began (Engine::request_stop found none running).
    if (stop_decided()) board.stop_early();
    if (seg.evaluating) board.open_every_layer();
    for (auto& dc : parts.devs) {
      dc->clock = dc->dev->create_event(kernels::EventTiming::kOn);
      dc->compute->record(*dc->clock);
      dc->clock->synchronize();
      dc->clock_t = parts.options.events ? parts.options.events->now() : 0;
    }
    Pipeline pipeline(parts, board, *seg.jobs, seg.steps * J, steps_done, seg.evaluating);
    OptimizerDriver driver(parts, board, *seg.jobs, static_cast<int>(plan.forward.size()),
                           optimizer, scaler, reports, steps_done);
    std::vector<std::thread> threads;
    for (std::size_t d = 0; d < parts.devices(); ++d) {
      threads.emplace_back([&pipeline, d] { pipeline.loader(static_cast<int>(d)); });
      threads.emplace_back([&pipeline, d] { pipeline.worker(static_cast<int>(d)); });
    }
    if (!seg.evaluating) threads.emplace_back([&driver, &seg] { driver.run(seg.steps); });

    std::int64_t handed = 0, done = 0;
    auto hand_out = [&](std::int64_t s) {
      handed = s + 1;
      guarded(board,
              (seg.evaluating ? "evaluation batch " + std::to_string(s + 1)
                              : "step " + std::to_string(steps_done + s + 1)) +
                  ", reading the batch",
              [&] { board.hand_out(s, seg.make(s)); });
    };
    hand_out(0);
    if (seg.steps > 1) hand_out(1);
    for (std::int64_t s = 0; s < std::min(seg.steps, handed) && !board.failed(); ++s) {
      if (!seg.wait_done(s)) break;
      ++done;
      if (seg.after) seg.after(s);
      if (!seg.evaluating && ranks()) {
        // Several ranks stop together: step s + 1, handed out on every rank and perhaps begun on
        // some, runs everywhere; no step is handed out after it. A rank that is gone fails the
        // segment as any thread's failure does (the threads are joined below).
        bool stop = false;
        guarded(board, "after step " + std::to_string(steps_done + s + 1) + ", agreeing on a stop",
                [&] { stop = agree_stop(); });
        if (board.failed()) break;
        if (stop)
          board.stop_after(handed);
        else if (s + 2 < seg.steps)
          hand_out(s + 2);
      } else if (!seg.evaluating && stop_requested) {
        board.stop_early();
      } else if (s + 2 < seg.steps) {
        hand_out(s + 2);
      }
    }
    for (auto& t : threads)
      t.join();
    end_segment(pipeline);
    if (std::exception_ptr e = board.error()) std::rethrow_exception(e);
    return done;
  }

  // After the segment's threads have joined: everything still on the devices waited for and freed,
  // the store flushed. A failure is left on the board.
  void end_segment(Pipeline& pipeline) {
    // Everything still on the devices: wait for it, then free it. A device that failed reports its
    // error again on every later call (CUDA's errors are sticky); the run's error is the first
    // one, with the job it happened in, so these only speak when nothing has yet.
    auto synchronize_all = [&] {
      for (auto& dc : parts.devs)
        try {
          dc->dev->synchronize();
        } catch (const std::exception& e) {
          board.set_error_if_none(
              std::make_exception_ptr(Error(dc->dev->info().name + ": " + e.what())));
        }
    };
    synchronize_all();
    // The jobs whose loader did not get to release them (the last ones): their device time.
    if (!board.error()) pipeline.account_remaining();
    board.end_segment();
    // The staging pool stays (page-locked, for the next segment's same sizes) unless the run
    // failed; a new plan's sizes replace it (replan_now()).
    if (board.error()) parts.transfers->clear_staging();
    synchronize_all();  // stream-ordered releases done
    // NVMe write-backs done (and reads nobody took dropped): the store is as the last step left
    // it, for checkpoints and exports.
    try {
      parts.store.flush();
    } catch (...) {
      board.set_error_if_none(std::current_exception());
    }
  }

  std::vector<StepResult> train(std::int64_t steps, const BatchSource& batches,
                                const std::function<void(const StepResult&)>& on_step) {
    std::vector<StepResult> all;
    if (agree_stop()) return all;
    if (!plan_emitted) emit_plan(parts.options.partitioner.c_str());
    plan_emitted = true;
    const bool replanning = parts.options.replan_every > 0 && parts.options.plan_inputs;
    while (steps > 0) {
      const std::int64_t n =
          replanning ? std::min<std::int64_t>(steps, parts.options.replan_every) : steps;
      std::vector<StepResult> results;
      Segment seg{.jobs = &jobs, .steps = n};
      seg.make = [&](std::int64_t s) {
        return make_step(steps_done + s + 1, batches(steps_done + s + 1), false);
      };
      seg.wait_done = [&](std::int64_t s) {
        std::optional<StepResult> r = board.wait_result(s);
        if (r) results.push_back(*r);
        return r.has_value();
      };
      seg.after = [&](std::int64_t s) {
        if (on_step)
          guarded(board, "after step " + std::to_string(results[static_cast<std::size_t>(s)].step),
                  [&] { on_step(results[static_cast<std::size_t>(s)]); });
      };
      struct Count {  // steps_done counts the steps run even when the segment throws
        Impl& self;
        std::vector<StepResult>& results;
        ~Count() { self.steps_done += static_cast<std::int64_t>(results.size()); }
      };
      {
        const Count count{*this, results};
        run_segment(seg);
      }
      all.insert(all.end(), results.begin(), results.end());
      steps -= n;
      if (stop_decided()) break;
      if (steps > 0 && replanning) replan_now();
    }
    return all;
  }

  EvalResult evaluate(std::vector<Microbatch> microbatches) {
    EvalResult result;
    if (microbatches.empty()) return result;
    const auto M = static_cast<std::size_t>(plan.microbatches);
    const JobList eval_jobs = make_jobs(plan, parts.store, /*evaluation=*/true);
    // Batches of M microbatches (the last may hold fewer), handed out two ahead of the one whose
    // last job was enqueued, as training's steps are.
    Segment seg{.jobs = &eval_jobs,
                .steps = static_cast<std::int64_t>((microbatches.size() + M - 1) / M),
                .evaluating = true};
    std::vector<std::shared_ptr<offload::HostBuffer>> losses(static_cast<std::size_t>(seg.steps));
    std::vector<std::int64_t> targets(static_cast<std::size_t>(seg.steps), 0);
    // A preference evaluation's: per batch, its values' slots per microbatch, and how many of them
    // each microbatch's sequences fill.
    std::vector<int> slots(static_cast<std::size_t>(seg.steps), 0);
    std::vector<std::vector<std::int64_t>> sequences(static_cast<std::size_t>(seg.steps));
    seg.make = [&](std::int64_t b) {
      std::vector<Microbatch> mb;
      for (std::size_t i = static_cast<std::size_t>(b) * M;
           i < std::min(static_cast<std::size_t>(b + 1) * M, microbatches.size()); ++i)
        mb.push_back(std::move(microbatches[i]));
      auto step = make_step(b + 1, std::move(mb), true);
      losses[static_cast<std::size_t>(b)] = step->loss;
      targets[static_cast<std::size_t>(b)] = parts.options.preference.pairs()
                                                 ? static_cast<std::int64_t>(step->in.mb.size())
                                                 : step->in.targets;
      slots[static_cast<std::size_t>(b)] = step->sequence_slots;
      if (step->sequence_slots > 0)
        for (const Microbatch& m : step->in.mb)
          sequences[static_cast<std::size_t>(b)].push_back(m.pairs.reference.size(0));
      return step;
    };
    seg.wait_done = [&](std::int64_t b) {
      if (!board.wait_evaluated(b)) return false;
      board.drop_step(b);  // every job of the batch has it already
      return true;
    };
    run_segment(seg);
    for (std::size_t b = 0; b < losses.size(); ++b) {
      const float* values = losses[b]->as<float>();
      result.loss_sum += values[0];
      result.targets += targets[b];
      for (int k = 0; k < kPreferenceMetrics && parts.options.preference.pairs(); ++k)
        result.preference[static_cast<std::size_t>(k)] += values[1 + k];
      for (std::size_t m = 0; m < sequences[b].size(); ++m) {
        const float* at = values + StepData::kStepValues + m * static_cast<std::size_t>(slots[b]);
        result.sequence_logps.emplace_back(at, at + sequences[b][m]);
      }
    }
    return result;
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
  if (options.data_parallel.gradients)
    for (std::size_t l = 0; l < store.layers(); ++l)
      if (store.grad_tier(l) == offload::Tier::kNvme) {
        problems.push_back("layer " + std::to_string(l) +
                           "'s gradients are on the NVMe tier: a run on several ranks sums them "
                           "in host memory (keep gradients in host memory)");
        break;
      }
  if (const std::vector<int>& owners = options.data_parallel.optimizer_owners; !owners.empty()) {
    const int rank = options.data_parallel.gradients ? options.data_parallel.gradients->rank() : 0;
    if (!options.data_parallel.gradients)
      problems.push_back("sharded optimizer state needs the ranks (data_parallel.gradients)");
    if (options.one_step_stale)
      problems.push_back(
          "sharded optimizer state with one-step-stale training: the stale update publishes "
          "masters every rank would need; turn one of them off");
    if (owners.size() != store.layers())
      problems.push_back("the optimizer state's owners name " + std::to_string(owners.size()) +
                         " layers, the store holds " + std::to_string(store.layers()));
    for (std::size_t l = 0; l < std::min(owners.size(), store.layers()); ++l)
      if (store.optimizer_chunks(l) > 0 && store.holds_optimizer(l) != (owners[l] == rank)) {
        problems.push_back("layer " + std::to_string(l) + "'s optimizer state is owned by rank " +
                           std::to_string(owners[l]) + " but the store of rank " +
                           std::to_string(rank) + (store.holds_optimizer(l) ? " holds" : " lacks") +
                           " it");
        break;
      }
  }
  if (!problems.empty()) throw Error(join_problems("The engine cannot run this plan:", problems));
  if (options.plan_inputs && (options.plan_inputs->layers.size() != specs.size() ||
                              options.plan_inputs->devices.size() != devices.size()))
    throw Error("engine: plan_inputs must describe the model's " + std::to_string(specs.size()) +
                " layers and the " + std::to_string(devices.size()) + " devices");
  EngineParts parts{.config = config,
                    .specs = specs,
                    .store = store,
                    .arena = arena,
                    .options = std::move(options),
                    .act_dtype = scalar_type(store.stream_dtype())};
  parts.transfers = std::make_unique<offload::Transfers>(
      store, arena, devices,
      offload::TransferOptions{.max_chunk_bytes = parts.options.max_chunk_bytes,
                               .spill_bytes = parts.options.spill_checkpoint_bytes,
                               .share_frozen = parts.options.share_frozen_weights,
                               .share_trained = parts.shares_trained()});
  for (std::size_t d = 0; d < devices.size(); ++d) {
    auto dc = std::make_unique<DeviceContext>();
    dc->dev = devices[d];
    dc->index = static_cast<int>(d);
    dc->compute = &dc->dev->create_stream("compute");
    dc->torch = torch_device(*dc->dev);
    parts.devs.push_back(std::move(dc));
  }
  impl_ = std::make_unique<Impl>(std::move(parts), std::move(plan));
  if (impl_->parts.options.plan_inputs) {
    impl_->costs = *impl_->parts.options.plan_inputs;
    impl_->costs.microbatches = impl_->plan.microbatches;
    impl_->costs.grain = impl_->plan.grain;
    // The tile stays the run's: a replan moves stages, never the order the MLPs' weight gradients
    // are summed in (what an exact resume compares).
    impl_->costs.mlp_tile_tokens = impl_->plan.mlp_tile_tokens;
  }
}

Engine::~Engine() = default;

std::vector<StepResult> Engine::train(std::int64_t steps, const BatchSource& batches,
                                      const std::function<void(const StepResult&)>& on_step) {
  const kernels::QuietCallerOpenMp quiet;
  return impl_->train(steps, batches, on_step);
}

EvalResult Engine::evaluate(std::vector<Microbatch> microbatches) {
  const kernels::QuietCallerOpenMp quiet;
  return impl_->evaluate(std::move(microbatches));
}

Generation Engine::generate(const std::vector<std::vector<std::int64_t>>& prompts,
                            const models::SamplingOptions& options,
                            const GenerateSettings& settings) {
  const kernels::QuietCallerOpenMp quiet;
  return Generator(impl_->parts, impl_->plan).run(prompts, options, settings);
}

EngineCounters Engine::counters() const {
  return {.steps_done = impl_->steps_done,
          .optimizer_step = impl_->optimizer.step(),
          .loss_scale = impl_->scaler.scale(),
          .good_steps = impl_->scaler.good_steps()};
}

void Engine::restore(const EngineCounters& c) {
  if (c.steps_done < 0 || c.optimizer_step < 0 || c.optimizer_step > c.steps_done ||
      !(c.loss_scale > 0) || c.good_steps < 0)
    throw Error("engine: cannot restore inconsistent counters (steps " +
                std::to_string(c.steps_done) + ", optimizer step " +
                std::to_string(c.optimizer_step) + ")");
  impl_->steps_done = c.steps_done;
  impl_->optimizer.set_step(c.optimizer_step);
  impl_->scaler.restore(c.loss_scale, c.good_steps);
}

void Engine::request_stop() {
  impl_->stop_requested = true;
  // At once, not after the step under way: the step handed out ahead of it has usually not begun.
  // Several ranks agree on the step first (Impl::agree_stop).
  if (!impl_->ranks()) impl_->board.stop_early();
}

const Plan& Engine::plan() const {
  return impl_->plan;
}

double Engine::loss_scale() const {
  return impl_->scaler.scale();
}

offload::TransferStats Engine::transfer_stats() const {
  return impl_->parts.transfers->stats();
}

}  // namespace rondo::engine
