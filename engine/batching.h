// From a Dataset to the engine's microbatches: truncation to seq_len, packing of whole examples
// into rows (kept apart by doc_ids), a seeded per-epoch row order, and a validation split.
// Invariant: step(s) is a pure function of (data, options, s), so a resumed run sees exactly the
// batches an uninterrupted one would have. Meant for the CLI and GUI, as the engine's BatchSource.
//
//   engine::Dataset val = engine::split_validation(train, 0.05, seed);
//   engine::Batcher batcher(train, {.seq_len = 2048, .rows = 4, .microbatches = 8, .seed = seed});
//   eng.train(steps, [&](std::int64_t step) { return batcher.step(step); });
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/data.h"
#include "engine/engine.h"

namespace rondo::engine {

struct BatchingOptions {
  std::int64_t seq_len = 1024;  // tokens per row (T); longer examples are cut to their prefix
  std::int64_t rows = 1;        // rows per microbatch (B)
  int microbatches = 1;         // microbatches per optimizer step (gradient accumulation)
  // true: several whole examples per row, kept apart by doc_ids; false: one example per row,
  // padded at the end (doc_ids undefined: causal attention never lets the example see its pad).
  bool pack = true;
  bool shuffle = true;     // false: every epoch visits the rows in dataset order
  std::uint64_t seed = 0;  // row order of each epoch
};

// Splits off a validation set: round(fraction * examples) examples (at least 1 when fraction > 0
// and there are >= 2 examples), chosen by a permutation seeded with `seed`. Returns them as a
// Dataset (same path and format, dataset order); `train` keeps the rest, in its order. fraction
// 0 returns an empty Dataset. Throws Error when fraction is outside [0, 1] or nothing would be
// left for training.
Dataset split_validation(Dataset& train, double fraction, std::uint64_t seed);

class Batcher {
 public:
  // Copies what it needs from `data` (it need not outlive the Batcher). Each example longer than
  // seq_len keeps its first seq_len tokens (counted in truncated()); empty examples are dropped.
  // Packing is greedy in dataset order: a row takes whole examples until the next one does not
  // fit, then a new row starts — an example is never split. In a row, example k has doc id k and
  // the padding after the last example has its own doc id; pad tokens are 0 with target -100.
  // Throws Error for bad options, an example whose ids and loss_mask differ in length, or a
  // dataset with no tokens ("no training rows").
  Batcher(const Dataset& data, const BatchingOptions& options);

  std::int64_t rows() const { return static_cast<std::int64_t>(row_begin_.size()) - 1; }
  // Optimizer steps in one epoch: floor(rows() / (options.rows * microbatches)), at least 1.
  // Steps never hold a partial microbatch: the rows left at an epoch's end start the next step,
  // which continues into the next epoch's order (so an epoch boundary may fall inside a step).
  std::int64_t steps_per_epoch() const;
  std::int64_t truncated() const { return truncated_; }  // examples cut to seq_len

  // The `microbatches` microbatches of optimizer step `step` (1-based), each options.rows rows.
  // Rows form one endless stream: epoch e (0-based) is every packed row once, in the order of a
  // permutation seeded by (seed, e) (dataset order without shuffle); step s takes stream rows
  // [(s - 1) * R, s * R), R = options.rows * microbatches.
  std::vector<Microbatch> step(std::int64_t step) const;

  // Where step `step` (1-based) starts in the stream: epoch (0-based) and row within that epoch.
  struct Position {
    std::int64_t epoch = 0, row = 0;
  };
  Position position(std::int64_t step) const;
  // Epochs consumed after `step` steps (0 allowed): step * R / rows(), e.g. 1.35. Agrees with
  // position(step + 1); equals step / steps_per_epoch() when R divides rows().
  double epoch_progress(std::int64_t step) const;

  // Every row once, in dataset order, in microbatches of options.rows rows (the last may have
  // fewer) — for validation loss, and the pass that computes a preference objective's reference:
  // all of them, or `count` from microbatch `first` on (fewer at the end), a long pass's part.
  std::vector<Microbatch> all_rows() const { return all_rows(0, row_microbatches()); }
  std::vector<Microbatch> all_rows(std::int64_t first, std::int64_t count) const;
  std::int64_t row_microbatches() const { return (rows() + options_.rows - 1) / options_.rows; }

  // Preference pairs (Example::second): every microbatch carries Microbatch::pairs, a pair's
  // two sequences as two documents of its row (with or without packing). Their reference
  // log-probabilities: two per kept pair, in dataset order (all_rows()' sequences one after
  // another); zeros until set.
  bool pairs() const { return pairs_; }
  std::int64_t examples() const { return static_cast<std::int64_t>(example_begin_.size()) - 1; }
  void set_reference(std::vector<float> logps);

 private:
  // (B, T) tensors for the given rows (B = row_ids.size()).
  Microbatch make_microbatch(const std::vector<std::int64_t>& row_ids) const;
  std::vector<std::int64_t> epoch_order(std::int64_t epoch) const;  // (rows()) row ids

  BatchingOptions options_;
  std::vector<std::int32_t> tokens_;         // every kept example, truncated, back to back
  std::vector<std::uint8_t> loss_mask_;      // same layout as tokens_
  std::vector<std::int64_t> example_begin_;  // (examples + 1) offsets into tokens_
  // (rows + 1): row r holds examples row_begin_[r] .. row_begin_[r + 1] - 1
  std::vector<std::int64_t> row_begin_;
  std::int64_t truncated_ = 0;
  bool pairs_ = false;
  std::vector<std::int64_t> second_;  // per kept example: where its rejected sequence starts
  std::vector<float> reference_;      // 2 per kept example (pairs), or empty
};

// A checkpoint's data_fingerprint: FNV-1a 64 over the tokenized examples and the batching options,
// as 16 hex digits (batching.cpp says why it must stay this function).
std::string data_fingerprint(const Dataset& d, const BatchingOptions& b);

}  // namespace rondo::engine
