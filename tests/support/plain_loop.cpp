#include "tests/support/plain_loop.h"

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include "models/layers.h"
#include "models/model.h"

namespace rondo::test {

struct PlainLoop::State {
  models::ModelConfig config;
  std::vector<models::LayerSpec> specs;
  std::map<std::string, at::Tensor> params;  // leaves; a tied name appears once
  std::vector<at::Tensor> order;             // parameters, for the optimizer
  std::unique_ptr<torch::optim::AdamW> adamw;
  double max_norm = 0;
  std::vector<at::Tensor> stale;  // one-step-stale: the weights the next step runs on
  at::Device device = at::kCPU;
};

PlainLoop::PlainLoop(const models::ModelConfig& config,
                     const std::map<std::string, at::Tensor>& weights, const PlainAdamW& a,
                     double max_grad_norm, at::ScalarType dtype,
                     const std::vector<models::LayerSpec>* specs,
                     const std::function<bool(const std::string&)>& trainable, at::Device device)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.device = device;
  s.config = config;
  s.specs = specs ? *specs : models::layer_specs(config);
  s.max_norm = max_grad_norm;
  for (const models::LayerSpec& l : s.specs)
    for (const models::ParamSpec& p : l.params) {
      if (s.params.count(p.name)) continue;
      const bool train = !trainable || trainable(p.name);
      at::Tensor t = weights.at(p.name).to(device, dtype).clone().requires_grad_(train);
      s.params.emplace(p.name, t);
      if (train) s.order.push_back(t);
    }
  s.adamw = std::make_unique<torch::optim::AdamW>(s.order, torch::optim::AdamWOptions(a.lr)
                                                               .betas({a.beta1, a.beta2})
                                                               .eps(a.eps)
                                                               .weight_decay(a.weight_decay));
}

PlainLoop::~PlainLoop() = default;

double PlainLoop::forward_backward(const std::vector<engine::Microbatch>& microbatches,
                                   std::int64_t step_no, std::uint64_t seed) {
  State& s = *state_;
  std::int64_t targets = 0;
  for (const engine::Microbatch& mb : microbatches)
    targets += mb.targets.ne(-100).sum().item<std::int64_t>();
  double aux_total = 0;
  auto layer = [&](std::size_t l) {
    std::vector<at::Tensor> w;
    for (const models::ParamSpec& p : s.specs[l].params)
      w.push_back(s.params.at(p.name));
    return w;
  };
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions(s.device).dtype(at::kDouble));
  for (std::size_t m = 0; m < microbatches.size(); ++m) {
    const engine::Microbatch& host_mb = microbatches[m];
    const engine::Microbatch mb{
        {host_mb.batch.tokens.to(s.device),
         host_mb.batch.doc_ids.defined() ? host_mb.batch.doc_ids.to(s.device) : at::Tensor()},
        host_mb.targets.to(s.device)};
    const at::ScalarType dt = s.params.begin()->second.scalar_type();
    models::AttentionContext ctx = models::make_attention_context(s.config, mb.batch, dt);
    ctx.dropout_seed = engine::dropout_seed(seed, step_no, static_cast<int>(m));
    // MoE with the router's load-balancing loss: the sparse blocks' probability sums under
    // autograd, and their top-k counts, from this one forward.
    const bool aux = s.config.num_experts > 0 && s.config.output_router_logits;
    std::vector<at::Tensor> prob_sums;
    if (aux) {
      ctx.routing = std::make_shared<models::RoutingRecord>();
      ctx.record_routing = true;
      ctx.router_prob_sums = &prob_sums;
    }
    at::Tensor x = models::embed(layer(0)[0], mb.batch.tokens);
    for (std::size_t l = 1; l + 1 < s.specs.size(); ++l)
      x = models::block_forward(s.config, models::BlockWeights::bind(s.specs[l], layer(l)), x, ctx);
    std::vector<at::Tensor> head = layer(s.specs.size() - 1);
    // The head as one plain graph: norm, LM head, cross-entropy in fp32 (or the loop's dtype when
    // wider, so that an f64 loop is f64 throughout).
    at::Tensor logits = at::linear(models::rms_norm(s.config, x, head[0]), head[1]);
    logits = logits.to(at::promote_types(logits.scalar_type(), at::kFloat));
    at::Tensor sum = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                            mb.targets.reshape({-1}), {}, at::Reduction::Sum, -100);
    at::Tensor objective = sum / static_cast<double>(targets);
    if (aux && !prob_sums.empty()) {
      // transformers' load_balancing_loss_func: E * sum_e (counts_e / rows) * (prob sum_e / rows)
      // over all sparse blocks' (token, expert) pairs; each microbatch's counts 1 / M.
      at::Tensor counts =
          at::zeros({s.config.num_experts}, at::TensorOptions(s.device).dtype(at::kDouble));
      double rows = 0;
      for (auto& [b, r] : ctx.routing->blocks) {
        counts += at::tensor(r.counts, at::kLong).to(s.device, at::kDouble);
        rows += static_cast<double>(r.tokens);
      }
      at::Tensor probs = at::stack(prob_sums).sum(0).to(at::kDouble);
      at::Tensor aux_loss =
          (counts / rows * probs / rows).sum() * static_cast<double>(s.config.num_experts) *
          s.config.router_aux_loss_coef / static_cast<double>(microbatches.size());
      objective = objective + aux_loss.to(objective.scalar_type());
      aux_total += aux_loss.item<double>();
    }
    objective.backward();
    loss_sum += sum.detach().to(at::kDouble);
  }
  // One host sync per step, not per microbatch: a GPU loop keeps its queue full.
  return loss_sum.item<double>() / static_cast<double>(targets) + aux_total;
}

