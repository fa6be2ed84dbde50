// The block itself (layers.h): binding a block's weights by name, its forward (projections with
// their LoRA adapters, RMSNorm, the MLP; attention from attention.cpp, a sparse MLP from moe.cpp),
// the embedding, the head with its chunked loss, and the backward of runs of blocks. Touches only
// the tensors handed to it. Used by the engine, generation and export.
#include "models/layers.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <map>
#include <string>

#include "kernels/error.h"

namespace rondo::models {

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

// Note [Projections recomputed for their gradients alone]
// A tiled backward (attention_backward_tiled, mlp_backward_by_tiles) recomputes each tile's
// norm, projections and MLP under autograd only to backpropagate through them. A linear layer's
// backward needs its input and weight, never its output: where nothing between a projection and
// the tile's graph outputs needs the projection's values (o; v; q and k, whose rotation is linear
// in them, unless they have norms; the MLP's down), it runs as BackwardOnlyLinear, whose forward
// computes nothing (zeros of the output's shape) and whose backward is the linear layer's. The
// recompute then costs those projections' backward alone, as untiled training does.
struct BackwardOnlyLinear : torch::autograd::Function<BackwardOnlyLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    std::vector<std::int64_t> sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return at::zeros(sizes, x.options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor g = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor g_x, g_weight;
    if (ctx->needs_input_grad(0)) g_x = g.mm(weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) g_weight = g.t().mm(x.reshape({-1, x.size(-1)}));
    return {g_x, g_weight};
  }
};

std::int64_t mix_seed(std::int64_t seed, std::int64_t a, std::int64_t b) {
  std::uint64_t z = static_cast<std::uint64_t>(seed) * 1000003u + static_cast<std::uint64_t>(a);
  z = z * 1000003u + static_cast<std::uint64_t>(b);
  return static_cast<std::int64_t>(z >> 1);
}

// A projection of a block, with its LoRA adapter when it has one (as PEFT computes it). `row`
// is the token row of the batch (flattened, B * T) that x's first row is: a tile of tokens draws
// the LoRA dropout the whole batch draws for those tokens. Without `values`, only its gradients
// are right (Note [Projections recomputed for their gradients alone]).
at::Tensor project(const BlockWeights& w, BlockWeights::Projection p, const at::Tensor& x,
                   const at::Tensor& weight, const at::Tensor& bias, const AttentionContext& ctx,
                   std::int64_t row = 0, bool values = true) {
  at::Tensor y = values           ? linear(x, weight, bias)
                 : bias.defined() ? BackwardOnlyLinear::apply(x, weight) + bias
                                  : BackwardOnlyLinear::apply(x, weight);
  if (!w.lora_a[p].defined()) return y;
  at::Tensor in = x;
  if (w.lora_dropout > 0 && ctx.dropout_seed >= 0)
    in = seeded_dropout(x, w.lora_dropout, mix_seed(ctx.dropout_seed, w.block, 16 + p),
                        row * x.size(-1));
  return y + at::linear(at::linear(in, w.lora_a[p]), w.lora_b[p]) * w.lora_scaling;
}

// A sparse block's router or expert tensor (Qwen3-MoE's mlp.*, Mixtral's block_sparse_moe.*).
bool bind_expert(const std::string& local, const at::Tensor& t, BlockWeights& w) {
  for (const char* moe : {"mlp.gate.weight", "block_sparse_moe.gate.weight"})
    if (local == moe) {
      w.router = t;
      return true;
    }
  std::int64_t e = 0;
  int p = 0;
  if (!parse_expert_name("." + local, &e, &p)) return false;
  std::vector<at::Tensor>& list = p == 0 ? w.expert_gate : p == 1 ? w.expert_up : w.expert_down;
  if (list.size() <= static_cast<std::size_t>(e)) list.resize(static_cast<std::size_t>(e) + 1);
  list[static_cast<std::size_t>(e)] = t;
  return true;
}
}  // namespace

