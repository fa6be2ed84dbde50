// The pieces the engine composes — forward without autograd, the chunked head's backward, block
// backward from checkpoints (stage grain for one stage, layer grain for another), the embedding's
// backward, the tied LM head's gradient added to the embedding's — give the gradients torch
// autograd gives through the same model as one graph.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <random>

#include "models/layers.h"
#include "models/model.h"

namespace rondo::models {
namespace {

ModelConfig qwen2_tied() {
  return parse_hf_config(R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":29,
    "hidden_size":16,"intermediate_size":24,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":2,"tie_word_embeddings":true,"rms_norm_eps":1e-5})",
                         "test config");
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  at::Tensor diff = (got - want).abs();
  double scale = std::max(1e-12, want.abs().max().item<double>());
  EXPECT_LE(diff.max().item<double>() / scale, 2e-5)
      << what << ": worst at " << diff.argmax().item<std::int64_t>();
}

TEST(Backward, StagePiecesEqualAutogradThroughTheWholeModel) {
  const auto seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  at::manual_seed(seed);
  ModelConfig c = qwen2_tied();
  std::vector<LayerSpec> specs = layer_specs(c);  // prefix, 4 blocks, head
  std::vector<std::vector<at::Tensor>> w;
  for (const LayerSpec& s : specs) {
    std::vector<at::Tensor> t;
    for (const ParamSpec& p : s.params)
      t.push_back(0.2 * at::randn(p.shape) + (p.shape.size() == 1 ? 1 : 0));
    w.push_back(t);
  }
  w.back()[1] = w[0][0];  // tied: the head's LM head is the embedding
  TokenBatch batch{
      at::randint(0, c.vocab_size, {2, 9}, at::kLong),
      at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1}, at::kLong).view({2, 9})};
  at::Tensor targets = next_token_targets(batch);
  const double scale = 1.0 / targets.ne(-100).sum().item<double>();
  AttentionContext ctx = make_attention_context(c, batch, at::kFloat);

  // Reference: one autograd graph.
  std::vector<std::vector<at::Tensor>> leaf;
  for (std::size_t l = 0; l + 1 < w.size(); ++l) {
    std::vector<at::Tensor> t;
    for (const at::Tensor& x : w[l])
      t.push_back(x.clone().requires_grad_(true));
    leaf.push_back(t);
  }
  at::Tensor final_norm = w.back()[0].clone().requires_grad_(true);
  at::Tensor x = embed(leaf[0][0], batch.tokens);
  for (std::size_t b = 1; b <= 4; ++b)
    x = block_forward(c, BlockWeights::bind(specs[b], leaf[b]), x, ctx);
  at::Tensor logits = at::linear(rms_norm(c, x, final_norm), leaf[0][0]);
  at::Tensor loss = at::cross_entropy_loss(logits.reshape({-1, c.vocab_size}),
                                           targets.reshape({-1}), {}, at::Reduction::Sum, -100);
  torch::autograd::backward({loss * scale});

  // Pieces: forward without autograd, saving each block's input.
  std::vector<at::Tensor> inputs;
  at::Tensor h;
  {
    c10::AutoGradMode no_grad(false);
    h = embed(w[0][0], batch.tokens);
    for (std::size_t b = 1; b <= 4; ++b) {
      inputs.push_back(h);
      h = block_forward(c, BlockWeights::bind(specs[b], w[b]), h, ctx);
    }
  }
  HeadGrads head = head_forward_backward(c, w.back()[0], w.back()[1], h, targets, scale, true, 5);
  std::vector<std::vector<at::Tensor>> grads(5);
  std::vector<BlockRun> runs;
  for (std::size_t b = 1; b <= 4; ++b) {
    for (const at::Tensor& t : w[b])
      grads[b].push_back(at::zeros_like(t));
    runs.push_back({&specs[b], w[b], &grads[b]});
  }
  // Backward stage [3, 5) in stage grain, then [1, 3) in layer grain.
  std::vector<BlockRun> upper(runs.begin() + 2, runs.end()), lower(runs.begin(), runs.begin() + 2);
  at::Tensor g = blocks_backward(c, upper, {inputs[2]}, ctx, head.grad_x);
  g = blocks_backward(c, lower, {inputs[0], inputs[1]}, ctx, g);
  at::Tensor embed_grad = at::zeros_like(w[0][0]);
  embed_backward(batch.tokens, g, embed_grad);
  embed_grad += head.grad_lm_head;  // the tied LM head's share

  expect_close(head.loss_sum, loss.detach(), "loss");
  expect_close(head.grad_norm, final_norm.grad(), "final norm");
  expect_close(embed_grad, leaf[0][0].grad(), "embedding (tied)");
  for (std::size_t b = 1; b <= 4; ++b)
    for (std::size_t i = 0; i < w[b].size(); ++i)
      expect_close(grads[b][i], leaf[b][i].grad(), specs[b].params[i].name);
}

}  // namespace
}  // namespace rondo::models
