#include "models/layers.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "kernels/error.h"
#include "models/attention_masks.h"

namespace rondo::models {

const char* to_string(LayerKind kind) {
  switch (kind) {
    case LayerKind::kPrefix:
      return "prefix";
    case LayerKind::kBlock:
      return "block";
    case LayerKind::kHead:
      return "head";
  }
  return "?";
}

std::int64_t ParamSpec::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape)
    n *= d;
  return n;
}

std::int64_t LayerSpec::param_count() const {
  std::int64_t n = 0;
  for (const ParamSpec& p : params)
    if (!p.tied) n += p.numel();
  return n;
}

namespace {
// A sparse block's per-expert parameter (weights and biases; not the router's).
bool is_expert_param(const ParamSpec& p) {
  return p.name.find(".experts.") != std::string::npos;
}
}  // namespace

double LayerSpec::active_param_count() const {
  double n = 0, experts = 0;
  for (const ParamSpec& p : params)
    if (!p.tied) (is_expert_param(p) ? experts : n) += static_cast<double>(p.numel());
  if (config.num_experts > 0)
    n += experts * static_cast<double>(config.experts_per_token) /
         static_cast<double>(config.num_experts);
  return n;
}

double LayerSpec::flops_forward_per_token(std::int64_t seq_len) const {
  const ModelConfig& c = config;
  switch (kind) {
    case LayerKind::kPrefix:
      return 0;  // a gather
    case LayerKind::kHead:
      return 2.0 * static_cast<double>(c.vocab_size) * c.hidden_size;
    case LayerKind::kBlock: {
      // A sparse block computes only the routed share of its experts: experts_per_token of them
      // per token.
      double matmul = 0, experts = 0;
      for (const ParamSpec& p : params)
        if (is_expert_param(p))
          experts += 2.0 * p.numel();  // biases too: a token pays for its experts' adds
        else if (p.shape.size() == 2)
          matmul += 2.0 * p.numel();
      if (c.num_experts > 0)
        matmul +=
            experts * static_cast<double>(c.experts_per_token) / static_cast<double>(c.num_experts);
      // Scores and the weighted sum: 2 * 2 * H * D multiply-adds per key, seq_len / 2 keys.
      double attention = 4.0 * c.num_heads * c.head_dim * (static_cast<double>(seq_len) / 2.0);
      return matmul + attention;
    }
  }
  return 0;
}

double LayerSpec::flops_backward_per_token(std::int64_t seq_len) const {
  return 2.0 * flops_forward_per_token(seq_len);
}

std::uint64_t LayerSpec::activation_bytes_per_token(std::size_t act_bytes,
                                                    std::int64_t seq_len) const {
  const ModelConfig& c = config;
  const auto T = static_cast<std::uint64_t>(std::max<std::int64_t>(seq_len, 0));
  std::uint64_t values = 0;
  switch (kind) {
    case LayerKind::kPrefix:
      // The embedding's output. (The attention masks are the planner's per job, where they are
      // built: PlanInputs::mask_bytes_per_token.)
      values = c.hidden_size;
      break;

    case LayerKind::kHead:
      // Normed input, plus one chunk of fp32 logits is transient, not per token.
      values = 2 * c.hidden_size;
      break;
    case LayerKind::kBlock:
      // x, normed x (twice), q k v (rotated copies too), attention output, o output, gate, up,
      // silu(gate), their product.
      values = 4 * c.hidden_size + 2 * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim +
               c.num_heads * c.head_dim;
      // A sparse block: router logits and probabilities, and per routed copy of a token its
      // gathered input, the four MLP intermediates and the weighted output.
      values += c.num_heads * T;  // attention probabilities, kept for the backward
      values += c.sparse(block)
                    ? 2 * c.num_experts +
                          c.experts_per_token * (2 * c.hidden_size + 4 * c.moe_intermediate_size)
                    : 4 * c.intermediate_size;
      break;
  }
  return values * act_bytes;
}

