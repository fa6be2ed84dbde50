// The chunked head's hand-written backward against torch autograd on the plain, unchunked head
// in float64 (same inputs, upcast): loss, and gradients for the input, the norm and the LM head.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <random>

#include "models/layers.h"

namespace rondo::models {
namespace {

ModelConfig tiny() {
  ModelConfig c;
  c.vocab_size = 37;
  c.hidden_size = 13;
  c.rms_norm_eps = 1e-5;
  return c;
}

// Worst |a - b| relative to the largest |b|, with its index in the message.
void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const char* what) {
  at::Tensor diff = (got.to(at::kDouble) - want).abs();
  double scale = std::max(1e-12, want.abs().max().item<double>());
  std::int64_t worst = diff.argmax().item<std::int64_t>();
  EXPECT_LE(diff.max().item<double>() / scale, tol)
      << what << ": worst at flat index " << worst << ", got "
      << got.to(at::kDouble).flatten()[worst].item<double>() << " want "
      << want.flatten()[worst].item<double>();
}

TEST(HeadForwardBackward, EqualsAutogradOnTheUnchunkedHead) {
  std::mt19937 rng(std::random_device{}());
  const auto seed = rng();
  std::printf("seed %lu\n", static_cast<unsigned long>(seed));
  at::manual_seed(seed);
  ModelConfig c = tiny();
  const std::int64_t B = 2, T = 11, C = c.hidden_size, V = c.vocab_size;
  at::Tensor x = at::randn({B, T, C});
  at::Tensor norm = 1 + 0.1 * at::randn({C});
  at::Tensor lm = 0.3 * at::randn({V, C});
  at::Tensor targets = at::randint(0, V, {B, T}, at::kLong);
  targets.index_put_({0, 3}, -100);
  targets.index_put_({1, 0}, -100);
  targets.index_put_({1, 10}, -100);
  const double scale = 3.0 / targets.ne(-100).sum().item<double>();

  // Reference: Hugging Face's formulas, autograd, float64.
  at::Tensor xr = x.to(at::kDouble).requires_grad_(true);
  at::Tensor nr = norm.to(at::kDouble).requires_grad_(true);
  at::Tensor lr = lm.to(at::kDouble).requires_grad_(true);
  at::Tensor h = nr * (xr * at::rsqrt(xr.pow(2).mean(-1, true) + c.rms_norm_eps));
  at::Tensor loss = at::cross_entropy_loss(at::linear(h, lr).reshape({-1, V}),
                                           targets.reshape({-1}), {}, at::Reduction::Sum, -100);
  torch::autograd::backward({loss * scale});

  for (std::int64_t chunk : {1, 5, 22, 1000}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    HeadGrads g = head_forward_backward(c, norm, lm, x, targets, scale, true, chunk);
    expect_close(g.loss_sum, loss.detach(), 1e-6, "loss");
    expect_close(g.grad_x, xr.grad(), 1e-5, "grad_x");
    expect_close(g.grad_norm, nr.grad(), 1e-5, "grad_norm");
    expect_close(g.grad_lm_head, lr.grad(), 1e-5, "grad_lm_head");
  }
  HeadGrads frozen = head_forward_backward(c, norm, lm, x, targets, scale, false, 4);
  EXPECT_FALSE(frozen.grad_lm_head.defined());
  expect_close(frozen.grad_x, xr.grad(), 1e-5, "grad_x without the LM head's gradient");
}

}  // namespace
}  // namespace rondo::models