double PlainLoop::step(const std::vector<engine::Microbatch>& microbatches,
                       std::map<std::string, at::Tensor>* grads, std::int64_t step_no,
                       std::uint64_t seed) {
  State& s = *state_;
  s.adamw->zero_grad();
  double loss = forward_backward(microbatches, step_no, seed);
  if (grads)
    for (auto& [name, p] : s.params)
      if (p.grad().defined()) (*grads)[name] = p.grad().clone();
  if (s.max_norm > 0) torch::nn::utils::clip_grad_norm_(s.order, s.max_norm);
  s.adamw->step();
  return loss;
}

double PlainLoop::stale_step(const std::vector<engine::Microbatch>& microbatches,
                             std::map<std::string, at::Tensor>* grads, std::int64_t step_no) {
  State& s = *state_;
  at::NoGradGuard no_grad_copy;
  std::vector<at::Tensor> theta;
  for (const at::Tensor& p : s.order)
    theta.push_back(p.detach().clone());
  if (s.stale.empty()) s.stale = theta;
  for (std::size_t i = 0; i < s.order.size(); ++i)
    s.order[i].detach().copy_(s.stale[i]);
  s.adamw->zero_grad();
  double loss;
  {
    at::AutoGradMode grad(true);
    loss = forward_backward(microbatches, step_no, 0);
  }
  for (std::size_t i = 0; i < s.order.size(); ++i)
    s.order[i].detach().copy_(theta[i]);
  if (grads)
    for (auto& [name, p] : s.params)
      if (p.grad().defined()) (*grads)[name] = p.grad().clone();
  if (s.max_norm > 0) torch::nn::utils::clip_grad_norm_(s.order, s.max_norm);
  s.adamw->step();
  s.stale = theta;  // θ_i: what step i + 1 runs on
  return loss;
}

std::map<std::string, at::Tensor> PlainLoop::gradients(
    const std::vector<engine::Microbatch>& microbatches) {
  State& s = *state_;
  s.adamw->zero_grad();
  forward_backward(microbatches, 1, 0);
  std::map<std::string, at::Tensor> out;
  for (auto& [name, p] : s.params)
    if (p.grad().defined()) out[name] = p.grad().clone();
  s.adamw->zero_grad();
  return out;
}

at::Tensor PlainLoop::param(const std::string& name) const {
  return state_->params.at(name).detach();
}

models::ModelConfig tiny_llama(int layers, int scale) {
  const int C = 16 * scale;
  return models::parse_hf_config(
      R"({"architectures":["LlamaForCausalLM"],"vocab_size":)" + std::to_string(37 * scale) +
          R"(,"hidden_size":)" + std::to_string(C) + R"(,"intermediate_size":)" +
          std::to_string(40 * scale) + R"(,"num_hidden_layers":)" + std::to_string(layers) +
          R"(,"num_attention_heads":4,"num_key_value_heads":2,"tie_word_embeddings":false,
          "rms_norm_eps":1e-5,"rope_theta":10000})",
      "tiny llama");
}

