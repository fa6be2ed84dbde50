// Batching: packing keeps every example whole and visits each once per epoch, targets match the
// definition (next token of the same document, where that token is trained), the step stream is
// deterministic and wraps across epochs, and the validation split is what it says.
#include "engine/batching.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "kernels/error.h"

namespace rondo::engine {
namespace {

// Example i has tokens i * 1000 + 1, + 2, ... (never 0, the pad token), so a row's documents
// name the example they came from.
Example numbered(std::int64_t i, std::int64_t len) {
  Example e;
  for (std::int64_t j = 0; j < len; ++j) {
    e.ids.push_back(static_cast<std::int32_t>(i * 1000 + j + 1));
    e.loss_mask.push_back(static_cast<std::uint8_t>((i + j) % 3 != 0));
  }
  return e;
}

Dataset numbered_dataset(const std::vector<std::int64_t>& lengths) {
  Dataset d;
  d.path = "test.jsonl";
  for (std::size_t i = 0; i < lengths.size(); ++i)
    d.examples.push_back(numbered(static_cast<std::int64_t>(i), lengths[i]));
  return d;
}

Example example(std::vector<std::int32_t> ids, std::vector<std::uint8_t> mask) {
  return {std::move(ids), std::move(mask)};
}

std::vector<std::int64_t> row_of(const at::Tensor& t, std::int64_t b) {
  at::Tensor r = t[b].contiguous();
  return {r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel()};
}

struct Doc {
  std::int64_t doc_id = 0;
  std::vector<std::int64_t> tokens, targets;
};

// A row cut into its documents by doc_ids; fails the test when a doc id comes back after another
// (documents must be contiguous).
std::vector<Doc> docs_of(const Microbatch& mb, std::int64_t b) {
  const std::vector<std::int64_t> tok = row_of(mb.batch.tokens, b);
  const std::vector<std::int64_t> tgt = row_of(mb.targets, b);
  const std::vector<std::int64_t> doc = mb.batch.doc_ids.defined()
                                            ? row_of(mb.batch.doc_ids, b)
                                            : std::vector<std::int64_t>(tok.size(), 0);
  std::vector<Doc> docs;
  std::set<std::int64_t> seen;
  for (std::size_t t = 0; t < tok.size(); ++t) {
    if (docs.empty() || docs.back().doc_id != doc[t]) {
      EXPECT_TRUE(seen.insert(doc[t]).second) << "doc id " << doc[t] << " is not contiguous";
      docs.push_back({doc[t], {}, {}});
    }
    docs.back().tokens.push_back(tok[t]);
    docs.back().targets.push_back(tgt[t]);
  }
  return docs;
}

// The example a (non-pad) document holds, checked to be example's whole (truncated) prefix, or
// -1 for padding (all zeros, all targets -100).
std::int64_t example_of(const Doc& d, const Dataset& data, std::int64_t seq_len) {
  if (d.tokens[0] == 0) {
    for (std::size_t t = 0; t < d.tokens.size(); ++t) {
      EXPECT_EQ(d.tokens[t], 0) << "padding holds a token at " << t;
      EXPECT_EQ(d.targets[t], -100) << "padding has a target at " << t;
    }
    return -1;
  }
  const std::int64_t x = d.tokens[0] / 1000;
  const Example& e = data.examples.at(static_cast<std::size_t>(x));
  const auto len = std::min<std::int64_t>(static_cast<std::int64_t>(e.ids.size()), seq_len);
  EXPECT_EQ(static_cast<std::int64_t>(d.tokens.size()), len) << "example " << x << " was split";
  for (std::size_t t = 0; t < d.tokens.size() && t < e.ids.size(); ++t)
    EXPECT_EQ(d.tokens[t], e.ids[t]) << "example " << x << " token " << t;
  return x;
}

// Every row of every microbatch, as the list of examples it holds (pad excluded).
std::vector<std::vector<std::int64_t>> rows_as_examples(const std::vector<Microbatch>& mbs,
                                                        const Dataset& data, std::int64_t seq_len) {
  std::vector<std::vector<std::int64_t>> rows;
  for (const Microbatch& mb : mbs) {
    for (std::int64_t b = 0; b < mb.batch.tokens.size(0); ++b) {
      std::vector<std::int64_t> xs;
      const std::vector<Doc> docs = docs_of(mb, b);
      for (std::size_t k = 0; k < docs.size(); ++k) {
        const std::int64_t x = example_of(docs[k], data, seq_len);
        if (x < 0) {
          EXPECT_EQ(k + 1, docs.size()) << "padding before a document";
        }
        if (x >= 0) xs.push_back(x);
      }
      rows.push_back(xs);
    }
  }
  return rows;
}

TEST(BatchingPack, RowsHoldWholeExamplesGreedilyAndEachEpochVisitsEveryRowOnce) {
  // Lengths not multiples of anything, a few longer than seq_len, two exactly seq_len, and a first
  // row that the second example fills exactly (5 + 12).
  const std::vector<std::int64_t> lengths = {5,  12, 17, 3, 1, 22, 8, 8, 2,  30, 11, 4,
                                             17, 6,  13, 7, 1, 16, 9, 5, 40, 3,  12};
  const std::int64_t T = 17;
  const Dataset data = numbered_dataset(lengths);
  const BatchingOptions o{.seq_len = T, .rows = 2, .microbatches = 3, .pack = true, .seed = 7};
  const Batcher batcher(data, o);
  EXPECT_EQ(batcher.truncated(), 3);  // 22, 30, 40

  // all_rows(): dataset order, greedy — a row closes only when the next example does not fit.
  const std::vector<std::vector<std::int64_t>> rows = rows_as_examples(batcher.all_rows(), data, T);
  ASSERT_EQ(static_cast<std::int64_t>(rows.size()), batcher.rows());
  // In parts (a long pass's): the same rows, part after part, the last part shorter.
  std::vector<std::vector<std::int64_t>> parts;
  for (std::int64_t first = 0; first < batcher.row_microbatches(); first += 3)
    for (auto& row : rows_as_examples(batcher.all_rows(first, 3), data, T))
      parts.push_back(std::move(row));
  EXPECT_EQ(batcher.row_microbatches(), (batcher.rows() + 1) / 2);
  EXPECT_EQ(parts, rows);
  EXPECT_TRUE(batcher.all_rows(batcher.row_microbatches(), 3).empty());
  std::int64_t next = 0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::int64_t used = 0;
    for (std::int64_t x : rows[r]) {
      EXPECT_EQ(x, next++) << "row " << r << " out of dataset order";
      used += std::min<std::int64_t>(lengths[x], T);
    }
    EXPECT_LE(used, T);
    if (r + 1 < rows.size()) {
      EXPECT_GT(used + std::min<std::int64_t>(lengths[rows[r + 1][0]], T), T)
          << "row " << r << " closed although example " << rows[r + 1][0] << " fitted";
    }
  }
  EXPECT_EQ(next, static_cast<std::int64_t>(lengths.size()));