std::vector<LayerSpec> layer_specs(const ModelConfig& c) {
  const std::int64_t C = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim,
                     I = c.intermediate_size, V = c.vocab_size;
  std::vector<LayerSpec> specs;
  LayerSpec prefix;
  prefix.kind = LayerKind::kPrefix;
  prefix.config = c;
  prefix.params.push_back({"model.embed_tokens.weight", {V, C}});
  specs.push_back(prefix);
  for (std::int64_t b = 0; b < c.num_layers; ++b) {
    LayerSpec s;
    s.kind = LayerKind::kBlock;
    s.block = static_cast<int>(b);
    s.config = c;
    std::string p = "model.layers." + std::to_string(b) + ".";
    auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
      s.params.push_back({p + name, std::move(shape)});
    };
    add("input_layernorm.weight", {C});
    add("self_attn.q_proj.weight", {H * D, C});
    if (c.attention_bias) add("self_attn.q_proj.bias", {H * D});
    add("self_attn.k_proj.weight", {KV * D, C});
    if (c.attention_bias) add("self_attn.k_proj.bias", {KV * D});
    add("self_attn.v_proj.weight", {KV * D, C});
    if (c.attention_bias) add("self_attn.v_proj.bias", {KV * D});
    add("self_attn.o_proj.weight", {C, H * D});
    if (c.attention_out_bias) add("self_attn.o_proj.bias", {C});
    if (c.qk_norm) {
      add("self_attn.q_norm.weight", {D});
      add("self_attn.k_norm.weight", {D});
    }
    if (c.attention_sinks) add("self_attn.sinks", {H});
    add("post_attention_layernorm.weight", {C});
    if (c.sparse(b) && c.family == Family::kGptOss) {
      // GPT-OSS stores its experts fused, x @ W layout, gate and up interleaved, with biases.
      const std::int64_t E = c.num_experts, F = c.moe_intermediate_size;
      add("mlp.router.weight", {E, C});
      add("mlp.router.bias", {E});
      add("mlp.experts.gate_up_proj", {E, C, 2 * F});
      add("mlp.experts.gate_up_proj_bias", {E, 2 * F});
      add("mlp.experts.down_proj", {E, F, C});
      add("mlp.experts.down_proj_bias", {E, C});
      specs.push_back(std::move(s));
      continue;
    }
    if (c.sparse(b)) {
      // As the checkpoints store them: one module per expert.
      const std::int64_t E = c.num_experts, F = c.moe_intermediate_size;
      const bool mixtral = c.family == Family::kMixtral;
      const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
      add(moe + "gate.weight", {E, C});
      for (std::int64_t e = 0; e < E; ++e) {
        const std::string x = moe + "experts." + std::to_string(e) + ".";
        add(x + (mixtral ? "w1" : "gate_proj") + ".weight", {F, C});
        add(x + (mixtral ? "w3" : "up_proj") + ".weight", {F, C});
        add(x + (mixtral ? "w2" : "down_proj") + ".weight", {C, F});
      }
      specs.push_back(std::move(s));
      continue;
    }
    add("mlp.gate_proj.weight", {I, C});
    if (c.mlp_bias) add("mlp.gate_proj.bias", {I});
    add("mlp.up_proj.weight", {I, C});
    if (c.mlp_bias) add("mlp.up_proj.bias", {I});
    add("mlp.down_proj.weight", {C, I});
    if (c.mlp_bias) add("mlp.down_proj.bias", {C});
    specs.push_back(std::move(s));
  }
  LayerSpec head;
  head.kind = LayerKind::kHead;
  head.config = c;
  head.params.push_back({"model.norm.weight", {C}});
  if (c.tie_word_embeddings)
    head.params.push_back({"model.embed_tokens.weight", {V, C}, true});
  else
    head.params.push_back({"lm_head.weight", {V, C}});
  specs.push_back(head);
  return specs;
}

