// Sequence tiling (AttentionContext::mlp_tile_tokens): a dense block's MLP run over tiles of the
// flattened batch — in the forward without autograd, in the backward recomputed tile by tile —
// gives the outputs and gradients of the untiled block: forward stages, the backward from
// checkpoints in stage and layer grain, and the fused tail's forward and backward, with LoRA
// dropout drawing the same mask per token whatever the tile. The untiled path itself is checked
// against transformers and peft by the oracle tests (tests/oracle/test_engine.py runs a tiled
// plan too).
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
    {"qwen3", R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":29,"hidden_size":16,
      "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":8,"rms_norm_eps":1e-6})"},
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
  // LoRA on every projection, its dropout on: the tiles must draw the whole batch's mask.
  const LoraConfig lora{.rank = 4, .alpha = 8, .dropout = 0.3, .targets = {"all-linear"}};
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
  const at::Tensor x = at::randn({2, 9, c.hidden_size});

  // Forward without autograd (forward stages, evaluation).
  {
    c10::AutoGradMode no_grad(false);
    expect_close(block_forward(c, BlockWeights::bind(specs[1], w[0]), x, tiled),
                 block_forward(c, BlockWeights::bind(specs[1], w[0]), x, whole), "forward");
  }

  // The LoRA adapters train (the base is frozen), as in a LoRA run; the norms too, so that a
  // full weight's gradient through the tiles is checked.
  auto runs_with = [&](std::vector<std::vector<at::Tensor>>& grads) {
    std::vector<BlockRun> runs;
    grads.assign(3, {});
    for (int b = 0; b < 3; ++b) {
      for (std::size_t i = 0; i < w[b].size(); ++i) {
        const std::string& name = specs[b + 1].params[i].name;
        const bool trained = is_lora_param(name) || name.find("norm") != std::string::npos;
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
  std::vector<at::Tensor> saved;
  {
    c10::AutoGradMode no_grad(false);
    at::Tensor h = x;
    for (int b = 0; b < 3; ++b) {
      saved.push_back(h);
      h = block_forward(c, BlockWeights::bind(specs[b + 1], w[b]), h, whole);
    }
  }
  for (const auto& inputs : {std::vector<at::Tensor>{saved[0]}, saved}) {
    const std::string grain = inputs.size() == 1 ? "stage grain" : "layer grain";
    std::vector<std::vector<at::Tensor>> got, want;
    std::vector<BlockRun> tiled_runs = runs_with(got), whole_runs = runs_with(want);
    expect_close(blocks_backward(c, tiled_runs, inputs, tiled, grad_out),
                 blocks_backward(c, whole_runs, inputs, whole, grad_out), grain + ": input");
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

INSTANTIATE_TEST_SUITE_P(Families, Tiling, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace rondo::models