models::ModelConfig tiny_qwen2(int layers, int scale) {
  return models::parse_hf_config(
      R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":)" + std::to_string(29 * scale) +
          R"(,"hidden_size":)" + std::to_string(16 * scale) + R"(,"intermediate_size":)" +
          std::to_string(24 * scale) + R"(,"num_hidden_layers":)" + std::to_string(layers) +
          R"(,"num_attention_heads":4,"num_key_value_heads":2,"tie_word_embeddings":true,
          "rms_norm_eps":1e-6})",
      "tiny qwen2");
}

models::ModelConfig tiny_qwen3_moe(int layers, int scale) {
  return models::parse_hf_config(
      R"({"architectures":["Qwen3MoeForCausalLM"],"vocab_size":)" + std::to_string(31 * scale) +
          R"(,"hidden_size":)" + std::to_string(16 * scale) + R"(,"intermediate_size":)" +
          std::to_string(24 * scale) + R"(,"moe_intermediate_size":)" + std::to_string(12 * scale) +
          R"(,"num_hidden_layers":)" + std::to_string(layers) +
          R"(,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
          "num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],
          "output_router_logits":true,"router_aux_loss_coef":0.05,"rms_norm_eps":1e-6})",
      "tiny qwen3-moe");
}

models::ModelConfig tiny_gpt_oss(int layers, int scale) {
  return models::parse_hf_config(
      R"({"architectures":["GptOssForCausalLM"],"vocab_size":)" + std::to_string(33 * scale) +
          R"(,"hidden_size":)" + std::to_string(16 * scale) + R"(,"intermediate_size":)" +
          std::to_string(12 * scale) + R"(,"num_hidden_layers":)" + std::to_string(layers) +
          R"(,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,
          "num_local_experts":4,"num_experts_per_tok":2,"sliding_window":3,"swiglu_limit":1.0,
          "output_router_logits":true,"router_aux_loss_coef":0.05,"rms_norm_eps":1e-5,
          "rope_parameters":{"rope_type":"yarn","factor":4.0,"beta_fast":32.0,"beta_slow":1.0,
          "truncate":false,"original_max_position_embeddings":64,"rope_theta":150000.0}})",
      "tiny gpt-oss");
}

std::map<std::string, at::Tensor> random_weights(const models::ModelConfig& config) {
  std::map<std::string, at::Tensor> w;
  for (const models::LayerSpec& l : models::layer_specs(config))
    for (const models::ParamSpec& p : l.params) {
      if (w.count(p.name)) continue;
      w[p.name] = p.shape.size() == 1 ? 1 + 0.1 * at::randn(p.shape) : 0.2 * at::randn(p.shape);
    }
  return w;
}

std::vector<engine::Microbatch> random_batch(const models::ModelConfig& config, int rows, int seq,
                                             int m) {
  at::Tensor tokens = at::randint(0, config.vocab_size, {rows, seq}, at::kLong);
  // Two documents per row, split at a random point.
  at::Tensor docs = at::zeros({rows, seq}, at::kLong);
  for (int r = 0; r < rows; ++r) {
    const std::int64_t cut = at::randint(1, seq, {1}, at::kLong).item<std::int64_t>();
    docs[r].narrow(0, cut, seq - cut).fill_(1);
  }
  models::TokenBatch batch{tokens, docs};
  engine::Microbatch all{batch, models::next_token_targets(batch)};
  // Some positions without loss (a prompt), as chat data has.
  all.targets.narrow(1, 0, 1).fill_(-100);
  return resplit({all}, m);
}

std::vector<engine::Microbatch> resplit(const std::vector<engine::Microbatch>& batch, int m) {
  std::vector<at::Tensor> tok, docs, tgt;
  for (const engine::Microbatch& b : batch) {
    tok.push_back(b.batch.tokens);
    docs.push_back(b.batch.doc_ids);
    tgt.push_back(b.targets);
  }
  at::Tensor t = at::cat(tok), d = at::cat(docs), y = at::cat(tgt);
  const std::int64_t rows = t.size(0);
  std::vector<engine::Microbatch> out;
  for (int i = 0; i < m; ++i) {
    const std::int64_t begin = rows * i / m, end = rows * (i + 1) / m;
    out.push_back({{t.narrow(0, begin, end - begin).contiguous(),
                    d.narrow(0, begin, end - begin).contiguous()},
                   y.narrow(0, begin, end - begin).contiguous()});
  }
  return out;
}

}  // namespace rondo::test
