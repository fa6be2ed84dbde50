// The model's layer functions on a CUDA device (label cuda; skips without a GPU): logits of a
// packed batch equal the CPU's (fp32, TF32 off), the chunked head's backward too, and bf16 stays
// close. Exercises torch's fused attention kernels with Rondo's masks.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "models/attention_masks.h"
#include "models/layers.h"
#include "models/model.h"
#include "tests/support/cuda_or_skip.h"

namespace rondo::models {
namespace {

class ModelCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    RONDO_CUDA_OR_SKIP();
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
};

Model tiny_model(at::Device device, at::ScalarType dtype) {
  ModelConfig c = parse_hf_config(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":211,
    "hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":32,"tie_word_embeddings":true})",
                                  "test config");
  at::manual_seed(1234);
  std::map<std::string, at::Tensor> w;
  for (const LayerSpec& s : layer_specs(c))
    for (const ParamSpec& p : s.params)
      if (!p.tied)
        w[p.name] =
            (0.1 * at::randn(p.shape) + (p.shape.size() == 1 ? 1.0 : 0.0)).to(device, dtype);
  return Model::from_tensors(c, w, "random");
}

TokenBatch packed(at::Device device) {
  at::manual_seed(99);
  at::Tensor tokens = at::randint(0, 211, {2, 40}, at::kLong);
  at::Tensor docs = at::cat({at::zeros({2, 15}, at::kLong), at::ones({2, 25}, at::kLong)}, 1);
  return {tokens.to(device), docs.to(device)};
}

TEST_F(ModelCuda, LogitsEqualTheCpu) {
  Model cpu = tiny_model(at::kCPU, at::kFloat), gpu = tiny_model(at::kCUDA, at::kFloat);
  at::Tensor a = cpu.logits(packed(at::kCPU));
  at::Tensor b = gpu.logits(packed(at::kCUDA)).cpu();
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-3);
  Model half = tiny_model(at::kCUDA, at::kBFloat16);
  at::Tensor h = half.logits(packed(at::kCUDA)).cpu();
  EXPECT_LT((a - h).abs().max().item<double>(), 0.1 * a.abs().max().item<double>());
}

TEST_F(ModelCuda, ChunkedHeadBackwardEqualsTheCpu) {
  Model cpu = tiny_model(at::kCPU, at::kFloat), gpu = tiny_model(at::kCUDA, at::kFloat);
  auto run = [](const Model& m, at::Device d) {
    TokenBatch batch = packed(d);
    at::Tensor x = m.hidden(batch);
    auto head = m.layer_tensors(m.layers().size() - 1);
    return head_forward_backward(m.config(), head[0], head[1], x, next_token_targets(batch),
                                 1.0 / 78, true, 16);
  };
  HeadGrads a = run(cpu, at::kCPU), b = run(gpu, at::kCUDA);
  EXPECT_LT((a.grad_x - b.grad_x.cpu()).abs().max().item<double>(), 1e-4);
  EXPECT_LT((a.grad_lm_head - b.grad_lm_head.cpu()).abs().max().item<double>(), 1e-4);
}

// Packed rows (a mask) on Qwen3-1.7B's attention shape (16 query heads, 8 key/value heads of 128,
// bf16) go to a fused kernel, not the math one that keeps (B, H, T, T) probabilities: the backend
// torch picks for the call block_forward makes on CUDA (key/value heads repeated under a mask),
// with deterministic algorithms off and on (exact runs turn them on).
TEST_F(ModelCuda, PackedRowAttentionRunsOnAFusedKernel) {
  ModelConfig c = parse_hf_config(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":1000,
    "hidden_size":2048,"intermediate_size":6144,"num_hidden_layers":1,"num_attention_heads":16,
    "num_key_value_heads":8,"head_dim":128,"max_position_embeddings":4096})",
                                  "test config");
  const std::int64_t T = 2048, H = 16, KV = 8, D = 128;
  at::Tensor docs = at::cat({at::zeros({1, 700}, at::kLong), at::ones({1, T - 700}, at::kLong)}, 1);
  TokenBatch batch{at::randint(0, 1000, {1, T}, at::kLong), docs};
  // The mask path (what packed rows fall back to where flash attention per document does not run).
  AttentionContext ctx = attention_context_without_masks(c, batch, at::kBFloat16);
  limit_attention(ctx, c, docs, DocSpans{}, at::kCPU, at::kBFloat16);
  ASSERT_TRUE(ctx.mask.defined());
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  at::Tensor q = at::randn({1, H, T, D}, opts);
  at::Tensor k = at::randn({1, KV, T, D}, opts).repeat_interleave(H / KV, 1);
  at::Tensor v = at::randn({1, KV, T, D}, opts).repeat_interleave(H / KV, 1);
  at::Tensor mask = ctx.mask.to(at::kCUDA);
  const char* names[] = {"math", "flash", "efficient", "cudnn", "overrideable"};
  const bool was = at::globalContext().deterministicAlgorithms();
  const bool was_warn = at::globalContext().deterministicAlgorithmsWarnOnly();
  for (bool deterministic : {false, true}) {
    at::globalContext().setDeterministicAlgorithms(deterministic, false);
    const std::int64_t choice = at::_fused_sdp_choice(q, k, v, mask, 0.0, /*is_causal=*/false,
                                                      1.0 / std::sqrt(static_cast<double>(D)),
                                                      /*enable_gqa=*/false);
    std::printf("packed rows, deterministic %s: SDPA backend %s\n", deterministic ? "on" : "off",
                choice >= 0 && choice <= 4 ? names[choice] : "error");
    EXPECT_GT(choice, 0) << "deterministic " << deterministic << ": the math kernel (0) or none";
  }
  at::globalContext().setDeterministicAlgorithms(was, was_warn);
}

