// Sequence tiling (AttentionContext::mlp_tile_tokens): a block's attention half (its norm, q, k, v
// and o projections, q and k's norms and the rotary positions, around one whole attention) and
// its MLP (dense, or a sparse block's router and experts with the load-balancing loss) run over
// tiles of the flattened batch — in the forward without autograd, in the backward recomputed tile
// by tile — gives the outputs and
// gradients of the untiled block: forward stages, the backward from checkpoints in stage and
// layer grain, and the fused tail's forward and backward, with LoRA dropout drawing the same mask
// per token whatever the tile. The untiled path itself is checked against transformers and peft
// by the oracle tests (tests/oracle/test_engine.py runs a tiled plan too).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <ostream>
#include <random>

#include "models/layers.h"
#include "models/lora.h"
#include "models/model.h"

namespace rondo::models {
namespace {

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  const double scale = std::max(1e-12, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>() / scale, 2e-5) << what;
}

struct Case {
  const char* name;
  const char* config;
};

const Case kCases[] = {
    {"llama", R"({"architectures":["LlamaForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"mlp_bias":true,"rms_norm_eps":1e-5})"},
    // q, k and v with biases (which train here): recomputed for their gradients alone.
    {"qwen2", R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"rms_norm_eps":1e-6})"},
    {"qwen3", R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":8,"rms_norm_eps":1e-6})"},
    // Sparse blocks (block 1 dense), the router's load-balancing loss on: the routing record
    // adds up over the tiles, and each tile's backward takes its share of the aux loss.
    {"qwen3_moe", R"({"architectures":["Qwen3MoeForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":8,"rms_norm_eps":1e-6,"num_experts":6,
      "num_experts_per_tok":2,"moe_intermediate_size":12,"mlp_only_layers":[1],
      "norm_topk_prob":true,"output_router_logits":true,"router_aux_loss_coef":0.02})"},
    // Attention sinks (the plain attention path), biases on every projection, fused experts
    // with their own biases, a sliding window on alternate layers, YaRN positions.
    {"gpt_oss", R"({"architectures":["GptOssForCausalLM"],"vocab_size":33,"hidden_size":16,
      "intermediate_size":12,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":8,"num_local_experts":4,"num_experts_per_tok":2,
      "sliding_window":3,"swiglu_limit":1.0,"output_router_logits":true,
      "router_aux_loss_coef":0.05,"rms_norm_eps":1e-5,
      "rope_parameters":{"rope_type":"yarn","factor":4.0,"beta_fast":32.0,"beta_slow":1.0,
      "truncate":false,"original_max_position_embeddings":64,"rope_theta":150000.0}})"},
    {"mixtral", R"({"architectures":["MixtralForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":20,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"rms_norm_eps":1e-5,"num_local_experts":4,
      "num_experts_per_tok":2,"output_router_logits":true,"router_aux_loss_coef":0.02})"},
};

// Names the case in test output (not its bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class Tiling : public ::testing::TestWithParam<Case> {};

