// Attention over packed rows: a document in a packed row attends as it would alone; rows that
// each hold one document carry no mask (so that the fused kernels can run them); the repeated
// key/value heads that let the memory-efficient kernel take a mask with grouped-query heads give
// what the grouped heads give, values and gradients; and attention per document (the CPU's choice
// for documents of 32 tokens or more) gives what the mask gives.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "models/attention_masks.h"
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

// The documents of packed rows as offsets into the flattened tokens: a row boundary ends a
// document even when the next row starts with the same id.
TEST(Attention, DocumentSpansSplitAtRowsAndIdChanges) {
  const at::Tensor docs = at::tensor({0, 0, 1, 1, 1, 1, 2, 2, 3}, at::kLong).view({3, 3});
  const DocSpans s = doc_spans(docs);
  EXPECT_EQ(s.offsets, (std::vector<std::int64_t>{0, 2, 3, 6, 8, 9}));
  EXPECT_EQ(s.max_len, 3);
  EXPECT_TRUE(at::equal(s.offsets_tensor(), at::tensor({0, 2, 3, 6, 8, 9}, at::kInt)));
  EXPECT_TRUE(doc_spans(at::Tensor()).offsets.empty());
}

// Packed rows whose documents average 32 tokens or more attend one document at a time on the CPU
// (no mask is built): outputs and every gradient equal the masked attention's, in float64, with
// grouped-query heads and a document of one token.
TEST(Attention, PerDocumentAttentionEqualsTheMaskOnTheCpu) {
  Block blk;
  for (at::Tensor& t : blk.w)
    t = t.to(at::kDouble);
  at::manual_seed(14);
  const std::int64_t T = 96;
  const at::Tensor docs = at::cat({at::full({1, 40}, 0, at::kLong), at::full({1, 55}, 1, at::kLong),
                                   at::full({1, 1}, 2, at::kLong), at::full({1, 70}, 3, at::kLong),
                                   at::full({1, 26}, 4, at::kLong)},
                                  1)
                              .view({2, T});
  const TokenBatch batch{at::zeros({2, T}, at::kLong), docs};
  const AttentionContext per_doc = make_attention_context(blk.c, batch, at::kDouble);
  ASSERT_EQ(per_doc.doc_offsets, (std::vector<std::int64_t>{0, 40, 95, 96, 166, 192}));
  EXPECT_FALSE(per_doc.mask.defined()) << "no mask is built for attention per document";
  AttentionContext masked = attention_context_without_masks(blk.c, batch, at::kDouble);
  limit_attention(masked, blk.c, docs, DocSpans{}, at::kCPU, at::kDouble);  // no spans: masks
  ASSERT_TRUE(masked.mask.defined());
  ASSERT_TRUE(masked.doc_offsets.empty());
  const at::Tensor x0 = at::randn({2, T, blk.c.hidden_size}, at::kDouble);
  auto forward_backward = [&](const AttentionContext& ctx) {
    std::vector<at::Tensor> w;
    for (const at::Tensor& t : blk.w)
      w.push_back(t.clone().requires_grad_(true));
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = block_forward(blk.c, BlockWeights::bind(blk.spec, w), x, ctx);
    (y * y.sin()).sum().backward();
    std::vector<at::Tensor> out{y.detach(), x.grad()};
    for (const at::Tensor& t : w)
      out.push_back(t.grad());
    return out;
  };
  const std::vector<at::Tensor> a = forward_backward(per_doc), b = forward_backward(masked);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_LE(max_rel(a[i], b[i]), 1e-12) << "output " << i;
}

// Which packed rows attend per document on the CPU: documents of 32 tokens or more on average,
// no window shorter than a document, no attention dropout or sinks (their path needs the mask).
TEST(Attention, ThePerDocumentChoiceOnTheCpu) {
  const ModelConfig c = gqa_config();
  auto spans_of = [](std::vector<std::int64_t> lengths) {
    DocSpans s{{0}, 0};
    for (std::int64_t l : lengths) {
      s.offsets.push_back(s.offsets.back() + l);
      s.max_len = std::max(s.max_len, l);
    }
    return s;
  };
  EXPECT_TRUE(attend_per_document(c, spans_of({32, 32}), at::kCPU, at::kFloat));
  EXPECT_TRUE(attend_per_document(c, spans_of({1, 63}), at::kCPU, at::kFloat));
  EXPECT_FALSE(attend_per_document(c, spans_of({31, 32}), at::kCPU, at::kFloat));
  EXPECT_FALSE(attend_per_document(c, DocSpans{}, at::kCPU, at::kFloat));
  ModelConfig windowed = c;
  windowed.sliding_window = 48;
  EXPECT_TRUE(attend_per_document(windowed, spans_of({48, 40}), at::kCPU, at::kFloat));
  EXPECT_FALSE(attend_per_document(windowed, spans_of({49, 40}), at::kCPU, at::kFloat));
  ModelConfig dropout = c;
  dropout.attention_dropout = 0.1;
  EXPECT_FALSE(attend_per_document(dropout, spans_of({64, 64}), at::kCPU, at::kFloat));
  ModelConfig sinks = c;
  sinks.attention_sinks = true;
  EXPECT_FALSE(attend_per_document(sinks, spans_of({64, 64}), at::kCPU, at::kFloat));
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
