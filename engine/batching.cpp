#include "engine/batching.h"

#include "kernels/checksum.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "engine/preference_data.h"
#include "kernels/error.h"
#include "models/model.h"

namespace rondo::engine {
namespace {

// Note [Portable permutations]
// The row order of every epoch and the validation split must be the same on every machine and
// standard library, or a run resumed elsewhere would train on different batches. std::shuffle and
// std::uniform_int_distribution are implementation-defined, so the permutation here is our own:
// splitmix64 as the generator, an unbiased bounded draw by rejection, and Fisher-Yates.
std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [0, n), n >= 1: rejects the draws below 2^64 mod n so every residue is equally likely.
std::uint64_t bounded(std::uint64_t& state, std::uint64_t n) {
  const std::uint64_t threshold = (0 - n) % n;
  for (;;) {
    const std::uint64_t x = splitmix64(state);
    if (x >= threshold) return x % n;
  }
}

// Purposes of a permutation, so that the validation split and epoch 0's order are unrelated.
constexpr std::uint64_t kDomainEpoch = 0x45504f4348ull;  // "EPOCH"
constexpr std::uint64_t kDomainSplit = 0x53504c4954ull;  // "SPLIT"

// A permutation of 0..n-1, a pure function of (seed, domain, index). See Note [Portable
// permutations].
std::vector<std::int64_t> permutation(std::int64_t n, std::uint64_t seed, std::uint64_t domain,
                                      std::uint64_t index) {
  // Chained hashing, so no two (seed, domain, index) share a stream by a simple xor relation.
  std::uint64_t mix = seed;
  mix = splitmix64(mix) ^ domain;
  mix = splitmix64(mix) ^ index;
  std::uint64_t state = splitmix64(mix);
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    p[i] = i;
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(bounded(state, static_cast<std::uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

}  // namespace

Dataset split_validation(Dataset& train, double fraction, std::uint64_t seed) {
  if (!(fraction >= 0 && fraction <= 1))
    throw Error("validation split: fraction is " + std::to_string(fraction) +
                "; give a share of the examples between 0 and 1 (0.05 = 5%)");
  const auto n = static_cast<std::int64_t>(train.examples.size());
  std::int64_t k = std::llround(fraction * static_cast<double>(n));
  if (fraction > 0 && n >= 2) k = std::max<std::int64_t>(k, 1);
  if (fraction > 0 && n - k < 1)
    throw Error("validation split: a fraction of " + std::to_string(fraction) + " of " +
                std::to_string(n) + " example(s)" +
                (train.path.empty() ? "" : " in " + train.path) +
                " leaves nothing to train on; lower the fraction or add examples");

  Dataset val;
  val.path = train.path;
  val.format = train.format;
  if (k == 0) return val;
  const std::vector<std::int64_t> p = permutation(n, seed, kDomainSplit, 0);
  std::vector<std::uint8_t> in_val(static_cast<std::size_t>(n), 0);
  for (std::int64_t i = 0; i < k; ++i)
    in_val[p[i]] = 1;

  std::vector<Example> kept;
  kept.reserve(static_cast<std::size_t>(n - k));
  val.examples.reserve(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < n; ++i)
    (in_val[i] ? val.examples : kept).push_back(std::move(train.examples[i]));
  train.examples = std::move(kept);
  return val;
}

Batcher::Batcher(const Dataset& data, const BatchingOptions& options) : options_(options) {
  std::vector<std::string> problems;
  if (options.seq_len < 1) problems.push_back("seq_len must be at least 1 token");
  if (options.rows < 1) problems.push_back("rows (per microbatch) must be at least 1");
  if (options.microbatches < 1) problems.push_back("microbatches (per step) must be at least 1");
  if (!problems.empty()) throw Error(join_problems("batching options:", problems));

  // Truncate and copy, dropping empty examples (they hold nothing to train on).
  example_begin_.push_back(0);
  for (std::size_t i = 0; i < data.examples.size(); ++i) {
    const Example& e = data.examples[i];
    if (e.ids.size() != e.loss_mask.size())
      throw Error("batching " + (data.path.empty() ? std::string("data") : data.path) +
                  ": example " + std::to_string(i) + " has " + std::to_string(e.ids.size()) +
                  " tokens but " + std::to_string(e.loss_mask.size()) +
                  " loss-mask entries; they must match");
    auto len = static_cast<std::int64_t>(e.ids.size());
    if (len == 0) continue;
    if (e.second != 0) {
      pairs_ = true;
      if (len > options.seq_len)
        throw Error("batching " + (data.path.empty() ? std::string("data") : data.path) +
                    ": preference pair " + std::to_string(i) + " has " + std::to_string(len) +
                    " tokens, more than a row's " + std::to_string(options.seq_len) +
                    " (a pair is never split); raise data.seq_len or lower preference.max_length");
    }
    second_.push_back(e.second);
    if (len > options.seq_len) {
      len = options.seq_len;
      ++truncated_;
    }
    tokens_.insert(tokens_.end(), e.ids.begin(), e.ids.begin() + len);
    loss_mask_.insert(loss_mask_.end(), e.loss_mask.begin(), e.loss_mask.begin() + len);
    example_begin_.push_back(static_cast<std::int64_t>(tokens_.size()));
  }
  const std::int64_t examples = this->examples();
  if (examples == 0)
    throw Error("batching " + (data.path.empty() ? std::string("data") : data.path) +
                ": no training rows (no example has a token); check the file and its format");

  // Greedy packing in dataset order: an example that does not fit closes the row.
  row_begin_.push_back(0);
  std::int64_t used = 0;  // tokens in the open row
  for (std::int64_t x = 0; x < examples; ++x) {
    const std::int64_t len = example_begin_[x + 1] - example_begin_[x];
    if (x > row_begin_.back() && (!options.pack || used + len > options.seq_len)) {
      row_begin_.push_back(x);
      used = 0;
    }
    used += len;
  }
  row_begin_.push_back(examples);
}

std::int64_t Batcher::steps_per_epoch() const {
  return std::max<std::int64_t>(1, rows() / (options_.rows * options_.microbatches));
}

std::vector<std::int64_t> Batcher::epoch_order(std::int64_t epoch) const {
  if (options_.shuffle)
    return permutation(rows(), options_.seed, kDomainEpoch, static_cast<std::uint64_t>(epoch));
  std::vector<std::int64_t> order(static_cast<std::size_t>(rows()));
  for (std::int64_t r = 0; r < rows(); ++r)
    order[r] = r;
  return order;
}

Batcher::Position Batcher::position(std::int64_t step) const {
  RONDO_ASSERT_MSG(step >= 1, "steps are 1-based");
  const std::int64_t first = (step - 1) * options_.rows * options_.microbatches;
  return {first / rows(), first % rows()};
}

double Batcher::epoch_progress(std::int64_t step) const {
  RONDO_ASSERT(step >= 0);
  const std::int64_t consumed = step * options_.rows * options_.microbatches;
  return static_cast<double>(consumed / rows()) +
         static_cast<double>(consumed % rows()) / static_cast<double>(rows());
}

std::vector<Microbatch> Batcher::step(std::int64_t step) const {
  Position at = position(step);
  std::vector<std::int64_t> order = epoch_order(at.epoch);
  std::vector<Microbatch> out;
  out.reserve(static_cast<std::size_t>(options_.microbatches));
  for (int m = 0; m < options_.microbatches; ++m) {
    std::vector<std::int64_t> ids;
    ids.reserve(static_cast<std::size_t>(options_.rows));
    for (std::int64_t b = 0; b < options_.rows; ++b) {
      if (at.row == rows()) {  // into the next epoch's order
        at = {at.epoch + 1, 0};
        order = epoch_order(at.epoch);
      }
      ids.push_back(order[at.row++]);
    }
    out.push_back(make_microbatch(ids));
  }
  return out;
}

void Batcher::set_reference(std::vector<float> logps) {
  RONDO_ASSERT_MSG(pairs_ && static_cast<std::int64_t>(logps.size()) == 2 * examples(),
                   "a reference log-probability for each sequence of every pair");
  reference_ = std::move(logps);
}

std::vector<Microbatch> Batcher::all_rows(std::int64_t first, std::int64_t count) const {
  std::vector<Microbatch> out;
  const std::int64_t end = std::min(rows(), (first + count) * options_.rows);
  for (std::int64_t r = first * options_.rows; r < end; r += options_.rows) {
    std::vector<std::int64_t> ids;
    for (std::int64_t i = r; i < std::min(rows(), r + options_.rows); ++i)
      ids.push_back(i);
    out.push_back(make_microbatch(ids));
  }
  return out;
}

Microbatch Batcher::make_microbatch(const std::vector<std::int64_t>& row_ids) const {
  const auto B = static_cast<std::int64_t>(row_ids.size());
  const std::int64_t T = options_.seq_len;
  at::Tensor tokens = at::zeros({B, T}, at::kLong);  // pad token 0
  at::Tensor mask = at::zeros({B, T}, at::kBool);    // pad: no loss
  at::Tensor doc_ids;
  // Pairs: a pair's two sequences are two documents, packed or not.
  const bool docs = options_.pack || pairs_;
  if (docs) doc_ids = at::empty({B, T}, at::kLong);
  auto* tok = tokens.data_ptr<std::int64_t>();
  auto* msk = mask.data_ptr<bool>();
  std::int64_t* doc = docs ? doc_ids.data_ptr<std::int64_t>() : nullptr;
  // Pairs: the sequence each target position scores (-1: none) and the NLL term's positions, per
  // pair p of the microbatch sequences 2p (chosen) and 2p + 1 (rejected).
  at::Tensor seq, nll;
  std::vector<float> reference;
  if (pairs_) {
    seq = at::full({B, T}, -1, at::kLong);
    nll = at::zeros({B, T}, at::kFloat);
  }
  auto* sq = pairs_ ? seq.data_ptr<std::int64_t>() : nullptr;
  auto* nl = pairs_ ? nll.data_ptr<float>() : nullptr;
  std::int64_t pair = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t r = row_ids[b];
    std::int64_t t = 0, doc_id = 0;
    for (std::int64_t x = row_begin_[r]; x < row_begin_[r + 1]; ++x, ++doc_id) {
      const std::int64_t split = example_begin_[x] + second_[static_cast<std::size_t>(x)];
      if (pairs_)
        for (int k = 0; k < 2; ++k)
          reference.push_back(reference_.empty() ? 0.0f : reference_[2 * x + k]);
      for (std::int64_t i = example_begin_[x]; i < example_begin_[x + 1]; ++i, ++t) {
        if (pairs_ && i == split) ++doc_id;  // the rejected sequence
        tok[b * T + t] = tokens_[i];
        msk[b * T + t] = loss_mask_[i] != 0;
        if (doc) doc[b * T + t] = doc_id;
        // The target at t - 1 predicts token t: a sequence's first token is never one.
        if (pairs_ && i != example_begin_[x] && i != split) {
          if (loss_mask_[i] & kAnswerToken) sq[b * T + t - 1] = 2 * pair + (i >= split ? 1 : 0);
          if (loss_mask_[i] & kNllToken) nl[b * T + t - 1] = 1;
        }
      }
      if (pairs_) ++pair;
    }
    RONDO_ASSERT(t <= T);
    if (doc)
      std::fill(doc + b * T + t, doc + (b + 1) * T, doc_id);  // padding: a document of its own
  }
  Microbatch mb;
  mb.batch.tokens = tokens;
  mb.batch.doc_ids = doc_ids;
  mb.targets = models::next_token_targets(mb.batch, mask);
  if (pairs_)
    mb.pairs = {
        .seq = seq, .nll = nll, .reference = at::tensor(reference, at::kFloat).reshape({-1})};
  return mb;
}

// data_fingerprint: FNV-1a 64 over the tokenized examples and the batching
// options, as 16 hex digits. A resume compares it with the value the checkpoint holds, so it must
// stay this function, with these bytes in this order: anything else would refuse to resume every
// run an older binary started (kernels::fnv1a64 is kept for it; new checksums use XXH3).
std::string data_fingerprint(const Dataset& d, const BatchingOptions& b) {
  std::uint64_t h = kernels::kFnv1a64Basis;
  for (const Example& e : d.examples) {
    h = kernels::fnv1a64(h, e.ids.data(), e.ids.size() * sizeof(e.ids[0]));
    h = kernels::fnv1a64(h, e.loss_mask.data(), e.loss_mask.size());
    const std::uint64_t n = e.ids.size();
    h = kernels::fnv1a64(h, &n, sizeof(n));
    // A pair's split (absent for other examples, so that their fingerprints stay what they were).
    if (e.second != 0) h = kernels::fnv1a64(h, &e.second, sizeof(e.second));
  }
  for (std::int64_t v : {b.seq_len, b.rows, static_cast<std::int64_t>(b.microbatches),
                         static_cast<std::int64_t>(b.pack), static_cast<std::int64_t>(b.shuffle),
                         static_cast<std::int64_t>(b.seed)})
    h = kernels::fnv1a64(h, &v, sizeof(v));
  return kernels::hex64(h);
}

}  // namespace rondo::engine