  // Two epochs through step(): each epoch holds every row exactly once.
  const std::int64_t N = batcher.rows(), R = o.rows * o.microbatches;
  EXPECT_EQ(batcher.steps_per_epoch(), N / R);
  std::vector<std::vector<std::int64_t>> stream;
  for (std::int64_t s = 1; static_cast<std::int64_t>(stream.size()) < 2 * N; ++s) {
    const Batcher::Position p = batcher.position(s);
    EXPECT_EQ(p.epoch * N + p.row, static_cast<std::int64_t>(stream.size())) << "step " << s;
    const std::vector<Microbatch> mbs = batcher.step(s);
    ASSERT_EQ(static_cast<int>(mbs.size()), o.microbatches);
    for (const Microbatch& mb : mbs) {
      EXPECT_EQ(mb.batch.tokens.sizes().vec(), (std::vector<std::int64_t>{o.rows, T}));
      EXPECT_EQ(mb.targets.sizes().vec(), (std::vector<std::int64_t>{o.rows, T}));
      EXPECT_EQ(mb.batch.doc_ids.sizes().vec(), (std::vector<std::int64_t>{o.rows, T}));
    }
    for (auto& r : rows_as_examples(mbs, data, T))
      stream.push_back(r);
    EXPECT_DOUBLE_EQ(batcher.epoch_progress(s), static_cast<double>(stream.size()) / N);
  }
  const std::multiset<std::vector<std::int64_t>> all(rows.begin(), rows.end());
  const std::multiset<std::vector<std::int64_t>> epoch0(stream.begin(), stream.begin() + N);
  const std::multiset<std::vector<std::int64_t>> epoch1(stream.begin() + N, stream.begin() + 2 * N);
  EXPECT_EQ(epoch0, all);
  EXPECT_EQ(epoch1, all);
  // Shuffled: not dataset order, and epoch 1 is ordered differently from epoch 0.
  EXPECT_NE(std::vector(stream.begin(), stream.begin() + N), rows);
  EXPECT_NE(std::vector(stream.begin(), stream.begin() + N),
            std::vector(stream.begin() + N, stream.begin() + 2 * N));
}

TEST(BatchingTargets, TinyCaseByHand) {
  Dataset data;
  data.examples = {
      example({11, 12, 13}, {0, 1, 1}),
      example({21, 22, 23, 24}, {0, 0, 1, 1}),
      example({31, 32}, {1, 1}),
      example({41, 42, 43, 44, 45, 46, 47, 48, 49, 50}, {0, 0, 0, 1, 1, 1, 1, 1, 1, 1}),
  };
  const Batcher batcher(data, {.seq_len = 8, .rows = 2, .microbatches = 1, .shuffle = false});
  // Rows: [A B pad] (C would make 9 tokens), [C pad] (D does not fit), [D cut to 8 tokens].
  EXPECT_EQ(batcher.rows(), 3);
  EXPECT_EQ(batcher.truncated(), 1);
  EXPECT_EQ(batcher.steps_per_epoch(), 1);
  const auto L = [](std::vector<std::int64_t> v) {
    return at::tensor(v, at::kLong).reshape({-1, 8});
  };
  const at::Tensor tokens = L({11, 12, 13, 21, 22, 23, 24, 0,  //
                               31, 32, 0,  0,  0,  0,  0,  0,  //
                               41, 42, 43, 44, 45, 46, 47, 48});
  const at::Tensor doc_ids = L({0, 0, 0, 1, 1, 1, 1, 2,  //
                                0, 0, 1, 1, 1, 1, 1, 1,  //
                                0, 0, 0, 0, 0, 0, 0, 0});
  // targets[t] = tokens[t + 1] when t + 1 is in t's document and its mask is 1, else -100.
  const at::Tensor targets = L({12,   13,   -100, -100, 23,   24,   -100, -100,  //
                                32,   -100, -100, -100, -100, -100, -100, -100,  //
                                -100, -100, 44,   45,   46,   47,   48,   -100});
  const auto rows = [](const at::Tensor& t, std::vector<std::int64_t> r) {
    return t.index_select(0, at::tensor(r, at::kLong));
  };

  const std::vector<Microbatch> s1 = batcher.step(1);
  ASSERT_EQ(s1.size(), 1u);
  EXPECT_TRUE(at::equal(s1[0].batch.tokens, rows(tokens, {0, 1}))) << s1[0].batch.tokens;
  EXPECT_TRUE(at::equal(s1[0].batch.doc_ids, rows(doc_ids, {0, 1}))) << s1[0].batch.doc_ids;
  EXPECT_TRUE(at::equal(s1[0].targets, rows(targets, {0, 1}))) << s1[0].targets;
  // Step 2 takes the epoch's last row, then wraps to the next epoch's first.
  const std::vector<Microbatch> s2 = batcher.step(2);
  EXPECT_TRUE(at::equal(s2[0].batch.tokens, rows(tokens, {2, 0}))) << s2[0].batch.tokens;
  EXPECT_TRUE(at::equal(s2[0].targets, rows(targets, {2, 0}))) << s2[0].targets;
  EXPECT_EQ(batcher.position(2).epoch, 0);
  EXPECT_EQ(batcher.position(2).row, 2);
  EXPECT_EQ(batcher.position(3).epoch, 1);
  EXPECT_EQ(batcher.position(3).row, 1);
  EXPECT_DOUBLE_EQ(batcher.epoch_progress(1), 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(batcher.epoch_progress(3), 2.0);

  const std::vector<Microbatch> all = batcher.all_rows();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1].batch.tokens.size(0), 1);  // the last microbatch is smaller
  EXPECT_TRUE(at::equal(all[1].targets, rows(targets, {2})));

