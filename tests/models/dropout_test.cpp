// models::seeded_dropout: the counter-based mask keeps a share 1 - p (binomial bounds), scales kept
// entries by 1 / (1 - p), is a pure function of (seed, shape) and differs between seeds and
// between neighbouring elements.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

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

}  // namespace
}  // namespace rondo::models