BlockWeights BlockWeights::bind(const LayerSpec& spec, const std::vector<at::Tensor>& tensors) {
  RONDO_ASSERT(spec.kind == LayerKind::kBlock);
  if (tensors.size() != spec.params.size())
    throw InternalError("block " + std::to_string(spec.block) + ": " +
                        std::to_string(tensors.size()) + " tensors for " +
                        std::to_string(spec.params.size()) + " parameters");
  static const std::map<std::string, at::Tensor BlockWeights::*> kFields = {
      {"input_layernorm.weight", &BlockWeights::input_norm},
      {"self_attn.q_proj.weight", &BlockWeights::q},
      {"self_attn.q_proj.bias", &BlockWeights::q_bias},
      {"self_attn.k_proj.weight", &BlockWeights::k},
      {"self_attn.k_proj.bias", &BlockWeights::k_bias},
      {"self_attn.v_proj.weight", &BlockWeights::v},
      {"self_attn.v_proj.bias", &BlockWeights::v_bias},
      {"self_attn.o_proj.weight", &BlockWeights::o},
      {"self_attn.o_proj.bias", &BlockWeights::o_bias},
      {"self_attn.q_norm.weight", &BlockWeights::q_norm},
      {"self_attn.k_norm.weight", &BlockWeights::k_norm},
      {"post_attention_layernorm.weight", &BlockWeights::post_norm},
      {"mlp.gate_proj.weight", &BlockWeights::gate},
      {"mlp.gate_proj.bias", &BlockWeights::gate_bias},
      {"mlp.up_proj.weight", &BlockWeights::up},
      {"mlp.up_proj.bias", &BlockWeights::up_bias},
      {"mlp.down_proj.weight", &BlockWeights::down},
      {"mlp.down_proj.bias", &BlockWeights::down_bias},
      {"self_attn.sinks", &BlockWeights::sinks},
      {"mlp.router.weight", &BlockWeights::router},
      {"mlp.router.bias", &BlockWeights::router_bias},
      {"mlp.experts.gate_up_proj", &BlockWeights::fused_gate_up},
      {"mlp.experts.gate_up_proj_bias", &BlockWeights::fused_gate_up_bias},
      {"mlp.experts.down_proj", &BlockWeights::fused_down},
      {"mlp.experts.down_proj_bias", &BlockWeights::fused_down_bias},
  };
  static const std::map<std::string, BlockWeights::Projection> kProjections = {
      {"self_attn.q_proj", BlockWeights::kQ}, {"self_attn.k_proj", BlockWeights::kK},
      {"self_attn.v_proj", BlockWeights::kV}, {"self_attn.o_proj", BlockWeights::kO},
      {"mlp.gate_proj", BlockWeights::kGate}, {"mlp.up_proj", BlockWeights::kUp},
      {"mlp.down_proj", BlockWeights::kDown}};
  const std::string prefix = "model.layers." + std::to_string(spec.block) + ".";
  const std::string lora_prefix = "base_model.model." + prefix;
  BlockWeights w;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = spec.params[i].name;
    if (name.rfind(lora_prefix, 0) ==
        0) {  // base_model.model.model.layers.3.mlp.up_proj.lora_A.weight
      const std::string local = name.substr(lora_prefix.size());
      if (local.rfind("mlp.gate.lora_", 0) == 0 ||
          local.rfind("mlp.router.lora_", 0) == 0) {  // the router's (gate.weight, router.weight)
        (local.find(".lora_A.") != std::string::npos ? w.router_lora_a : w.router_lora_b) =
            tensors[i];
        continue;
      }
      if (local.rfind("mlp.experts.", 0) == 0) {  // PEFT's adapters on the fused experts
        const int which = local.find(".base_layer.") != std::string::npos ? 0
                          : spec.lora_experts_down                        ? 1
                                                                          : 0;
        (local.find(".lora_A.") != std::string::npos ? w.expert_lora_a : w.expert_lora_b)[which] =
            tensors[i];
        w.expert_lora_scaling[which] = which == 0 ? spec.lora_fused_scaling : spec.lora_scaling;
        continue;
      }
      const std::size_t cut = local.find(".lora_");
      auto it =
          cut == std::string::npos ? kProjections.end() : kProjections.find(local.substr(0, cut));
      RONDO_ASSERT_MSG(it != kProjections.end(), "unknown LoRA parameter " + name);
      (local.compare(cut, 8, ".lora_A.") == 0 ? w.lora_a : w.lora_b)[it->second] = tensors[i];
      continue;
    }
    std::string local = name.substr(prefix.size());
    if (bind_expert(local, tensors[i], w)) continue;
    auto it = kFields.find(local);
    RONDO_ASSERT_MSG(it != kFields.end(), "unknown block parameter " + spec.params[i].name);
    w.*(it->second) = tensors[i];
  }
  w.block = spec.block;
  w.lora_scaling = spec.lora_scaling;
  w.lora_dropout = spec.lora_dropout;
  return w;
}