  // Unpacked: one example per row, padded; no doc_ids (one document per row).
  const Batcher one(data, {.seq_len = 8, .rows = 4, .pack = false, .shuffle = false});
  EXPECT_EQ(one.rows(), 4);
  const std::vector<Microbatch> u = one.step(1);
  ASSERT_EQ(u.size(), 1u);
  EXPECT_FALSE(u[0].batch.doc_ids.defined());
  EXPECT_TRUE(at::equal(u[0].batch.tokens, L({11, 12, 13, 0,  0,  0,  0,  0,  //
                                              21, 22, 23, 24, 0,  0,  0,  0,  //
                                              31, 32, 0,  0,  0,  0,  0,  0,  //
                                              41, 42, 43, 44, 45, 46, 47, 48})))
      << u[0].batch.tokens;
  EXPECT_TRUE(at::equal(u[0].targets, L({12,   13,   -100, -100, -100, -100, -100, -100,  //
                                         -100, 23,   24,   -100, -100, -100, -100, -100,  //
                                         32,   -100, -100, -100, -100, -100, -100, -100,  //
                                         -100, -100, 44,   45,   46,   47,   48,   -100})))
      << u[0].targets;
}

TEST(BatchingUnpacked, EachRowHoldsOneExampleAndPadsAreNotTrained) {
  const std::vector<std::int64_t> lengths = {5, 12, 1, 9, 20, 3, 9};
  const Dataset data = numbered_dataset(lengths);
  const std::int64_t T = 9;
  const Batcher batcher(data, {.seq_len = T, .rows = 3, .pack = false, .seed = 3});
  EXPECT_EQ(batcher.rows(), 7);
  EXPECT_EQ(batcher.truncated(), 2);
  std::multiset<std::int64_t> seen;
  for (std::int64_t s = 1; s <= 7; ++s) {  // 21 rows: three epochs exactly
    for (const Microbatch& mb : batcher.step(s)) {
      EXPECT_FALSE(mb.batch.doc_ids.defined());
      for (std::int64_t b = 0; b < mb.batch.tokens.size(0); ++b) {
        const std::vector<std::int64_t> tok = row_of(mb.batch.tokens, b);
        const std::vector<std::int64_t> tgt = row_of(mb.targets, b);
        const std::int64_t x = tok[0] / 1000;
        seen.insert(x);
        const std::int64_t len = std::min(lengths[x], T);
        for (std::int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(tok[t], t < len ? data.examples[x].ids[t] : 0) << "example " << x;
          if (t >= len - 1) {
            EXPECT_EQ(tgt[t], -100) << "example " << x << " position " << t;
          }
        }
      }
    }
  }
  for (std::int64_t x = 0; x < 7; ++x)
    EXPECT_EQ(seen.count(x), 3u) << "example " << x;
}

