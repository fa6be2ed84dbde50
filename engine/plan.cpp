#include "engine/plan.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "kernels/error.h"

namespace rondo::engine {

const char* to_string(RecomputeGrain grain) {
  return grain == RecomputeGrain::kStage ? "stage" : "layer";
}

std::vector<std::string> Plan::problems(int layers) const {
  std::vector<std::string> out;
  if (microbatches < 1) out.push_back("microbatches must be at least 1");
  if (tail.end != layers)
    out.push_back("the tail must end at the last layer (" + std::to_string(layers) + "), not " +
                  std::to_string(tail.end));
  if (tail.size() < 1) out.push_back("the tail must hold at least one layer");
  int at = 0;
  for (const LayerRange& r : forward) {
    if (r.begin != at || r.size() < 1)
      out.push_back("forward stage [" + std::to_string(r.begin) + "," + std::to_string(r.end) +
                    ") does not continue at layer " + std::to_string(at));
    at = r.end;
  }
  if (at != tail.begin)
    out.push_back("forward stages end at layer " + std::to_string(at) + " but the tail begins at " +
                  std::to_string(tail.begin));
  at = tail.begin;
  for (const LayerRange& r : backward) {
    if (r.end != at || r.size() < 1)
      out.push_back("backward stage [" + std::to_string(r.begin) + "," + std::to_string(r.end) +
                    ") does not continue down from layer " + std::to_string(at));
    at = r.begin;
  }
  if (at != 0) out.push_back("backward stages stop at layer " + std::to_string(at) + ", not 0");
  return out;
}

std::set<int> Plan::checkpointed_layers() const {
  std::set<int> out;
  if (grain == RecomputeGrain::kLayer) {
    for (int l = 1; l < tail.begin; ++l)
      out.insert(l);
  } else {
    for (const LayerRange& r : backward)
      if (std::max(r.begin, 1) < r.end) out.insert(std::max(r.begin, 1));
  }
  return out;
}

std::string Plan::describe() const {
  auto range = [](char kind, const LayerRange& r) {
    return std::string(1, kind) + "[" + std::to_string(r.begin) + "," + std::to_string(r.end) + ")";
  };
  std::string s;
  for (const LayerRange& r : forward)
    s += range('F', r) + " ";
  s += range('T', tail) + " ";
  for (const LayerRange& r : backward)
    s += range('B', r) + " ";
  s += "M=" + std::to_string(microbatches) + " " + to_string(grain);
  if (mlp_tile_tokens > 0) s += " tile=" + std::to_string(mlp_tile_tokens);
  return s;
}

int PlanInputs::resolved_microbatches() const {
  return microbatches > 0 ? microbatches : static_cast<int>(devices.size()) + 1;
}

std::vector<std::string> PlanInputs::problems() const {
  std::vector<std::string> out;
  if (layers.empty()) out.push_back("no layers to plan");
  if (devices.empty()) out.push_back("no devices to plan for");
  if (tokens_per_step <= 0) out.push_back("tokens per step must be positive");
  if (mlp_tile_tokens < -1)
    out.push_back(
        "the sequence tile must be -1 (the planner's choice), 0 (none) or a number of tokens");
  if (microbatches < 0) out.push_back("microbatches must not be negative");
  if (tokens_per_step > 0 && resolved_microbatches() > tokens_per_step)
    out.push_back("more microbatches (" + std::to_string(resolved_microbatches()) +
                  ") than tokens per step (" + std::to_string(tokens_per_step) + ")");
  auto finite_nonneg = [](double x) { return std::isfinite(x) && x >= 0; };
  for (std::size_t i = 0; i < devices.size(); ++i) {
    const DeviceModel& d = devices[i];
    const std::string who = "device " + std::to_string(i);
    if (!(std::isfinite(d.speed) && d.speed > 0)) out.push_back(who + ": speed must be positive");
    if (!finite_nonneg(d.link_bytes_per_s))
      out.push_back(who + ": link bandwidth must be a number >= 0 (0 = free)");
    if (!finite_nonneg(d.link_latency_s)) out.push_back(who + ": link latency must be >= 0");
  }
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (!finite_nonneg(layers[l].forward_s_per_token) ||
        !finite_nonneg(layers[l].backward_s_per_token)) {
      out.push_back("layer " + std::to_string(l) + ": compute times must be numbers >= 0");
      break;
    }
  if (!(upper_threshold >= 1.0)) out.push_back("upper_threshold must be at least 1");
  return out;
}

namespace {

void check(const PlanInputs& in) {
  auto problems = in.problems();
  if (!problems.empty()) throw Error(join_problems("cannot plan:", problems));
}

// --- The schedule simulation -------------------------------------------------------------------

// One direction of a device's link: busy intervals, in time order. Transfers are placed in the
// earliest gap that holds them (activations), or spread over gaps (weights: chunked).
class Channel {
 public:
  Channel(double bytes_per_s, double latency_s) : bw_(bytes_per_s), latency_(latency_s) {}