namespace {

// RMSNorm's forward as Hugging Face computes it, from its fp32 (or f64) input `h` and reciprocal
// root mean square `r`, back in `dtype`.
at::Tensor rms_output(bool gpt_oss, const at::Tensor& weight, const at::Tensor& h,
                      const at::Tensor& r, at::ScalarType dtype) {
  if (gpt_oss) return (weight * (h * r)).to(dtype);
  return weight * (h * r).to(dtype);
}

// Note [RMSNorm below fp32 under autograd]
// Differentiated op by op, rms_norm on bf16 or fp16 activations keeps the fp32 copy of its input
// (4 bytes a value, twice the input's own) until the backward: with two norms a block, that copy
// is a fifth of a bf16 block's activations. This function keeps only the input (which the caller
// holds anyway) and the fp32 reciprocal root mean square of each token, and recomputes the rest
// in the backward. Its forward runs the same ops as rms_norm, so its output is bit for bit the
// same; its backward is the same math in fp32, so its gradients differ only in rounding.
struct LeanRmsNorm : torch::autograd::Function<LeanRmsNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps, bool gpt_oss) {
    const at::Tensor h = x.to(at::kFloat);
    const at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, r});
    ctx->saved_data["gpt_oss"] = gpt_oss;
    return rms_output(gpt_oss, weight, h, r, x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &r = saved[2];
    const bool gpt_oss = ctx->saved_data["gpt_oss"].toBool();
    const at::Tensor& g = grads[0];
    const at::Tensor h = x.to(at::kFloat);
    at::Tensor g_normed, g_weight;
    auto weight_grad = [&](const at::Tensor& per_token) {  // summed to the weight's shape
      return per_token.reshape({-1, per_token.size(-1)}).sum(0).to(weight.scalar_type());
    };
    if (gpt_oss) {  // (w * normed).to(dtype), all in fp32 (w promoted)
      const at::Tensor g32 = g.to(at::kFloat);
      if (ctx->needs_input_grad(1)) g_weight = weight_grad(g32 * (h * r));
      g_normed = g32 * weight;
    } else {  // w * normed.to(dtype), in the activations' dtype
      if (ctx->needs_input_grad(1)) g_weight = weight_grad(g * (h * r).to(x.scalar_type()));
      g_normed = (g * weight).to(at::kFloat);
    }
    // normed = h * (mean(h^2) + eps)^-1/2: dh = g r - h r^3 mean(g h), in place (the backward
    // holds h, the gradient and one temporary at most).
    const at::Tensor dot = (g_normed * h).mean(-1, /*keepdim=*/true);
    at::Tensor& g_h = g_normed.mul_(r);
    g_h.addcmul_(h, r.pow(3) * dot, -1);
    return {g_h.to(x.scalar_type()), g_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const ModelConfig& c, const at::Tensor& x, const at::Tensor& weight) {
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (reduced && at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return LeanRmsNorm::apply(x, weight, c.rms_norm_eps, c.family == Family::kGptOss);
  at::Tensor h = x.to(at::promote_types(x.scalar_type(), at::kFloat));  // f64 stays f64
  const at::Tensor r = at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + c.rms_norm_eps);
  return rms_output(c.family == Family::kGptOss, weight, h, r, x.scalar_type());
}

namespace {
// A 32-bit integer hash (Chris Wellons' lowbias32) on int64 tensors holding values < 2^32; the
// multiplications are split in 16-bit halves so that no product overflows int64.
at::Tensor hash32(at::Tensor x) {
  const std::int64_t m32 = 0xffffffffLL;
  auto mul = [&](const at::Tensor& v, std::int64_t c) {
    at::Tensor lo = v.bitwise_and(0xffff), hi = v.bitwise_right_shift(16);
    return (lo * c + (hi * c).bitwise_and(0xffff).bitwise_left_shift(16)).bitwise_and(m32);
  };
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = mul(x, 0x7feb352dLL);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = mul(x, 0x846ca68bLL);
  return x.bitwise_xor(x.bitwise_right_shift(16));
}
}  // namespace

at::Tensor seeded_dropout(const at::Tensor& x, double p, std::int64_t seed,
                          std::int64_t first_index) {
  if (p <= 0) return x;
  const std::int64_t m32 = 0xffffffffLL;
  const std::int64_t s_lo = seed & m32, s_hi = (seed >> 32) & m32;
  const auto threshold = static_cast<std::int64_t>(p * 4294967296.0);
  // The mask in x's dtype, hashed a slice of kSlice values at a time: the hash's int64
  // intermediates take 8 bytes a value, several at once (about 40 bytes for each of x's values
  // unsliced: 10 GiB for one projection's input of 131,072 tokens by 2,048), and bounded so they
  // stay within a few tens of MiB whatever the sequence.
  constexpr std::int64_t kSlice = std::int64_t{1} << 21;
  const std::int64_t n = x.numel();
  at::Tensor keep = at::empty(x.sizes(), x.options());  // row-major: flat index = x's
  at::Tensor flat = keep.view({-1});
  for (std::int64_t start = 0; start < n; start += kSlice) {
    const std::int64_t len = std::min(kSlice, n - start);
    const at::Tensor idx =
        at::arange(first_index + start, first_index + start + len, x.options().dtype(at::kLong));
    at::Tensor h = hash32(idx.bitwise_right_shift(32).bitwise_xor(s_hi));
    h = hash32(h.bitwise_xor(idx.bitwise_and(m32)).bitwise_xor(s_lo));
    h = hash32(h.bitwise_xor(s_lo));
    flat.narrow(0, start, len).copy_(h.ge(threshold));
  }
  return x * keep * (1.0 / (1.0 - p));
}

at::Tensor embed(const at::Tensor& embed_weight, const at::Tensor& tokens) {
  return at::embedding(embed_weight, tokens);
}

namespace {

// The block's first half: x + attn(norm(x)).
at::Tensor attention_half(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
                          const AttentionContext& ctx, KvCache* cache) {
  const std::int64_t B = x.size(0), T = x.size(1), H = c.num_heads, KV = c.num_kv_heads,
                     D = c.head_dim;
  at::Tensor h = rms_norm(c, x, w.input_norm);
  at::Tensor q = project(w, BlockWeights::kQ, h, w.q, w.q_bias, ctx).view({B, T, H, D});
  at::Tensor k = project(w, BlockWeights::kK, h, w.k, w.k_bias, ctx).view({B, T, KV, D});
  at::Tensor v = project(w, BlockWeights::kV, h, w.v, w.v_bias, ctx).view({B, T, KV, D});
  if (c.qk_norm) {
    q = rms_norm(c, q, w.q_norm);
    k = rms_norm(c, k, w.k_norm);
  }
  q = q.transpose(1, 2);  // (B, H, T, D)
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  at::Tensor a = attend(c, w, q, k, v, ctx, cache);
  a = a.transpose(1, 2).reshape({B, T, H * D});
  return x + project(w, BlockWeights::kO, a, w.o, w.o_bias, ctx);
}

// A block's MLP with its norm on tokens whose first is row `row` of the flattened batch: for
// n = norm(out), down(silu(gate(n)) * up(n)), or a sparse block's experts (moe_mlp). Without
// `values` a dense MLP's output is zeros and only its gradients are right (down runs as
// BackwardOnlyLinear).
at::Tensor block_mlp(const ModelConfig& c, const BlockWeights& w, const at::Tensor& out,
                     const AttentionContext& ctx, std::int64_t row, bool values = true) {
  const at::Tensor h = rms_norm(c, out, w.post_norm);
  if (w.router.defined()) return moe_mlp(c, w, h, ctx, row);
  const at::Tensor gated =
      at::silu(project(w, BlockWeights::kGate, h, w.gate, w.gate_bias, ctx, row)) *
      project(w, BlockWeights::kUp, h, w.up, w.up_bias, ctx, row);
  return project(w, BlockWeights::kDown, gated, w.down, w.down_bias, ctx, row, values);
}

template <typename F>
void for_each_tile(std::int64_t rows, std::int64_t tile, const F& f) {
  for (std::int64_t r = 0; r < rows; r += tile)
    f(r, std::min(tile, rows - r));
}

// Note [Sequence tiling of the attention half]
// Of a block's first half, x + o(attention(rope(q(n), k(n), v(n)))) with n = norm(x), only
// attention itself mixes tokens. The rest runs over tiles of AttentionContext::mlp_tile_tokens
// tokens of the flattened batch (B * T): the norm, the q, k and v projections (with their LoRA
// adapters and dropout, drawn per token as the whole batch draws it), q and k's norms and the
// rotary positions write each tile's rows of the rotated q, k and v; attention runs once over
// them whole (its kernels never hold tokens x tokens); o and the residual run by tiles again.
// What spans the sequence is x, the rotated q, k and v, attention's output (and its logsumexp)
// and the half's output; the normed input, the projections before their norms and rotation, and
// their fp32 transients exist for one tile. In training (attention_forward_tiled) q, k and v are
// leaves of a graph holding attention alone; the backward (attention_backward_tiled) takes o's
// gradient tile by tile, attention's once, then recomputes each tile's norm, projections and
// rotation under autograd and backpropagates them (o, v, and q and k without norms, for their
// gradients alone: Note [Projections recomputed for their gradients alone]).

struct QkvTile {
  at::Tensor q, k, v;  // (n, H, D), (n, KV, D), (n, KV, D); q and k rotated
};

// The rotated q, k and v of `x` (n, C), tokens from row `row` of the flattened batch on. Without
// `values`, for a backward: only their gradients are right (q and k's values too where they have
// norms, whose backward needs them).
QkvTile qkv_tile(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
                 const AttentionContext& ctx, std::int64_t row, bool values = true) {
  const std::int64_t n = x.size(0), H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  const at::Tensor h = rms_norm(c, x, w.input_norm);
  const bool qk_values = values || c.qk_norm;
  at::Tensor q =
      project(w, BlockWeights::kQ, h, w.q, w.q_bias, ctx, row, qk_values).view({n, H, D});
  at::Tensor k =
      project(w, BlockWeights::kK, h, w.k, w.k_bias, ctx, row, qk_values).view({n, KV, D});
  at::Tensor v = project(w, BlockWeights::kV, h, w.v, w.v_bias, ctx, row, values).view({n, KV, D});
  if (c.qk_norm) {
    q = rms_norm(c, q, w.q_norm);
    k = rms_norm(c, k, w.k_norm);
  }
  // The tables (B, 1, T, D) as rows of the flattened batch, (B * T, 1, D).
  auto rows = [&](const at::Tensor& t) { return t.reshape({-1, 1, t.size(-1)}).narrow(0, row, n); };
  const at::Tensor cos = rows(ctx.cos), sin = rows(ctx.sin);
  return {apply_rope(q, cos, sin), apply_rope(k, cos, sin), v};
}

// Attention over the whole batch from rotated q, k, v as flattened tokens (B * T, heads, D);
// returns (B * T, H * D).
at::Tensor attend_flat(const ModelConfig& c, const BlockWeights& w, std::int64_t B,
                       const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionContext& ctx) {
  const std::int64_t T = q.size(0) / B;
  auto heads = [&](const at::Tensor& t) {  // (B, heads, T, D)
    return t.view({B, T, t.size(1), t.size(2)}).transpose(1, 2);
  };
  return attend_rotated(c, w, heads(q), heads(k), heads(v), ctx, nullptr)
      .transpose(1, 2)
      .reshape({B * T, -1});
}

// The tiled attention half's tensors that span the sequence (training).
struct TiledAttention {
  at::Tensor q, k, v;  // rotated, (B * T, heads, D): leaves requiring a gradient
  at::Tensor a;        // attention's output (B * T, H * D), under autograd from q, k, v
  at::Tensor out;      // x + o(a), (B, T, C), without a graph
};

// The rotated q, k, v of all of `x` (B, T, C), tile by tile, without autograd.
QkvTile qkv_by_tiles(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
                     const AttentionContext& ctx) {
  c10::AutoGradMode no_grad(false);
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const std::int64_t N = flat.size(0), H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim;
  QkvTile all{at::empty({N, H, D}, x.options()), at::empty({N, KV, D}, x.options()),
              at::empty({N, KV, D}, x.options())};
  for_each_tile(N, ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    const QkvTile t = qkv_tile(c, w, flat.narrow(0, r, n), ctx, r);
    all.q.narrow(0, r, n).copy_(t.q);
    all.k.narrow(0, r, n).copy_(t.k);
    all.v.narrow(0, r, n).copy_(t.v);
  });
  return all;
}

// x + o(a) tile by tile, without autograd; (B, T, C) as x.
at::Tensor output_by_tiles(const BlockWeights& w, const at::Tensor& x, const at::Tensor& a,
                           const AttentionContext& ctx) {
  c10::AutoGradMode no_grad(false);
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty_like(flat);
  for_each_tile(flat.size(0), ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    out.narrow(0, r, n).copy_(flat.narrow(0, r, n) + project(w, BlockWeights::kO, a.narrow(0, r, n),
                                                             w.o, w.o_bias, ctx, r));
  });
  return out.view(x.sizes());
}

