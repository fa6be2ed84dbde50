// models::seeded_dropout: the counter-based mask keeps a share 1 - p (binomial bounds), scales kept
// entries by 1 / (1 - p), is a pure function of (seed, shape) and differs between seeds and
// between neighbouring elements.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "models/layers.h"

namespace rondo::models {
namespace {

TEST(Dropout, KeepsOneMinusPScaledAndReplaysBySeed) {
  const std::int64_t n = 1 << 20;
  at::Tensor x = at::ones({4, n / 4});
  for (double p : {0.1, 0.5, 0.9}) {
    at::Tensor y = seeded_dropout(x, p, 12345);
    const double kept = y.ne(0).sum().item<double>() / n;
    const double sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(kept, 1 - p, 6 * sd) << "p " << p;
    EXPECT_NEAR(y.max().item<double>(), 1 / (1 - p), 1e-6);
    EXPECT_TRUE(seeded_dropout(x, p, 12345).equal(y)) << "same seed, same mask";
    const double same =
        seeded_dropout(x, p, 12346).ne(0).eq(y.ne(0)).to(at::kDouble).mean().item<double>();
    // Independent masks agree on a share p^2 + (1-p)^2.
    EXPECT_NEAR(same, p * p + (1 - p) * (1 - p), 6 * std::sqrt(0.25 / n)) << "p " << p;
    // Neighbours are not correlated: adjacent pairs both kept about (1-p)^2 of the time.
    at::Tensor k = y.ne(0).reshape({-1}).to(at::kDouble);
    const double both = (k.narrow(0, 0, n - 1) * k.narrow(0, 1, n - 1)).mean().item<double>();
    EXPECT_NEAR(both, (1 - p) * (1 - p), 6 * std::sqrt(0.25 / n)) << "p " << p;
  }
  EXPECT_TRUE(seeded_dropout(x, 0.0, 1).equal(x));
  // Seeds past 32 bits count too.
  EXPECT_FALSE(seeded_dropout(x, 0.5, 1).equal(seeded_dropout(x, 0.5, 1 + (1ll << 40))));
}

// The mask is what its definition says, element by element, where it is built a slice at a time
// (tensors larger than a slice of 2^21 values, a first index past 32 bits): Chris Wellons'
// lowbias32 of (index high word ^ seed high word), then of that ^ index low word ^ seed low word,
// then of that ^ seed low word; kept where it is at least p * 2^32. In scalar code here.
std::uint32_t lowbias32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

TEST(Dropout, TheMaskIsTheHashOfEachElementsIndex) {
  const std::int64_t rows = 3, cols = 1'500'001, first = 5'000'000'017LL;
  const std::int64_t seed = (7LL << 40) + 99;
  const double p = 0.3;
  const at::Tensor x = at::rand({rows, cols}) + 0.5;  // no zeros
  const at::Tensor y = seeded_dropout(x, p, seed, first);
  const auto lo = static_cast<std::uint32_t>(seed), hi = static_cast<std::uint32_t>(seed >> 32);
  const auto threshold = static_cast<std::uint64_t>(p * 4294967296.0);
  at::Tensor want = at::empty({rows * cols}, at::kBool);
  bool* w = want.data_ptr<bool>();
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const auto index = static_cast<std::uint64_t>(first + i);
    std::uint32_t h = lowbias32(static_cast<std::uint32_t>(index >> 32) ^ hi);
    h = lowbias32(h ^ static_cast<std::uint32_t>(index) ^ lo);
    h = lowbias32(h ^ lo);
    w[i] = h >= threshold;
  }
  EXPECT_TRUE(y.ne(0).reshape({-1}).equal(want));
  EXPECT_TRUE(at::allclose(y, x * want.view({rows, cols}) / (1 - p), 1e-6, 0));
}

}  // namespace
}  // namespace rondo::models