  // Returns when `bytes` issued no sooner than `earliest` have arrived.
  double send(double earliest, double bytes, bool splittable) {
    double need = bw_ > 0 ? bytes / bw_ : 0;
    if (need <= 0) return earliest + (bytes > 0 ? latency_ : 0);
    double t = earliest;
    std::size_t i = 0;
    while (i < busy_.size() && busy_[i].second <= t)
      ++i;
    for (;;) {
      double gap_end = i < busy_.size() ? busy_[i].first : std::numeric_limits<double>::infinity();
      if (i < busy_.size() && busy_[i].first <= t) {  // inside a busy interval: skip it
        t = busy_[i].second;
        ++i;
        continue;
      }
      double room = gap_end - t;
      if (room >= need) {
        busy_.insert(busy_.begin() + static_cast<std::ptrdiff_t>(i), {t, t + need});
        merge();
        return t + need + latency_;
      }
      if (splittable && room > 1e-12) {
        busy_.insert(busy_.begin() + static_cast<std::ptrdiff_t>(i), {t, gap_end});
        need -= room;
        ++i;
      }
      t = gap_end;
    }
  }

 private:
  void merge() {
    std::vector<std::pair<double, double>> out;
    for (auto& iv : busy_) {
      if (!out.empty() && iv.first <= out.back().second + 1e-15)
        out.back().second = std::max(out.back().second, iv.second);
      else
        out.push_back(iv);
    }
    busy_.swap(out);
  }
  double bw_, latency_;
  std::vector<std::pair<double, double>> busy_;
};

enum class JobKind { kForward, kTail, kBackward };

struct Job {
  JobKind kind;
  LayerRange range;
  int index;  // position in its list (forward stage s, backward stage g; tail 0)
};

std::vector<Job> jobs_of(const Plan& plan) {
  std::vector<Job> jobs;
  for (std::size_t s = 0; s < plan.forward.size(); ++s)
    jobs.push_back({JobKind::kForward, plan.forward[s], static_cast<int>(s)});
  jobs.push_back({JobKind::kTail, plan.tail, 0});
  for (std::size_t g = 0; g < plan.backward.size(); ++g)
    jobs.push_back({JobKind::kBackward, plan.backward[g], static_cast<int>(g) + 1});
  return jobs;
}

struct RangeSums {
  double forward_s = 0, backward_s = 0;  // per token
  double tiled_extra_s = 0;              // per token (LayerCosts::tiled_recompute_s_per_token)
  double params = 0, grads = 0;
  double device_params = 0;  // the weights as they sit on the device (dequantised)
  double nvme = 0, nvme_update = 0;
  double activation_sum = 0, activation_max = 0;  // per token
  double tileable_max = 0;                        // per token, what one tile holds per token
  double backward_max = 0;                        // per token, one layer's backward at a time
  double forward_max = 0;                         // per token, one layer's forward at a time
  double transient_max = 0;                       // one layer's backward at a time
};

// `tiled`: the activations sequence tiling keeps (what it bounds to one tile is tileable_max).
RangeSums sums(const PlanInputs& in, LayerRange r, bool tiled = false) {
  RangeSums s;
  for (int l = r.begin; l < r.end; ++l) {
    const LayerCosts& c = in.layers[l];
    s.forward_s += c.forward_s_per_token;
    s.backward_s += c.backward_s_per_token;
    s.tiled_extra_s += c.tiled_recompute_s_per_token;
    s.params += static_cast<double>(c.param_bytes);
    s.grads += static_cast<double>(c.grad_bytes);
    // A quantised layer holds its dequantised weights and, while they land, the quantised ones.
    s.device_params += static_cast<double>(
        c.device_param_bytes ? c.device_param_bytes + c.param_bytes : c.param_bytes);
    s.nvme += static_cast<double>(c.nvme_read_bytes);
    s.nvme_update += static_cast<double>(c.nvme_update_bytes);
    const double act = static_cast<double>(tiled && c.tiled_activation_bytes_per_token > 0
                                               ? c.tiled_activation_bytes_per_token
                                               : c.activation_bytes_per_token);
    s.activation_sum += act;
    s.activation_max = std::max(s.activation_max, act);
    s.tileable_max = std::max(s.tileable_max, static_cast<double>(c.tileable_bytes_per_token));
    s.backward_max = std::max(
        s.backward_max,
        static_cast<double>(tiled ? c.backward_tiled_bytes_per_token : c.backward_bytes_per_token));
    s.transient_max = std::max(s.transient_max, static_cast<double>(c.transient_bytes));
    s.forward_max = std::max(s.forward_max, static_cast<double>(c.forward_bytes_per_token));
  }
  return s;
}

// Bytes of the input of layer l (the output of l - 1) per token; the prefix takes token ids.
double input_bytes(const PlanInputs& in, int l) {
  return l > 0 ? static_cast<double>(in.layers[l - 1].output_bytes_per_token) : 8.0;
}

// The buffers a job's microbatches receive and hand on, per token: its input (token ids for the
// prefix) and its output, or in a backward job the gradient it receives, the checkpoint of its
// first layer and the gradient it hands on; and the activation checkpoints of its other layers
// (Plan::checkpointed_layers; while packing, before there is a plan, as if every layer of a job
// were one in layer grain and its first in stage grain), which a forward job writes and a
// backward job receives. Every microbatch's stay on the device until the job is released (Note
// [Engine synchronisation] in board.cpp), so a job holds these for all of its step's tokens.
double io_bytes(const PlanInputs& in, const Job& job, RecomputeGrain grain,
                const std::set<int>* checkpointed) {
  const double input = input_bytes(in, job.range.begin),
               output = static_cast<double>(in.layers[job.range.end - 1].output_bytes_per_token);
  double io = 0;
  switch (job.kind) {
    case JobKind::kForward:
      io = input + output;
      break;
    case JobKind::kTail:  // its input, and that input's gradient
      return 2 * input;
    case JobKind::kBackward:
      io = output + 2 * input;
      break;
  }
  for (int l = std::max(job.range.begin, 1); l < job.range.end; ++l) {
    const bool saved = checkpointed ? checkpointed->count(l) > 0
                                    : grain == RecomputeGrain::kLayer || l == job.range.begin;
    if (saved && (job.kind == JobKind::kForward || l > job.range.begin)) io += input_bytes(in, l);
  }
  return io;
}

// Device memory while `job` runs: its weights, its gradients, one microbatch's activations, its
// microbatches' input, output and checkpoint buffers (io_bytes), and what one layer's backward
// holds at a time (the head's chunk of logits, or a block's gradients of its activations); a
// forward job, one layer's work at a time, whose peak may be a norm's fp32 scratch. Tiled
// (tile > 0), the projections' and MLPs' intermediates are one tile's: in the forward, and in the
// backward with their gradients beside them. (What the device holds of its neighbouring jobs
// meanwhile: neighbour_memory.)
double job_memory(const PlanInputs& in, const Job& job, double tokens_mb, RecomputeGrain grain,
                  std::int64_t tile, const std::set<int>* checkpointed = nullptr) {
  RangeSums s = sums(in, job.range, tile > 0);
  double act = 0;
  switch (job.kind) {
    case JobKind::kForward:
      // No autograd in forward stages: one layer's transients at a time.
      act = tile > 0 ? s.activation_max : std::max(s.activation_max, s.forward_max);
      break;
    case JobKind::kTail:
      act = s.activation_sum;  // fused: the whole tail's graph is kept
      break;
    case JobKind::kBackward:
      act = grain == RecomputeGrain::kStage ? s.activation_sum : s.activation_max;
      break;
  }
  double grads = job.kind == JobKind::kForward ? 0 : s.grads;
  double transient =
      job.kind == JobKind::kForward ? 0 : std::max(s.transient_max, tokens_mb * s.backward_max);
  if (tile > 0)
    transient = std::max(transient, std::min(static_cast<double>(tile), tokens_mb) *
                                        s.tileable_max * (job.kind == JobKind::kForward ? 1 : 1.5));
  const double inputs = 2.0 * static_cast<double>(in.tokens_per_step) *
                            static_cast<double>(in.input_bytes_per_token) +
                        tokens_mb * static_cast<double>(in.mask_bytes_per_token);
  return s.device_params + grads + transient + inputs + tokens_mb * act +
         static_cast<double>(in.tokens_per_step) * io_bytes(in, job, grain, checkpointed);
}

// What a job holds on its device before its compute or after it: its weights and gradients.
double held_between_jobs(const PlanInputs& in, const Job& job) {
  const RangeSums s = sums(in, job.range);
  return s.device_params + (job.kind == JobKind::kForward ? 0 : s.grads);
}

// What the device holds of its other jobs while `job` computes (Note [Engine synchronisation] in
// board.cpp): the previous job's weights, gradients and buffers (io_bytes) until its downloads
// (and NVMe writes) are done and its loader has let them go, or the next job's, prefetched, with
// the buffers its worker sets up meanwhile (the worker enqueues a job's microbatches without
// waiting for their compute, and goes on to the next job as soon as its weights are loaded). On
// one device a job's output is the next one's input, handed over on the device: counted once,
// with the job that receives it.
double neighbour_memory(const PlanInputs& in, const Job& prev, const Job& next,
                        RecomputeGrain grain, const std::set<int>* checkpointed) {
  const bool one_device = in.devices.size() == 1;
  auto handed_on = [&](const Job& j) {  // the job's output (a backward job's: its input gradient)
    return j.kind == JobKind::kForward
               ? static_cast<double>(in.layers[j.range.end - 1].output_bytes_per_token)
               : input_bytes(in, j.range.begin);
  };
  auto received = [&](const Job& j) {  // its input (a backward job's: its output's gradient)
    return j.kind == JobKind::kBackward
               ? static_cast<double>(in.layers[j.range.end - 1].output_bytes_per_token)
               : input_bytes(in, j.range.begin);
  };
  const auto tokens = static_cast<double>(in.tokens_per_step);
  const double before =
      io_bytes(in, prev, grain, checkpointed) - (one_device ? handed_on(prev) : 0);
  const double after = io_bytes(in, next, grain, checkpointed) - (one_device ? received(next) : 0);
  return std::max(held_between_jobs(in, prev) + tokens * before,
                  held_between_jobs(in, next) + tokens * after);
}

// Tiled, a job with a backward runs part of its blocks' forward once more: what the tiles'
// backward needs the values of (LayerCosts::tiled_recompute_s_per_token; Note [Sequence tiling of
// the attention half] in models/layers.cpp: recomputed tile by tile instead of kept).
double job_compute(const PlanInputs& in, const Job& job, double tokens_mb, bool tiled) {
  RangeSums s = sums(in, job.range);
  if (job.kind == JobKind::kForward) return tokens_mb * s.forward_s;
  return tokens_mb * (s.forward_s + s.backward_s + (tiled ? s.tiled_extra_s : 0));
}

}  // namespace

PlanPrediction predict(const Plan& plan, const PlanInputs& in) {
  check(in);
  auto problems = plan.problems(static_cast<int>(in.layers.size()));
  if (!problems.empty()) throw InternalError("predict() of an invalid plan: " + problems.front());
  const int N = static_cast<int>(in.devices.size());
  const int M = plan.microbatches;
  const double tokens_mb = static_cast<double>(in.tokens_per_step) / M;
  const std::vector<Job> jobs = jobs_of(plan);
  const int J = static_cast<int>(jobs.size());
  // Steps 1-2 fill the pipeline, step 3 is measured, step 4 overlaps its end (no barrier between
  // steps), so that the measured window sees the work a real run would do in it.
  constexpr int kSteps = 4;

  std::vector<Channel> up, down;
  for (const DeviceModel& d : in.devices) {
    up.emplace_back(d.link_bytes_per_s, d.link_latency_s);
    down.emplace_back(d.link_bytes_per_s, d.link_latency_s);
  }
  // The NVMe tier: one drive for every device's reads and the optimizer's read-modify-writes.
  Channel nvme(in.nvme_bytes_per_s, 0);
  PlanPrediction p;
  constexpr int kCounted = 2;                    // the step whose bytes are reported
  std::vector<double> device_free(N, 0.0);       // last compute end
  double cores_free = 0;                         // PlanInputs::shared_compute: last compute end
  std::vector<double> device_job_start(N, 0.0);  // compute start of its current job
  std::vector<std::vector<std::pair<double, double>>> busy(N);
  // Per microbatch: when the previous job's output (or input gradient) is on the host, and on
  // which device it was produced (it stays there for a job on the same device).
  std::vector<double> handoff_host(M, 0.0), handoff_device_time(M, 0.0);
  int handoff_device = -1;
  // Per step and layer: when its gradients are on the host. A job uploading a layer's weights
  // waits for the update from the previous step's gradients (exact synchronous training), or
  // from the step before that (one-step-stale mode).
  std::vector<std::vector<double>> grads_home(kSteps, std::vector<double>(in.layers.size(), 0.0));
  // Per step and layer: when the optimizer has updated it. It starts once every gradient of the
  // step is in (the global norm) and its previous step is done, then goes layer by layer in
  // forward order. Asked for only once the step's jobs are all simulated.
  std::vector<std::vector<double>> updates(kSteps);
  double optimizer_free = 0;
  auto updated = [&](int s) -> const std::vector<double>& {
    std::vector<double>& u = updates[static_cast<std::size_t>(s)];
    if (!u.empty()) return u;
    double t = optimizer_free;
    for (std::size_t l = 0; l < in.layers.size(); ++l)
      if (in.layers[l].grad_bytes > 0) t = std::max(t, grads_home[s][l]);
    // On the devices' own cores (the CPU, simulated GPUs) it takes its turn with their compute.
    if (in.shared_compute) t = std::max(t, cores_free);
    u.assign(in.layers.size(), t);
    for (std::size_t l = 0; l < in.layers.size(); ++l) {
      t += static_cast<double>(in.layers[l].grad_bytes) * in.optimizer_s_per_grad_byte;
      u[l] = t;
    }
    optimizer_free = t;
    if (in.shared_compute) cores_free = std::max(cores_free, t);
    return u;
  };
  const int lag = in.one_step_stale ? 2 : 1;
  std::vector<double> step_end(kSteps, 0.0);
  // Which layers' inputs the backward needs saved, and per (layer, microbatch) when that saved
  // input is on the host.
  // (Layer 0's input is the step's tokens, already on every device that runs a job of the step.)
  std::vector<bool> saved_for_backward(in.layers.size(), false);
  const std::set<int> checkpointed = plan.checkpointed_layers();
  for (int l : checkpointed)
    saved_for_backward[static_cast<std::size_t>(l)] = true;
  std::vector<std::vector<double>> checkpoint_home(in.layers.size(), std::vector<double>(M, 0.0));
  std::vector<double> peak(N, 0.0);

  int step = 0;
  auto send_up = [&](int d, double earliest, double bytes, bool split) {
    if (step == kCounted) p.bytes_up += bytes;
    return up[d].send(earliest, bytes, split);
  };
  auto send_down = [&](int d, double earliest, double bytes, bool split) {
    if (step == kCounted) p.bytes_down += bytes;
    return down[d].send(earliest, bytes, split);
  };
  long long pointer = 0;  // the global round-robin pointer
  for (step = 0; step < kSteps; ++step) {
    for (int j = 0; j < J; ++j) {
      const Job& job = jobs[j];
      const int d = static_cast<int>(pointer++ % N);
      RangeSums s = sums(in, job.range);
      // Weights: prefetched once the device's current job has started, after the optimizer has
      // updated them.
      double weights_earliest = device_job_start[d];
      if (step >= lag) {
        const std::vector<double>& up_to_date = updated(step - lag);
        for (int l = job.range.begin; l < job.range.end; ++l)
          if (in.layers[l].grad_bytes > 0)
            weights_earliest = std::max(weights_earliest, up_to_date[l]);
      }
      double weights_ready = up[d].send(weights_earliest, s.params, /*splittable=*/true);
      // Layers on NVMe are read into host memory first; reads and uploads overlap (layer by
      // layer), so the later of the two decides.
      if (s.nvme > 0)
        weights_ready = std::max(weights_ready, nvme.send(weights_earliest, s.nvme, true));
      if (step == kCounted) {
        p.bytes_up += s.params;
        p.bytes_weights_up += s.params;
        p.bytes_nvme_read += s.nvme;
      }
      const double compute_mb =
          job_compute(in, job, tokens_mb, plan.mlp_tile_tokens > 0) / in.devices[d].speed;
      const bool first_job = (j == 0);
      double t = device_free[d];
      double job_start = -1;
      for (int m = 0; m < M; ++m) {
        // When this job's input is on the host: the tokens (prepared while the device's previous
        // job ran), or the previous job's output once downloaded; -1 when it stayed on this device.
        double input_on_host = -1;
        double input_ready;
        if (first_job) {
          input_on_host = device_job_start[d];
          input_ready = send_up(d, input_on_host, tokens_mb * input_bytes(in, 0), false);
        } else if (handoff_device == d) {
          input_ready = handoff_device_time[m];  // stayed on the device
        } else {
          input_on_host = handoff_host[m];
          double bytes =
              tokens_mb *
              (job.kind == JobKind::kForward || job.kind == JobKind::kTail
                   ? input_bytes(in, job.range.begin)
                   : static_cast<double>(in.layers[job.range.end - 1].output_bytes_per_token));
          input_ready = send_up(d, input_on_host, bytes, false);
        }
        if (job.kind == JobKind::kBackward) {
          // The saved inputs (checkpoints) come back, each once it has reached the host.
          for (int l = job.range.begin; l < job.range.end; ++l) {
            if (!saved_for_backward[static_cast<std::size_t>(l)]) continue;
            const double bytes = tokens_mb * input_bytes(in, l);
            double home = checkpoint_home[l][m];
            if (in.checkpoints_on_nvme) {
              home = nvme.send(std::max(home, device_job_start[d]), bytes, false);
              if (step == kCounted) p.bytes_nvme_read += bytes;
            }
            input_ready = std::max(input_ready, send_up(d, home, bytes, false));
          }
        }
        double start = std::max({t, weights_ready, input_ready});
        if (in.shared_compute) start = std::max(start, cores_free);
        if (job_start < 0) job_start = start;
        double end = start + compute_mb;
        if (in.shared_compute) cores_free = end;
        busy[d].push_back({start, end});
        t = end;
        handoff_device_time[m] = end;
        if (job.kind == JobKind::kForward) {
          // Checkpoints for the backward: each backward stage's input (stage grain) or every
          // layer's input (layer grain). This stage's own input is on the host already unless it
          // stayed on the device; inner layers' inputs go down as they are computed.
          for (int l = job.range.begin; l < job.range.end; ++l) {
            if (!saved_for_backward[l]) continue;
            const double bytes = tokens_mb * input_bytes(in, l);
            if (l == job.range.begin && input_on_host >= 0)
              checkpoint_home[l][m] = input_on_host;
            else
              checkpoint_home[l][m] =
                  send_down(d, l == job.range.begin ? start : end, bytes, false);
            if (in.checkpoints_on_nvme) {
              checkpoint_home[l][m] = nvme.send(checkpoint_home[l][m], bytes, false);
              if (step == kCounted) p.bytes_nvme_write += bytes;
            }
          }
        }
        // Output (forward) or input gradient (tail, backward) goes down for the next job,
        // unless that job is on this device; the last backward stage has no successor.
        const bool last_of_step = (j == J - 1);
        const int next_device = static_cast<int>(pointer % N);
        if (!last_of_step && next_device != d) {
          double bytes =
              tokens_mb *
              (job.kind == JobKind::kForward
                   ? static_cast<double>(in.layers[job.range.end - 1].output_bytes_per_token)
                   : input_bytes(in, job.range.begin));
          handoff_host[m] = send_down(d, end, bytes, false);
        } else {
          handoff_host[m] = end;
        }
      }
      handoff_device = d;
      device_job_start[d] = job_start;
      device_free[d] = t;
      if (job.kind != JobKind::kForward && s.grads > 0) {
        double home = send_down(d, t, s.grads, true);
        // Masters and moments on NVMe: read, updated, written back before the new weights exist.
        if (s.nvme_update > 0) {
          home = nvme.send(home, 2 * s.nvme_update, true);
          if (step == kCounted) {
            p.bytes_nvme_read += s.nvme_update;
            p.bytes_nvme_write += s.nvme_update;
          }
        }
        for (int l = job.range.begin; l < job.range.end; ++l)
          grads_home[step][l] = home;
        step_end[step] = std::max(step_end[step], home);
      }
      step_end[step] = std::max(step_end[step], t);
      const double neighbour = neighbour_memory(in, jobs[(j + J - N % J) % J], jobs[(j + N) % J],
                                                plan.grain, &checkpointed);
      peak[d] = std::max(
          peak[d], job_memory(in, job, tokens_mb, plan.grain, plan.mlp_tile_tokens, &checkpointed) +
                       neighbour);
    }
  }
  const double window_start = step_end[1], window_end = step_end[2];
  p.step_time_s = window_end - window_start;
  double busy_in_window = 0;
  for (int d = 0; d < N; ++d)
    for (auto [a, b] : busy[d])
      busy_in_window += std::max(0.0, std::min(b, window_end) - std::max(a, window_start));
  p.idle_fraction = p.step_time_s > 0 ? 1.0 - busy_in_window / (N * p.step_time_s) : 0.0;
  p.peak_bytes.resize(N);
  for (int d = 0; d < N; ++d) {
    p.peak_bytes[d] = static_cast<std::uint64_t>(peak[d]);
    std::uint64_t cap = in.devices[d].memory_cap;
    if (cap != 0 && p.peak_bytes[d] > cap && p.fits) {
      p.fits = false;
      p.why_not = "device " + std::to_string(d) + " needs " + format_bytes(p.peak_bytes[d]) +
                  " of its " + format_bytes(cap);
    }
  }
  return p;
}

namespace {

// --- Packing -----------------------------------------------------------------------------------

struct Packer {
  const PlanInputs& in;
  int M;
  double tokens_mb;
  RecomputeGrain grain;
  // Cost of a job over a range, in the planner's time unit; and whether it fits the memory rule.
  std::function<double(JobKind, LayerRange)> cost;
  std::function<bool(JobKind, LayerRange)> fits;
  std::int64_t tile = 0;  // Plan::mlp_tile_tokens of the plans it packs