// The attention half by tiles without autograd (forward stages, evaluation).
at::Tensor attention_half_by_tiles(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
                                   const AttentionContext& ctx) {
  const QkvTile all = qkv_by_tiles(c, w, x, ctx);
  return output_by_tiles(w, x, attend_flat(c, w, x.size(0), all.q, all.k, all.v, ctx), ctx);
}

// The attention half by tiles in training: attention's graph kept, the rest recomputed in
// attention_backward_tiled.
TiledAttention attention_forward_tiled(const ModelConfig& c, const BlockWeights& w,
                                       const at::Tensor& x, const AttentionContext& ctx) {
  QkvTile all = qkv_by_tiles(c, w, x.detach(), ctx);
  TiledAttention t{all.q.requires_grad_(true), all.k.requires_grad_(true),
                   all.v.requires_grad_(true)};
  {
    c10::AutoGradMode grad_mode(true);
    t.a = attend_flat(c, w, x.size(0), t.q, t.k, t.v, ctx);
  }
  t.out = output_by_tiles(w, x.detach(), t.a.detach(), ctx);
  return t;
}

// The backward of attention_forward_tiled from `x` and `grad` (the gradient of t.out, which it
// turns into x's in place): returns the gradient of x; the weights' gradients add up in their
// grad(). Leaves `t` empty.
at::Tensor attention_backward_tiled(const ModelConfig& c, const BlockWeights& w,
                                    const at::Tensor& x, TiledAttention& t, at::Tensor grad,
                                    const AttentionContext& ctx) {
  c10::AutoGradMode grad_mode(true);
  const at::Tensor flat = x.detach().reshape({-1, x.size(-1)});
  grad = grad.contiguous();
  const at::Tensor grad_flat = grad.view({-1, grad.size(-1)});
  const std::int64_t N = flat.size(0);
  at::Tensor grad_a = at::empty_like(t.a);
  for_each_tile(N, ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    const at::Tensor a = t.a.narrow(0, r, n).detach().requires_grad_(true);
    project(w, BlockWeights::kO, a, w.o, w.o_bias, ctx, r, /*values=*/false)
        .backward(grad_flat.narrow(0, r, n));
    grad_a.narrow(0, r, n).copy_(a.grad());
  });
  t.a.backward(grad_a);
  t.a.reset();
  grad_a.reset();
  const at::Tensor& grad_x = grad_flat;  // the residual's, then the norm's added
  for_each_tile(N, ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    const at::Tensor xt = flat.narrow(0, r, n).detach().requires_grad_(true);
    const QkvTile qkv = qkv_tile(c, w, xt, ctx, r, /*values=*/false);
    torch::autograd::backward(
        {qkv.q, qkv.k, qkv.v},
        {t.q.grad().narrow(0, r, n), t.k.grad().narrow(0, r, n), t.v.grad().narrow(0, r, n)});
    grad_x.narrow(0, r, n).add_(xt.grad());
  });
  t = TiledAttention{};
  return grad;
}