namespace {

// Rotary inverse frequencies, in fp32 as transformers computes them (so that logits agree to
// fp32 rounding, not just to the mathematically exact value). `seq_len`: 1 + the largest position
// of the batch, which dynamic (NTK) scaling grows the base with past max_position_embeddings
// (within it, as in every training row Rondo makes, dynamic is the default rope).
at::Tensor inverse_frequencies(const ModelConfig& c, std::int64_t seq_len) {
  const std::int64_t D = c.head_dim;
  at::Tensor exponent = at::arange(0, D, 2, at::kLong).to(at::kFloat) / static_cast<double>(D);
  at::Tensor pos_freqs = at::pow(at::scalar_tensor(c.rope.theta, at::kFloat), exponent);
  if (c.rope.type == "dynamic" && seq_len > c.max_position_embeddings) {
    // transformers computes the grown base in fp32 tensors (seq_len is one there).
    const double factor = c.rope.factor;
    at::Tensor s = at::scalar_tensor(seq_len, at::kLong);
    at::Tensor base =
        at::pow(s * factor / static_cast<double>(c.max_position_embeddings) - (factor - 1),
                static_cast<double>(D) / static_cast<double>(D - 2)) *
        c.rope.theta;
    pos_freqs = at::pow(base, exponent);
  }
  at::Tensor inv = 1.0 / pos_freqs;
  if (c.rope.type == "linear") inv = inv / c.rope.factor;
  if (c.rope.type == "yarn") {
    // The dimensions whose wavelengths fit the pretraining context many times keep their
    // frequency (extrapolation); the slow ones are divided by factor (interpolation); a linear
    // ramp between, its ends found from beta_fast and beta_slow rotations.
    const double theta = c.rope.theta,
                 orig = static_cast<double>(c.rope.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return (static_cast<double>(D) * std::log(orig / (rotations * 2 * M_PI))) /
             (2 * std::log(theta));
    };
    double low = correction_dim(c.rope.beta_fast), high = correction_dim(c.rope.beta_slow);
    if (c.rope.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(D - 1));
    if (low == high) high += 0.001;  // as transformers: no singular ramp
    at::Tensor ramp = at::clamp((at::arange(D / 2, at::kFloat) - low) / (high - low), 0, 1);
    at::Tensor extrapolation = 1 - ramp;
    at::Tensor interpolated = 1.0 / (c.rope.factor * pos_freqs);
    inv = interpolated * (1 - extrapolation) + inv * extrapolation;
  }
  if (c.rope.type == "llama3") {
    const double factor = c.rope.factor, low = c.rope.low_freq_factor,
                 high = c.rope.high_freq_factor;
    const double old_len = static_cast<double>(c.rope.original_max_position_embeddings);
    const double low_wavelen = old_len / low, high_wavelen = old_len / high;
    at::Tensor wavelen = 2.0 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / factor, inv);
    at::Tensor smooth = (old_len / wavelen - low) / (high - low);
    at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    at::Tensor medium =
        at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

// cos and sin of the angles (B, T, D/2), as (B, 1, T, D) in `dtype`; yarn scales both by its
// attention factor first, in fp32, as transformers does.
void set_cos_sin(const ModelConfig& c, const at::Tensor& freqs, at::ScalarType dtype,
                 AttentionContext& ctx) {
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (c.rope.attention_factor != 1.0) {
    cos = cos * c.rope.attention_factor;
    sin = sin * c.rope.attention_factor;
  }
  ctx.cos = cos.to(dtype).unsqueeze(1);
  ctx.sin = sin.to(dtype).unsqueeze(1);
}

at::Tensor rotate_half(const at::Tensor& x) {
  const std::int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

std::int64_t mix_seed(std::int64_t seed, std::int64_t a, std::int64_t b) {
  std::uint64_t z = static_cast<std::uint64_t>(seed) * 1000003u + static_cast<std::uint64_t>(a);
  z = z * 1000003u + static_cast<std::uint64_t>(b);
  return static_cast<std::int64_t>(z >> 1);
}

// A projection of a block, with its LoRA adapter when it has one (as PEFT computes it).
at::Tensor project(const BlockWeights& w, BlockWeights::Projection p, const at::Tensor& x,
                   const at::Tensor& weight, const at::Tensor& bias, const AttentionContext& ctx) {
  at::Tensor y = linear(x, weight, bias);
  if (!w.lora_a[p].defined()) return y;
  at::Tensor in = x;
  if (w.lora_dropout > 0 && ctx.dropout_seed >= 0)
    in = seeded_dropout(x, w.lora_dropout, mix_seed(ctx.dropout_seed, w.block, 16 + p));
  return y + at::linear(at::linear(in, w.lora_a[p]), w.lora_b[p]) * w.lora_scaling;
}

}  // namespace

at::Tensor packed_doc_ids(const TokenBatch& batch) {
  if (!batch.doc_ids.defined()) return {};
  if (batch.doc_ids.sizes() != batch.tokens.sizes())
    throw Error("doc_ids must have the tokens' shape");
  at::Tensor docs = batch.doc_ids.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t B = docs.size(0), T = docs.size(1);
  const std::int64_t* d = docs.data_ptr<std::int64_t>();
  bool packed = false;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 1; t < T; ++t) {
      const std::int64_t i = b * T + t;
      if (d[i] == d[i - 1]) continue;
      packed = true;
      for (std::int64_t u = 0; u < t; ++u)
        if (d[b * T + u] == d[i])
          throw Error("doc_ids: document " + std::to_string(d[i]) + " of row " + std::to_string(b) +
                      " is not contiguous");
    }
  // A mask only where some row holds more than one document: with one per row it would be the
  // plain causal one, and it would keep attention off the fused kernels.
  return packed ? docs : at::Tensor();
}

DocSpans doc_spans(const at::Tensor& docs) {
  DocSpans s;
  if (!docs.defined()) return s;
  RONDO_ASSERT(docs.device().is_cpu() && docs.scalar_type() == at::kLong && docs.dim() == 2);
  const at::Tensor d = docs.contiguous();
  const std::int64_t B = d.size(0), T = d.size(1);
  const std::int64_t* id = d.data_ptr<std::int64_t>();
  s.offsets.push_back(0);
  for (std::int64_t i = 1; i <= B * T; ++i)
    if (i == B * T || i % T == 0 || id[i] != id[i - 1]) {
      s.max_len = std::max(s.max_len, i - s.offsets.back());
      s.offsets.push_back(i);
    }
  return s;
}

at::Tensor DocSpans::offsets_tensor() const {
  std::vector<std::int32_t> o(offsets.begin(), offsets.end());
  RONDO_ASSERT(offsets.empty() || offsets.back() <= std::numeric_limits<std::int32_t>::max());
  return at::tensor(o, at::TensorOptions().dtype(at::kInt));
}

namespace {

// Variable-length flash attention: q (N, H, D), k and v (N, KV, D) over the documents at
// `offsets` (int32, on the device), causal within each, keys at most window - 1 back (0 = no
// window). Differentiable (torch's FlashAttentionBackward0).
at::Tensor flash_per_document(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& offsets, std::int64_t max_len, double scale,
                              std::int64_t window) {
  std::optional<std::int64_t> left, right;
  if (window > 0) {
    left = window - 1;
    right = 0;
  }
  return std::get<0>(at::_flash_attention_forward(q, k, v, offsets, offsets, max_len, max_len, 0.0,
                                                  /*is_causal=*/true, /*return_debug_mask=*/false,
                                                  scale, left, right));
}

// Whether flash_per_document runs on this device for this dtype and head size, forward and
// backward: tried once with two documents (an older GPU, or a torch built without flash attention,
// throws; flash's backward lacks head sizes above 192 outside sm80/sm90, where the forward
// runs, so a training step would throw halfway instead of taking the masked path).
bool flash_per_document_runs(at::Device device, at::ScalarType dtype, std::int64_t D) {
  if (!at::globalContext().userEnabledFlashSDP()) return false;
  static std::mutex mu;
  static std::map<std::tuple<int, int, std::int64_t>, bool> known;
  const auto key = std::tuple{static_cast<int>(device.index()), static_cast<int>(dtype), D};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  bool runs = false;
  try {
    // (Autograd is on even under a caller's InferenceMode, which AutoGradMode alone does not undo.)
    c10::InferenceMode no_inference(false);
    c10::AutoGradMode grad_mode(true);
    const auto opts = at::TensorOptions().dtype(dtype).device(device);
    at::Tensor q = at::ones({3, 2, D}, opts).set_requires_grad(true);
    at::Tensor kv = at::ones({3, 1, D}, opts).set_requires_grad(true);
    at::Tensor offsets = at::tensor(std::vector<std::int32_t>{0, 1, 3}, at::kInt).to(device);
    const at::Tensor out = flash_per_document(q, kv, kv, offsets, 2, 1.0, 0);
    const auto grads = torch::autograd::grad({out.sum()}, {q, kv});
    runs = out.isfinite().all().item<bool>() && grads[0].isfinite().all().item<bool>() &&
           grads[1].isfinite().all().item<bool>();
  } catch (const std::exception&) {
    runs = false;
  }
  known[key] = runs;
  return runs;
}

}  // namespace

bool flash_may_attend_per_document(const ModelConfig& c, at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && c.head_dim % 8 == 0 &&
         c.head_dim <= 256 && c.attention_dropout == 0 && !c.attention_sinks;
}

bool attend_per_document(const ModelConfig& c, const DocSpans& spans, at::Device device,
                         at::ScalarType dtype) {
  if (spans.offsets.size() < 2 || c.attention_dropout > 0 || c.attention_sinks) return false;
  if (device.is_cuda())
    return flash_may_attend_per_document(c, dtype) &&
           flash_per_document_runs(device, dtype, c.head_dim);
  if (!device.is_cpu()) return false;
  const auto docs = static_cast<std::int64_t>(spans.offsets.size()) - 1;
  return docs * 32 <= spans.offsets.back() &&
         (c.sliding_window == 0 || spans.max_len <= c.sliding_window);
}

void limit_attention(AttentionContext& ctx, const ModelConfig& c, const at::Tensor& docs,
                     const DocSpans& spans, at::Device device, at::ScalarType dtype,
                     const at::Tensor& offsets_on_device) {
  const std::int64_t B = ctx.positions.size(0), T = ctx.positions.size(1);
  if (docs.defined() && attend_per_document(c, spans, device, dtype)) {
    ctx.doc_offsets = spans.offsets;
    ctx.max_doc_len = spans.max_len;
    if (device.is_cuda())
      ctx.doc_offsets_dev =
          offsets_on_device.defined() ? offsets_on_device : spans.offsets_tensor().to(device);
    return;
  }
  const at::TensorOptions bools = at::TensorOptions().dtype(at::kBool).device(device);
  if (docs.defined()) {
    at::Tensor same = docs.unsqueeze(2).eq(docs.unsqueeze(1));  // (B, T, T)
    at::Tensor causal = at::ones({T, T}, bools).tril();
    ctx.mask = (same & causal).unsqueeze(1);
  }
  if (c.sliding_window > 0 && T > c.sliding_window) {
    // Keys more than sliding_window - 1 positions back are out of reach: in every layer
    // (Mistral), or in the windowed ones only (Qwen's per-layer windows).
    // Query i sees keys i - window + 1 ..= i: the band of the lower triangle (bools only; an
    // int64 (T, T) difference would take 8 times the mask's memory).
    at::Tensor window = at::ones({T, T}, bools).tril().triu(1 - c.sliding_window);
    at::Tensor base =
        ctx.mask.defined() ? ctx.mask : window.unsqueeze(0).unsqueeze(0).expand({B, 1, T, T});
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = base & window;
  }
}

AttentionContext make_attention_context(const ModelConfig& c, const TokenBatch& batch,
                                        at::ScalarType dtype) {
  AttentionContext ctx = attention_context_without_masks(c, batch, dtype);
  const at::Tensor docs = packed_doc_ids(batch);
  const at::Device device = batch.tokens.device();
  limit_attention(ctx, c, docs.defined() ? docs.to(device) : docs, doc_spans(docs), device, dtype);
  return ctx;
}

AttentionContext attention_context_without_masks(const ModelConfig& c, const TokenBatch& batch,
                                                 at::ScalarType dtype) {
  const at::Tensor& tokens = batch.tokens;
  if (tokens.dim() != 2) throw Error("token batch must be (B, T)");
  const std::int64_t B = tokens.size(0), T = tokens.size(1);
  AttentionContext ctx;
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(tokens.device());
  if (batch.doc_ids.defined()) {
    // (packed_doc_ids checks that each document is contiguous; positions need only the shape.)
    if (batch.doc_ids.sizes() != tokens.sizes()) throw Error("doc_ids must have the tokens' shape");
    const at::Tensor all = batch.doc_ids.to(at::kCPU, at::kLong).contiguous();
    at::Tensor pos = at::empty({B, T}, at::kLong);
    const std::int64_t* d = all.data_ptr<std::int64_t>();
    std::int64_t* p = pos.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < B * T; ++i)
      p[i] = (i % T > 0 && d[i] == d[i - 1]) ? p[i - 1] + 1 : 0;
    ctx.positions = pos.to(tokens.device());
  } else {
    ctx.positions = at::arange(T, longs).unsqueeze(0).expand({B, T});
  }
  // Only dynamic rope needs the longest position (a host sync).
  const std::int64_t seq_len =
      c.rope.type == "dynamic" ? ctx.positions.max().item<std::int64_t>() + 1 : 0;
  at::Tensor inv = inverse_frequencies(c, seq_len).to(tokens.device());
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) * inv;  // (B, T, D/2)
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

