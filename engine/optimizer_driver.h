// The optimizer driver: the engine's optimizer thread. Per step it sums the squares of each job's
// gradients as they land, takes the exact global norm once the last are in, decides the next fp16
// loss scale (LossScaler), and runs AdamW (engine/optimizer.h) layer by layer in forward order,
// releasing each layer to the next step's loaders on the board; in one-step-stale mode it first
// publishes the masters to the streaming copies as each layer's uploads of the step complete.
// Talks to the pipeline only through the board (Note [Engine synchronisation] in board.cpp).
//
//   OptimizerDriver driver(parts, board, jobs, plan.forward.size(), optimizer, scaler, steps_done);
//   std::thread t([&] { driver.run(steps); });
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/board.h"
#include "engine/engine_parts.h"
#include "engine/jobs.h"
#include "engine/optimizer.h"
#include "engine/ranks.h"

namespace rondo::engine {

// fp16 dynamic loss scaling (EngineOptions::loss_scaling): an overflowing step halves the scale
// (not below min_scale); growth_interval finite steps in a row double it. Disabled: always 1.
class LossScaler {
 public:
  explicit LossScaler(const LossScaling& options)
      : options_(options), scale_(options.enabled ? options.initial_scale : 1.0) {}
  double scale() const { return scale_; }  // the next step's
  int good_steps() const { return good_steps_; }
  void restore(double scale, int good_steps) {
    scale_ = scale;
    good_steps_ = good_steps;
  }
  // After a step whose gradient norm was finite, or not.
  void after_step(bool finite);

 private:
  LossScaling options_;
  double scale_ = 1;
  int good_steps_ = 0;
};

// Device events (memory, busy share, link traffic) for the event sink, once per step.
class DeviceReports {
 public:
  void emit(EngineParts& parts);

 private:
  double last_t_ = 0;
};

class OptimizerDriver {
 public:
  // `forward_jobs`: the number of forward stages (the jobs before the first with gradients).
  OptimizerDriver(EngineParts& parts, Board& board, const JobList& jobs, int forward_jobs,
                  Optimizer& optimizer, LossScaler& scaler, DeviceReports& reports,
                  std::int64_t steps_done);
  // The thread body: `steps` steps, or fewer on a stop or a failure.
  void run(std::int64_t steps);

 private:
  // One step: its gradients in, norm, scale, update. The step's result.
  StepResult step(std::int64_t s);
  // One-step-stale mode, first half of step s's pass: each layer's master (θ_s) to its streaming
  // copy as soon as step s has finished uploading that layer.
  void publish_stale(std::int64_t s);
  // Data parallel: layers whose gradients are summed across the ranks in one collective
  // (gradient_buckets in ranks.h).
  struct Bucket {
    std::vector<int> layers;  // descending
    int lowest = 0;           // the last to land
  };
  std::unique_ptr<Collective::Pending> start_bucket(Collective& ranks, const Bucket& bucket,
                                                    std::int64_t s);
  // Sharded optimizer state (EngineOptions::data_parallel.optimizer_owners): this rank's layers
  // updated, every layer's new streaming copies broadcast from its owner, each layer handed back
  // to the loaders as its broadcast completes.
  void update_sharded(std::int64_t s);
  // Consecutive layers whose new streaming copies one broadcast carries: one owner (-1: nothing
  // trained, nothing to send), back to back in host memory, kWeightGroupBytes or so; or one layer
  // whose trained copies are on the NVMe tier, sent a weight piece at a time.
  struct WeightGroup {
    int first = 0, end = 0;  // layers [first, end)
    int owner = -1;
    bool pieces = false;
  };

  EngineParts& parts_;
  Board& board_;
  const JobList& jobs_;
  const int forward_jobs_;
  Optimizer& optimizer_;
  LossScaler& scaler_;
  DeviceReports& reports_;
  const std::int64_t steps_done_;
  std::chrono::steady_clock::time_point last_step_end_;
  std::vector<Bucket> buckets_;
  std::vector<WeightGroup> weight_groups_;
};

}  // namespace rondo::engine