// Sequence tiling (AttentionContext::mlp_tile_tokens): a block's MLP, a function of each token
// alone, runs over tiles of that many tokens of the flattened batch, so that its intermediates
// (4 x intermediate_size a token, or a sparse block's router probabilities and its experts' for
// each routed copy of a token, and their gradients) exist for one tile at a time. Without
// autograd here; mlp_backward_by_tiles is its backward. A sparse block's routing record adds up
// over the tiles (moe_mlp): the load-balancing loss is linear in each tile's probability sums.

at::Tensor mlp_by_tiles(const ModelConfig& c, const BlockWeights& w, const at::Tensor& out,
                        const AttentionContext& ctx) {
  const at::Tensor flat = out.reshape({-1, out.size(-1)});
  at::Tensor m = at::empty_like(flat);
  for_each_tile(flat.size(0), ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    m.narrow(0, r, n).copy_(block_mlp(c, w, flat.narrow(0, r, n), ctx, r));
  });
  return m.view(out.sizes());
}

// The backward of mlp_by_tiles for `grad` (the gradient of its output): each tile recomputed under
// autograd and backpropagated alone, a sparse block's with its share of the router load-balancing
// loss (its probability sums times router_aux_grad, the same for every tile: the microbatch's
// routing is complete by now). The weight gradients add up in the grad() of w's tensors that
// require one; returns the gradient of `out` through the MLP.
at::Tensor mlp_backward_by_tiles(const ModelConfig& c, const BlockWeights& w, const at::Tensor& out,
                                 const at::Tensor& grad, const AttentionContext& ctx) {
  c10::AutoGradMode grad_mode(true);
  const at::Tensor flat = out.detach().reshape({-1, out.size(-1)});
  const at::Tensor grad_flat = grad.reshape({-1, grad.size(-1)});
  at::Tensor g = at::empty_like(flat);
  AttentionContext tile_ctx = ctx;
  tile_ctx.record_routing = false;  // the forward recorded it; the tiles find their counts there
  std::vector<at::Tensor> prob_sums;
  at::Tensor aux_grad;
  if (w.router.defined() && ctx.aux_loss_weight != 0 && ctx.routing) {
    tile_ctx.router_prob_sums = &prob_sums;
    aux_grad = router_aux_grad(c, *ctx.routing, ctx.aux_loss_weight, out.device());
  }
  for_each_tile(flat.size(0), ctx.mlp_tile_tokens, [&](std::int64_t r, std::int64_t n) {
    const at::Tensor o = flat.narrow(0, r, n).detach().requires_grad_(true);
    prob_sums.clear();
    const at::Tensor y = block_mlp(c, w, o, tile_ctx, r, /*values=*/false);
    if (prob_sums.empty()) {
      y.backward(grad_flat.narrow(0, r, n));
    } else {
      const at::Tensor term = (prob_sums.front() * aux_grad).sum();
      torch::autograd::backward({y, term}, {grad_flat.narrow(0, r, n), at::ones_like(term)});
    }
    g.narrow(0, r, n).copy_(o.grad());
  });
  return g.view(out.sizes());
}

}  // namespace