TEST_P(Tiling, TiledMlpEqualsTheWholeBatchForwardAndBackward) {
  const auto seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  at::manual_seed(seed);
  const ModelConfig c = parse_hf_config(GetParam().config, "test config");
  // LoRA on every projection, its dropout on: the tiles must draw the whole batch's mask (not
  // on experts and routers, which PEFT cannot give dropout).
  const bool moe = c.num_experts > 0;
  const LoraConfig lora{
      .rank = 4, .alpha = 8, .dropout = moe ? 0.0 : 0.3, .targets = {"all-linear"}};
  const std::vector<LayerSpec> specs = add_lora(layer_specs(c), lora);
  std::vector<std::vector<at::Tensor>> w;
  for (int b = 1; b <= 3; ++b) {
    std::vector<at::Tensor> t;
    for (const ParamSpec& p : specs[b].params)
      t.push_back(0.2 * at::randn(p.shape) + (p.shape.size() == 1 ? 1 : 0));
    w.push_back(t);
  }
  const TokenBatch batch{
      at::randint(0, c.vocab_size, {2, 9}, at::kLong),
      at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1}, at::kLong).view({2, 9})};
  AttentionContext whole = make_attention_context(c, batch, at::kFloat);
  whole.dropout_seed = 11;
  AttentionContext tiled = whole;
  tiled.mlp_tile_tokens = 5;  // 18 tokens: tiles of 5, 5, 5, 3, crossing the rows
  // Each its own routing record, written by the forwards (as a microbatch's forward jobs and
  // tail do) and read by the backward.
  auto route = [moe](AttentionContext& ctx, bool record) {
    if (!moe) return;
    if (!ctx.routing) ctx.routing = std::make_shared<RoutingRecord>();
    ctx.record_routing = record;
    ctx.aux_loss_weight = record ? 0 : 0.7;  // a backward differentiates the aux loss
  };
  const at::Tensor x = at::randn({2, 9, c.hidden_size});

  // Forward without autograd (forward stages, evaluation).
  {
    c10::AutoGradMode no_grad(false);
    route(whole, true);
    route(tiled, true);
    const int b = c.sparse(0) ? 0 : 1;  // a sparse block, in a sparse model (layer b + 1)
    expect_close(block_forward(c, BlockWeights::bind(specs[b + 1], w[b]), x, tiled),
                 block_forward(c, BlockWeights::bind(specs[b + 1], w[b]), x, whole), "forward");
    if (moe) {  // the tiles' routing adds up to the whole batch's
      const BlockRouting& t = tiled.routing->blocks.at(b);
      const BlockRouting& u = whole.routing->blocks.at(b);
      EXPECT_EQ(t.counts, u.counts);
      EXPECT_EQ(t.tokens, u.tokens);
      expect_close(t.prob_sums, u.prob_sums, "routing record");
      EXPECT_EQ(t.by_row.size(), 4u);  // one entry a tile
    }
  }

  // The LoRA adapters train (the base is frozen), as in a LoRA run; the norms and biases too, so
  // that full weights' gradients through the tiles are checked.
  auto runs_with = [&](std::vector<std::vector<at::Tensor>>& grads) {
    std::vector<BlockRun> runs;
    grads.assign(3, {});
    for (int b = 0; b < 3; ++b) {
      for (std::size_t i = 0; i < w[b].size(); ++i) {
        const std::string& name = specs[b + 1].params[i].name;
        // A sparse model trains everything: the router's gradient takes the aux loss.
        const bool trained = moe || is_lora_param(name) || name.find("norm") != std::string::npos ||
                             name.find("bias") != std::string::npos;
        grads[b].push_back(trained ? at::full_like(w[b][i], 0.5) : at::Tensor());
      }
      runs.push_back({.spec = &specs[b + 1], .weights = w[b], .grads = &grads[b]});
    }
    return runs;
  };
  auto expect_same_grads = [&](const std::vector<std::vector<at::Tensor>>& got,
                               const std::vector<std::vector<at::Tensor>>& want,
                               const std::string& what) {
    for (int b = 0; b < 3; ++b)
      for (std::size_t i = 0; i < want[b].size(); ++i)
        if (want[b][i].defined())
          expect_close(got[b][i], want[b][i], what + " " + specs[b + 1].params[i].name);
  };
  const at::Tensor grad_out = at::randn({2, 9, c.hidden_size});

  // Backward from checkpoints: stage grain (one saved input), then layer grain (one per block).
  // The forward that saved them (and recorded the routing) is tiled for the tiled backward.
  std::vector<at::Tensor> saved, saved_tiled;
  {
    c10::AutoGradMode no_grad(false);
    at::Tensor h = x, h_tiled = x;
    for (int b = 0; b < 3; ++b) {
      saved.push_back(h);
      saved_tiled.push_back(h_tiled);
      h = block_forward(c, BlockWeights::bind(specs[b + 1], w[b]), h, whole);
      h_tiled = block_forward(c, BlockWeights::bind(specs[b + 1], w[b]), h_tiled, tiled);
    }
    expect_close(h_tiled, h, "forward of 3 blocks");
  }
  route(whole, false);
  route(tiled, false);
  for (bool stage : {true, false}) {
    const std::string grain = stage ? "stage grain" : "layer grain";
    auto inputs = [stage](const std::vector<at::Tensor>& all) {
      return stage ? std::vector<at::Tensor>{all[0]} : all;
    };
    std::vector<std::vector<at::Tensor>> got, want;
    std::vector<BlockRun> tiled_runs = runs_with(got), whole_runs = runs_with(want);
    expect_close(blocks_backward(c, tiled_runs, inputs(saved_tiled), tiled, grad_out),
                 blocks_backward(c, whole_runs, inputs(saved), whole, grad_out), grain + ": input");
    expect_same_grads(got, want, grain);
  }

  // The fused tail: forward under autograd, a head's gradient of the output, backward.
  at::Tensor out_tiled, out_whole;
  auto head = [&](at::Tensor& seen) {
    return [&seen](const at::Tensor& h) {
      seen = h.clone();
      return at::tanh(h);  // a gradient that depends on the output
    };
  };
  // The tail records its blocks' routing in its forward and differentiates the aux loss.
  for (AttentionContext* ctx : {&whole, &tiled}) {
    route(*ctx, true);
    ctx->aux_loss_weight = moe ? 0.7 : 0;
  }
  std::vector<std::vector<at::Tensor>> got, want;
  std::vector<BlockRun> tiled_runs = runs_with(got), whole_runs = runs_with(want);
  for (BlockRun& r : tiled_runs)
    r.overwrite = true;
  for (BlockRun& r : whole_runs)
    r.overwrite = true;
  expect_close(blocks_forward_backward(c, tiled_runs, x, tiled, head(out_tiled)),
               blocks_forward_backward(c, whole_runs, x, whole, head(out_whole)), "tail: input");
  expect_close(out_tiled, out_whole, "tail: output");
  expect_same_grads(got, want, "tail");
}