TEST(BatchingOrder, StepsAreAPureFunctionOfDataOptionsAndStep) {
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < 40; ++i)
    lengths.push_back(3 + (i * 7) % 11);
  const Dataset data = numbered_dataset(lengths);
  const BatchingOptions o{.seq_len = 16, .rows = 3, .microbatches = 2, .seed = 1234};
  const Batcher a(data, o), b(data, o);
  const auto same = [](const std::vector<Microbatch>& x, const std::vector<Microbatch>& y) {
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!at::equal(x[i].batch.tokens, y[i].batch.tokens) ||
          !at::equal(x[i].batch.doc_ids, y[i].batch.doc_ids) ||
          !at::equal(x[i].targets, y[i].targets))
        return false;
    return true;
  };
  // A fresh Batcher, or the same one asked out of order, gives the same step.
  for (std::int64_t s : {9, 1, 4, 9})
    EXPECT_TRUE(same(a.step(s), b.step(s))) << "step " << s;

  BatchingOptions other = o;
  other.seed = 1235;
  const Batcher c(data, other);
  bool differs = false;
  for (std::int64_t s = 1; s <= 3; ++s)
    differs = differs || !same(a.step(s), c.step(s));
  EXPECT_TRUE(differs) << "seeds 1234 and 1235 give the same first steps";

  // Without shuffling every epoch is dataset order: the stream is all_rows() over and over.
  BatchingOptions plain = o;
  plain.shuffle = false;
  const Batcher p(data, plain);
  const std::vector<std::vector<std::int64_t>> rows = rows_as_examples(p.all_rows(), data, 16);
  std::int64_t i = 0;
  for (std::int64_t s = 1; s <= 2 * p.steps_per_epoch() + 1; ++s)
    for (const auto& r : rows_as_examples(p.step(s), data, 16))
      EXPECT_EQ(r, rows[i++ % rows.size()]) << "step " << s;
}