at::Tensor block_forward(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
                         const AttentionContext& ctx, KvCache* cache) {
  // Under autograd the tiles are blocks_backward's to run (a graph over tiles would keep them all).
  if (ctx.mlp_tile_tokens > 0 && !at::GradMode::is_enabled() && cache == nullptr) {
    const at::Tensor out = attention_half_by_tiles(c, w, x, ctx);
    return out + mlp_by_tiles(c, w, out, ctx);
  }
  const at::Tensor out = attention_half(c, w, x, ctx, cache);
  return out + block_mlp(c, w, out, ctx, 0);
}

at::Tensor head_logits(const ModelConfig& c, const at::Tensor& norm_weight,
                       const at::Tensor& lm_head_weight, const at::Tensor& x) {
  at::Tensor h = rms_norm(c, x, norm_weight);
  return at::linear(h, lm_head_weight).to(at::kFloat);
}

namespace {

// The head's cross-entropy over `x`'s rows, `chunk_tokens` rows of fp32 logits at a time: `use`
// gets each chunk's (first row, rows, cross-entropy reduced by `reduction`).
template <typename Use>
void head_cross_entropy_chunks(const ModelConfig& c, const at::Tensor& norm_weight,
                               const at::Tensor& lm_head_weight, const at::Tensor& x,
                               const at::Tensor& targets, std::int64_t chunk_tokens,
                               std::int64_t reduction, Use use) {
  RONDO_ASSERT(chunk_tokens > 0);
  at::Tensor h = rms_norm(c, x, norm_weight).reshape({-1, x.size(-1)});
  at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const std::int64_t N = h.size(0);
  for (std::int64_t start = 0; start < N; start += chunk_tokens) {
    const std::int64_t n = std::min(chunk_tokens, N - start);
    at::Tensor logits = at::linear(h.narrow(0, start, n), lm_head_weight).to(at::kFloat);
    use(start, n,
        at::cross_entropy_loss(logits, t.narrow(0, start, n), {}, reduction,
                               /*ignore_index=*/-100));
  }
}

}  // namespace

at::Tensor head_loss_sum(const ModelConfig& c, const at::Tensor& norm_weight,
                         const at::Tensor& lm_head_weight, const at::Tensor& x,
                         const at::Tensor& targets, std::int64_t chunk_tokens) {
  at::Tensor total = at::zeros({}, x.options().dtype(at::kFloat));
  head_cross_entropy_chunks(
      c, norm_weight, lm_head_weight, x, targets, chunk_tokens, at::Reduction::Sum,
      [&](std::int64_t, std::int64_t, const at::Tensor& ce) { total = total + ce; });
  return total;
}

at::Tensor head_token_losses(const ModelConfig& c, const at::Tensor& norm_weight,
                             const at::Tensor& lm_head_weight, const at::Tensor& x,
                             const at::Tensor& targets, std::int64_t chunk_tokens) {
  at::Tensor out = at::empty({targets.numel()}, x.options().dtype(at::kFloat));
  head_cross_entropy_chunks(c, norm_weight, lm_head_weight, x, targets, chunk_tokens,
                            at::Reduction::None,
                            [&](std::int64_t start, std::int64_t n, const at::Tensor& ce) {
                              out.narrow(0, start, n).copy_(ce);
                            });
  return out.view(targets.sizes());
}