  // RoundPipe's packing for budget T: tail from the top, forward from below the tail downward
  // (reversed), backward from layer 0 up (then descending). Empty optional if a single layer
  // cannot fit. `tail_begin` >= 0 fixes the tail to [tail_begin, L) whatever its cost (a longer
  // tail recomputes less).
  std::optional<Plan> pack(double T, int tail_begin = -1) const {
    const int L = static_cast<int>(in.layers.size());
    Plan plan;
    plan.microbatches = M;
    plan.grain = grain;
    plan.mlp_tile_tokens = tile;
    int k = L - 1;
    if (tail_begin >= 0)
      k = tail_begin;
    else
      while (k > 0 && cost(JobKind::kTail, {k - 1, L}) <= T && fits(JobKind::kTail, {k - 1, L}))
        --k;
    if (!fits(JobKind::kTail, {k, L})) return std::nullopt;
    plan.tail = {k, L};
    int end = k;
    while (end > 0) {
      int begin = end - 1;
      if (!fits(JobKind::kForward, {begin, end})) return std::nullopt;
      while (begin > 0 && cost(JobKind::kForward, {begin - 1, end}) <= T &&
             fits(JobKind::kForward, {begin - 1, end}))
        --begin;
      plan.forward.push_back({begin, end});
      end = begin;
    }
    std::reverse(plan.forward.begin(), plan.forward.end());
    std::vector<LayerRange> up;
    int begin = 0;
    while (begin < k) {
      int e = begin + 1;
      if (!fits(JobKind::kBackward, {begin, e})) return std::nullopt;
      while (e < k && cost(JobKind::kBackward, {begin, e + 1}) <= T &&
             fits(JobKind::kBackward, {begin, e + 1}))
        ++e;
      up.push_back({begin, e});
      begin = e;
    }
    plan.backward.assign(up.rbegin(), up.rend());
    return plan;
  }

