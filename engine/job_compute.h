// One microbatch of one job on a device, as torch math: the forward of a stage, the fused tail
// (blocks, LM head and cross-entropy, backward), a backward stage from its checkpoints, or an
// evaluation's loss; and a job's gradient accumulators. Runs in compute-stream order (inside
// Stream::enqueue work); takes no lock and touches no shared state but the StepData counters it
// is given. The pipeline (pipeline.cpp) sets up the tensors and calls it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/board.h"
#include "engine/engine_parts.h"
#include "engine/jobs.h"
#include "engine/step_inputs.h"

namespace rondo::engine {

// A job's weight gradients on its device: per layer with trained tensors, a buffer in the store's
// gradient layout (what goes down to the store; the store's own region on the CPU device), and
// the f32 accumulators the microbatches write or add into (the same memory when the gradient
// dtype is f32).
struct JobGradients {
  std::map<int, std::vector<at::Tensor>> acc;  // per layer, per tensor: f32 (undefined: frozen)
  std::map<int, std::vector<at::Tensor>> out;  // the same in the store's dtype (the download's)
  std::vector<std::pair<int, void*>> layers;   // layer, its gradient in the store's layout
  // Layers whose gradients the store keeps on NVMe: the device buffer, held until the gradient
  // writer has brought it down (offload::Transfers::download_gradients' `keep`).
  std::map<int, std::shared_ptr<kernels::DeviceBuffer>> keep;
  bool convert = false;  // acc and out differ (gradients not f32)
  std::vector<int> layer_ids() const;
};

// Sets up the gradients of `range`'s trained layers on device `dc`: device buffers (appended to
// `buffers`, which must outlive the job's work; those of NVMe-resident gradients in `keep`) or,
// where the device computes in host memory and EngineParts::shares_trained(), the store's own
// gradient regions (in host memory). Accumulators that the first
// microbatch does not overwrite (the embedding's) are zero-filled on the compute stream.
JobGradients job_gradients(const EngineParts& parts, DeviceContext& dc, LayerRange range,
                           std::vector<kernels::DeviceBuffer>& buffers);
// After the last microbatch: the f32 accumulators rounded into the store-dtype buffers.
void round_gradients(JobGradients& grads);

// What one microbatch of a job computes with (device tensors, in compute-stream order).
struct MicrobatchWork {
  const JobSpec* job = nullptr;
  const StepData* step = nullptr;
  const MicrobatchInputs* inputs = nullptr;
  int m = 0;       // the microbatch
  at::Tensor in;   // the previous job's output (undefined where the job embeds tokens)
  at::Tensor out;  // this job's output (undefined when it has none)
  std::map<int, at::Tensor> saved;  // backward: checkpointed block inputs, by layer
  std::map<int, at::Tensor> ckpt;   // forward: where the checkpointed block inputs go, by layer
  const std::map<int, std::vector<at::Tensor>>* weights = nullptr;  // by layer, spec order
  const std::map<int, std::vector<at::Tensor>>* grads = nullptr;    // JobGradients::acc, or null
  // Tail and evaluation: the step's values on the device (StepData::loss: the loss sum and the
  // preference metrics' sums, added to; an evaluation's sequences' log-probabilities, written).
  float* loss_dev = nullptr;
  // Tail and backward: the fp16 scale over what the step's loss is a mean over (its target tokens,
  // or its microbatches: StepData::loss_denominator).
  double loss_scale = 1;
  bool evaluating = false;  // no dropout, no routing records
};

// Runs one microbatch of a job on `device` (the torch device of the compute stream it runs on).
void compute_microbatch(const EngineParts& parts, c10::Device device, const MicrobatchWork& work);

}  // namespace rondo::engine