namespace {

// Autograd's aliases of blocks [first, end)'s weights (the shared weight tensors stay untouched):
// those with a gradient to accumulate require one.
std::vector<std::vector<at::Tensor>> weight_leaves(const std::vector<BlockRun>& blocks,
                                                   std::size_t first, std::size_t end) {
  std::vector<std::vector<at::Tensor>> leaves(end - first);
  for (std::size_t b = first; b < end; ++b) {
    const BlockRun& run = blocks[b];
    for (std::size_t i = 0; i < run.weights.size(); ++i) {
      const bool trainable = run.grads && i < run.grads->size() && (*run.grads)[i].defined();
      leaves[b - first].push_back(trainable ? run.weights[i].detach().requires_grad_(true)
                                            : run.weights[i].detach());
    }
  }
  return leaves;
}

// The leaves' gradients into BlockRun::grads (added, or written with BlockRun::overwrite).
void collect_weight_grads(const std::vector<BlockRun>& blocks, std::size_t first, std::size_t end,
                          const std::vector<std::vector<at::Tensor>>& leaves) {
  for (std::size_t b = first; b < end; ++b) {
    const BlockRun& run = blocks[b];
    if (!run.grads) continue;
    for (std::size_t i = 0; i < leaves[b - first].size(); ++i) {
      // An expert no token of the microbatch was routed to has no gradient.
      const at::Tensor& g = leaves[b - first][i].grad();
      at::Tensor& into = (*run.grads)[i];
      if (!into.defined()) continue;
      if (run.overwrite)
        g.defined() ? into.copy_(g) : into.zero_();
      else if (g.defined())
        into.add_(g);
    }
  }
}

// forward_and_backward tiled: each block's attention half runs by tiles around one attention
// under autograd (attention_forward_tiled, Note [Sequence tiling of the attention half]); its MLP
// runs tile by tile without autograd, and in the backward tile by tile again, recomputed
// (mlp_backward_by_tiles), before the attention half's backward takes the sum of both gradients.
// What the untiled graph would keep of the MLPs (four intermediates of intermediate_size a token,
// or a sparse block's router and experts') and of the attention half's projections and norms is
// held for one tile at a time. Without `output_used` (a recompute, whose gradient comes from
// outside) the last block's MLP is not run forward at all: its tiles run once, in the backward,
// as the untiled recompute's MLP does.
at::Tensor forward_and_backward_tiled(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                      std::size_t first, std::size_t end, const at::Tensor& x,
                                      const AttentionContext& ctx,
                                      const std::function<at::Tensor(const at::Tensor&)>& grad_of,
                                      bool output_used) {
  c10::AutoGradMode grad_mode(true);
  const std::vector<std::vector<at::Tensor>> leaves = weight_leaves(blocks, first, end);
  const std::size_t n = end - first;
  std::vector<BlockWeights> bound;
  std::vector<at::Tensor> inputs(n);
  std::vector<TiledAttention> halves(n);
  at::Tensor h = x.detach();
  for (std::size_t i = 0; i < n; ++i) {
    bound.push_back(BlockWeights::bind(*blocks[first + i].spec, leaves[i]));
    inputs[i] = h;
    halves[i] = attention_forward_tiled(c, bound[i], inputs[i], ctx);
    if (i + 1 == n && !output_used) {
      h = at::Tensor();
      break;
    }
    c10::AutoGradMode no_grad(false);
    h = halves[i].out + mlp_by_tiles(c, bound[i], halves[i].out, ctx);
  }
  at::Tensor grad;
  {
    c10::AutoGradMode no_grad(false);  // the head's own pass manages its autograd
    grad = grad_of(h);
  }
  for (std::size_t i = n; i-- > 0;) {
    // One gradient of the sequence's length at a time beside what the backward needs: the MLP's
    // gets the residual's added in place, and becomes the input's in place.
    at::Tensor g = mlp_backward_by_tiles(c, bound[i], halves[i].out, grad, ctx);
    g.add_(grad);
    grad.reset();
    grad = attention_backward_tiled(c, bound[i], inputs[i], halves[i], std::move(g), ctx);
    inputs[i].reset();
  }
  collect_weight_grads(blocks, first, end, leaves);
  return grad;
}

// Runs blocks [first, end) under autograd from `x`, asks `grad_of` for the gradient of their
// output (given the output, unless `output_used` is false: then it may be undefined),
// backpropagates it, adds the weight gradients; returns the input gradient.
at::Tensor forward_and_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                std::size_t first, std::size_t end, const at::Tensor& x,
                                const AttentionContext& ctx,
                                const std::function<at::Tensor(const at::Tensor&)>& grad_of,
                                bool output_used = true) {
  if (ctx.mlp_tile_tokens > 0)
    return forward_and_backward_tiled(c, blocks, first, end, x, ctx, grad_of, output_used);
  c10::AutoGradMode grad_mode(true);
  at::Tensor x_leaf = x.detach().requires_grad_(true);
  const std::vector<std::vector<at::Tensor>> leaves = weight_leaves(blocks, first, end);
  at::Tensor h = x_leaf;
  // The router load-balancing loss: the sparse blocks' probability sums, differentiated with the
  // weight router_aux_grad gives once every block of the microbatch has routed (after this
  // forward: the tail's blocks are the microbatch's last).
  std::vector<at::Tensor> prob_sums;
  AttentionContext aux_ctx;
  const bool aux = ctx.aux_loss_weight != 0 && ctx.routing != nullptr;
  if (aux) {
    aux_ctx = ctx;
    aux_ctx.router_prob_sums = &prob_sums;
  }
  const AttentionContext& run_ctx = aux ? aux_ctx : ctx;
  for (std::size_t b = first; b < end; ++b)
    h = block_forward(c, BlockWeights::bind(*blocks[b].spec, leaves[b - first]), h, run_ctx);
  at::Tensor grad_out;
  {
    c10::AutoGradMode no_grad(false);  // the head's own pass manages its autograd
    grad_out = grad_of(h.detach());
  }
  if (prob_sums.empty()) {
    h.backward(grad_out);
  } else {
    const at::Tensor g = router_aux_grad(c, *ctx.routing, ctx.aux_loss_weight, h.device());
    at::Tensor term = (at::stack(prob_sums) * g).sum();
    torch::autograd::backward({h, term}, {grad_out, at::ones_like(term)});
  }
  collect_weight_grads(blocks, first, end, leaves);
  return x_leaf.grad();
}

