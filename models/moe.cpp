// Mixture-of-experts routing (moe.h): a sparse block's MLP (router, top-k, the experts with their
// LoRA shares), the routing record of a microbatch and the router load-balancing loss from it,
// experts' names. Touches only the tensors handed to it and a RoutingRecord under its mutex.
// Used by block_forward, the engine (aux loss) and LoRA/export (expert names and factors).
#include "models/moe.h"

#include <ATen/ATen.h>

#include <cctype>
#include <cstring>
#include <optional>
#include <tuple>

#include "kernels/error.h"
#include "models/layers.h"

namespace rondo::models {

bool parse_expert_name(const std::string& name, std::int64_t* expert, int* projection) {
  std::size_t at = std::string::npos;
  for (const char* moe : {".mlp.experts.", ".block_sparse_moe.experts."})
    if (std::size_t i = name.find(moe); i != std::string::npos) at = i + std::strlen(moe);
  if (at == std::string::npos || at >= name.size() ||
      !std::isdigit(static_cast<unsigned char>(name[at])))
    return false;
  const std::size_t dot = name.find('.', at);
  if (dot == std::string::npos) return false;
  const std::string what = name.substr(dot + 1);
  const int p = what == "gate_proj.weight" || what == "w1.weight"   ? 0
                : what == "up_proj.weight" || what == "w3.weight"   ? 1
                : what == "down_proj.weight" || what == "w2.weight" ? 2
                                                                    : -1;
  if (p < 0) return false;
  *expert = std::stoll(name.substr(at, dot - at));
  *projection = p;
  return true;
}

std::pair<at::Tensor, at::Tensor> expert_lora_factors(const at::Tensor& a, const at::Tensor& b,
                                                      std::int64_t experts, std::int64_t e) {
  const std::int64_t r = a.size(0) / experts;
  return {a.narrow(0, e * r, r), b.slice(1, e, std::nullopt, experts)};
}

at::Tensor expert_lora_delta(const at::Tensor& a, const at::Tensor& b, std::int64_t experts,
                             std::int64_t e) {
  const auto [a_e, b_e] = expert_lora_factors(a, b, experts, e);
  return at::matmul(b_e, a_e);
}

// A sparse block's MLP as transformers computes it: router softmax (fp32) and top-k (renormalised
// when norm_topk_prob), then each expert's SwiGLU on the tokens routed to it, weighted and added
// back per token (index_add). Tokens are sorted by expert once; the per-expert counts that split
// them are host values, taken from the routing record in a recompute (the forward recorded them)
// rather than synced again.
at::Tensor moe_mlp(const ModelConfig& c, const BlockWeights& w, const at::Tensor& h,
                   const AttentionContext& ctx, std::int64_t row) {
  const std::int64_t C = h.size(-1), E = c.num_experts, K = c.experts_per_token;
  const bool fused = w.fused_gate_up.defined();  // GPT-OSS
  RONDO_ASSERT_MSG(fused || (static_cast<std::int64_t>(w.expert_gate.size()) == E &&
                             static_cast<std::int64_t>(w.expert_up.size()) == E &&
                             static_cast<std::int64_t>(w.expert_down.size()) == E),
                   "block " + std::to_string(w.block) + ": not every expert's weights are bound");
  const at::Tensor x = h.reshape({-1, C});
  const std::int64_t N = x.size(0);
  at::Tensor logits =
      w.router_bias.defined() ? at::linear(x, w.router, w.router_bias) : at::linear(x, w.router);
  if (w.router_lora_a.defined())
    logits = logits + at::linear(at::linear(x, w.router_lora_a), w.router_lora_b) * w.lora_scaling;
  // The full softmax: what routes Qwen3-MoE and Mixtral, and what the load-balancing loss sums
  // for every family.
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);  // (N, E)
  at::Tensor top, chosen;
  if (c.family == Family::kGptOss) {
    // GPT-OSS: top-k of the logits, weighed by a softmax over those k (in the logits' dtype).
    auto [values, index] = at::topk(logits, K, -1);
    top = at::softmax(values, 1);
    chosen = index;
  } else {
    std::tie(top, chosen) = at::topk(probs, K, -1);  // (N, K)
    if (c.norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
    // Qwen3-MoE weighs the experts' outputs in the activation dtype, Mixtral in fp32.
    if (c.family != Family::kMixtral) top = top.to(x.scalar_type());
  }

  const at::Tensor flat = chosen.reshape({-1});  // token n's k-th choice at n * K + k
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  std::vector<std::int64_t> counts;
  if (ctx.routing && !ctx.record_routing) {
    std::lock_guard<std::mutex> lock(ctx.routing->mu);
    auto it = ctx.routing->blocks.find(w.block);
    if (it != ctx.routing->blocks.end())
      if (auto at = it->second.by_row.find(row);
          at != it->second.by_row.end() && at->second.first == N)
        counts = at->second.second;
  }
  if (counts.empty()) {  // the one host sync of the block (of the tile)
    const at::Tensor bins = at::bincount(flat, {}, E).to(at::kCPU);
    counts.assign(bins.data_ptr<std::int64_t>(), bins.data_ptr<std::int64_t>() + E);
  }
  if (ctx.routing && ctx.record_routing) {
    const at::Tensor sums = probs.sum(0).detach();
    std::lock_guard<std::mutex> lock(ctx.routing->mu);
    BlockRouting& r = ctx.routing->blocks[w.block];
    if (row == 0) {
      r = BlockRouting{.counts = counts, .prob_sums = sums, .tokens = N};
    } else {  // a later tile of the same microbatch
      RONDO_ASSERT_MSG(r.prob_sums.defined(), "block " + std::to_string(w.block) +
                                                  ": a tile's routing recorded before the first");
      for (std::size_t e = 0; e < counts.size(); ++e)
        r.counts[e] += counts[e];
      r.prob_sums = r.prob_sums + sums;
      r.tokens += N;
    }
    r.by_row[row] = {N, counts};
  }
  if (ctx.router_prob_sums != nullptr) ctx.router_prob_sums->push_back(probs.sum(0));

  const at::Tensor token_of = at::div(order, K, "floor");
  const at::Tensor weight_of = top.reshape({-1}).index_select(0, order);
  at::Tensor out = at::zeros_like(x);
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t n = counts[static_cast<std::size_t>(e)];
    if (n == 0) continue;
    const at::Tensor tokens = token_of.narrow(0, start, n);
    const at::Tensor xs = x.index_select(0, tokens);
    // Expert e's share of an adapter in PEFT's layout: x A_e^T B_e^T * scaling (GPT-OSS's
    // x @ W layout takes the same product: PEFT adds (B_e A_e)^T to its (in, out) weight).
    auto expert_lora = [&](int which, const at::Tensor& in) {
      const auto [a, b] = expert_lora_factors(w.expert_lora_a[which], w.expert_lora_b[which], E, e);
      return at::linear(at::linear(in, a), b) * w.expert_lora_scaling[which];
    };
    at::Tensor y;
    if (fused) {  // GPT-OSS: interleaved gate/up, biases, the clamped SwiGLU
      at::Tensor gu = at::matmul(xs, w.fused_gate_up[e]) + w.fused_gate_up_bias[e];
      if (w.expert_lora_a[0].defined()) gu = gu + expert_lora(0, xs);  // interleaved, as gu
      const at::Tensor g = gu.slice(1, 0, std::nullopt, 2).clamp_max(c.swiglu_limit);
      const at::Tensor u = gu.slice(1, 1, std::nullopt, 2).clamp(-c.swiglu_limit, c.swiglu_limit);
      const at::Tensor act = (u + 1) * (g * at::sigmoid(g * c.swiglu_alpha));
      y = at::matmul(act, w.fused_down[e]) + w.fused_down_bias[e];
      if (w.expert_lora_a[1].defined()) y = y + expert_lora(1, act);
    } else {
      at::Tensor gate = at::linear(xs, w.expert_gate[e]), up = at::linear(xs, w.expert_up[e]);
      if (w.expert_lora_a[0].defined()) {  // gate_up_proj's adapter: gate rows, then up rows
        const std::int64_t I = gate.size(1);
        const at::Tensor d = expert_lora(0, xs);
        gate = gate + d.narrow(1, 0, I);
        up = up + d.narrow(1, I, I);
      }
      const at::Tensor act = at::silu(gate) * up;
      y = at::linear(act, w.expert_down[e]);
      if (w.expert_lora_a[1].defined()) y = y + expert_lora(1, act);
    }
    y = y * weight_of.narrow(0, start, n).unsqueeze(1);
    out = out.index_add(0, tokens, y.to(out.scalar_type()));
    start += n;
  }
  return out.view(h.sizes());
}

