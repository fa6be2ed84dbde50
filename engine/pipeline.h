// The pipeline: per device a loader thread (uploads a job's weights, one job ahead at most, and
// frees the job two behind) and a worker thread (enqueues the job's microbatches on the compute
// stream, hands outputs and checkpoints on, downloads the gradients once per job). Job g of a
// segment (step s = g / J, stage j = g % J) runs on device g % N. Every byte goes through
// offload::Transfers; every hand-over through the board (board.h). Used by engine.cpp, which
// starts the threads for a segment and joins them.
//
//   Pipeline pipeline(parts, board, jobs, total_jobs, steps_done, /*evaluating=*/false);
//   std::thread loader([&] { pipeline.loader(0); }), worker([&] { pipeline.worker(0); });
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/board.h"
#include "engine/engine_parts.h"
#include "engine/jobs.h"

namespace rondo::engine {

class Pipeline {
 public:
  // A segment of `total_jobs` jobs of `jobs`; its first step is step `steps_done` + 1 (or, when
  // `evaluating`, its first batch is batch 1).
  Pipeline(EngineParts& parts, Board& board, const JobList& jobs, std::int64_t total_jobs,
           std::int64_t steps_done, bool evaluating);

  void loader(int d);  // thread bodies: jobs d, d + N, d + 2N, ...
  void worker(int d);
  // After the threads have joined: the device time of the jobs their loaders did not release.
  void account_remaining();
  // "step 4, job B1 (layers 3-5) on sim1", for errors.
  std::string job_where(std::int64_t g) const;

 private:
  // The tensors a job's microbatches share, kept alive by each enqueued microbatch's work.
  struct JobTensors;

  void release(std::int64_t g);
  void account(std::int64_t g, JobRun& r);
  void run_job(int d, std::int64_t g);
  // The step's inputs on dc: uploaded by the first job of the step there (its staging kept alive
  // by `r` until the copy is done).
  std::shared_ptr<DeviceInputs> inputs_on(DeviceContext& dc, StepData& step, JobRun& r);
  at::Tensor receive(DeviceContext& dc, JobRun& r, HandoffKind kind, HandoffKey key);
  void send(DeviceContext& dc, JobRun& r, HandoffKind kind, HandoffKey key,
            kernels::DeviceBuffer dev_buf, std::vector<std::int64_t> sizes, bool keep);
  void prefetch_checkpoints(const JobSpec& js, std::int64_t s, int m);
  std::vector<int> checkpointed_in(LayerRange range) const;

  EngineParts& parts_;
  Board& board_;
  const JobList& jobs_;
  const std::int64_t total_jobs_, steps_done_;
  const bool evaluating_;
};

}  // namespace rondo::engine
