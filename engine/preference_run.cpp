// A preference run's parts for the session (preference_run.h).
#include "engine/preference_run.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <map>

#include "kernels/error.h"
#include "models/safetensors.h"

namespace rondo::engine {

PreferenceOptions preference_options(const TrainConfig& c) {
  const Objective objective = objective_from(c.training.objective);
  if (objective == Objective::kSft) return {};
  return {.objective = objective,
          .dpo_loss = dpo_loss_from(c.preference.loss),
          .beta = c.preference.beta,
          .label_smoothing = c.preference.label_smoothing,
          .gamma = c.preference.gamma,
          .sft_weight = c.preference.sft_weight};
}

std::vector<std::pair<std::string, double>> preference_metrics(
    Objective objective, const std::array<double, kPreferenceMetrics>& values, double count) {
  std::vector<std::pair<std::string, double>> out;
  for (PreferenceMetric m : reported_metrics(objective))
    out.emplace_back(kPreferenceMetricNames[m], values[m] / count);
  return out;
}

namespace {

constexpr const char* kReferenceFile = "reference_logps.safetensors";

// The microbatches' inputs one part of the pass holds in host memory at most (a row position's
// tokens, targets, positions, documents and pair data take about 40 bytes): a large data set's
// rows are not all built at once.
constexpr std::int64_t kPassPartBytes = 256ll << 20;

// Every sequence's summed log-probability over `b`'s rows in dataset order (two per pair), in
// parts; a pass of several parts says how far it is about ten times.
std::vector<float> sequence_logps(
    const Batcher& b, const std::function<EvalResult(std::vector<Microbatch>)>& evaluate,
    std::int64_t seq_len, const std::function<void(const std::string&)>& log) {
  const std::int64_t total = b.row_microbatches();
  const std::int64_t rows = (b.rows() + total - 1) / std::max<std::int64_t>(total, 1);
  const std::int64_t part = std::max<std::int64_t>(1, kPassPartBytes / (40 * rows * seq_len));
  std::vector<float> out;
  std::int64_t said = 0;
  for (std::int64_t first = 0; first < total; first += part) {
    const EvalResult r = evaluate(b.all_rows(first, part));
    for (const std::vector<float>& m : r.sequence_logps)
      out.insert(out.end(), m.begin(), m.end());
    const std::int64_t done = std::min(total, first + part);
    if (done < total && done * 10 >= (said + 1) * total) {
      said = done * 10 / total;
      log(fmt::format("  {} of {} pairs scored", out.size() / 2, b.examples()));
    }
  }
  RONDO_ASSERT_MSG(static_cast<std::int64_t>(out.size()) == 2 * b.examples(),
                   "a reference log-probability for each sequence");
  return out;
}

}  // namespace

std::int64_t reference_tokens(const TrainConfig& c, const Batcher* train,
                              const Batcher* validation) {
  if (!train || !preference_options(c).needs_reference()) return 0;
  return (train->rows() + (validation ? validation->rows() : 0)) * c.data.seq_len;
}

void prepare_reference(const std::filesystem::path& run_dir, const std::string& fingerprint,
                       bool fresh, bool write, Batcher& train, Batcher* validation,
                       std::int64_t seq_len,
                       const std::function<EvalResult(std::vector<Microbatch>)>& evaluate,
                       const std::function<void(const std::string&)>& log) {
  const std::filesystem::path path = run_dir / kReferenceFile;
  std::vector<std::pair<std::string, Batcher*>> parts = {{"train", &train}};
  if (validation) parts.emplace_back("validation", validation);
  if (fresh) {
    log(
        fmt::format("Reference log-probabilities of the starting weights: a forward pass over "
                    "{} pairs",
                    train.examples() + (validation ? validation->examples() : 0)));
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (auto& [name, b] : parts) {
      std::vector<float> logps = sequence_logps(*b, evaluate, seq_len, log);
      tensors.emplace_back(name, at::tensor(logps, at::kFloat));
      b->set_reference(std::move(logps));
    }
    if (write)
      models::write_safetensors(path.string(), tensors, {{"data_fingerprint", fingerprint}});
    return;
  }
  if (!std::filesystem::exists(path))
    throw Error(path.string() +
                " is missing: a DPO run resumes with the reference log-probabilities it computed "
                "before its first step, and they cannot be computed again from trained weights; "
                "start the run again in a new folder");
  const models::SafetensorsFile file(path.string());
  const auto fp = file.metadata().find("data_fingerprint");
  if (fp == file.metadata().end() || fp->second != fingerprint)
    throw Error(path.string() +
                " was computed for other data (its data fingerprint differs from this run's); "
                "the data or the batching settings changed since the run began");
  for (auto& [name, b] : parts) {
    const models::TensorEntry* e = file.find(name);
    if (e == nullptr || e->view().numel() != 2 * b->examples())
      throw Error(path.string() + " holds no reference for the " + name +
                  " data as this run reads it; start the run again in a new folder");
    const at::Tensor t = e->view().to(at::kFloat).contiguous();
    b->set_reference(std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel()));
  }
}

}  // namespace rondo::engine