AttentionContext make_decode_context(const ModelConfig& c, std::int64_t offset, std::int64_t count,
                                     at::ScalarType dtype, at::Device device) {
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  AttentionContext ctx;
  ctx.positions = at::arange(offset, offset + count, longs).unsqueeze(0);
  at::Tensor i = ctx.positions.squeeze(0).unsqueeze(1);           // query positions
  at::Tensor j = at::arange(offset + count, longs).unsqueeze(0);  // key positions
  const at::Tensor causal = j <= i;
  if (count > 1) ctx.mask = causal.unsqueeze(0).unsqueeze(0);  // (1, 1, count, offset + count)
  if (c.sliding_window > 0 && offset + count > c.sliding_window) {
    const at::Tensor windowed = (causal & ((i - j) < c.sliding_window)).unsqueeze(0).unsqueeze(0);
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = windowed;
  }
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) *
                     inverse_frequencies(c, offset + count).to(device);
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

AttentionContext make_decode_context(const ModelConfig& c, std::int64_t offset, std::int64_t count,
                                     at::ScalarType dtype, at::Device device,
                                     const std::vector<std::int64_t>& left_pad) {
  RONDO_ASSERT(!left_pad.empty());
  at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  const auto B = static_cast<std::int64_t>(left_pad.size());
  at::Tensor pad = at::tensor(left_pad, at::kLong).to(device).view({B, 1, 1});
  at::Tensor i = at::arange(offset, offset + count, longs).view({1, count, 1});   // query slots
  at::Tensor j = at::arange(offset + count, longs).view({1, 1, offset + count});  // key slots
  AttentionContext ctx;
  ctx.positions = (i.squeeze(-1) - pad.squeeze(-1)).clamp_min(0);  // (B, count)
  const at::Tensor real_key = (j >= pad) & (j <= i);
  const at::Tensor allowed = real_key | (j == i);  // (B, count, keys)
  ctx.mask = allowed.unsqueeze(1);
  if (c.sliding_window > 0 && offset + count > c.sliding_window) {
    const at::Tensor windowed = ((real_key & ((i - j) < c.sliding_window)) | (j == i)).unsqueeze(1);
    (c.sliding_layers.empty() ? ctx.mask : ctx.window_mask) = windowed;
  }
  at::Tensor freqs = ctx.positions.to(at::kFloat).unsqueeze(-1) *
                     inverse_frequencies(c, offset + count).to(device);
  set_cos_sin(c, freqs, dtype, ctx);
  return ctx;
}

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

