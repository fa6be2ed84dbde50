// Attention over packed rows: a document in a packed row attends as it would alone; rows that
// each hold one document carry no mask (so that the fused kernels can run them); and the
// repeated key/value heads that let the memory-efficient kernel take a mask with grouped-query
// heads give what the grouped heads give, values and gradients.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "models/layers.h"
#include "models/model.h"

namespace rondo::models {
namespace {

ModelConfig gqa_config() {
  return parse_hf_config(R"({"architectures":["LlamaForCausalLM"],"vocab_size":31,
    "hidden_size":32,"intermediate_size":48,"num_hidden_layers":1,"num_attention_heads":4,
    "num_key_value_heads":2,"tie_word_embeddings":false,"rms_norm_eps":1e-5})",
                         "test config");
}

struct Block {
  ModelConfig c = gqa_config();
  LayerSpec spec = layer_specs(c)[1];
  std::vector<at::Tensor> w;
  Block() {
    at::manual_seed(3);
    for (const ParamSpec& p : spec.params)
      w.push_back(0.3 * at::randn(p.shape) + (p.shape.size() == 1 ? 1.0 : 0.0));
  }
  at::Tensor run(const at::Tensor& x, const AttentionContext& ctx) const {
    return block_forward(c, BlockWeights::bind(spec, w), x, ctx);
  }
};

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

TEST(Attention, ADocumentInAPackedRowAttendsAsItWouldAlone) {
  Block blk;
  at::manual_seed(11);
  const at::Tensor x = at::randn({1, 12, blk.c.hidden_size}, at::kDouble);
  for (at::Tensor& t : blk.w)
    t = t.to(at::kDouble);
  // One row: a document of 5 tokens, then one of 7.
  const at::Tensor docs = at::cat({at::zeros({1, 5}, at::kLong), at::ones({1, 7}, at::kLong)}, 1);
  const at::Tensor tokens = at::zeros({1, 12}, at::kLong);
  const AttentionContext packed = make_attention_context(blk.c, {tokens, docs}, at::kDouble);
  ASSERT_TRUE(packed.mask.defined());
  const at::Tensor both = blk.run(x, packed);
  const at::Tensor first = blk.run(
      x.narrow(1, 0, 5), make_attention_context(blk.c, {tokens.narrow(1, 0, 5), {}}, at::kDouble));
  const at::Tensor second = blk.run(
      x.narrow(1, 5, 7), make_attention_context(blk.c, {tokens.narrow(1, 5, 7), {}}, at::kDouble));
  EXPECT_LE(max_rel(both.narrow(1, 0, 5), first), 1e-12);
  EXPECT_LE(max_rel(both.narrow(1, 5, 7), second), 1e-12);
}

TEST(Attention, RowsOfOneDocumentEachCarryNoMask) {
  Block blk;
  at::manual_seed(12);
  const at::Tensor tokens = at::randint(0, 31, {3, 10}, at::kLong);
  // Each row one document (ids differ between rows, as the batcher numbers them).
  const at::Tensor docs = at::arange(3, at::kLong).unsqueeze(1).expand({3, 10}).contiguous();
  const AttentionContext one_each = make_attention_context(blk.c, {tokens, docs}, at::kFloat);
  EXPECT_FALSE(one_each.mask.defined()) << "a causal mask would keep flash attention off";
  const AttentionContext none = make_attention_context(blk.c, {tokens, {}}, at::kFloat);
  EXPECT_TRUE(at::equal(one_each.positions, none.positions));
  const at::Tensor x = at::randn({3, 10, blk.c.hidden_size});
  EXPECT_TRUE(at::equal(blk.run(x, one_each), blk.run(x, none)));
  // One row with two documents: every row gets the mask.
  at::Tensor two = docs.clone();
  two[1].narrow(0, 6, 4).fill_(7);
  EXPECT_TRUE(make_attention_context(blk.c, {tokens, two}, at::kFloat).mask.defined());
}

TEST(Attention, RepeatedKeyValueHeadsEqualGroupedOnesUnderAMask) {
  Block blk;
  at::manual_seed(13);
  const at::Tensor tokens = at::zeros({2, 16}, at::kLong);
  const at::Tensor docs = at::cat({at::zeros({2, 6}, at::kLong), at::ones({2, 10}, at::kLong)}, 1);
  AttentionContext ctx = make_attention_context(blk.c, {tokens, docs}, at::kFloat);
  ASSERT_TRUE(ctx.mask.defined());
  const at::Tensor x0 = at::randn({2, 16, blk.c.hidden_size});
  auto forward_backward = [&](bool expand) {
    ctx.expand_kv_heads = expand;
    std::vector<at::Tensor> w;
    for (const at::Tensor& t : blk.w)
      w.push_back(t.clone().requires_grad_(true));
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = block_forward(blk.c, BlockWeights::bind(blk.spec, w), x, ctx);
    (y * y).sum().backward();
    std::vector<at::Tensor> out{y.detach(), x.grad()};
    for (const at::Tensor& t : w)
      out.push_back(t.grad());
    return out;
  };
  const std::vector<at::Tensor> grouped = forward_backward(false),
                                repeated = forward_backward(true);
  ASSERT_EQ(grouped.size(), repeated.size());
  for (std::size_t i = 0; i < grouped.size(); ++i)
    EXPECT_LE(max_rel(repeated[i], grouped[i]), 1e-6) << "output " << i;
}

}  // namespace
}  // namespace rondo::models