// Packed rows in bf16 on CUDA attend per document through variable-length flash attention: the path
// is selected (no mask is built), and outputs and gradients stay close to the masked attention
// computed in fp32 on the same GPU, with grouped-query heads, a document of one token, and windows
// shorter than a document (of two keys: the token and the one before it). Compared without the
// residual (the block's output less its input, the input's gradient less the output's), which
// would otherwise hide an error in the attention under the tolerance.
TEST_F(ModelCuda, PackedRowsAttendPerDocumentThroughFlashAttention) {
  for (std::int64_t window : {0, 2, 24}) {
    ModelConfig c = parse_hf_config(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":100,
      "hidden_size":256,"intermediate_size":384,"num_hidden_layers":1,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":64})",
                                    "test config");
    c.sliding_window = window;
    const LayerSpec spec = layer_specs(c)[1];
    at::manual_seed(21);
    std::vector<at::Tensor> w32;
    for (const ParamSpec& p : spec.params)
      w32.push_back((0.05 * at::randn(p.shape) + (p.shape.size() == 1 ? 1.0 : 0.0)).to(at::kCUDA));
    const std::int64_t T = 128;
    const at::Tensor docs =
        at::cat({at::full({1, 50}, 0, at::kLong), at::full({1, 78}, 1, at::kLong),
                 at::full({1, 1}, 2, at::kLong), at::full({1, 127}, 3, at::kLong)},
                1)
            .view({2, T})
            .to(at::kCUDA);
    const TokenBatch batch{at::zeros({2, T}, at::kLong).to(at::kCUDA), docs};
    const AttentionContext flash = make_attention_context(c, batch, at::kBFloat16);
    ASSERT_FALSE(flash.doc_offsets.empty()) << "window " << window << ": not attended per document";
    EXPECT_FALSE(flash.mask.defined());
    AttentionContext masked = attention_context_without_masks(c, batch, at::kFloat);
    limit_attention(masked, c, docs, DocSpans{}, at::kCUDA, at::kFloat);
    ASSERT_TRUE(masked.mask.defined());
    // A small input (the norms scale it up): the block's output is then mostly what attention and
    // the MLP add, which bf16 resolves, rather than the residual.
    const at::Tensor x0 = 0.01 * at::randn({2, T, c.hidden_size}).to(at::kCUDA);
    const at::Tensor g = at::randn({2, T, c.hidden_size}).to(at::kCUDA);
    auto run = [&](const AttentionContext& ctx, at::ScalarType dtype) {
      std::vector<at::Tensor> w;
      for (const at::Tensor& t : w32)
        w.push_back(t.to(dtype).requires_grad_(true));
      at::Tensor x = x0.to(dtype).requires_grad_(true);
      at::Tensor y = block_forward(c, BlockWeights::bind(spec, w), x, ctx);
      (y.to(at::kFloat) * g).sum().backward();
      return std::vector<at::Tensor>{y.to(at::kFloat) - x.to(at::kFloat),
                                     x.grad().to(at::kFloat) - g,
                                     w[1].grad().to(at::kFloat)};  // the q projection's
    };
    const std::vector<at::Tensor> a = run(flash, at::kBFloat16), b = run(masked, at::kFloat);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double rel = (a[i] - b[i]).abs().max().item<double>() /
                         std::max(1e-12, b[i].abs().max().item<double>());
      std::printf("window %ld, output %zu: max relative difference %.2e\n",
                  static_cast<long>(window), i, rel);
      EXPECT_LT(rel, 3e-2) << "window " << window << ", output " << i;
    }
  }
}

}  // namespace
}  // namespace rondo::models