namespace {
// Every sparse block's routing of a microbatch summed: top-k selections and router probabilities
// per expert, and the (block, token) pairs. The caller holds record.mu.
struct RoutingTotals {
  std::vector<double> counts, prob_sums;
  double rows = 0;
};
RoutingTotals routing_totals(const ModelConfig& c, const RoutingRecord& record, bool with_probs) {
  const auto E = static_cast<std::size_t>(c.num_experts);
  RoutingTotals t{std::vector<double>(E, 0.0), std::vector<double>(with_probs ? E : 0, 0.0)};
  for (const auto& [b, r] : record.blocks) {
    for (std::size_t e = 0; e < E; ++e)
      t.counts[e] += static_cast<double>(r.counts[e]);
    if (with_probs) {
      const at::Tensor sums = r.prob_sums.to(at::kCPU, at::kDouble).contiguous();
      for (std::size_t e = 0; e < E; ++e)
        t.prob_sums[e] += sums.data_ptr<double>()[e];
    }
    t.rows += static_cast<double>(r.tokens);
  }
  return t;
}
}  // namespace

double router_aux_loss(const ModelConfig& c, RoutingRecord& record) {
  std::lock_guard<std::mutex> lock(record.mu);
  const RoutingTotals t = routing_totals(c, record, /*with_probs=*/true);
  if (t.rows == 0) return 0;
  double sum = 0;
  for (std::size_t e = 0; e < t.counts.size(); ++e)
    sum += (t.counts[e] / t.rows) * (t.prob_sums[e] / t.rows);
  return sum * static_cast<double>(c.num_experts);
}

at::Tensor router_aux_grad(const ModelConfig& c, RoutingRecord& record, double weight,
                           at::Device device) {
  std::lock_guard<std::mutex> lock(record.mu);
  const RoutingTotals t = routing_totals(c, record, /*with_probs=*/false);
  std::vector<float> g(t.counts.size(), 0.0f);
  for (std::size_t e = 0; e < g.size() && t.rows > 0; ++e)
    g[e] = static_cast<float>(weight * static_cast<double>(c.num_experts) * t.counts[e] /
                              (t.rows * t.rows));
  return at::tensor(g, at::TensorOptions().dtype(at::kFloat)).to(device);
}

}  // namespace rondo::models