// Note [RMSNorm below fp32 under autograd] (models/layers.cpp): in bf16 under autograd the norm
// keeps only its input and a scale a token. Its output is bit for bit the op-by-op one; its
// gradients (input and weight, for the usual norm and GPT-OSS's fp32 weight product) are those of
// the same function differentiated by autograd in f64 from the same bf16 values, within bf16
// rounding.
TEST(RmsNorm, LeanNormInBf16EqualsTheOpByOpForwardAndF64Gradients) {
  at::manual_seed(3);
  for (const char* arch : {"LlamaForCausalLM", "GptOssForCausalLM"}) {
    SCOPED_TRACE(arch);
    ModelConfig c;
    c.family = std::string(arch) == "GptOssForCausalLM" ? Family::kGptOss : Family::kLlama;
    c.rms_norm_eps = 1e-5;
    const at::Tensor x = (3 * at::randn({2, 5, 64})).to(at::kBFloat16);
    const at::Tensor w = (1 + 0.3 * at::randn({64})).to(at::kBFloat16);
    // A gradient along the input too, so that the norm's own term (through the mean) is large.
    const at::Tensor g = (0.3 * x.to(at::kFloat) + at::randn({2, 5, 64})).to(at::kBFloat16);
    at::Tensor plain;
    {
      c10::AutoGradMode no_grad(false);  // op by op
      plain = rms_norm(c, x, w);
    }
    const at::Tensor xl = x.detach().requires_grad_(true), wl = w.detach().requires_grad_(true);
    const at::Tensor lean = rms_norm(c, xl, wl);
    EXPECT_TRUE(at::equal(lean, plain));
    lean.backward(g);
    const at::Tensor x64 = x.to(at::kDouble).requires_grad_(true);
    const at::Tensor w64 = w.to(at::kDouble).requires_grad_(true);
    const at::Tensor n = x64 * at::rsqrt(x64.pow(2).mean(-1, true) + c.rms_norm_eps);
    (w64 * n).backward(g.to(at::kDouble));
    auto rel = [](const at::Tensor& got, const at::Tensor& want) {
      return ((got.to(at::kDouble) - want).abs().max() / want.abs().max()).item<double>();
    };
    std::printf("%s: input gradient %.3g, weight gradient %.3g off (relative to max)\n", arch,
                rel(xl.grad(), x64.grad()), rel(wl.grad(), w64.grad()));
    EXPECT_LE(rel(xl.grad(), x64.grad()), 1e-2);
    EXPECT_LE(rel(wl.grad(), w64.grad()), 1e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Tiling, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace rondo::models