  // Candidate budgets: sums of contiguous ranges' costs within [W, threshold * W].
  std::vector<double> candidates(double W) const {
    const int L = static_cast<int>(in.layers.size());
    std::vector<double> out;
    for (JobKind kind : {JobKind::kForward, JobKind::kBackward})
      for (int b = 0; b < L; ++b)
        for (int e = b + 1; e <= L; ++e) {
          double c = cost(kind, {b, e});
          if (c > in.upper_threshold * W * (1 + 1e-12)) break;  // costs grow with the range
          if (c >= W * (1 - 1e-12)) out.push_back(c);
        }
    out.push_back(W);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    // Many cuts give the same plan; a few hundred budgets cover the range finely enough.
    if (out.size() > 256) {
      std::vector<double> thin;
      for (std::size_t i = 0; i < 256; ++i)
        thin.push_back(out[i * out.size() / 256]);
      thin.push_back(out.back());
      out.swap(thin);
    }
    return out;
  }

  double heaviest() const {
    double W = 0;
    for (int l = 0; l < static_cast<int>(in.layers.size()); ++l)
      W = std::max({W, cost(JobKind::kForward, {l, l + 1}), cost(JobKind::kBackward, {l, l + 1})});
    return W;
  }
};

std::uint64_t smallest_cap(const PlanInputs& in) {
  std::uint64_t cap = 0;
  for (const DeviceModel& d : in.devices)
    if (d.memory_cap != 0) cap = cap == 0 ? d.memory_cap : std::min(cap, d.memory_cap);
  return cap;
}

Packer reference_packer(const PlanInputs& in) {
  Packer p{in,
           in.resolved_microbatches(),
           static_cast<double>(in.tokens_per_step) / in.resolved_microbatches(),
           in.grain,
           {},
           {}};
  // Compute only, by layer: forward = recompute time, backward = recompute + backward.
  p.cost = [&in](JobKind kind, LayerRange r) {
    RangeSums s = sums(in, r);
    return kind == JobKind::kForward ? s.forward_s : s.forward_s + s.backward_s;
  };
  // Stages hold at most half the memory (the other half is the prefetched stage); weights and
  // gradients only.
  double half = smallest_cap(in) / 2.0;
  double largest = 0;
  for (int l = 0; l < static_cast<int>(in.layers.size()); ++l) {
    const RangeSums one = sums(in, {l, l + 1});  // what fits() weighs: a quantised layer twice
    largest = std::max(largest, one.device_params + one.grads);
  }
  if (half > 0 && largest > half) half = largest;  // the reference raises its limit (and warns)
  p.fits = [&in, half](JobKind kind, LayerRange r) {
    if (half <= 0) return true;
    RangeSums s = sums(in, r);
    return (kind == JobKind::kForward ? s.device_params : s.device_params + s.grads) <= half;
  };
  return p;
}

}  // namespace

Plan plan_reference(const PlanInputs& in) {
  check(in);
  Packer packer = reference_packer(in);
  const int min_stages = in.min_stages > 0 ? in.min_stages : static_cast<int>(in.devices.size());
  double W = packer.heaviest();
  std::optional<Plan> best;
  double best_cost = std::numeric_limits<double>::infinity();
  for (double T : packer.candidates(W)) {
    std::optional<Plan> plan = packer.pack(T);
    if (!plan) continue;
    double cost = std::max<double>(plan->jobs(), min_stages) * T;
    if (cost < best_cost) {
      best_cost = cost;
      best = plan;
    }
  }
  RONDO_ASSERT_MSG(best.has_value(), "the reference packing found no plan");
  return *best;
}

Plan plan_ours(const PlanInputs& in) {
  check(in);
  // Try the settings as given (a tile of the MLPs, or none); if nothing fits, say which changes
  // would.
  auto attempt_tile = [&](const PlanInputs& inputs,
                          std::int64_t tile) -> std::optional<std::pair<Plan, PlanPrediction>> {
    const int M = inputs.resolved_microbatches();
    const double tokens_mb = static_cast<double>(inputs.tokens_per_step) / M;
    double bw = std::numeric_limits<double>::infinity();
    for (const DeviceModel& d : inputs.devices)
      if (d.link_bytes_per_s > 0) bw = std::min(bw, d.link_bytes_per_s);
    Packer p{inputs, M, tokens_mb, inputs.grain, {}, {}, tile};
    // A job's time: compute over all microbatches, or the bytes it must move, whichever is longer.
    p.cost = [&inputs, M, tokens_mb, bw, tile](JobKind kind, LayerRange r) {
      RangeSums s = sums(inputs, r);
      double compute = M * job_compute(inputs, {kind, r, 0}, tokens_mb, tile > 0);
      double bytes = s.params + (kind == JobKind::kForward ? 0 : s.grads) +
                     M * tokens_mb *
                         (input_bytes(inputs, r.begin) +
                          static_cast<double>(inputs.layers[r.end - 1].output_bytes_per_token));
      // The NVMe tier is shared: with every device loading, each gets a share of it.
      const double nvme =
          inputs.nvme_bytes_per_s > 0
              ? s.nvme * static_cast<double>(inputs.devices.size()) / inputs.nvme_bytes_per_s
              : 0.0;
      return std::max({compute, std::isinf(bw) ? 0.0 : bytes / bw, nvme});
    };
    const double cap = static_cast<double>(smallest_cap(inputs));
    p.fits = [&inputs, tokens_mb, cap, tile](JobKind kind, LayerRange r) {
      if (cap <= 0) return true;
      // Twice the weights and buffers: this stage and the prefetched one (assume a stage of the
      // same size).
      Job job{kind, r, 0};
      return job_memory(inputs, job, tokens_mb, inputs.grain, tile) +
                 neighbour_memory(inputs, job, job, inputs.grain, nullptr) <=
             cap;
    };
    std::vector<Plan> candidates;
    double W = p.heaviest();
    const std::vector<double> budgets = p.candidates(W);
    for (double T : budgets)
      if (auto plan = p.pack(T)) candidates.push_back(*plan);
    // RoundPipe balances jobs of about one layer's cost, so its tail is short and every layer
    // below it is computed twice (forward stage, then recompute). On one device, with memory to
    // spare, a longer tail recomputes less, down to none at all when the whole model's graph fits
    // (what a single GPU that holds the model should do): every tail that fits, with the rest
    // packed at a few budgets; predict() chooses. Not on several devices: there a long tail
    // leaves the others idle, its predicted advantage is small and swings with the measured
    // speed, and a plan must not change between a run and its resume on the same machine.
    const int L = static_cast<int>(inputs.layers.size());
    for (int k = 0; inputs.devices.size() == 1 && k + 1 < L; ++k) {
      if (!p.fits(JobKind::kTail, {k, L})) continue;
      const std::size_t n = std::min<std::size_t>(budgets.size(), 4);
      for (std::size_t i = 0; i < n; ++i) {
        const double T = budgets[n > 1 ? i * (budgets.size() - 1) / (n - 1) : 0];
        if (auto plan = p.pack(T, k)) candidates.push_back(*plan);
        if (k == 0) break;  // the whole model in the tail: no other stages to pack
      }
    }
    Plan reference = plan_reference(inputs);
    reference.mlp_tile_tokens = tile;
    candidates.push_back(reference);
    std::optional<std::pair<Plan, PlanPrediction>> best;
    for (const Plan& plan : candidates) {
      PlanPrediction pred = predict(plan, inputs);
      if (!pred.fits) continue;
      if (!best || pred.step_time_s < best->second.step_time_s - 1e-15) best = {{plan, pred}};
    }
    // None fits: single-layer jobs, the least device memory a plan takes. The budgets above start
    // at the heaviest layer's cost, which where one layer (a large vocabulary's head on a slow
    // CPU) outweighs many packs several blocks into a job, whose neighbours then pass the cap.
    // Only then: they save the most checkpoints, which host memory holds.
    if (!best)
      if (std::optional<Plan> plan = p.pack(0.0)) {
        PlanPrediction pred = predict(*plan, inputs);
        if (pred.fits) best = {{*plan, pred}};
      }
    return best;
  };
  // The planner's tile: none when a plan fits so (tiling recomputes part of each block's forward
  // in the backward), else the largest that fits, shorter than a microbatch.
  auto attempt = [&](const PlanInputs& inputs) -> std::optional<std::pair<Plan, PlanPrediction>> {
    if (inputs.mlp_tile_tokens >= 0) return attempt_tile(inputs, inputs.mlp_tile_tokens);
    if (auto best = attempt_tile(inputs, 0)) return best;
    const bool tileable =
        std::any_of(inputs.layers.begin(), inputs.layers.end(),
                    [](const LayerCosts& c) { return c.tileable_bytes_per_token > 0; });
    const double tokens_mb =
        static_cast<double>(inputs.tokens_per_step) / inputs.resolved_microbatches();
    for (std::int64_t tile : kMlpTiles)
      if (tileable && static_cast<double>(tile) < tokens_mb)
        if (auto best = attempt_tile(inputs, tile)) return best;
    return std::nullopt;
  };
  if (auto best = attempt(in)) return best->first;

  // Nothing fits: find the smallest changes that would.
  std::vector<std::string> would_fit;
  const int M = in.resolved_microbatches();
  for (int more : {2, 4, 8, 16}) {
    PlanInputs alt = in;
    alt.microbatches = M * more;
    if (alt.microbatches <= alt.tokens_per_step && attempt(alt)) {
      would_fit.push_back("more microbatches (" + std::to_string(alt.microbatches) + ")");
      break;
    }
  }
  if (in.grain == RecomputeGrain::kStage) {
    PlanInputs alt = in;
    alt.grain = RecomputeGrain::kLayer;
    if (attempt(alt)) would_fit.push_back("layer-grain recompute");
  }
  for (int shorter : {2, 4, 8}) {
    PlanInputs alt = in;
    alt.tokens_per_step = in.tokens_per_step / shorter;
    if (alt.tokens_per_step >= alt.resolved_microbatches() && attempt(alt)) {
      would_fit.push_back("shorter sequences or a smaller batch (" +
                          std::to_string(alt.tokens_per_step) + " tokens per step)");
      break;
    }
  }
  std::string text = "no plan fits in " + format_bytes(smallest_cap(in)) +
                     " of device memory with " + std::to_string(M) + " microbatches of " +
                     std::to_string(in.tokens_per_step / M) + " tokens and " + to_string(in.grain) +
                     "-grain recompute";
  if (would_fit.empty())
    text += "; even single-layer stages do not fit: use a larger device memory cap";
  else {
    text += "; these would fit: ";
    for (std::size_t i = 0; i < would_fit.size(); ++i)
      text += (i ? ", or " : "") + would_fit[i];
  }
  throw Error(text);
}

}  // namespace rondo::engine