TEST(BatchingErrors, EmptyDataAndBadOptionsAreErrors) {
  Dataset empty;
  empty.path = "e.jsonl";
  try {
    Batcher b(empty, {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("e.jsonl: no training rows"), std::string::npos)
        << e.what();
  }
  const Dataset data = numbered_dataset({4, 5});
  EXPECT_THROW(Batcher(data, {.seq_len = 0}), Error);
  EXPECT_THROW(Batcher(data, {.rows = 0}), Error);
  EXPECT_THROW(Batcher(data, {.microbatches = 0}), Error);
  Dataset ragged = data;
  ragged.examples[1].loss_mask.pop_back();
  EXPECT_THROW(Batcher(ragged, {}), Error);
}

TEST(BatchingValidation, SplitIsSeededDisjointAndKeepsOrder) {
  std::vector<std::int64_t> lengths(20, 4);
  const Dataset original = numbered_dataset(lengths);
  const auto ids = [](const Dataset& d) {
    std::vector<std::int64_t> xs;
    for (const Example& e : d.examples)
      xs.push_back(e.ids[0] / 1000);
    return xs;
  };

  Dataset train = original;
  const Dataset val = split_validation(train, 0.25, 5);
  EXPECT_EQ(val.examples.size(), 5u);
  EXPECT_EQ(train.examples.size(), 15u);
  EXPECT_EQ(val.path, original.path);
  const std::vector<std::int64_t> t = ids(train), v = ids(val);
  EXPECT_TRUE(std::is_sorted(t.begin(), t.end()));
  EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));
  std::set<std::int64_t> both(t.begin(), t.end());
  both.insert(v.begin(), v.end());
  EXPECT_EQ(both.size(), 20u);  // disjoint, and nothing lost
  EXPECT_NE(v, (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  EXPECT_NE(v, (std::vector<std::int64_t>{15, 16, 17, 18, 19}));

  Dataset again = original;
  EXPECT_EQ(ids(split_validation(again, 0.25, 5)), v);
  Dataset reseeded = original;
  EXPECT_NE(ids(split_validation(reseeded, 0.25, 6)), v);

  Dataset tiny_fraction = original;
  EXPECT_EQ(split_validation(tiny_fraction, 0.01, 5).examples.size(), 1u);
  Dataset none = original;
  EXPECT_TRUE(split_validation(none, 0, 5).examples.empty());
  EXPECT_EQ(none.examples.size(), 20u);

  Dataset all = original;
  EXPECT_THROW(split_validation(all, 1.0, 5), Error);
  Dataset one = numbered_dataset({4});
  EXPECT_THROW(split_validation(one, 0.5, 5), Error);
  EXPECT_EQ(one.examples.size(), 1u);  // untouched by the failed split
  Dataset bad = original;
  EXPECT_THROW(split_validation(bad, 1.5, 5), Error);
  EXPECT_THROW(split_validation(bad, std::nan(""), 5), Error);
}

}  // namespace
}  // namespace rondo::engine