namespace {
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

at::Tensor rms_norm(const ModelConfig& c, const at::Tensor& x, const at::Tensor& weight) {
  at::Tensor h = x.to(at::promote_types(x.scalar_type(), at::kFloat));  // f64 stays f64
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + c.rms_norm_eps);
  if (c.family == Family::kGptOss) return (weight * h).to(x.scalar_type());
  return weight * h.to(x.scalar_type());
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

at::Tensor seeded_dropout(const at::Tensor& x, double p, std::int64_t seed) {
  if (p <= 0) return x;
  const std::int64_t m32 = 0xffffffffLL;
  at::Tensor idx = at::arange(x.numel(), x.options().dtype(at::kLong)).view(x.sizes());
  const std::int64_t s_lo = seed & m32, s_hi = (seed >> 32) & m32;
  at::Tensor h = hash32(idx.bitwise_right_shift(32).bitwise_xor(s_hi));
  h = hash32(h.bitwise_xor(idx.bitwise_and(m32)).bitwise_xor(s_lo));
  h = hash32(h.bitwise_xor(s_lo));
  at::Tensor keep = h.ge(static_cast<std::int64_t>(p * 4294967296.0));
  return x * keep.to(x.scalar_type()) * (1.0 / (1.0 - p));
}

namespace {

// A sparse block's MLP as transformers computes it: router softmax (fp32) and top-k (renormalised
// when norm_topk_prob), then each expert's SwiGLU on the tokens routed to it, weighted and added
// back per token (index_add). Tokens are sorted by expert once; the per-expert counts that split
// them are host values, taken from the routing record in a recompute (the forward recorded them)
// rather than synced again.
at::Tensor moe_mlp(const ModelConfig& c, const BlockWeights& w, const at::Tensor& h,
                   const AttentionContext& ctx) {
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
    if (it != ctx.routing->blocks.end() && it->second.tokens == N) counts = it->second.counts;
  }
  if (counts.empty()) {  // the one host sync of the block
    const at::Tensor bins = at::bincount(flat, {}, E).to(at::kCPU);
    counts.assign(bins.data_ptr<std::int64_t>(), bins.data_ptr<std::int64_t>() + E);
  }
  if (ctx.routing && ctx.record_routing) {
    BlockRouting r{.counts = counts, .prob_sums = probs.sum(0).detach(), .tokens = N};
    std::lock_guard<std::mutex> lock(ctx.routing->mu);
    ctx.routing->blocks[w.block] = std::move(r);
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

}  // namespace

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

namespace {

// Attention per document of packed rows (AttentionContext::doc_offsets), causal within each:
// q (B, H, T, D), k and v (B, KV, T, D); returns (B, H, T, D). On CUDA one variable-length flash
// attention over the flattened rows (the layer's window, if any, applied by the kernel); on the
// CPU one fused causal attention per document (no window cuts into one: attend_per_document).
at::Tensor attend_documents(const ModelConfig& c, std::int64_t block, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const AttentionContext& ctx) {
  const std::int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), KV = k.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  if (q.is_cuda()) {
    auto flat = [&](const at::Tensor& t) {
      return t.transpose(1, 2).reshape({B * T, t.size(1), D});
    };
    return flash_per_document(flat(q), flat(k), flat(v), ctx.doc_offsets_dev, ctx.max_doc_len,
                              scale, c.windowed(block) ? c.sliding_window : 0)
        .view({B, T, H, D})
        .transpose(1, 2);
  }
  // The rows flattened, (1, heads, B * T, D), and split into the documents: the backward of a split
  // is one concatenation, where slicing each document out of the whole tensor gave every document
  // a zero-filled gradient of the whole size to add up (on SmolLM2's packed chats, a fifth of the
  // CPU step).
  std::vector<std::int64_t> lengths;
  for (std::size_t d = 0; d + 1 < ctx.doc_offsets.size(); ++d)
    lengths.push_back(ctx.doc_offsets[d + 1] - ctx.doc_offsets[d]);
  auto documents = [&](const at::Tensor& x) {
    return at::split_with_sizes(x.transpose(0, 1).reshape({1, x.size(1), B * T, D}), lengths, 2);
  };
  const std::vector<at::Tensor> qs = documents(q), ks = documents(k), vs = documents(v);
  std::vector<at::Tensor> parts;
  for (std::size_t d = 0; d < lengths.size(); ++d)
    parts.push_back(at::scaled_dot_product_attention(qs[d], ks[d], vs[d], {}, 0.0,
                                                     /*is_causal=*/true, scale,
                                                     /*enable_gqa=*/H != KV));
  // (1, H, B * T, D) in row order, as (B, H, T, D).
  return at::cat(parts, 2).view({H, B, T, D}).transpose(0, 1);
}

}  // namespace

at::Tensor embed(const at::Tensor& embed_weight, const at::Tensor& tokens) {
  return at::embedding(embed_weight, tokens);
}

at::Tensor block_forward(const ModelConfig& c, const BlockWeights& w, const at::Tensor& x,
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
  q = q * ctx.cos + rotate_half(q) * ctx.sin;
  k = k * ctx.cos + rotate_half(k) * ctx.sin;
  // This layer's mask: the windowed one where the layer has a window of its own.
  const at::Tensor& layer_mask =
      ctx.window_mask.defined() && c.windowed(w.block) ? ctx.window_mask : ctx.mask;
  bool causal = !layer_mask.defined();
  if (cache != nullptr) {
    if (cache->k.defined()) {
      k = at::cat({cache->k, k}, 2);
      v = at::cat({cache->v, v}, 2);
    }
    cache->k = k;
    cache->v = v;
    // New tokens see every cached one: the mask (from make_decode_context) says so; one new
    // token needs none.
    causal = false;
  }
  std::optional<at::Tensor> mask;
  if (layer_mask.defined()) mask = layer_mask;
  at::Tensor a;
  const bool dropout = c.attention_dropout > 0 && ctx.dropout_seed >= 0;
  if (!ctx.doc_offsets.empty()) {
    RONDO_ASSERT_MSG(cache == nullptr && !dropout && !w.sinks.defined(),
                     "attention per document is for training and evaluation without dropout or "
                     "sinks (attend_per_document)");
    a = attend_documents(c, w.block, q, k, v, ctx);
  } else if (dropout || w.sinks.defined()) {
    // The plain path, as transformers' eager attention: in training with attention dropout
    // (the fused kernels draw from a generator whose state a recompute could not replay), and
    // with GPT-OSS's sinks (a learned logit per head joins each row's softmax, its share dropped).
    RONDO_ASSERT_MSG(!dropout || cache == nullptr,
                     "attention dropout is for training, not generation");
    at::Tensor kk = H != KV ? k.repeat_interleave(H / KV, 1) : k;
    at::Tensor vv = H != KV ? v.repeat_interleave(H / KV, 1) : v;
    at::Tensor s = at::matmul(q, kk.transpose(-2, -1)) / std::sqrt(static_cast<double>(D));
    const std::int64_t keys = s.size(-1);
    if (mask || cache == nullptr) {  // one cached token's query sees every key: nothing to mask
      at::Tensor allowed =
          mask ? *mask
               : at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).tril();
      s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    }
    if (w.sinks.defined())
      s = at::cat({s, w.sinks.to(s.scalar_type()).view({1, H, 1, 1}).expand({B, H, T, 1})}, -1);
    at::Tensor p = at::softmax(s.to(at::promote_types(s.scalar_type(), at::kFloat)), -1)
                       .narrow(-1, 0, keys)
                       .to(q.scalar_type());
    if (dropout)
      p = seeded_dropout(
          p, c.attention_dropout,
          static_cast<std::int64_t>(static_cast<std::uint64_t>(ctx.dropout_seed) * 1000003u +
                                    static_cast<std::uint64_t>(w.block)));
    a = at::matmul(p, vv);
  } else {
    const bool expand =
        H != KV && mask.has_value() && ctx.expand_kv_heads.value_or(q.device().is_cuda());
    if (expand) {
      k = k.repeat_interleave(H / KV, 1);
      v = v.repeat_interleave(H / KV, 1);
    }
    a = at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal,
                                         1.0 / std::sqrt(static_cast<double>(D)),
                                         /*enable_gqa=*/H != KV && !expand);
  }
  a = a.transpose(1, 2).reshape({B, T, H * D});
  at::Tensor out = x + project(w, BlockWeights::kO, a, w.o, w.o_bias, ctx);
  h = rms_norm(c, out, w.post_norm);
  if (w.router.defined()) return out + moe_mlp(c, w, h, ctx);
  at::Tensor gated = at::silu(project(w, BlockWeights::kGate, h, w.gate, w.gate_bias, ctx)) *
                     project(w, BlockWeights::kUp, h, w.up, w.up_bias, ctx);
  at::Tensor m = project(w, BlockWeights::kDown, gated, w.down, w.down_bias, ctx);
  return out + m;
}

