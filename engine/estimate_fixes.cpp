// What would make a run fit, each change proven by planning the run with it (RunEstimate::fixes):
// the answer behind `rondo plan`'s "To fit" lines and the GUI review's button that applies one.
#include <fmt/format.h>

#include <functional>

#include "engine/estimate.h"

namespace rondo::engine {

void find_fixes(RunEstimate& e, const TrainConfig& config, const models::ModelSummary& model,
                const DevicePlan& devices, std::int64_t steps, std::uint64_t host_free,
                std::uint64_t disk_free, const std::optional<ResumePoint>& resume,
                const std::string& offload_dir, std::size_t most) {
  e.fixes.clear();
  if (e.verdict != "does not fit") return;
  struct Candidate {
    Fix fix;
    std::function<void(TrainConfig&)> apply;
  };
  const bool lora = config.training.method == "lora";
  const std::int64_t rows = config.training.batch_rows;
  std::vector<Candidate> candidates;
  // The least change to what is trained first: where state lives and in what precision.
  if (lora && e.placement.quantize == "none") {
    const bool gguf = model.format == "gguf";
    candidates.push_back({{{{"model.quantize", gguf ? "gguf" : "nf4"}},
                           gguf ? "the frozen base in the GGUF file's own block types"
                                : "the frozen base in 4 bits, NF4: about 0.56 bytes per parameter"},
                          [gguf](TrainConfig& c) { c.model.quantize = gguf ? "gguf" : "nf4"; }});
  }
  // Several ranks (`config` is one rank's share, TrainConfig::distributed): the optimizer state
  // shared among them changes nothing of the training.
  const int ranks = config.distributed.ranks;
  if (!lora && ranks > 1 && !config.distributed.shard_optimizer && !config.training.one_step_stale)
    candidates.push_back(
        {{{{"distributed.shard_optimizer", "true"}},
          fmt::format("each of the {} ranks holds the optimizer state of 1/{} of the layers", ranks,
                      ranks)},
         [](TrainConfig& c) { c.distributed.shard_optimizer = true; }});
  if (config.hardware.offload_dir.empty() && !offload_dir.empty())
    candidates.push_back({{{{"hardware.offload_dir", offload_dir}},
                           "what host memory cannot hold goes to a folder on the run's drive"},
                          [&](TrainConfig& c) { c.hardware.offload_dir = offload_dir; }});
  if (config.model.dtype == "fp32")
    candidates.push_back({{{{"model.dtype", "bf16"}}, "weights streamed in bf16, not fp32"},
                          [](TrainConfig& c) { c.model.dtype = "bf16"; }});
  if (!lora && config.training.optimizer == "adamw")
    candidates.push_back(
        {{{{"training.optimizer", "adamw_8bit"}}, "AdamW moments in 2 bytes per parameter, not 8"},
         [](TrainConfig& c) { c.training.optimizer = "adamw_8bit"; }});
  if (rows > 1 && rows % 2 == 0)  // the same tokens per step: half the rows, twice as often
    candidates.push_back(
        {{{{"training.batch_rows", std::to_string(rows / 2)},
           {"training.grad_accum", std::to_string(config.training.grad_accum * 2 * ranks)}},
          fmt::format("{} rows per microbatch instead of {}, twice the microbatches: the same "
                      "tokens per step",
                      rows / 2, rows)},
         [](TrainConfig& c) {
           c.training.batch_rows /= 2;
           c.training.grad_accum *= 2;
         }});
  // Then changes to what is trained.
  if (!lora)
    candidates.push_back({{{{"training.method", "lora"}}, "LoRA adapters on a frozen base"},
                          [](TrainConfig& c) { c.training.method = "lora"; }});
  if (config.data.seq_len >= 256)
    candidates.push_back({{{{"data.seq_len", std::to_string(config.data.seq_len / 2)}},
                           fmt::format("rows of {} tokens (longer examples are cut there)",
                                       config.data.seq_len / 2)},
                          [](TrainConfig& c) { c.data.seq_len /= 2; }});
  for (Candidate& k : candidates) {
    if (e.fixes.size() >= most) break;
    TrainConfig with = config;
    k.apply(with);
    // A change that another setting forbids (half the rows under a preference.max_length that
    // needs them whole) is no fix.
    if (with.validate(/*planning=*/true).size() > config.validate(/*planning=*/true).size())
      continue;
    const std::int64_t tokens =
        with.data.seq_len * with.training.batch_rows * with.training.grad_accum;
    const RunEstimate probe =
        estimate_run(with, model, devices, steps, tokens, host_free, disk_free, resume);
    if (probe.verdict != "does not fit") e.fixes.push_back(std::move(k.fix));
  }
}

void find_longest_seq_len(RunEstimate& e, const TrainConfig& config,
                          const models::ModelSummary& model, const DevicePlan& devices,
                          std::int64_t steps, std::uint64_t host_free, std::uint64_t disk_free,
                          const std::optional<ResumePoint>& resume) {
  const std::int64_t positions = model.config.positions();
  const std::int64_t top = positions > 0 ? positions : std::int64_t{1} << 24;
  // Memory only: a disk too small for the checkpoints is so at any length.
  auto fits = [&](std::int64_t len) {
    TrainConfig with = config;
    with.data.seq_len = len;
    const RunEstimate probe = estimate_run(
        with, model, devices, steps, len * with.training.batch_rows * with.training.grad_accum,
        host_free, disk_free, resume);
    for (const std::string& p : probe.problems)
      if (p.rfind("disk: ", 0) != 0) return false;
    return true;
  };
  e.longest_is_positions = false;
  // Doubling from one step of lengths, then halving the gap between the longest that fits and
  // the shortest that does not.
  std::int64_t lo = 0, hi = 0;
  for (std::int64_t len = std::min(kSeqLenStep, top);; len = std::min(2 * len, top)) {
    if (!fits(len)) {
      hi = len;
      break;
    }
    lo = len;
    if (len == top) break;
  }
  if (hi == 0) {  // fits up to the model's positions
    e.longest_seq_len = top;
    e.longest_is_positions = positions > 0;
    return;
  }
  while (hi - lo > kSeqLenStep) {
    const std::int64_t mid = (lo + hi) / 2 / kSeqLenStep * kSeqLenStep;
    if (mid <= lo) break;
    (fits(mid) ? lo : hi) = mid;
  }
  e.longest_seq_len = lo;
}

}  // namespace rondo::engine