at::Tensor recompute_and_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                  std::size_t first, std::size_t end, const at::Tensor& x,
                                  const AttentionContext& ctx, const at::Tensor& grad_out) {
  return forward_and_backward(
      c, blocks, first, end, x, ctx, [&](const at::Tensor&) { return grad_out; },
      /*output_used=*/false);
}

}  // namespace

at::Tensor blocks_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                           const std::vector<at::Tensor>& saved_inputs, const AttentionContext& ctx,
                           const at::Tensor& grad_out) {
  if (blocks.empty()) return grad_out;
  if (saved_inputs.size() == 1)  // stage grain
    return recompute_and_backward(c, blocks, 0, blocks.size(), saved_inputs[0], ctx, grad_out);
  if (saved_inputs.size() != blocks.size())
    throw InternalError("blocks_backward: " + std::to_string(saved_inputs.size()) +
                        " saved inputs for " + std::to_string(blocks.size()) + " blocks");
  at::Tensor g = grad_out;
  for (std::size_t b = blocks.size(); b-- > 0;)  // layer grain: top block first
    g = recompute_and_backward(c, blocks, b, b + 1, saved_inputs[b], ctx, g);
  return g;
}

at::Tensor blocks_forward_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                   const at::Tensor& x, const AttentionContext& ctx,
                                   const std::function<at::Tensor(const at::Tensor&)>& head) {
  if (blocks.empty()) return head(x);
  return forward_and_backward(c, blocks, 0, blocks.size(), x, ctx, head);
}

void embed_backward(const at::Tensor& tokens, const at::Tensor& grad_x, at::Tensor& grad_weight) {
  const std::int64_t C = grad_x.size(-1);
  grad_weight.index_add_(0, tokens.reshape({-1}).to(at::kLong),
                         grad_x.reshape({-1, C}).to(grad_weight.scalar_type()));
}

HeadGrads head_forward_backward(const ModelConfig& c, const at::Tensor& norm_weight,
                                const at::Tensor& lm_head_weight, const at::Tensor& x,
                                const at::Tensor& targets, double loss_scale,
                                bool want_lm_head_grad, std::int64_t chunk_tokens,
                                const at::Tensor& token_weights) {
  RONDO_ASSERT(chunk_tokens > 0);
  const at::Tensor weights = token_weights.defined() ? token_weights.reshape({-1}) : at::Tensor();
  // The final norm runs under autograd (its output is tokens x hidden, small); the LM head and
  // the loss are differentiated by hand, chunk by chunk.
  at::Tensor x_leaf = x.detach().requires_grad_(true);
  at::Tensor w_leaf = norm_weight.detach().requires_grad_(true);
  at::Tensor h;
  {
    c10::AutoGradMode grad(true);
    h = rms_norm(c, x_leaf, w_leaf);
  }
  const std::int64_t C = x.size(-1), V = lm_head_weight.size(0);
  at::Tensor h2 = h.detach().reshape({-1, C});
  at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const std::int64_t N = h2.size(0);
  at::Tensor dh = at::empty_like(h2);
  HeadGrads out;
  out.loss_sum = at::zeros({}, h2.options().dtype(at::kFloat));
  if (want_lm_head_grad) out.grad_lm_head = at::zeros({V, C}, h2.options().dtype(at::kFloat));
  c10::AutoGradMode no_grad(false);
  for (std::int64_t start = 0; start < N; start += chunk_tokens) {
    const std::int64_t n = std::min(chunk_tokens, N - start);
    at::Tensor hc = h2.narrow(0, start, n);
    at::Tensor tc = t.narrow(0, start, n);
    at::Tensor logits = at::linear(hc, lm_head_weight).to(at::kFloat);  // (n, V)
    at::Tensor valid = tc.ne(-100);
    at::Tensor safe = at::where(valid, tc, at::zeros_like(tc));
    at::Tensor logz = at::logsumexp(logits, -1);
    at::Tensor picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1);
    out.loss_sum += ((logz - picked) * valid).sum();
    // d(loss)/d(logits) = softmax - one-hot, zero for ignored tokens, times the scale.
    at::Tensor d = at::exp(logits - logz.unsqueeze(1));
    // One target per row, so no two writes meet: a gather and a scatter (which torch's
    // deterministic mode runs on CUDA, unlike scatter_add_ on some versions) subtract the one.
    const at::Tensor at_target = safe.unsqueeze(1);
    d.scatter_(1, at_target, d.gather(1, at_target) - 1);
    at::Tensor coef = valid.to(d.scalar_type()) * loss_scale;
    if (weights.defined()) coef = coef * weights.narrow(0, start, n).to(d.scalar_type());
    d.mul_(coef.unsqueeze(1));
    dh.narrow(0, start, n).copy_(at::matmul(d.to(lm_head_weight.scalar_type()), lm_head_weight));
    if (want_lm_head_grad) out.grad_lm_head.addmm_(d.t(), hc.to(at::kFloat));
  }
  {
    c10::AutoGradMode grad(true);
    h.backward(dh.view(h.sizes()));
  }
  out.grad_x = x_leaf.grad();
  out.grad_norm = w_leaf.grad();
  return out;
}

}  // namespace rondo::models