at::Tensor head_logits(const ModelConfig& c, const at::Tensor& norm_weight,
                       const at::Tensor& lm_head_weight, const at::Tensor& x) {
  at::Tensor h = rms_norm(c, x, norm_weight);
  return at::linear(h, lm_head_weight).to(at::kFloat);
}

at::Tensor head_loss_sum(const ModelConfig& c, const at::Tensor& norm_weight,
                         const at::Tensor& lm_head_weight, const at::Tensor& x,
                         const at::Tensor& targets, std::int64_t chunk_tokens) {
  RONDO_ASSERT(chunk_tokens > 0);
  at::Tensor h = rms_norm(c, x, norm_weight).reshape({-1, x.size(-1)});
  at::Tensor t = targets.reshape({-1}).to(at::kLong);
  const std::int64_t N = h.size(0);
  at::Tensor total = at::zeros({}, h.options().dtype(at::kFloat));
  for (std::int64_t start = 0; start < N; start += chunk_tokens) {
    const std::int64_t n = std::min(chunk_tokens, N - start);
    at::Tensor logits = at::linear(h.narrow(0, start, n), lm_head_weight).to(at::kFloat);
    total = total + at::cross_entropy_loss(logits, t.narrow(0, start, n), {}, at::Reduction::Sum,
                                           /*ignore_index=*/-100);
  }
  return total;
}

namespace {

// Runs blocks [first, end) under autograd from `x`, asks `grad_of` for the gradient of their
// output (given the output), backpropagates it, adds the weight gradients; returns the input
// gradient.
at::Tensor forward_and_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                std::size_t first, std::size_t end, const at::Tensor& x,
                                const AttentionContext& ctx,
                                const std::function<at::Tensor(const at::Tensor&)>& grad_of) {
  c10::AutoGradMode grad_mode(true);
  at::Tensor x_leaf = x.detach().requires_grad_(true);
  // Aliases of the weights that carry autograd state: the shared weight tensors stay untouched.
  std::vector<std::vector<at::Tensor>> leaves(end - first);
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
  for (std::size_t b = first; b < end; ++b) {
    const BlockRun& run = blocks[b];
    for (std::size_t i = 0; i < run.weights.size(); ++i) {
      bool trainable = run.grads && i < run.grads->size() && (*run.grads)[i].defined();
      leaves[b - first].push_back(trainable ? run.weights[i].detach().requires_grad_(true)
                                            : run.weights[i].detach());
    }
    h = block_forward(c, BlockWeights::bind(*run.spec, leaves[b - first]), h, run_ctx);
  }
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
  return x_leaf.grad();
}

at::Tensor recompute_and_backward(const ModelConfig& c, const std::vector<BlockRun>& blocks,
                                  std::size_t first, std::size_t end, const at::Tensor& x,
                                  const AttentionContext& ctx, const at::Tensor& grad_out) {
  return forward_and_backward(c, blocks, first, end, x, ctx,
                              [&](const at::Tensor&) { return grad_out; });
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
                                bool want_lm_head_grad, std::int64_t chunk_tokens) {
  RONDO_ASSERT(chunk_tokens > 0);
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
    d.mul_((valid.to(d.scalar_type()) * loss_scale).unsqueeze(1));
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
